"""The reference split path as ``torch.library`` custom ops, for ``torch.compile``.

The split path runs one GEMM per expert on host sizes. Traced by dynamo, those sizes would be
guarded on (a graph per routing) or, from a splits tensor, be data-dependent (an error under
``fullgraph=True``). Inside an opaque custom op they are read at run time instead, so one graph
serves every routing (see NOTE: [Splits under torch.compile] in ``kernels/splits.py``).

As in ``te_ops.py`` (NOTE: [Custom ops without autograd]): fake implementations give the
output shapes, no op has an autograd formula, and eager calls never reach these ops:
:data:`TRACED_TORCH` is what ``get_kernels`` returns only while compiling. The grouped path
(``grouped_mm`` on device offsets) is traced as it is, except its GEMMs with a list of
weights: ``ref_weights_gmm`` takes the list, so that at run time weights that are slices of one
buffer are read in place (NOTE: [One buffer]); traced, the list would be stacked (a copy)
because a trace knows no addresses.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .packing import Weights
from .splits import Splits
from .splits import write
from .torch_ref import TorchKernels

_NS = "functional_dw"
_EAGER = TorchKernels()


def op_weights(ws: list[Tensor]) -> Weights:
    """A custom op's ``Tensor[]`` weights back as the seam's form: E ``[N, K]`` or one ``[E, N, K]``."""
    return ws[0] if len(ws) == 1 and ws[0].dim() == 3 else ws


def op_list(w: Weights) -> list[Tensor]:
    return [w] if isinstance(w, Tensor) else list(w)


def op_splits(splits: Splits) -> Tensor:
    """The splits as the ops take them: one int tensor (always so while compiling; a host tuple
    only when a traced kernels object is called eagerly)."""
    return splits.tensor if splits.tensor is not None else torch.tensor(splits.host)


@torch.library.custom_op(f"{_NS}::ref_split_fprop", mutates_args=())
def ref_split_fprop(x: Tensor, ws: list[Tensor], b: Tensor | None, splits: Tensor) -> Tensor:
    w = op_weights(ws)
    return _EAGER.split_fprop(x, w, b, Splits.in_op(splits, x, len(w), grouped=False))


@ref_split_fprop.register_fake
def _(x, ws, b, splits):
    return x.new_empty(x.shape[0], ws[0].shape[-2])


@torch.library.custom_op(f"{_NS}::ref_split_dgrad", mutates_args=())
def ref_split_dgrad(dy: Tensor, ws: list[Tensor], splits: Tensor) -> Tensor:
    w = op_weights(ws)
    return _EAGER.split_dgrad(dy, w, Splits.in_op(splits, dy, len(w), grouped=False))


@ref_split_dgrad.register_fake
def _(dy, ws, splits):
    return dy.new_empty(dy.shape[0], ws[0].shape[-1])


@torch.library.custom_op(f"{_NS}::ref_split_wgrad", mutates_args=())
def ref_split_wgrad(x: Tensor, dy: Tensor, splits: Tensor) -> Tensor:
    return _EAGER.split_wgrad(x, dy, Splits.in_op(splits, x, splits.shape[0], grouped=False))


@ref_split_wgrad.register_fake
def _(x, dy, splits):
    return x.new_empty(splits.shape[0], dy.shape[1], x.shape[1])


@torch.library.custom_op(f"{_NS}::ref_weights_gmm", mutates_args=())
def ref_weights_gmm(a: Tensor, ws: list[Tensor], offs: Tensor, transpose: bool) -> Tensor:
    """grouped_mm of token rows ``a`` (groups ending at ``offs``) with E weights: ``W^T``
    (fprop) or ``W`` (dgrad)."""
    return _EAGER.weights_gmm(a, ws, offs, transpose)


@ref_weights_gmm.register_fake
def _(a, ws, offs, transpose):
    return a.new_empty(a.shape[0], ws[0].shape[-2 if transpose else -1])


class TracedTorchKernels(TorchKernels):
    """The reference kernels with the split path's three products, and the grouped path's
    products with a list of weights, as the custom ops above."""

    def __repr__(self) -> str:
        return "TracedTorchKernels()"

    def split_fprop(self, x_TK, w_ENK, b_EN, splits):
        return ref_split_fprop(x_TK, op_list(w_ENK), b_EN, op_splits(splits))

    def split_dgrad(self, dy_TN, w_ENK, splits):
        return ref_split_dgrad(dy_TN, op_list(w_ENK), op_splits(splits))

    def split_wgrad(self, x_TK, dy_TN, splits, *, out=None, accumulate=False):
        dw = ref_split_wgrad(x_TK, dy_TN, op_splits(splits))  # [E, N, K]: indexes like a list
        if out is None:
            return dw
        for t, d in zip(out, dw):
            write(t, d, accumulate)
        return out

    def weights_gmm(self, a_TX, w_ENK, offs, transpose):
        if isinstance(w_ENK, Tensor):  # one [E, N, K] weight: traced as it is
            return super().weights_gmm(a_TX, w_ENK, offs, transpose)
        return ref_weights_gmm(a_TX, list(w_ENK), offs, transpose)


TRACED_TORCH = TracedTorchKernels()
