"""TE's kernels as ``torch.library`` custom ops, so ``torch.compile`` can trace them.

NOTE: [Custom ops without autograd]
  Each op wraps one method of :class:`~functional_dw.kernels.te.TEKernels` and has a fake
  (meta) implementation that gives the output shapes. None registers an autograd formula:
  autograd stays in the one ``custom_vjp`` bridge (custom ops with ``register_autograd`` do
  not compose with ``torch.func.grad``). Eager calls bypass these ops and call TEKernels
  directly (no dispatcher overhead); :data:`TRACED_TE` is what ``get_kernels`` returns while
  compiling. Splits travel as a host ``int[]`` or a device tensor and are rebuilt per op.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from . import Splits, Weights
from .te import TE

_NS = "functional_dw"


def _splits(x: Tensor, E: int, sizes: Sequence[int] | None, sizes_dev: Tensor | None) -> Splits:
    host = tuple(sizes) if sizes is not None else None
    return Splits(host=host, tensor=sizes_dev, device=x.device, num_tokens=x.shape[0], num_experts=E)


def _weights(ws: list[Tensor]) -> Weights:
    return ws[0] if len(ws) == 1 and ws[0].dim() == 3 else ws


def _num_experts(ws: list[Tensor]) -> int:
    return ws[0].shape[0] if len(ws) == 1 and ws[0].dim() == 3 else len(ws)


def _db(db: Tensor | None, like: Tensor) -> Tensor:
    return like.new_empty(0) if db is None else db


@torch.library.custom_op(f"{_NS}::te_fprop", mutates_args=())
def te_fprop(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    return TE.fprop(x, w, b)


@te_fprop.register_fake
def _(x, w, b):
    return x.new_empty(x.shape[0], w.shape[0])


@torch.library.custom_op(f"{_NS}::te_dgrad", mutates_args=())
def te_dgrad(dy: Tensor, w: Tensor) -> Tensor:
    return TE.dgrad(dy, w)


@te_dgrad.register_fake
def _(dy, w):
    return dy.new_empty(dy.shape[0], w.shape[1])


@torch.library.custom_op(f"{_NS}::te_wgrad", mutates_args=())
def te_wgrad(x: Tensor, dy: Tensor, with_dbias: bool) -> list[Tensor]:
    dw, db = TE.wgrad(x, dy, with_dbias=with_dbias)
    return [dw, _db(db, dy)]


@te_wgrad.register_fake
def _(x, dy, with_dbias):
    return [dy.new_empty(dy.shape[1], x.shape[1]), dy.new_empty(dy.shape[1] if with_dbias else 0)]


@torch.library.custom_op(f"{_NS}::te_wgrad_into", mutates_args=("out",))
def te_wgrad_into(out: Tensor, x: Tensor, dy: Tensor, accumulate: bool, with_dbias: bool) -> Tensor:
    return _db(TE.wgrad(x, dy, out=out, accumulate=accumulate, with_dbias=with_dbias)[1], dy)


@te_wgrad_into.register_fake
def _(out, x, dy, accumulate, with_dbias):
    return dy.new_empty(dy.shape[1] if with_dbias else 0)


@torch.library.custom_op(f"{_NS}::te_grouped_fprop", mutates_args=())
def te_grouped_fprop(x: Tensor, ws: list[Tensor], b: Tensor | None, sizes: list[int] | None,
                     sizes_dev: Tensor | None, grouped: bool) -> Tensor:
    return TE.grouped_fprop(x, _weights(ws), b, _splits(x, _num_experts(ws), sizes, sizes_dev), grouped)


@te_grouped_fprop.register_fake
def _(x, ws, b, sizes, sizes_dev, grouped):
    return x.new_empty(x.shape[0], ws[0].shape[-2])


@torch.library.custom_op(f"{_NS}::te_grouped_dgrad", mutates_args=())
def te_grouped_dgrad(dy: Tensor, ws: list[Tensor], sizes: list[int] | None, sizes_dev: Tensor | None,
                     grouped: bool) -> Tensor:
    return TE.grouped_dgrad(dy, _weights(ws), _splits(dy, _num_experts(ws), sizes, sizes_dev), grouped)


@te_grouped_dgrad.register_fake
def _(dy, ws, sizes, sizes_dev, grouped):
    return dy.new_empty(dy.shape[0], ws[0].shape[-1])


@torch.library.custom_op(f"{_NS}::te_grouped_wgrad", mutates_args=())
def te_grouped_wgrad(x: Tensor, dy: Tensor, E: int, sizes: list[int] | None, sizes_dev: Tensor | None,
                     grouped: bool, with_dbias: bool) -> list[Tensor]:
    dw, db = TE.grouped_wgrad(x, dy, _splits(x, E, sizes, sizes_dev), grouped, with_dbias=with_dbias)
    return [dw, _db(db, dy)]


@te_grouped_wgrad.register_fake
def _(x, dy, E, sizes, sizes_dev, grouped, with_dbias):
    N = dy.shape[1]
    return [dy.new_empty(E, N, x.shape[1]), dy.new_empty((E, N) if with_dbias else (0,))]


@torch.library.custom_op(f"{_NS}::te_grouped_wgrad_into", mutates_args=("out",))
def te_grouped_wgrad_into(out: list[Tensor], x: Tensor, dy: Tensor, sizes: list[int] | None,
                          sizes_dev: Tensor | None, grouped: bool, accumulate: bool, with_dbias: bool) -> Tensor:
    E = _num_experts(out)
    _, db = TE.grouped_wgrad(x, dy, _splits(x, E, sizes, sizes_dev), grouped, out=_weights(out),
                             accumulate=accumulate, with_dbias=with_dbias)
    return _db(db, dy)


@te_grouped_wgrad_into.register_fake
def _(out, x, dy, sizes, sizes_dev, grouped, accumulate, with_dbias):
    return dy.new_empty((_num_experts(out), dy.shape[1]) if with_dbias else (0,))


def _list(w: Weights) -> list[Tensor]:
    return [w] if isinstance(w, Tensor) else list(w)


def _host(splits: Splits) -> list[int] | None:
    return None if splits.host is None else list(splits.host)


class TracedTEKernels:
    """The :class:`~functional_dw.kernels.Kernels` interface over the custom ops above."""

    name = "te"

    def __repr__(self) -> str:
        return "TracedTEKernels()"

    def grouped_path_unsupported(self, x_TK, w_ENK):
        return TE.grouped_path_unsupported(x_TK, w_ENK)

    def fprop(self, x_TK, w_NK, b_N):
        return te_fprop(x_TK, w_NK, b_N)

    def dgrad(self, dy_TN, w_NK):
        return te_dgrad(dy_TN, w_NK)

    def wgrad(self, x_TK, dy_TN, *, out=None, accumulate=False, with_dbias=False):
        if out is None:
            dw, db = te_wgrad(x_TK, dy_TN, with_dbias)
            return dw, db if with_dbias else None
        db = te_wgrad_into(out, x_TK, dy_TN, accumulate, with_dbias)
        return out, db if with_dbias else None

    def grouped_fprop(self, x_TK, w_ENK, b_EN, splits, grouped):
        return te_grouped_fprop(x_TK, _list(w_ENK), b_EN, _host(splits), splits.tensor, grouped)

    def grouped_dgrad(self, dy_TN, w_ENK, splits, grouped):
        return te_grouped_dgrad(dy_TN, _list(w_ENK), _host(splits), splits.tensor, grouped)

    def grouped_wgrad(self, x_TK, dy_TN, splits, grouped, *, out=None, accumulate=False, with_dbias=False):
        if out is None:
            dw, db = te_grouped_wgrad(x_TK, dy_TN, splits.num_experts, _host(splits), splits.tensor, grouped, with_dbias)
            return dw, db if with_dbias else None
        db = te_grouped_wgrad_into(_list(out), x_TK, dy_TN, _host(splits), splits.tensor, grouped, accumulate, with_dbias)
        return out, db if with_dbias else None


TRACED_TE = TracedTEKernels()
