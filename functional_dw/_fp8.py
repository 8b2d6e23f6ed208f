"""The layers' FP8 entry point: a call's FP8 arguments (:class:`Args`), the autograd rules of an
FP8 layer (:func:`no_jvp`, :func:`check_first_order`), and :mod:`.fp8_plan`'s API (the
:class:`Plan` base, :func:`plan`, :func:`family`, the checks), with the built-in recipe families
registered by importing their modules (``fp8_te_plan.py``, ``fp8_rowwise_plan.py``; NOTE: [FP8
kernels by family]).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

from . import _checks, fp8_rowwise_plan, fp8_te_plan  # noqa: F401  (each registers its recipes' family)
from .fp8_plan import (
    FAMILIES,
    Plan,
    as_recipe,
    check_dims,
    family,
    plan,
    plan_key,
    refuse_compile,
    register_family,
    with_usage,
)

__all__ = [
    "FAMILIES",
    "Args",
    "Plan",
    "as_recipe",
    "check_dims",
    "check_first_order",
    "NOT_TWICE",
    "tensors_of",
    "dead_level",
    "family",
    "no_jvp",
    "plan",
    "plan_key",
    "refuse_compile",
    "register_family",
    "unpack_args",
    "wgrad_possible",
    "with_usage",
]


class Args:
    """``(recipe, fp8_state)`` as ONE opaque argument of the autograd bridge. A
    :class:`~functional_dw.fp8.DelayedScalingState` is a pytree node: passed as it is, its
    tensors would become inputs of the autograd Function; this wrapper is not a node, so the
    bridge holds it by reference (the state is written in place, never differentiated)."""

    __slots__ = ("recipe", "state", "keep_x")

    def __init__(self, recipe: Any, state: Any, keep_x: bool = True) -> None:
        # keep_x: whether forward keeps x's FP8 copy (False: every weight is frozen, wgrad never runs)
        self.recipe, self.state, self.keep_x = recipe, state, keep_x

    def __repr__(self) -> str:
        return f"fp8.Args(recipe={self.recipe!r}, state={self.state!r})"


def wgrad_possible(weights: Any) -> bool:
    """Whether a weight gradient may be asked of this call: some weight requires grad, or a
    functorch transform is active (its levels decide what they differentiate). With FP8 the
    layers keep x's FP8 copy (wgrad's operand) only then, as TE keeps it only for a weight that
    requires grad. (Direct ``*_fwd`` calls always keep it: a pure forward cannot know.)"""
    if torch._C._functorch.peek_interpreter_stack() is not None:
        return True
    ws = [weights] if isinstance(weights, torch.Tensor) else weights
    return any(isinstance(w, torch.Tensor) and w.requires_grad for w in ws)


def unpack_args(args: Args | None) -> tuple[Any, Any]:
    """(recipe, fp8_state) of an :class:`Args` (None, None without one)."""
    return (None, None) if args is None else (args.recipe, args.state)


def no_jvp(p: Plan | None, layer: str) -> None:
    """Forward mode has no rule for an FP8 layer: raise saying so (nothing without FP8)."""
    if p is not None:
        raise NotImplementedError(
            f"{layer}: forward-mode AD (torch.func.jvp, jacfwd, hessian) is not defined for FP8 layers: "
            "quantization has no derivative, and backward's straight-through rule (dy and the weights "
            "quantized, x's saved FP8 copy) has no forward-mode counterpart. Use reverse mode "
            "(backward, torch.func.grad/vjp/jacrev), or recipe=None"
        )


def tensors_of(saved: Any) -> list:
    """The tensors of a saved input or its FP8 copy (a tensor, a dataclass of them:
    RowwiseActivation, or a list or tuple of either: one per expert); [] for anything else."""
    if isinstance(saved, torch.Tensor):
        return [saved]
    if isinstance(saved, (list, tuple)):
        return [t for v in saved for t in tensors_of(v)]
    if dataclasses.is_dataclass(saved):
        return [v for f in dataclasses.fields(saved) if isinstance(v := getattr(saved, f.name), torch.Tensor)]
    return []


def _transform_differentiates(top: Any, dy: torch.Tensor, weights: Sequence[torch.Tensor], copies: list) -> bool:
    """Under torch.func (``top``: the innermost level): whether a level other than the one running
    this backward tracks dy, a weight (dgrad reads their FP8 copies, with no graph back) or the
    record's copies of x (that level differentiates through x, which quantization cut: the copy
    itself never requires grad)."""
    func = torch._C._functorch
    if any(_checks.has_dead_wrapper(t) for t in (dy, *weights, *copies)):
        # a vjp_fn run inside a live transform (NOTE: [A transform's dead level] in _steps.py):
        # every live level is outside this backward and may differentiate it through x
        live = retrieve_all_functorch_interpreters()
        return any(i.key() in (func.TransformType.Grad, func.TransformType.Jvp) for i in live)
    own = top.level() if top.key() == func.TransformType.Grad else None  # grad(): backward runs at its level
    for t in (dy, *weights, *copies):
        copy = any(t is c for c in copies)
        while func.is_functorch_wrapped_tensor(t):
            if func.is_gradtrackingtensor(t) and func.maybe_get_level(t) != own and (t.requires_grad or copy):
                return True
            t = func.get_unwrapped(t)
    return False


def dead_level(saved: Any) -> contextlib.AbstractContextManager:
    """Around a composite's backward (grouped_mlp): where its record's ``saved`` tensors are
    wrappers of an exited torch.func level (a vjp_fn's backward: NOTE: [A transform's dead
    level] in _steps.py), its layers' :func:`check_first_order` know it too, on the records it
    rebuilt in backward (a recomputed h carries no wrapper) and would take for autograd's own
    ``create_graph=True`` (:func:`_checks.transforms_backward`). A no-op elsewhere."""
    if not torch.is_grad_enabled() or not any(_checks.has_dead_wrapper(t) for t in tensors_of(saved)):
        return contextlib.nullcontext()
    return _checks.in_transforms_backward()


NOT_TWICE = (  # ({how}: what differentiates it)
    "a backward through an FP8 layer cannot be differentiated again{how}: quantization has no derivative, so "
    "second-order terms would be silently missing. Take first-order gradients, or use recipe=None"
)


def check_first_order(layer: str, dy: torch.Tensor, weights: Sequence[torch.Tensor], saved: Any = None) -> None:
    """Raise when a backward through an FP8 layer would itself be differentiated: autograd's
    backward with ``create_graph=True`` where dy or a weight requires grad, or under
    ``torch.func`` a dy tracked by a grad level other than the one running this backward (grad
    of grad, ``jacrev(jacrev)``). dy's and the weights' quantizations are not differentiable, so
    a second-order result would silently miss their terms. A single ``torch.func.grad``/``vjp``
    level (which runs backward with a graph of its own) and direct calls of the pure ``*_bwd``
    pass. (Forward mode over an FP8 layer, e.g. ``hessian``, is refused by the jvp rule.)
    ``saved``: the record's copy of x, whose wrappers tell a vjp_fn run inside a live transform.

    Also refused: a dy batched by autograd's legacy vmap (``is_grads_batched=True``,
    ``torch.autograd.functional.jacobian(vectorize=True)``), which has no rules for the
    quantization's ops (``detach``, dtype views) and failed inside them."""
    legacy = getattr(torch._C._functorch, "is_legacy_batchedtensor", None)
    if legacy is not None and not torch.compiler.is_compiling() and legacy(dy):  # (no legacy batching in a graph)
        raise NotImplementedError(
            f"{layer}: batched gradients through an FP8 layer (torch.autograd.grad(..., is_grads_batched=True), "
            "torch.autograd.functional.jacobian(..., vectorize=True)) are not supported: autograd's legacy "
            "batching has no rules for the quantization's ops. Loop over the cotangents, use torch.func.vmap "
            "over torch.func.vjp, or recipe=None"
        )
    if not torch.is_grad_enabled():
        return
    top = torch._C._functorch.peek_interpreter_stack()
    copies = tensors_of(saved)
    if top is not None:
        higher = _transform_differentiates(top, dy, weights, copies)
    elif torch._C._current_autograd_node() is None:
        return  # the pure API called directly, not autograd's backward
    elif _checks.transforms_backward() or any(_checks.has_dead_wrapper(t) for t in (dy, *weights, *copies)):
        # a transform's backward (a vjp_fn's, a vmap rule's): refused lazily (NOTE: [Refused lazily]),
        # or at once where live levels outside it may differentiate it through x (as above)
        higher = _checks.transforms_outside()
    else:  # autograd's backward with create_graph=True
        higher = dy.requires_grad or any(w.requires_grad for w in weights)
    if higher:
        raise NotImplementedError(
            f"{layer}: " + NOT_TWICE.format(how=" (create_graph=True, grad of grad, jacrev of jacrev)")
        )
