"""FP8 for functional_dw as data: recipes, per-tensor specs, emulated quantization.

Pure torch; Transformer Engine is never imported (TE's recipe objects are read by name).
See :mod:`.recipe`, :mod:`.spec`, :mod:`.qtensor`, :mod:`.quantize`, :mod:`.state`.
"""

from .qtensor import QTensor, from_te_scale_inv, te_scale_inv
from .quantize import FLT_MAX, amax_of, compute_scale_from_amax, quantize, quantize_groups
from .recipe import (
    HOPPER_RECIPES, DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Format, MMParams, QParams, Recipe,
    as_recipe,
)
from .spec import FP8_MAX, ROLES, SplitAccumulator, TensorSpec, split_accumulator, tensor_spec
from .state import (
    DelayedScalingState, adjust_history_len, group_scales, init_state, record_amax, record_amax_, scale_for, slot,
    update_state, update_state_,
)

__all__ = [
    "Format", "MMParams", "QParams", "DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling", "Recipe",
    "HOPPER_RECIPES", "as_recipe",
    "ROLES", "FP8_MAX", "TensorSpec", "SplitAccumulator", "tensor_spec", "split_accumulator",
    "QTensor", "te_scale_inv", "from_te_scale_inv",
    "FLT_MAX", "compute_scale_from_amax", "amax_of", "quantize", "quantize_groups",
    "DelayedScalingState", "init_state", "slot", "scale_for", "group_scales", "record_amax", "record_amax_",
    "update_state", "update_state_", "adjust_history_len",
]
