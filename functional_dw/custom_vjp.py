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

NOTE: [What goes where]
  Tensor leaves of the residuals go through ``ctx.save_for_backward``, so saved-tensor hooks
  (offloading, ``save_on_cpu``) see them and only them. Non-tensor leaves and the record's
  context (weights, DistributedWeight objects, splits, flags) stay on ``ctx`` by reference.
  Under ``torch.func`` (see NOTE: [Two Functions]) a residual tensor that is not an input is
  also returned from ``forward`` as an extra, non-differentiable output, which is what
  ``torch.func`` requires of intermediates.

NOTE: [Backward is re-entrant]
  ``backward`` reads ``ctx.saved_tensors`` exactly once (unpack hooks run on every read),
  rebuilds the residuals and calls ``bwd``. It never clears or mutates ``ctx``, so a second
  ``backward(retain_graph=True)`` repeats exactly the same work.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree

from .residuals import with_needs

try:  # NOTE: [Fast pytrees] torch's C++ pytree (optree) flattens several times faster than
    # the Python one; eager calls use it when installed. Compiled code and torch.func keep the
    # Python one (dynamo traces it). Both read the same registrations (our residual records).
    import torch.utils._cxx_pytree as fast_pytree
except ImportError:  # optree is not installed
    fast_pytree = pytree

__all__ = ["custom_vjp"]

Fwd = Callable[..., tuple[Any, Any]]
Bwd = Callable[..., Any]
VmapRule = Callable[..., Any]


class _Stash:
    """Carries non-tensor results of ``forward`` to ``setup_context`` and ``apply``:
    ``out = (out_spec, n_out)`` and ``plan = (plan, res_spec)``, or a callable that makes the
    plan when first asked (see NOTE: [vmap])."""

    __slots__ = ("out", "_plan")

    def set(self, out: tuple, plan: Any) -> None:
        self.out, self._plan = out, plan

    @property
    def plan(self) -> tuple:
        if callable(self._plan):
            self._plan = self._plan()
        return self._plan


def _is_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


def _split_residuals(res: Any, in_leaves: tuple) -> tuple[list, list[torch.Tensor], Any]:
    """Plan how each residual leaf is kept: ("in", i), ("out", j) or ("ref", obj)."""
    leaves, spec = pytree.tree_flatten(res)
    plan, extra = [], []
    for leaf in leaves:
        if not _is_tensor(leaf):
            plan.append(("ref", leaf))
            continue
        i = next((i for i, t in enumerate(in_leaves) if t is leaf), None)
        if i is not None:
            plan.append(("in", i))
        else:
            plan.append(("out", len(extra)))
            extra.append(leaf)
    return plan, extra, spec


def _cotangent_leaves(d: Any, spec: pytree.TreeSpec, name: str) -> list:
    """Flatten ``d`` along ``spec``; ``None`` stands for "no cotangent" for a whole subtree."""
    if d is None:
        return [None] * spec.num_leaves
    if spec.is_leaf():
        return [d]
    node = pytree.SUPPORTED_NODES.get(spec.type)
    children = node.flatten_fn(d)[0] if node is not None and isinstance(d, spec.type) else None
    specs = spec.children() if hasattr(spec, "children") else spec.children_specs  # torch >= 2.13
    if children is None or len(children) != len(specs):
        raise TypeError(
            f"custom_vjp({name}): bwd must return one cotangent per argument of fwd, shaped like "
            f"the arguments (None for no gradient); expected {spec}, got {pytree.tree_structure(d)}"
        )
    return [leaf for c, s in zip(children, specs) for leaf in _cotangent_leaves(c, s, name)]


def _tree(spec: Any) -> Any:
    """The pytree module that made ``spec``."""
    return pytree if isinstance(spec, pytree.TreeSpec) else fast_pytree


def _flatten_cotangents(d: Any, spec: Any, name: str) -> list:
    """Fast path: ``d`` has the arguments' full structure; else allow None for a subtree."""
    try:
        return spec.flatten_up_to(d)
    except (ValueError, TypeError, RuntimeError):
        if _tree(spec) is not pytree:  # redo the structure with the Python pytree
            spec = pytree.tree_structure(fast_pytree.tree_unflatten([0] * spec.num_leaves, spec))
        return _cotangent_leaves(d, spec, name)


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
        return any(_is_tensor(t) and t.requires_grad for t in in_leaves)
    if torch.is_inference_mode_enabled():  # enable_grad inside inference_mode: torch records nothing
        return False
    return any(_is_tensor(t) and t.requires_grad and not t.is_inference() for t in in_leaves)


def _pair(result: Any, name: str) -> tuple[Any, Any]:
    """``fwd``'s result, checked against the contract ``fwd(*args) -> (out, residuals)``."""
    if not isinstance(result, tuple) or len(result) != 2:
        got = f"a tuple of {len(result)}" if isinstance(result, tuple) else type(result).__name__
        if isinstance(result, torch.Tensor):
            got = f"a bare Tensor of shape {tuple(result.shape)}"
        raise TypeError(
            f"custom_vjp({name}): fwd must return a pair (out, residuals), e.g. `return y, (x,)`; got {got}"
        )
    return result


def custom_vjp(
    fwd: Fwd, bwd: Bwd, *, primal: Callable[..., Any] | None = None, jvp: Callable[..., Any] | None = None,
    vmap: VmapRule | None = None, name: str | None = None,
) -> Callable[..., Any]:
    """Turn a pure ``fwd``/``bwd`` pair into a differentiable callable.

    The returned function ``f(*args)`` computes ``fwd(*args)[0]`` and, under autograd or
    ``torch.func``, differentiates through ``bwd``. See the module docstring for the contract.

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
    primal = primal or (lambda *args: _pair(fwd(*args), name)[0])

    class FuncFunction(torch.autograd.Function):
        @staticmethod
        def forward(stash: _Stash, in_spec: Any, *in_leaves: Any) -> tuple:  # type: ignore[override]
            args = pytree.tree_unflatten(in_leaves, in_spec)
            out, res = _pair(fwd(*args), name)
            out_leaves, out_spec = pytree.tree_flatten(out)
            if not all(_is_tensor(t) for t in out_leaves):
                raise TypeError(f"custom_vjp({name}): fwd's output must be tensors; got {out_spec}")
            plan, extra, res_spec = _split_residuals(res, in_leaves)
            stash.set((out_spec, len(out_leaves)), (plan, res_spec))
            return (*out_leaves, *extra)

        @staticmethod
        def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
            stash, in_spec, *in_leaves = inputs
            (out_spec, n_out), (plan, res_spec) = stash.out, stash.plan
            extra = output[n_out:]
            ctx.mark_non_differentiable(*extra)
            saved = [in_leaves[i] if kind == "in" else extra[i] for kind, i in plan if kind != "ref"]
            ctx.save_for_backward(*saved)
            if jvp is not None and _forward_ad_active():
                ctx.save_for_forward(*saved)  # only then: a strong ref would defeat offloading
            ctx.plan, ctx.res_spec, ctx.in_spec, ctx.out_spec = plan, res_spec, in_spec, out_spec
            # Not materialized: jvp must see None (not zeros) for inputs without a tangent;
            # backward fills missing output grads itself.
            ctx.set_materialize_grads(False)
            ctx.out_meta = [(o.shape, o.dtype, o.device) for o in output[:n_out]]

        @staticmethod
        def backward(ctx: Any, *grads: Any) -> tuple:
            res = _residuals_of(ctx)
            n_out = ctx.out_spec.num_leaves
            grads = [torch.zeros(s, dtype=d, device=v) if g is None else g for g, (s, d, v) in zip(grads[:n_out], ctx.out_meta)]
            d_out = pytree.tree_unflatten(grads, ctx.out_spec)
            d_args = _flatten_cotangents(bwd(res, d_out), ctx.in_spec, name)
            d_leaves = [g if ctx.needs_input_grad[2 + i] else None for i, g in enumerate(d_args)]
            return (None, None, *d_leaves)

        @staticmethod
        def jvp(ctx: Any, *tangents: Any) -> tuple:
            if jvp is None:
                raise NotImplementedError(f"custom_vjp({name}) has no forward-mode rule: pass jvp=...")
            t_args = pytree.tree_unflatten(list(tangents[2:]), ctx.in_spec)
            t_out = ctx.out_spec.flatten_up_to(jvp(_residuals_of(ctx), t_args))
            n_extra = sum(kind == "out" for kind, _ in ctx.plan)
            return (*t_out, *[None] * n_extra)

        @staticmethod
        def vmap(info: Any, in_dims: tuple, stash: _Stash, in_spec: Any, *in_leaves: Any) -> tuple:
            args = pytree.tree_unflatten(in_leaves, in_spec)
            folded = vmap(info.batch_size, pytree.tree_unflatten(list(in_dims[2:]), in_spec), *args) if vmap else None
            if folded is not None:  # one call with the batch folded in
                new_args, unfold = folded
                flat, n_out, out_spec = _call(new_args, stash)
                stash.set(stash.out, functools.partial(_element_plan, in_leaves, in_dims[2:], in_spec))
                out, out_dims = unfold(pytree.tree_unflatten(list(flat[:n_out]), out_spec))
                dims = out_spec.flatten_up_to(out_dims)
                return (*pytree.tree_leaves(out), *flat[n_out:]), (*dims, *[None] * (len(flat) - n_out))
            results = []  # fallback: one call per batch element
            for i in range(info.batch_size):
                sliced = [t if d is None else t.select(d, i) for t, d in zip(in_leaves, in_dims[2:])]
                results.append(_call(pytree.tree_unflatten(sliced, in_spec), stash)[0])
            flat = tuple(torch.stack(column) for column in zip(*results))
            return flat, (0,) * len(flat)

    def _residuals_of(ctx: Any) -> Any:
        saved = iter(ctx.saved_tensors)  # read once: unpack hooks run on every read
        leaves = [value if kind == "ref" else next(saved) for kind, value in ctx.plan]
        res = _tree(ctx.res_spec).tree_unflatten(leaves, ctx.res_spec)
        # NOTE: [Which gradients] A record with a `needed()` field learns here which inputs
        # autograd wants gradients for (shaped like fwd's arguments), so bwd can skip a GEMM.
        mask = getattr(ctx, "needs_input_grad", None)
        if getattr(type(res), "__needs_field__", None) and mask is not None and not torch.compiler.is_compiling():
            res = with_needs(res, _tree(ctx.in_spec).tree_unflatten(list(mask[2:]), ctx.in_spec))
        return res

    def _element_plan(in_leaves: tuple, dims: tuple, in_spec: Any) -> tuple:
        """NOTE: [vmap] Under ``vmap(grad(f))`` the grad level runs ``setup_context`` on the
        outputs of our vmap rule, with per-element semantics. A folded call's residuals hold
        folded context (e.g. splits * B), so the grad level needs the context of one element:
        run ``fwd`` on element 0 (only when asked; plain ``vmap`` never asks)."""
        sliced = tuple(t if d is None else t.select(d, 0) for t, d in zip(in_leaves, dims))
        with torch.no_grad():
            out, res = _pair(fwd(*pytree.tree_unflatten(list(sliced), in_spec)), name)
        plan, extra, res_spec = _split_residuals(res, sliced)
        if extra:
            raise NotImplementedError(f"custom_vjp({name}): a vmap fold rule needs residuals that are inputs")
        return plan, res_spec

    def _call(args: Any, stash: _Stash) -> tuple[tuple, int, Any]:
        in_leaves, in_spec = pytree.tree_flatten(args)
        inner = _Stash()
        flat = FuncFunction.apply(inner, in_spec, *in_leaves)
        stash.set(inner.out, inner._plan)
        out_spec, n_out = inner.out
        return flat, n_out, out_spec

    class Function(torch.autograd.Function):
        """NOTE: [Two Functions] ``torch.func`` needs the setup_context style (``FuncFunction``
        above), whose residual plan reaches ``setup_context`` through a side channel (the
        stash). Dynamo cannot trace that side channel, and the setup_context style costs an
        ``inspect.signature`` bind on every ``apply``. So eager autograd and ``torch.compile``
        use this ctx-style twin: forward keeps the plan on ``ctx`` and saves every residual
        tensor itself; the plan and ``bwd`` are shared. Under ``torch.compile`` no stash
        carries the output's structure, so ``fwd``'s output must be a tensor or a flat tuple."""

        @staticmethod
        def forward(ctx: Any, stash: _Stash | None, in_spec: Any, *in_leaves: Any) -> tuple:  # type: ignore[override]
            tree = _tree(in_spec)
            out, res = _pair(fwd(*tree.tree_unflatten(in_leaves, in_spec)), name)
            # A single tensor output (every layer here) needs no pytree: spec None stands for it.
            out_leaves, ctx.out_spec = ((out,), None) if _is_tensor(out) else tree.tree_flatten(out)
            if ctx.out_spec is not None and not all(_is_tensor(t) for t in out_leaves):
                raise TypeError(f"custom_vjp({name}): fwd's output must be tensors; got {ctx.out_spec}")
            res_leaves, ctx.res_spec = tree.tree_flatten(res)
            ctx.save_for_backward(*[t for t in res_leaves if _is_tensor(t)])
            ctx.plan = [("saved", None) if _is_tensor(t) else ("ref", t) for t in res_leaves]
            ctx.in_spec = in_spec
            if stash is not None:
                stash.out = (ctx.out_spec, len(out_leaves))
            return tuple(out_leaves)

        @staticmethod
        def backward(ctx: Any, *grads: Any) -> tuple:
            d_out = grads[0] if ctx.out_spec is None else _tree(ctx.out_spec).tree_unflatten(list(grads), ctx.out_spec)
            d_args = _flatten_cotangents(bwd(_residuals_of(ctx), d_out), ctx.in_spec, name)
            return (None, None, *[g if ctx.needs_input_grad[2 + i] else None for i, g in enumerate(d_args)])

    # autograd names a Function's backward node after the class when the class is created:
    # subclass under the pair's name so grad_fn reads e.g. `CustomVJP_linearBackward`.
    tag = "".join(c if c.isalnum() else "_" for c in name)
    FuncFunction = type(f"CustomVJP_{tag}_func", (FuncFunction,), {})
    Function = type(f"CustomVJP_{tag}", (Function,), {})

    @functools.wraps(fwd)
    def apply(*args: Any) -> Any:
        if torch.compiler.is_compiling():
            in_leaves, in_spec = pytree.tree_flatten(args)
            if not _needs_grad(in_leaves):
                return primal(*args)
            flat = Function.apply(None, in_spec, *in_leaves)
            return flat[0] if len(flat) == 1 else tuple(flat)
        if _transformed():
            flat, n_out, out_spec = _call(args, _Stash())
            return pytree.tree_unflatten(list(flat[:n_out]), out_spec)
        in_leaves, in_spec = fast_pytree.tree_flatten(args)
        if not _needs_grad(in_leaves):  # inference: just the GEMMs (inference tensors welcome)
            return primal(*args)
        stash = _Stash()
        flat = Function.apply(stash, in_spec, *in_leaves)
        out_spec = stash.out[0]
        return flat[0] if out_spec is None else fast_pytree.tree_unflatten(list(flat), out_spec)

    apply.fwd, apply.bwd, apply.primal = fwd, bwd, primal  # type: ignore[attr-defined]
    apply.Function, apply.FuncFunction = Function, FuncFunction  # type: ignore[attr-defined]
    return apply
