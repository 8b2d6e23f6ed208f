"""Tests written to kill mutants that survived `bash .ci/mutation` (mutmut over six modules).

Each asserts behaviour (numbers, errors, what a hook or a kernel saw). mutmut forks each
mutant's run from a process that imported functional_dw unmutated, so whatever runs at import
(``custom_vjp(...)`` building the layers' bridges, ``@residuals`` and ``saved()`` declaring
their records) keeps its original code there. The tests below therefore build their bridges
and records inside the test, where a mutant of ``custom_vjp``/``residuals``/``saved`` is live.
The equivalent mutants that no test can kill are listed in tests/support/mutation_equivalents.md.
"""

from __future__ import annotations

import dataclasses
import importlib
from unittest import mock

import pytest
import torch

from functional_dw.plan import Options
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch.func import grad, jvp, vjp, vmap

import functional_dw as fd
from conftest import HOOKS, FakeDW
from helpers import ref_grouped
from functional_dw import custom_vjp, residuals, saved, saved_activations
from functional_dw.kernels.torch_ref import TorchKernels

gl_mod = importlib.import_module("functional_dw.grouped_linear")  # the modules (the package's names are the functions)
lin_mod = importlib.import_module("functional_dw.linear")
dwp = importlib.import_module("functional_dw.distributed_weight")
ref_mod = importlib.import_module("functional_dw.kernels.torch_ref")

D = torch.float64
SPLITS = (2, 0, 3)
E, K, N, T = 3, 8, 4, sum(SPLITS)


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _rand(*shape, seed=0, grad=False, dtype=D):
    t = torch.randn(*shape, generator=_g(seed), dtype=dtype)
    return t.requires_grad_() if grad else t


# --- residual records, declared inside the tests ------------------------------------------


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
    assert repr(r) == "\n".join([
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
    ])
    r = Rec(x=x, ws=ws, mixed=[mixed[0], torch.zeros(1)], name="", sixty="", empty=(), n=0, gone=torch.zeros(3))
    text = repr(r)
    assert "  [ref  ] mixed = 2 x Tensor[1] (by reference)" in text
    assert text.endswith(")  # 36 B through save_for_backward")
    assert "[ref  ] ws = 2 x Parameter[4, 5] (by reference)" in repr(
        dataclasses.replace(r, ws=[torch.nn.Parameter(ws[0]), ws[1]]))


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


# --- the bridge, built inside the tests ---------------------------------------------------


def _fresh_linear():
    """The Linear bridge exactly as linear.py builds it at import (called without FP8), its
    options the one nondiff argument."""
    f = custom_vjp(lin_mod._fwd, lin_mod._bwd, nondiff_argnums=(3,), primal=lin_mod._primal, jvp=lin_mod._jvp,
                   vmap=lin_mod._vmap, name="linear")
    return lambda x, w, b, fuse, backend: f(x, w, b, Options(fuse, None, backend, None))


def _fresh_grouped():
    f = custom_vjp(gl_mod._fwd, gl_mod._bwd, nondiff_argnums=(4,), primal=gl_mod._primal, jvp=gl_mod._jvp,
                   vmap=gl_mod._vmap, name="grouped_linear")
    return lambda x, ws, bs=None, backend=None: f(x, ws, gl_mod._HostSplits(SPLITS), bs, Options(False, None, backend))


class CountingKernels(TorchKernels):
    def __init__(self):
        self.calls = 0

    def fprop(self, *args):
        self.calls += 1
        return super().fprop(*args)

    def grouped_fprop(self, *args):
        self.calls += 1
        return super().grouped_fprop(*args)


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
    torch.testing.assert_close(vmap(lambda x: f(x, ws, bs, k))(xb), torch.stack([ref_grouped(v, ws, SPLITS, bs) for v in xb]))
    assert k.calls == 1
    dxb = vmap(grad(lambda x: (f(x, ws, bs) * dy).sum()))(xb)
    torch.testing.assert_close(dxb, torch.stack([want[0]] * 2))


# a pair with two outputs, an intermediate residual and non-tensor residual leaves

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
    with pytest.raises(NotImplementedError, match=r"^custom_vjp\(op\) has no forward-mode rule: pass jvp=\.\.\.$"):
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
        return ((x.movedim(x_dim, 0).reshape(-1), w.repeat(batch_size)),
                lambda y: (y.view(batch_size, -1), 0)) if w_dim is None else None

    f = custom_vjp(fwd, lambda r, d: (d * r[1], d * r[0]), vmap=fold, name="fold")
    xb, w = torch.randn(3, 4), torch.randn(4)
    torch.testing.assert_close(vmap(lambda x: f(x, w))(xb), xb * w)  # plain vmap never asks for the plan
    with pytest.raises(NotImplementedError, match=r"^custom_vjp\(fold\): a vmap fold rule needs residuals that are inputs$"):
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
    with pytest.raises(TypeError, match=r"(?s)^custom_vjp\(short\): bwd must return one cotangent per argument of fwd.*argument 1 is a list of 2 tensors, its cotangent a list of 1"):
        bad(x, ws).sum().backward()


# --- forward mode and vmap, every combination of what is batched or has a tangent ---------

_SUBSETS = [(1, 0, 0), (0, 1, 0), (0, 0, 1), (1, 1, 0), (0, 1, 1), (1, 0, 1), (1, 1, 1), (0, 0, 0)]


@pytest.mark.parametrize("which", _SUBSETS, ids=lambda s: "t" + "".join("xwb"[i] for i in range(3) if s[i]) or "none")
def test_linear_jvp_for_every_subset_of_tangents(which):
    x = _rand(2, 3, K, seed=1)  # leading dims [2, 3]: the tangent keeps them
    w, b = _rand(N, K, seed=2), _rand(N, seed=3)
    tans = [_rand(*t.shape, seed=10 + i) if on else torch.zeros_like(t) for i, (t, on) in enumerate(zip((x, w, b), which))]
    primals = tuple(t for t, on in zip((x, w, b), which) if on)
    tangents = tuple(t for t, on in zip(tans, which) if on)

    def call(fn):
        def f(*ps):
            it = iter(ps)
            args = [next(it) if on else t for t, on in zip((x, w, b), which)]
            return fn(*args)
        return f

    if not primals:  # the rule with no tangent at all: zeros shaped like y
        res = fd.linear_fwd(x, w, b)[1]
        assert torch.equal(lin_mod._jvp(res, (None, None, None, None, None)), torch.zeros(2, 3, N, dtype=D))
        return
    y, t = jvp(call(fd.linear), primals, tangents)
    y_ref, t_ref = jvp(call(F.linear), primals, tangents)
    assert t.shape == (2, 3, N)
    torch.testing.assert_close((y, t), (y_ref, t_ref))


@pytest.mark.parametrize("which", _SUBSETS[:-1], ids=lambda s: "t" + "".join("xwb"[i] for i in range(3) if s[i]))
@pytest.mark.parametrize("stacked", [False, True], ids=["list", "stacked"])
def test_grouped_jvp_for_every_subset_of_tangents(which, stacked):
    x = _rand(T, K, seed=1)
    ws = [_rand(N, K, seed=2 + e) for e in range(E)]
    bs = [_rand(N, seed=8 + e) for e in range(E)]
    W, B = torch.stack(ws), torch.stack(bs)
    base = (x, W, B) if stacked else (x, ws, bs)
    tans = (_rand(T, K, seed=20), _rand(E, N, K, seed=21), _rand(E, N, seed=22))
    if not stacked:
        tans = (tans[0], list(tans[1].unbind(0)), list(tans[2].unbind(0)))
    idx = [i for i in range(3) if which[i]]

    def call(fn):
        def f(*ps):
            args = list(base)
            for i, p in zip(idx, ps):
                args[i] = p
            return fn(*args)
        return f

    ours = call(lambda x, w, b: fd.grouped_linear(x, w, SPLITS, b))
    ref = call(lambda x, w, b: ref_grouped(x, list(w), SPLITS, list(b)))
    y, t = jvp(ours, tuple(base[i] for i in idx), tuple(tans[i] for i in idx))
    torch.testing.assert_close((y, t), jvp(ref, tuple(base[i] for i in idx), tuple(tans[i] for i in idx)))


def test_grouped_jvp_with_a_none_tangent_in_a_list():
    x = _rand(T, K, seed=1)
    ws = [_rand(N, K, seed=2 + e) for e in range(E)]
    bs = [_rand(N, seed=8 + e) for e in range(E)]
    res = fd.grouped_linear_fwd(x, ws, list(SPLITS), bs)[1]
    tw = [None, _rand(N, K, seed=30), None]
    tb = [_rand(N, seed=31), None, None]
    got = gl_mod._jvp(res, (None, tw, None, tb))
    zeros_w = [torch.zeros(N, K, dtype=D) if t is None else t for t in tw]
    zeros_b = [torch.zeros(N, dtype=D) if t is None else t for t in tb]
    torch.testing.assert_close(got, ref_grouped(x, zeros_w, SPLITS, zeros_b))
    assert torch.equal(gl_mod._jvp(res, (None, [None] * E, None, None)), torch.zeros(T, N, dtype=D))


@pytest.mark.parametrize("which", _SUBSETS[:-1], ids=lambda s: "v" + "".join("xwb"[i] for i in range(3) if s[i]))
def test_linear_vmap_for_every_subset_of_batched_args(which):
    B = 3
    args = (_rand(5, K, seed=1), _rand(N, K, seed=2), _rand(N, seed=3))
    batched = [_rand(B, *a.shape, seed=10 + i) if on else a for i, (a, on) in enumerate(zip(args, which))]
    dims = tuple(0 if on else None for on in which)
    k = CountingKernels()
    y = vmap(lambda x, w, b: fd.linear(x, w, b, backend=k), in_dims=dims)(*batched)
    want = torch.stack([F.linear(*[a[i] if on else a for a, on in zip(batched, which)]) for i in range(B)])
    torch.testing.assert_close(y, want)
    assert k.calls == (1 if which == (1, 0, 0) else B)  # only a batch of x alone folds


@pytest.mark.parametrize("which", _SUBSETS[:-1], ids=lambda s: "v" + "".join("xwb"[i] for i in range(3) if s[i]))
def test_grouped_vmap_for_every_subset_of_batched_args(which):
    B = 2
    args = (_rand(T, K, seed=1), _rand(E, N, K, seed=2), _rand(E, N, seed=3))
    batched = [_rand(B, *a.shape, seed=10 + i) if on else a for i, (a, on) in enumerate(zip(args, which))]
    dims = tuple(0 if on else None for on in which)
    k = CountingKernels()
    y = vmap(lambda x, w, b: fd.grouped_linear(x, w, list(SPLITS), b, backend=k), in_dims=dims)(*batched)
    want = torch.stack([ref_grouped(*[a[i] if on else a for a, on in zip(batched, which)][:2], SPLITS,
                                    [a[i] if on else a for a, on in zip(batched, which)][2]) for i in range(B)])
    torch.testing.assert_close(y, want)
    assert k.calls == (1 if which == (1, 0, 0) else B)


# --- error messages, in full: they name the argument (and the position) and say what to do


class BentDW(FakeDW):
    """A FakeDW whose gathers and finalize a test can replace."""

    bend: dict = {}

    def materialize_group_for_forward(self):
        f = self.bend.get("forward")
        return f(self) if f else super().materialize_group_for_forward()

    def materialize_group_for_backward(self, **kwargs):
        f = self.bend.get("backward")
        return f(self) if f else super().materialize_group_for_backward()

    def finalize_group_grads(self, wgrads):
        f = self.bend.get("finalize")
        return f(self, wgrads) if f else super().finalize_group_grads(wgrads)


def _dw(**bend):
    w = BentDW(_rand(2 * N, K, seed=5))  # shard [N, K] of a full [2N, K]
    w.bend = bend
    return w


def _dw_group(fused=False, **bend):
    ws = BentDW.group_of([_rand(2 * N, K, seed=5 + e) for e in range(E)], fused=fused)
    ws[0].bend = bend
    return ws


def _bump(*ts):
    with torch.no_grad():
        for t in ts:
            t.add_(0)


def _lin(w, x=None, bias=None, bump=False, part="bwd", **kw):
    x = _rand(5, K, seed=7, grad=True) if x is None else x
    y, res = fd.linear_fwd(x, w, bias, **kw)
    if bump:
        _bump(w)
    fn = {"bwd": fd.linear_bwd, "dgrad": fd.linear_bwd_dgrad, "wgrad": fd.linear_bwd_wgrad}[part]
    return fn(res, torch.ones_like(y))


def _grp(ws, bias=None, bump=None, part="bwd", **kw):
    x = _rand(T, K, seed=7, grad=True)
    y, res = fd.grouped_linear_fwd(x, ws, list(SPLITS), bias, **kw)
    if bump is not None:
        _bump(*bump)
    fn = {"bwd": fd.grouped_linear_bwd, "dgrad": fd.grouped_linear_bwd_dgrad, "wgrad": fd.grouped_linear_bwd_wgrad}[part]
    return fn(res, torch.ones_like(y))


def _with(t, **attrs):
    for k, v in attrs.items():
        setattr(t, k, v)
    return t


def _ws(n=E, grad=True, **attrs):
    return [_with(_rand(N, K, seed=2 + e, grad=grad), **attrs) for e in range(n)]


def _f32(*shape, device="cpu", dtype=torch.float32):
    return torch.zeros(*(shape or (N, K)), dtype=dtype, device=device)


def _w(**attrs):
    return _with(_rand(N, K, seed=2, grad=True), **attrs)


def _mg_group(*mgs):
    return [_with(w, main_grad=m) for w, m in zip(_ws(), mgs)]


ERROR_CASES = {
    # linear: argument checks
    "linear-x-9d": (lambda: fd.linear(torch.zeros([1] * 8 + [K], dtype=D), _rand(N, K)), ValueError, 'x must be 1-D or 2-D or 3-D or 4-D or 5-D or 6-D or 7-D or 8-D, got shape (1, 1, 1, 1, 1, 1, 1, 1, 8)'),
    "linear-weight-3d": (lambda: fd.linear(_rand(5, K), _rand(1, N, K)), ValueError, 'weight must be 2-D, got shape (1, 4, 8)'),
    "linear-fuse-flag": (lambda: fd.linear_fwd(_rand(5, K), _rand(N, K), fuse_wgrad_accumulation=1), TypeError, 'fuse_wgrad_accumulation must be a bool, got int'),
    "linear-bias-2d": (lambda: fd.linear(_rand(5, K), _rand(N, K), _rand(1, N)), ValueError, 'bias must be 1-D, got shape (1, 4)'),
    "linear-x-features": (lambda: fd.linear(_rand(5, K + 1), _rand(N, K)), ValueError, 'x has 9 features but weight is [4, 8]: x must be [..., 8]'),
    "linear-x3d-features": (lambda: fd.linear(_rand(2, 5, K + 1), _rand(N, K)), ValueError, 'x has 9 features but weight is [4, 8]: x must be [..., 8]'),
    "linear-dw-x-features": (lambda: fd.linear(_rand(5, K + 1), _dw()), ValueError, 'x has 9 features but weight is [8, 8] (as materialize_group_for_forward() of the DistributedWeight returned it): x must be [..., 8]'),
    "linear-dw-3d": (lambda: fd.linear(_rand(5, K), _dw(forward=lambda s: s.full[None])), ValueError, 'weight (materialized) must be 2-D, got shape (1, 8, 8)'),
    "linear-dw-fwd-dtype": (lambda: fd.linear(_rand(5, K), _dw(forward=lambda s: s.full.float())), TypeError, "weight: materialize_group_for_forward() of the DistributedWeight returned a torch.float32 tensor on cpu for weight 0; the layer runs in torch.float64 on cpu (x's dtype and device): gather into that"),
    "linear-dw-bwd-dtype": (lambda: _lin(_dw(backward=lambda s: s.full.float())), TypeError, "weight: materialize_group_for_backward() of the DistributedWeight returned a torch.float32 tensor on cpu for weight 0; the layer runs in torch.float64 on cpu (x's dtype and device): gather into that"),
    "linear-dw-bwd-shape": (lambda: _lin(_dw(backward=lambda s: s.full[:1])), ValueError, 'weight: materialize_group_for_backward() returned (1, 8) for weight 0, expected (8, 8)'),
    "linear-dw-finalize-count": (lambda: _lin(_dw(finalize=lambda s, g: [g, g])), ValueError, 'weight: finalize_group_grads returned 2 grad(s) for 1 weights'),
    "linear-dw-finalize-shape": (lambda: _lin(_dw(finalize=lambda s, g: g)), ValueError, 'weight: finalize_group_grads returned (8, 8) on cpu for weight 0; each grad must be None or a tensor shaped like that parameter ((4, 8) on cpu)'),
    "linear-dw-finalize-type": (lambda: _lin(_dw(finalize=lambda s, g: [1.0])), ValueError, 'weight: finalize_group_grads returned a float for weight 0; each grad must be None or a tensor shaped like that parameter ((4, 8) on cpu)'),
    # the forward-mode rules themselves (through torch.func.jvp the subclass does not arrive: see
    # tests/support/mutation_equivalents.md)
    "linear-dw-jvp": (lambda: lin_mod._jvp(fd.linear_fwd(_rand(5, K), _dw())[1], (None, _rand(N, K), None)), ValueError, 'forward-mode (jvp) tangents for a DistributedWeight are not supported: take the tangent with respect to x or bias, or use a plain weight'),
    "linear-weight-bumped-dgrad": (lambda: _lin(_rand(N, K, grad=True), bump=True, part="dgrad"), RuntimeError, 'weight was modified in place between forward and backward (version 0 -> 1), e.g. by an optimizer step. Its gradient would be computed with the new values; run backward before updating the weights.'),
    "linear-weight-bumped-wgrad": (lambda: _lin(_rand(N, K, grad=True), bump=True, part="wgrad"), RuntimeError, 'weight was modified in place between forward and backward (version 0 -> 1), e.g. by an optimizer step. Its gradient would be computed with the new values; run backward before updating the weights.'),
    "linear-res-type": (lambda: fd.linear_bwd(("not", "res"), torch.ones(1)), TypeError, 'linear_bwd takes the LinearResiduals that linear_fwd returned, got tuple'),
    "linear-dgrad-res-type": (lambda: fd.linear_bwd_dgrad(None, torch.ones(1)), TypeError, 'linear_bwd_dgrad takes the LinearResiduals that linear_fwd returned, got NoneType'),
    "linear-wgrad-res-type": (lambda: fd.linear_bwd_wgrad(None, torch.ones(1)), TypeError, 'linear_bwd_wgrad takes the LinearResiduals that linear_fwd returned, got NoneType'),
    "linear-no-main-grad": (lambda: _lin(_w(), fuse_wgrad_accumulation=True), ValueError, 'weight: fuse_wgrad_accumulation=True needs a `main_grad` buffer on the weight (e.g. `w.main_grad = torch.zeros_like(w, dtype=torch.float32)`)'),
    "linear-main-grad-shape": (lambda: _lin(_w(main_grad=_f32(N, K + 1)), fuse_wgrad_accumulation=True), ValueError, 'weight: main_grad/grad_buffer() must be a (4, 8) tensor, got (4, 9)'),
    "linear-main-grad-type": (lambda: _lin(_w(main_grad=[0.0]), fuse_wgrad_accumulation=True), ValueError, 'weight: main_grad/grad_buffer() must be a (4, 8) tensor, got list'),
    "linear-main-grad-int": (lambda: _lin(_w(main_grad=_f32(dtype=torch.int32)), fuse_wgrad_accumulation=True), TypeError, 'weight: main_grad/grad_buffer() is torch.int32; it must be a float tensor (float32)'),
    "linear-main-grad-device": (lambda: _lin(_w(main_grad=_f32(device="meta")), fuse_wgrad_accumulation=True), ValueError, 'weight: main_grad is on meta but the weight is on cpu'),
    # grouped: the same checks, naming the expert
    "grouped-fuse-flag": (lambda: fd.grouped_linear_fwd(_rand(T, K), _ws(), list(SPLITS), fuse_wgrad_accumulation=0), TypeError, 'fuse_wgrad_accumulation must be a bool, got int'),
    "grouped-dw-x-features": (lambda: fd.grouped_linear(_rand(T, K + 1), _dw_group(), list(SPLITS)), ValueError, 'x has 9 features but the weights are [8, 8] (as materialize_group_for_forward() of the DistributedWeight returned them): x must be [T, 8]'),
    "grouped-dw-fwd-count": (lambda: fd.grouped_linear(_rand(T, K), _dw_group(forward=lambda s: [m.full for m in s.group][:2]), list(SPLITS)), ValueError, 'weights: materialize_group_for_forward() of the DistributedWeight returned 2 tensor(s) for a group of 3; it must return one per weight'),
    "grouped-dw-fwd-type": (lambda: fd.grouped_linear(_rand(T, K), _dw_group(forward=lambda s: [m.full for m in s.group][:2] + ["w"]), list(SPLITS)), TypeError, 'weights: materialize_group_for_forward() of the DistributedWeight returned a str for weight 2; it must return tensors'),
    "grouped-dw-bwd-shape": (lambda: _grp(_dw_group(backward=lambda s: [m.full[:1] for m in s.group])), ValueError, 'weights: materialize_group_for_backward() returned (1, 8) for weight 0, expected (8, 8)'),
    "grouped-dw-finalize-count": (lambda: _grp(_dw_group(finalize=lambda s, g: g[:1])), ValueError, 'weights: finalize_group_grads returned 1 grad(s) for 3 weights'),
    "grouped-dw-jvp": (lambda: gl_mod._jvp(fd.grouped_linear_fwd(_rand(T, K), _dw_group(), list(SPLITS))[1], (None, [_rand(N, K), None, None], None, None)), ValueError, 'forward-mode (jvp) tangents for a DistributedWeight are not supported: take the tangent with respect to x or bias, or use plain weights'),
    "grouped-weight-bumped-dgrad": (lambda: _grp(ws := _ws(), bump=ws[1:2], part="dgrad"), RuntimeError, 'weights[1] was modified in place between forward and backward (version 0 -> 1), e.g. by an optimizer step. Its gradient would be computed with the new values; run backward before updating the weights.'),
    "grouped-weight-bumped-wgrad": (lambda: _grp(ws := _ws(), bump=ws[2:], part="wgrad"), RuntimeError, 'weights[2] was modified in place between forward and backward (version 0 -> 1), e.g. by an optimizer step. Its gradient would be computed with the new values; run backward before updating the weights.'),
    "grouped-stacked-bumped": (lambda: _grp(W := _rand(E, N, K, grad=True), bump=[W], part="wgrad"), RuntimeError, 'weights was modified in place between forward and backward (version 0 -> 1), e.g. by an optimizer step. Its gradient would be computed with the new values; run backward before updating the weights.'),
    "grouped-res-type": (lambda: fd.grouped_linear_bwd(None, torch.ones(1)), TypeError, 'grouped_linear_bwd takes the GroupedLinearResiduals that grouped_linear_fwd returned, got NoneType'),
    "grouped-dgrad-res-type": (lambda: fd.grouped_linear_bwd_dgrad(None, torch.ones(1)), TypeError, 'grouped_linear_bwd_dgrad takes the GroupedLinearResiduals that grouped_linear_fwd returned, got NoneType'),
    "grouped-wgrad-res-type": (lambda: fd.grouped_linear_bwd_wgrad(None, torch.ones(1)), TypeError, 'grouped_linear_bwd_wgrad takes the GroupedLinearResiduals that grouped_linear_fwd returned, got NoneType'),
    "grouped-no-main-grad": (lambda: _grp(_ws(), fuse_wgrad_accumulation=True), ValueError, 'weights[0]: fuse_wgrad_accumulation=True needs a `main_grad` buffer on the weight (e.g. `w.main_grad = torch.zeros_like(w, dtype=torch.float32)`)'),
    "grouped-main-grad-shape": (lambda: _grp(_mg_group(_f32(), _f32(N, K + 1), _f32()), fuse_wgrad_accumulation=True), ValueError, 'weights[1]: main_grad/grad_buffer() must be a (4, 8) tensor, got (4, 9)'),
    "grouped-main-grad-type": (lambda: _grp(_mg_group(_f32(), _f32(), "buffer"), fuse_wgrad_accumulation=True), ValueError, 'weights[2]: main_grad/grad_buffer() must be a (4, 8) tensor, got str'),
    "grouped-main-grad-device": (lambda: _grp(_mg_group(_f32(), _f32(device="meta"), _f32()), fuse_wgrad_accumulation=True), ValueError, 'weights[1]: main_grad is on meta but the weight is on cpu'),
    "grouped-main-grad-dtypes": (lambda: _grp(_mg_group(_f32(), _f32(dtype=D), _f32()), fuse_wgrad_accumulation=True), TypeError, "weights[1]: main_grad is torch.float64 but another weight's is torch.float32: the weights of a group share one main_grad dtype (one wgrad GEMM writes them all)"),
    "grouped-splits-meta": (lambda: fd.grouped_linear(_rand(T, K), _ws(), torch.tensor(SPLITS, device="meta")), ValueError, 'splits is a tensor on the meta device, which holds no counts: give the splits as a list of ints (shape inference needs their values) or a tensor on a real device'),
    "grouped-splits-str": (lambda: fd.grouped_linear_fwd(_rand(T, K), _ws(), "235"), TypeError, 'splits must be a list/tuple of ints or a 1-D integer tensor, got str'),
    "grouped-bias-3d": (lambda: fd.grouped_linear(_rand(T, K), _ws(), list(SPLITS), _rand(E, N, 1)), ValueError, 'bias must be 2-D, got shape (3, 4, 1)'),
    "grouped-bias-item-2d": (lambda: fd.grouped_linear(_rand(T, K), _ws(), list(SPLITS), [_rand(N), _rand(1, N), _rand(N)]), ValueError, 'bias[1] must be 1-D, got shape (1, 4)'),
    "grouped-bias-item-dtype": (lambda: fd.grouped_linear(_rand(T, K), _ws(), list(SPLITS), [_rand(N), _rand(N), _rand(N, dtype=torch.float32)]), TypeError, 'bias[2] has dtype torch.float32 but x has torch.float64; cast one of them'),
    "grouped-bias-count": (lambda: fd.grouped_linear(_rand(T, K), _ws(), list(SPLITS), [_rand(N)] * 2), ValueError, 'bias must be None, a sequence of 3 [4] tensors or one [3, 4] tensor; got 2 items'),
    "grouped-bias-type": (lambda: fd.grouped_linear_fwd(_rand(T, K), _ws(), list(SPLITS), 5), ValueError, 'bias must be None, a sequence of 3 [4] tensors or one [3, 4] tensor; got int'),
    "grouped-stacked-dtype": (lambda: fd.grouped_linear(_rand(T, K), _rand(E, N, K, dtype=torch.float32), list(SPLITS)), TypeError, 'weights has dtype torch.float32 but x has torch.float64; cast one of them'),
    "grouped-weights-2d-tensor": (lambda: fd.grouped_linear(_rand(T, K), _rand(N, K), list(SPLITS)), ValueError, 'weights must be 3-D, got shape (4, 8)'),
    "grouped-weight-3d-in-list": (lambda: fd.grouped_linear(_rand(T, K), [_rand(N, K), _rand(1, N, K), _rand(N, K)], list(SPLITS)), ValueError, 'weights[1] must be 2-D, got shape (1, 4, 8)'),
    "grouped-weight-shape-in-list": (lambda: fd.grouped_linear(_rand(T, K), [_rand(N, K), _rand(N + 1, K), _rand(N, K)], list(SPLITS)), ValueError, "weights[1] is (5, 8); every expert's weight must be [4, 8] like weights[0]"),
    "grouped-weights-empty": (lambda: fd.grouped_linear_fwd(_rand(T, K), [], []), TypeError, 'weights must be a non-empty sequence of [out, in] tensors or one [E, out, in] tensor, got list (empty)'),
    "grouped-weights-int": (lambda: fd.grouped_linear_fwd(_rand(T, K), 5, list(SPLITS)), TypeError, 'weights must be a non-empty sequence of [out, in] tensors or one [E, out, in] tensor, got int'),
    "grouped-weights-str-item": (lambda: fd.grouped_linear_fwd(_rand(T, K), [_rand(N, K), "w", _rand(N, K)], list(SPLITS)), TypeError, 'weights[1] must be a torch.Tensor, got str'),
    "grouped-x-features": (lambda: fd.grouped_linear(_rand(T, K + 1), _ws(), list(SPLITS)), ValueError, 'x has 9 features but the weights are [4, 8]: x must be [T, 8]'),
    "dw-not-a-tensor": (lambda: fd.is_distributed_weight(type("NotATensor", (), {"is_distributed_weight": True})()), TypeError, 'weight: a DistributedWeight must be a torch.Tensor subclass, got NotATensor'),
    "grouped-dw-buffer-shape": (lambda: _grp(_with_buffer(_dw_group(fused=True), 1, _f32(N, K)), fuse_wgrad_accumulation=True), ValueError, 'weights[1]: main_grad/grad_buffer() must be a (8, 8) tensor, got (4, 8)'),
}


def _with_buffer(ws, e, buf):
    ws[e].buffer = buf
    return ws


@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_error_message_in_full(case):
    run, exc, message = ERROR_CASES[case]
    with pytest.raises(exc) as info:
        run()
    assert str(info.value) == message


# --- fused wgrad accumulation: frozen weights, FSDP buffers, dtypes -----------------------


@pytest.mark.parametrize("stacked", [False, True], ids=["list", "stacked"])
def test_fused_all_frozen_group_without_bias_gives_no_grads(stacked):
    ws = _rand(E, N, K, seed=2) if stacked else [_rand(N, K, seed=2 + e) for e in range(E)]
    y, res = fd.grouped_linear_fwd(_rand(T, K, seed=1), ws, list(SPLITS), fuse_wgrad_accumulation=True)
    assert fd.grouped_linear_bwd_wgrad(res, _rand(T, N, seed=9)) == ((None if stacked else [None] * E), None)


@pytest.mark.parametrize("stacked", [False, True], ids=["list", "stacked"])
def test_fused_all_frozen_group_still_gives_bias_grads(stacked):
    x = _rand(T, K, seed=1)
    ws = _rand(E, N, K, seed=2) if stacked else [_rand(N, K, seed=2 + e) for e in range(E)]
    bs = _rand(E, N, seed=8, grad=True) if stacked else [_rand(N, seed=8 + e, grad=True) for e in range(E)]
    dy = _rand(T, N, seed=9)
    y, res = fd.grouped_linear_fwd(x, ws, list(SPLITS), bs, fuse_wgrad_accumulation=True)
    dws, dbs = fd.grouped_linear_bwd_wgrad(res, dy)
    want = torch.stack([d.sum(0) for d in dy.split(list(SPLITS))])
    if stacked:
        assert dws is None
        torch.testing.assert_close(dbs, want)
    else:
        assert dws == [None] * E
        torch.testing.assert_close(torch.stack(dbs), want)


def test_fused_frozen_first_weight_keeps_the_groups_float64_main_grad():
    """The frozen weight's scratch output takes the group's main_grad dtype, so float64
    main_grads accumulate in float64 whichever weight is frozen."""
    x, dy = _rand(T, K, seed=1), _rand(T, N, seed=9)
    ws = [_rand(N, K, seed=2 + e, grad=e > 0) for e in range(E)]
    for w in ws[1:]:
        w.main_grad = torch.zeros(N, K, dtype=D)
    y, res = fd.grouped_linear_fwd(x, ws, list(SPLITS), fuse_wgrad_accumulation=True)
    fd.grouped_linear_bwd_wgrad(res, dy)
    xs, dys = x.split(list(SPLITS)), dy.split(list(SPLITS))
    for e in (1, 2):
        torch.testing.assert_close(ws[e].main_grad, dys[e].t() @ xs[e], rtol=1e-13, atol=1e-13)
    assert not hasattr(ws[0], "main_grad")


def test_grad_targets_for_frozen_weights_are_float32_scratch():
    ws = [_rand(N, K, seed=e) for e in range(2)]
    out = dwp.grad_targets(ws, False, [(N, K), (N, K + 1)], "weights")
    assert [(tuple(o.shape), o.dtype) for o in out] == [((N, K), torch.float32), ((N, K + 1), torch.float32)]


class _FsdpParam(torch.nn.Parameter):
    """Megatron FSDP's parameter: its main grad comes from get_main_grad()."""

    __fsdp_param__ = True

    def get_main_grad(self):
        return self.fsdp_buffer


@pytest.mark.parametrize("fsdp", [True, False], ids=["fsdp-param", "get_main_grad-only"])
def test_fused_wgrad_writes_into_the_fsdp_main_grad(fsdp):
    x, dy = _rand(5, K, seed=1), _rand(5, N, seed=9)
    w = _FsdpParam(_rand(N, K, seed=2)) if fsdp else _rand(N, K, seed=2, grad=True)
    w.fsdp_buffer = torch.zeros(N, K, dtype=D)
    if not fsdp:
        w.get_main_grad = lambda: w.fsdp_buffer  # without __fsdp_param__ the method is not used
        w.main_grad = torch.zeros(N, K, dtype=D)
    y, res = fd.linear_fwd(x, w, fuse_wgrad_accumulation=True)
    fd.linear_bwd_wgrad(res, dy)
    target, other = (w.fsdp_buffer, getattr(w, "main_grad", None)) if fsdp else (w.main_grad, w.fsdp_buffer)
    torch.testing.assert_close(target, dy.t() @ x)
    assert other is None or not other.any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_bias_grads_keep_the_layer_dtype_and_fp32_accuracy(dtype):
    g = _g(3)
    x = torch.randn(64, K, generator=g).to(dtype)
    dy = (torch.randn(64, N, generator=g) * 100).to(dtype)
    w, b = torch.randn(N, K, generator=g).to(dtype), torch.zeros(N, dtype=dtype)
    want = dy.double().sum(0)
    y, res = fd.linear_fwd(x, w, b)
    _, db = fd.linear_bwd_wgrad(res, dy)
    assert db.dtype == dtype
    torch.testing.assert_close(db.double(), want.to(dtype).double(), rtol=0, atol=0)
    splits = [30, 34]
    y, res = fd.grouped_linear_fwd(x, [w, w], splits, torch.zeros(2, N, dtype=dtype))
    _, db = fd.grouped_linear_bwd_wgrad(res, dy)
    assert db.dtype == dtype
    want = torch.stack([d.double().sum(0) for d in dy.split(splits)]).to(dtype)
    torch.testing.assert_close(db.double(), want.double(), rtol=0, atol=0)


# --- which kernel runs: grouped_mm on the grouped path, per expert otherwise ---------------


@pytest.mark.parametrize("path", [True, False], ids=["grouped", "split"])
def test_path_decides_whether_grouped_mm_runs(path):
    calls = []
    real = ref_mod._torch_grouped_mm

    def spy(a, b, offs):
        calls.append(a.shape)
        return real(a, b, offs=offs)

    x, dy = _rand(T, 16, seed=1, dtype=torch.float32), _rand(T, 16, seed=2, dtype=torch.float32)
    ws = [_rand(16, 16, seed=3 + e, dtype=torch.float32, grad=True) for e in range(E)]
    with mock.patch.object(ref_mod, "_torch_grouped_mm", spy):
        y, res = fd.grouped_linear_fwd(x, ws, list(SPLITS), use_grouped_tensor=path)
        dx, dws, _ = fd.grouped_linear_bwd(res, dy)
    assert res.path == ("grouped" if path else "split")
    assert len(calls) == (3 if path else 0)  # fprop, dgrad, wgrad
    torch.testing.assert_close(y, ref_grouped(x, ws, SPLITS), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx, torch.cat([d @ w for d, w in zip(dy.split(list(SPLITS)), ws)]), rtol=1e-5, atol=1e-5)


# --- grouped_mm operands: kept as they are where grouped_mm takes them, else one dense copy -

_F32, _BF16 = torch.float32, torch.bfloat16  # a = 16 bytes / element size: 4 and 8 elements

_LAYOUTS = [  # (device, dtype, size, stride, storage offset, kept)
    ("cpu", _F32, (4, 8), (8, 1), 0, True),  # row-major
    ("cpu", _F32, (3, 4, 8), (32, 8, 1), 0, True),
    ("cpu", _F32, (4, 8), (12, 1), 0, True),  # rows of a wider buffer, 48-byte stride
    ("cpu", _F32, (4, 8), (10, 1), 0, False),  # 40-byte rows
    ("cpu", _F32, (4, 8), (1, 4), 0, True),  # column-major, 16-byte columns
    ("cpu", _F32, (4, 8), (1, 6), 0, False),  # column-major, 24-byte columns
    ("cpu", _F32, (4, 8), (1, 2), 0, False),  # columns overlap
    ("cpu", _F32, (4, 2), (1, 4), 0, True),
    ("cpu", _F32, (1, 8), (3, 1), 0, False),  # one row, an odd stride is_contiguous() ignores
    ("cpu", _F32, (1, 8), (8, 1), 0, True),
    ("cpu", _F32, (1, 8), (12, 1), 0, True),
    ("cpu", _F32, (8, 1), (4, 1), 0, True),  # one column, row stride 16 bytes
    ("cpu", _F32, (4, 1), (1, 4), 0, True),
    ("cpu", _F32, (8, 1), (1, 1), 0, True),  # contiguous: the CPU kernel takes it as it is
    ("cuda", _BF16, (8, 1), (1, 1), 0, True),  # contiguous with an aligned start
    ("cuda", _BF16, (8, 1), (1, 1), 2, False),  # contiguous, 4-byte aligned start
    ("cpu", _F32, (4, 8), (8, 1), 2, True),  # an offset is fine on the CPU
    ("cuda", _BF16, (4, 8), (8, 1), 0, True),
    ("cuda", _BF16, (4, 8), (8, 1), 8, True),
    ("cuda", _BF16, (4, 8), (8, 1), 4, False),  # 8-byte aligned start
    ("cuda", _BF16, (4, 8), (16, 1), 4, False),
    ("cuda", _BF16, (4, 8), (16, 1), 8, True),
    ("cuda", _BF16, (4, 8), (1, 8), 0, True),
    ("cuda", _BF16, (4, 8), (1, 4), 0, False),
    ("cuda", _BF16, (3, 4, 8), (32, 8, 1), 0, True),
    ("cuda", _BF16, (3, 4, 8), (40, 8, 1), 0, True),  # batch stride 80 bytes
    ("cuda", _BF16, (3, 4, 8), (36, 8, 1), 0, False),  # batch stride 72 bytes
    ("cuda", _BF16, (3, 4, 8), (36, 8, 1), 8, False),
    ("cuda", _BF16, (1, 8), (8, 1), 0, True),
    ("cuda", _BF16, (1, 8), (8, 1), 4, False),
    ("cuda", _BF16, (1, 8), (3, 1), 0, False),
]


@pytest.mark.parametrize("case", _LAYOUTS, ids=lambda c: f"{c[0]}-{c[2]}-{c[3]}-off{c[4]}-{'kept' if c[5] else 'copied'}")
def test_grouped_mm_operands_copied_only_when_they_must(case):
    from torch._subclasses.fake_tensor import FakeTensorMode

    device, dtype, size, stride, offset, kept = case
    with FakeTensorMode() if device == "cuda" else torch.device("cpu"):  # CUDA: fake tensors
        base = torch.arange(200, dtype=torch.float32).to(dtype) if device == "cpu" else torch.empty(200, dtype=dtype, device="cuda")
        t = base.as_strided(size, stride, offset)
        out = ref_mod._mm_ready(t)
        assert (out is t) == kept
        if not kept:
            assert out.is_contiguous() and out.stride() == torch.empty(size).stride()
            if device == "cpu":
                assert torch.equal(out, t)


def test_torch_kernels_name_themselves():
    assert repr(TorchKernels()) == "TorchKernels()" and TorchKernels.name == "torch"


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
    for run in (lambda: f(x.clone().requires_grad_())[0].sum().backward(),
                lambda: grad(lambda x: f(x)[0].sum())(x)):
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
        assert cv._needs_grad((torch.ones(1, requires_grad=True), 3, "s"))
        assert not cv._needs_grad((torch.ones(1), 3, None))


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_linear_fused_frozen_weight_gives_only_the_bias_grad(bias):
    x, dy = _rand(5, K, seed=1), _rand(5, N, seed=9)
    b = _rand(N, seed=3, grad=True) if bias else None
    y, res = fd.linear_fwd(x, _rand(N, K, seed=2), b, fuse_wgrad_accumulation=True)
    dw, db = fd.linear_bwd_wgrad(res, dy)
    assert dw is None
    if bias:
        torch.testing.assert_close(db, dy.sum(0))
    else:
        assert db is None


@pytest.mark.parametrize("layer", ["linear", "grouped"])
def test_fused_distributed_weight_buffer_is_overwritten_not_accumulated(layer):
    """A DW's finalize does the accumulating (TE's rule): the wgrad GEMM overwrites whatever
    the gathered grad buffer held."""
    n = 1 if layer == "linear" else E
    ws = BentDW.group_of([_rand(2 * N, K, seed=5 + e) for e in range(n)], fused=True)
    for m in ws:
        m.buffer.fill_(1e3)  # stale data from an earlier step
    T_ = 5 if layer == "linear" else T
    x, dy = _rand(T_, K, seed=1), _rand(T_, 2 * N, seed=9)  # the full weights are [2N, K]
    if layer == "linear":
        y, res = fd.linear_fwd(x, ws[0], fuse_wgrad_accumulation=True)
        fd.linear_bwd_wgrad(res, dy)
        want = [(dy.t() @ x)[:N]]
    else:
        y, res = fd.grouped_linear_fwd(x, ws, list(SPLITS), fuse_wgrad_accumulation=True)
        fd.grouped_linear_bwd_wgrad(res, dy)
        want = [(d.t() @ xe)[:N] for d, xe in zip(dy.split(list(SPLITS)), x.split(list(SPLITS)))]
    for m, wnt in zip(ws, want):
        torch.testing.assert_close(m.main_grad, wnt.float())


def test_linear_jvp_in_x_uses_the_forward_gather():
    full = _rand(N, K, seed=2)
    w = FakeDW(full)  # gathers 2 * full for forward, 4 * full for backward
    x, tx = _rand(5, K, seed=1), _rand(5, K, seed=3)
    y, t = jvp(lambda x: fd.linear(x, w), (x,), (tx,))
    torch.testing.assert_close((y, t), (x @ (2 * full).t(), tx @ (2 * full).t()))


def test_finalize_gets_a_bare_tensor_for_one_weight_and_may_return_none():
    got = []
    w = _dw(finalize=lambda s, g: got.append(g))  # returns None: no grad for the parameter
    dx, dw, db = _lin(w)
    assert dw is None and isinstance(got[0], torch.Tensor) and got[0].shape == (2 * N, K)  # TE: bare for one
    ws = _dw_group(finalize=lambda s, g: got.append(g))
    _, dws, _ = _grp(ws)
    assert dws == [None] * E and isinstance(got[1], list) and len(got[1]) == E


def test_splits_in_a_traced_graph_are_a_tensor_never_host_ints():
    x = _rand(T, K)
    with mock.patch("torch.compiler.is_compiling", return_value=True):
        s = gl_mod._as_splits([2, 0, 3], E, x)
    assert s.host is None and s.device == x.device and (s.num_tokens, s.num_experts) == (T, E)
    assert s.tensor.dtype == torch.int64 and s.tensor.tolist() == [2, 0, 3]
    t = torch.tensor([2, 0, 3], dtype=torch.int32)
    with mock.patch("torch.compiler.is_compiling", return_value=True):
        s = gl_mod._as_splits(t, E, x)
    assert s.host is None and s.tensor is not t and torch.equal(s.tensor, t)  # a copy: the buffer may be reused


def test_grouped_path_fallback_warning_says_why(monkeypatch):
    monkeypatch.setattr(ref_mod, "_PATH_VERDICTS", {})  # a verdict cached by an earlier test would hide the message
    x, ws = _rand(T, 0, dtype=torch.float32), [_rand(N, 0, dtype=torch.float32) for _ in range(E)]
    with pytest.warns(UserWarning, match=r"^grouped_linear: use_grouped_tensor=True but grouped_mm takes no zero-size "
                                         r"features; running the split path$"):
        y = fd.grouped_linear(x, ws, list(SPLITS), use_grouped_tensor=True)
    assert torch.equal(y, torch.zeros(T, N))


def test_float32_grouped_path_under_jvp_and_vmap():
    """grouped_mm has no forward-AD formula and no functorch batching rule: under jvp, vmap or
    a transform's wrappers the reference backend must run the split path (the results match)."""
    F32 = torch.float32
    x, dy = _rand(T, 16, seed=1, dtype=F32), _rand(T, 16, seed=2, dtype=F32)
    ws = [_rand(16, 16, seed=3 + e, dtype=F32) for e in range(E)]
    tx, tws = _rand(T, 16, seed=10, dtype=F32), [_rand(16, 16, seed=11 + e, dtype=F32) for e in range(E)]
    tol = dict(rtol=1e-5, atol=1e-5)
    f = lambda x, ws: fd.grouped_linear(x, ws, list(SPLITS), use_grouped_tensor=True)  # noqa: E731
    ref = lambda x, ws: ref_grouped(x, ws, SPLITS)  # noqa: E731
    torch.testing.assert_close(jvp(f, (x, ws), (tx, tws)), jvp(ref, (x, ws), (tx, tws)), **tol)
    xb = torch.stack([x, 2 * x])
    torch.testing.assert_close(vmap(lambda ws: f(x, ws))([torch.stack([w, -w]) for w in ws]),
                               torch.stack([ref(x, ws), ref(x, [-w for w in ws])]), **tol)
    g = grad(lambda x, ws: (f(x, ws) * dy).sum(), argnums=(0, 1))(x, ws)
    leaves = [t.clone().requires_grad_() for t in (x, *ws)]
    want = torch.autograd.grad(ref(leaves[0], leaves[1:]), leaves, dy)
    torch.testing.assert_close([g[0], *g[1]], list(want), **tol)
    dxb = vmap(grad(lambda x: (f(x, ws) * dy).sum()))(xb)
    torch.testing.assert_close(dxb, torch.stack([want[0]] * 2), **tol)


def test_split_wgrad_overwrites_out_unless_asked_to_accumulate():
    x, dy = _rand(T, 16, seed=1, dtype=torch.float32), _rand(T, 8, seed=2, dtype=torch.float32)
    splits = fd.kernels.Splits(host=tuple(SPLITS), tensor=None, device=x.device, num_tokens=T, num_experts=E)
    want = torch.stack([d.t() @ a for a, d in zip(x.split(list(SPLITS)), dy.split(list(SPLITS)))])
    out = torch.full((E, 8, 16), 7.0)
    assert TorchKernels().split_wgrad(x, dy, splits, out=out) is out
    assert torch.equal(out, want)
    TorchKernels().split_wgrad(x, dy, splits, out=out, accumulate=True)
    assert torch.equal(out, want + want)
    dy = dy.requires_grad_()  # create_graph: dy's products are recorded (no out= product), even with x plain
    dw = TorchKernels().split_wgrad(x, dy, splits)
    assert torch.equal(dw, want) and dw.requires_grad
    torch.testing.assert_close(torch.autograd.grad(dw.sum(), dy)[0], x.sum(1, keepdim=True).expand(T, 8))
