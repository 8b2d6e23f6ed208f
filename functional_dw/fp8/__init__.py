"""FP8 for functional_dw as data: recipes, per-tensor specs, emulated quantization.

Pure torch; Transformer Engine is never imported (TE's recipe objects are read by name).
See :mod:`.recipe`, :mod:`.spec`, :mod:`.qtensor`, :mod:`.quantize`.
"""

from .qtensor import QTensor, from_te_scale_inv, te_scale_inv
from .quantize import FLT_MAX, amax_of, compute_scale_from_amax, quantize, quantize_groups
from .recipe import (
    HOPPER_RECIPES, DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Format, MMParams, QParams, Recipe,
    as_recipe,
)
from .spec import FP8_MAX, ROLES, SplitAccumulator, TensorSpec, split_accumulator, tensor_spec

__all__ = [
    "Format", "MMParams", "QParams", "DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling", "Recipe",
    "HOPPER_RECIPES", "as_recipe",
    "ROLES", "FP8_MAX", "TensorSpec", "SplitAccumulator", "tensor_spec", "split_accumulator",
    "QTensor", "te_scale_inv", "from_te_scale_inv",
    "FLT_MAX", "compute_scale_from_amax", "amax_of", "quantize", "quantize_groups",
]
