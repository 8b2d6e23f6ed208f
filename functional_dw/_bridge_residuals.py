"""Backward's view of the residuals (:mod:`functional_dw.custom_vjp`): rebuilt from the saved
tensors and the by-reference context, told which gradients autograd wants (NOTE: [Which
gradients]), rebound to each torch.func level's own weights (NOTE: [Context per level]), and,
for a call vmap ran once per element, each element's own (:func:`per_element`, NOTE: [vmap] in
``custom_vjp.py``).

``call`` below is the bridge's ``_BridgeCall`` (its ``rules``, ``in_spec``, ``out_spec``, ``sources``,
``res_spec``, ``elements``, ``in_ids``, ``level``; ``resolve()``), read, never written.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch._C._functorch import (
    TransformType,
    get_unwrapped,
    is_batchedtensor,
    is_functorch_wrapped_tensor,
    unwrap_if_dead,
)
from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

from ._checks import has_dead_wrapper, in_transforms_backward
from ._bridge_tree import flatten_cotangents, output_leaves, unflatten_out
from .distributed_weight import is_distributed_weight
from .residuals import RecordSpec, with_needs

__all__ = ["autograd_mask", "ctx_residuals", "element_refs", "live", "per_element", "rebind_table", "rebuild"]


def ctx_residuals(ctx: Any) -> Any:
    """The residuals again: saved tensors (read once: unpack hooks run on every read) and refs
    (as this functorch level sees them: NOTE: [Context per level])."""
    call = ctx.call
    res = rebuild(call, ctx.saved_tensors, autograd_mask(ctx))
    table = getattr(ctx, "rebind", None)
    return res if not table else _rebind(res, {i: live(t) for i, t in table.items()})


def live(t: torch.Tensor) -> torch.Tensor:
    """``t`` without the wrappers of levels that have exited (``vjp``'s pullback runs after its
    level is gone): what the levels still running track."""
    while (u := unwrap_if_dead(t)) is not t:
        t = u
    return t


def rebuild(call: Any, saved: Any, mask: Any) -> Any:
    """``call``'s residuals from its saved tensors, in ``sources`` order, and its by-reference leaves;
    ``mask``: autograd's ``needs_input_grad`` less the _BridgeCall's slot, or None."""
    saved = iter(saved)
    leaves = [value if kind == "ref" else next(saved) for kind, value in call.sources]
    spec = call.res_spec
    if isinstance(spec, RecordSpec):
        return spec.unflatten(leaves, _needs(call, mask, spec.cls))
    res = spec.unflatten(leaves)  # any pytree, or a record that took the pytree path
    needs = None if torch.compiler.is_compiling() else _needs(call, mask, type(res))
    return res if needs is None else with_needs(res, needs)


# NOTE: [Which gradients] A record with a `needed()` field learns here which inputs
# autograd wants gradients for (shaped like fwd's arguments), so bwd can skip a GEMM.
def autograd_mask(ctx: Any) -> Any:
    """autograd's ``needs_input_grad`` for fwd's arguments (None in forward mode)."""
    mask = getattr(ctx, "needs_input_grad", None)
    return None if mask is None else mask[1:]


def _needs(call: Any, mask: Any, cls: type) -> Any:
    """Which of fwd's arguments autograd wants gradients for, shaped like them, for a record
    with a `needed()` field (NOTE: [Which gradients]); else None."""
    if mask is None or not getattr(cls, "__needs_field__", None):
        return None
    return call.in_spec.unflatten(mask)


# NOTE: [Context per level]
#   Under torch.func, ``fwd`` runs once, below every functorch level, on the fully unwrapped
#   inputs, so a record's by-reference context (a layer's weights and biases: NOTE: [Why
#   weights are context, not leaves]) holds those bottom tensors. Each grad or jvp level above
#   runs ``setup_context`` with its own wrappers of the inputs, then ``bwd`` or ``jvp`` on that
#   ctx; they must compute with *that level's* W, which the levels below it track (a gradient
#   penalty's d/dW, a Hessian's x-W block, jvp of grad), not the bottom W none of them sees.
#   So ``setup_context``, under a transform, maps each tensor the context holds to the level's
#   input that wraps it (``ctx.rebind``: id -> the level's tensor; weights, which outlive the
#   graph; never an activation, which goes through ``save_for_backward``), and
#   :func:`_residuals` rebinds the record to them. (A vmap fold rule's element sources run ``fwd``
#   on that level's inputs: its context may hold a lower level's wrapper, which is matched the
#   same way, anywhere in the input's chain of wrappers.) Saved tensors need nothing: autograd
#   hands each level its own. A call vmap ran per element keeps each element's own context
#   (NOTE: [vmap]). Eager autograd and eager forward mode run ``fwd`` on the caller's tensors:
#   nothing to rebind. Refused, never computed wrong: one tensor reaching the call through two
#   different wrappers (the table cannot tell which context entry is which), a DistributedWeight
#   under nested levels (it keeps its identity: its protocol needs the object), and jvp of jvp
#   (torch runs a Function's jvp rule with forward AD off, so an outer jvp level cannot see it).
def _held(obj: Any, out: dict[int, torch.Tensor]) -> None:
    """Add the tensors ``obj`` holds by reference to ``out`` (by id): a tensor, lists, tuples
    (namedtuples too) and dicts of them, and the fields of residual records, nested."""
    if isinstance(obj, torch.Tensor):
        out[id(obj)] = obj
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _held(v, out)
    elif isinstance(obj, dict):
        _held(list(obj.values()), out)
    elif type(obj).__dict__.get("__saved_fields__") is not None:
        _held(list(obj.__dict__.values()), out)


def _rebind(obj: Any, table: dict[int, torch.Tensor]) -> Any:
    """``obj`` with each tensor it holds (as :func:`_held` walks it) whose id is in ``table``
    replaced by ``table``'s tensor; the same object where nothing changes."""
    if isinstance(obj, torch.Tensor):
        return table.get(id(obj), obj)
    if isinstance(obj, (list, tuple)):
        new = [_rebind(v, table) for v in obj]
        if all(map(operator.is_, new, obj)):
            return obj
        return type(obj)._make(new) if hasattr(type(obj), "_make") else type(obj)(new)
    if isinstance(obj, dict):
        new = {k: _rebind(v, table) for k, v in obj.items()}
        return obj if all(new[k] is v for k, v in obj.items()) else type(obj)(new)
    if type(obj).__dict__.get("__saved_fields__") is not None:
        fields = {k: _rebind(v, table) for k, v in obj.__dict__.items()}
        if all(fields[k] is v for k, v in obj.__dict__.items()):
            return obj
        record = object.__new__(type(obj))
        record.__dict__.update(fields)
        return record
    return obj


def _context(call: Any) -> dict[int, torch.Tensor]:
    """The tensors ``call``'s residuals hold by reference (by id)."""
    leaves = [value if kind == "ref" else None for kind, value in call.resolve()]
    spec, out = call.res_spec, {}
    _held(spec.refs() if isinstance(spec, RecordSpec) else spec.unflatten(leaves), out)
    _held([v for v in leaves if v is not None], out)
    return out


def rebind_table(call: Any, inputs: tuple) -> dict[int, torch.Tensor]:
    """id of each tensor ``call``'s context holds -> this level's input that wraps it (NOTE:
    [Context per level])."""
    held, table = _context(call), {}
    for t in inputs:
        if not isinstance(t, torch.Tensor):
            continue
        u = t
        while is_functorch_wrapped_tensor(u) and id(u := get_unwrapped(u)) not in held:
            pass
        if u is t or id(u) not in held:
            continue  # not wrapped at all, or nothing of it held
        if is_distributed_weight(u):  # keeps its identity; refused where an outer level tracks it
            if sum(is_functorch_wrapped_tensor(v) and not is_batchedtensor(v) for v in _chain(t)) > 1:
                raise NotImplementedError(_DW_NESTED.format(name=call.rules.name))
            continue
        if table.setdefault(id(u), t) is not t:
            raise NotImplementedError(_TWO_WRAPPERS.format(name=call.rules.name))
    return table


def _chain(t: torch.Tensor) -> list[torch.Tensor]:
    """``t`` and each tensor under its functorch wrappers, outermost first."""
    out = [t]
    while is_functorch_wrapped_tensor(t):
        t = get_unwrapped(t)
        out.append(t)
    return out


def element_refs(call: Any, inputs: tuple) -> dict[int, torch.Tensor]:
    """For a call run per element (NOTE: [vmap]): the inputs (by position) any element's context
    holds, and the integer tensors (splits: the context derived from them differs per element,
    and :class:`_PerElement` must see them batched)."""
    found = {k: t for k, t in enumerate(inputs) if isinstance(t, torch.Tensor) and not t.is_floating_point()}
    for element in call.elements:
        if element.elements is not None:
            found.update(element_refs(element, inputs))
        else:
            held = _context(element)
            found.update((k, inputs[k]) for k, i in enumerate(element.in_ids) if i in held)
    return found


_DW_NESTED = (
    "custom_vjp({name}): a DistributedWeight under nested torch.func levels (a derivative of a derivative "
    "through it: a gradient penalty, a Hessian, jvp of grad) is not supported: the layer computes with what "
    "the DistributedWeight materializes, which the outer levels cannot track. Use a plain tensor for such "
    "a transform, or autograd with create_graph=True"
)
_TWO_WRAPPERS = (
    "custom_vjp({name}): one tensor reaches this call through two different torch.func wrappers (e.g. a "
    "weight passed both as the function's argument and closed over from outside it); which use is which "
    "cannot be told apart in a higher-order transform. Pass it one way (or a .clone() for the other)"
)


def per_element(ctx: Any, rule: str, grads: tuple) -> tuple:
    """``bwd`` (``rule="bwd"``: grads, the cotangent leaves) or ``jvp`` (tangents, the output
    tangent leaves) of a call vmap ran per element (NOTE: [vmap])."""
    refs = getattr(ctx, "element_refs", None) or {}
    saved = ctx.saved_tensors  # (read once: unpack hooks run on every read)
    job = _Job(ctx.call, rule, autograd_mask(ctx), len(saved), len(grads), tuple(refs), _outside(saved))
    return _PerElement.apply(job, *saved, *grads, *refs.values())


def _outside(saved: tuple) -> bool:
    """A vjp_fn's backward (saved tensors of its exited level) with live grad or jvp levels
    around it, which the per-element run will no longer show (:func:`_checks.transforms_outside`)."""
    live = (TransformType.Grad, TransformType.Jvp)
    if not any(i.key() in live for i in retrieve_all_functorch_interpreters()):
        return False
    return any(has_dead_wrapper(t) for t in saved if isinstance(t, torch.Tensor))


class _Job:
    """One per-element rule: the call and how :class:`_PerElement`'s inputs split."""

    __slots__ = ("call", "rule", "mask", "n_saved", "n_grads", "ref_positions", "outside")

    def __init__(self, call: Any, rule: str, mask: Any, n_saved: int, n_grads: int, refs: tuple, outside: bool) -> None:
        self.call, self.rule, self.mask, self.n_saved, self.n_grads = call, rule, mask, n_saved, n_grads
        self.ref_positions, self.outside = refs, outside

    def run(self, element: Any, leaves: Any) -> tuple:
        """The rule on one element: its saved tensors, grads (or tangents) and refs."""
        saved, grads = leaves[: self.n_saved], leaves[self.n_saved : self.n_saved + self.n_grads]
        refs = dict(zip(self.ref_positions, leaves[self.n_saved + self.n_grads :]))
        if element.elements is not None:  # vmap of vmap: this element was itself run per element
            job = _Job(element, self.rule, self.mask, self.n_saved, self.n_grads, self.ref_positions, self.outside)
            return _PerElement.apply(job, *saved, *grads, *refs.values())
        res = rebuild(element, saved, self.mask)
        res = _rebind(res, {element.in_ids[k]: live(t) for k, t in refs.items()})
        rules = element.rules
        if self.rule == "jvp":
            return tuple(output_leaves(rules.jvp(res, element.in_spec.unflatten(grads)), element.out_spec))
        d_args = flatten_cotangents(rules.bwd(res, unflatten_out(grads, element.out_spec)), element.in_spec, rules)
        return tuple(g if self.mask is None or self.mask[i] else None for i, g in enumerate(d_args))


_AGAIN = (
    "custom_vjp: differentiating the backward (or jvp) of a layer that vmap ran once per batch element "
    "again inside that vmap is not supported (e.g. vmap(grad(gradient penalty))). vmap runs a call per "
    "element where its weights or splits are batched (an ensemble) or the pair has no rule that folds "
    "the batch (grouped_mlp, moe_layer, FP8 layers). Take the outer derivative outside the vmap "
    "(grad(vmap(...)) works), or batch only x through linear or grouped_linear without FP8"
)


class _PerElement(torch.autograd.Function):
    """A looped call's backward or jvp as a Function whose vmap rule slices the level's batched
    tensors and runs each element's rule on that element's own residuals (NOTE: [vmap])."""

    @staticmethod
    def forward(job: _Job, *leaves: Any) -> tuple:  # type: ignore[override]
        # Nothing batched at the looping level: none of what the rule reads differs between the
        # elements (saved tensors, weights, splits all come in as leaves), so any one will do.
        return job.run(job.call.elements[0], leaves)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple:
        raise NotImplementedError(_AGAIN)

    @staticmethod
    def jvp(ctx: Any, *tangents: Any) -> tuple:
        raise NotImplementedError(_AGAIN)

    @staticmethod
    def vmap(info: Any, in_dims: tuple, job: _Job, *leaves: Any) -> tuple:
        # This level is the vmap that ran the call per element, or another one (jacrev's and
        # jacfwd's basis, an outer vmap): then one application per its element, each of which
        # reaches the looping level below.
        mine = torch._C._functorch.maybe_current_level() == job.call.level
        columns = []
        with in_transforms_backward(
            job.outside
        ):  # (the rule's create_graph is the transform's; this op refuses lazily)
            for i in range(info.batch_size):
                sliced = [t if d is None or t is None else t.select(d, i) for t, d in zip(leaves, in_dims[1:])]
                columns.append(job.run(job.call.elements[i], sliced) if mine else _PerElement.apply(job, *sliced))
        out = tuple(None if c[0] is None else torch.stack(c) for c in zip(*columns))
        return out, tuple(None if o is None else 0 for o in out)
