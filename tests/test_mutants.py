"""Tests written to kill mutants that survived `bash .ci/mutation` (mutmut over six modules).

Each asserts behaviour (numbers, errors, what a hook or a kernel saw). mutmut forks each
mutant's run from a process that imported functional_dw unmutated, so whatever runs at import
(``custom_vjp(...)`` building the layers' bridges, ``@residuals`` and ``saved()`` declaring
their records) keeps its original code there. The tests below therefore build their bridges
and records inside the test, where a mutant of ``custom_vjp``/``residuals``/``saved`` is live.
The equivalent mutants that no test can kill are listed in tests/mutation_equivalents.md.
"""

from __future__ import annotations

import dataclasses
import importlib
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch.func import grad, jvp, vjp, vmap

import functional_dw as fd
from conftest import HOOKS, ref_grouped
from functional_dw import custom_vjp, residuals, saved, saved_activations
from functional_dw.kernels.torch_ref import TorchKernels

gl_mod = importlib.import_module("functional_dw.grouped_linear")  # the modules (the package's names are the functions)
lin_mod = importlib.import_module("functional_dw.linear")

D = torch.float64
SPLITS = (2, 0, 3)
E, K, N, T = 3, 8, 4, sum(SPLITS)


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _rand(*shape, seed=0, grad=False, dtype=D):
    return torch.randn(*shape, generator=_g(seed), dtype=dtype).requires_grad_(grad)


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
        dataclasses.replace(r, ws=[torch.nn.Parameter(w) for w in ws]))


# --- the bridge, built inside the tests ---------------------------------------------------


def _fresh_linear():
    """The Linear bridge exactly as linear.py builds it at import."""
    return custom_vjp(lin_mod._fwd, lin_mod._bwd, primal=lin_mod._primal, jvp=lin_mod._jvp, vmap=lin_mod._vmap,
                      name="linear")


def _fresh_grouped():
    f = custom_vjp(gl_mod._fwd, gl_mod._bwd, primal=gl_mod._primal, jvp=gl_mod._jvp, vmap=gl_mod._vmap,
                   name="grouped_linear")
    return lambda x, ws, bs=None, backend=None: f(x, ws, gl_mod._HostSplits(SPLITS), bs, False, None, backend)


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
        with pytest.raises(TypeError, match=rf"^custom_vjp\(mine\): fwd must return a pair \(out, residuals\), "
                                            rf"e\.g\. `return y, \(x,\)`; got {got}$".replace("(2,)", r"\(2,\)")):
            f(x)
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
    with pytest.raises(TypeError, match=r"(?s)expected TreeSpec\(list, None, \[\*,.*\*\]\), got TreeSpec\(list, None, \[\*\]\)"):
        bad(x, ws).sum().backward()
