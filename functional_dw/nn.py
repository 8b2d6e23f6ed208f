"""Thin modules for users coming from TE: parameters named as ``te.Linear`` and
``te.GroupedLinear`` name them, so a TE module's ``state_dict`` loads unchanged, and a
``forward`` that is one call of the functional API.

NOTE: [FP8 in the modules]
  A module runs FP8 with its ``recipe`` (a constructor argument), or, when that is None, with
  the recipe of an active Transformer Engine ``te.autocast(enabled=True, recipe=...)`` /
  ``fp8_autocast`` (read from TE's ``FP8GlobalStateManager`` only when TE is already imported:
  no autocast can be active otherwise, and TE is never imported here). Delayed scaling keeps
  its state in the module as non-persistent buffers ``fp8_amax_history_fwd``,
  ``fp8_scale_fwd``, ``fp8_amax_history_bwd``, ``fp8_scale_bwd`` (they follow ``.to(device)``,
  stay float32 under ``.to(dtype)``), made at construction for a delayed ``recipe`` or at the
  first FP8 forward under an autocast. The state is checkpointed as TE checkpoints it: in
  ``_extra_state``, in TE's format, so a TE module and this one load each other's state dicts.

  Updates are lazy: TE updates the forward state when the autocast exits and the backward state
  after the step's backward; here each forward with grad enabled, and each backward through the
  module, leave an update pending, and the next forward (or ``state_dict()``) applies them
  first (``fp8.update_state_``), so step t quantizes with scales from steps < t as under TE. A
  forward without grad (inference) records amaxes but leaves no update pending (TE skips the
  update under no_grad). Amaxes are not reduced across ranks here (TE's
  ``amax_reduction_group``): use the functional API's ``fp8.update_state(..., group=)`` for that.
"""

from __future__ import annotations

import math
import operator
import sys
from collections.abc import Sequence
from typing import Any

import torch

from . import fp8
from .grouped_linear import grouped_linear
from .linear import linear

__all__ = ["Linear", "GroupedLinear"]


def _init_(w: torch.Tensor, b: torch.Tensor | None, fan_in: int) -> None:
    """torch.nn.Linear's default init (zero in-features: nothing to draw for w, b bound 0)."""
    if w.numel():
        torch.nn.init.kaiming_uniform_(w, a=math.sqrt(5))
    if b is not None:
        bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0.0
        torch.nn.init.uniform_(b, -bound, bound)


def _reset_state(m: _FP8) -> None:
    """Scales 1, histories 0 (after ``to_empty`` the buffers hold garbage)."""
    state = m.fp8_state
    if state is not None:
        with torch.no_grad():
            for name in _STATE:
                getattr(state, name).fill_(1.0 if name.startswith("scale") else 0.0)
        m._fp8_pending = set()


def _size(name: str, v: object, least: int = 0) -> int:
    """An int size (numpy ints too, as torch.nn.Linear takes them) of at least ``least``."""
    try:
        n = operator.index(v) if not isinstance(v, bool) else None
    except TypeError:
        n = None
    if n is None:
        raise TypeError(f"{name} must be an int, got {v!r} ({type(v).__name__})")
    if n < least:
        raise ValueError(f"{name} must be an int >= {least}, got {n}")
    return n


_TE_QUANTIZATION = ("transformer_engine.pytorch.quantization", "transformer_engine.pytorch.fp8")  # TE 2.x, 1.x
_STATE = ("amax_history_fwd", "scale_fwd", "amax_history_bwd", "scale_bwd")


_TE_MANAGER: list = []  # TE's FP8GlobalStateManager, once seen imported


def te_autocast_recipe() -> fp8.Recipe | None:
    """The recipe of an active TE ``autocast``/``fp8_autocast`` (as this package's recipe), or
    None: no autocast, or TE not imported (then none can be active; nothing is imported). While
    compiling, TE is looked for only if an eager call (or this module's import) saw it: dynamo
    would guard a ``sys.modules`` lookup on the number of modules loaded, recompiling whenever
    any import happens."""
    if not _TE_MANAGER and not torch.compiler.is_compiling():
        for name in _TE_QUANTIZATION:
            manager = getattr(sys.modules.get(name), "FP8GlobalStateManager", None)
            if manager is not None:
                _TE_MANAGER.append(manager)
                break
    if not _TE_MANAGER or not _TE_MANAGER[0].is_fp8_enabled():
        return None
    return fp8.as_recipe(_TE_MANAGER[0].get_fp8_recipe())


te_autocast_recipe()  # TE imported before functional_dw.nn: found now, also for compiled code


class _FP8:
    """A module's FP8: its recipe or TE's autocast, delayed scaling's state as buffers, TE's
    ``_extra_state`` (see NOTE: [FP8 in the modules])."""

    _fp8_gemms: int

    def _init_fp8(self, recipe: Any, num_gemms: int, device: Any) -> None:
        self.recipe = fp8.as_recipe(recipe)
        self._fp8_gemms, self._fp8_recipe, self._fp8_pending = num_gemms, None, set()
        for name in _STATE:
            self.register_buffer(f"fp8_{name}", None, persistent=False)
        if isinstance(self.recipe, fp8.DelayedScaling):
            self._fp8_set(fp8.init_state(self.recipe, num_gemms, device=device), self.recipe)

    @property
    def fp8_state(self) -> fp8.DelayedScalingState | None:
        """Delayed scaling's state (a record over this module's buffers), or None."""
        if self.fp8_scale_fwd is None:
            return None
        return fp8.DelayedScalingState(*(getattr(self, f"fp8_{n}") for n in _STATE), self._fp8_gemms)

    def _fp8_set(self, state: fp8.DelayedScalingState, recipe: fp8.DelayedScaling) -> None:
        for name in _STATE:
            setattr(self, f"fp8_{name}", getattr(state, name))
        self._fp8_recipe, self._fp8_pending = recipe, set()

    def _fp8_flush(self) -> None:
        """Apply the pending updates (the last step's forward and backward)."""
        state = self.fp8_state
        for which in sorted(self._fp8_pending):
            fp8.update_state_(state, self._fp8_recipe, which=which)
        self._fp8_pending = set()

    def _fp8_begin(self, x: torch.Tensor) -> tuple[fp8.Recipe | None, fp8.DelayedScalingState | None]:
        """(recipe, state) for this forward: the explicit recipe, else the autocast's; the state
        made (first FP8 forward), resized to the recipe's history, or updated (a step ran)."""
        recipe = self.recipe if self.recipe is not None else te_autocast_recipe()
        if not isinstance(recipe, fp8.DelayedScaling):
            return recipe, None
        state = self.fp8_state
        if state is None:  # (a state follows the module's .to(); on another device than x, the layer says so)
            state = fp8.init_state(recipe, self._fp8_gemms, device=x.device)
            self._fp8_set(state, recipe)
        self._fp8_flush()
        if state.history_len != recipe.amax_history_len:  # as TE's adjust_amax_history_length
            self._fp8_set(fp8.adjust_history_len(state, recipe.amax_history_len), recipe)
            state = self.fp8_state
        self._fp8_recipe = recipe
        return recipe, state

    def _fp8_end(self, y: torch.Tensor, state: fp8.DelayedScalingState | None) -> torch.Tensor:
        """Leave the updates this forward (and later its backward) make pending."""
        if state is not None and torch.is_grad_enabled():
            self._fp8_pending.add("fwd")
            if y.requires_grad:
                y.register_hook(self._fp8_backward_ran)
        return y

    def _fp8_backward_ran(self, grad: torch.Tensor) -> None:
        self._fp8_pending.add("bwd")

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        """``.to(dtype)``/``.half()`` move the state but keep it float32 (TE's fp8_meta is not cast)."""
        kept = {n: getattr(self, f"fp8_{n}") for n in _STATE}
        out = super()._apply(fn, recurse)
        for name, old in kept.items():
            new = getattr(self, f"fp8_{name}")
            if old is not None and new is not None and new.dtype != torch.float32:
                setattr(self, f"fp8_{name}", old.to(new.device))
        return out

    def get_extra_state(self) -> torch.Tensor:
        """TE's ``_extra_state``: the delayed-scaling state (pending updates applied first) in
        TE's format, or an empty uint8 tensor (no state), as TE writes it."""
        state = self.fp8_state
        if state is None:
            return torch.empty(0, dtype=torch.uint8)
        self._fp8_flush()
        return fp8.state_to_extra_state(state, self._fp8_recipe)

    def set_extra_state(self, extra: Any) -> None:
        """Load TE's ``_extra_state`` (or ours): the delayed-scaling state and its recipe; an
        empty entry (no FP8, or a stateless recipe) changes nothing."""
        d = fp8.read_extra_state(extra)
        if d is None or "scale_fwd" not in d:
            return
        device = self.fp8_scale_fwd.device if self.fp8_scale_fwd is not None else next(self.parameters()).device
        state = fp8.state_from_extra_state(extra, self._fp8_gemms, device=device)
        recipe = d["recipe"] if isinstance(d["recipe"], fp8.DelayedScaling) else fp8.DelayedScaling(
            amax_history_len=state.history_len)
        self._fp8_set(state, recipe)


class Linear(_FP8, torch.nn.Module):
    """``y = x W^T + b`` with parameters ``weight [out, in]`` and ``bias [out]``. ``recipe``:
    an FP8 recipe, or None to follow TE's autocast (see NOTE: [FP8 in the modules]: delayed
    scaling's state lives in buffers and ``_extra_state``, updated lazily at the start of each
    forward after a step)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 params_dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                 fuse_wgrad_accumulation: bool = False, backend: str | None = None, recipe: Any = None) -> None:
        super().__init__()
        kw = dict(dtype=params_dtype, device=device)
        self.in_features, self.out_features = _size("in_features", in_features), _size("out_features", out_features)
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features, **kw))
        self.bias = torch.nn.Parameter(torch.empty(out_features, **kw)) if bias else None
        self.fuse_wgrad_accumulation, self.backend = fuse_wgrad_accumulation, backend
        self._init_fp8(recipe, 1, self.weight.device)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initialize the parameters (torch.nn.Linear's rule) and a delayed-scaling state;
        FSDP2-style meta init calls it after ``to_empty``."""
        _init_(self.weight, self.bias, self.in_features)
        _reset_state(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        recipe, state = self._fp8_begin(x)
        y = linear(x, self.weight, self.bias, fuse_wgrad_accumulation=self.fuse_wgrad_accumulation,
                   backend=self.backend, recipe=recipe, fp8_state=state)
        return self._fp8_end(y, state)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class GroupedLinear(_FP8, torch.nn.Module):
    """E experts with parameters ``weight0..weight{E-1}`` ``[out, in]`` and ``bias0..``.
    ``recipe``: as for :class:`Linear` (one state of ``num_gemms`` GEMMs, TE's layout)."""

    def __init__(self, num_gemms: int, in_features: int, out_features: int, bias: bool = True, *,
                 params_dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                 fuse_wgrad_accumulation: bool = False, use_grouped_tensor: bool | None = None,
                 backend: str | None = None, recipe: Any = None) -> None:
        super().__init__()
        kw = dict(dtype=params_dtype, device=device)
        self.num_gemms = _size("num_gemms", num_gemms, least=1)
        self.in_features, self.out_features = _size("in_features", in_features), _size("out_features", out_features)
        self.use_bias = bias
        for e in range(num_gemms):
            w = torch.nn.Parameter(torch.empty(out_features, in_features, **kw))
            b = torch.nn.Parameter(torch.empty(out_features, **kw)) if bias else None
            self.register_parameter(f"weight{e}", w)
            self.register_parameter(f"bias{e}", b)
        self.fuse_wgrad_accumulation, self.use_grouped_tensor = fuse_wgrad_accumulation, use_grouped_tensor
        self.backend = backend
        self._init_fp8(recipe, self.num_gemms, self.weight0.device)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initialize each expert's parameters (torch.nn.Linear's rule) and a delayed-scaling
        state; FSDP2-style meta init calls it after ``to_empty``."""
        for w, b in zip(self.weights(), self.biases() or [None] * self.num_gemms):
            _init_(w, b, self.in_features)
        _reset_state(self)

    def weights(self) -> list[torch.Tensor]:
        return [getattr(self, f"weight{e}") for e in range(self.num_gemms)]

    def biases(self) -> list[torch.Tensor] | None:
        return [getattr(self, f"bias{e}") for e in range(self.num_gemms)] if self.use_bias else None

    def forward(self, x: torch.Tensor, m_splits: Sequence[int] | torch.Tensor) -> torch.Tensor:
        recipe, state = self._fp8_begin(x)
        y = grouped_linear(x, self.weights(), m_splits, self.biases(),
                           fuse_wgrad_accumulation=self.fuse_wgrad_accumulation,
                           use_grouped_tensor=self.use_grouped_tensor, backend=self.backend,
                           recipe=recipe, fp8_state=state)
        return self._fp8_end(y, state)

    def extra_repr(self) -> str:
        return (f"num_gemms={self.num_gemms}, in_features={self.in_features}, "
                f"out_features={self.out_features}, bias={self.use_bias}")
