"""The custom_vjp bridge and residual records on their own, with user-defined fwd/bwd pairs, and
the layers' own bridges (Linear's and GroupedLinear's pairs) built inside the tests."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import re
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch.func import grad, jvp, vjp, vmap

import functional_dw as fd
from conftest import HOOKS, CountingKernels
from functional_dw import custom_vjp, residuals, saved, saved_activations
from functional_dw.plan import Options
from functional_dw.residuals import needed
from helpers import draws, randn, ref_grouped

gl_mod = importlib.import_module("functional_dw.grouped_linear")  # the modules (the package's names are the functions)
lin_mod = importlib.import_module("functional_dw.linear")


@residuals
class SinResiduals:
    x: torch.Tensor = saved()


def sin_fwd(x):
    return torch.sin(x), SinResiduals(x)


sin = custom_vjp(sin_fwd, lambda res, dy: (dy * torch.cos(res.x),))


@residuals
class TwoResiduals:
    x: torch.Tensor = saved()  # an input
    cos_x: torch.Tensor = saved()  # an intermediate: not one of the inputs
    w: torch.Tensor  # context, by reference
    scale: int
    tag: str
    unused: torch.Tensor | None = saved(default=None)


SEEN = []  # the non-tensor arguments fwd received


def two_fwd(x, w, scale, tag):
    SEEN.append((scale, tag))
    res = TwoResiduals(x=x, cos_x=torch.cos(x), w=w, scale=scale, tag=tag)
    return (x * w * scale, torch.sin(x)), res


def two_bwd(res, d_out):
    da, db = d_out
    return (da * res.w * res.scale + db * res.cos_x, da * res.x * res.scale, None, None)


two = custom_vjp(two_fwd, two_bwd)


def plain_two(x, w, scale):
    return x * w * scale, torch.sin(x)


def inputs(seed=0, grad=True):  # float64 (x, w); seed=1, grad=False: the cotangents (da, db)
    return [t.requires_grad_(grad) for t in draws((5,), (5,), seed=seed, dtype=torch.float64, draw_dtype=None)]


def test_gradients_match_autograd_of_the_plain_expression():
    x, w = inputs()
    ga, gb = inputs(1, False)
    got = torch.autograd.grad(two(x, w, 3, "t"), (x, w), (ga, gb))
    want = torch.autograd.grad(plain_two(x, w, 3), (x, w), (ga, gb))
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r, rtol=0, atol=1e-14)
    torch.testing.assert_close(torch.autograd.grad(sin(x).sum(), x)[0], torch.cos(x).detach())
    assert torch.autograd.gradcheck(sin, (x,))
    assert torch.autograd.gradcheck(lambda x, w: two(x, w, 3, "t"), (x, w))


def test_intermediate_residual_goes_through_save_for_backward():
    x, w = inputs()
    with HOOKS["identity"]()() as rec:
        two(x, w, 3, "t")
    assert len(rec.packed) == 2, "exactly x and cos(x) are saved; w is context"
    assert rec.packed[0] is x
    torch.testing.assert_close(rec.packed[1], torch.cos(x).detach())
    assert not any(p is w for p in rec.packed)


@pytest.mark.parametrize("junk", [False, True], ids=["bwd-returns-None", "bwd-returns-junk"])
def test_non_tensor_args_pass_through_and_get_no_cotangent(junk):
    tag = "a string argument"

    def bwd(res, d_out):
        dx, dw, _, _ = two_bwd(res, d_out)
        return (dx, dw, torch.ones(()), torch.ones(())) if junk else (dx, dw, None, None)

    f = custom_vjp(two_fwd, bwd)
    x, w = inputs()
    SEEN.clear()
    a, b = f(x, w, 7, tag)
    assert SEEN == [(7, tag)] and SEEN[0][1] is tag
    # the node hands autograd None for the int and the str (a plain Function returning
    # a tensor there would raise "returned a gradient different than None")
    assert a.grad_fn.apply(*inputs(1, False))[-2:] == (None, None)
    (a.sum() + b.sum()).backward()
    want = torch.autograd.grad(sum(t.sum() for t in plain_two(x, w, 7)), (x, w))
    torch.testing.assert_close((x.grad, w.grad), want)


@pytest.mark.parametrize(
    "fwd, bwd",
    [
        pytest.param(two_fwd, lambda r, d: two_bwd(r, d)[:2], id="too-few"),
        pytest.param(two_fwd, lambda r, d: list(two_bwd(r, d)), id="list-not-tuple"),
        pytest.param(sin_fwd, lambda r, dy: dy * torch.cos(r.x), id="bare-tensor-not-tuple"),
    ],
)
def test_wrongly_structured_cotangent_raises_type_error(fwd, bwd):
    x, w = inputs()
    outs = custom_vjp(fwd, bwd)(*((x, w, 3, "t") if fwd is two_fwd else (x,)))
    outs = outs if isinstance(outs, tuple) else (outs,)
    with pytest.raises(TypeError, match="cotangent"):
        sum(o.sum() for o in outs).backward()


def test_retain_graph_three_backwards_give_three_times_the_grads():
    x, w = inputs()
    with HOOKS["identity"]()() as rec:
        a, b = two(x, w, 3, "t")
    loss = a.sum() + b.sum()
    for _ in range(3):
        loss.backward(retain_graph=True)
    want = torch.autograd.grad(sum(t.sum() for t in plain_two(x, w, 3)), (x, w))
    torch.testing.assert_close((x.grad, w.grad), tuple(3 * g for g in want))
    assert rec.unpacks == 3 * len(rec.packed) == 6, "each backward unpacks each saved tensor once"


def test_torch_func_grad_and_vjp_match_autograd():
    x, w = inputs()
    ga, gb = inputs(1, False)
    want = torch.autograd.grad(plain_two(x, w, 3), (x, w), (ga, gb))
    x, w = x.detach(), w.detach()

    def loss(x, w):
        a, b = two(x, w, 3, "t")
        return (a * ga).sum() + (b * gb).sum()

    torch.testing.assert_close(torch.func.grad(loss, argnums=(0, 1))(x, w), want)
    out, vjp_fn = torch.func.vjp(lambda x, w: two(x, w, 3, "t"), x, w)
    torch.testing.assert_close(out, plain_two(x, w, 3))
    torch.testing.assert_close(vjp_fn((ga, gb)), want)


def record(unused=None):
    x, w = inputs(grad=False)
    return TwoResiduals(x=x, cos_x=torch.cos(x), w=w, scale=3, tag="t", unused=unused)


def test_saved_activations_are_exactly_the_saved_fields():
    r = record()
    assert [id(t) for t in saved_activations(r)] == [id(r.x), id(r.cos_x)]  # None field and w excluded
    r = record(unused=torch.zeros(2))
    assert [id(t) for t in saved_activations(r)] == [id(r.x), id(r.cos_x), id(r.unused)]


def test_repr_lists_every_field_with_shape_dtype_and_bytes():
    text = repr(record())
    for field, tag in [("x", "saved"), ("cos_x", "saved"), ("w", "ref  ")]:
        assert re.search(rf"\[{tag}\] {field} = Tensor\[5\] float64 40 B", text), text
    assert "[ref  ] scale = 3" in text and "[ref  ] tag = 't'" in text and "[saved] unused = None" in text
    assert text.endswith("# 80 B through save_for_backward")


def test_pytree_round_trip_keeps_static_fields_by_identity():
    r = record()
    leaves, spec = pytree.tree_flatten(r)
    tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
    assert [id(t) for t in tensors] == [id(r.x), id(r.cos_x)]
    fresh = [t.clone() if isinstance(t, torch.Tensor) else t for t in leaves]  # as an unpack hook would
    r2 = pytree.tree_unflatten(fresh, spec)
    assert type(r2) is TwoResiduals
    assert r2.w is r.w and r2.tag is r.tag and r2.scale is r.scale and r2.unused is None
    assert r2.x is fresh[0] and r2.cos_x is fresh[1]


def test_records_are_frozen():
    r = record()
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.x = torch.zeros(5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.scale = 4


@residuals
class NestedResiduals:
    pair: tuple = saved()  # a saved field holding a pytree of tensors (e.g. a quantized x)
    k: int


def test_saved_field_holding_a_pytree_saves_its_tensors():
    f = custom_vjp(
        lambda x: (x * 2, NestedResiduals((x, torch.cos(x)), 2)),
        lambda res, dy: (dy * res.k + 0 * res.pair[1],),
        name="nested",
    )
    x, _ = inputs()
    with HOOKS["identity"]()() as rec:
        y = f(x)
    assert len(rec.packed) == 2 and rec.packed[0] is x, "both tensors of the saved pair go through the hooks"
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.full_like(x, 2.0))


def test_no_zeros_are_made_for_an_intermediate_residual_in_backward():
    """An intermediate residual rides out of forward as an extra output that never gets a
    gradient: backward must not materialize an activation-sized zeros tensor for it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(func.__name__)
            return func(*args, **(kwargs or {}))

    x, w = inputs()
    a, b = two(x, w, 3, "t")
    loss = a.sum() + b.sum()
    with Ops() as ops:
        loss.backward()
    assert not any(name.startswith(("zeros", "new_zeros", "zero_")) for name in ops.seen), ops.seen


@residuals
class NestedNeeds:
    pair: tuple = saved()
    needs: object = needed()


def test_record_with_a_pytree_in_a_saved_field_still_learns_which_gradients():
    got = []

    def bwd(res, dy):
        got.append(res.needs)
        return dy * 2, None

    f = custom_vjp(lambda x, w: (x * 2, NestedNeeds((x, w))), bwd, name="nested_needs")
    x, w = inputs()
    f(x, w.detach()).sum().backward()
    assert got == [(True, False)]


# --- closed-over tensors: constants for the call, the caller's tensors untouched ----------------


def _closing_over(captured, as_output=False):
    """A pair whose fwd closes over ``captured`` (keeps it in its residuals, or returns it)."""

    def fwd(x):
        return (captured if as_output else x * captured), (x, captured)

    def bwd(res, dy):
        return (dy if as_output else dy * res[1],)

    return custom_vjp(fwd, bwd, name="closing_over")


@pytest.mark.parametrize("how", ["parameter", "non-leaf", "buffer"])
@pytest.mark.parametrize("hook", sorted(HOOKS), ids=sorted(HOOKS))
def test_a_closed_over_residual_is_a_constant_and_the_callers_tensor_is_untouched(how, hook):
    a = torch.randn(3, dtype=torch.float64, requires_grad=True)
    captured = {"parameter": torch.nn.Parameter(a.detach().clone()), "non-leaf": a * 2, "buffer": a.detach() * 2}[how]
    before = (captured.requires_grad, captured.grad_fn, captured.is_leaf, type(captured))
    x = torch.randn(3, dtype=torch.float64, requires_grad=True)
    with HOOKS[hook]():
        y = _closing_over(captured)(x)
    assert (captured.requires_grad, captured.grad_fn, captured.is_leaf, type(captured)) == before
    # the caller's other use of the captured tensor still gets its gradient; fwd's use is a constant
    (y.sum() + (captured * 3).sum()).backward()
    torch.testing.assert_close(x.grad, captured.detach(), rtol=0, atol=0)
    if how == "parameter":
        torch.testing.assert_close(captured.grad, torch.full_like(a, 3.0), rtol=0, atol=0)
    elif how == "non-leaf":
        torch.testing.assert_close(a.grad, torch.full_like(a, 6.0), rtol=0, atol=0)


@pytest.mark.parametrize("how", ["parameter", "non-leaf", "buffer"])
def test_a_closed_over_tensor_returned_as_output_is_not_rewired(how):
    a = torch.randn(3, requires_grad=True)
    captured = {"parameter": torch.nn.Parameter(torch.randn(3)), "non-leaf": a * 2, "buffer": torch.randn(3)}[how]
    before = (captured.requires_grad, captured.grad_fn, captured.is_leaf)
    x = torch.randn(3, requires_grad=True)
    y = _closing_over(captured, as_output=True)(x)
    assert (captured.requires_grad, captured.grad_fn, captured.is_leaf) == before
    assert y is not captured and y.grad_fn is not None
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.ones(3), rtol=0, atol=0)


def test_a_closed_over_parameter_under_torch_func_and_compile():
    w = torch.nn.Parameter(torch.randn(3, dtype=torch.float64))
    f = _closing_over(w)
    x = torch.randn(3, dtype=torch.float64)
    g = torch.func.grad(lambda x: f(x).sum())(x)
    torch.testing.assert_close(g, w.detach(), rtol=0, atol=0)
    xc = x.clone().requires_grad_()
    torch.compile(lambda x: f(x).sum(), backend="aot_eager", fullgraph=True)(xc).backward()
    torch.testing.assert_close(xc.grad, w.detach(), rtol=0, atol=0)
    assert w.requires_grad and w.is_leaf and w.grad_fn is None


@pytest.mark.parametrize(
    "outs",
    [
        lambda W, x: (W, W[:2]),
        lambda W, x: (W[:2], W),
        lambda W, x: (x * 1, W, W.t()),
        lambda W, x: (W.view(2, 2), W.view(4)),
    ],
    ids=["W,W[:2]", "W[:2],W", "x,W,W.t", "views"],
)
@pytest.mark.parametrize("how", ["parameter", "non-leaf", "buffer"])
@pytest.mark.parametrize("mode", ["eager", "vjp"])
def test_a_closed_over_tensor_returned_with_a_view_of_it_is_untouched(outs, how, mode):
    """Outputs sharing storage keep torch's view rule among themselves, around a detached alias
    of their root, never the caller's tensor itself."""
    a = torch.randn(4, requires_grad=True)
    W = {"parameter": torch.nn.Parameter(torch.randn(4)), "non-leaf": a * 2, "buffer": torch.randn(4)}[how]
    before = (W.requires_grad, W.grad_fn, W.is_leaf, W._version)
    f = custom_vjp(lambda x: (outs(W, x), (x,)), lambda res, d: (torch.ones_like(res[0]),), name="views_of_W")
    x = torch.randn(4, requires_grad=True)
    if mode == "eager":
        ys = f(x)
        assert all(y is not W for y in ys)
        sum(y.sum() for y in ys).backward()
        torch.testing.assert_close(x.grad, torch.ones(4), rtol=0, atol=0)
    else:
        ys, pull = torch.func.vjp(f, x.detach())
        torch.testing.assert_close(pull(tuple(torch.ones_like(y) for y in ys))[0], torch.ones(4), rtol=0, atol=0)
    assert (W.requires_grad, W.grad_fn, W.is_leaf, W._version) == before
    if how == "parameter":  # still trainable: the caller's own use of it gets its gradient
        (x.detach() * W).sum().backward()
        torch.testing.assert_close(W.grad, x.detach(), rtol=0, atol=0)


def test_outputs_sharing_storage_are_views_of_one_output_and_an_input_output_a_view_of_it():
    """``(y, y[1])``: the second output is a view of the first (torch's rule among outputs that
    share storage), with y[1]'s values; an input handed back among several outputs is a view of
    the caller's tensor, not the tensor itself."""

    def fwd(x):
        y = x * 2
        return (y, y[1]), None

    f = custom_vjp(fwd, lambda res, d: (2 * d[0],), name="y_and_row")
    x = torch.randn(2, 3, requires_grad=True)
    y, row = f(x)
    assert y._base is None and row._base is y
    assert torch.equal(y, x.detach() * 2) and torch.equal(row, x.detach()[1] * 2)
    g = custom_vjp(lambda x: ((x, x * 2), None), lambda res, d: (d[0] + 2 * d[1],), name="x_and_2x")
    same, twice = g(x)
    assert same is not x and same._base is x and torch.equal(same, x) and torch.equal(twice, 2 * x)


def test_function_attributes_are_the_autograd_functions_the_calls_record():
    """A plain eager call records ``f.Lean`` (NOTE: [The lean run]); forward mode and torch.func
    run ``f.Function``. Both name the node after the pair."""
    f = custom_vjp(lambda x: (x * 2, None), lambda res, d: (2 * d,), jvp=lambda res, t: 2 * t[0], name="twice")
    x = torch.ones(2, requires_grad=True)
    y = f(x)
    assert issubclass(f.Lean, torch.autograd.Function) and y.grad_fn._forward_cls is f.Lean
    with torch.autograd.forward_ad.dual_level():
        y = f(torch.autograd.forward_ad.make_dual(x, torch.ones(2)))
    assert issubclass(f.Function, torch.autograd.Function) and y.grad_fn._forward_cls is f.Function
    assert type(y.grad_fn).__name__ == type(f(x).grad_fn).__name__ == "CustomVJP_twiceBackward"


def test_vmap_fold_rule_of_a_pair_with_several_outputs():
    """The fold rule's unfold gets the whole output structure and gives dims shaped like it."""

    def fwd(x, w):
        return (x * w, x + w), (x, w)

    def fold(batch_size, in_dims, x, w):
        return (
            (x.movedim(in_dims[0], 0).reshape(-1), w.repeat(batch_size)),
            lambda out: ((out[0].view(batch_size, -1), out[1].view(batch_size, -1)), (0, 0)),
        )

    f = custom_vjp(fwd, lambda r, d: (d[0] * r[1] + d[1], d[0] * r[0] + d[1]), vmap=fold, name="two_out")
    xb, w = torch.randn(3, 4), torch.randn(4)
    prod, total = torch.func.vmap(lambda x: f(x, w))(xb)
    assert torch.equal(prod, xb * w) and torch.equal(total, xb + w)


def test_fwd_breaking_the_pair_contract_for_one_element_is_named_under_vmap_grad():
    """Under vmap(grad(f)) with a fold rule, fwd runs again on batch element 0 for the plan; a
    result that is not a pair there is reported with the pair's name."""

    def fwd(x):
        return (x * 2, (x,)) if x.dim() == 2 else x * 2

    f = custom_vjp(
        fwd, lambda r, d: (2 * d,), vmap=lambda b, dims, x: ((x.movedim(dims[0], 0),), lambda y: (y, 0)), name="flaky"
    )
    with pytest.raises(TypeError, match=r"^custom_vjp\(flaky\): fwd must return a pair \(out, residuals\)"):
        torch.func.vmap(torch.func.grad(lambda x: f(x).sum()))(torch.randn(3, 4))


# --- nondiff_argnums and cotangents for None arguments (the second adversarial pass) --------------


def test_a_tensor_inside_a_nondiff_argument_is_refused():
    """A tensor nested in a nondiff argument would get no gradient, silently: refused, like a
    bare one (a structure of plain values passes)."""
    f = custom_vjp(lambda x, o: (x * o["s"], ()), lambda r, dy: (dy,), nondiff_argnums=(1,))
    x = torch.ones(3)
    with pytest.raises(TypeError, match="argument 1 is or holds a Tensor"):
        f(x, {"s": torch.full((3,), 2.0)})
    with pytest.raises(TypeError, match="argument 1 is or holds a Tensor"):
        f(x, [1, torch.zeros(())])
    g = custom_vjp(lambda x, o: (x * o["s"], ()), lambda r, dy: (dy * 2,), nondiff_argnums=1)  # (an int)
    xr = x.clone().requires_grad_()
    (dx,) = torch.autograd.grad(g(xr, {"s": 2.0}).sum(), xr)
    torch.testing.assert_close(dx, torch.full((3,), 2.0))


def test_a_cotangent_for_an_argument_that_was_none_is_ignored():
    """bwd may compute a bias grad whether or not a bias was passed: the cotangent of a None
    argument is ignored, as a pytree's None subtree has no leaves (under autograd and torch.func)."""

    def fwd(x, w, b):
        return x @ w.T + (0 if b is None else b), (x, w)

    def bwd(r, dy):
        x, w = r
        return dy @ w, dy.T @ x, dy.sum(0)

    f = custom_vjp(fwd, bwd)
    x, w = torch.randn(4, 3, requires_grad=True), torch.randn(2, 3, requires_grad=True)
    dx, dw = torch.autograd.grad(f(x, w, None).sum(), (x, w))
    torch.testing.assert_close(dx, torch.ones(4, 2) @ w)
    torch.testing.assert_close(dw, torch.ones(4, 2).T @ x)
    dx2 = torch.func.grad(lambda x: f(x, w.detach(), None).sum())(x.detach())
    torch.testing.assert_close(dx2, dx)


def test_a_bwd_returning_cotangents_for_nondiff_arguments_is_told_so():
    f = custom_vjp(lambda x, o: (x * 2, ()), lambda r, dy: (dy * 2, None), nondiff_argnums=(1,))
    x = torch.randn(3, requires_grad=True)
    with pytest.raises(TypeError, match=r"per differentiable argument \(nondiff_argnums=\(1,\) excluded\)"):
        torch.autograd.grad(f(x, 3).sum(), x)


@pytest.mark.parametrize("where", ["argument", "in-a-list"])
def test_a_tensor_that_escaped_a_transform_is_unwrapped(where):
    """A tensor kept from inside ``torch.func.grad`` is a dead wrapper afterwards; passed to a
    pair (as an argument, or among a list of tensors) it is unwrapped as torch's own apply
    does, and the gradients are the plain ones."""
    leaked = {}

    def inner(t):
        leaked["t"] = t
        return t.sum()

    torch.func.grad(inner)(torch.full((3,), 3.0))
    dead = leaked["t"]
    assert torch._C._functorch.is_functorch_wrapped_tensor(dead)
    f = custom_vjp(lambda x, w, ws: (x * w * ws[0], (w, ws[0])), lambda r, dy: (dy * r[0] * r[1], None, [None]))
    x = torch.full((3,), 2.0, requires_grad=True)
    w, ws = (dead, [torch.full((3,), 5.0)]) if where == "argument" else (torch.full((3,), 5.0), [dead])
    y = f(x, w, ws)
    torch.testing.assert_close(y.detach(), torch.full((3,), 30.0))
    (dx,) = torch.autograd.grad(y.sum(), x)
    torch.testing.assert_close(dx, torch.full((3,), 15.0))


# --- outputs: a residual that is the output, outputs sharing storage, what fwd must return -----


def _x(requires_grad=True):
    g = torch.Generator().manual_seed(0)
    return torch.randn(3, dtype=torch.float64, generator=g, requires_grad=requires_grad)


def _exp_fwd(x):
    y = torch.exp(x)
    return y, (y,)  # JAX's classic: the output is the residual


exp = custom_vjp(_exp_fwd, lambda res, dy: (dy * res[0],))


def test_a_residual_that_is_the_output_keeps_the_output_differentiable():
    """Was: the output was also returned as an extra output and marked non-differentiable,
    which made the output itself non-differentiable: no error when something else in the loss
    requires grad, just a silently missing gradient."""
    x = _x()
    y = exp(x)
    assert y.requires_grad and y.grad_fn is not None
    (y.sum() + x.sum()).backward()
    torch.testing.assert_close(x.grad, torch.exp(x).detach() + 1)
    (g,) = torch.autograd.grad(torch.autograd.grad(exp(x).sum(), x, create_graph=True)[0].sum(), x)
    torch.testing.assert_close(g, torch.exp(x).detach())
    torch.testing.assert_close(torch.func.grad(lambda x: exp(x).sum())(x.detach()), torch.exp(x).detach())
    torch.testing.assert_close(
        torch.func.vmap(torch.func.grad(lambda x: exp(x).sum()))(x.detach()[:, None]), torch.exp(x).detach()[:, None]
    )


def test_a_residual_output_changed_in_place_before_backward_raises():
    x = _x()
    y = exp(x)
    y.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


_identity = custom_vjp(lambda x: (x, (x,)), lambda res, dy: (dy,))


def test_an_input_returned_as_is_and_saved_as_a_residual_works():
    """Was: torch's "An input that has been returned as-is as output is being saved for
    backward. This is not supported if you override setup_context" (the old ctx-style
    Function took it)."""
    x = _x()
    torch.testing.assert_close(torch.autograd.grad(_identity(x).sum() * 2, x)[0], torch.full_like(x, 2))
    torch.testing.assert_close(torch.func.grad(lambda x: _identity(x).sum())(x.detach()), torch.ones(3, dtype=x.dtype))


def test_a_residual_that_is_the_output_compiles():
    """Was: dynamo's "Placeholder node not found in env" (the output returned twice)."""
    x = _x()
    y = torch.compile(exp, fullgraph=True, backend="aot_eager")(x)
    torch.testing.assert_close(torch.autograd.grad(y.sum(), x)[0], torch.exp(x).detach())


def test_a_non_tensor_output_leaf_is_named_in_the_error():
    """fwd's output must be tensors: the error said only the spec (``PyTreeSpec((*, *), ...)``),
    not which leaf was wrong nor what it was."""
    f = custom_vjp(lambda x: ((x * 2, None), ()), lambda res, d: (d[0] * 2,))
    with pytest.raises(TypeError, match=r"output leaf 1 is None \(NoneType\)"):
        f(_x())


def _double_fwd(x):
    y = x * 2
    return (y, y[0]), None


def _double_bwd(res, g):
    gy, gv = g
    gx = gy * 2
    if gv is not None:
        gx = gx.clone()
        gx[0] += gv * 2
    return (gx,)


def _two_views_fwd(x):
    buf = x * 2
    return (buf.view(-1), buf.view(x.shape)), None


def _two_views_bwd(res, g):
    ga, gb = g
    out = torch.zeros_like(gb) if gb is not None else torch.zeros_like(ga).view(-1, 3)
    if ga is not None:
        out = out + 2 * ga.view(out.shape)
    if gb is not None:
        out = out + 2 * gb
    return (out,)


@pytest.mark.parametrize("case", ["output_and_its_view", "two_views_of_one_buffer"])
def test_in_place_on_an_output_sharing_storage_is_never_silently_wrong(case):
    # 3e85913 handed out every view of an fwd-made tensor detached; for (y, y[0]) that made y[0]
    # a tensor of its own on y's storage: y[0].mul_(3) changed y's value but not its gradient,
    # so x.grad came out silently wrong. Now such outputs keep torch's rule: the in-place op
    # either raises or gives plain torch's gradient.
    fwd, bwd = {
        "output_and_its_view": (_double_fwd, _double_bwd),
        "two_views_of_one_buffer": (_two_views_fwd, _two_views_bwd),
    }[case]
    f = fd.custom_vjp(fwd, bwd)
    x = torch.randn(2, 3, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)

    a_ref, b_ref = fwd(x_ref)[0]
    b_ref.mul_(3)
    (a_ref.sum() * 1.5 + b_ref.sum()).backward()

    a, b = f(x)
    try:
        b.mul_(3)
    except RuntimeError as e:  # torch's rule for a view of a Function's output
        assert "view" in str(e).lower() and "inplace" in str(e).replace("-", "").replace(" ", "").lower()
        return
    (a.sum() * 1.5 + b.sum()).backward()
    torch.testing.assert_close(x.grad, x_ref.grad)


def test_a_lone_view_of_an_fwd_tensor_is_still_modifiable_in_place():
    # the case 3e85913 was for: Linear's reshape of its GEMM output, then y += r
    x = torch.randn(2, 4, 8, requires_grad=True)
    w = torch.randn(5, 8, requires_grad=True)
    y = fd.linear(x, w)
    y += 1.0
    y.sum().backward()
    torch.testing.assert_close(w.grad, x.detach().reshape(-1, 8).sum(0).expand(5, 8))


def test_custom_vjp_fwd_returning_a_bare_tensor():
    f = fd.custom_vjp(lambda x: x * 2, lambda res, dy: (dy * 2,), name="double")
    x = torch.ones(3, requires_grad=True)
    with pytest.raises(
        TypeError, match=r"custom_vjp\(double\): fwd must return a pair \(out, residuals\).*bare Tensor of shape \(3,\)"
    ):
        f(x)
    with pytest.raises(TypeError, match="fwd must return a pair"):
        torch.func.grad(lambda x: f(x).sum())(x)
    with torch.no_grad(), pytest.raises(TypeError, match="fwd must return a pair"):
        f(x)


def test_custom_vjp_default_primal_under_no_grad():
    calls = []

    def fwd(x):
        calls.append("fwd")
        return x * 3, ()

    f = fd.custom_vjp(fwd, lambda res, dy: (dy * 3,))
    with torch.no_grad():
        y = f(torch.ones(2, requires_grad=True))
    assert y.grad_fn is None and calls == ["fwd"] and y.tolist() == [3.0, 3.0]


# --- residual records, declared inside the tests -----------------------------------------------
# (Written to kill mutants of `bash .ci/mutation`: mutmut forks each mutant's run from a process
# that imported functional_dw unmutated, so whatever runs at import (``custom_vjp(...)`` building
# the layers' bridges, ``@residuals`` and ``saved()`` declaring their records) keeps its original
# code there. These tests declare their records, and the next section builds its bridges, inside
# the test, where a mutant of ``custom_vjp``/``residuals``/``saved`` is live. The equivalent
# mutants no test can kill: tests/support/mutation_equivalents.md.)

D = torch.float64
SPLITS = (2, 0, 3)
E, K, N, T = 3, 8, 4, sum(SPLITS)
_rand = functools.partial(randn, dtype=D, draw_dtype=None)  # (drawn in float64)


def _declare():
    @residuals
    class Rec:
        x: torch.Tensor = saved()
        w: torch.Tensor
        k: int
        y: torch.Tensor | None = saved(default=None)

    return Rec


def test_record_saved_fields_are_the_leaves_and_the_rest_context():
    Rec = _declare()
    x, w, y = _rand(3), _rand(2, seed=1), _rand(4, seed=2)
    r = Rec(x=x, w=w, k=7, y=y)
    assert Rec(x=x, w=w, k=7).y is None  # saved(default=None) keeps its default
    leaves, spec = pytree.tree_flatten(r)
    assert len(leaves) == 2 and leaves[0] is x and leaves[1] is y
    assert [id(t) for t in saved_activations(r)] == [id(x), id(y)]
    paths = [pytree.keystr(p) for p, _ in pytree.tree_flatten_with_path(r)[0]]
    assert paths == [".x", ".y"]
    fresh = [x.clone(), y.clone()]  # what an unpack hook hands back
    for traced in (False, True):  # eager rebuild, and the constructor dynamo traces
        with mock.patch("torch.compiler.is_compiling", return_value=traced):
            r2 = pytree.tree_unflatten(fresh, spec)
        assert type(r2) is Rec and r2.x is fresh[0] and r2.y is fresh[1]
        assert r2.w is w and r2.k == 7
        with pytest.raises(dataclasses.FrozenInstanceError):
            r2.k = 8
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.x = y
    assert r == r and r != Rec(x=x, w=w, k=7, y=y)  # identity, never a field-wise tensor compare


def test_record_repr_states_every_field_exactly():
    @residuals
    class Rec:
        x: torch.Tensor = saved()
        ws: tuple
        mixed: list
        name: str
        sixty: str
        empty: tuple
        n: int
        gone: torch.Tensor | None = saved(default=None)

    x = torch.zeros(2, 3, dtype=torch.float32)
    ws = (torch.zeros(4, 5, dtype=torch.bfloat16), torch.zeros(4, 5, dtype=torch.bfloat16))
    mixed = [torch.zeros(1, dtype=D), torch.zeros(2, dtype=D)]
    r = Rec(x=x, ws=ws, mixed=mixed, name="n" * 59, sixty="s" * 58, empty=(), n=3)
    assert repr(r) == "\n".join(
        [
            "Rec(",
            "  [saved] x = Tensor[2, 3] float32 24 B",
            "  [ref  ] ws = 2 x Tensor[4, 5] (by reference)",
            "  [ref  ] mixed = 2 x Tensormixed (by reference)",
            "  [ref  ] name = '" + "n" * 56 + "...",  # 61 characters: cut to 57 and '...'
            "  [ref  ] sixty = '" + "s" * 58 + "'",  # 60 characters: kept whole
            "  [ref  ] empty = ()",
            "  [ref  ] n = 3",
            "  [saved] gone = None",
            ")  # 24 B through save_for_backward",
        ]
    )
    r = Rec(x=x, ws=ws, mixed=[mixed[0], torch.zeros(1)], name="", sixty="", empty=(), n=0, gone=torch.zeros(3))
    text = repr(r)
    assert "  [ref  ] mixed = 2 x Tensor[1] (by reference)" in text
    assert text.endswith(")  # 36 B through save_for_backward")
    assert "[ref  ] ws = 2 x Parameter[4, 5] (by reference)" in repr(
        dataclasses.replace(r, ws=[torch.nn.Parameter(ws[0]), ws[1]])
    )


def test_record_needed_field_is_none_by_default_and_set_by_with_needs_and_unflatten():
    from functional_dw.residuals import needed, split, with_needs

    @residuals
    class Rec:
        x: torch.Tensor = saved()
        k: int = 5
        n: object = needed()

    x = _rand(3)
    r = Rec(x=x)
    assert Rec.__needs_field__ == "n" and Rec.__saved_fields__ == ("x",)
    assert r.n is None and r.k == 5 and r.x is x  # needed() defaults to None; a field's own default kept
    r2 = with_needs(r, (True, False))
    assert r2.n == (True, False) and r.n is None and r2.x is x and r2.k == 5
    with mock.patch("torch.compiler.is_compiling", return_value=True):  # dataclasses.replace under dynamo
        r3 = with_needs(r, (False, True))
    assert type(r3) is Rec and r3.n == (False, True) and r3.x is x and r3.k == 5
    values, spec = split(r2)
    assert len(values) == 1 and values[0] is x
    assert spec.unflatten([x]).n == (True, False)  # no needs given: the record's own stays
    back = spec.unflatten([x], needs=(False, False))
    assert back.n == (False, False) and back.x is x and back.k == 5


def test_record_fast_init_only_where_it_keeps_dataclass_semantics():
    """The fast ``__init__`` (which fills the instance dict at once) replaces the dataclass's for
    plain records; records with a keyword-only field, a ``__post_init__`` or a
    ``default_factory`` keep the dataclass's, whose semantics the fast one would break."""
    from functional_dw.residuals import needed

    x = _rand(3)

    @residuals
    class Plain:
        x: torch.Tensor = saved()
        k: int = 3
        n: object = needed()

    assert Plain.__init__.__wrapped__ is not None and Plain.__init__.__qualname__.endswith("Plain.__init__")
    assert Plain(x, 4).k == 4 and Plain(x).k == 3

    @residuals
    class KW:
        x: torch.Tensor = saved()
        n: object = needed(kw_only=True)

    assert KW(x).n is None and KW(x, n=(True,)).n == (True,)
    with pytest.raises(TypeError):
        KW(x, (True,))  # keyword-only stays keyword-only

    @residuals
    class Post:
        x: torch.Tensor = saved()
        k: int = 1

        def __post_init__(self):
            object.__setattr__(self, "k", self.k * 10)

    assert Post(x=x, k=2).k == 20

    @residuals
    class Fac:
        x: torch.Tensor = saved()
        tags: list = dataclasses.field(default_factory=list)

    a, b = Fac(x=x), Fac(x=x)
    assert a.tags == [] and a.tags is not b.tags
    for cls in (KW, Post, Fac):
        assert not hasattr(cls.__init__, "__wrapped__")


def test_record_fast_init_calls_the_dataclass_init_under_dynamo():
    from functional_dw.residuals import needed

    x = _rand(3)
    with mock.patch("torch.compiler.is_compiling", return_value=True):  # the record made and built while traced

        @residuals
        class Traced:
            x: torch.Tensor = saved()
            k: int = 3
            n: object = needed()

        t = Traced(x, 4)
    assert t.x is x and t.k == 4 and t.n is None


def test_any_needed_reads_bools_lists_and_nested_needs():
    from functional_dw.residuals import any_needed

    assert any_needed(True) and not any_needed(False) and not any_needed(None)
    assert any_needed([False, True]) and not any_needed([False, False]) and not any_needed([])
    assert any_needed([[False], [True]]) and not any_needed([[False], [False]])  # per expert, nested
    assert any_needed({"w": (False, True)}) and not any_needed({"w": (False,)})


def test_record_repr_of_a_list_holding_tensors_and_none():
    @residuals
    class Rec:
        x: torch.Tensor = saved()
        pair: list

    text = repr(Rec(x=torch.zeros(1), pair=[torch.zeros(2), None]))
    assert "  [ref  ] pair = 2 x Tensor, e.g. tensor([0., 0.]): 8 B" in text


# --- the layers' bridges, built inside the tests (see above), and user pairs -------------------


def _fresh_linear():
    """The Linear bridge exactly as linear.py builds it at import (called without FP8), its
    options the one nondiff argument."""
    f = custom_vjp(
        lin_mod._fwd,
        lin_mod._bwd,
        nondiff_argnums=(3,),
        primal=lin_mod._primal,
        jvp=lin_mod._jvp,
        vmap=lin_mod._vmap,
        name="linear",
    )
    return lambda x, w, b, fuse, backend: f(x, w, b, Options(fuse, None, backend, None))


def _fresh_grouped():
    f = custom_vjp(
        gl_mod._fwd,
        gl_mod._bwd,
        nondiff_argnums=(4,),
        primal=gl_mod._primal,
        jvp=gl_mod.jvp,
        vmap=gl_mod._vmap,
        name="grouped_linear",
    )
    return lambda x, ws, bs=None, backend=None: f(x, ws, gl_mod.HostSplits(SPLITS), bs, Options(False, None, backend))


def _linear_args(seed=0, grad=True):
    return _rand(5, K, seed=seed, grad=grad), _rand(N, K, seed=seed + 1, grad=grad), _rand(N, seed=seed + 2, grad=grad)


def test_fresh_linear_bridge_under_autograd_hooks_and_retain_graph():
    f = _fresh_linear()
    x, w, b = _linear_args()
    with HOOKS["identity"]() as rec:
        y = f(x, w, b, False, None)
    assert rec.packed == [x] or (len(rec.packed) == 1 and rec.packed[0] is x)
    assert type(y.grad_fn).__name__ == "CustomVJP_linearBackward"
    torch.testing.assert_close(y, F.linear(x, w, b))
    dy = _rand(5, N, seed=9)
    want = torch.autograd.grad(F.linear(x, w, b), (x, w, b), dy)
    for _ in range(2):  # backward never consumes its state
        got = torch.autograd.grad(y, (x, w, b), dy, retain_graph=True)
        torch.testing.assert_close(got, want)
    assert rec.unpacks == 2
    # only the inputs that require grad get one, each its own
    x2, w2, b2 = x.detach().requires_grad_(), w.detach(), b.detach().requires_grad_()
    y2 = f(x2, w2, b2, False, None)
    (y2 * dy).sum().backward()
    torch.testing.assert_close((x2.grad, b2.grad), (want[0], want[2]))
    assert w2.grad is None


def test_fresh_bridge_without_grad_runs_primal_only():
    calls = []

    def fwd(x):
        calls.append("fwd")
        return x * 2, (x,)

    def primal(x):
        calls.append("primal")
        return x * 2

    f = custom_vjp(fwd, lambda res, dy: (dy * 2,), primal=primal)
    x = torch.ones(3, requires_grad=True)
    with torch.no_grad():
        assert f(x).grad_fn is None
    with torch.inference_mode():
        assert f(x).grad_fn is None
        with torch.enable_grad():  # enable_grad inside inference_mode records nothing
            assert f(x).grad_fn is None
    assert f(torch.ones(3)).grad_fn is None  # nothing requires grad
    with torch.inference_mode():
        xi = torch.ones(3).requires_grad_()
    torch.testing.assert_close(f(xi), 2 * xi)  # an inference tensor counts as not requiring grad
    assert calls == ["primal"] * 5
    assert f(x).grad_fn is not None and calls[-1] == "fwd"
    g = custom_vjp(fwd, lambda res, dy: (dy * 2,))  # default primal: fwd's output
    calls.clear()
    with torch.no_grad():
        torch.testing.assert_close(g(x), torch.full((3,), 2.0))
    assert calls == ["fwd"] and g.fwd is fwd and torch.equal(g.primal(x), 2 * x)


def test_fresh_linear_bridge_under_torch_func():
    f = _fresh_linear()
    x, w, b = _linear_args(grad=False)
    dy = _rand(5, N, seed=9)
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    want = torch.autograd.grad(F.linear(*leaves), leaves, dy)
    got = grad(lambda x, w, b: (f(x, w, b, False, None) * dy).sum(), argnums=(0, 1, 2))(x, w, b)
    torch.testing.assert_close(got, want)
    y, pull = vjp(lambda x, w, b: f(x, w, b, False, None), x, w, b)
    torch.testing.assert_close(y, F.linear(x, w, b))
    torch.testing.assert_close(pull(dy), want)
    tx, tw, tb = _linear_args(seed=20, grad=False)
    _, t = jvp(lambda x, w, b: f(x, w, b, False, None), (x, w, b), (tx, tw, tb))
    _, t_ref = jvp(F.linear, (x, w, b), (tx, tw, tb))
    torch.testing.assert_close(t, t_ref)


@pytest.mark.parametrize("in_dim", [0, 1])
def test_fresh_bridges_vmap_fold_loop_and_per_example_grads(in_dim):
    f = _fresh_linear()
    x, w, b = _linear_args(grad=False)
    xb = _rand(3, 5, K, seed=30).movedim(0, in_dim)
    k = CountingKernels()
    y = vmap(lambda x: f(x, w, b, False, k), in_dims=in_dim)(xb)
    assert k.calls == 1  # folded: one GEMM for the batch
    torch.testing.assert_close(y, F.linear(xb.movedim(in_dim, 0), w, b))
    W = torch.stack([w, 2 * w, -w])  # an ensemble: one call per element
    k.calls = 0
    torch.testing.assert_close(vmap(lambda w: f(x, w, b, False, k))(W), torch.stack([F.linear(x, v, b) for v in W]))
    assert k.calls == 3
    dy = _rand(5, N, seed=9)
    per_x = vmap(grad(lambda x, w: (f(x, w, b, False, None) * dy).sum(), argnums=(0, 1)), in_dims=(in_dim, None))
    dx, dw = per_x(xb, w)
    for i, xe in enumerate(xb.movedim(in_dim, 0)):
        leaves = [xe.clone().requires_grad_(), w.clone().requires_grad_()]
        want = torch.autograd.grad(F.linear(leaves[0], leaves[1], b), leaves, dy)
        torch.testing.assert_close((dx[i], dw[i]), want)
    dW = vmap(grad(lambda w: (f(x, w, b, False, None) * dy).sum()))(W)
    torch.testing.assert_close(dW, torch.stack([dy.t() @ x] * 3))


def test_fresh_grouped_bridge_everywhere():
    f = _fresh_grouped()
    x = _rand(T, K, seed=40)
    ws = [_rand(N, K, seed=41 + e) for e in range(E)]
    bs = [_rand(N, seed=50 + e) for e in range(E)]
    dy = _rand(T, N, seed=60)
    leaves = [t.clone().requires_grad_() for t in (x, *ws, *bs)]
    want = torch.autograd.grad(ref_grouped(leaves[0], leaves[1:4], SPLITS, leaves[4:]), leaves, dy)
    xl, wl, bl = leaves[0], leaves[1:4], leaves[4:]
    y = f(xl, wl, bl)
    assert type(y.grad_fn).__name__ == "CustomVJP_grouped_linearBackward"
    torch.testing.assert_close(torch.autograd.grad(y, leaves, dy), want)
    dx, dws, dbs = grad(lambda x, ws, bs: (f(x, ws, bs) * dy).sum(), argnums=(0, 1, 2))(x, ws, bs)
    torch.testing.assert_close([dx, *dws, *dbs], list(want))
    tx, tws = _rand(T, K, seed=70), [_rand(N, K, seed=71 + e) for e in range(E)]
    _, t = jvp(lambda x, ws: f(x, ws, bs), (x, ws), (tx, tws))
    _, t_ref = jvp(lambda x, ws: ref_grouped(x, ws, SPLITS, bs), (x, ws), (tx, tws))
    torch.testing.assert_close(t, t_ref)
    xb = _rand(2, T, K, seed=80)
    k = CountingKernels()
    torch.testing.assert_close(
        vmap(lambda x: f(x, ws, bs, k))(xb), torch.stack([ref_grouped(v, ws, SPLITS, bs) for v in xb])
    )
    assert k.calls == 1
    dxb = vmap(grad(lambda x: (f(x, ws, bs) * dy).sum()))(xb)
    torch.testing.assert_close(dxb, torch.stack([want[0]] * 2))


def _two_fwd(x, w, scale):
    return (x * w * scale, torch.sin(x)), ("ctx", x, 3, torch.cos(x), w, scale)


def _two_bwd(res, d_out):
    _, x, three, cos_x, w, scale = res
    assert three == 3
    da, db = d_out
    return da * w * scale + db * cos_x, da * x * scale, None


def _two_jvp(res, tangents):
    _, x, _, cos_x, w, scale = res
    tx, tw, _ = tangents
    tx = torch.zeros_like(x) if tx is None else tx
    tw = torch.zeros_like(w) if tw is None else tw
    return (tx * w * scale + x * tw * scale, cos_x * tx)


def _two_ref(x, w, scale):
    return x * w * scale, torch.sin(x)


def test_two_output_pair_eager_func_jvp_and_vmap():
    f = custom_vjp(_two_fwd, _two_bwd, jvp=_two_jvp)
    x, w = _rand(5, seed=1), _rand(5, seed=2)
    da, db = _rand(5, seed=3), _rand(5, seed=4)
    leaves = [x.clone().requires_grad_(), w.clone().requires_grad_()]
    want = torch.autograd.grad(_two_ref(*leaves, 3.0), leaves, (da, db))
    a, b = f(*leaves, 3.0)
    assert type(a.grad_fn).__name__ == "CustomVJP__two_fwdBackward"
    torch.testing.assert_close(torch.autograd.grad((a, b), leaves, (da, db)), want)
    # only the first output used: the other's cotangent is zeros (autograd and torch.func)
    want_a = torch.autograd.grad(_two_ref(*leaves, 3.0)[0], leaves, da)
    a, _ = f(*leaves, 3.0)
    torch.testing.assert_close(torch.autograd.grad(a, leaves, da), want_a)
    got = grad(lambda x, w: (f(x, w, 3.0)[0] * da).sum(), argnums=(0, 1))(x, w)
    torch.testing.assert_close(got, want_a)
    got = grad(lambda x, w: sum((o * c).sum() for o, c in zip(f(x, w, 3.0), (da, db))), argnums=(0, 1))(x, w)
    torch.testing.assert_close(got, want)
    out, pull = vjp(lambda x, w: f(x, w, 3.0), x, w)
    torch.testing.assert_close(out, _two_ref(x, w, 3.0))
    torch.testing.assert_close(pull((da, db)), want)
    tx, tw = _rand(5, seed=5), _rand(5, seed=6)
    out, t = jvp(lambda x, w: f(x, w, 3.0), (x, w), (tx, tw))
    torch.testing.assert_close((out, t), jvp(lambda x, w: _two_ref(x, w, 3.0), (x, w), (tx, tw)))
    _, t = jvp(lambda x: f(x, w, 3.0), (x,), (tx,))
    torch.testing.assert_close(t, jvp(lambda x: _two_ref(x, w, 3.0), (x,), (tx,))[1])
    xb = _rand(4, 5, seed=7)
    ya, yb = vmap(lambda x: f(x, w, 3.0))(xb)
    torch.testing.assert_close((ya, yb), _two_ref(xb, w, 3.0))
    g = vmap(grad(lambda x: f(x, w, 3.0)[1].sum()))(xb)
    torch.testing.assert_close(g, torch.cos(xb))


def test_bridge_errors_name_the_pair_and_the_problem():
    x = torch.ones(2, requires_grad=True)
    for ret, got in [((x, x, x), "a tuple of 3"), (x * 1, "a bare Tensor of shape (2,)"), (5, "int")]:
        f = custom_vjp(lambda x, ret=ret: ret, lambda r, d: (d,), name="mine")
        want = rf"^custom_vjp\(mine\): fwd must return a pair \(out, residuals\), e\.g\. `return y, \(x,\)`; got {got}$"
        want = want.replace("(2,)", r"\(2,\)")
        for call in (lambda: f(x), lambda: f(x.detach()), lambda: grad(lambda x: f(x).sum())(x.detach())):
            with pytest.raises(TypeError, match=want):
                call()

    def named_fwd(x):
        return ([x * 2, "no"], (x,))

    for call in (lambda f: f(x), lambda f: grad(lambda x: f(x)[0].sum())(x.detach())):
        with pytest.raises(TypeError, match=r"^custom_vjp\(named_fwd\): fwd's output must be tensors; got "):
            call(custom_vjp(named_fwd, lambda r, d: (d[0] * 2,)))
    f = custom_vjp(lambda x: (x * 2, (x,)), lambda r, d: (d, d), name="op")
    for run in (lambda: f(x).sum().backward(), lambda: grad(lambda x: f(x).sum())(x.detach())):
        with pytest.raises(TypeError, match=r"^custom_vjp\(op\): bwd must return one cotangent per argument of fwd"):
            run()
    with pytest.raises(
        NotImplementedError, match=r"^custom_vjp\(op\) has no forward-mode rule, .*jacrev.*pass jvp=\.\.\."
    ):
        jvp(f, (x.detach(),), (torch.ones(2),))


def test_bridge_name_becomes_the_backward_node_name():
    f = custom_vjp(lambda x: (x * 2, (x,)), lambda r, d: (d * 2,), name="my-op.v2")
    assert type(f(torch.ones(2, requires_grad=True)).grad_fn).__name__ == "CustomVJP_my_op_v2Backward"
    assert f.fwd(torch.ones(1))[0].item() == 2.0 and f.bwd(None, torch.ones(1))[0].item() == 2.0


def test_fold_rule_with_intermediate_residuals_is_refused_under_vmap_grad():
    def fwd(x, w):
        return x * w, (torch.cos(x), w)  # cos(x) is not an input

    def fold(batch_size, in_dims, x, w):
        x_dim, w_dim = in_dims
        return (
            ((x.movedim(x_dim, 0).reshape(-1), w.repeat(batch_size)), lambda y: (y.view(batch_size, -1), 0))
            if w_dim is None
            else None
        )

    f = custom_vjp(fwd, lambda r, d: (d * r[1], d * r[0]), vmap=fold, name="fold")
    xb, w = torch.randn(3, 4), torch.randn(4)
    torch.testing.assert_close(vmap(lambda x: f(x, w))(xb), xb * w)  # plain vmap never asks for the plan
    with pytest.raises(
        NotImplementedError, match=r"^custom_vjp\(fold\): a vmap fold rule needs residuals that are inputs$"
    ):
        vmap(grad(lambda x: f(x, w).sum()))(xb)


def test_none_for_a_whole_subtree_of_arguments():
    def fwd(x, ws):
        return x * ws[0] * ws[1], (x, ws[0], ws[1])

    def bwd(res, dy):
        x, w0, w1 = res
        return dy * w0 * w1, None  # no gradient for any weight

    f = custom_vjp(fwd, bwd)
    x, ws = _rand(3, seed=1, grad=True), [_rand(3, seed=2, grad=True), _rand(3, seed=3, grad=True)]
    f(x, ws).sum().backward()
    torch.testing.assert_close(x.grad, (ws[0] * ws[1]).detach())
    assert ws[0].grad is None and ws[1].grad is None
    g = custom_vjp(fwd, lambda res, dy: (dy * res[1] * res[2], [None, dy * res[0] * res[1]]))
    x.grad = None
    g(x, ws).sum().backward()
    torch.testing.assert_close(ws[1].grad, (x * ws[0]).detach())
    bad = custom_vjp(fwd, lambda res, dy: (dy, [dy]), name="short")
    with pytest.raises(
        TypeError,
        match=r"(?s)^custom_vjp\(short\): bwd must return one cotangent per argument of fwd.*argument 1 is a list of 2 tensors, its cotangent a list of 1",
    ):
        bad(x, ws).sum().backward()


def test_a_pair_without_a_name_is_called_fwd():
    import functools

    f = custom_vjp(functools.partial(lambda s, x: (x * s, None), 2.0), lambda r, d: (d,))
    assert type(f(torch.ones(1, requires_grad=True)).grad_fn).__name__ == "CustomVJP_fwdBackward"
    g = custom_vjp(functools.partial(lambda x: x), lambda r, d: (d,))
    with pytest.raises(TypeError, match=r"^custom_vjp\(fwd\): fwd must return a pair"):
        g(torch.ones(1, requires_grad=True))


def test_none_subtree_under_torch_func():
    def fwd(x, ws):
        return x * ws[0] * ws[1], (x, ws[0], ws[1])

    f = custom_vjp(fwd, lambda res, dy: (dy * res[1] * res[2], None))
    x, ws = _rand(3, seed=1), [_rand(3, seed=2), _rand(3, seed=3)]
    dx, dws = grad(lambda x, ws: f(x, ws).sum(), argnums=(0, 1))(x, ws)
    torch.testing.assert_close(dx, ws[0] * ws[1])
    assert all(torch.equal(d, torch.zeros(3, dtype=D)) for d in dws)


def test_unused_output_gets_zeros_of_its_dtype_and_shape():
    seen = []

    def fwd(x):
        return (x.float() * 2, (x * 3)[:2]), (x,)

    def bwd(res, d_out):
        seen.append(d_out)
        return (2 * d_out[0].double() + 3 * d_out[1].sum(),)

    f = custom_vjp(fwd, bwd)
    x = _rand(4, seed=1)
    for run in (lambda: f(x.clone().requires_grad_())[0].sum().backward(), lambda: grad(lambda x: f(x)[0].sum())(x)):
        run()
        d_a, d_b = seen.pop()
        assert torch.equal(d_a, torch.ones(4))
        assert d_b.dtype == D and d_b.shape == (2,) and not d_b.any()


def test_backward_reads_residuals_through_the_hooks():
    got = []
    f = custom_vjp(lambda x: (x.sin(), (x,)), lambda res, dy: (got.append(res[0]) or dy * res[0].cos(),))
    x = _rand(3, seed=1, grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t):
        y = f(x)
    y.sum().backward()
    assert got[0] is not x  # what the unpack hook handed back, not a reference kept past the hook
    torch.testing.assert_close(x.grad, x.detach().cos())


def test_vmap_grad_of_a_folded_call_with_a_batch_of_one():
    f = _fresh_linear()
    x, w, b = _linear_args(grad=False)
    dy = _rand(5, N, seed=9)
    dx = vmap(grad(lambda x: (f(x, w, b, False, None) * dy).sum()))(x[None])
    torch.testing.assert_close(dx, (dy @ w)[None])


def test_needs_grad_in_a_traced_graph():
    cv = importlib.import_module("functional_dw.custom_vjp")
    with mock.patch("torch.compiler.is_compiling", return_value=True):
        assert cv.needs_grad((torch.ones(1, requires_grad=True), 3, "s"))
        assert not cv.needs_grad((torch.ones(1), 3, None))


def test_a_user_record_holding_its_weight_in_a_dict_is_rebound_per_level():
    """A record's context may hold the weight in a dict: a gradient penalty through it (nested
    torch.func levels; NOTE: [Context per level]) against float64 F.linear."""

    @residuals
    class DictResiduals:
        x: torch.Tensor = saved()
        params: dict

    lin = custom_vjp(
        lambda x, w: (x @ w.T, DictResiduals(x, {"w": w})),
        lambda r, dy: (dy @ r.params["w"], dy.T @ r.x),
        name="lin_dict",
    )
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3, dtype=torch.float64, generator=g)
    W = torch.randn(2, 3, dtype=torch.float64, generator=g)
    penalty = lambda f: torch.func.grad(  # noqa: E731
        lambda W: torch.func.grad(lambda x: f(x, W).sin().sum())(x).square().sum()
    )(W)
    torch.testing.assert_close(penalty(lin), penalty(torch.nn.functional.linear), rtol=1e-9, atol=1e-9)


# --- the lean run (NOTE: [The lean run]) ------------------------------------------------------------


def test_an_input_that_is_also_the_output_is_saved_as_the_input():
    """fwd returns x and keeps x: the residual is the caller's x (its own graph), not this node's
    output, so a double backward through a bwd that is not the identity's Jacobian (here a
    scaled gradient, d * x) differentiates x, not bwd again; hooks see the input itself."""
    f = custom_vjp(lambda x: (x, (x,)), lambda res, d: (d * res[0],), name="scaled_identity")
    x = torch.tensor([2.0, 3.0], requires_grad=True)
    with HOOKS["identity"]()() as rec:
        y = f(x)
    assert rec.packed[0] is x
    (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
    (gg,) = torch.autograd.grad(g.sum(), x)
    assert g.tolist() == [2.0, 3.0] and gg.tolist() == [1.0, 1.0]


def test_a_tensor_that_escaped_a_torch_func_transform_is_differentiated_as_the_tensor_it_wraps():
    """A dead functorch wrapper (kept from inside a finished torch.func.grad) reaches autograd
    unwrapped, as torch's Function.apply hands it over: its gradient reaches the leaf."""
    f = custom_vjp(lambda x: (x.sin(), (x,)), lambda r, d: (d * r[0].cos(),), name="sin")
    leak = []
    x0 = torch.randn(3, requires_grad=True, dtype=torch.float64)
    torch.func.grad(lambda x: (leak.append(x * 1), x.sum())[1])(x0)
    f(leak[0]).sum().backward()
    torch.testing.assert_close(x0.grad, x0.detach().cos())
