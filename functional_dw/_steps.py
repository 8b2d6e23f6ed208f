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
import torch.utils._pytree as pytree
from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

from . import _checks, _fp8, distributed_weight as dwp
from .custom_vjp import custom_vjp

__all__ = [
    "check_record",
    "frozen",
    "quantize_dy",
    "dgrad_weights",
    "bias_grad",
    "differentiated",
    "refused_later",
]


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
    saved: Any = None,
) -> Any:
    """With FP8, dy quantized for the GEMMs that run (rowwise for dgrad, columnwise for wgrad;
    per expert when ``splits`` is given), after refusing a backward that would itself be
    differentiated; None without FP8 or without GEMMs."""
    if plan is None:
        return None
    _fp8.check_first_order(layer, dy_TN, params, saved)
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


# NOTE: [A transform's dead level] ``torch.func.vjp``'s vjp_fn (and jacrev, which vmaps it)
# runs autograd with ``create_graph=True`` after vjp's grad level has exited: the saved
# inputs are then dead wrappers of that level, still ``requires_grad``, whose results the
# vjp_fn unwraps, so nothing can differentiate them at that level: a first-order vjp or
# jacrev is not a second-order gradient. The backward then runs at that dead level, so every
# live level is outside it, the innermost grad level included (a vjp_fn called inside a
# ``grad``: grad of vjp): a tensor any live level tracks, or plain autograd's base tensor
# requiring grad, counts. Where no input is a dead wrapper the innermost grad level is the
# one running the backward: ``torch.func.grad``'s own, never differentiated again, or a
# ``torch.autograd.grad(create_graph=True)`` inside the transform, which that level does
# differentiate afterwards. The two look alike here, so its own wrappers count for a caller
# that can recompute (``below``) and are refused lazily otherwise (NOTE: [Refused lazily]).
def differentiated(dy: Any, inputs: Any, x_wanted: bool = False, below: bool = True) -> bool:
    """Whether this backward will itself be differentiated (autograd's ``create_graph=True``, or
    under ``torch.func`` a dy or saved input tracked by another grad or jvp level than the one
    running it: grad of grad, ``jacrev(jacrev)``, jvp of grad), as ``_fp8.check_first_order``
    tells, where ``inputs`` are the saved inputs the backward's intermediates depend on (for
    grouped_mlp x, w1, bias1, probs: nonlinear in x, so a constant dy differentiated through dx,
    a gradient penalty, counts). Saved intermediates carry no graph back to those inputs, so a
    backward that is differentiated must recompute them (grouped_mlp) or refuse (moe_layer):
    else a second-order gradient silently misses their terms (for x: NOTE: [Saved x]). A direct
    pure ``*_bwd`` call is never differentiated here. ``x_wanted``: autograd asks for x's grad
    where the record holds no x (FP8 keeps its FP8 copy), so x requires grad. ``below``: under a
    transform, also count the innermost grad level's own wrappers (``torch.autograd.grad`` with
    ``create_graph=True`` inside it) and plain autograd beneath it (inputs' base tensors
    requiring grad: a loss on ``torch.func.grad``'s result, then ``backward()``; likewise
    beneath a vjp_fn's dead level), so grouped_mlp recomputes under any ``torch.func.grad``
    whose inputs require grad. A caller that can only refuse passes False, or it would refuse
    every first-order ``torch.func.grad``, and refuses there lazily instead
    (:func:`refused_later`)."""

    if not torch.is_grad_enabled() or torch.compiler.is_compiling() or not isinstance(dy, torch.Tensor):
        return False
    func = torch._C._functorch
    tensors = [t for v in (dy, *inputs) for t in _fp8.tensors_of(v)]  # (FP8 copies: their tensors)
    top = func.peek_interpreter_stack()
    own = top.level() if top is not None and top.key() == func.TransformType.Grad else None
    if own is not None and any(_checks.has_dead_wrapper(t) for t in tensors):  # NOTE: [A transform's dead level]
        own = None
    # a jvp level (jvp of grad, hessian's jacfwd) carries tangents, not requires_grad
    jvp = {i.level() for i in retrieve_all_functorch_interpreters() if i.key() == func.TransformType.Jvp}
    bases, dead = [], False
    for t in tensors:
        while func.is_functorch_wrapped_tensor(t):
            if func.is_dead_tensor_wrapper(t):
                t, dead = func.unwrap_if_dead(t), True
                continue
            if func.is_gradtrackingtensor(t) and ((level := func.maybe_get_level(t)) != own or below):
                if t.requires_grad or level in jvp:
                    return True
            t = func.get_unwrapped(t)
        bases.append(t)
    if torch._C._current_autograd_node() is None:
        return False  # the pure API called directly, not autograd's backward
    if top is None and not dead and not _checks.transforms_backward():  # autograd's own create_graph=True
        return x_wanted or any(t.requires_grad for t in bases)
    # Beneath a transform (or a vjp_fn's dead level) plain autograd may still differentiate what
    # it returns (a loss on torch.func.grad's result, then backward()): NOTE: [Refused lazily]
    return below and any(t.requires_grad for t in bases)


# NOTE: [Refused lazily] A backward that cannot be differentiated (FP8: quantization has no
# derivative; moe_layer's one node: rows saved with no graph back to x) refuses at once where
# a torch.func level or autograd's own ``create_graph=True`` will differentiate it
# (:func:`differentiated`, ``_fp8.check_first_order``). Two cannot be told from first-order
# use there: plain autograd beneath a transform (a first-order ``torch.func.grad`` over a
# module whose parameters require grad, or a vjp_fn run after vjp returned, records this
# backward's ops in autograd's graph of those parameters whether or not anything
# differentiates them later), and the grad level running the backward (its own final
# backward, or a ``torch.autograd.grad(create_graph=True)`` inside the transform, which it
# then differentiates). There the grads are handed back through an identity op whose own
# backward raises: one node where first order never reaches it. (The FP8 grads, made from
# quantized copies, have no graph of their own, so a second-order result used to miss every
# term silently, or came back exactly 0.)
def _refusal_fwd(grads: tuple, sources: tuple, message: str) -> tuple:
    return tuple(g.detach() for g in grads), message  # (new tensors, not views: in-place ops on them run)


def _refusal_bwd(message: str, _: Any) -> tuple:
    raise NotImplementedError(message)


_refusal = custom_vjp(_refusal_fwd, _refusal_bwd, nondiff_argnums=(2,), name="refused_later")


def refused_later(layer: str, why: str, grads: Any, sources: Sequence[Any]) -> Any:
    """``grads`` (a backward's cotangents, a pytree) as given, or, where plain autograd beneath a
    torch.func transform records them (a tensor of ``sources``, the saved inputs and dy, requires
    grad under its wrappers), through an op whose backward raises ``NotImplementedError`` with
    ``layer`` and ``why`` (its ``{how}`` filled in: NOTE: [Refused lazily]). Autograd's own ``create_graph=True`` is
    refused at once by the caller."""
    if not torch.is_grad_enabled() or torch._C._current_autograd_node() is None or torch.compiler.is_compiling():
        return grads
    tensors = [t for v in sources for t in _fp8.tensors_of(v)]
    if torch._C._functorch.peek_interpreter_stack() is None and not _checks.transforms_backward():
        if not any(map(_checks.has_dead_wrapper, tensors)):
            return grads  # autograd's own create_graph=True: refused at once by the caller
    live = tuple(map(_checks.live, tensors))
    if not any(map(_checks.tracked, live)):
        return grads
    leaves, spec = pytree.tree_flatten(grads)
    at = [i for i, g in enumerate(leaves) if isinstance(g, torch.Tensor)]
    message = f"{layer}: " + why.format(how=" (here by autograd beneath or inside a torch.func transform)")
    for i, g in zip(at, _refusal(tuple(leaves[i] for i in at), live, message)):
        leaves[i] = g
    return pytree.tree_unflatten(leaves, spec)
