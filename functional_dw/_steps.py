"""The backward steps both layers share (``linear.py``, ``grouped_linear.py``): written once.

A Linear is a group of one: each step takes the layer's parameters as a sequence (``[weight]``
or the E experts'), so the rules for frozen weights, FP8's dy, the weights dgrad reads and the
bias grad are the same for both. (The wgrad epilogue, fused ``main_grad`` and DistributedWeight
finalize included, is :func:`distributed_weight.weight_grads`; the options are one
:class:`plan.Options`.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import _checks, _fp8, distributed_weight as dwp

__all__ = ["check_record", "frozen", "quantize_dy", "dgrad_weights", "bias_grad"]


def check_record(fn: str, res: Any, cls: type, fwd: str, x_field: str) -> None:
    """``res`` is ``fwd``'s record (a ``cls``) and its saved x (field ``x_field``) was not
    changed in place since (the pure API's checks)."""
    _checks.record(fn, res, cls, fwd)
    _checks.check_stamp("x", getattr(res, x_field), res.x_version)


def frozen(weight_grad_wanted: bool, fused: bool, params: Sequence[torch.Tensor]) -> bool:
    """No wgrad GEMM: no weight grad wanted, or fused and every weight frozen (``main_grad``
    untouched)."""
    return not weight_grad_wanted or (fused and not any(p.requires_grad for p in params))


def quantize_dy(
    plan: _fp8.Plan | None,
    layer: str,
    dy_TN: torch.Tensor,
    params: Sequence[torch.Tensor],
    kernels: Any,
    *,
    dgrad: bool,
    wgrad: bool,
    splits: Any = None,
    grouped: bool = False,
) -> Any:
    """With FP8, dy quantized for the GEMMs that run (rowwise for dgrad, columnwise for wgrad;
    per expert when ``splits`` is given), after refusing a backward that would itself be
    differentiated; None without FP8 or without GEMMs."""
    if plan is None:
        return None
    _fp8.check_first_order(layer, dy_TN, params)
    if splits is None:
        return plan.quantize_dy(kernels, dy_TN, dgrad=dgrad, wgrad=wgrad)
    return plan.quantize_dy(kernels, dy_TN, splits, grouped, dgrad=dgrad, wgrad=wgrad)


def dgrad_weights(
    params: Sequence[torch.Tensor],
    distributed: bool,
    like: Any,
    shapes: Sequence[tuple],
    name: str,
    amp: torch.dtype | None,
    wanted: bool,
) -> list[torch.Tensor]:
    """The weights dgrad reads: materialized again (a DistributedWeight gathers in backward,
    never kept from forward; plain weights are themselves; under autocast (``amp``) cast again:
    NOTE: [Autocast] in ``_amp.py``) and checked against forward's shapes. A DistributedWeight
    is gathered even when dx is not ``wanted``: its collectives match across ranks."""
    amp = amp if wanted or distributed else None  # (plain weights no dgrad reads: not cast)
    full = dwp.materialize(params, distributed, for_backward=True, like=like, name=name, amp=amp)
    dwp.check_materialized(full, shapes, "materialize_group_for_backward()", name)
    return full


def bias_grad(
    db: torch.Tensor | None, with_dbias: bool, dy_TN: torch.Tensor, sums: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor | None:
    """The bias grad from the high-precision dy: the wgrad GEMM's fused one when it made it,
    else ``sums(dy_TN)`` (FP8 GEMMs, or no GEMM ran); None when not wanted."""
    if not with_dbias:
        return None
    return db if db is not None else sums(dy_TN)
