"""TE's kernels as ``torch.library`` custom ops, so ``torch.compile`` can trace them.

FP8 is not traced yet: ``quantize``/``grouped_quantize`` raise under ``torch.compile`` (TE's
quantized storages are not tensors an op schema can carry; they would need their own ops).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .splits import Splits
from .te import TE
from .torch_ops import op_list as _list, op_splits, op_weights as _weights


# NOTE: [Custom ops without autograd]
#   Each op wraps one method of :class:`~functional_dw.kernels.te.TEKernels` and has a fake
#   (meta) implementation that gives the output shapes. None registers an autograd formula:
#   autograd stays in the one ``custom_vjp`` bridge (custom ops with ``register_autograd`` do
#   not compose with ``torch.func.grad``). Eager calls bypass these ops and call TEKernels
#   directly (no dispatcher overhead); :data:`TRACED_TE` is what ``get_kernels`` returns while
#   compiling. Splits travel as one int tensor (CPU or device) and are rebuilt per op by
#   ``Splits.in_op`` (see NOTE: [Splits under torch.compile] in ``kernels/splits.py``).

_NS = "functional_dw"


def _num_experts(ws: list[Tensor]) -> int:
    return len(_weights(ws))


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
def te_grouped_fprop(x: Tensor, ws: list[Tensor], b: Tensor | None, splits: Tensor, grouped: bool) -> Tensor:
    return TE.grouped_fprop(x, _weights(ws), b, Splits.in_op(splits, x, _num_experts(ws), grouped), grouped)


@te_grouped_fprop.register_fake
def _(x, ws, b, splits, grouped):
    return x.new_empty(x.shape[0], ws[0].shape[-2])


@torch.library.custom_op(f"{_NS}::te_grouped_dgrad", mutates_args=())
def te_grouped_dgrad(dy: Tensor, ws: list[Tensor], splits: Tensor, grouped: bool) -> Tensor:
    return TE.grouped_dgrad(dy, _weights(ws), Splits.in_op(splits, dy, _num_experts(ws), grouped), grouped)


@te_grouped_dgrad.register_fake
def _(dy, ws, splits, grouped):
    return dy.new_empty(dy.shape[0], ws[0].shape[-1])


@torch.library.custom_op(f"{_NS}::te_grouped_wgrad", mutates_args=())
def te_grouped_wgrad(x: Tensor, dy: Tensor, splits: Tensor, grouped: bool, with_dbias: bool) -> list[Tensor]:
    dw, db = TE.grouped_wgrad(x, dy, Splits.in_op(splits, x, splits.shape[0], grouped), grouped, with_dbias=with_dbias)
    return [dw, _db(db, dy)]


@te_grouped_wgrad.register_fake
def _(x, dy, splits, grouped, with_dbias):
    E, N = splits.shape[0], dy.shape[1]
    return [dy.new_empty(E, N, x.shape[1]), dy.new_empty((E, N) if with_dbias else (0,))]


@torch.library.custom_op(f"{_NS}::te_grouped_wgrad_into", mutates_args=("out",))
def te_grouped_wgrad_into(
    out: list[Tensor], x: Tensor, dy: Tensor, splits: Tensor, grouped: bool, accumulate: bool, with_dbias: bool
) -> Tensor:
    _, db = TE.grouped_wgrad(
        x,
        dy,
        Splits.in_op(splits, x, _num_experts(out), grouped),
        grouped,
        out=_weights(out),
        accumulate=accumulate,
        with_dbias=with_dbias,
    )
    return _db(db, dy)


@te_grouped_wgrad_into.register_fake
def _(out, x, dy, splits, grouped, accumulate, with_dbias):
    return dy.new_empty((_num_experts(out), dy.shape[1]) if with_dbias else (0,))


_NO_FP8 = (
    "FP8 (recipe=...) with backend='te' is not supported under torch.compile yet: run the FP8 layer "
    "eagerly (e.g. wrap it in torch.compiler.disable), or use backend='torch' (the FP8 emulation)"
)


class TracedTEKernels:
    """The :class:`~functional_dw.kernels.Kernels` interface over the custom ops above."""

    name = "te"

    def __repr__(self) -> str:
        return "TracedTEKernels()"

    def grouped_path_unsupported(self, x_TK, w_ENK, recipe=None):
        if recipe is None:
            return TE.grouped_path_unsupported(x_TK, w_ENK)
        return TE.grouped_path_unsupported(x_TK, w_ENK, recipe=recipe)

    def quantize(self, *args, **kwargs):
        raise NotImplementedError(_NO_FP8)

    def grouped_quantize(self, *args, **kwargs):
        raise NotImplementedError(_NO_FP8)

    # split_accumulator: read with FP8 operands only, which never reach these ops (see quantize)
    def fprop(self, x_TK, w_NK, b_N, *, split_accumulator=False):
        return te_fprop(x_TK, w_NK, b_N)

    def dgrad(self, dy_TN, w_NK, *, split_accumulator=False):
        return te_dgrad(dy_TN, w_NK)

    def wgrad(self, x_TK, dy_TN, *, out=None, accumulate=False, with_dbias=False, split_accumulator=False):
        if out is None:
            dw, db = te_wgrad(x_TK, dy_TN, with_dbias)
            return dw, db if with_dbias else None
        db = te_wgrad_into(out, x_TK, dy_TN, accumulate, with_dbias)
        return out, db if with_dbias else None

    def grouped_fprop(self, x_TK, w_ENK, b_EN, splits, grouped, *, split_accumulator=False):
        return te_grouped_fprop(x_TK, _list(w_ENK), b_EN, op_splits(splits), grouped)

    def grouped_dgrad(self, dy_TN, w_ENK, splits, grouped, *, split_accumulator=False):
        return te_grouped_dgrad(dy_TN, _list(w_ENK), op_splits(splits), grouped)

    def grouped_wgrad(
        self, x_TK, dy_TN, splits, grouped, *, out=None, accumulate=False, with_dbias=False, split_accumulator=False
    ):
        if out is None:
            dw, db = te_grouped_wgrad(x_TK, dy_TN, op_splits(splits), grouped, with_dbias)
            return dw, db if with_dbias else None
        db = te_grouped_wgrad_into(_list(out), x_TK, dy_TN, op_splits(splits), grouped, accumulate, with_dbias)
        return out, db if with_dbias else None


TRACED_TE = TracedTEKernels()
