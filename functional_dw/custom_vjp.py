"""One bridge from a pure ``fwd``/``bwd`` pair to a ``torch.autograd.Function``.

The contract, stated once (it is JAX's ``custom_vjp`` contract)::

    fwd(*args)             -> (out, residuals)
    bwd(residuals, d_out)  -> d_args          # one cotangent per arg, same structure

``args``, ``out``, ``residuals`` and ``d_args`` are pytrees. Tensor leaves of ``args`` are the
differentiable inputs; a ``d_args`` leaf may be ``None`` (no gradient). ``residuals`` is
usually a record made with :func:`functional_dw.residuals.residuals`: its tensor leaves are
activations, everything else is context held by reference.

Example::

    @residuals
    class SinResiduals:
        x: torch.Tensor = saved()

    def sin_fwd(x):
        return torch.sin(x), SinResiduals(x)

    def sin_bwd(res, dy):
        return (dy * torch.cos(res.x),)       # a tuple: one cotangent per argument

    sin = custom_vjp(sin_fwd, sin_bwd)
    torch.func.grad(lambda x: sin(x).sum())(torch.ones(3))   # cos(1) three times

The pieces below, one at a time: :class:`_Call` (one call's structure), :class:`_Bridge` (the
Function: ``forward``, ``setup_context``, ``backward``, ``jvp``, ``vmap``, ``apply``), the
transform rules (:func:`_vmap_rule`), and :func:`custom_vjp`, which picks the entry per mode.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch._C._functorch import (
    TransformType,
    get_unwrapped,
    is_batchedtensor,
    is_functorch_wrapped_tensor,
    unwrap_if_dead,
)
from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

from ._checks import PLAIN_TYPES, bottom
from .distributed_weight import is_distributed_weight
from ._bridge_tree import (
    SCALARS,
    fast_pytree,
    flatten_args,
    flatten_cotangents,
    flatten_out,
    fresh_outputs,
    is_tensor,
    output_leaves,
    pair,
    residual_plan,
    tree_of,
    unflatten_out,
)
from .residuals import RecordSpec, with_needs

__all__ = ["custom_vjp"]


# NOTE: [What goes where]
#   Tensor leaves of the residuals go through ``ctx.save_for_backward``, so saved-tensor hooks
#   (offloading, ``save_on_cpu``) see them and only them. Non-tensor leaves and the record's
#   context (weights, DistributedWeight objects, splits, flags) stay on ``ctx`` by reference.
#   A residual tensor that is not an input is also returned from ``forward`` as an extra,
#   non-differentiable output, which is what ``torch.func`` requires of intermediates.

# NOTE: [Backward is re-entrant]
#   ``backward`` reads ``ctx.saved_tensors`` exactly once (unpack hooks run on every read),
#   rebuilds the residuals and calls ``bwd``. It never clears or mutates ``ctx``, so a second
#   ``backward(retain_graph=True)`` repeats exactly the same work.

# NOTE: [One Function]
#   Every mode (eager autograd, ``torch.func``, ``torch.compile``) runs the same setup_context
#   style Function, :class:`_Bridge` (one subclass per pair, named after it). Its ``forward``
#   cannot see ``ctx``, so the structure it learns (the output's pytree spec, how to rebuild
#   the residuals) travels on a :class:`_Call` object, the Function's first input, which
#   ``setup_context`` then keeps on ``ctx``. One rule per mode: NOTE: [autograd], NOTE:
#   [torch.func grad and vjp], NOTE: [jvp], NOTE: [vmap], NOTE: [torch.compile].

# NOTE: [nondiff_argnums]
#   Arguments named by ``nondiff_argnums`` (a layer's options: flags, backend, FP8 recipe) ride
#   on the :class:`_Call` by reference: they are not leaves of the Function (no flattening, no
#   autograd input), and ``bwd`` returns one cotangent per *other* argument, so a layer's
#   backward returns ``(dx, dw, dsplits, dbias)``, not a tuple padded with a None per option.
#   Example: ``custom_vjp(f_fwd, f_bwd, nondiff_argnums=(2,))`` for ``f(x, w, opts)``: ``f_bwd``
#   returns ``(dx, dw)``.

Fwd = Callable[..., tuple[Any, Any]]
Bwd = Callable[..., Any]
VmapRule = Callable[..., Any]


# --- small helpers ---------------------------------------------------------------------------


def _forward_ad_active() -> bool:
    """True inside ``torch.func.jvp`` or an eager ``forward_ad.dual_level``."""
    return torch.autograd.forward_ad._current_level >= 0


def _transformed() -> bool:
    """A torch.func transform or forward-mode AD is active."""
    return torch._C._functorch.peek_interpreter_stack() is not None or _forward_ad_active()


def _needs_grad(in_leaves: Any) -> bool:
    """Can autograd take a gradient through this call? (grad mode on, a tensor requires grad;
    autograd records nothing through inference tensors, whatever their ``requires_grad``.
    Dynamo cannot trace ``is_inference``; a compiled graph sees no inference tensors anyway.)"""
    if not torch.is_grad_enabled():
        return False
    if torch.compiler.is_compiling():
        return any(is_tensor(t) and t.requires_grad for t in in_leaves)
    if torch.is_inference_mode_enabled():  # enable_grad inside inference_mode: torch records nothing
        return False
    for t in in_leaves:  # (a loop: the eager hot path)
        if isinstance(t, torch.Tensor) and t.requires_grad and not t.is_inference():
            return True
    return False


# --- one pair's rules, one call's structure -----------------------------------------------------


class _Rules:
    """What :func:`custom_vjp` was given, and the Function classes named after the pair."""

    __slots__ = ("fwd", "bwd", "primal", "jvp", "vmap", "name", "nondiff", "Function", "Traced")

    def __init__(
        self, fwd: Fwd, bwd: Bwd, primal: Any, jvp: Any, vmap: Any, name: str, nondiff: tuple[int, ...] = ()
    ) -> None:
        self.fwd, self.bwd, self.jvp, self.vmap, self.name, self.nondiff = fwd, bwd, jvp, vmap, name, nondiff
        self.primal = primal or (lambda *args: pair(fwd(*args), name)[0])
        # autograd names a Function's backward node after the class when the class is created:
        # subclass under the pair's name so grad_fn reads e.g. `CustomVJP_linearBackward`.
        tag = "".join(c if c.isalnum() else "_" for c in name)
        self.Function = type(f"CustomVJP_{tag}", (_Bridge,), {})
        # NOTE: [torch.compile] dynamo refuses a Function that defines ``jvp``: the same class
        # with torch's default jvp, used only while compiling.
        default_jvp = staticmethod(torch.autograd.Function.jvp)
        self.Traced = type(f"CustomVJP_{tag}_traced", (self.Function,), {"jvp": default_jvp})


class _Call:
    """One call's structure, the Function's first input (NOTE: [One Function]).

    The caller sets ``rules``, ``in_spec`` (the differentiable arguments' structure: the
    Function's other inputs are its leaves) and ``static`` (the nondiff arguments, by reference). ``forward`` sets ``out_spec`` (None: one tensor), ``n_out`` (the
    outputs before the extra ones) and ``plan``/``res_spec`` (how ``backward`` rebuilds the
    residuals). A vmap rule may leave ``pending``, which makes the plan when first asked
    (NOTE: [vmap])."""

    __slots__ = (
        "rules",
        "in_spec",
        "static",
        "out_spec",
        "n_out",
        "plan",
        "res_spec",
        "pending",
        "out_meta",
        "elements",
        "in_ids",
        "level",
    )

    def __init__(self, rules: _Rules, in_spec: Any, static: tuple = ()) -> None:
        self.rules, self.in_spec, self.static, self.pending, self.out_meta = rules, in_spec, static, None, None
        self.elements: list[_Call] | None = None  # vmap ran one call per element: theirs (NOTE: [vmap])
        self.in_ids: tuple = ()  # such an element's input leaves' bottom tensors, by id (NOTE: [Context per level])
        self.level: int | None = None  # with elements: the functorch level just below that vmap's

    def args(self, leaves: Any, static: Any = True) -> tuple:
        """fwd's arguments from the Function's input leaves and the nondiff arguments (or, with
        ``static=None``, None in their places: vmap's in_dims)."""
        values = self.static if static is True else (static,) * len(self.static)
        return _join(self.rules, self.in_spec.unflatten(leaves), values)

    def adopt(self, inner: "_Call", pending: Any = None) -> None:
        """Take the structure of ``inner``, a call a vmap rule made for this one."""
        self.out_spec, self.n_out, self.plan, self.res_spec = inner.out_spec, inner.n_out, inner.plan, inner.res_spec
        self.pending = pending

    def resolve(self) -> list:
        if self.pending is not None:
            self.plan, self.res_spec = self.pending()
            self.pending = None
        return self.plan


def _split(rules: _Rules, args: tuple) -> tuple[tuple, tuple]:
    """(the differentiable arguments, the nondiff ones) (NOTE: [nondiff_argnums])."""
    if not rules.nondiff:
        return args, ()
    if len(args) <= rules.nondiff[-1]:
        raise TypeError(
            f"custom_vjp({rules.name}): nondiff_argnums={rules.nondiff} but the call has "
            f"{len(args)} positional arguments"
        )
    k = rules.nondiff[0]
    if rules.nondiff == tuple(range(k, len(args))):  # the usual layout: the options come last
        diff, static = args[:k], args[k:]
    else:
        skip = set(rules.nondiff)
        diff, static = tuple(a for i, a in enumerate(args) if i not in skip), tuple(args[i] for i in rules.nondiff)
    for i, v in zip(rules.nondiff, static):
        if _holds_tensor(v):
            raise TypeError(
                f"custom_vjp({rules.name}): argument {i} is or holds a Tensor but nondiff_argnums="
                f"{rules.nondiff} names it: a nondiff argument is held by reference, "
                "so transforms and autograd would "
                "not see it. Pass tensors as differentiable arguments (bwd may return None for them)"
            )
    return diff, static


def _holds_tensor(v: Any) -> bool:
    """A tensor, or a pytree holding one (objects that declare ``_fdw_static``, such as the
    layers' options, are not looked into: they hold none)."""
    if isinstance(v, torch.Tensor):
        return True
    if v is None or type(v) in SCALARS or getattr(type(v), "_fdw_static", False):
        return False
    return any(isinstance(t, torch.Tensor) for t in fast_pytree.tree_leaves(v))


def _join(rules: _Rules, diff: tuple, static: tuple) -> tuple:
    """The arguments again, the nondiff ones back at their positions."""
    if not rules.nondiff:
        return diff
    if rules.nondiff[0] == len(diff):  # trailing
        return (*diff, *static)
    args = list(diff)
    for i, v in zip(rules.nondiff, static):
        args.insert(i, v)
    return tuple(args)


def _run(rules: _Rules, args: tuple, tree: Any, function: type, gate: bool) -> Any:
    """Flatten ``args``, apply ``function`` to the leaves, and give ``fwd``'s output back.
    ``gate``: with no gradient to take, run ``primal`` instead (no residuals, no node)."""
    diff, static = _split(rules, args)
    in_leaves, in_spec = flatten_args(diff, tree)
    if gate and not _needs_grad(in_leaves):
        return rules.primal(*args)
    call = _Call(rules, in_spec, static)
    flat = function.apply(call, *in_leaves)
    return unflatten_out(flat[: call.n_out], call.out_spec)


# --- the Function --------------------------------------------------------------------------------


class _Bridge(torch.autograd.Function):
    """The bridge as one setup_context style Function; :class:`_Rules` subclasses it per pair.
    Inputs: a :class:`_Call`, then the leaves of ``fwd``'s arguments. Outputs: the leaves of
    ``fwd``'s output, then the intermediate residuals (NOTE: [What goes where])."""

    @staticmethod
    def forward(call: _Call, *in_leaves: Any) -> tuple:  # type: ignore[override]
        rules = call.rules
        tree = tree_of(call.in_spec)
        out, res = pair(rules.fwd(*call.args(in_leaves)), rules.name)
        out_leaves, call.out_spec = flatten_out(out, tree, rules.name)
        call.plan, extra, call.res_spec = residual_plan(res, in_leaves, tree, out_leaves)
        call.n_out = len(out_leaves)
        return (*fresh_outputs(out_leaves, in_leaves), *extra)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        call = inputs[0]
        extra = output[call.n_out :]
        if extra:
            ctx.mark_non_differentiable(*extra)
        saved = [
            inputs[1 + i] if kind == "in" else output[i] if kind == "y" else extra[i]
            for kind, i in call.resolve()
            if kind != "ref"
        ]
        ctx.save_for_backward(*saved)
        ctx.call = call
        if torch.compiler.is_compiling():
            return
        if extra or _forward_ad_active():
            _grads_as_given(ctx, call, saved, output)
        if torch._C._are_functorch_transforms_active():  # NOTE: [Context per level]
            if call.elements is None:
                ctx.rebind = _rebind_table(call, inputs[1:])
            else:
                ctx.element_refs = _element_refs(call, inputs[1:])

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple:
        call = ctx.call
        grads = grads[: call.n_out]
        if call.out_meta is not None:  # grads not materialized: zeros for a missing one
            grads = [
                torch.zeros(s, dtype=d, device=v) if g is None else g for g, (s, d, v) in zip(grads, call.out_meta)
            ]
        needs = ctx.needs_input_grad
        if call.elements is not None:  # NOTE: [vmap]
            return (None, *_per_element(ctx, "bwd", grads))
        d_out = unflatten_out(grads, call.out_spec)
        d_args = flatten_cotangents(call.rules.bwd(_residuals(ctx), d_out), call.in_spec, call.rules)
        return (None, *[g if needs[1 + i] else None for i, g in enumerate(d_args)])

    @staticmethod
    def jvp(ctx: Any, _: Any, *tangents: Any) -> tuple:  # NOTE: [jvp]
        call = ctx.call
        if call.rules.jvp is None:
            raise NotImplementedError(f"custom_vjp({call.rules.name}) has no forward-mode rule: pass jvp=...")
        if sum(i.key() == _JVP for i in retrieve_all_functorch_interpreters()) > 1:
            raise NotImplementedError(_JVP_OF_JVP.format(name=call.rules.name))
        if call.elements is not None:  # NOTE: [vmap]
            t_out = _per_element(ctx, "jvp", tangents)
        else:
            t_out = output_leaves(call.rules.jvp(_residuals(ctx), call.in_spec.unflatten(tangents)), call.out_spec)
        n_extra = sum(kind == "out" for kind, _ in call.plan)
        return (*t_out, *[None] * n_extra)

    @staticmethod
    def vmap(info: Any, in_dims: tuple, call: _Call, *in_leaves: Any) -> tuple:
        return _vmap_rule(info.batch_size, in_dims[1:], call, in_leaves)

    # NOTE: [Fast apply] torch's ``Function.apply`` binds the arguments to ``forward``'s
    # signature (``inspect.signature``: ~15 us) on every call of a setup_context Function,
    # for keyword arguments we never pass. With no functorch transform active it then only
    # unwraps dead functorch wrappers and calls the C++ apply (forward, then setup_context);
    # we do just that. Under a transform, torch's own apply (``custom_function_call``).
    @classmethod
    def apply(cls, *args: Any) -> Any:
        """``Function.apply`` without its signature binding when no functorch transform is active
        (NOTE: [Fast apply])."""
        if torch._C._are_functorch_transforms_active():
            return super().apply(*args)
        call, *leaves = args
        if set(map(type, leaves)) <= PLAIN_TYPES:  # (all tensors: unwrapped in one C loop; E experts)
            leaves = map(unwrap_if_dead, leaves)
        else:
            leaves = [unwrap_if_dead(a) if isinstance(a, torch.Tensor) else a for a in leaves]
        return super(torch.autograd.Function, cls).apply(call, *leaves)


# NOTE: [jvp] Forward mode (eager ``dual_level`` or ``torch.func.jvp``) runs the pair's
# ``jvp`` rule on the residuals and the tangents, shaped like the arguments with None where
# there is none (hence not materialized); the extra outputs get no tangent. Only when
# forward mode is on at forward time does ``setup_context`` keep the residuals for it
# (``save_for_forward``: a strong ref, which would defeat offloading).
def _grads_as_given(ctx: Any, call: _Call, saved: list, output: tuple) -> None:
    """Grads and tangents not materialized: backward fills a missing output grad with zeros
    itself, and gets no zeros for the extra outputs (activation-sized intermediates), which it
    ignores. (Dynamo has neither this nor forward mode: a compiled graph's grads are tensors.)

    In forward mode the residuals are also kept for the pair's ``jvp`` rule (NOTE: [jvp])."""
    if call.rules.jvp is not None and _forward_ad_active():
        ctx.save_for_forward(*saved)
    ctx.set_materialize_grads(False)
    call.out_meta = [(o.shape, o.dtype, o.device) for o in output[: call.n_out]]


def _residuals(ctx: Any) -> Any:
    """The residuals again: saved tensors (read once: unpack hooks run on every read) and refs
    (as this functorch level sees them: NOTE: [Context per level])."""
    call = ctx.call
    res = _rebuild(call, ctx.saved_tensors, _mask(ctx))
    table = getattr(ctx, "rebind", None)
    return res if not table else _rebind(res, {i: _live(t) for i, t in table.items()})


def _live(t: torch.Tensor) -> torch.Tensor:
    """``t`` without the wrappers of levels that have exited (``vjp``'s pullback runs after its
    level is gone): what the levels still running track."""
    while (u := unwrap_if_dead(t)) is not t:
        t = u
    return t


def _rebuild(call: _Call, saved: Any, mask: Any) -> Any:
    """``call``'s residuals from its saved tensors, in plan order, and its by-reference leaves;
    ``mask``: autograd's ``needs_input_grad`` less the _Call's slot, or None."""
    saved = iter(saved)
    leaves = [value if kind == "ref" else next(saved) for kind, value in call.plan]
    spec = call.res_spec
    if isinstance(spec, RecordSpec):
        return spec.unflatten(leaves, _needs(call, mask, spec.cls))
    res = spec.unflatten(leaves)  # any pytree, or a record that took the pytree path
    needs = None if torch.compiler.is_compiling() else _needs(call, mask, type(res))
    return res if needs is None else with_needs(res, needs)


# NOTE: [Which gradients] A record with a `needed()` field learns here which inputs
# autograd wants gradients for (shaped like fwd's arguments), so bwd can skip a GEMM.
def _mask(ctx: Any) -> Any:
    """autograd's ``needs_input_grad`` for fwd's arguments (None in forward mode)."""
    mask = getattr(ctx, "needs_input_grad", None)
    return None if mask is None else mask[1:]


def _needs(call: _Call, mask: Any, cls: type) -> Any:
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
#   :func:`_residuals` rebinds the record to them. (A vmap fold rule's element plan runs ``fwd``
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


def _context(call: _Call) -> dict[int, torch.Tensor]:
    """The tensors ``call``'s residuals hold by reference (by id)."""
    leaves = [value if kind == "ref" else None for kind, value in call.resolve()]
    spec, out = call.res_spec, {}
    _held(list(spec.shell.values()) if isinstance(spec, RecordSpec) else spec.unflatten(leaves), out)
    _held([v for v in leaves if v is not None], out)
    return out


def _rebind_table(call: _Call, inputs: tuple) -> dict[int, torch.Tensor]:
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


def _element_refs(call: _Call, inputs: tuple) -> dict[int, torch.Tensor]:
    """For a call run per element (NOTE: [vmap]): the inputs (by position) any element's context
    holds, and the integer tensors (splits: the context derived from them differs per element,
    and :class:`_PerElement` must see them batched)."""
    found = {k: t for k, t in enumerate(inputs) if isinstance(t, torch.Tensor) and not t.is_floating_point()}
    for element in call.elements:
        if element.elements is not None:
            found.update(_element_refs(element, inputs))
        else:
            held = _context(element)
            found.update((k, inputs[k]) for k, i in enumerate(element.in_ids) if i in held)
    return found


_JVP = TransformType.Jvp
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
_JVP_OF_JVP = (
    "custom_vjp({name}): jvp of jvp (jacfwd(jacfwd), nested torch.func.jvp) is not supported: torch runs a "
    "custom Function's jvp rule with forward AD off, so the outer level would silently miss the mixed "
    "terms. Use torch.func.hessian (jacfwd of jacrev), jacrev(jacrev) or jvp of grad"
)


# --- the transform rules -------------------------------------------------------------------------


def _apply_inner(rules: _Rules, args: Any) -> tuple[tuple, _Call]:
    """One call of the Function from inside a vmap rule: (all outputs, its structure)."""
    diff, static = _split(rules, args)
    in_leaves, in_spec = flatten_args(diff, fast_pytree)
    inner = _Call(rules, in_spec, static)
    return rules.Function.apply(inner, *in_leaves), inner


# NOTE: [vmap] The pair's ``vmap`` rule may fold the batch into one unbatched call (e.g.
# x's batch into the token dimension): run it, then ``unfold`` puts the batch back. Without
# a rule, or when it returns None, one call per batch element, stacked.
#
# Under ``vmap(grad(f))`` the grad level then runs ``setup_context`` on our outputs with
# per-element semantics. A folded call's residuals hold folded context (e.g. splits * B),
# so the grad level gets the plan of one element instead: ``fwd`` on element 0, run only
# when asked (:func:`_element_plan`; plain ``vmap`` never asks). A fold shares the weights
# and splits across the batch, so element 0's context is every element's.
#
# A call run per element (batched weights: an ensemble; batched splits) keeps each element's
# call (``call.elements``): their contexts differ (each holds its own weights and routing). A
# grad or jvp level above the vmap then runs its ``bwd``/``jvp`` through :class:`_PerElement`,
# a Function whose own vmap rule, at the looping level, slices the saved tensors, the grads
# and the level's weights (NOTE: [Context per level]) and runs each element's rule on that
# element's residuals; at any other vmap level (jacrev's basis) it applies itself once per
# that level's element. Differentiating that backward once more is refused.
def _vmap_rule(batch_size: int, dims: tuple, call: _Call, in_leaves: tuple) -> tuple:
    """The Function's vmap rule: one call with the batch folded in by the pair's ``vmap`` rule,
    else one call per batch element (NOTE: [vmap])."""
    rules = call.rules
    folded = rules.vmap(batch_size, call.args(dims, static=None), *call.args(in_leaves)) if rules.vmap else None
    if folded is None:
        return _vmap_loop(batch_size, dims, call, in_leaves)
    new_args, unfold = folded
    flat, inner = _apply_inner(rules, new_args)
    call.adopt(inner, functools.partial(_element_plan, call, in_leaves, dims))
    out, out_dims = unfold(unflatten_out(flat[: inner.n_out], inner.out_spec))
    n_extra = len(flat) - inner.n_out
    out_leaves, dims_out = output_leaves(out, inner.out_spec), output_leaves(out_dims, inner.out_spec)
    return (*out_leaves, *flat[inner.n_out :]), (*dims_out, *[None] * n_extra)


def _vmap_loop(batch_size: int, dims: tuple, call: _Call, in_leaves: tuple) -> tuple:
    """One call per batch element; every output stacked along dim 0. ``call`` keeps every
    element's call: each element's backward and jvp read its own context (NOTE: [vmap])."""
    results, elements = [], []
    for i in range(batch_size):
        sliced = [t if d is None else t.select(d, i) for t, d in zip(in_leaves, dims)]
        flat, inner = _apply_inner(call.rules, call.args(sliced))
        inner.in_ids = tuple(id(bottom(t)) if isinstance(t, torch.Tensor) else None for t in sliced)
        results.append(flat)
        elements.append(inner)
    kept = {tuple(kind for kind in e.resolve() if kind[0] != "ref") for e in elements}
    if len(kept) != 1:
        raise NotImplementedError(
            f"custom_vjp({call.rules.name}): under vmap, the batch elements keep different residuals "
            "(fwd saved different tensors for different elements); run the elements one by one"
        )
    call.adopt(inner)
    call.elements, call.level = elements, torch._C._functorch.maybe_current_level()
    flat = tuple(torch.stack(column) for column in zip(*results))
    return flat, (0,) * len(flat)


def _per_element(ctx: Any, rule: str, grads: tuple) -> tuple:
    """``bwd`` (``rule="bwd"``: grads, the cotangent leaves) or ``jvp`` (tangents, the output
    tangent leaves) of a call vmap ran per element (NOTE: [vmap])."""
    refs = getattr(ctx, "element_refs", None) or {}
    saved = ctx.saved_tensors  # (read once: unpack hooks run on every read)
    job = _Job(ctx.call, rule, _mask(ctx), len(saved), len(grads), tuple(refs))
    return _PerElement.apply(job, *saved, *grads, *refs.values())


class _Job:
    """One per-element rule: the call and how :class:`_PerElement`'s inputs split."""

    __slots__ = ("call", "rule", "mask", "n_saved", "n_grads", "ref_positions")

    def __init__(self, call: _Call, rule: str, mask: Any, n_saved: int, n_grads: int, ref_positions: tuple) -> None:
        self.call, self.rule, self.mask, self.n_saved, self.n_grads = call, rule, mask, n_saved, n_grads
        self.ref_positions = ref_positions

    def run(self, element: _Call, leaves: Any) -> tuple:
        """The rule on one element: its saved tensors, grads (or tangents) and refs."""
        saved, grads = leaves[: self.n_saved], leaves[self.n_saved : self.n_saved + self.n_grads]
        refs = dict(zip(self.ref_positions, leaves[self.n_saved + self.n_grads :]))
        if element.elements is not None:  # vmap of vmap: this element was itself run per element
            job = _Job(element, self.rule, self.mask, self.n_saved, self.n_grads, self.ref_positions)
            return _PerElement.apply(job, *saved, *grads, *refs.values())
        res = _rebuild(element, saved, self.mask)
        res = _rebind(res, {element.in_ids[k]: _live(t) for k, t in refs.items()})
        rules = element.rules
        if self.rule == "jvp":
            return tuple(output_leaves(rules.jvp(res, element.in_spec.unflatten(grads)), element.out_spec))
        d_args = flatten_cotangents(rules.bwd(res, unflatten_out(grads, element.out_spec)), element.in_spec, rules)
        return tuple(g if self.mask is None or self.mask[i] else None for i, g in enumerate(d_args))


_AGAIN = (
    "custom_vjp: differentiating the backward (or jvp) of a layer that vmap ran once per batch element "
    "(batched weights or splits, e.g. an ensemble) again inside that vmap is not supported (e.g. "
    "vmap(grad(gradient penalty)) over an ensemble); batch x only, or take the outer derivative outside "
    "the vmap (grad(vmap(...)) works)"
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
        for i in range(info.batch_size):
            sliced = [t if d is None or t is None else t.select(d, i) for t, d in zip(leaves, in_dims[1:])]
            columns.append(job.run(job.call.elements[i], sliced) if mine else _PerElement.apply(job, *sliced))
        out = tuple(None if c[0] is None else torch.stack(c) for c in zip(*columns))
        return out, tuple(None if o is None else 0 for o in out)


def _element_plan(call: _Call, in_leaves: tuple, dims: tuple) -> tuple[list, Any]:
    """The residual plan of batch element 0 (see NOTE: [vmap])."""
    rules = call.rules
    sliced = tuple(t if d is None else t.select(d, 0) for t, d in zip(in_leaves, dims))
    with torch.no_grad():
        _, res = pair(rules.fwd(*call.args(sliced)), rules.name)
    plan, extra, res_spec = residual_plan(res, sliced, tree_of(call.in_spec))
    if extra:
        raise NotImplementedError(f"custom_vjp({rules.name}): a vmap fold rule needs residuals that are inputs")
    return plan, res_spec


# --- the bridge ----------------------------------------------------------------------------------


def custom_vjp(
    fwd: Fwd,
    bwd: Bwd,
    *,
    nondiff_argnums: tuple[int, ...] = (),
    primal: Callable[..., Any] | None = None,
    jvp: Callable[..., Any] | None = None,
    vmap: VmapRule | None = None,
    name: str | None = None,
) -> Callable[..., Any]:
    """Turn a pure ``fwd``/``bwd`` pair into a differentiable callable.

    The returned function ``f(*args)`` computes ``fwd(*args)[0]`` and, under autograd or
    ``torch.func``, differentiates through ``bwd``. See the module docstring for the contract.

    ``nondiff_argnums``: positions of arguments that are not differentiated (options, flags, a
    backend): held by reference, never flattened, and ``bwd`` returns cotangents for the other
    arguments only (JAX's ``nondiff_argnums``; NOTE: [nondiff_argnums]). ``fwd``, ``primal``
    and the ``vmap`` rule still take every argument (a vmap rule's ``in_dims`` are None at
    those positions); the ``jvp`` rule's tangents cover the differentiable ones.

    ``primal(*args) -> out`` (optional, JAX's ``fun``) computes the output alone. It runs
    when no gradient can be taken (grad mode off, or no tensor argument requires grad, outside
    ``torch.func`` and forward-mode AD): no residuals, no autograd node. Default:
    ``fwd(*args)[0]``.

    Optional rules for the other transforms:

    * ``jvp(residuals, tangent_args) -> tangent_out`` for forward mode (``torch.func.jvp``);
      ``tangent_args`` has the arguments' structure, with None where there is no tangent.
    * ``vmap(batch_size, in_dims, *args) -> (new_args, unfold) | None`` folds a batch into one
      unbatched call: ``f(*new_args)`` runs once and ``unfold(out) -> (out, out_dims)`` puts the
      batch back. Returning None (or giving no rule) runs ``f`` once per batch element.
    """
    name = name or getattr(fwd, "__name__", "fwd")
    nondiff = tuple(sorted(set((nondiff_argnums,) if isinstance(nondiff_argnums, int) else nondiff_argnums)))
    if any(not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in nondiff):
        raise TypeError(f"custom_vjp({name}): nondiff_argnums must be non-negative ints, got {nondiff_argnums!r}")
    rules = _Rules(fwd, bwd, primal, jvp, vmap, name, nondiff)

    @functools.wraps(fwd)
    def apply(*args: Any) -> Any:
        # NOTE: [autograd] Eager: ``primal`` when no gradient can be taken, else the Function
        # through its fast apply (NOTE: [Fast apply]).
        #
        # NOTE: [torch.func grad and vjp] Under a transform (or forward mode) always the
        # Function, which torch's apply hands to ``custom_function_call``: each grad level runs
        # ``forward`` and ``setup_context`` on its unwrapped inputs and later ``backward`` on its
        # cotangents; that level's ``needs_input_grad`` fills NOTE: [Which gradients]. Forward
        # mode: NOTE: [jvp]; vmap: NOTE: [vmap].
        #
        # NOTE: [torch.compile] Dynamo traces ``forward`` and ``setup_context`` as one function
        # (with the writes to the _Call, made inside the traced region) and then ``backward``,
        # on the Python pytree. It refuses a Function that defines ``jvp``, hence
        # ``rules.Traced``; it has no ``set_materialize_grads`` nor ``save_for_forward``, which
        # only forward mode uses (there is no forward mode in a compiled graph).
        if torch.compiler.is_compiling():
            return _run(rules, args, pytree, rules.Traced, gate=True)
        return _run(rules, args, fast_pytree, rules.Function, gate=not _transformed())

    apply.fwd, apply.bwd, apply.primal = fwd, bwd, rules.primal  # type: ignore[attr-defined]
    apply.Function = rules.Function  # type: ignore[attr-defined]
    return apply
