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

The pieces below, one at a time: :class:`_BridgeCall` (one call's structure), :class:`_Bridge` (the
Function: ``forward``, ``setup_context``, ``backward``, ``jvp``, ``vmap``, ``apply``), the
transform rules (:func:`_vmap_rule`), and :func:`custom_vjp`, which picks the entry per mode.
Two modules hold the rest: ``_bridge_tree.py`` (arguments, outputs, residuals and cotangents as
flat leaves) and ``_bridge_residuals.py`` (backward's view of the residuals: rebuilt, rebound
per torch.func level and per vmap element); ``_bridge_planned.py`` runs a layer call whose cached
plan already knows its structure without the generic work (NOTE: [The plan's runner]).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch._C._functorch import (
    TransformType,
    unwrap_if_dead,
)
from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

from ._checks import PLAIN_TYPES, bottom
from ._bridge_tree import (
    SCALARS,
    FlatSpec,
    fast_pytree,
    flatten_args,
    flatten_cotangents,
    flatten_out,
    fresh_outputs,
    is_tensor,
    kept_residuals,
    output_leaves,
    pair,
    residual_sources,
    tree_of,
    unflatten_out,
)
from ._bridge_residuals import ctx_residuals, element_refs, per_element, rebind_table

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
#   the residuals) travels on a :class:`_BridgeCall` object, the Function's first input, which
#   ``setup_context`` then keeps on ``ctx``. One rule per mode: NOTE: [autograd], NOTE:
#   [torch.func grad and vjp], NOTE: [jvp], NOTE: [vmap], NOTE: [torch.compile].

# NOTE: [nondiff_argnums]
#   Arguments named by ``nondiff_argnums`` (a layer's options: flags, backend, FP8 recipe) ride
#   on the :class:`_BridgeCall` by reference: they are not leaves of the Function (no flattening, no
#   autograd input), and ``bwd`` returns one cotangent per *other* argument, so a layer's
#   backward returns ``(dx, dw, dsplits, dbias)``, not a tuple padded with a None per option.
#   Example: ``custom_vjp(f_fwd, f_bwd, nondiff_argnums=(2,))`` for ``f(x, w, opts)``: ``f_bwd``
#   returns ``(dx, dw)``.

Fwd = Callable[..., tuple[Any, Any]]
Bwd = Callable[..., Any]
VmapRule = Callable[..., Any]


# --- small helpers ---------------------------------------------------------------------------


def forward_ad_active() -> bool:
    """True inside ``torch.func.jvp`` or an eager ``forward_ad.dual_level``."""
    return torch.autograd.forward_ad._current_level >= 0


def transformed() -> bool:
    """A torch.func transform or forward-mode AD is active."""
    return torch._C._functorch.peek_interpreter_stack() is not None or forward_ad_active()


def needs_grad(in_leaves: Any) -> bool:
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

    __slots__ = ("fwd", "bwd", "primal", "jvp", "vmap", "name", "nondiff", "Function", "Traced", "Lean")

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
        self.Lean = type(f"CustomVJP_{tag}", (_LeanBridge,), {})  # NOTE: [The lean run]


class _BridgeCall:
    """One call's structure, the Function's first input (NOTE: [One Function]).

    The caller sets ``rules``, ``in_spec`` (the differentiable arguments' structure: the
    Function's other inputs are its leaves) and ``static`` (the nondiff arguments, by reference). ``forward`` sets ``out_spec`` (None: one tensor), ``n_out`` (the
    outputs before the extra ones) and ``sources``/``res_spec`` (where each residual leaf comes from, and how ``backward``
    rebuilds the residuals). A vmap rule may leave ``pending``, which makes them when first asked
    (NOTE: [vmap])."""

    __slots__ = (
        "rules",
        "in_spec",
        "static",
        "out_spec",
        "n_out",
        "sources",
        "res_spec",
        "pending",
        "out_meta",
        "elements",
        "in_ids",
        "level",
    )

    def __init__(self, rules: _Rules, in_spec: Any, static: tuple = ()) -> None:
        self.rules, self.in_spec, self.static, self.pending, self.out_meta = rules, in_spec, static, None, None
        self.elements: list[_BridgeCall] | None = None  # vmap ran one call per element: theirs (NOTE: [vmap])
        self.in_ids: tuple = ()  # such an element's input leaves' bottom tensors, by id (NOTE: [Context per level])
        self.level: int | None = None  # with elements: the functorch level just below that vmap's

    def args(self, leaves: Any, static: Any = True) -> tuple:
        """fwd's arguments from the Function's input leaves and the nondiff arguments (or, with
        ``static=None``, None in their places: vmap's in_dims)."""
        values = self.static if static is True else (static,) * len(self.static)
        return _join(self.rules, self.in_spec.unflatten(leaves), values)

    def adopt(self, inner: "_BridgeCall", pending: Any = None) -> None:
        """Take the structure of ``inner``, a call a vmap rule made for this one."""
        self.out_spec, self.n_out, self.sources, self.res_spec = (
            inner.out_spec,
            inner.n_out,
            inner.sources,
            inner.res_spec,
        )
        self.pending = pending

    def resolve(self) -> list:
        if self.pending is not None:
            self.sources, self.res_spec = self.pending()
            self.pending = None
        return self.sources


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


def _run(rules: _Rules, args: tuple, tree: Any, function: type, gate: bool, lean: bool = False) -> Any:
    """Flatten ``args``, apply ``function`` to the leaves, and give ``fwd``'s output back.
    ``gate``: with no gradient to take, run ``primal`` instead (no residuals, no node).
    ``lean``: a plain eager call, which may run ``rules.Lean`` (NOTE: [The lean run])."""
    diff, static = _split(rules, args)
    in_leaves, in_spec = flatten_args(diff, tree)
    if gate and not needs_grad(in_leaves):
        return rules.primal(*args)
    if lean and type(in_spec) is FlatSpec:  # NOTE: [The lean run]
        function = rules.Lean
    call = _BridgeCall(rules, in_spec, static)
    flat = function.apply(call, *in_leaves)
    return unflatten_out(flat[: call.n_out], call.out_spec)


# --- the Function --------------------------------------------------------------------------------


class _Bridge(torch.autograd.Function):
    """The bridge as one setup_context style Function; :class:`_Rules` subclasses it per pair.
    Inputs: a :class:`_BridgeCall`, then the leaves of ``fwd``'s arguments. Outputs: the leaves of
    ``fwd``'s output, then the intermediate residuals (NOTE: [What goes where])."""

    @staticmethod
    def forward(call: _BridgeCall, *in_leaves: Any) -> tuple:  # type: ignore[override]
        rules = call.rules
        tree = tree_of(call.in_spec)
        out, res = pair(rules.fwd(*call.args(in_leaves)), rules.name)
        out_leaves, call.out_spec = flatten_out(out, tree, rules.name)
        call.sources, extra, call.res_spec = residual_sources(res, in_leaves, tree, out_leaves)
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
        if extra or forward_ad_active():
            _grads_as_given(ctx, call, saved, output)
        if torch._C._are_functorch_transforms_active():  # NOTE: [Context per level]
            if call.elements is None:
                ctx.rebind = rebind_table(call, inputs[1:])
            else:
                ctx.element_refs = element_refs(call, inputs[1:])

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
            return (None, *per_element(ctx, "bwd", grads))
        d_out = unflatten_out(grads, call.out_spec)
        d_args = flatten_cotangents(call.rules.bwd(ctx_residuals(ctx), d_out), call.in_spec, call.rules)
        return (None, *[g if needs[1 + i] else None for i, g in enumerate(d_args)])

    @staticmethod
    def jvp(ctx: Any, _: Any, *tangents: Any) -> tuple:  # NOTE: [jvp]
        call = ctx.call
        if call.rules.jvp is None:
            raise NotImplementedError(
                f"custom_vjp({call.rules.name}) has no forward-mode rule, so torch.func.jvp, jacfwd and hessian "
                "cannot run through it: use reverse mode (vjp, jacrev, jacrev(jacrev)) there, or, where the pair is "
                "yours, pass jvp=... to custom_vjp"
            )
        if sum(i.key() == _JVP for i in retrieve_all_functorch_interpreters()) > 1:
            raise NotImplementedError(_JVP_OF_JVP.format(name=call.rules.name))
        if call.elements is not None:  # NOTE: [vmap]
            t_out = per_element(ctx, "jvp", tangents)
        else:
            t_out = output_leaves(call.rules.jvp(ctx_residuals(ctx), call.in_spec.unflatten(tangents)), call.out_spec)
        n_extra = sum(kind == "out" for kind, _ in call.sources)
        return (*t_out, *[None] * n_extra)

    @staticmethod
    def vmap(info: Any, in_dims: tuple, call: _BridgeCall, *in_leaves: Any) -> tuple:
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
        return c_apply(cls, args)


def c_apply(cls: type, args: tuple) -> Any:
    """The C++ apply of Function ``cls``, on its inputs with dead functorch wrappers unwrapped
    (what torch's ``Function.apply`` does outside a transform: a tensor that escaped a finished
    ``torch.func.grad`` reaches autograd as the tensor it wraps)."""
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
def _grads_as_given(ctx: Any, call: _BridgeCall, saved: list, output: tuple) -> None:
    """Grads and tangents not materialized: backward fills a missing output grad with zeros
    itself, and gets no zeros for the extra outputs (activation-sized intermediates), which it
    ignores. (Dynamo has neither this nor forward mode: a compiled graph's grads are tensors.)

    In forward mode the residuals are also kept for the pair's ``jvp`` rule (NOTE: [jvp])."""
    if call.rules.jvp is not None and forward_ad_active():
        ctx.save_for_forward(*saved)
    ctx.set_materialize_grads(False)
    call.out_meta = [(o.shape, o.dtype, o.device) for o in output[: call.n_out]]


# NOTE: [The lean run]
#   A plain eager call (no torch.func transform, no forward-mode AD, not compiling) whose
#   arguments flatten without a pytree (every layer's) runs :class:`_LeanBridge`: the same
#   ``fwd``, ``bwd`` and backward as :class:`_Bridge`, as an old-style Function whose
#   ``forward`` sees ``ctx``. What that saves per call is the generic machinery torch.func
#   needs: no intermediate residual returned as an extra output and marked non-differentiable
#   (an old-style forward saves it directly; autograd hands backward the same tensors, through
#   the same saved-tensor hooks), no output remapping in ``setup_context``, no zeros planned for
#   the extra outputs' grads. The residuals are kept as :class:`_Bridge` keeps them (NOTE:
#   [What goes where]: tensors through ``save_for_backward``, the rest on ``ctx`` by
#   reference), so backward is :class:`_Bridge`'s, unchanged, and so are its errors, version
#   checks and ``retain_graph``. Under a transform, forward mode or a compiler, :class:`_Bridge`.
class _LeanBridge(torch.autograd.Function):
    """The bridge for a plain eager call (NOTE: [The lean run]). Inputs: a :class:`_BridgeCall`,
    then the leaves of ``fwd``'s arguments; outputs: the leaves of ``fwd``'s output."""

    @staticmethod
    def forward(ctx: Any, call: _BridgeCall, *in_leaves: Any) -> Any:  # type: ignore[override]
        rules = call.rules
        out, res = pair(rules.fwd(*call.args(in_leaves)), rules.name)
        out_leaves, call.out_spec = flatten_out(out, fast_pytree, rules.name)
        outs = fresh_outputs(out_leaves, in_leaves)
        call.sources, saved, call.res_spec = kept_residuals(res, in_leaves, out_leaves, outs)
        call.n_out = len(out_leaves)
        ctx.save_for_backward(*saved)
        ctx.call = call
        return outs

    backward = _Bridge.backward

    @classmethod
    def apply(cls, *args: Any) -> Any:
        """The C++ apply (no transform is active: NOTE: [Fast apply])."""
        return c_apply(cls, args)


_JVP = TransformType.Jvp
_JVP_OF_JVP = (
    "custom_vjp({name}): jvp of jvp (jacfwd(jacfwd), nested torch.func.jvp) is not supported: torch runs a "
    "custom Function's jvp rule with forward AD off, so the outer level would silently miss the mixed "
    "terms. Use torch.func.hessian (jacfwd of jacrev), jacrev(jacrev) or jvp of grad"
)


# --- the transform rules -------------------------------------------------------------------------


def _apply_inner(rules: _Rules, args: Any) -> tuple[tuple, _BridgeCall]:
    """One call of the Function from inside a vmap rule: (all outputs, its structure)."""
    diff, static = _split(rules, args)
    in_leaves, in_spec = flatten_args(diff, fast_pytree)
    inner = _BridgeCall(rules, in_spec, static)
    return rules.Function.apply(inner, *in_leaves), inner


# NOTE: [vmap] The pair's ``vmap`` rule may fold the batch into one unbatched call (e.g.
# x's batch into the token dimension): run it, then ``unfold`` puts the batch back. Without
# a rule, or when it returns None, one call per batch element, stacked.
#
# Under ``vmap(grad(f))`` the grad level then runs ``setup_context`` on our outputs with
# per-element semantics. A folded call's residuals hold folded context (e.g. splits * B),
# so the grad level gets the residual sources of one element instead: ``fwd`` on element 0, run only
# when asked (:func:`_element_sources`; plain ``vmap`` never asks). A fold shares the weights
# and splits across the batch, so element 0's context is every element's.
#
# A call run per element (batched weights: an ensemble; batched splits) keeps each element's
# call (``call.elements``): their contexts differ (each holds its own weights and routing). A
# grad or jvp level above the vmap then runs its ``bwd``/``jvp`` through ``_bridge_residuals._PerElement``,
# a Function whose own vmap rule, at the looping level, slices the saved tensors, the grads
# and the level's weights (NOTE: [Context per level]) and runs each element's rule on that
# element's residuals; at any other vmap level (jacrev's basis) it applies itself once per
# that level's element. Differentiating that backward once more is refused.
def _vmap_rule(batch_size: int, dims: tuple, call: _BridgeCall, in_leaves: tuple) -> tuple:
    """The Function's vmap rule: one call with the batch folded in by the pair's ``vmap`` rule,
    else one call per batch element (NOTE: [vmap])."""
    rules = call.rules
    folded = rules.vmap(batch_size, call.args(dims, static=None), *call.args(in_leaves)) if rules.vmap else None
    if folded is None:
        return _vmap_loop(batch_size, dims, call, in_leaves)
    new_args, unfold = folded
    flat, inner = _apply_inner(rules, new_args)
    call.adopt(inner, functools.partial(_element_sources, call, in_leaves, dims))
    out, out_dims = unfold(unflatten_out(flat[: inner.n_out], inner.out_spec))
    n_extra = len(flat) - inner.n_out
    out_leaves, dims_out = output_leaves(out, inner.out_spec), output_leaves(out_dims, inner.out_spec)
    return (*out_leaves, *flat[inner.n_out :]), (*dims_out, *[None] * n_extra)


def _vmap_loop(batch_size: int, dims: tuple, call: _BridgeCall, in_leaves: tuple) -> tuple:
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


def _element_sources(call: _BridgeCall, in_leaves: tuple, dims: tuple) -> tuple[list, Any]:
    """The residual sources of batch element 0 (see NOTE: [vmap])."""
    rules = call.rules
    sliced = tuple(t if d is None else t.select(d, 0) for t, d in zip(in_leaves, dims))
    with torch.no_grad():
        _, res = pair(rules.fwd(*call.args(sliced)), rules.name)
    sources, extra, res_spec = residual_sources(res, sliced, tree_of(call.in_spec))
    if extra:
        raise NotImplementedError(f"custom_vjp({rules.name}): a vmap fold rule needs residuals that are inputs")
    return sources, res_spec


# --- the bridge ----------------------------------------------------------------------------------

# How ``custom_vjp``'s ``apply`` runs a call:
#
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
# (with the writes to the _BridgeCall, made inside the traced region) and then ``backward``,
# on the Python pytree. It refuses a Function that defines ``jvp``, hence
# ``rules.Traced``; it has no ``set_materialize_grads`` nor ``save_for_forward``, which
# only forward mode uses (there is no forward mode in a compiled graph).


def _nondiff(nondiff_argnums: int | tuple[int, ...], name: str) -> tuple[int, ...]:
    """``nondiff_argnums`` as a sorted tuple of distinct non-negative ints (an int alone allowed)."""
    nondiff = tuple(sorted(set((nondiff_argnums,) if isinstance(nondiff_argnums, int) else nondiff_argnums)))
    if any(not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in nondiff):
        raise TypeError(f"custom_vjp({name}): nondiff_argnums must be non-negative ints, got {nondiff_argnums!r}")
    return nondiff


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
    rules = _Rules(fwd, bwd, primal, jvp, vmap, name, _nondiff(nondiff_argnums, name))

    @functools.wraps(fwd)
    def apply(*args: Any) -> Any:
        # NOTE: [autograd], NOTE: [torch.func grad and vjp], NOTE: [torch.compile] (above).
        if torch.compiler.is_compiling():
            return _run(rules, args, pytree, rules.Traced, gate=True)
        plain = not transformed()
        return _run(rules, args, fast_pytree, rules.Function, gate=plain, lean=plain)

    apply.fwd, apply.bwd, apply.primal = fwd, bwd, rules.primal  # type: ignore[attr-defined]
    apply.Function, apply.Lean = rules.Function, rules.Lean  # type: ignore[attr-defined]
    return apply
