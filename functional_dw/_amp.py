"""``torch.autocast`` (AMP) in the layers: decided once, at the top of a call (NOTE: [Autocast])."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch

from .kernels.packing import packed

__all__ = ["dtype", "cast", "cast_weights", "grads_back", "off"]

# NOTE: [Autocast]
#   Under ``torch.autocast`` the layers compute what torch's own composition (``F.linear`` per
#   expert, ``torch.cat``) computes under it, as ``torch.amp.custom_fwd(cast_inputs=...)`` runs
#   a custom op: the differentiable call (``linear``, ``grouped_linear``, ``grouped_mlp``, the
#   modules) reads the autocast dtype of x's device type once, at its top (:func:`dtype`), casts
#   x and the biases to it there (autograd records the casts, so their grads come back in the
#   caller's dtypes), and runs with autocast off (:func:`off`, also in backward, which autograd
#   may run inside the autocast region): the residual record, the kernels and backward see one
#   dtype, and what runs in fp32 on purpose (``main_grad``'s products, the FP8 emulation) stays
#   fp32.
#
#   The weights are cast where they are materialized (``distributed_weight.materialize``), in
#   forward and again in backward, as a DistributedWeight is gathered: the record holds the
#   parameters themselves (NOTE: [Why weights are context, not leaves]), so a DistributedWeight
#   is cast after its gather, the fused wgrad GEMM writes the parameter's own ``main_grad`` at
#   its dtype, a group in one buffer is cast as one tensor whose slices are again one buffer
#   (:func:`cast_weights`), and a weight's grad is cast back to the parameter's dtype
#   (``distributed_weight.weight_grads``): what autograd gives through torch's cast. Router
#   probs are not cast (Megatron keeps them fp32; their grad comes in their dtype). As torch's
#   autocast, float64 tensors are never cast. FP8 recipes quantize from the autocast dtype, the
#   activations' dtype, as TE's modules do under ``torch.autocast``. The pure API (``*_fwd``,
#   ``*_bwd``) computes in the dtypes it is given, with autocast off: its caller casts (as
#   ``custom_fwd(cast_inputs=...)`` does), so the record and its backward agree.
#
#   The plan cache keys on the autocast dtype (it is one of the call's ``plan.Options``), so a
#   plan made outside autocast is not reused inside it, nor across its dtypes.

_NULL = contextlib.nullcontext()
# The device types autocast serves, asked once here (torch 2.11's dynamo cannot trace
# ``torch.amp.is_autocast_available``: a graph break at every call under autocast), and
# privateuse1 by the name its backend gives it when asked (torch_npu's "npu": :func:`_served`).
_AUTOCAST_TYPES = frozenset(
    t
    for t in ("cpu", "cuda", "xpu", "mps", "hpu", "mtia", "maia", "xla", "ipu", "privateuseone")
    if torch.amp.is_autocast_available(t)
)


def _served(device_type: str) -> bool:
    """``torch.amp.is_autocast_available(device_type)``, in calls dynamo traces."""
    return device_type in _AUTOCAST_TYPES or device_type == torch._C._get_privateuse1_backend_name()


def dtype(x: Any) -> torch.dtype | None:
    """The dtype a differentiable call on ``x`` runs in: ``torch.get_autocast_dtype`` of x's
    device type where autocast is on for it, else None (NOTE: [Autocast])."""
    if not torch._C._is_any_autocast_enabled() or not isinstance(x, torch.Tensor):
        return None
    device_type = x.device.type
    if not _served(device_type) or not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def _castable(t: Any, dt: torch.dtype) -> bool:
    """What autocast casts: a floating tensor of another dtype, not float64 (torch's rule)."""
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype not in (dt, torch.float64)


def cast(t: Any, dt: torch.dtype) -> Any:
    """``t`` (a tensor, a list of them, or None) in ``dt`` where autocast would cast it;
    anything else as it is (the layer's checks name what is wrong)."""
    if isinstance(t, list):
        return [cast(u, dt) for u in t]
    return t.to(dt) if _castable(t, dt) else t


def cast_weights(ws: Sequence[torch.Tensor], dt: torch.dtype) -> list[torch.Tensor]:
    """A group's materialized weights in ``dt`` where autocast would cast them: weights in one
    buffer (NOTE: [One buffer]) as one cast whose slices are again one buffer, else one cast per
    weight."""
    if _castable(ws[0], dt):
        one = _one_cast(ws, dt)
        if one is not None:
            return one
    return [cast(w, dt) for w in ws]


def grads_back(grads: Sequence[torch.Tensor], params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Each weight grad in its parameter's dtype, what autograd gives through torch's cast (one
    cast where they are one buffer, so they stay one)."""
    dt = params[0].dtype
    if grads[0].dtype != dt and all(p.dtype == dt for p in params):
        one = _one_cast(grads, dt)
        if one is not None:
            return one
    return [g.to(p.dtype) for g, p in zip(grads, params)]


def _one_cast(ts: Sequence[torch.Tensor], dt: torch.dtype) -> list[torch.Tensor] | None:
    """``ts``, consecutive slices of one buffer, as slices of one new buffer in ``dt`` (one cast);
    None where they are not one (:func:`packed`: also where autograd would have to record the
    view, so a cast that must be differentiable is made per tensor)."""
    one = packed(ts) if len(ts) > 1 else None
    return None if one is None else list(one.to(dt).unbind(0))


def off(t: Any) -> Any:
    """A context with autocast off for ``t``'s device type while the layer's own ops run; a
    null context where no autocast is on (NOTE: [Autocast])."""
    if not torch._C._is_any_autocast_enabled() or not isinstance(t, torch.Tensor):
        return _NULL
    device_type = t.device.type
    return torch.autocast(device_type, enabled=False) if _served(device_type) else _NULL
