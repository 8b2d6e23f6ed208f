"""TE's recipes' family (``_fp8.py`` says what a family is): DelayedScaling, Float8CurrentScaling
and Float8BlockScaling quantize each expert's tensors on their own, through the kernels'
``quantize`` / ``quantize_each`` / ``grouped_quantize`` (TE's, ``kernels/te.py``, or the emulated
reference, ``kernels/torch_ref.py``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from . import fp8
from ._fp8 import Plan
from .kernels import per_expert

__all__ = ["TEBlockPlan", "TEPlan"]

BLOCK_GROUPED_TOKEN_MULTIPLE = 128  # TE's grouped block-scaling quantize (group_quantize)


class TEPlan(Plan):
    """DelayedScaling and Float8CurrentScaling (the base's rules): each weight quantized on its
    own, with the state's per-GEMM scales under delayed scaling."""

    def quantize_weights(
        self, kernels: Any, w_ENK: Any, *, keep: bool = False, params: Sequence[torch.Tensor] | None = None
    ) -> tuple[list[Any], Plan]:
        """See :meth:`Plan.quantize_weights` (``params`` unused: nothing is cached)."""
        scales, amaxes = self._views("weight", None)
        qs = _quantize_each(kernels, w_ENK, self.w, scales, amaxes, rowwise=True, columnwise=keep)
        if not keep:
            return qs, self
        return qs, dataclasses.replace(self, w_dgrad=tuple(q.with_usage(rowwise=False, columnwise=True) for q in qs))

    def requantize_weights(self, kernels: Any, w_ENK: Any) -> list[Any]:
        """See :meth:`Plan.requantize_weights`."""
        if self.w_dgrad is not None:
            return list(self.w_dgrad)
        return _quantize_each(
            kernels, w_ENK, self.w, self._forward_scales("weight"), None, rowwise=False, columnwise=True
        )


class TEBlockPlan(TEPlan):
    """Float8BlockScaling: TE's grouped block-scaling quantize takes 128-row blocks per expert."""

    def grouped_problem(self, splits: Any) -> str | None:
        """Other counts go to the split path (checked on every backend, so the path is the same
        on the CPU as on the GPU; counts known only on the device are read once, a sync, since
        TE's kernel would fail on the device)."""
        bad = next(((e, s) for e, s in enumerate(splits.sizes()) if s % BLOCK_GROUPED_TOKEN_MULTIPLE), None)
        if bad is None:
            return None
        return (
            f"Float8BlockScaling on the grouped path needs each expert's tokens to be a multiple of "
            f"{BLOCK_GROUPED_TOKEN_MULTIPLE} (splits[{bad[0]}] is {bad[1]})"
        )


def _quantize_each(
    kernels: Any, ts: Any, spec: fp8.TensorSpec, scales: Any, amaxes: Any, *, rowwise: bool, columnwise: bool
) -> list[Any]:
    """Each of a group's weights quantized on its own: the kernels' ``quantize_each`` where they
    have one (checks once, one call per weight), else ``quantize`` per weight; ``scales``/
    ``amaxes`` strided ``[E]`` views (delayed scaling) or None."""
    each = getattr(kernels, "quantize_each", None)
    if each is not None:
        return each(ts, spec, scales=scales, amaxes=amaxes, rowwise=rowwise, columnwise=columnwise)
    return [
        kernels.quantize(t, spec, scale=scale, amax=amax, rowwise=rowwise, columnwise=columnwise)
        for t, (scale, amax) in zip(ts, per_expert(scales, amaxes, len(ts)))
    ]
