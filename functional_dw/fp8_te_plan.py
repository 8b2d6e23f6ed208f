"""TE's recipes' family (``fp8_plan.py`` says what a family is): DelayedScaling, Float8CurrentScaling
and Float8BlockScaling quantize each expert's tensors on their own (the base's rules), through
the family's kernels: TE's (``kernels/te_fp8_gemm.py``) or the emulation (``kernels/emulated.py``)."""

from __future__ import annotations

from typing import Any

from . import fp8
from .fp8_plan import Plan, register_family

__all__ = ["TEBlockPlan", "TEPlan"]

BLOCK_GROUPED_TOKEN_MULTIPLE = 128  # TE's grouped block-scaling quantize (group_quantize)


class TEPlan(Plan):
    """DelayedScaling and Float8CurrentScaling (the base's rules): each weight quantized on its
    own, with the state's per-GEMM scales under delayed scaling; the base's kernels (the
    emulation on torch's backend, TE's FP8 GEMMs on TE's)."""


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


register_family(fp8.DelayedScaling, TEPlan)
register_family(fp8.Float8CurrentScaling, TEPlan)
register_family(fp8.Float8BlockScaling, TEBlockPlan)
