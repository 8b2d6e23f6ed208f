"""FP8 for functional_dw, as data: recipes, per-tensor specs, emulated quantization, state.

Pure torch; Transformer Engine is never imported (TE's recipe objects and checkpoints are
read by name). The modules, in the order a layer needs them:

- :mod:`.recipe`: ``Format``, ``MMParams``, ``QParams``, ``DelayedScaling``,
  ``Float8CurrentScaling``, ``Float8BlockScaling`` (TE 2.20's fields and defaults, checked),
  and functional_dw's own ``RowwiseScaling`` (the fast expert recipe, :mod:`.rowwise`);
  :func:`as_recipe` takes ours, TE's, or None.
- :mod:`.spec`: :func:`tensor_spec` (how a recipe quantizes ``"input"``, ``"weight"``,
  ``"grad_output"``) and :func:`split_accumulator` (per GEMM).
- :mod:`.quantize` / :mod:`.qtensor`: :func:`quantize`, :func:`quantize_groups` (per expert)
  into a :class:`QTensor` (FP8 payload + fp32 inverse scales, rowwise and/or columnwise copies,
  a pytree), with TE's kernel formulas.
- :mod:`.state`: delayed scaling's amax histories and scales (:class:`DelayedScalingState`, in
  TE's ``fp8_meta`` layout), :func:`record_amax`, :func:`update_state` (pure) /
  :func:`update_state_` (in place).
- :mod:`.extra_state`: TE's ``_extra_state`` checkpoint entry, read and written.
- :mod:`.rowwise`: RowwiseScaling's quantization as reference math, and its weight cache:
  :func:`clear_weight_cache`, :func:`remove_optimizer_hook` (the ``torch.optim`` post-step hook
  the cache installs at its first use; importing fp8 registers nothing global).

A layer's use, sketched (GEMM ``e``; for a GroupedLinear use :func:`quantize_groups` with
:func:`group_scales` and record one amax per GEMM)::

    recipe = fp8.as_recipe(user_recipe)
    sx, sw, sdy = (fp8.tensor_spec(recipe, role) for role in fp8.ROLES)
    delayed = sx.scaling == "delayed"
    # forward: fprop reads x and W rowwise; keep x columnwise for wgrad, W columnwise for dgrad
    qx = fp8.quantize(x, sx, scale=fp8.scale_for(state, "input", e) if delayed else None,
                      rowwise=True, columnwise=True)
    qw = fp8.quantize(w, sw, scale=fp8.scale_for(state, "weight", e) if delayed else None,
                      rowwise=True, columnwise=True)
    if delayed:
        fp8.record_amax_(state, "input", qx.amax, gemm=e)
        fp8.record_amax_(state, "weight", qw.amax, gemm=e)
    saved_x = qx.with_usage(rowwise=False, columnwise=True)   # a pytree: goes into residuals
    # backward: dgrad reads dy rowwise, wgrad reads dy columnwise
    qdy = fp8.quantize(dy, sdy, scale=..., rowwise=True, columnwise=True)   # + record "grad_output"
    # after the step (TE: at autocast exit / after the first module's backward)
    fp8.update_state_(state, recipe, which="fwd"); fp8.update_state_(state, recipe, which="bwd")
"""

from .extra_state import read_extra_state, state_from_extra_state, state_to_extra_state
from .qtensor import QTensor, from_te_scale_inv, te_scale_inv
from .quantize import FLT_MAX, amax_of, compute_scale_from_amax, quantize, quantize_groups
from .recipe import (
    HOPPER_RECIPES,
    RECIPES,
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    MMParams,
    QParams,
    Recipe,
    RowwiseScaling,
    as_recipe,
)
from .rowwise import clear_weight_cache, remove_optimizer_hook
from .spec import FP8_MAX, ROLES, SplitAccumulator, TensorSpec, split_accumulator, tensor_spec
from .state import (
    DelayedScalingState,
    adjust_history_len,
    group_scales,
    init_state,
    record_amax,
    record_amax_,
    scale_for,
    slot,
    update_state,
    update_state_,
)

__all__ = [
    "Format",
    "MMParams",
    "QParams",
    "DelayedScaling",
    "Float8CurrentScaling",
    "Float8BlockScaling",
    "RowwiseScaling",
    "Recipe",
    "HOPPER_RECIPES",
    "RECIPES",
    "as_recipe",
    "ROLES",
    "FP8_MAX",
    "TensorSpec",
    "SplitAccumulator",
    "tensor_spec",
    "split_accumulator",
    "QTensor",
    "te_scale_inv",
    "from_te_scale_inv",
    "FLT_MAX",
    "compute_scale_from_amax",
    "amax_of",
    "quantize",
    "quantize_groups",
    "DelayedScalingState",
    "init_state",
    "slot",
    "scale_for",
    "group_scales",
    "record_amax",
    "record_amax_",
    "update_state",
    "update_state_",
    "adjust_history_len",
    "read_extra_state",
    "state_from_extra_state",
    "state_to_extra_state",
    "clear_weight_cache",
    "remove_optimizer_hook",
]
