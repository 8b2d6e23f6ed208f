"""The custom_vjp bridge and residual records on their own, with user-defined fwd/bwd pairs."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
import torch.utils._pytree as pytree

from conftest import HOOKS
from functional_dw import custom_vjp, residuals, saved, saved_activations
from functional_dw.residuals import needed


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
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(5, dtype=torch.float64, generator=g, requires_grad=grad) for _ in range(2)]


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


@pytest.mark.parametrize("fwd, bwd", [
    pytest.param(two_fwd, lambda r, d: two_bwd(r, d)[:2], id="too-few"),
    pytest.param(two_fwd, lambda r, d: list(two_bwd(r, d)), id="list-not-tuple"),
    pytest.param(sin_fwd, lambda r, dy: dy * torch.cos(r.x), id="bare-tensor-not-tuple"),
])
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
    f = custom_vjp(lambda x: (x * 2, NestedResiduals((x, torch.cos(x)), 2)),
                   lambda res, dy: (dy * res.k + 0 * res.pair[1],), name="nested")
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
    captured = {"parameter": torch.nn.Parameter(a.detach().clone()), "non-leaf": a * 2,
                "buffer": a.detach() * 2}[how]
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


@pytest.mark.parametrize("outs", [lambda W, x: (W, W[:2]), lambda W, x: (W[:2], W), lambda W, x: (x * 1, W, W.t()),
                                  lambda W, x: (W.view(2, 2), W.view(4))], ids=["W,W[:2]", "W[:2],W", "x,W,W.t", "views"])
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


def test_function_attribute_is_the_autograd_function_the_calls_record():
    f = custom_vjp(lambda x: (x * 2, None), lambda res, d: (2 * d,), name="twice")
    y = f(torch.ones(2, requires_grad=True))
    assert issubclass(f.Function, torch.autograd.Function) and y.grad_fn._forward_cls is f.Function


def test_vmap_fold_rule_of_a_pair_with_several_outputs():
    """The fold rule's unfold gets the whole output structure and gives dims shaped like it."""
    def fwd(x, w):
        return (x * w, x + w), (x, w)

    def fold(batch_size, in_dims, x, w):
        return ((x.movedim(in_dims[0], 0).reshape(-1), w.repeat(batch_size)),
                lambda out: ((out[0].view(batch_size, -1), out[1].view(batch_size, -1)), (0, 0)))

    f = custom_vjp(fwd, lambda r, d: (d[0] * r[1] + d[1], d[0] * r[0] + d[1]), vmap=fold, name="two_out")
    xb, w = torch.randn(3, 4), torch.randn(4)
    prod, total = torch.func.vmap(lambda x: f(x, w))(xb)
    assert torch.equal(prod, xb * w) and torch.equal(total, xb + w)


def test_fwd_breaking_the_pair_contract_for_one_element_is_named_under_vmap_grad():
    """Under vmap(grad(f)) with a fold rule, fwd runs again on batch element 0 for the plan; a
    result that is not a pair there is reported with the pair's name."""
    def fwd(x):
        return (x * 2, (x,)) if x.dim() == 2 else x * 2

    f = custom_vjp(fwd, lambda r, d: (2 * d,), vmap=lambda b, dims, x: ((x.movedim(dims[0], 0),), lambda y: (y, 0)),
                   name="flaky")
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
