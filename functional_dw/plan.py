"""Plans: what a layer call decides from metadata alone, decided once per call signature."""

from __future__ import annotations

import operator
import threading
from collections.abc import Hashable
from typing import Any, NamedTuple

import torch

from ._checks import PLAIN_TYPES

__all__ = [
    "Options",
    "PlanCache",
    "eager_plain",
    "options_key",
    "weights_key",
    "tensor_key",
    "choose_path",
    "route",
    "wgrad_grouped",
]


# NOTE: [Plan once, run lean]
#   A layer call has two kinds of work. What depends only on metadata (shapes, dtypes, devices,
#   the weights' layout, the options, the recipe, the torch mode) is decided by ONE function per
#   layer into ONE immutable plan: the argument checks, the kernels, the GEMM path and why, the
#   FP8 plan. What depends on data runs on every call: version stamps, the split counts, the
#   quantization, the GEMMs, the residual record.
#
#   Plans are cached (:class:`PlanCache`) for plain calls, keyed on exactly what they read: a
#   call whose key was seen reuses its plan and skips every metadata check. The key of a group of
#   E weights is every weight's storage address, shape and strides, the group's dtypes and
#   devices (C loops over E), and the first one's storage (base and size: the caching allocator
#   may put separate tensors back to back, and only one storage is one buffer): what the plan's
#   checks and its one-buffer verdict read, so a ``.data`` swap, an in-place ``transpose_``, a
#   re-tied module or a new model built where an old one was freed changes it. (Identity is not
#   in it: equal metadata at equal addresses makes the same decisions.) Calls that are not plain
#   (``torch.compile`` tracing, forward-mode AD, a dispatch mode such as ``FakeTensorMode``,
#   functorch's wrappers at the call, tensor subclasses, DistributedWeights, whose materialized
#   weights are data) plan every time with the same function: the same decisions, no cache.
#   (Under ``torch.func.grad``/``vjp``/``jacrev`` and a folded ``vmap`` the layer's forward runs one
#   level below the transform, on the caller's own tensors: a plain call, sharing its plan.)
#
#   Example: ``grouped_linear(x, m.weights(), splits)`` in a training loop plans at the first
#   step; later steps with any token count and any routing hit the cache (T and the counts are
#   data), also under ``no_grad`` (whether autograd must see the weights' one-buffer view is
#   decided per call), while a call with ``use_grouped_tensor=False``, another dtype or another
#   bias makes a plan of its own; so does a call under ``torch.autocast`` (its dtype is one of
#   the options: NOTE: [Autocast]).


class Options(NamedTuple):
    """A layer call's static options: one nondiff argument of the bridge (NOTE:
    [nondiff_argnums]), never flattened, never differentiated. (No tensors: ``_fdw_static``
    tells the bridge not to look into it.)"""

    _fdw_static = True

    fuse_wgrad_accumulation: bool = False
    use_grouped_tensor: bool | None = None
    backend: Any = None
    fp8: Any = None  # an ``_fp8.Args`` (recipe, state, keep_x) or None
    amp: torch.dtype | None = None  # the autocast dtype the call runs in (NOTE: [Autocast] in ``_amp.py``)


def options_key(opts: Options, fp8_key: Hashable) -> tuple:
    """What a plan reads of the options, for its cache key: every field by type and value
    (``True`` is not ``1``: a flag's check would be skipped), the FP8 arguments by ``fp8_key``
    (``_fp8.plan_key``'s). A field added to :class:`Options` is in every layer's key."""
    return tuple((type(v), v) for v in opts._replace(fp8=fp8_key))


def eager_plain() -> bool:
    """A plain eager call: no tracing, no torch.func transform, no forward-mode AD, no dispatch
    mode (only then is a plan cached; NOTE: [Plan once, run lean])."""
    return (
        not torch.compiler.is_compiling()
        and torch._C._functorch.peek_interpreter_stack() is None
        and torch.autograd.forward_ad._current_level < 0
        and not torch._C._len_torch_dispatch_stack()
    )


def tensor_key(t: torch.Tensor) -> Hashable | None:
    """The metadata of one plain tensor a plan reads (None for a subclass: not cached)."""
    if type(t) not in PLAIN_TYPES or t.is_nested or t.layout != torch.strided:
        return None  # (planned afresh: its checks name what is wrong)
    return t.shape, t.dtype, t.device


_SHAPE, _DTYPE_DEVICE = operator.attrgetter("shape"), operator.attrgetter("dtype", "device")


def weights_key(ws: Any) -> Hashable | None:
    """The key of a group of E plain tensors (NOTE: [Plan once, run lean]): every tensor's
    storage address, shape and strides, and the set of their dtypes and devices, read in C loops
    (about 0.4 us per tensor): what the plan's checks and its one-buffer verdict read. None
    where it cannot be read (a subclass, a nested or sparse tensor, no storage)."""
    if not set(map(type, ws)) <= PLAIN_TYPES:
        return None
    try:
        storage = ws[0].untyped_storage()  # (separate allocations may lie back to back: one buffer is one storage)
        return (
            tuple(map(torch.Tensor.data_ptr, ws)),
            tuple(map(_SHAPE, ws)),
            tuple(map(torch.Tensor.stride, ws)),
            frozenset(map(_DTYPE_DEVICE, ws)),
            storage.data_ptr(),
            storage.nbytes(),
        )
    except (RuntimeError, TypeError, NotImplementedError):
        return None


class PlanCache:
    """A bounded map from call keys to plans (cleared whole when full: a training loop has a
    handful of signatures per layer; a sweep that makes thousands starts again). Thread-safe:
    a plan is immutable, and a lost race makes the same plan twice."""

    def __init__(self, size: int = 1024) -> None:
        self.size, self._plans, self._lock = size, {}, threading.Lock()

    def get(self, key: Hashable) -> Any:
        """The plan kept for ``key``, or None (also for a key that cannot be hashed)."""
        try:
            return self._plans.get(key)
        except TypeError:  # an unhashable option: the call plans afresh (and its checks name it)
            return None

    def put(self, key: Hashable, plan: Any) -> None:
        try:
            hash(key)
        except TypeError:
            return
        with self._lock:
            if len(self._plans) >= self.size:
                self._plans.clear()
            self._plans[key] = plan

    def clear(self) -> None:
        with self._lock:
            self._plans.clear()

    def __len__(self) -> int:
        return len(self._plans)


def choose_path(why_not: str | None, use_grouped_tensor: bool | None) -> tuple[str, str]:
    """(path, reason) from the backend's verdict on the grouped path (``why_not`` None: it can
    run) and the caller's ``use_grouped_tensor``: ``None`` takes the grouped path where it can
    run; ``True`` asks for it (the caller is warned where it cannot); ``False`` refuses it."""
    if use_grouped_tensor is False:
        return "split", "use_grouped_tensor=False"
    if why_not is None:
        return "grouped", "the backend runs these operands grouped"
    return "split", why_not


# NOTE: [Transforms without a rule] ``torch._grouped_mm`` has no forward-mode formula and no
# functorch batching rule, and TE's C++ kernels read raw pointers, so neither can take
# functorch's wrappers (the batched tensors of the backward inside ``vmap(grad(f))`` or
# ``jacrev``, jvp's tangents). Such products run on the reference kernels' split path, which
# torch's transforms handle (same math, reference numerics); under forward-mode AD the
# reference kernels take their split path too. Forward and backward route on their own
# operands: ``jacrev`` batches only backward's dy, so forward may run grouped and backward
# split. (A traced graph holds no wrappers: while compiling, the plan's kernels and path.)
# The MLP's fused activation kernels route here too (``reference=``), more strictly: they have
# no derivative at all, so the reference also runs under forward-mode AD and where autograd
# would record the step.
def route(
    kernels: Any, grouped: bool, *operands: Any, one_path: bool = False, reference: Any = None
) -> tuple[Any, bool]:
    """The kernels and path that run these operands: the plan's, except under a transform the
    GEMMs have no rule for (the one place that decides it; kernels never fall back).
    ``one_path``: products with no other path (RowwiseScaling's one grouped GEMM, whose
    reference ops torch's transforms take) run as planned.

    ``reference``: ``kernels`` are the MLP's activation kernels (``grouped`` passes through) and
    this is their reference, which runs instead of fused ones (no derivative) where autograd
    would record the step (an operand requiring grad with grad mode on: a backward with
    ``create_graph``), under forward-mode AD, on functorch's wrappers, and while compiling for
    the Triton ones (inductor fuses the reference's ops itself)."""
    if reference is not None:
        return _activation_kernels(kernels, reference, operands), grouped
    if one_path or torch.compiler.is_compiling():
        return kernels, grouped
    forward_ad, wrapped = _transformed(operands)
    if getattr(kernels, "name", None) == "torch":
        return kernels, grouped and not (forward_ad or wrapped)
    if wrapped:
        from .kernels.torch_ref import TORCH

        return getattr(kernels, "reference", TORCH), False  # (FP8 on TE: the emulation)
    return kernels, grouped


def _activation_kernels(kernels: Any, reference: Any, operands: tuple) -> Any:
    """:func:`route`'s decision for activation kernels."""
    if kernels is reference:
        return kernels
    if torch.compiler.is_compiling():
        return reference if getattr(kernels, "name", None) == "triton" else kernels
    forward_ad, wrapped = _transformed(operands)
    recorded = torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in operands)
    return reference if forward_ad or wrapped or recorded else kernels


def _transformed(operands: tuple) -> tuple[bool, bool]:
    """(forward-mode AD is active, an operand is a functorch wrapper): the wrappers are looked
    for only under forward-mode AD or a torch.func transform."""
    forward_ad = torch.autograd.forward_ad._current_level >= 0
    transform = forward_ad or torch._C._functorch.peek_interpreter_stack() is not None
    return forward_ad, transform and _any_wrapped(operands)


def _any_wrapped(operands: tuple) -> bool:
    is_wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    for o in operands:
        for t in o if isinstance(o, (list, tuple)) else (o,):
            if isinstance(t, torch.Tensor) and is_wrapped(t):
                return True
    return False


def wgrad_grouped(kernels: Any, dy_TN: torch.Tensor, out: Any) -> bool:
    """Whether the grouped wgrad can write ``out`` (fused ``main_grad``): torch's grouped_mm
    writes only its operands' dtype (CUDA: bf16) and no float64, so an fp32 ``main_grad`` of
    bf16 activations on CUDA, or a float64 one, takes the split path (its products run in
    ``main_grad``'s dtype; a bf16 product cast up would not be fp32-accurate). The CPU's
    grouped_mm takes fp32 operands. (Decided here, from ``out``'s dtype at backward.)"""
    if out is None or getattr(kernels, "name", None) != "torch":
        return True
    dt = out.dtype if isinstance(out, torch.Tensor) else out[0].dtype
    return dt == dy_TN.dtype or not (dy_TN.is_cuda or dt == torch.float64)
