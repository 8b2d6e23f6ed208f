"""Delayed scaling's state as data: amax histories and scales, laid out as TE lays them out.

A layer with ``E`` GEMMs (Linear: 1, GroupedLinear: ``num_gemms``) has, as TE's
``fp8_meta["scaling_fwd"]`` / ``["scaling_bwd"]`` (``module/base.py: set_meta_tensor``;
``quantization.py: DelayedScalingRecipeState``):

- forward: ``scale_fwd [3E]`` and ``amax_history_fwd [H, 3E]``, slot ``3e + 0`` = GEMM e's
  input, ``3e + 1`` its weight, ``3e + 2`` its output (used only for FP8 output, not by
  Linear/GroupedLinear here);
- backward: ``scale_bwd [2E]`` and ``amax_history_bwd [H, 2E]``, slot ``2e + 0`` = GEMM e's
  grad_output, ``2e + 1`` its grad_input (unused likewise).

(``module/grouped_linear.py``: ``_offsets = {input: 0, weight: 1, output: 2, grad_output: 0,
grad_input: 1}``, ``_num_fp8_tensors_per_gemm = {fwd: 3, bwd: 2}``; Linear uses the same
indices with e = 0, ``FP8FwdTensors.GEMM1_INPUT`` ...). ``H = recipe.amax_history_len``.
Scales start at 1, histories at 0.

:func:`record_amax` maxes a tensor's amax into row 0 (this step's); :func:`update_state` rolls
the histories and recomputes the scales as TE does (NOTE: [Where TE writes amaxes, and when it
updates], NOTE: [The update rule]).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Literal, Optional

import torch
import torch.utils._pytree as pytree

from .quantize import FLT_MAX
from .recipe import DelayedScaling, as_recipe
from .spec import tensor_spec

__all__ = [
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
    "FWD_PER_GEMM",
    "BWD_PER_GEMM",
]


# NOTE: [Where TE writes amaxes, and when it updates]
#   Quantizing GEMM e's input in forward uses ``Float8Quantizer(scale=scale_fwd[3e],
#   amax=amax_history_fwd[0][3e])``: the cast kernel reads the scale and *atomically maxes* the
#   tensor's amax into row 0 of the history (``atomicMaxFloat``), so several quantizations
#   before an update keep the largest. The weight goes to ``[0, 3e+1]``, and in backward dy to
#   ``amax_history_bwd[0, 2e]`` with ``scale_bwd[2e]``. Row 0 is "this step"; :func:`record_amax`
#   does that max.
#
#   Updates (:func:`update_state`) are separate for the two directions:
#   - forward: when the outermost ``te.autocast`` exits with grad enabled
#     (``FP8GlobalStateManager.autocast_exit -> reduce_and_update_fp8_tensors(forward=True)``;
#     skipped under ``no_grad``, so inference forwards keep maxing into row 0). Forward t uses the
#     scale computed at the exit of step t-1.
#   - backward: at the end of the backward of the module that ran first in that autocast
#     (``is_first_fp8_module`` -> ``ctx.reduce_and_update_bwd_fp8_tensors``), i.e. after every
#     module's backward of the step has recorded its dy amax; it updates the backward state of
#     every module registered under that autocast (``forward=False``).
#
#   A second backward through the same graph (``retain_graph=True``; TE's own backward cannot run
#   twice, it clears its ctx) would, under TE's rules, quantize dy with the backward scale as the
#   first backward's update left it, max its amax into the fresh row 0, and run the backward
#   update again: the backward history rolls twice in one step. With this module the caller
#   decides: update the backward state once after all backwards of a step, and the two
#   backwards' amaxes share one row.
#
#   Activation recomputation: TE stashes the forward scales before the first forward and
#   restores them for the recompute (``copy_forward_fp8_meta_tensors_for_recompute``), so the
#   recomputed forward quantizes exactly as the first did. Here, a recompute must be given the
#   scale values the first forward used.

# NOTE: [The update rule]  (``common/recipe/delayed_scaling.cu: kernel_bulk``, TE's default
#   ``tex.fused_amax_and_scale_update_after_reduction``), per slot, with ``last`` = row 0 (after
#   the optional max-reduction over ranks):
#   - if ``last != 0``: the history rolls one row up (row i takes row i+1, row H-1 takes
#     ``last``) and row 0 is zeroed; ``amax`` = the max over the window ``rows 1..H-1 and last``
#     ("max", NaN skipped by ``fmaxf``) or ``last`` ("most_recent").
#   - if ``last == 0`` (nothing recorded this step): the history does not roll and amax = 0.
#   - ``scale = (fp8_max * 2**-margin) / amax`` if amax is finite and > 0, else the old scale;
#     an inf scale becomes FLT_MAX. fp8_max is the direction's format's (E4M3 448, E5M2 57344).
#   TE runs its unfused Python update instead (``quantization.py: _amax_and_scale_update``) when
#   ``amax_compute_algo`` or ``scaling_factor_compute_algo`` is a callable, or when
#   ``NVTE_UNFUSED_FP8_UPDATE=1``. It differs: the history always rolls (even for a zero row),
#   "max" is ``torch.max`` over the whole history (NaN propagates), and the scale is
#   ``(fp8_max / amax) / 2**margin``, a true fp32 division here. TE's ``_default_sf_compute`` runs
#   under ``torch.compile`` by default (``jit_fuser``); with ``NVTE_TORCH_COMPILE=0`` eager torch
#   evaluates ``float / tensor`` as ``reciprocal(amax) * fp8_max``, which can differ by an ulp.
#   Callables get (a copy of) the history and ``(amax, scale, fp8_max, recipe)`` with this
#   package's recipe.

FWD_PER_GEMM, BWD_PER_GEMM = 3, 2
_SLOTS = {
    "input": ("fwd", 0),
    "weight": ("fwd", 1),
    "output": ("fwd", 2),
    "grad_output": ("bwd", 0),
    "grad_input": ("bwd", 1),
}
_TENSORS = ("amax_history_fwd", "scale_fwd", "amax_history_bwd", "scale_bwd")


@dataclasses.dataclass(frozen=True, eq=False)
class DelayedScalingState:
    """Delayed scaling's state for one layer of ``num_gemms`` GEMMs (see the module docstring).
    A frozen record and a pytree node: its four tensors are the leaves."""

    amax_history_fwd: torch.Tensor  # [H, 3E] fp32
    scale_fwd: torch.Tensor  # [3E] fp32
    amax_history_bwd: torch.Tensor  # [H, 2E] fp32
    scale_bwd: torch.Tensor  # [2E] fp32
    num_gemms: int

    def __post_init__(self) -> None:
        E = self.num_gemms
        if isinstance(E, bool) or not isinstance(E, int) or E < 1:
            raise ValueError(f"num_gemms must be an int >= 1, got {E!r}")
        H = self.amax_history_fwd.shape[0] if self.amax_history_fwd.dim() == 2 else -1
        for name, shape in (
            ("amax_history_fwd", (H, 3 * E)),
            ("scale_fwd", (3 * E,)),
            ("amax_history_bwd", (H, 2 * E)),
            ("scale_bwd", (2 * E,)),
        ):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or tuple(t.shape) != shape or H < 1:
                got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(
                    f"{name} must be float32 of shape {shape} for num_gemms={E} "
                    f"(H >= 1 history rows, shared by both directions), got {got}"
                )

    @property
    def history_len(self) -> int:
        return self.amax_history_fwd.shape[0]

    def __repr__(self) -> str:
        return f"DelayedScalingState(num_gemms={self.num_gemms}, history_len={self.history_len})"


pytree.register_pytree_node(
    DelayedScalingState,
    lambda s: ([getattr(s, n) for n in _TENSORS], s.num_gemms),
    lambda values, E: DelayedScalingState(*values, num_gemms=E),
    flatten_with_keys_fn=lambda s: ([(pytree.GetAttrKey(n), getattr(s, n)) for n in _TENSORS], s.num_gemms),
)


def _delayed(recipe: Any) -> DelayedScaling:
    r = as_recipe(recipe)
    if not isinstance(r, DelayedScaling):
        raise ValueError(
            f"delayed-scaling state needs a DelayedScaling recipe, got {type(r).__name__}: "
            "current and block scaling keep no state"
        )
    return r


def init_state(recipe: Any, num_gemms: int = 1, device: Any = None) -> DelayedScalingState:
    """A fresh state (scales 1, histories 0) for ``num_gemms`` GEMMs, as TE allocates it."""
    r = _delayed(recipe)
    if isinstance(num_gemms, bool) or not isinstance(num_gemms, int) or num_gemms < 1:
        raise ValueError(f"num_gemms must be an int >= 1, got {num_gemms!r}")
    H, E = r.amax_history_len, num_gemms
    f32 = dict(dtype=torch.float32, device=device)
    return DelayedScalingState(
        torch.zeros(H, 3 * E, **f32),
        torch.ones(3 * E, **f32),
        torch.zeros(H, 2 * E, **f32),
        torch.ones(2 * E, **f32),
        E,
    )


def slot(role: str, gemm: int = 0, num_gemms: Optional[int] = None) -> tuple[str, int]:
    """``("fwd" | "bwd", column)`` of GEMM ``gemm``'s ``role`` (input/weight/output,
    grad_output/grad_input) in the state's scale and history."""
    if role not in _SLOTS:
        raise ValueError(f"role must be one of {tuple(_SLOTS)}, got {role!r}")
    if isinstance(gemm, bool) or not isinstance(gemm, int) or gemm < 0 or (num_gemms is not None and gemm >= num_gemms):
        raise ValueError(f"gemm must be an int in [0, {num_gemms}), got {gemm!r}")
    side, offset = _SLOTS[role]
    return side, offset + gemm * (FWD_PER_GEMM if side == "fwd" else BWD_PER_GEMM)


def _columns(state: DelayedScalingState, role: str) -> tuple[str, slice]:
    side, first = slot(role, 0)
    return side, slice(first, None, FWD_PER_GEMM if side == "fwd" else BWD_PER_GEMM)


def scale_for(state: DelayedScalingState, role: str, gemm: int = 0) -> torch.Tensor:
    """The scale (0-d view into the state) that quantizing GEMM ``gemm``'s ``role`` uses."""
    side, col = slot(role, gemm, state.num_gemms)
    return getattr(state, f"scale_{side}")[col]


def group_scales(state: DelayedScalingState, role: str) -> torch.Tensor:
    """The E scales of ``role``, one per GEMM (a strided view), for :func:`quantize_groups`."""
    side, cols = _columns(state, role)
    return getattr(state, f"scale_{side}")[cols]


def _amax_row(state: DelayedScalingState, role: str, amax: Any, gemm: Optional[int]) -> tuple[str, Any, torch.Tensor]:
    if gemm is None:
        side, cols = _columns(state, role)
        n = state.num_gemms
    else:
        side, cols = slot(role, gemm, state.num_gemms)
        n = 1
    a = torch.as_tensor(amax, dtype=torch.float32, device=state.scale_fwd.device).reshape(-1)
    if a.numel() != n:
        raise ValueError(
            f"amax must have {n} value(s) ({'one per GEMM' if gemm is None else f'GEMM {gemm}'}), got {a.numel()}"
        )
    return side, cols, a if gemm is None else a[0]


def record_amax(state: DelayedScalingState, role: str, amax: Any, *, gemm: Optional[int] = None) -> DelayedScalingState:
    """A new state whose history row 0 holds ``max(row 0, amax)`` at ``role``'s slot(s): what
    TE's cast kernel does (see the module NOTE). ``amax``: one value per GEMM when ``gemm`` is
    None (e.g. ``torch.cat([q.amax for q in qs])``), else GEMM ``gemm``'s value (``q.amax``)."""
    side, cols, a = _amax_row(state, role, amax, gemm)
    name = f"amax_history_{side}"
    hist = getattr(state, name).clone()
    hist[0, cols] = torch.maximum(hist[0, cols], a)
    return dataclasses.replace(state, **{name: hist})


def record_amax_(
    state: DelayedScalingState, role: str, amax: Any, *, gemm: Optional[int] = None
) -> DelayedScalingState:
    """:func:`record_amax` in place (for modules holding a state); returns ``state``."""
    side, cols, a = _amax_row(state, role, amax, gemm)
    row = getattr(state, f"amax_history_{side}")[0]
    row[cols] = torch.maximum(row[cols], a)
    return state


def _reduce_row0(hist: torch.Tensor, group: Any) -> torch.Tensor:
    """Row 0 max-reduced over ``group`` (TE: ``reduce_tensor_across_group_op_max``)."""
    import torch.distributed as dist

    row = hist[0].clone()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group=group) > 1:
        dist.all_reduce(row, op=dist.ReduceOp.MAX, group=group)
    return row


def _nanmax0(t: torch.Tensor) -> torch.Tensor:
    """``fmaxf`` reduction over dim 0 starting from 0: NaN skipped, never below 0."""
    t = torch.where(torch.isnan(t), torch.zeros_like(t), t)
    return t.amax(dim=0).clamp_min(0.0)


Pair = tuple[torch.Tensor, torch.Tensor]


def _fused_update(hist: torch.Tensor, scale: torch.Tensor, algo: str, fp8_max: float, margin: int) -> Pair:
    """``delayed_scaling.cu: kernel_bulk`` for every column at once."""
    last = hist[0]
    window = torch.cat([hist[1:], last[None]])  # row i <- row i+1; row H-1 <- last
    rolled = window.clone()
    rolled[0] = 0.0
    go = last != 0  # NaN != 0: rolls
    new_hist = torch.where(go, rolled, hist)
    amax = _nanmax0(window) if algo == "max" else last
    amax = torch.where(go, amax, torch.zeros_like(amax))
    two = torch.tensor(2.0, dtype=torch.float32)
    scaled_max = (torch.tensor(fp8_max, dtype=torch.float32) * two.pow(-float(margin))).to(
        hist.device
    )  # host float math
    new_scale = torch.where(torch.isfinite(amax) & (amax > 0), scaled_max / amax, scale)
    new_scale = torch.where(torch.isinf(new_scale), torch.full_like(new_scale, FLT_MAX), new_scale)
    return new_hist, new_scale


def _unfused_update(hist: torch.Tensor, scale: torch.Tensor, fp8_max: float, r: DelayedScaling) -> Pair:
    """``quantization.py: _amax_and_scale_update`` (TE's Python path), on copies."""
    algo = r.amax_compute_algo
    if callable(algo):
        amax = algo(hist.clone())
    elif algo == "max":
        amax = torch.max(hist, dim=0).values
    else:
        amax = hist[0].clone()
    new_hist = torch.roll(hist, -1, 0) if hist.shape[0] > 1 else hist.clone()
    new_hist[0] = 0.0
    if r.scaling_factor_compute_algo is not None:
        return new_hist, r.scaling_factor_compute_algo(amax, scale.clone(), fp8_max, r)
    sf = (torch.full_like(amax, fp8_max) / amax) / (2**r.margin)  # _default_sf_compute (see the NOTE)
    sf = torch.where(amax > 0.0, sf, scale)
    sf = torch.where(torch.isfinite(amax), sf, scale)
    sf = torch.where(torch.isinf(sf), torch.full_like(sf, FLT_MAX), sf)
    return new_hist, sf


def _update_args(
    state: DelayedScalingState, recipe: Any, which: str, fused: Optional[bool]
) -> tuple[DelayedScaling, bool]:
    """The checked recipe, and whether TE's fused rule applies (see :func:`update_state`)."""
    r = _delayed(recipe)
    if which not in ("fwd", "bwd", "both"):
        raise ValueError(f"which must be 'fwd', 'bwd' or 'both', got {which!r}")
    if state.history_len != r.amax_history_len:
        raise ValueError(
            f"the state has {state.history_len} history rows but recipe.amax_history_len is "
            f"{r.amax_history_len}: resize it with adjust_history_len(state, {r.amax_history_len})"
        )
    wants_python = callable(r.amax_compute_algo) or callable(r.scaling_factor_compute_algo)
    if fused is None:
        fused = not (wants_python or bool(int(os.getenv("NVTE_UNFUSED_FP8_UPDATE", "0"))))
    elif fused and wants_python:
        raise ValueError(
            "fused=True runs TE's kernel, which takes amax_compute_algo 'max' or 'most_recent' "
            "and no scaling_factor_compute_algo: leave fused=None for callables"
        )
    return r, fused


def update_state(
    state: DelayedScalingState,
    recipe: Any,
    *,
    which: Literal["fwd", "bwd", "both"] = "both",
    group: Any = None,
    fused: Optional[bool] = None,
) -> DelayedScalingState:
    """The state after TE's amax-and-scale update (a new record; ``state`` is not changed).

    ``which``: ``"fwd"`` (what TE does when the autocast exits), ``"bwd"`` (at the end of the
    step's backward) or both. ``group``: a process group to max-reduce this step's amaxes over
    first, when ``recipe.reduce_amax`` (TE reduces over the autocast's ``amax_reduction_group``;
    ``torch.distributed.group.WORLD`` for all ranks); None: no reduction, the caller's business.
    ``fused``: None picks as TE does (its fused kernel unless a callable or
    ``NVTE_UNFUSED_FP8_UPDATE=1`` asks for the Python path); see the module NOTE for both rules.
    """
    r, fused = _update_args(state, recipe, which, fused)
    return _updated(state, r, which, group, fused)


def _updated(state: DelayedScalingState, r: DelayedScaling, which: str, group: Any, fused: bool) -> DelayedScalingState:
    """:func:`update_state` after its checks (:func:`_update_args`)."""
    new = {}
    for side in ("fwd", "bwd") if which == "both" else (which,):
        hist, scale = getattr(state, f"amax_history_{side}"), getattr(state, f"scale_{side}")
        if group is not None and r.reduce_amax:
            hist = torch.cat([_reduce_row0(hist, group)[None], hist[1:]])
        fp8_max = r.fp8_format.value.max_fwd if side == "fwd" else r.fp8_format.value.max_bwd  # TE: get_fp8_max
        if fused:
            h, s = _fused_update(hist, scale, r.amax_compute_algo, float(fp8_max), r.margin)
        else:
            h, s = _unfused_update(hist, scale, fp8_max, r)
        new[f"amax_history_{side}"], new[f"scale_{side}"] = h, s.to(torch.float32)
    return dataclasses.replace(state, **new)


def update_state_(
    state: DelayedScalingState,
    recipe: Any,
    *,
    which: Literal["fwd", "bwd", "both"] = "both",
    group: Any = None,
    fused: Optional[bool] = None,
) -> DelayedScalingState:
    """:func:`update_state` in place: the state's own tensors take the new values (what a
    module holding a state calls); returns ``state``."""
    r, fused = _update_args(state, recipe, which, fused)
    if fused and _te_update_(state, r, which, group):
        return state
    new = _updated(state, r, which, group, fused)
    with torch.no_grad():
        for name in _TENSORS:
            if getattr(new, name) is not getattr(state, name):
                getattr(state, name).copy_(getattr(new, name))
    return state


# NOTE: [The fused kernel comes from the kernels] TE's fused update kernel lives with the
# backends (``functional_dw.kernels``), and fp8 imports nothing from there: ``kernels`` registers
# a provider here when it is imported (:func:`set_fused_kernel`), a function that returns TE's
# in-place update (``kernels/te_fp8.py: update_delayed_``) where TE imports, else None. Without a
# provider (fp8 loaded on its own) every update takes the torch path.
_FUSED_KERNEL: list[Callable[[], Optional[Callable[..., None]]]] = []


def set_fused_kernel(provider: Optional[Callable[[], Optional[Callable[..., None]]]]) -> None:
    """Register the provider of the fused update's kernel (NOTE: [The fused kernel comes from
    the kernels]); None removes it. ``provider()`` returns ``update_delayed_(last, hist, scale,
    algo, fp8_dtype, margin)``, which updates ``hist`` and ``scale`` in place, or None."""
    _FUSED_KERNEL[:] = [] if provider is None else [provider]


def _te_update_(state: DelayedScalingState, r: DelayedScaling, which: str = "both", group: Any = None) -> bool:
    """The fused update (:func:`update_state_`'s checks done) on a CUDA state through TE's own
    kernel (``tex.fused_amax_and_scale_update_after_reduction``: one launch per direction, what
    TE's autocast runs, in place of about thirty small torch ops), where TE is installed;
    False (nothing done) otherwise."""
    if state.scale_fwd.device.type != "cuda":
        return False
    if not all(getattr(state, n).is_contiguous() for n in _TENSORS):
        return False  # TE's kernel reads a history by its data pointer with stride shape[1], a scale densely
    update_delayed_ = _FUSED_KERNEL[0]() if _FUSED_KERNEL else None
    if update_delayed_ is None:
        return False
    with torch.no_grad():
        for side in ("fwd", "bwd") if which == "both" else (which,):
            hist, scale = getattr(state, f"amax_history_{side}"), getattr(state, f"scale_{side}")
            last = _reduce_row0(hist, group) if group is not None and r.reduce_amax else hist[0].clone()
            dtype = tensor_spec(r, "input" if side == "fwd" else "grad_output").fp8_dtype
            update_delayed_(last, hist, scale, r.amax_compute_algo, dtype, r.margin)
    return True


def adjust_history_len(state: DelayedScalingState, length: int) -> DelayedScalingState:
    """The state with ``length`` history rows, as TE's ``adjust_amax_history_length`` does when
    a recipe's ``amax_history_len`` changes: the first ``length`` rows kept, or zero rows
    appended."""
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise ValueError(f"length must be an int >= 1, got {length!r}")

    def fit(h: torch.Tensor) -> torch.Tensor:
        if length <= h.shape[0]:
            return h[:length].clone()
        return torch.cat([h, h.new_zeros(length - h.shape[0], h.shape[1])])

    return dataclasses.replace(
        state, amax_history_fwd=fit(state.amax_history_fwd), amax_history_bwd=fit(state.amax_history_bwd)
    )
