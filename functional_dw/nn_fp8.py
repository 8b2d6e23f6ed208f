"""The modules' FP8 (NOTE: [FP8 in the modules]): :class:`FP8Module`, the mixin of ``nn.Linear``
and ``nn.GroupedLinear`` (their recipe or TE autocast's, delayed scaling's state as buffers,
TE's ``_extra_state``), and :func:`te_autocast_recipe`."""

from __future__ import annotations

import sys
from typing import Any

import torch

from . import fp8

__all__ = ["FP8Module", "reset_state", "te_autocast_recipe"]


# NOTE: [FP8 in the modules]
#   A module runs FP8 with its ``recipe`` (a constructor argument), or, when that is None, with
#   the recipe of an active Transformer Engine ``te.autocast(enabled=True, recipe=...)`` /
#   ``fp8_autocast`` (read from TE's ``FP8GlobalStateManager`` only when TE is already imported:
#   no autocast can be active otherwise, and TE is never imported here). Delayed scaling keeps
#   its state in the module as non-persistent buffers ``fp8_amax_history_fwd``,
#   ``fp8_scale_fwd``, ``fp8_amax_history_bwd``, ``fp8_scale_bwd`` (they follow ``.to(device)``,
#   stay float32 under ``.to(dtype)``), made at construction for a delayed ``recipe`` or at the
#   first FP8 forward under an autocast. The state is checkpointed as TE checkpoints it: in
#   ``_extra_state``, in TE's format, so a TE module and this one load each other's state dicts.
#   A module built on ``meta`` and materialized (``to_empty``, ``load_state_dict(assign=True)``,
#   either by swap_tensors too) gets the construction-time state where its parameters are, or the
#   checkpoint's when it holds one (``FP8Module._fp8_materialize``, the one place that does it).
#
#   Updates are lazy: TE updates the forward state when the autocast exits and the backward state
#   after the step's backward; here each forward with grad enabled, and each backward through the
#   module, leave an update pending, and the next forward (or ``state_dict()``) applies them
#   first (``fp8.update_state_``), so step t quantizes with scales from steps < t as under TE. A
#   forward without grad (inference) records amaxes but leaves no update pending (TE skips the
#   update under no_grad). Amaxes are not reduced across ranks here (TE's
#   ``amax_reduction_group``): use the functional API's ``fp8.update_state(..., group=)`` for that.


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


class FP8Module:
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

    def _fp8_device(self) -> torch.device:
        """Where the state belongs: where it is, unless it holds no values (on ``meta``): then
        where the parameters are (unless they hold none either; CPU for a module with neither)."""
        state = self.fp8_scale_fwd.device if self.fp8_scale_fwd is not None else None
        if state is not None and state.type != "meta":
            return state
        p = next(self.parameters(), None)
        return p.device if p is not None and not p.is_meta else state or torch.device("cpu")

    def _fp8_materialize(self, reset: bool = False) -> None:
        """The one place that (re)makes the construction-time delayed-scaling state (scales 1,
        histories 0, nothing pending): for a state with no values (on ``meta``) once the
        parameters have some, made where they are, after any path that materializes the module
        (``to_empty``, other ``_apply`` moves, by swap_tensors too, ``load_state_dict`` with or
        without ``assign``: a checkpoint's state, which :meth:`set_extra_state` loads onto that
        device, is kept); and for any state with ``reset`` (``reset_parameters``), in place."""
        state = self.fp8_state
        if state is None or not (reset or state.scale_fwd.is_meta):
            return
        device = self._fp8_device()
        with torch.no_grad():
            for name in _STATE:
                t, value = getattr(self, f"fp8_{name}"), 1.0 if name.startswith("scale") else 0.0
                if t.device == device:  # in place: the buffers stay the same tensors
                    t.fill_(value)
                else:
                    setattr(self, f"fp8_{name}", torch.full_like(t, value, device=device))
        self._fp8_pending = set()

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        """``fn`` says where the state goes, never what it holds: its values are kept (moved,
        float32: ``.to(dtype)``/``.half()`` do not cast TE's fp8_meta either), because ``fn`` may
        be ``to_empty``'s, which hands out uninitialized memory, and no checkpoint restores these
        non-persistent buffers. A state on ``meta`` stays there until :meth:`_fp8_materialize`
        makes it where the parameters went."""
        kept = {n: getattr(self, f"fp8_{n}") for n in _STATE}
        out = super()._apply(fn, recurse)
        for name, old in kept.items():
            new = getattr(self, f"fp8_{name}")
            if old is not None and new is not None:
                setattr(self, f"fp8_{name}", old if old.is_meta else old.to(new.device))
        self._fp8_materialize()
        return out

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        """After loading (``assign=True`` may have taken the parameters off ``meta``): a state
        with no values becomes the construction-time one, unless the checkpoint held one
        (:meth:`_fp8_materialize`)."""
        super()._load_from_state_dict(*args, **kwargs)
        self._fp8_materialize()

    def get_extra_state(self) -> torch.Tensor:
        """TE's ``_extra_state``: the delayed-scaling state (pending updates applied first) in
        TE's format, or an empty uint8 tensor (no state), as TE writes it."""
        state = self.fp8_state
        if state is None:
            return torch.empty(0, dtype=torch.uint8)
        if state.scale_fwd.is_meta:  # no values to write (a meta-built module): an empty meta entry
            return torch.empty(0, dtype=torch.uint8, device="meta")
        self._fp8_flush()
        return fp8.state_to_extra_state(state, self._fp8_recipe)

    def read_extra_state(self, extra: Any) -> tuple[fp8.DelayedScalingState, fp8.DelayedScaling] | None:
        """What :meth:`set_extra_state` would load (checked: the bytes, the number of GEMMs),
        without loading it; None for an empty entry."""
        d = fp8.read_extra_state(extra)
        if d is None or "scale_fwd" not in d:
            return None
        state = fp8.state_from_extra_state(extra, self._fp8_gemms, device=self._fp8_device())
        recipe = (
            d["recipe"]
            if isinstance(d["recipe"], fp8.DelayedScaling)
            else fp8.DelayedScaling(amax_history_len=state.history_len)
        )
        return state, recipe

    def set_extra_state(self, extra: Any) -> None:
        """Load TE's ``_extra_state`` (or ours): the delayed-scaling state and its recipe; an
        empty entry (no FP8, or a stateless recipe) changes nothing."""
        loaded = self.read_extra_state(extra)
        if loaded is not None:
            self._fp8_set(*loaded)


def reset_state(m: FP8Module) -> None:
    """The construction-time delayed-scaling state (scales 1, histories 0, nothing pending), as
    ``reset_parameters`` makes it: :meth:`FP8Module._fp8_materialize` with ``reset``."""
    m._fp8_materialize(reset=True)
