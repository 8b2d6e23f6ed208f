"""The plan's runner (NOTE: [The plan's runner]): a planned layer call as one autograd node, the
bridge's (:mod:`functional_dw.custom_vjp`) work a cached plan makes unnecessary left out."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from ._bridge_residuals import ctx_residuals
from ._bridge_tree import FlatSpec, fresh_outputs, kept_residuals
from .custom_vjp import c_apply, needs_grad, transformed

__all__ = ["Planned", "run_planned"]


# NOTE: [The plan's runner]
#   A layer call that matches a cached plan (NOTE: [Plan once, run lean] in ``plan.py``) has
#   nothing left to learn about its structure: its arguments flatten flat (tensors, lists of
#   them, None: ``FlatSpec``), it returns one tensor and one record, and its own checks already
#   ran when the plan was made. Such a call, when it is a plain eager one with a gradient to
#   take, may skip the bridge's generic work (the nondiff split, the _BridgeCall, the contract
#   checks on fwd's result, the output classification): the layer hands :func:`run_planned`
#   its differentiable arguments and a step, ``fwd`` (the pair's own, its options closed over)
#   and ``bwd`` (the pair's own, less the checks that the plan and autograd already made). The
#   record is kept as every bridge keeps it (NOTE: [What goes where]): tensors through
#   ``save_for_backward`` (saved-tensor hooks see them and only them; autograd checks their
#   versions), the rest on ``ctx`` by reference; backward never mutates ``ctx`` (NOTE: [Backward
#   is re-entrant]) and fills the record's needs (NOTE: [Which gradients]). Anything else (a
#   transform, forward-mode AD, a compiler, no gradient to take) returns None, and the layer
#   takes its bridge.
class Planned(NamedTuple):
    """A planned call's step (NOTE: [The plan's runner]); also its ``rules`` in error messages."""

    name: str
    fwd: Callable[..., tuple[torch.Tensor, Any]]  # (*args) -> (out, record)
    bwd: Callable[[Any, torch.Tensor], tuple]  # (record, d_out) -> one cotangent per argument
    in_spec: FlatSpec  # the arguments' structure (None where an argument is static)
    static: tuple  # (position, value) of the arguments that are data but no leaves (host splits)
    nondiff: tuple = ()

    def args(self, leaves: tuple) -> tuple:
        """fwd's arguments from the leaves, the static ones back in their places."""
        args = self.in_spec.unflatten(leaves)
        if not self.static:
            return args
        args = list(args)
        for i, v in self.static:
            args[i] = v
        return tuple(args)


class _PlannedCall(NamedTuple):
    """What a planned node keeps on ``ctx`` (as ``ctx.call``: ``ctx_residuals`` reads it as it
    reads a :class:`_BridgeCall`): the step, and how the record is rebuilt from the saved tensors."""

    step: Planned
    sources: list
    res_spec: Any

    @property
    def in_spec(self) -> FlatSpec:
        return self.step.in_spec


class _PlannedRun(torch.autograd.Function):
    """One planned call (NOTE: [The plan's runner]). Inputs: the :class:`Planned` step, then
    the arguments' leaves; output: ``fwd``'s one tensor."""

    @staticmethod
    def forward(ctx: Any, step: Planned, *leaves: Any) -> torch.Tensor:  # type: ignore[override]
        out, res = step.fwd(*step.args(leaves))
        (fresh,) = fresh_outputs((out,), leaves)
        sources, saved, spec = kept_residuals(res, leaves, (out,), (fresh,))
        ctx.save_for_backward(*saved)
        ctx.call = _PlannedCall(step, sources, spec)
        return fresh

    @staticmethod
    def backward(ctx: Any, d_out: torch.Tensor) -> tuple:  # type: ignore[override]
        step, needs = ctx.call.step, ctx.needs_input_grad
        grads = step.in_spec.cotangent_leaves(step.bwd(ctx_residuals(ctx), d_out), step)
        return (None, *[g if needs[1 + i] else None for i, g in enumerate(grads)])  # (as _Bridge.backward)


def run_planned(name: str, fwd: Callable, bwd: Callable, args: tuple, static: tuple = ()) -> torch.Tensor | None:
    """``fwd(*args)``'s output as one planned autograd node (NOTE: [The plan's runner]); None
    where the call is not a plain eager one with a gradient to take (the caller then takes its
    bridge). ``args``: the pair's differentiable arguments, with None at the positions
    ``static`` names (``(position, value)`` pairs: data that is no leaf, fwd gets the value);
    ``bwd`` returns one cotangent per argument (None for the static ones)."""
    if torch.compiler.is_compiling() or transformed():
        return None
    flat = FlatSpec.flatten(args)
    if flat is None or not needs_grad(flat[0]):
        return None
    return c_apply(_planned_function(name), (Planned(name, fwd, bwd, flat[1], static), *flat[0]))


@functools.lru_cache(maxsize=None)
def _planned_function(name: str) -> type:
    """:class:`_PlannedRun` under the pair's name, as its bridge is (grad_fn reads e.g.
    ``CustomVJP_grouped_linearBackward`` however the node runs)."""
    tag = "".join(c if c.isalnum() else "_" for c in name)
    return type(f"CustomVJP_{tag}", (_PlannedRun,), {})
