"""A catalogue of invalid inputs: each gets a specific exception type and a message naming the
offending argument. NaN/Inf are data, not errors: they pass through to the output."""

from __future__ import annotations

import types

import pytest
import torch

import functional_dw as fdw
from conftest import FakeDW, PathRecorder
from functional_dw.kernels import te_available

T, K, N, E = 6, 4, 8, 3
SPLITS = [2, 1, 3]
f64, i32 = torch.float64, torch.int32


def t(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype) if dtype.is_floating_point else torch.ones(*shape, dtype=dtype)


def ws(*shapes):
    return [t(*s).requires_grad_() for s in shapes or [(N, K)] * E]


def G(x=None, weights=None, splits=SPLITS, bias=None, **kw):  # grouped_linear with valid defaults
    return fdw.grouped_linear(t(T, K) if x is None else x, weights if weights is not None else ws(), splits, bias, **kw)


def L(x=None, weight=None, bias=None, **kw):  # linear with valid defaults
    return fdw.linear(t(T, K) if x is None else x, ws((N, K))[0] if weight is None else weight, bias, **kw)


class CountMismatchDW(FakeDW):
    def materialize_group_for_forward(self):
        return [self.full, self.full]  # two tensors for a group of one


class BadShapeBackwardDW(FakeDW):
    def materialize_group_for_backward(self, **kwargs):
        return [m.full[:, :-1] for m in self.group]  # [N, K-1]: not the [N, K] forward used


class FinalizeError(Exception):
    pass


class RaisingFinalizeDW(FakeDW):
    def finalize_group_grads(self, wgrads):
        raise FinalizeError("raised by finalize_group_grads")


class WrongDtypeDW(FakeDW):
    def materialize_group_for_forward(self):
        return [m.full.double() for m in self.group]


class NarrowForwardDW(FakeDW):
    def materialize_group_for_forward(self):
        return [m.full[:, :-1] for m in self.group]


class NoneDW(FakeDW):
    def materialize_group_for_forward(self):
        return [None for m in self.group]


class BackwardDtypeDW(FakeDW):
    def materialize_group_for_backward(self, **kwargs):
        return [m.full.half() for m in self.group]


class FinalizeShapeDW(FakeDW):
    def finalize_group_grads(self, wgrads):
        return [g[:, :-1] for g in (wgrads if isinstance(wgrads, list) else [wgrads])]


class FinalizeStringDW(FakeDW):
    def finalize_group_grads(self, wgrads):
        return ["grad" for _ in self.group]


NOT_A_TENSOR_DW = types.SimpleNamespace(is_distributed_weight=True)
NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="a device mismatch needs CUDA")
HAS_TE = pytest.mark.skipif(te_available(), reason="Transformer Engine is installed")

FORWARD = [  # id, call, exception, message (regex)
    ("splits-sum", lambda: G(splits=[2, 1, 2]), ValueError, "splits sum to 5 but x has 6 rows"),
    ("splits-negative", lambda: G(splits=[4, -1, 3]), ValueError, "splits must be non-negative"),
    ("splits-negative-tensor", lambda: G(splits=torch.tensor([4, -1, 3])), ValueError, "splits must be non-negative"),
    ("splits-count", lambda: G(splits=[3, 3]), ValueError, "splits has 2 entries but there are 3 experts"),
    ("splits-float-tensor", lambda: G(splits=torch.tensor([2.0, 1, 3])), TypeError, "splits tensor must be 1-D int"),
    ("splits-2d-tensor", lambda: G(splits=torch.tensor([SPLITS])), TypeError, "splits tensor must be 1-D int"),
    ("splits-str", lambda: G(splits="213"), TypeError, "splits must be a list/tuple of ints"),
    ("splits-float-list", lambda: G(splits=[2.0, 1.0, 3.0]), TypeError, r"splits\[0\] is 2.0 \(float\); each count must be an int"),
    ("splits-bool-element", lambda: G(splits=[2, True, 3]), TypeError, r"splits\[1\] is True \(bool\)"),
    ("splits-0d-tensor-element", lambda: G(splits=[2, 1, torch.tensor(3)]), TypeError, r"splits\[2\] is a tensor"),
    ("splits-none-element", lambda: G(splits=[2, None, 3]), TypeError, r"splits\[1\] is None \(NoneType\)"),
    ("splits-meta-tensor", lambda: G(splits=torch.tensor(SPLITS, device="meta")), ValueError, "splits is a tensor on the meta device"),
    ("splits-0d-tensor", lambda: G(splits=torch.tensor(6)), TypeError, "splits tensor must be 1-D int"),
    ("splits-generator", lambda: G(splits=(s for s in SPLITS)), TypeError, "splits must be a list/tuple of ints"),
    ("splits-fake-tensor", lambda: fake_splits(), ValueError, "splits is a fake tensor"),
    ("splits-set", lambda: G(splits={2, 1, 3}), TypeError, "splits must be a list/tuple of ints or a 1-D integer tensor, got set"),
    ("splits-dict", lambda: G(splits={0: 2, 1: 1, 2: 3}), TypeError, "splits must be a list/tuple of ints .* got dict"),
    ("splits-sparse-tensor", lambda: G(splits=torch.tensor(SPLITS).to_sparse()), TypeError, "splits must be a dense tensor"),
    ("weights-set", lambda: G(weights=set(ws())), TypeError, "weights must be a non-empty sequence .* got set"),
    ("weights-parameter-dict", lambda: G(weights=torch.nn.ParameterDict({"a": torch.nn.Parameter(t(N, K))})), TypeError,
     "weights must be a non-empty sequence .* got ParameterDict"),
    ("dw-forward-shape", lambda: L(weight=NarrowForwardDW(t(N, K))), ValueError,
     r"x has 4 features but weight is \[8, 3\] \(as materialize_group_for_forward\(\) of the DistributedWeight returned it\)"),
    ("custom-vjp-none-output", lambda: fdw.custom_vjp(lambda x: ((None,), ()), lambda r, d: (d,), name="f")(t(2).requires_grad_()),
     TypeError, r"custom_vjp\(f\): fwd's output must be tensors"),
    ("fused-under-torch-func", lambda: torch.func.grad(lambda w: L(weight=w, fuse_wgrad_accumulation=True).sum())(t(N, K)),
     ValueError, "fuse_wgrad_accumulation=True writes weight grads into main_grad in place, which torch.func"),
    ("x-sparse", lambda: G(x=t(T, K).to_sparse()), TypeError, "x must be a dense"),
    ("linear-x-sparse-csr", lambda: L(x=t(T, K).to_sparse_csr()), TypeError, "x must be a dense"),
    ("linear-weight-sparse", lambda: L(weight=t(N, K).to_sparse()), TypeError, "weight must be a dense"),
    ("grouped-weights-sparse", lambda: G(weights=[t(N, K), t(N, K).to_sparse(), t(N, K)]), TypeError, r"weights\[1\] must be a dense"),
    ("grouped-bias-sparse", lambda: G(bias=t(E, N).to_sparse()), TypeError, "bias must be a dense"),
    ("grouped-bias-string", lambda: G(bias="bias"), ValueError, "bias must be None, a sequence of 3"),
    ("dw-forward-dtype", lambda: L(weight=WrongDtypeDW(t(N, K))), TypeError,
     r"weight: materialize_group_for_forward\(\) of the DistributedWeight returned a torch.float64 tensor on cpu for weight 0"),
    ("dw-forward-non-tensor", lambda: G(weights=NoneDW.group_of([t(N, K)] * E)), TypeError,
     r"materialize_group_for_forward\(\) of the DistributedWeight returned a NoneType for weight 0"),
    ("nn-grouped-zero-experts", lambda: fdw.nn.GroupedLinear(0, K, N), ValueError, "num_gemms must be an int >= 1, got 0"),
    ("nn-grouped-negative-experts", lambda: fdw.nn.GroupedLinear(-2, K, N), ValueError, "num_gemms must be an int >= 1"),
    ("nn-linear-negative-in", lambda: fdw.nn.Linear(-1, N), ValueError, "in_features must be an int >= 0, got -1"),
    ("nn-grouped-float-out", lambda: fdw.nn.GroupedLinear(E, K, 8.0), TypeError, r"out_features must be an int, got 8.0 \(float\)"),
    ("custom-vjp-bare-tensor", lambda: fdw.custom_vjp(lambda x: x, lambda r, d: (d,), name="f")(t(2).requires_grad_()),
     TypeError, r"custom_vjp\(f\): fwd must return a pair \(out, residuals\)"),
    ("linear-in-features", lambda: L(x=t(T, K + 1)), ValueError, "x has 5 features but weight is"),
    ("grouped-in-features", lambda: G(x=t(T, K + 1)), ValueError, "x has 5 features but the weights are"),
    ("linear-dtype", lambda: L(x=t(T, K, dtype=f64)), TypeError, "weight has dtype"),
    ("grouped-dtype", lambda: G(x=t(T, K, dtype=f64)), TypeError, r"weights\[0\] has dtype"),
    ("linear-0d-x", lambda: L(x=torch.tensor(1.0)), ValueError, "x must be 1-D"),
    ("grouped-1d-x", lambda: G(x=t(K)), ValueError, "x must be 2-D"),
    ("grouped-3d-x", lambda: G(x=t(2, 3, K)), ValueError, "x must be 2-D"),
    ("linear-int-x", lambda: L(x=t(T, K, dtype=torch.int64)), TypeError, "x must be float32"),
    ("linear-int-weight", lambda: L(weight=t(N, K, dtype=i32)), TypeError, "weight must be float32"),
    ("grouped-int-x", lambda: G(x=t(T, K, dtype=i32)), TypeError, "x must be float32"),
    ("grouped-int-weights", lambda: G(weights=[t(N, K, dtype=i32)] * E), TypeError, r"weights\[0\] must be float32"),
    ("linear-bias-shape", lambda: L(bias=t(N + 1)), ValueError, r"bias must have shape \(8,\)"),
    ("linear-bias-dtype", lambda: L(bias=t(N, dtype=f64)), TypeError, "bias has dtype"),
    ("grouped-bias-shape", lambda: G(bias=t(E, N + 1)), ValueError, r"bias must have shape \(3, 8\)"),
    ("grouped-bias-list-length", lambda: G(bias=[t(N)] * 2), ValueError, "bias must be None, a sequence of 3"),
    ("grouped-bias-list-element", lambda: G(bias=[t(N), t(N + 1), t(N)]), ValueError, r"bias\[1\] must have shape"),
    ("grouped-bias-dtype", lambda: G(bias=t(E, N, dtype=f64)), TypeError, "bias has dtype"),
    ("weights-empty", lambda: G(weights=[]), TypeError, "weights must be a non-empty sequence"),
    ("weights-ragged", lambda: G(weights=ws((N, K), (N, K + 1), (N, K))), ValueError, r"weights\[1\] is \(8, 5\)"),
    ("weights-2d-tensor", lambda: G(weights=t(N, K)), ValueError, "weights must be 3-D"),
    ("linear-non-tensor-dw", lambda: L(weight=NOT_A_TENSOR_DW), TypeError, "weight must be a torch.Tensor"),
    ("grouped-non-tensor-dw", lambda: G(weights=[NOT_A_TENSOR_DW] * E), TypeError, r"weights\[0\] must be a torch"),
    ("is-dw-non-tensor", lambda: fdw.is_distributed_weight(NOT_A_TENSOR_DW), TypeError, "must be a torch.Tensor sub"),
    ("dw-forward-count", lambda: L(weight=CountMismatchDW(t(N, K))), ValueError,
     r"materialize_group_for_forward\(\) .* returned 2 tensor\(s\) for a group of 1"),
    ("use-grouped-tensor-int", lambda: G(use_grouped_tensor=1), TypeError, "use_grouped_tensor must be a bool"),
    ("fuse-int", lambda: L(fuse_wgrad_accumulation=1), TypeError, "fuse_wgrad_accumulation must be a bool"),
    ("backend-nonsense", lambda: L(backend="nonsense"), ValueError, "backend must be None, 'auto', 'torch', 'te'"),
    ("backend-te-on-cpu", lambda: L(backend="te"), ValueError, r"pip install .*backend='torch'", HAS_TE),
    ("backend-int", lambda: L(backend=3), (TypeError, ValueError), "backend"),
    ("device-mismatch", lambda: L(x=t(T, K).cuda(), backend="torch"), ValueError, "weight is on cpu but x is on cuda",
     NO_CUDA),
]


@pytest.mark.parametrize("call, exc, match", [pytest.param(*c[1:4], id=c[0], marks=c[4:]) for c in FORWARD])
def test_forward_rejects(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def stale(layer):
    w = ws() if layer is G else ws((N, K))
    loss = (G(weights=w) if layer is G else L(weight=w[0])).sum()
    with torch.no_grad():  # what an optimizer step does (`w.data.add_` is invisible to the check)
        w[-1].add_(1)
    return loss


def main_grad_too_big():
    w = ws((N, K))[0]
    w.main_grad = torch.zeros(2, N, K)  # add_ broadcasts dW [N, K] into both halves without complaint
    return L(weight=w, fuse_wgrad_accumulation=True).sum()



BACKWARD = [  # id, make the loss (forward succeeds), exception at backward, message
    ("linear-no-main-grad", lambda: L(fuse_wgrad_accumulation=True).sum(), ValueError, "needs a `main_grad` buffer"),
    ("grouped-no-main-grad", lambda: G(fuse_wgrad_accumulation=True).sum(), ValueError, "needs a `main_grad` buffer"),
    ("dw-backward-shape", lambda: L(weight=BadShapeBackwardDW(t(N, K))).sum(), ValueError,
     r"materialize_group_for_backward\(\) returned \(8, 3\) for weight 0, expected \(8, 4\)"),
    ("grouped-dw-backward-shape", lambda: G(weights=BadShapeBackwardDW.group_of([t(N, K)] * E)).sum(), ValueError,
     r"materialize_group_for_backward\(\) returned \(8, 3\)"),
    ("dw-finalize-raises", lambda: L(weight=RaisingFinalizeDW(t(N, K))).sum(), FinalizeError, "raised by finalize"),
    ("linear-weight-modified", lambda: stale(L), RuntimeError, "modified in place between forward and backward"),
    ("grouped-weight-modified", lambda: stale(G), RuntimeError, r"weights\[2\] was modified in place"),
    ("main-grad-wrong-shape", main_grad_too_big, ValueError, "main_grad"),
    ("main-grad-overlapping", lambda: overlapping_main_grad(), ValueError,
     r"weights: main_grad/grad_buffer\(\) has elements that share memory \(e\.g\. an expand\); "
     "each weight-gradient element needs its own$"),
    ("main-grad-int", lambda: int_main_grad(), TypeError, r"weight: main_grad/grad_buffer\(\) is torch.int64; it must be a float"),
    ("dw-backward-dtype", lambda: G(weights=BackwardDtypeDW.group_of([t(N, K)] * E)).sum(), TypeError,
     r"materialize_group_for_backward\(\) of the DistributedWeight returned a torch.float16 tensor"),
    ("dw-finalize-shape", lambda: L(weight=FinalizeShapeDW(t(N, K))).sum(), ValueError,
     r"finalize_group_grads returned \(8, 3\) on cpu for weight 0; each grad must be None or a tensor shaped like that parameter \(\(4, 4\)"),
    ("main-grad-mixed-dtypes", lambda: mixed_main_grads(), TypeError,
     r"weights\[1\]: main_grad is torch.float64 but another weight's is torch.bfloat16"),
    ("dw-finalize-strings", lambda: G(weights=FinalizeStringDW.group_of([t(N, K)] * E)).sum(), ValueError,
     r"finalize_group_grads returned a str for weight 0"),
]


def mixed_main_grads():
    w = ws()
    for p, dt in zip(w, (torch.bfloat16, torch.float64, torch.float32)):
        p.main_grad = torch.zeros(N, K, dtype=dt)
    return G(weights=w, fuse_wgrad_accumulation=True).sum()


def overlapping_main_grad():
    w = t(E, N, K).requires_grad_()
    w.main_grad = torch.zeros(1, N, K).expand(E, N, K)  # every expert's dW into one matrix
    return G(weights=w, fuse_wgrad_accumulation=True).sum()


def fake_splits():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        return G(x=torch.randn(T, K), weights=torch.randn(E, N, K), splits=torch.tensor(SPLITS))


def int_main_grad():
    w = ws((N, K))[0]
    w.main_grad = torch.zeros(N, K, dtype=torch.int64)
    return L(weight=w, fuse_wgrad_accumulation=True).sum()


def _pure(layer):
    if layer == "linear":
        return fdw.linear_fwd(t(T, K), ws((N, K))[0]) + (fdw.linear_bwd,)
    return fdw.grouped_linear_fwd(t(T, K), ws(), SPLITS) + (fdw.grouped_linear_bwd,)


PURE = [  # id, layer, make the bad (res, dy) from the good ones, exception, message
    ("dy-none", lambda res, y: (res, None), TypeError, r"dy must be a \[6, 8\] float32 tensor \(the output's shape and dtype\), got NoneType"),
    ("dy-shape", lambda res, y: (res, y[:, :-1]), ValueError, r"dy must be a \[6, 8\] float32 tensor .* got shape \(6, 7\)"),
    ("dy-rank", lambda res, y: (res, y[None]), ValueError, r"dy must be .* got shape \(1, 6, 8\)"),
    ("dy-dtype", lambda res, y: (res, y.double()), TypeError, r"dy must be .* got dtype torch.float64"),
    ("dy-numpy", lambda res, y: (res, y.detach().numpy()), TypeError, r"dy must be .* got ndarray"),
    ("dy-sparse", lambda res, y: (res, y.detach().to_sparse()), TypeError, r"dy must be a dense"),
    ("res-none", lambda res, y: (None, y), TypeError, r"takes the (Grouped)?LinearResiduals that .*, got NoneType"),
    ("res-other-layer", lambda res, y: (_pure("grouped" if "Grouped" not in type(res).__name__ else "linear")[1], y),
     TypeError, r"_bwd(_dgrad|_wgrad)? takes the (Grouped)?LinearResiduals that (grouped_)?linear_fwd returned, got (Grouped)?LinearResiduals"),
]


@pytest.mark.parametrize("layer", ["linear", "grouped"])
@pytest.mark.parametrize("make, exc, match", [pytest.param(*c[1:4], id=c[0]) for c in PURE])
def test_pure_bwd_rejects(layer, make, exc, match):
    y, res, bwd = _pure(layer)
    bad_res, bad_dy = make(res, torch.ones_like(y))
    for fn in (bwd, *((fdw.linear_bwd_dgrad, fdw.linear_bwd_wgrad) if layer == "linear"
                      else (fdw.grouped_linear_bwd_dgrad, fdw.grouped_linear_bwd_wgrad))):
        with pytest.raises(exc, match=match):
            fn(bad_res, bad_dy)


@pytest.mark.parametrize("make_loss, exc, match", [pytest.param(*c[1:4], id=c[0], marks=c[4:]) for c in BACKWARD])
def test_backward_rejects(make_loss, exc, match):
    loss = make_loss()
    with pytest.raises(exc, match=match):
        loss.backward()


@pytest.mark.parametrize("use_grouped_tensor", [False, True], ids=["split", "grouped"])
def test_nan_and_inf_pass_through_row_by_row(use_grouped_tensor):
    x = t(T, 2 * K)  # 8 float32 features: 16-byte rows, so the grouped path can run
    x[1, 3] = float("nan")  # row 1: expert 0 (splits [2, 1, 3])
    x[4, 0] = float("inf")  # row 4: expert 2
    w = [torch.rand(N, 2 * K) + 0.5 for _ in range(E)]  # positive, so inf * w stays inf
    rec = PathRecorder()
    y = fdw.grouped_linear(x, w, SPLITS, use_grouped_tensor=use_grouped_tensor, backend=rec)
    rec.check(use_grouped_tensor, x, w)
    assert torch.isnan(y[1]).all() and torch.isinf(y[4]).all() and not torch.isnan(y[4]).any()
    clean = [0, 2, 3, 5]
    assert torch.isfinite(y[clean]).all(), "NaN/Inf leaked into other rows"
    torch.testing.assert_close(y[clean], torch.cat([x[r:r + 1] @ w[e].T for r, e in zip(clean, [0, 1, 2, 2])]))


# --- inputs that are odd but valid: accepted, and the numbers are right --------------------

def _odd_inputs():
    g = torch.Generator().manual_seed(5)
    base = torch.randn(6, 16, generator=g)
    w = torch.randn(8, 16, generator=g)
    return {
        "x-transposed-view": (base.t().contiguous().t(), [w, w.clone()]),  # non-contiguous x
        "x-expanded-rows": (base[:1].expand(6, 16), [w, w.clone()]),  # overlapping memory, stride 0
        "weights-aliased": (base, [w, w]),  # the same tensor for both experts
        "weight-transposed-view": (base, [w.t().contiguous().t(), w.clone()]),
    }


@pytest.mark.parametrize("case", list(_odd_inputs()))
@pytest.mark.parametrize("path", [False, True], ids=["split", "grouped"])
def test_odd_but_valid_inputs_are_computed_right(case, path):
    x, ws = _odd_inputs()[case]
    ws = [w.requires_grad_() if not w.requires_grad else w for w in ws]
    x = x.requires_grad_() if x.is_leaf else x
    splits = [2, 4]
    rec = PathRecorder()
    y = fdw.grouped_linear(x, ws, splits, use_grouped_tensor=path, backend=rec)
    ref = torch.cat([xe @ w.t() for xe, w in zip(x.split(splits), ws)])
    torch.testing.assert_close(y, ref)
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, [x, *dict.fromkeys(ws)], dy)
    want = torch.autograd.grad(ref, [x, *dict.fromkeys(ws)], dy)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    rec.check(path, x, ws)


# --- module state dict loads
# A GroupedLinear loads the other layout's keys (TE's weight0.. into one stacked weight, and
# back); an expert missing or mis-shaped, or a stacked tensor of the wrong shape, is named
# with its shape and the expected one.

def _grouped_sd(single=False):
    return fdw.nn.GroupedLinear(E, K, N, single_grouped_weight=single).state_dict()


def _drop(sd, key):
    return {k: v for k, v in sd.items() if k != key}


STATE_DICT_LOADS = {  # name: (into single_grouped_weight?, the state dict, the message)
    "expert-weight-missing": (True, lambda: _drop(_grouped_sd(), "weight1"),
                              r"weight1 is missing; each expert's shape is \(8, 4\)"),
    "expert-weight-mis-shaped": (True, lambda: {**_grouped_sd(), "weight2": t(N, K + 1)},
                                 r"weight2 has shape \(8, 5\); each expert's shape is \(8, 4\)"),
    "expert-weight-not-a-tensor": (True, lambda: {**_grouped_sd(), "weight0": [1.0]}, r"weight0 is a list"),
    "expert-bias-missing": (True, lambda: _drop(_grouped_sd(), "bias0"), r"into bias of shape \(3, 8\): bias0 is missing"),
    "expert-bias-mis-shaped": (True, lambda: {**_grouped_sd(), "bias1": t(N + 1)},
                               r"bias1 has shape \(9,\); each expert's shape is \(8,\)"),
    "stacked-weight-experts": (False, lambda: {**_grouped_sd(True), "weight": t(E + 1, N, K)},
                               r"weight has shape \(4, 8, 4\), expected \(3, 8, 4\)"),
    "stacked-weight-mis-shaped": (False, lambda: {**_grouped_sd(True), "weight": t(E, K, N)},
                                  r"weight has shape \(3, 4, 8\), expected \(3, 8, 4\)"),
    "stacked-bias-mis-shaped": (False, lambda: {**_grouped_sd(True), "bias": t(E, N + 1)},
                                r"bias has shape \(3, 9\), expected \(3, 8\)"),
}


@pytest.mark.parametrize("nested", [False, True], ids=["", "nested"])
@pytest.mark.parametrize("case", list(STATE_DICT_LOADS))
def test_grouped_linear_load_names_the_bad_key_of_the_other_layout(case, nested):
    single, make, message = STATE_DICT_LOADS[case]
    m = fdw.nn.GroupedLinear(E, K, N, single_grouped_weight=single)
    sd = make()
    if nested:  # keys under a prefix are named with it
        m, sd = torch.nn.Sequential(m), {f"0.{k}": v for k, v in sd.items()}
        message = message.replace("weight", "0.weight").replace("bias", "0.bias")
    for strict in (True, False):
        with pytest.raises(RuntimeError, match=message):
            m.load_state_dict(sd, strict=strict)


# --- full state dict loads
# distributed.load_full_state_dict into an unsharded model: a tensor not of its parameter's or
# buffer's full shape raises ValueError (key, both shapes), a missing or unexpected key (after
# nn.remap_layouts) RuntimeError under strict=True; either before anything is loaded.

def _full_sd_model(single=False):
    return fdw.nn.GroupedLinear(E, K, N, single_grouped_weight=single)


def _full_sd(single=False, drop=(), **extra):
    sd = {k: v for k, v in _full_sd_model(single).state_dict().items() if k not in drop}
    return {**sd, **extra}


FULL_STATE_DICT_LOADS = {  # name: (the model, the state dict, the error, the message)
    "weight-rows": (_full_sd_model, lambda: _full_sd(weight1=t(N + 2, K)), ValueError,
                    r"weight1: expected full shape \[8, 4\], given \[10, 4\]"),
    "stacked-weight": (lambda: _full_sd_model(True), lambda: _full_sd(True, weight=t(E, N - 2, K)), ValueError,
                       r"weight: expected full shape \[3, 8, 4\], given \[3, 6, 4\]"),
    "not-a-tensor": (_full_sd_model, lambda: _full_sd(bias0=[1.0]), ValueError,
                     r"bias0: expected full shape \[8\], given a list"),
    "buffer": (lambda: torch.nn.BatchNorm1d(K), lambda: {**torch.nn.BatchNorm1d(K).state_dict(), "running_mean": t(K + 1)},
               ValueError, r"running_mean: expected full shape \[4\], given \[5\]"),
    "missing-key": (_full_sd_model, lambda: _full_sd(drop=["bias2"]), RuntimeError,
                    r'Missing key\(s\) in state_dict: "bias2"\.'),
    "missing-extra-state": (_full_sd_model, lambda: _full_sd(drop=["_extra_state"]), RuntimeError,
                            r'Missing key\(s\) in state_dict: "_extra_state"\.'),
    "unexpected-key": (_full_sd_model, lambda: _full_sd(weight3=t(N, K)), RuntimeError,
                       r'Unexpected key\(s\) in state_dict: "weight3"\.'),
    "expert-missing-into-stacked": (lambda: _full_sd_model(True), lambda: _full_sd(drop=["weight1"]), ValueError,
                                    r"cannot stack the per-expert weight0\.\.weight2 into weight of shape \(3, 8, 4\): "
                                    r"weight1 is missing"),
}


@pytest.mark.parametrize("case", list(FULL_STATE_DICT_LOADS))
def test_load_full_state_dict_names_what_does_not_fit_before_loading(case):
    from functional_dw.distributed import load_full_state_dict

    model, make, error, message = FULL_STATE_DICT_LOADS[case]
    m, sd = model(), make()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    for strict in (True, False) if error is ValueError else (True,):
        with pytest.raises(error, match=message):
            load_full_state_dict(m, sd, strict=strict)
    assert all(torch.equal(v, before[k]) for k, v in m.state_dict().items()), "a load that raised changed the model"
