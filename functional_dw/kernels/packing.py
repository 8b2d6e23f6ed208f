"""A group's tensors as one ``[E, ...]`` buffer, and small helpers over a group of weights
(``Weights``: a sequence of E ``[N, K]`` tensors or one ``[E, N, K]`` tensor).
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Iterable, Sequence
from typing import Any, Union

import torch

from .._checks import PLAIN_TYPES

__all__ = ["Weights", "as_one_buffer", "out_in", "packed", "per_expert", "stacked"]


# NOTE: [One buffer] E weights that are consecutive slices of one buffer (``nn.GroupedLinear``'s
# parameters, ``list(w_ENK)``, Megatron's contiguous ``main_grad`` buffer) are read, and written,
# in place as one ``[E, N, K]`` tensor: :func:`packed` recognises them, :func:`stacked` falls back
# to one copy (``torch.stack``) for separately made tensors.

Weights = Union[Sequence[torch.Tensor], torch.Tensor]


def out_in(w_ENK: Weights) -> tuple[int, int]:
    """(N, K) of a group's weights (no ``w_ENK[0]`` view of a stacked tensor: that is an op)."""
    N, K = (w_ENK if isinstance(w_ENK, torch.Tensor) else w_ENK[0]).shape[-2:]
    return N, K


_REQUIRES_GRAD, _DTYPE = operator.attrgetter("requires_grad"), operator.attrgetter("dtype")


def per_expert(scales: Any, amaxes: Any, n: int) -> Iterable[tuple[Any, Any]]:
    """(scale, amax) of each of ``n`` tensors (NOTE: [FP8 operands]): delayed scaling's
    ``scales``/``amaxes`` as strided ``[E]`` views or sequences of 0-d views, or ``(None, None)``
    each without them (``amaxes`` None: no amax recorded)."""
    if scales is None:
        return itertools.repeat((None, None), n)
    flat = lambda v: v.reshape(-1) if isinstance(v, torch.Tensor) else v  # noqa: E731  (a 0-d one for E=1)
    return zip(flat(scales), flat(amaxes) if amaxes is not None else itertools.repeat(None))


def packed(ts: Sequence[torch.Tensor], layout_only: bool = False) -> torch.Tensor | None:
    """One ``[E, ...]`` view over ``ts`` (no copy) when they are contiguous tensors at
    consecutive addresses of one buffer (NOTE: [One buffer]); else None. ``ts`` share shape,
    dtype and device (the layers check that first; the dtype is checked again). Also None where
    addresses are unknown (while tracing for ``torch.compile``, fake tensors, tensor
    subclasses at any position, functorch's wrappers), and where autograd would have to record the view (grad
    mode on and a tensor requires grad: every expert's gradient would flow to ``ts[0]``);
    :func:`stacked` then copies, differentiably. Costs about 0.4 us per tensor on the host."""
    if torch.compiler.is_compiling() or not ts:
        return None
    t0 = ts[0]
    if not set(map(type, ts)) <= PLAIN_TYPES or not t0.numel() or t0.layout != torch.strided:
        return None  # (every expert's type: a subclass anywhere keeps its semantics, as at ts[0])
    if not layout_only and torch.is_grad_enabled() and any(map(_REQUIRES_GRAD, ts)):
        return None  # (``layout_only``: the layout alone, for a plan; the caller decides per call)
    if torch._C._functorch.peek_interpreter_stack() is not None and any(
        torch._C._functorch.is_functorch_wrapped_tensor(t) for t in ts
    ):
        return None
    step, dtype = t0.numel() * t0.element_size(), t0.dtype
    try:
        ptrs = list(map(torch.Tensor.data_ptr, ts))  # (meta: offsets from 0; C loops: E experts)
    except (RuntimeError, TypeError):  # a tensor without storage (TypeError: not a tensor)
        return None
    if ptrs != list(range(ptrs[0], ptrs[0] + len(ts) * step, step)):
        return None
    if not all(map(torch.Tensor.is_contiguous, ts)) or set(map(_DTYPE, ts)) != {dtype}:
        return None
    if t0.untyped_storage().nbytes() < (t0.storage_offset() + len(ts) * t0.numel()) * t0.element_size():
        return None  # the addresses run past t0's storage: not one buffer (inside it: one device)
    return t0.detach().as_strided((len(ts), *t0.shape), (t0.numel(), *t0.stride()))  # (no reference to ts[0])


def as_one_buffer(ts: Sequence[torch.Tensor]) -> torch.Tensor:
    """The ``[E, ...]`` view over ``ts`` that :func:`packed` finds, without its checks: for a
    caller whose plan found ``ts`` one buffer (same identities and addresses since: NOTE: [Plan
    once, run lean]) and whose autograd records no view (no grad mode, or no tensor requiring
    grad)."""
    t0 = ts[0]
    return t0.detach().as_strided((len(ts), *t0.shape), (t0.numel(), *t0.stride()))


def stacked(ts: Sequence[torch.Tensor]) -> torch.Tensor:
    """``ts`` as one ``[E, ...]`` tensor: the :func:`packed` view, else a copy (``torch.stack``)."""
    view = packed(ts)
    return view if view is not None else torch.stack(list(ts))
