"""torch.func over both layers on the reference backend: grad, vjp, jacrev, vmap, jvp; second
order (double backward, the Hessian) against float64; the forward-mode and vmap rules for every
combination of what has a tangent or is batched."""

from __future__ import annotations

import functools
import importlib

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, jacrev, jvp, vjp, vmap

import functional_dw as fd
from conftest import HOOKS, CountingKernels, FakeDW, PathRecorder, assert_close
from helpers import grouped_inputs, randn, ref_grouped

gl_mod = importlib.import_module("functional_dw.grouped_linear")  # the modules (the package's names are the functions)
lin_mod = importlib.import_module("functional_dw.linear")

D = torch.float64
SPLITS = (2, 0, 4)
E, K, N, T = 3, 8, 4, sum(SPLITS)


def _data(seed=0):
    return grouped_inputs(SPLITS, K, N, seed=seed, dtype=D, draw_dtype=None, dy=False)[:3]


def _loss(x, ws, bs):
    return fd.grouped_linear(x, ws, SPLITS, bs).sin().sum()


def _autograd(x, ws, bs):
    leaves = [t.clone().requires_grad_() for t in (x, *ws, *bs)]
    return torch.autograd.grad(_loss(leaves[0], leaves[1:4], leaves[4:]), leaves)


def test_grad_vjp_jacrev_match_autograd():
    x, ws, bs = _data()
    want = _autograd(x, ws, bs)
    dx, dws, dbs = grad(_loss, argnums=(0, 1, 2))(x, ws, bs)
    torch.testing.assert_close([dx, *dws, *dbs], list(want))
    y, pullback = vjp(lambda x, ws, bs: fd.grouped_linear(x, ws, SPLITS, bs).sin(), x, ws, bs)
    got = pullback(torch.ones_like(y))
    torch.testing.assert_close([got[0], *got[1], *got[2]], list(want))
    J = jacrev(lambda w: fd.linear(x, w, bs[0]))(ws[0])
    J_ref = jacrev(lambda w: torch.nn.functional.linear(x, w, bs[0]))(ws[0])
    torch.testing.assert_close(J, J_ref)


@pytest.mark.parametrize("in_dim", [0, 1])
def test_vmap_over_x_folds_into_one_gemm_call(in_dim):
    x, ws, bs = _data()
    xb = torch.randn(5, T, K, dtype=D).movedim(0, in_dim)
    k = CountingKernels()
    y = vmap(lambda x: fd.grouped_linear(x, ws, SPLITS, bs, backend=k), in_dims=in_dim)(xb)
    assert k.calls == 1, "the batch is folded into the token dimension"
    loop = torch.stack([ref_grouped(xe, ws, SPLITS, bs) for xe in xb.movedim(in_dim, 0)])
    torch.testing.assert_close(y, loop)
    k.calls = 0
    y = vmap(lambda x: fd.linear(x, ws[0], bs[0], backend=k), in_dims=in_dim)(xb)
    assert k.calls == 1
    torch.testing.assert_close(y, torch.nn.functional.linear(xb.movedim(in_dim, 0), ws[0], bs[0]))


def test_vmap_over_weights_ensemble_loops():
    x, ws, bs = _data()
    W = torch.stack([torch.stack(ws) + i for i in range(3)])  # 3 ensembles of [E, N, K]
    y = vmap(lambda w: fd.grouped_linear(x, w, SPLITS))(W)
    torch.testing.assert_close(y, torch.stack([ref_grouped(x, list(w), SPLITS) for w in W]))


def test_per_example_gradients_vmap_of_grad():
    x, ws, bs = _data()
    xb = torch.randn(4, T, K, dtype=D)
    f = lambda w0, xe: fd.grouped_linear(xe, [w0, *ws[1:]], SPLITS).pow(2).sum()
    per_example = vmap(grad(f), in_dims=(None, 0))(ws[0], xb)
    loop = torch.stack([grad(f)(ws[0], xe) for xe in xb])
    torch.testing.assert_close(per_example, loop)


@pytest.mark.parametrize("layer", ["linear", "grouped"])
def test_jvp_matches_finite_differences(layer):
    x, ws, bs = _data()
    tx, tws, tbs = _data(seed=7)
    if layer == "linear":
        f = lambda x, w, b: fd.linear(x, w, b)
        primals, tangents = (x, ws[0], bs[0]), (tx, tws[0], tbs[0])
    else:
        f = lambda x, w, b: fd.grouped_linear(x, w, SPLITS, b)
        primals, tangents = (x, ws, bs), (tx, tws, tbs)
    _, t_out = jvp(f, primals, tangents)
    eps = 1e-6
    shift = lambda s: torch.utils._pytree.tree_map(lambda p, t: p + s * t, primals, tangents)
    fd_ = (f(*shift(eps)) - f(*shift(-eps))) / (2 * eps)
    torch.testing.assert_close(t_out, fd_, rtol=1e-6, atol=1e-6)


def test_distributed_weight_under_grad_and_functional_call():
    x, ws, bs = _data()
    group = FakeDW.group_of(ws)
    eager_leaves = [x.clone().requires_grad_()]
    fd.grouped_linear(eager_leaves[0], group, SPLITS).sum().backward()
    eager = [w.grad.clone() for w in group]
    calls = dict(group[0].calls)
    dws = grad(lambda ws: fd.grouped_linear(x, ws, SPLITS).sum())(list(group))
    assert group[0].calls == {k: 2 * v for k, v in calls.items()}, "hooks fire under torch.func.grad"
    torch.testing.assert_close(list(dws), eager)

    module = fd.nn.GroupedLinear(E, K, N, bias=False, params_dtype=D)
    params = {f"weight{e}": w for e, w in enumerate(FakeDW.group_of(ws))}
    got = grad(lambda p: functional_call(module, p, (x, list(SPLITS))).sum())(params)
    torch.testing.assert_close([got[f"weight{e}"] for e in range(E)], eager)
    assert params["weight0"].calls["finalize"] == 1


def test_torch_func_grad_refuses_saved_tensor_hooks():
    x, ws, bs = _data()
    with HOOKS["identity"]():
        with pytest.raises(RuntimeError, match="saved tensor hooks"):
            grad(_loss)(x, ws, bs)


def test_vmap_and_jvp_under_hooks_pack_activations_only():
    x, ws, bs = _data()
    params = [w.clone().requires_grad_() for w in ws]
    rec = HOOKS["identity"]()
    with rec:
        y = vmap(lambda xe: fd.grouped_linear(xe, params, SPLITS))(torch.randn(2, T, K, dtype=D))
    y.sum().backward()
    assert rec.packed and all(all(t is not p for p in params) for t in rec.packed)
    assert all(p.grad is not None for p in params)


def test_jvp_in_x_with_a_distributed_weight_materializes_it():
    """jvp hides the subclass behind a wrapper; the weight must still be gathered (x2 fake)."""
    x, ws, bs = _data()
    group = FakeDW.group_of(ws)
    y, t = jvp(lambda x: fd.grouped_linear(x, group, SPLITS), (x,), (x,))
    want = ref_grouped(x, [2 * w for w in ws], SPLITS)
    torch.testing.assert_close(y, want)
    torch.testing.assert_close(t, want)  # linear in x: the tangent along x is f(x)
    w = FakeDW(ws[0])
    y, t = jvp(lambda x: fd.linear(x, w), (x,), (x,))
    assert y.shape == (T, N)


def test_grad_fn_is_named_after_the_pair():
    y = fd.linear(torch.randn(2, K, requires_grad=True), torch.randn(N, K))
    assert type(y.grad_fn).__name__ == "CustomVJP_linearBackward"


def test_second_order_on_the_reference_backend():
    """grad of grad (create_graph=True) matches plain torch: bwd is made of differentiable ops."""
    x, ws, _ = _data()
    f = lambda x: fd.grouped_linear(x, ws, SPLITS).pow(2).sum()
    g = lambda x: ref_grouped(x, ws, SPLITS).pow(2).sum()
    hvp = grad(lambda x: grad(f)(x).sin().sum())(x)
    torch.testing.assert_close(hvp, grad(lambda x: grad(g)(x).sin().sum())(x))
    xl = x.clone().requires_grad_()
    (gx,) = torch.autograd.grad(f(xl), xl, create_graph=True)
    (h,) = torch.autograd.grad(gx.sin().sum(), xl)
    torch.testing.assert_close(h, hvp)


def test_vmap_over_splits_runs_one_call_per_routing():
    x, ws, bs = _data()
    routings = torch.tensor([[2, 0, 4], [1, 1, 4], [6, 0, 0]])
    y = vmap(lambda s: fd.grouped_linear(x, ws, s, bs))(routings)
    torch.testing.assert_close(y, torch.stack([ref_grouped(x, ws, s.tolist(), bs) for s in routings]))


def test_jvp_under_hooks_packs_activations_only():
    x, ws, bs = _data()
    params = [w.clone().requires_grad_() for w in ws]
    rec = HOOKS["identity"]()
    with rec:
        _, t = jvp(lambda x: fd.grouped_linear(x, params, SPLITS), (x,), (torch.ones_like(x),))
    assert all(all(p is not w for w in params) for p in rec.packed)
    torch.testing.assert_close(t, ref_grouped(torch.ones_like(x), ws, SPLITS))


class _FpropLog(PathRecorder):
    """PathRecorder that also logs the bias operand each grouped_fprop gets (Kernels: a tensor or None)."""

    def __init__(self):
        super().__init__()
        self.biases = []

    def grouped_fprop(self, x_TK, w_ENK, b_EN, splits, grouped):
        self.biases.append(None if b_EN is None else (type(b_EN), tuple(b_EN.shape)))
        return super().grouped_fprop(x_TK, w_ENK, b_EN, splits, grouped)


@pytest.mark.parametrize("use", [None, False], ids=["grouped-asked", "split"])
@pytest.mark.parametrize("stacked", [False, True], ids=["list", "stacked"])
def test_grouped_jvp_runs_the_split_path_with_an_E_by_N_bias_tangent(use, stacked):
    """Under forward mode every product (forward, then jvp's dx W^T + db and x dW^T) runs on the
    split path, whatever the plan says (grouped_mm has no forward-mode formula: NOTE:
    [Transforms without a rule]), and the kernels are told so; the bias tangent comes as one
    [E, N] tensor (a list of tangents stacked)."""
    x, ws, bs, tx, tws, tbs = [torch.utils._pytree.tree_map(lambda t: t.float(), d) for d in (*_data(), *_data(seed=7))]
    if stacked:
        ws, tws, bs, tbs = torch.stack(ws), torch.stack(tws), torch.stack(bs), torch.stack(tbs)
    rec = _FpropLog()
    f = lambda x, w, b: fd.grouped_linear(x, w, SPLITS, b, use_grouped_tensor=use, backend=rec)
    _, t = jvp(f, (x, ws, bs), (tx, tws, tbs))
    assert [name for name, _ in rec.paths] == ["fprop"] * 3  # forward, then jvp's two
    rec.check(False, x, ws)
    assert rec.biases == [(torch.Tensor, (E, N))] * 2 + [None]
    want = ref_grouped(tx, list(ws), SPLITS, list(tbs)) + ref_grouped(x, list(tws), SPLITS)
    torch.testing.assert_close(t, want)


def test_pure_pairs_under_torch_func_take_wrapped_plain_weights():
    """A direct ``*_fwd`` call under torch.func gets the weights as functorch wrappers: they
    are looked under (the DistributedWeight check) and used as plain weights."""
    x, ws, bs = _data()
    wb = torch.stack([torch.stack(ws), 2 * torch.stack(ws)])  # a batch of two weight groups

    def grouped(w):
        return fd.grouped_linear_fwd(x, list(w), SPLITS, bs)[0]

    torch.testing.assert_close(vmap(grouped)(wb), torch.stack([ref_grouped(x, list(w), SPLITS, bs) for w in wb]))
    torch.testing.assert_close(
        vmap(lambda w: fd.linear_fwd(x, w)[0])(wb[:, 0]), torch.stack([x @ w.t() for w in wb[:, 0]])
    )
    _, t = jvp(lambda w: fd.linear_fwd(x, w)[0], (ws[0],), (ws[1],))
    torch.testing.assert_close(t, x @ ws[1].t())


def test_weight_changed_in_place_under_grad_is_named_without_a_shared_buffer_note():
    """Under torch.func.grad the weights are wrappers whose storage cannot be read: the
    version error still names the weight, without claiming the weights share a buffer."""
    x, ws, bs = _data()
    dy = torch.ones(T, N, dtype=D)

    def f(w0):
        w0 = w0 * 1  # (a leaf of grad's level may not change in place)
        y, res = fd.grouped_linear_fwd(x, [w0, *ws[1:]], SPLITS, bs)
        w0.mul_(2)
        fd.grouped_linear_bwd(res, dy)
        return y.sum()

    want = (
        r"^weights\[0\] was modified in place between forward and backward \(version 0 -> 1\), e\.g\. by an "
        r"optimizer step\. Its gradient would be computed with the new values; run backward before updating the weights\.$"
    )
    with pytest.raises(RuntimeError, match=want):
        grad(f)(ws[0])


# --- second order: double backward on every path and layout, the Hessian -----------------------

SO_SPLITS = [2, 0, 3, 1]  # the sizes of this section: 4 experts, K = 16, N = 8
SO_E = len(SO_SPLITS)
PATHS = [pytest.param(False, id="split"), pytest.param(True, id="grouped")]


def _so_group(dtype=torch.float32, stacked=False, seed=0, requires_grad=True):
    """x, weights and biases (lists, or stacked); weights drawn / 4."""
    return grouped_inputs(
        SO_SPLITS, 16, 8, seed=seed, dtype=dtype, w_div=4, dy=False, stacked=stacked, grad=requires_grad
    )[:3]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("stacked", [False, True], ids=["list", "stacked"])
@pytest.mark.parametrize("path", PATHS)
def test_double_backward_matches_float64(dtype, stacked, path):
    x, ws, bs = _so_group(dtype, stacked)
    params = [x, *([ws] if stacked else ws), *([bs] if stacked else bs)]

    def second_order(f, args):
        y = f(*args)
        g = torch.autograd.grad(y.float().square().sum(), args, create_graph=True)
        return torch.autograd.grad(sum(t.float().sum() for t in g), args)

    got = second_order(
        lambda *a: fd.grouped_linear(
            a[0], _unflat(a[1:], stacked)[0], SO_SPLITS, _unflat(a[1:], stacked)[1], use_grouped_tensor=path
        ),
        params,
    )
    ref_args = [p.detach().double().requires_grad_() for p in params]
    want = second_order(
        lambda *a: ref_grouped(a[0], *_unflat(a[1:], stacked)[:1], SO_SPLITS, _unflat(a[1:], stacked)[1]), ref_args
    )
    for i, (a, b) in enumerate(zip(got, want)):  # a chain of GEMMs and sums, each result rounded
        assert_close(a, b, dtype, f"second-order grad {i}", rounds=8)
    y, res = fd.grouped_linear_fwd(x, ws, SO_SPLITS, bs, use_grouped_tensor=path)
    assert res.path == ("grouped" if path else "split")


def _unflat(rest, stacked):
    if stacked:
        return rest[0], rest[1]
    return list(rest[:SO_E]), list(rest[SO_E:])


def test_linear_double_backward_bf16():
    x, ws, bs = _so_group(torch.bfloat16)
    args = [x, ws[0], bs[0]]
    g = torch.autograd.grad(fd.linear(*args).float().square().sum(), args, create_graph=True)
    got = torch.autograd.grad(sum(t.float().sum() for t in g), args)
    ref = [a.detach().double().requires_grad_() for a in args]
    g = torch.autograd.grad((ref[0] @ ref[1].T + ref[2]).square().sum(), ref, create_graph=True)
    want = torch.autograd.grad(sum(t.sum() for t in g), ref)
    for a, b in zip(got, want):  # a chain of GEMMs and sums, each result rounded
        assert_close(a, b, torch.bfloat16, rounds=8)


def test_hessian_through_the_grouped_path():
    """grouped_mm has no forward-AD formula: under jvp-of-vjp the reference runs per expert."""
    x, ws, _ = _so_group(torch.float64, requires_grad=False)
    f = lambda *w: fd.grouped_linear(x, list(w), SO_SPLITS).square().sum()  # noqa: E731
    ref = lambda *w: ref_grouped(x, list(w), SO_SPLITS).square().sum()  # noqa: E731
    got = torch.func.hessian(f, argnums=(0, 1))(*ws)
    want = torch.func.hessian(ref, argnums=(0, 1))(*ws)
    for a, b in zip(pytree_leaves(got), pytree_leaves(want)):
        torch.testing.assert_close(a, b)


def pytree_leaves(t):
    return torch.utils._pytree.tree_leaves(t)


# --- forward mode and vmap, every combination of what is batched or has a tangent --------------
# (Written to kill mutants of the layers' jvp and vmap rules, with these sizes.)
RULE_SPLITS = (2, 0, 3)
RULE_T = sum(RULE_SPLITS)
_rand = functools.partial(randn, dtype=D, draw_dtype=None)  # (drawn in float64)


_SUBSETS = [(1, 0, 0), (0, 1, 0), (0, 0, 1), (1, 1, 0), (0, 1, 1), (1, 0, 1), (1, 1, 1), (0, 0, 0)]


@pytest.mark.parametrize("which", _SUBSETS, ids=lambda s: "t" + "".join("xwb"[i] for i in range(3) if s[i]) or "none")
def test_linear_jvp_for_every_subset_of_tangents(which):
    x = _rand(2, 3, K, seed=1)  # leading dims [2, 3]: the tangent keeps them
    w, b = _rand(N, K, seed=2), _rand(N, seed=3)
    tans = [
        _rand(*t.shape, seed=10 + i) if on else torch.zeros_like(t) for i, (t, on) in enumerate(zip((x, w, b), which))
    ]
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
    x = _rand(RULE_T, K, seed=1)
    ws = [_rand(N, K, seed=2 + e) for e in range(E)]
    bs = [_rand(N, seed=8 + e) for e in range(E)]
    W, B = torch.stack(ws), torch.stack(bs)
    base = (x, W, B) if stacked else (x, ws, bs)
    tans = (_rand(RULE_T, K, seed=20), _rand(E, N, K, seed=21), _rand(E, N, seed=22))
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

    ours = call(lambda x, w, b: fd.grouped_linear(x, w, RULE_SPLITS, b))
    ref = call(lambda x, w, b: ref_grouped(x, list(w), RULE_SPLITS, list(b)))
    y, t = jvp(ours, tuple(base[i] for i in idx), tuple(tans[i] for i in idx))
    torch.testing.assert_close((y, t), jvp(ref, tuple(base[i] for i in idx), tuple(tans[i] for i in idx)))


def test_grouped_jvp_with_a_none_tangent_in_a_list():
    x = _rand(RULE_T, K, seed=1)
    ws = [_rand(N, K, seed=2 + e) for e in range(E)]
    bs = [_rand(N, seed=8 + e) for e in range(E)]
    res = fd.grouped_linear_fwd(x, ws, list(RULE_SPLITS), bs)[1]
    tw = [None, _rand(N, K, seed=30), None]
    tb = [_rand(N, seed=31), None, None]
    got = gl_mod.jvp(res, (None, tw, None, tb))
    zeros_w = [torch.zeros(N, K, dtype=D) if t is None else t for t in tw]
    zeros_b = [torch.zeros(N, dtype=D) if t is None else t for t in tb]
    torch.testing.assert_close(got, ref_grouped(x, zeros_w, RULE_SPLITS, zeros_b))
    assert torch.equal(gl_mod.jvp(res, (None, [None] * E, None, None)), torch.zeros(RULE_T, N, dtype=D))


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
    args = (_rand(RULE_T, K, seed=1), _rand(E, N, K, seed=2), _rand(E, N, seed=3))
    batched = [_rand(B, *a.shape, seed=10 + i) if on else a for i, (a, on) in enumerate(zip(args, which))]
    dims = tuple(0 if on else None for on in which)
    k = CountingKernels()
    y = vmap(lambda x, w, b: fd.grouped_linear(x, w, list(RULE_SPLITS), b, backend=k), in_dims=dims)(*batched)
    want = torch.stack(
        [
            ref_grouped(
                *[a[i] if on else a for a, on in zip(batched, which)][:2],
                RULE_SPLITS,
                [a[i] if on else a for a, on in zip(batched, which)][2],
            )
            for i in range(B)
        ]
    )
    torch.testing.assert_close(y, want)
    assert k.calls == (1 if which == (1, 0, 0) else B)


def test_linear_jvp_in_x_uses_the_forward_gather():
    full = _rand(N, K, seed=2)
    w = FakeDW(full)  # gathers 2 * full for forward, 4 * full for backward
    x, tx = _rand(5, K, seed=1), _rand(5, K, seed=3)
    y, t = jvp(lambda x: fd.linear(x, w), (x,), (tx,))
    torch.testing.assert_close((y, t), (x @ (2 * full).t(), tx @ (2 * full).t()))


def test_float32_grouped_path_under_jvp_and_vmap():
    """grouped_mm has no forward-AD formula and no functorch batching rule: under jvp, vmap or
    a transform's wrappers the reference backend must run the split path (the results match)."""
    F32 = torch.float32
    x, dy = _rand(RULE_T, 16, seed=1, dtype=F32), _rand(RULE_T, 16, seed=2, dtype=F32)
    ws = [_rand(16, 16, seed=3 + e, dtype=F32) for e in range(E)]
    tx, tws = _rand(RULE_T, 16, seed=10, dtype=F32), [_rand(16, 16, seed=11 + e, dtype=F32) for e in range(E)]
    tol = dict(rtol=1e-5, atol=1e-5)
    f = lambda x, ws: fd.grouped_linear(x, ws, list(RULE_SPLITS), use_grouped_tensor=True)  # noqa: E731
    ref = lambda x, ws: ref_grouped(x, ws, RULE_SPLITS)  # noqa: E731
    torch.testing.assert_close(jvp(f, (x, ws), (tx, tws)), jvp(ref, (x, ws), (tx, tws)), **tol)
    xb = torch.stack([x, 2 * x])
    torch.testing.assert_close(
        vmap(lambda ws: f(x, ws))([torch.stack([w, -w]) for w in ws]),
        torch.stack([ref(x, ws), ref(x, [-w for w in ws])]),
        **tol,
    )
    g = grad(lambda x, ws: (f(x, ws) * dy).sum(), argnums=(0, 1))(x, ws)
    leaves = [t.clone().requires_grad_() for t in (x, *ws)]
    want = torch.autograd.grad(ref(leaves[0], leaves[1:]), leaves, dy)
    torch.testing.assert_close([g[0], *g[1]], list(want), **tol)
    dxb = vmap(grad(lambda x: (f(x, ws) * dy).sum()))(xb)
    torch.testing.assert_close(dxb, torch.stack([want[0]] * 2), **tol)


# --- what each functorch level reads by reference (NOTE: [Context per level], NOTE: [vmap]) ----
# The records hold weights and biases by reference. Under nested levels (a gradient penalty, a
# Hessian, jvp of grad) each level's backward must read its own wrapper of them; under vmap
# with batched weights or splits, each element its own. Every op against float64 torch under
# the same transform.
CTX_SPLITS = (2, 0, 4)
CTX_T, CTX_K, CTX_N, CTX_F = sum(CTX_SPLITS), 4, 3, 2


def _ctx_ref_mlp(x, w1, w2, p, b1, b2, splits=CTX_SPLITS):
    z = ref_grouped(x, w1, splits, b1)
    gate, up = z.chunk(2, -1)
    h = F.silu(gate) * up * p[:, None]
    return ref_grouped(h, w2, splits) + p[:, None] * b2.repeat_interleave(torch.tensor(splits), 0)


# name -> (ours(x, *params, splits=...), torch's, the params' shapes): each op's differentiable
# weights and biases, which its record holds by reference
_CTX_OPS = {
    "linear": (
        lambda x, w, b, splits=None: fd.linear(x, w, b),
        lambda x, w, b, splits=None: F.linear(x, w, b),
        [(CTX_N, CTX_K), (CTX_N,)],
    ),
    "grouped_list": (
        lambda x, *w, splits=CTX_SPLITS: fd.grouped_linear(x, list(w), splits),
        lambda x, *w, splits=CTX_SPLITS: ref_grouped(x, w, splits),
        [(CTX_N, CTX_K)] * E,
    ),
    "grouped_stacked": (
        lambda x, w, b, splits=CTX_SPLITS: fd.grouped_linear(x, w, splits, b),
        lambda x, w, b, splits=CTX_SPLITS: ref_grouped(x, w, splits, b),
        [(E, CTX_N, CTX_K), (E, CTX_N)],
    ),
    "mlp": (
        lambda x, w1, w2, p, b1, b2, splits=CTX_SPLITS: fd.grouped_mlp(x, w1, w2, splits, probs=p, bias1=b1, bias2=b2),
        _ctx_ref_mlp,
        [(E, 2 * CTX_F, CTX_K), (E, CTX_K, CTX_F), (CTX_T,), (E, 2 * CTX_F), (E, CTX_K)],
    ),
}


def _ctx_inputs(op, seed=0):
    """x and the op's params in float64; each changed in place once (a version counter past 0, as
    an optimizer's step leaves it: the version check must read the tensor forward ran on)."""
    g = torch.Generator().manual_seed(seed)
    ts = [torch.randn(CTX_T, CTX_K, generator=g, dtype=D)]
    ts += [torch.randn(s, generator=g, dtype=D) for s in _CTX_OPS[op][2]]
    for t in ts:
        t.mul_(1.0)
    return ts


def _assert_trees_close(got, want):
    got, want = pytree_leaves(got), pytree_leaves(want)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("op", list(_CTX_OPS))
def test_gradient_penalty_through_the_weights_matches_float64(op):
    """d/dparams of |d loss/dx|^2: the inner backward's W must be the one the outer grad tracks."""
    x, *params = _ctx_inputs(op)

    def penalty(f):
        def outer(*params):
            gx = grad(lambda x: f(x, *params).sin().sum())(x)
            return gx.square().sum()

        return outer

    argnums = tuple(range(len(params)))
    ours, ref = _CTX_OPS[op][:2]
    _assert_trees_close(grad(penalty(ours), argnums)(*params), grad(penalty(ref), argnums)(*params))


@pytest.mark.parametrize("op", list(_CTX_OPS))
def test_full_hessian_matches_float64(op):
    """Every block of the Hessian in (x, *params), the x-W blocks included."""
    inputs = _ctx_inputs(op)
    argnums = tuple(range(len(inputs)))
    ours, ref = _CTX_OPS[op][:2]
    got = torch.func.hessian(lambda *a: ours(*a).sin().sum(), argnums)(*inputs)
    want = torch.func.hessian(lambda *a: ref(*a).sin().sum(), argnums)(*inputs)
    _assert_trees_close(got, want)


@pytest.mark.parametrize("op", list(_CTX_OPS))
def test_jvp_of_grad_in_the_weights_matches_float64(op):
    x, *params = _ctx_inputs(op)
    tangents = tuple(_ctx_inputs(op, seed=1)[1:])
    ours, ref = _CTX_OPS[op][:2]
    outs = [jvp(lambda *p: grad(lambda x: f(x, *p).sin().sum())(x), tuple(params), tangents) for f in (ours, ref)]
    _assert_trees_close(*outs)


_X_RULES = {
    "grad": lambda f, x: grad(lambda x: f(x).sin().sum())(x),
    "jacrev": lambda f, x: jacrev(lambda x: f(x).sin())(x),
    "jacfwd": lambda f, x: torch.func.jacfwd(lambda x: f(x).sin())(x),
}


@pytest.mark.parametrize("rule", list(_X_RULES))
@pytest.mark.parametrize("batched", ["params", "x_and_params"])
@pytest.mark.parametrize("op", list(_CTX_OPS))
def test_vmap_over_an_ensemble_uses_each_members_weights(op, batched, rule):
    """vmap of grad_x / jacrev_x / jacfwd_x over stacked members: each member's own W (the
    loop once used the last member's for all)."""
    B = 3
    members = [_ctx_inputs(op, seed=s) for s in range(B)]
    x0 = members[0][0]
    xs = torch.stack([m[0] for m in members]) if batched == "x_and_params" else x0
    params = [torch.stack(column) for column in zip(*[m[1:] for m in members])]
    ours, ref = _CTX_OPS[op][:2]
    take = _X_RULES[rule]
    in_dims = (0 if batched == "x_and_params" else None, *[0] * len(params))
    got = vmap(lambda x, *p: take(lambda x: ours(x, *p), x), in_dims=in_dims)(xs, *params)
    for b, m in enumerate(members):
        want = take(lambda x: ref(x, *m[1:]), m[0] if batched == "x_and_params" else x0)
        torch.testing.assert_close(got[b], want, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("rule", list(_X_RULES))
@pytest.mark.parametrize("op", ["grouped_list", "grouped_stacked", "mlp"])
def test_vmap_over_per_example_splits_uses_each_routing(op, rule):
    x, *params = _ctx_inputs(op)
    S = torch.tensor([[2, 0, 4], [1, 5, 0], [0, 0, 6]])
    ours, ref = _CTX_OPS[op][:2]
    take = _X_RULES[rule]
    got = vmap(lambda s: take(lambda x: ours(x, *params, splits=s), x))(S)
    for b, s in enumerate(S.tolist()):
        want = take(lambda x: ref(x, *params, splits=tuple(s)), x)
        torch.testing.assert_close(got[b], want, rtol=1e-9, atol=1e-9)


def test_vmap_over_a_stacked_module_ensemble():
    """torch.func's model-ensembling recipe: stack_module_state over nn.GroupedLinear members
    (TE's per-expert weight0..), vmap of grad_x through functional_call."""
    torch.manual_seed(0)
    members = [fd.nn.GroupedLinear(E, CTX_K, CTX_N, params_dtype=D) for _ in range(3)]
    params, buffers = torch.func.stack_module_state(members)
    x = torch.randn(CTX_T, CTX_K, dtype=D)
    splits = torch.tensor(CTX_SPLITS)
    f = lambda p, b: grad(lambda x: functional_call(members[0], (p, b), (x, splits)).sin().sum())(x)
    got = vmap(f)(params, buffers)
    for i, m in enumerate(members):
        ws = [getattr(m, f"weight{e}").detach() for e in range(E)]
        bs = [getattr(m, f"bias{e}").detach() for e in range(E)]
        want = grad(lambda x: ref_grouped(x, ws, CTX_SPLITS, bs).sin().sum())(x)
        torch.testing.assert_close(got[i], want, rtol=1e-9, atol=1e-9)


def test_grad_of_vmap_over_an_ensemble_of_penalties():
    """The outer derivative outside the vmap: each member's penalty differentiated in its W."""
    x, w, b = _ctx_inputs("linear")
    W = torch.stack([w, w * 2, w - 1])

    def total(f):
        return lambda W: vmap(lambda w: grad(lambda x: f(x, w, b).sin().sum())(x).square().sum())(W).sum()

    ours, ref = _CTX_OPS["linear"][:2]
    torch.testing.assert_close(grad(total(ours))(W), grad(total(ref))(W), rtol=1e-9, atol=1e-9)


def test_second_order_inside_a_per_element_vmap_is_refused():
    """vmap(grad_W(penalty)) over an ensemble: the per-element backward has no derivative of its
    own; a clear refusal, never a wrong number."""
    x, w, b = _ctx_inputs("linear")
    W = torch.stack([w, w * 2])
    penalty = lambda w: grad(lambda x: fd.linear(x, w, b).sin().sum())(x).square().sum()
    with pytest.raises(NotImplementedError, match="once per batch element.*grad\\(vmap\\(...\\)\\) works"):
        vmap(grad(penalty))(W)


def test_a_folding_vmap_inside_a_per_element_vmap():
    """vmap over W (one call per member) of vmap over x (folded into one call) of grad_x."""
    x, w, b = _ctx_inputs("linear")
    xb, W = torch.stack([x, x * 2]), torch.stack([w, w + 1, w * 3])
    take = lambda f: vmap(lambda w: vmap(lambda x: grad(lambda x: f(x, w, b).sin().sum())(x))(xb))(W)
    ours, ref = _CTX_OPS["linear"][:2]
    torch.testing.assert_close(take(ours), take(ref), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("op", ["linear", "grouped_stacked"])
def test_a_level_below_a_folding_vmap_tracks_the_weights(op):
    """jvp_W of vmap_x of a per-example gradient penalty: the fold's element plan ran fwd on the
    jvp level's wrapper of W, which the penalty's grad level must still find and rebind."""
    x, *params = _ctx_inputs(op)
    xb = torch.stack([x, x * 2])
    tangents = tuple(_ctx_inputs(op, seed=1)[1:])

    def per_example(f):
        def outer(*p):
            penalty = lambda *p: grad(lambda x: f(x, *p).sin().sum())  # noqa: E731
            return vmap(lambda x: grad(lambda *p: penalty(*p)(x).square().sum(), argnums=0)(*p))(xb)

        return outer

    ours, ref = _CTX_OPS[op][:2]
    _assert_trees_close(jvp(per_example(ours), tuple(params), tangents), jvp(per_example(ref), tuple(params), tangents))


def test_a_parameter_subclass_weight_is_tracked_like_a_parameter():
    class MyParam(torch.nn.Parameter):
        pass

    x, w, b = _ctx_inputs("linear")
    W = MyParam(w.clone())
    ours, ref = _CTX_OPS["linear"][:2]
    penalty = lambda f: grad(lambda w: grad(lambda x: f(x, w, b).sin().sum())(x).square().sum())  # noqa: E731
    torch.testing.assert_close(penalty(ours)(W), penalty(ref)(w), rtol=1e-9, atol=1e-9)


def test_nested_levels_through_a_distributed_weight_are_refused():
    """A DistributedWeight keeps its identity (its protocol needs the object): first order is
    right; a derivative of a derivative through it is refused, never computed wrong."""
    x, ws, _ = _data()
    group = FakeDW.group_of(ws)
    first = grad(lambda ws: fd.grouped_linear(x, ws, SPLITS).sin().sum())(list(group))
    eager_x = x.clone().requires_grad_()
    for w in group:
        w.grad = None
    fd.grouped_linear(eager_x, group, SPLITS).sin().sum().backward()
    torch.testing.assert_close(list(first), [w.grad for w in group])
    penalty = lambda ws: grad(lambda x: fd.grouped_linear(x, ws, SPLITS).sin().sum())(x).square().sum()  # noqa: E731
    with pytest.raises(NotImplementedError, match="DistributedWeight under nested torch.func levels"):
        grad(penalty)(list(FakeDW.group_of(ws)))


def test_one_tensor_through_two_wrappers_is_refused():
    """W as the function's argument for one expert and closed over for another: the record cannot
    tell the two uses apart under a higher-order transform; refused (a clone works)."""
    x, *ws = _ctx_inputs("grouped_list")
    W = ws[0]

    def penalty(w_other):
        return grad(
            lambda v: (
                grad(lambda x: fd.grouped_linear(x, [v, w_other, ws[2]], CTX_SPLITS).sin().sum())(x).square().sum()
            )
        )

    with pytest.raises(NotImplementedError, match="two different torch.func wrappers"):
        penalty(W)(W)
    want = grad(lambda v: grad(lambda x: ref_grouped(x, [v, W, ws[2]], CTX_SPLITS).sin().sum())(x).square().sum())(W)
    torch.testing.assert_close(penalty(W.clone())(W), want, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("outer", ["jvp", "jacfwd"])
def test_jvp_of_jvp_is_refused(outer):
    """torch runs a Function's jvp rule with forward AD off: an outer jvp level would miss the
    mixed terms (F.linear's own jacfwd(jacfwd) has them). Refused; hessian still works."""
    x, w, b = _ctx_inputs("linear")
    inner = lambda w: jvp(lambda x: fd.linear(x, w, b).sin(), (x,), (torch.ones_like(x),))[1]  # noqa: E731
    with pytest.raises(NotImplementedError, match="jvp of jvp"):
        if outer == "jvp":
            jvp(inner, (w,), (torch.ones_like(w),))
        else:
            torch.func.jacfwd(torch.func.jacfwd(lambda x: fd.linear(x, w, b).sin().sum()))(x)


# --- under torch.autocast (NOTE: [Autocast] in functional_dw/_amp.py) -------------------------------


def _amp(f):
    """``f`` run under bf16 autocast (on the CPU)."""

    def run(*args):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return f(*args)

    return run


def _layer(path):
    return lambda x, ws, bs: fd.grouped_linear(x, ws, SO_SPLITS, bs, use_grouped_tensor=path)


def _composition(x, ws, bs):
    return ref_grouped(x, ws, SO_SPLITS, bs)


def test_grad_and_second_order_under_autocast_are_torchs_composition():
    """torch.func.grad of a loss computed under autocast (fp32 inputs), and autograd's double
    backward through it: the dtypes and bits of F.linear per expert under the same autocast (the
    split path runs the same GEMMs; its backward casts the weights again, differentiably)."""
    x, ws, bs = _so_group(requires_grad=False)
    dy = randn(sum(SO_SPLITS), 8, seed=9)

    def loss(f):
        return _amp(lambda x, ws, bs: (f(x, ws, bs).float() * dy).sum())

    got = grad(loss(_layer(False)), argnums=(0, 1, 2))(x, ws, bs)
    want = grad(loss(_composition), argnums=(0, 1, 2))(x, ws, bs)
    assert all(g.dtype == torch.float32 for g in pytree_leaves(got))
    assert all(torch.equal(a, b) for a, b in zip(pytree_leaves(got), pytree_leaves(want)))

    def second_order(f):
        args = [t.clone().requires_grad_() for t in (x, *ws, *bs)]
        y = _amp(f)(args[0], args[1 : 1 + SO_E], args[1 + SO_E :])
        gx = torch.autograd.grad(y, args[0], dy.to(y.dtype), create_graph=True)[0]
        return torch.autograd.grad(gx.square().sum(), args[1 : 1 + SO_E])

    got, want = second_order(_layer(False)), second_order(_composition)
    assert [g.dtype for g in got] == [torch.float32] * SO_E and all(map(torch.equal, got, want))


def _r64(t, absolute=False):
    """``t`` (a tensor or a list) as bf16 autocast rounds it, in float64 (``absolute``: |t|)."""
    if isinstance(t, list):
        return [_r64(u, absolute) for u in t]
    t = t.to(torch.bfloat16).double()
    return t.abs() if absolute else t


def test_jvp_and_vmap_under_autocast():
    """Forward mode and vmap over x under autocast: outputs and tangents in the autocast dtype (as
    torch's composition gives under jvp), within the tolerance rule of the float64 results from
    the inputs and tangents autocast rounds (magnitudes: the same on absolute values; the tangent
    adds two rounded products, dx W^T + db and x dW^T); on each path (the original ignored
    autocast on the grouped path), and for linear."""
    for path in (False, True):
        _jvp_and_vmap_under_autocast(path)
    x, ws, bs = _so_group(requires_grad=False)
    tx, tws, tbs = _so_group(seed=1, requires_grad=False)
    primals, tangents = (x, ws[0], bs[0]), (tx, tws[0], tbs[0])
    (y, ty), (y_t, ty_t) = (jvp(_amp(f), primals, tangents) for f in (fd.linear, F.linear))
    assert ty.dtype == ty_t.dtype == torch.bfloat16 and torch.equal(y, y_t)
    _, ty64 = jvp(F.linear, tuple(map(_r64, primals)), tuple(map(_r64, tangents)))
    _, ty_mag = jvp(F.linear, *(tuple(_r64(a, True) for a in t) for t in (primals, tangents)))
    assert_close(ty, ty64, torch.bfloat16, "linear's tangent", mag=ty_mag, rounds=2)


def _jvp_and_vmap_under_autocast(path):
    bf = torch.bfloat16
    x, ws, bs = _so_group(requires_grad=False)
    tx, tws, tbs = _so_group(seed=1, requires_grad=False)
    (y, ty), (y_t, ty_t) = (jvp(_amp(f), (x, ws, bs), (tx, tws, tbs)) for f in (_layer(path), _composition))
    assert y.dtype == ty.dtype == y_t.dtype == ty_t.dtype == bf
    primals, tangents = (x, ws, bs), (tx, tws, tbs)
    y64, ty64 = jvp(_composition, tuple(map(_r64, primals)), tuple(map(_r64, tangents)))
    y_mag, ty_mag = jvp(_composition, *(tuple(_r64(a, True) for a in t) for t in (primals, tangents)))
    assert_close(y, y64, bf, "y", mag=y_mag, rounds=2 if path else 1)
    assert_close(ty, ty64, bf, "tangent", mag=ty_mag, rounds=2)
    xb = randn(3, sum(SO_SPLITS), 16, seed=2)
    yb = vmap(_amp(lambda x: _layer(path)(x, ws, bs)))(xb)
    assert yb.dtype == bf  # F.linear's under autocast (under vmap torch's own composition gives fp32:
    # F.linear's batching rule adds the fp32 bias after autocast's bf16 matmul, promoting)
    y64 = vmap(lambda x: _composition(x, _r64(ws), _r64(bs)))(_r64(xb))
    y_mag = vmap(lambda x: _composition(x, _r64(ws, True), _r64(bs, True)))(_r64(xb, True))
    assert_close(yb, y64, bf, "vmap's y", mag=y_mag, rounds=2)
