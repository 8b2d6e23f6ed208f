"""What a recipe means for each tensor a Linear quantizes, and for each GEMM.

A Linear (or each GEMM of a GroupedLinear) quantizes three tensors: ``"input"`` (x),
``"weight"`` and ``"grad_output"`` (dy). :func:`tensor_spec` says how, as TE's modules
configure their quantizers; :func:`split_accumulator` says which GEMMs accumulate in split
(non fast) mode.

Which representation each GEMM reads (TE ``cpp_extensions/gemm.py: _unwrap_tensor``; Hopper
runs FP8 GEMMs as TN only):

==========  =========================  =========================
GEMM        operands                   usage
==========  =========================  =========================
fprop       ``y = x W^T``              x rowwise, W rowwise
dgrad       ``dx = dy W``              dy rowwise, W columnwise
wgrad       ``dW = dy^T x``            dy columnwise, x columnwise
==========  =========================  =========================

So forward quantizes x (rowwise for fprop, columnwise kept for wgrad) and W (both), backward
quantizes dy (both).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, NamedTuple, Optional

import torch

from .recipe import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    QParams,
    Recipe,
    RowwiseScaling,
    as_recipe,
)

__all__ = ["ROLES", "FP8_MAX", "TensorSpec", "SplitAccumulator", "tensor_spec", "split_accumulator"]

Role = Literal["input", "weight", "grad_output"]
Scaling = Literal["delayed", "current", "block", "rowwise"]
ROLES: tuple[str, ...] = ("input", "weight", "grad_output")
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}  # largest finite values
_BLOCKS = {1: (1, 128), 2: (128, 128)}


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """How one tensor role is quantized.

    ``scaling``: ``"delayed"`` (a given per-tensor scale; the tensor's amax goes to the
    state), ``"current"`` (a per-tensor scale from this tensor's amax), ``"block"`` (a scale
    per tile) or ``"rowwise"`` (a scale per row, and per expert column: :mod:`.rowwise`). ``block``: the tile, ``(1, 128)`` or ``(128, 128)``, for block scaling, else
    None. ``power_2_scale``/``amax_epsilon``: how a scale is computed from an amax (current and
    block scaling; TE's ``compute_scale_from_amax``). ``margin``: delayed scaling's margin,
    which applies when the state is updated, not when a tensor is quantized.
    """

    role: str
    scaling: Scaling
    fp8_dtype: torch.dtype
    block: Optional[tuple[int, int]] = None
    power_2_scale: bool = False
    amax_epsilon: float = 0.0
    margin: int = 0

    def __post_init__(self) -> None:
        if self.fp8_dtype not in FP8_MAX:
            raise ValueError(
                f"TensorSpec.fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {self.fp8_dtype}"
            )
        if self.scaling not in ("delayed", "current", "block", "rowwise"):
            raise ValueError(
                f"TensorSpec.scaling must be 'delayed', 'current', 'block' or 'rowwise', got {self.scaling!r}"
            )
        if (self.scaling == "block") != (self.block is not None) or self.block not in (None, *_BLOCKS.values()):
            raise ValueError(
                f"TensorSpec.block must be (1, 128) or (128, 128) with block scaling and None "
                f"otherwise, got {self.block!r} with {self.scaling!r} scaling"
            )

    @property
    def fp8_max(self) -> float:
        """The largest finite value of ``fp8_dtype``: 448 (E4M3) or 57344 (E5M2)."""
        return FP8_MAX[self.fp8_dtype]


class SplitAccumulator(NamedTuple):
    """``use_split_accumulator`` of each GEMM (cuBLASLt FAST_ACCUM off when True)."""

    fprop: bool
    dgrad: bool
    wgrad: bool


def _fp8_dtype(fmt: Format, forward: bool) -> torch.dtype:
    """TE ``quantization.py: get_fp8_torch_dtype``: E4M3, or HYBRID's E4M3 forward / E5M2 backward."""
    return torch.float8_e4m3fn if fmt == Format.E4M3 or (fmt == Format.HYBRID and forward) else torch.float8_e5m2


def _checked(recipe: Any) -> Recipe:
    r = as_recipe(recipe)
    if r is None:
        raise ValueError("no FP8 recipe (None): pass DelayedScaling(), Float8CurrentScaling() or Float8BlockScaling()")
    return r


def tensor_spec(recipe: Any, role: str) -> TensorSpec:
    """How ``recipe`` quantizes ``role`` (``"input"``, ``"weight"`` or ``"grad_output"``).

    ``recipe`` may be one of ours or TE's (see :func:`as_recipe`). The rules are TE's module
    code: ``quantization.py: DelayedScalingRecipeState`` (scale and amax from the state, no
    epsilon), ``module/linear.py`` and ``module/grouped_linear.py:
    _customize_quantizers_float8_current_scaling`` (current scaling takes ``power_2_scale`` and
    ``amax_epsilon`` from ``fp8_quant_fwd_inp``/``fp8_quant_fwd_weight``/``fp8_quant_bwd_grad``),
    ``quantization.py: Float8BlockScalingRecipeState.make_quantizers`` (block dims and QParams per
    role; input and weight in the forward format, grads in the backward one).
    """
    r = _checked(recipe)
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    forward = role != "grad_output"
    dtype = _fp8_dtype(r.fp8_format, forward)
    if isinstance(r, DelayedScaling):
        return TensorSpec(role, "delayed", dtype, margin=r.margin)
    if isinstance(r, RowwiseScaling):
        return TensorSpec(
            role, "rowwise", torch.float8_e4m3fn, power_2_scale=r.power_2_scale, amax_epsilon=float(r.amax_epsilon)
        )
    q: QParams = {"input": r.fp8_quant_fwd_inp, "weight": r.fp8_quant_fwd_weight, "grad_output": r.fp8_quant_bwd_grad}[
        role
    ]
    if isinstance(r, Float8CurrentScaling):
        return TensorSpec(role, "current", dtype, power_2_scale=q.power_2_scale, amax_epsilon=float(q.amax_epsilon))
    assert isinstance(r, Float8BlockScaling)
    dim = {"input": r.x_block_scaling_dim, "weight": r.w_block_scaling_dim, "grad_output": r.grad_block_scaling_dim}[
        role
    ]
    return TensorSpec(
        role, "block", dtype, block=_BLOCKS[dim], power_2_scale=q.power_2_scale, amax_epsilon=float(q.amax_epsilon)
    )


def split_accumulator(recipe: Any) -> SplitAccumulator:
    """Which GEMMs use split accumulation: the recipe's ``fp8_gemm_*`` where it has them, else
    TE's module defaults (``module/base.py: _2X_ACC_FPROP/_DGRAD/_WGRAD`` = False, True, True:
    DelayedScaling has no ``fp8_gemm_*`` fields)."""
    r = _checked(recipe)
    if isinstance(r, DelayedScaling):
        return SplitAccumulator(False, True, True)
    return SplitAccumulator(
        r.fp8_gemm_fprop.use_split_accumulator,
        r.fp8_gemm_dgrad.use_split_accumulator,
        r.fp8_gemm_wgrad.use_split_accumulator,
    )
