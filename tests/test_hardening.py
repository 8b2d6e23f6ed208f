"""Ordinary uses that crashed or were silently wrong (issue 12): inference tensors, double
backward on every path, partly frozen groups with fused wgrad, main_grad dtypes, x changed in
place under the pure API, any sequence of weights/biases, numpy splits, module edge sizes."""

from __future__ import annotations

import sys
import warnings

import numpy as np
import pytest
import torch

import functional_dw as fd
from conftest import FakeDW, assert_close, assert_same
from helpers import ref_grouped

SPLITS = [2, 0, 3, 1]
E, T, K, N = len(SPLITS), sum(SPLITS), 16, 8
PATHS = [pytest.param(False, id="split"), pytest.param(True, id="grouped")]


def _group(dtype=torch.float32, stacked=False, seed=0, requires_grad=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, K, generator=g).to(dtype)
    ws = [(torch.randn(N, K, generator=g) / 4).to(dtype) for _ in range(E)]
    bs = [torch.randn(N, generator=g).to(dtype) for _ in range(E)]
    if stacked:
        ws, bs = torch.stack(ws), torch.stack(bs)
    params = [ws] if stacked else ws
    for p in [x, *params, *([bs] if stacked else bs)]:
        p.requires_grad_(requires_grad)
    return x, ws, bs


# --- 1. inference tensors: no residual bookkeeping when no backward can happen ------------

@pytest.mark.parametrize("mode", ["inference_mode", "no_grad", "grad_enabled"])
@pytest.mark.parametrize("layer", ["linear", "grouped", "nn.Linear", "nn.GroupedLinear"])
def test_weights_made_under_inference_mode_run_forward(mode, layer):
    with torch.inference_mode():  # how a model is built or loaded for serving
        x, ws, bs = _group(requires_grad=False)
        lin, grp = fd.nn.Linear(K, N), fd.nn.GroupedLinear(E, K, N)
    call = {
        "linear": lambda: fd.linear(x, ws[0], bs[0]),
        "grouped": lambda: fd.grouped_linear(x, ws, SPLITS, bs),
        "nn.Linear": lambda: lin(x),
        "nn.GroupedLinear": lambda: grp(x, SPLITS),
    }[layer]
    want = {
        "linear": lambda: x @ ws[0].T + bs[0],
        "grouped": lambda: ref_grouped(x, ws, SPLITS, bs),
        "nn.Linear": lambda: x @ lin.weight.T + lin.bias,
        "nn.GroupedLinear": lambda: ref_grouped(x, grp.weights(), SPLITS, grp.biases()),
    }[layer]
    ctx = {"inference_mode": torch.inference_mode, "no_grad": torch.no_grad, "grad_enabled": torch.enable_grad}[mode]
    with ctx():
        y = call()
    # Parameters made under inference_mode say requires_grad=True, but autograd records nothing
    # through inference tensors: torch.nn.Linear's output has no grad_fn either.
    assert y.grad_fn is None and not y.requires_grad
    with torch.inference_mode():
        torch.testing.assert_close(y, want())


def test_inference_weights_with_an_x_that_needs_grad():
    """Weights held by reference are never saved, so inference-made weights still give dx."""
    with torch.inference_mode():
        _, ws, _ = _group(requires_grad=False)
    x = torch.randn(T, K, requires_grad=True)
    y = fd.grouped_linear(x, ws, SPLITS)
    (dx,) = torch.autograd.grad(y.square().sum(), x)
    xr = x.detach().clone().requires_grad_()
    (want,) = torch.autograd.grad(ref_grouped(xr, [w.clone() for w in ws], SPLITS).square().sum(), xr)
    torch.testing.assert_close(dx, want)


def test_no_grad_forward_builds_no_residuals(monkeypatch):
    """Under no_grad the bridge calls the layer's primal: no record, no autograd node."""
    gl = sys.modules["functional_dw.grouped_linear"]  # (fd.grouped_linear is the function)
    built = []
    monkeypatch.setattr(gl, "GroupedLinearResiduals", lambda **kw: built.append(kw))
    x, ws, bs = _group()
    with torch.no_grad():
        y = fd.grouped_linear(x, ws, SPLITS, bs)
    assert built == [] and y.grad_fn is None
    torch.testing.assert_close(y, ref_grouped(x, ws, SPLITS, bs).detach())


# --- 2. double backward on every path and layout -----------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("stacked", [False, True], ids=["list", "stacked"])
@pytest.mark.parametrize("path", PATHS)
def test_double_backward_matches_float64(dtype, stacked, path):
    x, ws, bs = _group(dtype, stacked)
    params = [x, *([ws] if stacked else ws), *([bs] if stacked else bs)]

    def second_order(f, args):
        y = f(*args)
        g = torch.autograd.grad(y.float().square().sum(), args, create_graph=True)
        return torch.autograd.grad(sum(t.float().sum() for t in g), args)

    got = second_order(lambda *a: fd.grouped_linear(a[0], _unflat(a[1:], stacked)[0], SPLITS, _unflat(a[1:], stacked)[1],
                                                    use_grouped_tensor=path), params)
    ref_args = [p.detach().double().requires_grad_() for p in params]
    want = second_order(lambda *a: ref_grouped(a[0], *_unflat(a[1:], stacked)[:1], SPLITS, _unflat(a[1:], stacked)[1]),
                        ref_args)
    for i, (a, b) in enumerate(zip(got, want)):  # a chain of GEMMs and sums, each result rounded
        assert_close(a, b, dtype, f"second-order grad {i}", rounds=8)
    y, res = fd.grouped_linear_fwd(x, ws, SPLITS, bs, use_grouped_tensor=path)
    assert res.path == ("grouped" if path else "split")


def _unflat(rest, stacked):
    if stacked:
        return rest[0], rest[1]
    return list(rest[:E]), list(rest[E:])


def test_linear_double_backward_bf16():
    x, ws, bs = _group(torch.bfloat16)
    args = [x, ws[0], bs[0]]
    g = torch.autograd.grad(fd.linear(*args).float().square().sum(), args, create_graph=True)
    got = torch.autograd.grad(sum(t.float().sum() for t in g), args)
    ref = [a.detach().double().requires_grad_() for a in args]
    g = torch.autograd.grad((ref[0] @ ref[1].T + ref[2]).square().sum(), ref, create_graph=True)
    want = torch.autograd.grad(sum(t.sum() for t in g), ref)
    for a, b in zip(got, want):  # a chain of GEMMs and sums, each result rounded
        assert_close(a, b, torch.bfloat16, rounds=8)


# --- 6. a partly frozen group with fused wgrad accumulation -------------------------------

@pytest.mark.parametrize("path", PATHS)
def test_partly_frozen_group_leaves_frozen_main_grads_alone(path):
    x, ws, _ = _group()
    frozen = {1, 3}
    for e, w in enumerate(ws):
        w.requires_grad_(e not in frozen)
        if e not in frozen:
            w.main_grad = torch.full((N, K), 0.5)
            w.grad_added_to_main_grad = False
    ws[3].main_grad = torch.full((N, K), 7.0)  # frozen, but holding a buffer: must stay 7
    y = fd.grouped_linear(x, ws, SPLITS, fuse_wgrad_accumulation=True, use_grouped_tensor=path)
    y.square().sum().backward()
    ref_ws = [w.detach().double().requires_grad_() for w in ws]
    dws = torch.autograd.grad(ref_grouped(x.detach().double(), ref_ws, SPLITS).square().sum(), ref_ws)
    for e, w in enumerate(ws):
        if e in frozen:
            assert w.grad is None and not hasattr(w, "grad_added_to_main_grad")
        else:
            assert_close(w.main_grad, dws[e] + 0.5, torch.float32, f"main_grad[{e}]")
            assert w.grad_added_to_main_grad is True
            assert_same(w.grad, torch.zeros_like(w))
    assert_same(ws[3].main_grad, torch.full((N, K), 7.0))
    assert x.grad is not None


def test_linear_frozen_weight_without_main_grad_is_fine():
    x, ws, bs = _group()
    ws[0].requires_grad_(False)
    fd.linear(x, ws[0], bs[0], fuse_wgrad_accumulation=True).sum().backward()
    assert ws[0].grad is None and not hasattr(ws[0], "main_grad") and bs[0].grad is not None


# --- 7. main_grad dtypes ------------------------------------------------------------------

@pytest.mark.parametrize("layer", ["linear", "grouped-split", "grouped-grouped"])
def test_float64_main_grad_accumulates_in_float64(layer):
    x, ws, _ = _group(torch.bfloat16)
    for w in ws:
        w.main_grad = torch.zeros(N, K, dtype=torch.float64)
    if layer == "linear":
        y, used = fd.linear(x, ws[0], fuse_wgrad_accumulation=True), ws[:1]
    else:
        y, used = fd.grouped_linear(x, ws, SPLITS, fuse_wgrad_accumulation=True,
                                    use_grouped_tensor=layer.endswith("grouped")), ws
    dy = torch.randn(y.shape).to(y.dtype)
    y.backward(dy)
    xs = x.detach().double().split(SPLITS) if layer != "linear" else [x.detach().double()]
    dys = dy.double().split(SPLITS) if layer != "linear" else [dy.double()]
    for w, xe, dye in zip(used, xs, dys):
        assert w.main_grad.dtype == torch.float64
        torch.testing.assert_close(w.main_grad, dye.T @ xe, rtol=1e-12, atol=1e-12)  # products of bf16 values: exact


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool])
@pytest.mark.parametrize("layer", ["linear", "grouped"])
def test_integer_main_grad_is_refused(dtype, layer):
    x, ws, _ = _group()
    for w in ws:
        w.main_grad = torch.zeros(N, K, dtype=dtype)
    y = fd.linear(x, ws[0], fuse_wgrad_accumulation=True) if layer == "linear" else \
        fd.grouped_linear(x, ws, SPLITS, fuse_wgrad_accumulation=True)
    with pytest.raises(TypeError, match=r"weights?(\[0\])?: main_grad/grad_buffer\(\) is torch\.(int|bool)"):
        y.sum().backward()
    assert all(not w.main_grad.any() for w in ws)


# --- 8. x changed in place between the pure fwd and bwd ------------------------------------

@pytest.mark.parametrize("layer", ["linear", "grouped"])
def test_pure_api_sees_x_modified_in_place(layer):
    x, ws, _ = _group(requires_grad=False)
    y, res = fd.linear_fwd(x, ws[0]) if layer == "linear" else fd.grouped_linear_fwd(x, ws, SPLITS)
    bwd = fd.linear_bwd if layer == "linear" else fd.grouped_linear_bwd
    bwd(res, torch.ones_like(y))  # fine before the change
    x.mul_(2)
    with pytest.raises(RuntimeError, match=r"x was modified in place between forward and backward \(version 0 -> 1\)"):
        bwd(res, torch.ones_like(y))


def test_non_contiguous_x_is_saved_as_given():
    """The residuals hold x itself (not forward's dense copy), so an in-place change is seen."""
    x, ws, _ = _group(requires_grad=False)
    xt = x.t().contiguous().t()
    y, res = fd.grouped_linear_fwd(xt, ws, SPLITS)
    assert res.x_TK is xt
    xt.mul_(2)
    with pytest.raises(RuntimeError, match="x was modified in place"):
        fd.grouped_linear_bwd(res, torch.ones_like(y))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("layer", ["linear", "grouped"])
def test_second_order_through_a_non_contiguous_x(layer, path):
    """The x term of d(dW)/dx survives when forward had to copy x (found by the probe)."""
    x, ws, _ = _group(torch.float64)
    xt = x.detach().t().contiguous().t().requires_grad_()
    f = (lambda x, w: fd.linear(x, w[0])) if layer == "linear" else \
        (lambda x, w: fd.grouped_linear(x, w, SPLITS, use_grouped_tensor=path))
    ref = (lambda x, w: x @ w[0].T) if layer == "linear" else (lambda x, w: ref_grouped(x, w, SPLITS))
    params = [xt, ws[0]] if layer == "linear" else [xt, *ws]
    out = []
    for fn in (f, ref):
        g = torch.autograd.grad(fn(xt, ws).square().sum(), params, create_graph=True)
        out.append(torch.autograd.grad(sum(t.sum() for t in g), params))
    for a, b in zip(*out):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("stacked", [False, True], ids=["list", "stacked"])
def test_jvp_with_non_contiguous_tangents_on_the_grouped_path(stacked):
    x, ws, _ = _group(requires_grad=False)
    W = torch.stack(ws) if stacked else ws
    xt = x.t().contiguous().t()
    tx = torch.randn(K, T).t()
    tW = torch.randn(E, K, N).transpose(1, 2) if stacked else [torch.randn(K, N).t() for _ in range(E)]
    y, ty = torch.func.jvp(lambda x, W: fd.grouped_linear(x, W, SPLITS, use_grouped_tensor=True), (xt, W), (tx, tW))
    _, want = torch.func.jvp(lambda x, W: ref_grouped(x, W, SPLITS), (xt, W), (tx, tW))
    torch.testing.assert_close(ty, want)


# --- 9. the bridge restates its contract ---------------------------------------------------

def test_custom_vjp_fwd_returning_a_bare_tensor():
    f = fd.custom_vjp(lambda x: x * 2, lambda res, dy: (dy * 2,), name="double")
    x = torch.ones(3, requires_grad=True)
    with pytest.raises(TypeError, match=r"custom_vjp\(double\): fwd must return a pair \(out, residuals\).*bare Tensor of shape \(3,\)"):
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


# --- 10/11. any sequence of weights and biases; numpy splits ------------------------------

@pytest.mark.parametrize("path", PATHS)
def test_parameter_lists_and_numpy_splits(path):
    x, ws, bs = _group()
    pw = torch.nn.ParameterList([torch.nn.Parameter(w.detach().clone()) for w in ws])
    pb = torch.nn.ParameterList([torch.nn.Parameter(b.detach().clone()) for b in bs])
    for splits in (np.array(SPLITS), [np.int64(s) for s in SPLITS], tuple(np.int32(s) for s in SPLITS)):
        y = fd.grouped_linear(x, pw, splits, pb, use_grouped_tensor=path)
        y.square().sum().backward()
    y_ref = ref_grouped(x, ws, SPLITS, bs)
    y_ref.square().sum().backward()
    torch.testing.assert_close(y, y_ref)
    for p, w in zip([*pw, *pb], [*ws, *bs]):
        torch.testing.assert_close(p.grad, 3 * w.grad)  # three calls accumulated
    y2, res = fd.grouped_linear_fwd(x, pw, np.array(SPLITS), pb, use_grouped_tensor=path)
    assert res.splits.host == tuple(SPLITS) and all(type(s) is int for s in res.splits.host)


# --- 14. module sizes, and a warning at the caller's line ---------------------------------

def test_zero_in_features_like_torch():
    lin = fd.nn.Linear(0, 4)
    ref = torch.nn.Linear(0, 4)
    y = lin(torch.randn(3, 0))
    assert y.shape == ref(torch.randn(3, 0)).shape == (3, 4)
    torch.testing.assert_close(y, lin.bias.expand(3, 4))
    g = fd.nn.GroupedLinear(2, 0, 4)
    assert g(torch.randn(3, 0), [1, 2]).shape == (3, 4)


def test_fallback_warning_points_at_the_callers_line():
    x = torch.randn(T, 3)  # 3 fp32 features: 12-byte rows, the grouped path cannot run
    ws = [torch.randn(N, 3, requires_grad=True) for _ in range(E)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fd.grouped_linear(x, ws, SPLITS, use_grouped_tensor=True)  # <- this line
        line = __import__("inspect").currentframe().f_lineno - 1
    (w,) = [c for c in caught if "use_grouped_tensor=True" in str(c.message)]
    assert w.filename == __file__ and w.lineno == line
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fd.nn.GroupedLinear(E, 3, N, use_grouped_tensor=True)(x, SPLITS)  # <- this line
        line = __import__("inspect").currentframe().f_lineno - 1
    (w,) = [c for c in caught if "use_grouped_tensor=True" in str(c.message)]
    assert w.filename == __file__ and w.lineno == line


# --- 13. DistributedWeight methods that break the protocol --------------------------------

class WrongDtypeDW(FakeDW):
    def materialize_group_for_forward(self):
        return [m.full.double() for m in self.group]


def test_dw_materialize_wrong_dtype_names_the_method():
    dws = WrongDtypeDW.group_of([torch.randn(N, K) for _ in range(E)])
    with pytest.raises(TypeError, match=r"materialize_group_for_forward\(\) of the DistributedWeight returned a torch.float64 tensor on cpu for weight 0"):
        fd.grouped_linear(torch.randn(T, K), dws, SPLITS)


# --- found by the adversarial pass ---------------------------------------------------------

def test_hessian_through_the_grouped_path():
    """grouped_mm has no forward-AD formula: under jvp-of-vjp the reference runs per expert."""
    x, ws, _ = _group(torch.float64, requires_grad=False)
    f = lambda *w: fd.grouped_linear(x, list(w), SPLITS).square().sum()  # noqa: E731
    ref = lambda *w: ref_grouped(x, list(w), SPLITS).square().sum()  # noqa: E731
    got = torch.func.hessian(f, argnums=(0, 1))(*ws)
    want = torch.func.hessian(ref, argnums=(0, 1))(*ws)
    for a, b in zip(pytree_leaves(got), pytree_leaves(want)):
        torch.testing.assert_close(a, b)


def pytree_leaves(t):
    return torch.utils._pytree.tree_leaves(t)


def test_enable_grad_inside_inference_mode_records_nothing_like_torch():
    x = torch.randn(T, K, requires_grad=True)
    w = torch.randn(N, K, requires_grad=True)
    with torch.inference_mode(), torch.enable_grad():
        y, ref = fd.linear(x, w), torch.nn.functional.linear(x, w)
    assert ref.grad_fn is None and y.grad_fn is None and not y.requires_grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_compile_with_grouped_fallback_has_no_graph_break(dtype):
    """use_grouped_tensor=True in a dtype the compiled grouped GEMM cannot take: the split path,
    no warnings.warn inside the trace (dynamo cannot trace it)."""
    torch._dynamo.reset()
    x, ws, _ = _group(dtype)
    f = lambda x, ws: fd.grouped_linear(x, ws, SPLITS, use_grouped_tensor=True)  # noqa: E731
    explained = torch._dynamo.explain(f)(x, ws)
    assert explained.graph_break_count == 0, explained.break_reasons
    torch.testing.assert_close(torch.compile(f, fullgraph=True, backend="aot_eager")(x, ws), ref_grouped(x, ws, SPLITS))


def test_nn_sizes_take_numpy_ints_like_torch():
    lin, grp = fd.nn.Linear(np.int64(K), np.int32(N)), fd.nn.GroupedLinear(np.int64(E), K, np.int64(N))
    assert lin.weight.shape == (N, K) and type(grp.num_gemms) is int and grp(torch.randn(T, K), SPLITS).shape == (T, N)
