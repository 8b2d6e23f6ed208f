"""The DistributedWeight protocol of Transformer Engine 2.20, and the weight bookkeeping
both layers share: materialize, gradient targets (``main_grad``), finalize, version checks.

A DistributedWeight is a ``torch.Tensor`` subclass holding a shard, with
``is_distributed_weight = True`` and::

    materialize_group_for_forward()   -> full weight(s) for the fprop GEMM (tensor or list)
    materialize_group_for_backward()  -> full weight(s) for the dgrad GEMM (tensor or list)
    finalize_group_grads(wgrads)      -> the parameter grad(s): shard-shaped, dummies or None
    grad_buffer()                     -> gathered-shape buffer the fused wgrad GEMM writes into

For a group (GroupedLinear) the leader ``weights[0]`` acts for all; the followers are ignored.
A DW from TE's tests or Megatron works unchanged: only these names are used.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from . import _amp
from ._checks import PLAIN_TYPES, bottom

_SHAPE = operator.attrgetter("shape")
_VERSION = operator.attrgetter("_version")

__all__ = ["DistributedWeight", "is_distributed_weight"]


@runtime_checkable
class DistributedWeight(Protocol):
    is_distributed_weight: bool

    def materialize_group_for_forward(self) -> torch.Tensor | list[torch.Tensor]: ...
    def materialize_group_for_backward(self, **kwargs: Any) -> torch.Tensor | list[torch.Tensor]: ...
    def finalize_group_grads(self, wgrads: Any) -> Any: ...
    def grad_buffer(self) -> torch.Tensor: ...


def is_distributed_weight(w: Any) -> bool:
    """True for an object that declares ``is_distributed_weight``; it must be a tensor."""
    if (
        not torch.compiler.is_compiling()
        and isinstance(w, torch.Tensor)
        and torch._C._functorch.is_functorch_wrapped_tensor(w)
    ):
        w = bottom(w)
    if not getattr(w, "is_distributed_weight", False):
        return False
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"weight: a DistributedWeight must be a torch.Tensor subclass, got {type(w).__name__}")
    return True


# NOTE: [DistributedWeight under torch.compile] A layer whose weights are DistributedWeights
# runs eagerly inside a compiled region (a graph break around the layer, as FSDP1's wrapped
# modules do): its gathers, reduce-scatters and Python bookkeeping are not traceable, and
# dynamo failed on them with an internal error. The layers around it still compile.
NO_COMPILE = "a layer with DistributedWeight weights runs eagerly (collectives and their bookkeeping)"


def any_distributed(weights: Any) -> bool:
    """True when ``weights`` (a tensor or a sequence of them) holds a DistributedWeight."""
    ws = [weights] if isinstance(weights, torch.Tensor) else list(weights)
    # (len, not bool(ws): torch 2.11's dynamo cannot trace bool() of a list, and this runs traced)
    return len(ws) > 0 and bool(getattr(ws[0], "is_distributed_weight", False))


def _as_list(x: Any) -> list:
    return list(x) if isinstance(x, (list, tuple)) else [x]


def materialize(
    params: Sequence[torch.Tensor],
    dw: bool,
    *,
    for_backward: bool,
    like: torch.Tensor | None = None,
    name: str = "weights",
    amp: torch.dtype | None = None,
) -> list[torch.Tensor]:
    """The weights the GEMMs use: ``params`` themselves, or what the DW leader gathers (one
    tensor per weight, of ``like``'s dtype and device when given); under autocast (``amp``, its
    dtype) cast to it after the gather (NOTE: [Autocast] in ``_amp.py``)."""
    if not dw:
        return list(params) if amp is None else _amp.cast_weights(params, amp)
    leader = params[0] if torch.compiler.is_compiling() else bottom(params[0])
    full = leader.materialize_group_for_backward() if for_backward else leader.materialize_group_for_forward()
    full = _as_list(full)
    if amp is not None and all(isinstance(w, torch.Tensor) for w in full):  # (else named below)
        full = _amp.cast_weights(full, amp)
    what = f"{name}: materialize_group_for_{'backward' if for_backward else 'forward'}() of the DistributedWeight"
    if len(full) != len(params):
        raise ValueError(
            f"{what} returned {len(full)} tensor(s) for a group of {len(params)}; it must return one per weight"
        )
    for e, w in enumerate(full):
        if not isinstance(w, torch.Tensor):
            raise TypeError(f"{what} returned a {type(w).__name__} for weight {e}; it must return tensors")
        if like is not None and (w.dtype != like.dtype or w.device != like.device):
            raise TypeError(
                f"{what} returned a {w.dtype} tensor on {w.device} for weight {e}; the layer runs in "
                f"{like.dtype} on {like.device} (x's dtype and device): gather into that"
            )
    return full


def check_materialized(full: Sequence[torch.Tensor], shapes: Sequence[tuple], what: str, name: str = "weights") -> None:
    """Raise if a materialized weight does not have the shape the forward used."""
    if not torch.compiler.is_compiling() and set(map(type, full)) <= PLAIN_TYPES:  # (C loops: this runs once
        try:  # per backward over E experts)
            if list(map(_SHAPE, full)) == list(shapes):
                return
        except RuntimeError:  # a (strided) nested tensor has no .shape: the loop names it
            pass
    for e, (w, shape) in enumerate(zip(full, shapes)):
        if not isinstance(w, torch.Tensor) or w.is_nested or tuple(w.shape) != tuple(shape):
            got = (
                type(w).__name__
                if not isinstance(w, torch.Tensor)
                else "a nested tensor"
                if w.is_nested
                else tuple(w.shape)
            )
            raise ValueError(f"{name}: {what} returned {got} for weight {e}, expected {tuple(shape)}")


def frozen_wgrads(
    params: Sequence[torch.Tensor], shapes: Sequence[tuple], fused: bool, like: torch.Tensor, name: str
) -> list[torch.Tensor]:
    """What a DW group whose weights are all frozen hands ``finalize`` (it still finalizes, once,
    as every rank does): zeros; fused, its own fp32 ``grad_buffer()``s zeroed (the dtype every
    other rank reduces; a buffer holds a gather's leftovers, which a reduce-scatter would add
    into the other ranks' ``main_grad``)."""
    if fused:
        return [b.zero_() for b in grad_targets(params, True, shapes, name)]
    return [like.new_zeros(s) for s in shapes]


def grad_targets(params: Sequence[torch.Tensor], dw: bool, shapes: Sequence[tuple], name: str) -> list[torch.Tensor]:
    """Where the fused wgrad GEMM writes: ``grad_buffer()`` (DW), ``get_main_grad()``
    (Megatron FSDP) or ``main_grad``; each must have the gathered weight's shape. A frozen
    plain weight (``requires_grad=False``) needs no buffer: it gets scratch space, so its
    ``main_grad`` is never written (the decision is per weight, as in TE)."""
    out: list[torch.Tensor | None] = []
    for e, (p, shape) in enumerate(zip(params, shapes)):
        where = name if len(params) == 1 else f"{name}[{e}]"
        if dw:
            buf = p.grad_buffer()
        elif not p.requires_grad:
            out.append(None)
            continue
        elif hasattr(p, "__fsdp_param__") and hasattr(p, "get_main_grad"):
            buf = p.get_main_grad()
        else:
            buf = getattr(p, "main_grad", None)
            if buf is None:
                raise ValueError(
                    f"{where}: fuse_wgrad_accumulation=True needs a `main_grad` buffer on the "
                    "weight (e.g. `w.main_grad = torch.zeros_like(w, dtype=torch.float32)`)"
                )
            p.main_grad = buf  # TE writes it back; harmless for a plain attribute
        if not isinstance(buf, torch.Tensor) or tuple(buf.shape) != tuple(
            shape
        ):  # any strides (kernels copy if they must)
            got = tuple(buf.shape) if isinstance(buf, torch.Tensor) else type(buf).__name__
            raise ValueError(f"{where}: main_grad/grad_buffer() must be a {tuple(shape)} tensor, got {got}")
        if not torch.compiler.is_compiling() and torch._debug_has_internal_overlap(buf) == 1:  # (2: cannot tell)
            raise ValueError(
                f"{where}: main_grad/grad_buffer() has elements that share memory (e.g. an expand); "
                "each weight-gradient element needs its own"
            )
        if not buf.dtype.is_floating_point:
            raise TypeError(f"{where}: main_grad/grad_buffer() is {buf.dtype}; it must be a float tensor (float32)")
        if buf.device != p.device and not dw:
            raise ValueError(f"{where}: main_grad is on {buf.device} but the weight is on {p.device}")
        out.append(buf)
    like = next((b for b in out if b is not None), None)
    for e, b in enumerate(out):
        if b is not None and b.dtype != like.dtype:
            raise TypeError(
                f"{name}[{e}]: main_grad is {b.dtype} but another weight's is {like.dtype}: "
                "the weights of a group share one main_grad dtype (one wgrad GEMM writes them all)"
            )
    return [
        (torch.empty_like(like) if like is not None else p.new_empty(shape, dtype=torch.float32)) if b is None else b
        for b, p, shape in zip(out, params, shapes)
    ]


def weight_grads(
    params: Sequence[torch.Tensor],
    dw: bool,
    fused: bool,
    shapes: Sequence[tuple],
    frozen: bool,
    like: torch.Tensor,
    gemm: Any,
    name: str,
    amp: torch.dtype | None = None,
) -> list[Any]:
    """The wgrad epilogue both layers share: what autograd receives for ``params``.

    ``frozen`` (no weight grad wanted, or fused and every weight frozen): no GEMM; a
    DistributedWeight still finalizes, once, as every rank does (:func:`frozen_wgrads`); plain
    weights get None. Else ``gemm(out, accumulate)`` runs the wgrad product(s) and returns one
    grad per weight: ``out`` the fused targets (``main_grad``, ``grad_buffer()``: :func:`grad_targets`)
    or None, ``accumulate`` TE's rule (:func:`accumulates`); then :func:`finalize`. Under
    autocast (``amp``: the weights were cast to it) an unfused grad is cast back to its
    parameter's dtype (NOTE: [Autocast] in ``_amp.py``); a fused one is in its buffer's."""
    if frozen and not dw:
        return [None] * len(params)
    if frozen:
        wgrads = frozen_wgrads(params, shapes, fused, like, name)
    else:
        out = grad_targets(params, dw, shapes, name) if fused else None
        wgrads = gemm(out, fused and accumulates(params, dw))
    if amp is not None and not fused:
        wgrads = _amp.grads_back(wgrads, params)
    return finalize(params, dw, fused, wgrads, name)


def accumulates(params: Sequence[torch.Tensor], dw: bool) -> bool:
    """TE's rule: a DW's finalize does the accumulation; ``overwrite_main_grad`` overwrites."""
    return not dw and not getattr(params[0], "overwrite_main_grad", False)


def finalize(
    params: Sequence[torch.Tensor], dw: bool, fused: bool, wgrads: list[Any], name: str = "weights"
) -> list[Any]:
    """The grads autograd receives for ``params``.

    DW: whatever ``finalize_group_grads`` returns (a bare tensor for a group of one).
    Fused plain weights: ``None``, or a zero dummy when the weight has
    ``grad_added_to_main_grad`` (Megatron DDP), which is then set to True.
    """
    if dw:
        got = params[0].finalize_group_grads(wgrads[0] if len(wgrads) == 1 else list(wgrads))
        if got is None:
            return [None] * len(params)
        got = _as_list(got)
        if len(got) != len(params):
            raise ValueError(f"{name}: finalize_group_grads returned {len(got)} grad(s) for {len(params)} weights")
        for e, (g, p) in enumerate(zip(got, params)):
            if g is not None and (not isinstance(g, torch.Tensor) or g.shape != p.shape or g.device != p.device):
                what = f"a {type(g).__name__}" if not isinstance(g, torch.Tensor) else f"{tuple(g.shape)} on {g.device}"
                raise ValueError(
                    f"{name}: finalize_group_grads returned {what} for weight {e}; each grad must be None "
                    f"or a tensor shaped like that parameter ({tuple(p.shape)} on {p.device})"
                )
        return got
    if not fused:
        return wgrads
    grads: list[Any] = []
    for p in params:
        if not p.requires_grad:  # frozen: its main_grad was not written
            grads.append(None)
        elif hasattr(p, "grad_added_to_main_grad"):
            p.grad_added_to_main_grad = True
            grads.append(torch.zeros_like(p))
        else:
            grads.append(None)
    return grads


def versions(params: Sequence[torch.Tensor]) -> tuple[int | None, ...]:
    # NOTE: under torch.compile a traced graph has no version counters to read (and the
    # compiled graph owns its inputs): the check is eager-only. Inference tensors have no
    # version counter (None: nothing to check; they cannot change in place outside inference mode).
    if torch.compiler.is_compiling():
        return ()
    try:
        return tuple(map(_VERSION, params))  # (C loops: E experts)
    except RuntimeError:  # an inference tensor has no version counter
        return tuple(None if p.is_inference() else p._version for p in params)


def _shares_storage(p: torch.Tensor, params: Sequence[torch.Tensor]) -> bool:
    """Whether another of ``params`` lives in ``p``'s storage (for an error message only)."""
    try:
        ptr = p.untyped_storage().data_ptr()
        return not p.is_meta and any(q is not p and q.untyped_storage().data_ptr() == ptr for q in params)
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def check_versions(params: Sequence[torch.Tensor], recorded: tuple[int, ...], name: str) -> None:
    """The check autograd's version counter would have done had the weights been saved."""
    if None not in recorded and len(recorded) == len(params):
        try:
            if tuple(map(_VERSION, params)) == recorded:  # (C loops: E experts)
                return
        except RuntimeError:  # became an inference tensor? the loop below says what changed
            pass
    for e, (p, v) in enumerate(zip(params, recorded)):
        if v is not None and (p := bottom(p))._version != v:  # (a torch.func level's weight: its bottom's)
            where = name if len(params) == 1 else f"{name}[{e}]"
            note = (
                (
                    f" ({where} and other weights share one buffer, hence one version counter: any of them "
                    "may be the one that changed)"
                )
                if _shares_storage(p, params)
                else ""
            )
            raise RuntimeError(
                f"{where} was modified in place between forward and backward (version {v} -> "
                f"{p._version}), e.g. by an optimizer step{note}. Its gradient would be computed with the "
                "new values; run backward before updating the weights."
            )
