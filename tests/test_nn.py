"""functional_dw.nn.Linear / GroupedLinear: TE's parameter names, TE state dicts, a
forward/backward that is the functional call, and sizes taken as torch.nn takes them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import functional_dw as fdw
from conftest import PathRecorder, assert_close, assert_same
from helpers import ref_grouped

E, K, N, SPLITS = 3, 4, 8, [2, 0, 4]
T = sum(SPLITS)


NO_FP8 = torch.empty(0, dtype=torch.uint8)  # TE's `_extra_state` without FP8


def te_linear_state_dict(bias=True):  # te.Linear(K, N, bias=bias).state_dict()
    return {"weight": torch.randn(N, K), **({"bias": torch.randn(N)} if bias else {}), "_extra_state": NO_FP8}


def te_grouped_state_dict(bias=True):  # ... and te.GroupedLinear(E, K, N, bias=bias).state_dict()
    params = {
        k: v
        for e in range(E)
        for k, v in [(f"weight{e}", torch.randn(N, K)), (f"bias{e}", torch.randn(N))]
        if bias or k.startswith("weight")
    }
    return {**params, "_extra_state": NO_FP8}


def test_parameter_names_are_te_names():
    lin = fdw.nn.Linear(K, N)
    assert {n: tuple(p.shape) for n, p in lin.named_parameters()} == {"weight": (N, K), "bias": (N,)}
    grp = fdw.nn.GroupedLinear(E, K, N)
    want = {**{f"weight{e}": (N, K) for e in range(E)}, **{f"bias{e}": (N,) for e in range(E)}}
    assert {n: tuple(p.shape) for n, p in grp.named_parameters()} == want


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_linear_loads_te_state_dict_and_matches_functional(bias):
    sd = te_linear_state_dict(bias)
    m = fdw.nn.Linear(K, N, bias=bias)
    m.load_state_dict(sd, strict=True)
    assert set(m.state_dict()) == set(sd)
    x = torch.randn(2, 3, K)
    y = m(x)
    assert_same(y, fdw.linear(x, sd["weight"], sd.get("bias")))
    assert_close(y, F.linear(x.double(), sd["weight"].double(), sd["bias"].double() if bias else None), torch.float32)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_grouped_loads_te_state_dict_and_matches_functional(bias):
    sd = te_grouped_state_dict(bias)
    m = fdw.nn.GroupedLinear(E, K, N, bias=bias)
    m.load_state_dict(sd, strict=True)
    assert set(m.state_dict()) == set(sd)
    ws = [sd[f"weight{e}"] for e in range(E)]
    bs = [sd[f"bias{e}"] for e in range(E)] if bias else None
    x = torch.randn(T, K)
    y = m(x, SPLITS)
    assert_same(y, fdw.grouped_linear(x, ws, SPLITS, bs))
    ref = ref_grouped(x.double(), [w.double() for w in ws], SPLITS, None if bs is None else [b.double() for b in bs])
    assert_close(y, ref, torch.float32)


def test_a_corrupt_extra_state_is_refused():
    """TE's FP8 extra state is loaded (tests/test_fp8_nn.py); bytes that are no pickle raise."""
    import pickle

    sd = {**te_linear_state_dict(), "_extra_state": torch.ones(3, dtype=torch.uint8)}
    with pytest.raises(pickle.UnpicklingError):
        fdw.nn.Linear(K, N).load_state_dict(sd, strict=True)


def test_no_bias_means_no_bias_parameters():
    lin, grp = fdw.nn.Linear(K, N, bias=False), fdw.nn.GroupedLinear(E, K, N, bias=False)
    assert lin.bias is None and [n for n, _ in lin.named_parameters()] == ["weight"]
    assert "bias" not in lin.state_dict()
    assert [n for n, _ in grp.named_parameters()] == [f"weight{e}" for e in range(E)]
    assert "bias0" not in grp.state_dict() and grp.biases() is None


def _reference_grads(params, run):
    """Grads of the same loss through plain torch ops, on float64 copies of the parameters."""
    copies = [p.detach().double().requires_grad_() for p in params]
    run(copies).backward()
    return [c.grad for c in copies]


def test_linear_forward_and_grads():
    m = fdw.nn.Linear(K, N)
    x = torch.randn(5, K)
    dy = torch.randn(5, N)
    (m(x) * dy).sum().backward()
    want = _reference_grads([m.weight, m.bias], lambda p: (F.linear(x.double(), *p) * dy.double()).sum())
    for p, g in zip([m.weight, m.bias], want):
        assert p.grad is not None and p.grad.shape == p.shape
        assert_close(p.grad, g, torch.float32)


@pytest.mark.parametrize("use_grouped_tensor", [False, None], ids=["split", "default"])
def test_grouped_forward_and_grads(use_grouped_tensor):
    rec = PathRecorder()
    m = fdw.nn.GroupedLinear(E, K, N, use_grouped_tensor=use_grouped_tensor, backend=rec)
    x = torch.randn(T, K)
    dy = torch.randn(T, N)
    y = m(x, torch.tensor(SPLITS))
    params = [*m.weights(), *m.biases()]
    assert_close(
        y,
        ref_grouped(x.double(), [p.double() for p in params[:E]], SPLITS, [p.double() for p in params[E:]]),
        torch.float32,
    )
    (y * dy).sum().backward()
    want = _reference_grads(params, lambda p: (ref_grouped(x.double(), p[:E], SPLITS, p[E:]) * dy.double()).sum())
    for name, p, g in zip([f"weight{e}" for e in range(E)] + [f"bias{e}" for e in range(E)], params, want):
        assert p.grad is not None, name
        assert_close(p.grad, g, torch.float32, name)
    assert not m.weight1.grad.any() and not m.bias1.grad.any(), "expert 1 got no tokens"
    rec.check(use_grouped_tensor, x, m.weights())


def test_fused_wgrad_accumulates_into_main_grad():
    lin = fdw.nn.Linear(K, N, fuse_wgrad_accumulation=True)
    grp = fdw.nn.GroupedLinear(E, K, N, fuse_wgrad_accumulation=True)
    for w in [lin.weight, *grp.weights()]:
        w.main_grad = torch.zeros_like(w, dtype=torch.float32)
    x, xg = torch.randn(5, K), torch.randn(T, K)
    for _ in range(2):
        lin(x).sum().backward()
        grp(xg, SPLITS).sum().backward()
    dw = _reference_grads([lin.weight], lambda p: F.linear(x.double(), p[0]).sum())[0]
    assert_close(lin.weight.main_grad, 2 * dw, torch.float32)
    assert lin.weight.grad is None, "fused dW goes to main_grad, not .grad"
    assert_close(lin.bias.grad, torch.full((N,), 2.0 * 5), torch.float32)
    dws = _reference_grads(grp.weights(), lambda p: ref_grouped(xg.double(), p, SPLITS).sum())
    for e, (w, g) in enumerate(zip(grp.weights(), dws)):
        assert w.grad is None
        assert_close(w.main_grad, 2 * g, torch.float32, f"weight{e}.main_grad")


def test_output_made_by_a_reshape_inside_forward_can_be_modified_in_place():
    """NOTE: [Outputs made inside fwd are not views]: Linear's [B, S, N] output is a reshape of
    the GEMM's [B*S, N]; handed out as that view, autograd refused ``y += r`` ("a view created
    inside a custom Function"). Now it is a tensor of its own (no copy) and the grads are right."""
    m = fdw.nn.Linear(K, N)
    x = torch.randn(2, 3, K, requires_grad=True)
    r, dy = torch.randn(2, 3, N), torch.randn(2, 3, N)
    y = m(x)
    assert not y._is_view()
    y += r
    F.relu(y, inplace=True)
    (y * dy).sum().backward()
    want = _reference_grads([x, m.weight, m.bias], lambda p: (F.relu(F.linear(*p) + r.double()) * dy.double()).sum())
    for name, p, g in zip(["x", "weight", "bias"], [x, m.weight, m.bias], want):
        assert_close(p.grad, g, torch.float32, name)


def test_a_view_of_an_input_returned_by_fwd_keeps_torchs_rule():
    """An output that views an input keeps autograd's view rule (in place on it is refused),
    and an input returned as it is becomes a view of it: only views of fwd's own tensors are
    handed out view-free."""
    from functional_dw import custom_vjp

    f = custom_vjp(lambda x: (x[:2], ()), lambda res, d: (torch.cat([d, d.new_zeros(1)]),), name="head")
    x = torch.randn(3, requires_grad=True)
    y = f(x * 1)
    assert y._is_view()
    with pytest.raises(RuntimeError, match="view"):
        y.add_(1)


def test_compiled_output_made_by_a_reshape_can_be_modified_in_place():
    """The same under torch.compile(fullgraph=True): dynamo refused the in-place add on the
    traced output ("a view created inside a custom Function")."""
    m = fdw.nn.Linear(K, N)
    x = torch.randn(2, 3, K)
    r = torch.randn(2, 3, N)

    def step(x):
        y = m(x)
        y += r
        return y

    torch._dynamo.reset()
    y = torch.compile(step, fullgraph=True)(x)
    y.sum().backward()
    assert_close(y, F.linear(x.double(), m.weight.double(), m.bias.double()) + r.double(), torch.float32)
    assert_close(
        m.weight.grad, _reference_grads([m.weight], lambda p: F.linear(x.double(), p[0]).sum())[0], torch.float32
    )


# --- sizes: zero in_features, numpy ints, as torch.nn takes them -------------------------------


def test_zero_in_features_like_torch():
    lin = fdw.nn.Linear(0, 4)
    ref = torch.nn.Linear(0, 4)
    y = lin(torch.randn(3, 0))
    assert y.shape == ref(torch.randn(3, 0)).shape == (3, 4)
    torch.testing.assert_close(y, lin.bias.expand(3, 4))
    g = fdw.nn.GroupedLinear(2, 0, 4)
    assert g(torch.randn(3, 0), [1, 2]).shape == (3, 4)


def test_nn_sizes_take_numpy_ints_like_torch():
    lin, grp = fdw.nn.Linear(np.int64(16), np.int32(8)), fdw.nn.GroupedLinear(np.int64(4), 16, np.int64(8))
    assert (
        lin.weight.shape == (8, 16)
        and type(grp.num_gemms) is int
        and grp(torch.randn(6, 16), [2, 0, 3, 1]).shape == (6, 8)
    )
