"""TE's ``_extra_state`` (a module's FP8 checkpoint entry), read and written without TE.

TE 2.20 (``module/base.py: get_extra_state``) writes a ``torch.uint8`` tensor holding
``pickle.dumps(state)`` of::

    {"recipe": <transformer_engine.common.recipe.DelayedScaling>,
     "scale_fwd": [3E] fp32, "amax_history_fwd": [H, 3E] fp32,     # CPU tensors
     "scale_bwd": [2E] fp32, "amax_history_bwd": [H, 2E] fp32,
     "extra_fp8_variables": {"fp8_checkpoint": True, "num_gemms": E,
                             "fp8_max_fwd": 448, "fp8_max_bwd": 57344, ...}}

(the scale/history keys only for delayed scaling; ``extra_fp8_variables`` holds every bool,
int, float, str, tuple or list of the module's ``fp8_meta``), and an empty tensor when there is
no FP8 state (FP8 never enabled, or a stateless recipe: current, block, MXFP8, NVFP4 scaling).
``set_extra_state`` also reads TE 1.x checkpoints (no ``"recipe"``: DelayedScaling's
defaults; ``"scale_inv_fwd"/"scale_inv_bwd"`` dropped) and the deprecated ``io.BytesIO``
holding ``torch.save(state)``.

Reading unpickles with an allow-list: any other global raises ``pickle.UnpicklingError``
(NOTE: [Unpickling safely]).

Writing (:func:`state_to_extra_state`) pickles this package's recipe under TE's class names
(``transformer_engine.common.recipe.DelayedScaling``, ``Format``, ``_FormatHelper``): our
fields are TE's, so TE's ``set_extra_state`` loads the result as its own.
"""

from __future__ import annotations

import copyreg
import io
import pickle
import types
from collections import OrderedDict
from typing import Any, Optional

import torch

from .recipe import DelayedScaling, Format, FormatHelper, MMParams, QParams, as_recipe
from .state import FWD_PER_GEMM, DelayedScalingState

__all__ = ["read_extra_state", "state_from_extra_state", "state_to_extra_state"]


# NOTE: [Unpickling safely]
#   TE itself now refuses such pickles unless ``NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1``
#   (``pytorch/_extra_state.py``): unpickling can run arbitrary code. Here the unpickler only
#   resolves an allow-list: torch's tensor and storage rebuilders (storages through
#   ``torch.load(weights_only=True)``), ``collections.OrderedDict``, and names in TE's recipe
#   module, which become inert stand-ins (attributes only; ``Format`` becomes ours) that
#   :func:`.recipe.as_recipe` converts. Any other global raises ``pickle.UnpicklingError``.

_RECIPE_MODULE = "transformer_engine.common.recipe"
_STATE_KEYS = ("scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd")


class _TEObject:
    """An object of TE's recipe module read from a checkpoint without TE: its attributes only."""

    def __new__(cls, *args: Any, **kwargs: Any) -> "_TEObject":
        return object.__new__(cls)

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2:  # (dict, slots)
            state = {**(state[0] or {}), **(state[1] or {})}
        if isinstance(state, dict):
            self.__dict__.update(state)

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in self.__dict__.items())
        return f"<TE {type(self).__name__}({fields})>"


_STAND_INS: dict[str, type] = {}


def _stand_in(name: str) -> type:
    if name not in _STAND_INS:
        _STAND_INS[name] = type(name, (_TEObject,), {"__module__": _RECIPE_MODULE, "__qualname__": name})
    return _STAND_INS[name]


def _load_storage(data: bytes) -> Any:
    """``torch.storage._load_from_bytes``, restricted to what ``weights_only`` loading allows."""
    return torch.load(io.BytesIO(data), weights_only=True)


_ALLOWED: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor_v2"): torch._utils._rebuild_tensor_v2,
    ("torch.storage", "_load_from_bytes"): _load_storage,
    # importing megatron.core swaps torch.storage._load_from_bytes for this name (the same
    # weights_only load), so tensors pickled in a Megatron process name it
    ("megatron.core.safe_globals", "safe_load_from_bytes"): _load_storage,
    ("collections", "OrderedDict"): OrderedDict,
    ("copyreg", "_reconstructor"): copyreg._reconstructor,
    ("builtins", "object"): object,
    (_RECIPE_MODULE, "Format"): Format,
    (_RECIPE_MODULE, "_FormatHelper"): FormatHelper,
}


class _SafeUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        found = _ALLOWED.get((module, name))
        if found is not None:
            return found
        if module == _RECIPE_MODULE:
            return _stand_in(name)
        raise pickle.UnpicklingError(
            f"refusing to unpickle {module}.{name}: an FP8 extra state holds only tensors and "
            f"{_RECIPE_MODULE} objects (functional_dw.fp8 never runs other code from a checkpoint)"
        )


_SAFE_PICKLE = types.ModuleType("functional_dw_fp8_safe_pickle")  # a pickle_module for torch.load
_SAFE_PICKLE.Unpickler = _SafeUnpickler  # type: ignore[attr-defined]
_SAFE_PICKLE.load = lambda f, **kw: _SafeUnpickler(f, **kw).load()  # type: ignore[attr-defined]


def _tensor_bytes(t: torch.Tensor) -> bytes:
    if t.dtype != torch.uint8 or t.dim() != 1:
        raise ValueError(f"an extra state tensor is 1-D uint8 (pickled bytes), got {t.dtype} of shape {tuple(t.shape)}")
    t = t.detach().to("cpu").contiguous()
    try:
        return t.numpy().tobytes()
    except (RuntimeError, ImportError):  # torch without numpy
        return bytes(t.tolist())


def read_extra_state(extra: Any) -> Optional[dict]:
    """The dict in a TE ``_extra_state`` (a uint8 tensor, pickled ``bytes``, or the deprecated
    ``io.BytesIO``), decoded safely (see the module NOTE), with ``"recipe"`` converted to this
    package's recipe (TE 1.x: DelayedScaling's defaults). A recipe this package does not run
    (MXFP8, NVFP4, custom) stays an inert stand-in. None when the entry holds no FP8 state."""
    if extra is None:
        return None
    if isinstance(extra, torch.Tensor):
        if extra.numel() == 0:  # no state (also a meta-built module's entry)
            return None
        if extra.is_meta:
            raise ValueError(
                "the extra state is a meta tensor, which holds no FP8 state: load one saved from a "
                "module on a real device"
            )
        data = _tensor_bytes(extra)
        obj = _SafeUnpickler(io.BytesIO(data)).load() if data else None
    elif isinstance(extra, (bytes, bytearray, memoryview)):
        obj = _SafeUnpickler(io.BytesIO(bytes(extra))).load() if len(extra) else None
    elif isinstance(extra, io.BytesIO):
        extra.seek(0)
        obj = torch.load(extra, map_location="cpu", weights_only=False, pickle_module=_SAFE_PICKLE)
    else:
        raise TypeError(f"extra state must be a uint8 tensor, bytes or io.BytesIO, got {type(extra).__name__}")
    if obj is None:
        return None
    if not isinstance(obj, dict):
        raise ValueError(f"an FP8 extra state holds a dict, got {type(obj).__name__}")
    out = dict(obj)
    if "recipe" not in out:  # TE 1.x: delayed scaling only, and a scale_inv TE 2 no longer keeps
        out["recipe"] = DelayedScaling()
        out.pop("scale_inv_fwd", None)
        out.pop("scale_inv_bwd", None)
    else:
        try:
            out["recipe"] = as_recipe(out["recipe"])
        except (ValueError, TypeError):
            pass  # not a recipe this package runs: kept as read
    return out


def state_from_extra_state(extra: Any, num_gemms: int, *, device: Any = None) -> Optional[DelayedScalingState]:
    """The :class:`DelayedScalingState` in a TE module's ``_extra_state`` (Linear: ``num_gemms=1``;
    GroupedLinear: its ``num_gemms``), on ``device`` (default CPU); None when it holds none
    (empty, or a stateless recipe). The recipe it was saved with: ``read_extra_state(...)["recipe"]``."""
    d = read_extra_state(extra)
    if d is None or "scale_fwd" not in d:
        return None
    missing = [k for k in _STATE_KEYS if k not in d]
    if missing:
        raise ValueError(f"the extra state has scale_fwd but lacks {missing}")
    saved_E = d.get("extra_fp8_variables", {}).get("num_gemms")
    n_fwd = d["scale_fwd"].numel()
    if (saved_E is not None and saved_E != num_gemms) or n_fwd != FWD_PER_GEMM * num_gemms:
        raise ValueError(
            f"the extra state was saved for {saved_E if saved_E is not None else n_fwd / FWD_PER_GEMM:g} "
            f"GEMM(s) ({n_fwd} forward scales, {FWD_PER_GEMM} per GEMM), not num_gemms={num_gemms}"
        )
    t = {k: d[k].to(device=device or "cpu", dtype=torch.float32) for k in _STATE_KEYS}
    return DelayedScalingState(t["amax_history_fwd"], t["scale_fwd"], t["amax_history_bwd"], t["scale_bwd"], num_gemms)


_TE_NAMES = {
    DelayedScaling: "DelayedScaling",
    Format: "Format",
    FormatHelper: "_FormatHelper",
    MMParams: "MMParams",
    QParams: "QParams",
}


class _TEPickler(pickle._Pickler):  # the Python pickler: its save_global can be overridden
    """Pickles this package's recipe classes under TE's names."""

    def save_global(self, obj: Any, name: Optional[str] = None) -> None:
        te_name = _TE_NAMES.get(obj) if isinstance(obj, type) else None
        if te_name is None:
            return super().save_global(obj, name)
        if self.proto >= 4:
            self.save(_RECIPE_MODULE)
            self.save(te_name)
            self.write(pickle.STACK_GLOBAL)
        else:
            self.write(pickle.GLOBAL + f"{_RECIPE_MODULE}\n{te_name}\n".encode())
        self.memoize(obj)


def state_to_extra_state(state: DelayedScalingState, recipe: Any = None) -> torch.Tensor:
    """``state`` as TE's ``get_extra_state`` writes it: a 1-D uint8 tensor of the pickled dict
    (module docstring), which TE's ``set_extra_state`` and :func:`state_from_extra_state` load.
    ``recipe`` (ours or TE's DelayedScaling) is saved with it; None saves DelayedScaling's
    defaults with the state's history length (TE sizes the history from the saved recipe)."""
    if not isinstance(state, DelayedScalingState):
        raise TypeError(f"state must be a DelayedScalingState, got {type(state).__name__}")
    r = as_recipe(recipe) if recipe is not None else DelayedScaling(amax_history_len=state.history_len)
    if not isinstance(r, DelayedScaling):
        raise ValueError(f"only DelayedScaling keeps an extra state, got {type(r).__name__}")
    if r.amax_history_len != state.history_len:
        raise ValueError(f"recipe.amax_history_len is {r.amax_history_len} but the state has {state.history_len} rows")
    payload = {"recipe": r}
    for key in _STATE_KEYS:
        payload[key] = getattr(state, key).detach().to("cpu", copy=True)
    payload["extra_fp8_variables"] = {
        "fp8_checkpoint": True,
        "num_gemms": state.num_gemms,
        "fp8_max_fwd": r.fp8_format.value.max_fwd,
        "fp8_max_bwd": r.fp8_format.value.max_bwd,
    }
    buf = io.BytesIO()
    _TEPickler(buf, protocol=pickle.DEFAULT_PROTOCOL).dump(payload)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
