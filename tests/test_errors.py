"""A catalogue of invalid inputs: each gets a specific exception type and a message naming the
offending argument. NaN/Inf are data, not errors: they pass through to the output. Nested,
sparse and subclassed weights are named by the checks' fast paths as by their loops, and a
catalogue of messages is held to its full text (ERROR_CASES)."""

from __future__ import annotations

import functools
import importlib
import types

import pytest
import torch

import functional_dw as fdw
from conftest import FakeDW, PathRecorder
from functional_dw.distributed_weight import check_materialized
from functional_dw.kernels import te_available
from helpers import grouped_inputs, randn

gl_mod = importlib.import_module("functional_dw.grouped_linear")  # the modules (the package's names are the functions)
lin_mod = importlib.import_module("functional_dw.linear")

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
    (
        "splits-float-list",
        lambda: G(splits=[2.0, 1.0, 3.0]),
        TypeError,
        r"splits\[0\] is 2.0 \(float\); each count must be an int",
    ),
    ("splits-bool-element", lambda: G(splits=[2, True, 3]), TypeError, r"splits\[1\] is True \(bool\)"),
    ("splits-0d-tensor-element", lambda: G(splits=[2, 1, torch.tensor(3)]), TypeError, r"splits\[2\] is a tensor"),
    ("splits-none-element", lambda: G(splits=[2, None, 3]), TypeError, r"splits\[1\] is None \(NoneType\)"),
    (
        "splits-meta-tensor",
        lambda: G(splits=torch.tensor(SPLITS, device="meta")),
        ValueError,
        "splits is a tensor on the meta device",
    ),
    ("splits-0d-tensor", lambda: G(splits=torch.tensor(6)), TypeError, "splits tensor must be 1-D int"),
    ("splits-generator", lambda: G(splits=(s for s in SPLITS)), TypeError, "splits must be a list/tuple of ints"),
    ("splits-fake-tensor", lambda: fake_splits(), ValueError, "splits is a fake tensor"),
    (
        "splits-set",
        lambda: G(splits={2, 1, 3}),
        TypeError,
        "splits must be a list/tuple of ints or a 1-D integer tensor, got set",
    ),
    ("splits-dict", lambda: G(splits={0: 2, 1: 1, 2: 3}), TypeError, "splits must be a list/tuple of ints .* got dict"),
    (
        "splits-sparse-tensor",
        lambda: G(splits=torch.tensor(SPLITS).to_sparse()),
        TypeError,
        "splits must be a dense tensor",
    ),
    ("weights-set", lambda: G(weights=set(ws())), TypeError, "weights must be a non-empty sequence .* got set"),
    (
        "weights-parameter-dict",
        lambda: G(weights=torch.nn.ParameterDict({"a": torch.nn.Parameter(t(N, K))})),
        TypeError,
        "weights must be a non-empty sequence .* got ParameterDict",
    ),
    (
        "dw-forward-shape",
        lambda: L(weight=NarrowForwardDW(t(N, K))),
        ValueError,
        r"x has 4 features but weight is \[8, 3\] \(as materialize_group_for_forward\(\) of the DistributedWeight returned it\)",
    ),
    (
        "custom-vjp-none-output",
        lambda: fdw.custom_vjp(lambda x: ((None,), ()), lambda r, d: (d,), name="f")(t(2).requires_grad_()),
        TypeError,
        r"custom_vjp\(f\): fwd's output must be tensors",
    ),
    (
        "fused-under-torch-func",
        lambda: torch.func.grad(lambda w: L(weight=w, fuse_wgrad_accumulation=True).sum())(t(N, K)),
        ValueError,
        "fuse_wgrad_accumulation=True writes weight grads into main_grad in place, which torch.func",
    ),
    ("x-sparse", lambda: G(x=t(T, K).to_sparse()), TypeError, "x must be a dense"),
    ("linear-x-sparse-csr", lambda: L(x=t(T, K).to_sparse_csr()), TypeError, "x must be a dense"),
    ("linear-weight-sparse", lambda: L(weight=t(N, K).to_sparse()), TypeError, "weight must be a dense"),
    (
        "grouped-weights-sparse",
        lambda: G(weights=[t(N, K), t(N, K).to_sparse(), t(N, K)]),
        TypeError,
        r"weights\[1\] must be a dense",
    ),
    ("grouped-bias-sparse", lambda: G(bias=t(E, N).to_sparse()), TypeError, "bias must be a dense"),
    ("grouped-bias-string", lambda: G(bias="bias"), ValueError, "bias must be None, a sequence of 3"),
    (
        "dw-forward-dtype",
        lambda: L(weight=WrongDtypeDW(t(N, K))),
        TypeError,
        r"weight: materialize_group_for_forward\(\) of the DistributedWeight returned a torch.float64 tensor on cpu for weight 0",
    ),
    (
        "dw-forward-non-tensor",
        lambda: G(weights=NoneDW.group_of([t(N, K)] * E)),
        TypeError,
        r"materialize_group_for_forward\(\) of the DistributedWeight returned a NoneType for weight 0",
    ),
    (
        "nn-grouped-zero-experts",
        lambda: fdw.nn.GroupedLinear(0, K, N),
        ValueError,
        "num_gemms must be an int >= 1, got 0",
    ),
    (
        "nn-grouped-negative-experts",
        lambda: fdw.nn.GroupedLinear(-2, K, N),
        ValueError,
        "num_gemms must be an int >= 1",
    ),
    ("nn-linear-negative-in", lambda: fdw.nn.Linear(-1, N), ValueError, "in_features must be an int >= 0, got -1"),
    (
        "nn-grouped-float-out",
        lambda: fdw.nn.GroupedLinear(E, K, 8.0),
        TypeError,
        r"out_features must be an int, got 8.0 \(float\)",
    ),
    (
        "custom-vjp-bare-tensor",
        lambda: fdw.custom_vjp(lambda x: x, lambda r, d: (d,), name="f")(t(2).requires_grad_()),
        TypeError,
        r"custom_vjp\(f\): fwd must return a pair \(out, residuals\)",
    ),
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
    (
        "dw-forward-count",
        lambda: L(weight=CountMismatchDW(t(N, K))),
        ValueError,
        r"materialize_group_for_forward\(\) .* returned 2 tensor\(s\) for a group of 1",
    ),
    ("use-grouped-tensor-int", lambda: G(use_grouped_tensor=1), TypeError, "use_grouped_tensor must be a bool"),
    ("fuse-int", lambda: L(fuse_wgrad_accumulation=1), TypeError, "fuse_wgrad_accumulation must be a bool"),
    ("backend-nonsense", lambda: L(backend="nonsense"), ValueError, "backend must be None, 'auto', 'torch', 'te'"),
    ("backend-te-on-cpu", lambda: L(backend="te"), ValueError, r"pip install .*backend='torch'", HAS_TE),
    ("backend-int", lambda: L(backend=3), (TypeError, ValueError), "backend"),
    (
        "device-mismatch",
        lambda: L(x=t(T, K).cuda(), backend="torch"),
        ValueError,
        "weight is on cpu but x is on cuda",
        NO_CUDA,
    ),
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
    (
        "dw-backward-shape",
        lambda: L(weight=BadShapeBackwardDW(t(N, K))).sum(),
        ValueError,
        r"materialize_group_for_backward\(\) returned \(8, 3\) for weight 0, expected \(8, 4\)",
    ),
    (
        "grouped-dw-backward-shape",
        lambda: G(weights=BadShapeBackwardDW.group_of([t(N, K)] * E)).sum(),
        ValueError,
        r"materialize_group_for_backward\(\) returned \(8, 3\)",
    ),
    ("dw-finalize-raises", lambda: L(weight=RaisingFinalizeDW(t(N, K))).sum(), FinalizeError, "raised by finalize"),
    ("linear-weight-modified", lambda: stale(L), RuntimeError, "modified in place between forward and backward"),
    ("grouped-weight-modified", lambda: stale(G), RuntimeError, r"weights\[2\] was modified in place"),
    ("main-grad-wrong-shape", main_grad_too_big, ValueError, "main_grad"),
    (
        "main-grad-overlapping",
        lambda: overlapping_main_grad(),
        ValueError,
        r"weights: main_grad/grad_buffer\(\) has elements that share memory \(e\.g\. an expand\); "
        "each weight-gradient element needs its own$",
    ),
    (
        "main-grad-int",
        lambda: int_main_grad(),
        TypeError,
        r"weight: main_grad/grad_buffer\(\) is torch.int64; it must be a float",
    ),
    (
        "dw-backward-dtype",
        lambda: G(weights=BackwardDtypeDW.group_of([t(N, K)] * E)).sum(),
        TypeError,
        r"materialize_group_for_backward\(\) of the DistributedWeight returned a torch.float16 tensor",
    ),
    (
        "dw-finalize-shape",
        lambda: L(weight=FinalizeShapeDW(t(N, K))).sum(),
        ValueError,
        r"finalize_group_grads returned \(8, 3\) on cpu for weight 0; each grad must be None or a tensor shaped like that parameter \(\(4, 4\)",
    ),
    (
        "main-grad-mixed-dtypes",
        lambda: mixed_main_grads(),
        TypeError,
        r"weights\[1\]: main_grad is torch.float64 but another weight's is torch.bfloat16",
    ),
    (
        "dw-finalize-strings",
        lambda: G(weights=FinalizeStringDW.group_of([t(N, K)] * E)).sum(),
        ValueError,
        r"finalize_group_grads returned a str for weight 0",
    ),
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
    (
        "dy-none",
        lambda res, y: (res, None),
        TypeError,
        r"dy must be a \[6, 8\] float32 tensor \(the output's shape and dtype\), got NoneType",
    ),
    (
        "dy-shape",
        lambda res, y: (res, y[:, :-1]),
        ValueError,
        r"dy must be a \[6, 8\] float32 tensor .* got shape \(6, 7\)",
    ),
    ("dy-rank", lambda res, y: (res, y[None]), ValueError, r"dy must be .* got shape \(1, 6, 8\)"),
    ("dy-dtype", lambda res, y: (res, y.double()), TypeError, r"dy must be .* got dtype torch.float64"),
    ("dy-numpy", lambda res, y: (res, y.detach().numpy()), TypeError, r"dy must be .* got ndarray"),
    ("dy-sparse", lambda res, y: (res, y.detach().to_sparse()), TypeError, r"dy must be a dense"),
    ("res-none", lambda res, y: (None, y), TypeError, r"takes the (Grouped)?LinearResiduals that .*, got NoneType"),
    (
        "res-other-layer",
        lambda res, y: (_pure("grouped" if "Grouped" not in type(res).__name__ else "linear")[1], y),
        TypeError,
        r"_bwd(_dgrad|_wgrad)? takes the (Grouped)?LinearResiduals that (grouped_)?linear_fwd returned, got (Grouped)?LinearResiduals",
    ),
]


@pytest.mark.parametrize("layer", ["linear", "grouped"])
@pytest.mark.parametrize("make, exc, match", [pytest.param(*c[1:4], id=c[0]) for c in PURE])
def test_pure_bwd_rejects(layer, make, exc, match):
    y, res, bwd = _pure(layer)
    bad_res, bad_dy = make(res, torch.ones_like(y))
    for fn in (
        bwd,
        *(
            (fdw.linear_bwd_dgrad, fdw.linear_bwd_wgrad)
            if layer == "linear"
            else (fdw.grouped_linear_bwd_dgrad, fdw.grouped_linear_bwd_wgrad)
        ),
    ):
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
    torch.testing.assert_close(y[clean], torch.cat([x[r : r + 1] @ w[e].T for r, e in zip(clean, [0, 1, 2, 2])]))


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
    "expert-weight-missing": (
        True,
        lambda: _drop(_grouped_sd(), "weight1"),
        r"weight1 is missing; each expert's shape is \(8, 4\)",
    ),
    "expert-weight-mis-shaped": (
        True,
        lambda: {**_grouped_sd(), "weight2": t(N, K + 1)},
        r"weight2 has shape \(8, 5\); each expert's shape is \(8, 4\)",
    ),
    "expert-weight-not-a-tensor": (True, lambda: {**_grouped_sd(), "weight0": [1.0]}, r"weight0 is a list"),
    "expert-bias-missing": (
        True,
        lambda: _drop(_grouped_sd(), "bias0"),
        r"into bias of shape \(3, 8\): bias0 is missing",
    ),
    "expert-bias-mis-shaped": (
        True,
        lambda: {**_grouped_sd(), "bias1": t(N + 1)},
        r"bias1 has shape \(9,\); each expert's shape is \(8,\)",
    ),
    "stacked-weight-experts": (
        False,
        lambda: {**_grouped_sd(True), "weight": t(E + 1, N, K)},
        r"weight has shape \(4, 8, 4\), expected \(3, 8, 4\)",
    ),
    "stacked-weight-mis-shaped": (
        False,
        lambda: {**_grouped_sd(True), "weight": t(E, K, N)},
        r"weight has shape \(3, 4, 8\), expected \(3, 8, 4\)",
    ),
    "stacked-bias-mis-shaped": (
        False,
        lambda: {**_grouped_sd(True), "bias": t(E, N + 1)},
        r"bias has shape \(3, 9\), expected \(3, 8\)",
    ),
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
    "weight-rows": (
        _full_sd_model,
        lambda: _full_sd(weight1=t(N + 2, K)),
        ValueError,
        r"weight1: expected full shape \[8, 4\], given \[10, 4\]",
    ),
    "stacked-weight": (
        lambda: _full_sd_model(True),
        lambda: _full_sd(True, weight=t(E, N - 2, K)),
        ValueError,
        r"weight: expected full shape \[3, 8, 4\], given \[3, 6, 4\]",
    ),
    "not-a-tensor": (
        _full_sd_model,
        lambda: _full_sd(bias0=[1.0]),
        ValueError,
        r"bias0: expected full shape \[8\], given a list",
    ),
    "buffer": (
        lambda: torch.nn.BatchNorm1d(K),
        lambda: {**torch.nn.BatchNorm1d(K).state_dict(), "running_mean": t(K + 1)},
        ValueError,
        r"running_mean: expected full shape \[4\], given \[5\]",
    ),
    "missing-key": (
        _full_sd_model,
        lambda: _full_sd(drop=["bias2"]),
        RuntimeError,
        r'Missing key\(s\) in state_dict: "bias2"\.',
    ),
    "missing-extra-state": (
        _full_sd_model,
        lambda: _full_sd(drop=["_extra_state"]),
        RuntimeError,
        r'Missing key\(s\) in state_dict: "_extra_state"\.',
    ),
    "unexpected-key": (
        _full_sd_model,
        lambda: _full_sd(weight3=t(N, K)),
        RuntimeError,
        r'Unexpected key\(s\) in state_dict: "weight3"\.',
    ),
    "expert-missing-into-stacked": (
        lambda: _full_sd_model(True),
        lambda: _full_sd(drop=["weight1"]),
        ValueError,
        r"cannot stack the per-expert weight0\.\.weight2 into weight of shape \(3, 8, 4\): "
        r"weight1 is missing",
    ),
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


# --- nested, subclassed and odd weights in the checks' fast paths ------------------------------


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
@pytest.mark.parametrize("pos", [0, 1])
def test_a_nested_weight_is_named(pos):
    # A strided nested tensor has layout torch.strided and no .shape: the fast path (and the
    # slow one) died in torch with "Internal error: NestedTensorImpl doesn't support sizes"
    nt = torch.nested.nested_tensor([torch.randn(5), torch.randn(5)])  # dim() == 2
    ws = [torch.randn(4, 5), torch.randn(4, 5)]
    ws[pos] = nt
    with pytest.raises(TypeError, match=rf"weights\[{pos}\] must be a dense .*nested"):
        fdw.grouped_linear(torch.randn(4, 5), ws, [2, 2])


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_a_nested_x_or_stacked_weight_is_named():
    nt3 = torch.nested.nested_tensor([torch.randn(4, 5), torch.randn(4, 5)])
    with pytest.raises(TypeError, match=r"^weights must be a dense .*nested"):
        fdw.grouped_linear(torch.randn(4, 5), nt3, [2, 2])
    nt2 = torch.nested.nested_tensor([torch.randn(5), torch.randn(5)])
    with pytest.raises(TypeError, match=r"^x must be a dense .*nested"):
        fdw.grouped_linear(nt2, [torch.randn(4, 5)] * 2, [1, 1])


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_check_materialized_names_a_nested_weight():
    nt = torch.nested.nested_tensor([torch.randn(5), torch.randn(5)])
    with pytest.raises(ValueError, match=r"returned a nested tensor for weight 1, expected \(2, 5\)"):
        check_materialized([torch.randn(2, 5), nt], [(2, 5), (2, 5)], "materialize_group_for_backward()")


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_fast_paths_agree_with_the_loops_on_hostile_lists():
    # equivalence of the C-loop checks with the per-expert loops they replaced (errors name the expert)
    x = torch.randn(4, 3)
    P = torch.nn.Parameter
    cases = {
        "dtype": ([torch.randn(5, 3), torch.randn(5, 3, dtype=torch.float64)], TypeError, r"weights\[1\] has dtype"),
        "shape": ([torch.randn(5, 3), torch.randn(6, 3)], ValueError, r"weights\[1\] is \(6, 3\)"),
        "3-D": ([torch.randn(5, 3), torch.randn(1, 5, 3)], ValueError, r"weights\[1\] must be 2-D"),
        "meta": ([P(torch.randn(5, 3)), torch.empty(5, 3, device="meta")], ValueError, r"weights\[1\] is on meta"),
        "sparse": ([torch.randn(5, 3), torch.randn(5, 3).to_sparse()], TypeError, r"weights\[1\] must be a dense"),
        "item": ([torch.randn(5, 3), 3], TypeError, r"weights\[1\] must be a torch.Tensor, got int"),
    }
    for name, (ws, exc, msg) in cases.items():
        with pytest.raises(exc, match=msg):
            fdw.grouped_linear(x, ws, [2, 2])


# --- the pure API: x changed in place; a DistributedWeight's gather in the wrong dtype ---------


def _group(requires_grad=True):
    """x, weights, biases of this file's sizes (seeded; weights / 4)."""
    return grouped_inputs(SPLITS, K, N, w_div=4, dy=False, grad=requires_grad)[:3]


@pytest.mark.parametrize("layer", ["linear", "grouped"])
def test_pure_api_sees_x_modified_in_place(layer):
    x, ws, _ = _group(requires_grad=False)
    y, res = fdw.linear_fwd(x, ws[0]) if layer == "linear" else fdw.grouped_linear_fwd(x, ws, SPLITS)
    bwd = fdw.linear_bwd if layer == "linear" else fdw.grouped_linear_bwd
    bwd(res, torch.ones_like(y))  # fine before the change
    x.mul_(2)
    with pytest.raises(RuntimeError, match=r"x was modified in place between forward and backward \(version 0 -> 1\)"):
        bwd(res, torch.ones_like(y))


def test_dw_materialize_wrong_dtype_names_the_method():
    dws = WrongDtypeDW.group_of([torch.randn(N, K) for _ in range(E)])
    with pytest.raises(
        TypeError,
        match=r"materialize_group_for_forward\(\) of the DistributedWeight returned a torch.float64 tensor on cpu for weight 0",
    ):
        fdw.grouped_linear(torch.randn(T, K), dws, SPLITS)


# --- error messages in full: they name the argument (and the position) and say what to do ------
# (Written to kill mutants of the checks in `bash .ci/mutation`; the messages quote these sizes.)
MSG_SPLITS = (2, 0, 3)
MSG_E, MSG_K, MSG_N, MSG_T = 3, 8, 4, sum(MSG_SPLITS)
D = torch.float64
_rand = functools.partial(randn, dtype=D, draw_dtype=None)  # (drawn in float64)


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
    w = BentDW(_rand(2 * MSG_N, MSG_K, seed=5))  # shard [N, K] of a full [2N, K]
    w.bend = bend
    return w


def _dw_group(fused=False, **bend):
    ws = BentDW.group_of([_rand(2 * MSG_N, MSG_K, seed=5 + e) for e in range(MSG_E)], fused=fused)
    ws[0].bend = bend
    return ws


def _bump(*ts):
    with torch.no_grad():
        for t in ts:
            t.add_(0)


def _lin(w, x=None, bias=None, bump=False, part="bwd", **kw):
    x = _rand(5, MSG_K, seed=7, grad=True) if x is None else x
    y, res = fdw.linear_fwd(x, w, bias, **kw)
    if bump:
        _bump(w)
    fn = {"bwd": fdw.linear_bwd, "dgrad": fdw.linear_bwd_dgrad, "wgrad": fdw.linear_bwd_wgrad}[part]
    return fn(res, torch.ones_like(y))


def _grp(ws, bias=None, bump=None, part="bwd", **kw):
    x = _rand(MSG_T, MSG_K, seed=7, grad=True)
    y, res = fdw.grouped_linear_fwd(x, ws, list(MSG_SPLITS), bias, **kw)
    if bump is not None:
        _bump(*bump)
    fn = {"bwd": fdw.grouped_linear_bwd, "dgrad": fdw.grouped_linear_bwd_dgrad, "wgrad": fdw.grouped_linear_bwd_wgrad}[
        part
    ]
    return fn(res, torch.ones_like(y))


def _with(t, **attrs):
    for k, v in attrs.items():
        setattr(t, k, v)
    return t


def _ws(n=MSG_E, grad=True, **attrs):
    return [_with(_rand(MSG_N, MSG_K, seed=2 + e, grad=grad), **attrs) for e in range(n)]


def _f32(*shape, device="cpu", dtype=torch.float32):
    return torch.zeros(*(shape or (MSG_N, MSG_K)), dtype=dtype, device=device)


def _w(**attrs):
    return _with(_rand(MSG_N, MSG_K, seed=2, grad=True), **attrs)


def _mg_group(*mgs):
    return [_with(w, main_grad=m) for w, m in zip(_ws(), mgs)]


ERROR_CASES = {
    # linear: argument checks
    "linear-x-9d": (
        lambda: fdw.linear(torch.zeros([1] * 8 + [MSG_K], dtype=D), _rand(MSG_N, MSG_K)),
        ValueError,
        "x must be 1-D or 2-D or 3-D or 4-D or 5-D or 6-D or 7-D or 8-D, got shape (1, 1, 1, 1, 1, 1, 1, 1, 8)",
    ),
    "linear-weight-3d": (
        lambda: fdw.linear(_rand(5, MSG_K), _rand(1, MSG_N, MSG_K)),
        ValueError,
        "weight must be 2-D, got shape (1, 4, 8)",
    ),
    "linear-fuse-flag": (
        lambda: fdw.linear_fwd(_rand(5, MSG_K), _rand(MSG_N, MSG_K), fuse_wgrad_accumulation=1),
        TypeError,
        "fuse_wgrad_accumulation must be a bool, got int",
    ),
    "linear-bias-2d": (
        lambda: fdw.linear(_rand(5, MSG_K), _rand(MSG_N, MSG_K), _rand(1, MSG_N)),
        ValueError,
        "bias must be 1-D, got shape (1, 4)",
    ),
    "linear-x-features": (
        lambda: fdw.linear(_rand(5, MSG_K + 1), _rand(MSG_N, MSG_K)),
        ValueError,
        "x has 9 features but weight is [4, 8]: x must be [..., 8]",
    ),
    "linear-x3d-features": (
        lambda: fdw.linear(_rand(2, 5, MSG_K + 1), _rand(MSG_N, MSG_K)),
        ValueError,
        "x has 9 features but weight is [4, 8]: x must be [..., 8]",
    ),
    "linear-dw-x-features": (
        lambda: fdw.linear(_rand(5, MSG_K + 1), _dw()),
        ValueError,
        "x has 9 features but weight is [8, 8] (as materialize_group_for_forward() of the DistributedWeight returned it): x must be [..., 8]",
    ),
    "linear-dw-3d": (
        lambda: fdw.linear(_rand(5, MSG_K), _dw(forward=lambda s: s.full[None])),
        ValueError,
        "weight (materialized) must be 2-D, got shape (1, 8, 8)",
    ),
    "linear-dw-fwd-dtype": (
        lambda: fdw.linear(_rand(5, MSG_K), _dw(forward=lambda s: s.full.float())),
        TypeError,
        "weight: materialize_group_for_forward() of the DistributedWeight returned a torch.float32 tensor on cpu for weight 0; the layer runs in torch.float64 on cpu (x's dtype and device): gather into that",
    ),
    "linear-dw-bwd-dtype": (
        lambda: _lin(_dw(backward=lambda s: s.full.float())),
        TypeError,
        "weight: materialize_group_for_backward() of the DistributedWeight returned a torch.float32 tensor on cpu for weight 0; the layer runs in torch.float64 on cpu (x's dtype and device): gather into that",
    ),
    "linear-dw-bwd-shape": (
        lambda: _lin(_dw(backward=lambda s: s.full[:1])),
        ValueError,
        "weight: materialize_group_for_backward() returned (1, 8) for weight 0, expected (8, 8)",
    ),
    "linear-dw-finalize-count": (
        lambda: _lin(_dw(finalize=lambda s, g: [g, g])),
        ValueError,
        "weight: finalize_group_grads returned 2 grad(s) for 1 weights",
    ),
    "linear-dw-finalize-shape": (
        lambda: _lin(_dw(finalize=lambda s, g: g)),
        ValueError,
        "weight: finalize_group_grads returned (8, 8) on cpu for weight 0; each grad must be None or a tensor shaped like that parameter ((4, 8) on cpu)",
    ),
    "linear-dw-finalize-type": (
        lambda: _lin(_dw(finalize=lambda s, g: [1.0])),
        ValueError,
        "weight: finalize_group_grads returned a float for weight 0; each grad must be None or a tensor shaped like that parameter ((4, 8) on cpu)",
    ),
    # the forward-mode rules themselves (through torch.func.jvp the subclass does not arrive: see
    # tests/support/mutation_equivalents.md)
    "linear-dw-jvp": (
        lambda: lin_mod._jvp(fdw.linear_fwd(_rand(5, MSG_K), _dw())[1], (None, _rand(MSG_N, MSG_K), None)),
        ValueError,
        "forward-mode (jvp) tangents for a DistributedWeight are not supported: take the tangent with respect to x or bias, or use a plain weight",
    ),
    "linear-weight-bumped-dgrad": (
        lambda: _lin(_rand(MSG_N, MSG_K, grad=True), bump=True, part="dgrad"),
        RuntimeError,
        "weight was modified in place between forward and backward (version 0 -> 1), e.g. by an optimizer step. Its gradient would be computed with the new values; run backward before updating the weights.",
    ),
    "linear-weight-bumped-wgrad": (
        lambda: _lin(_rand(MSG_N, MSG_K, grad=True), bump=True, part="wgrad"),
        RuntimeError,
        "weight was modified in place between forward and backward (version 0 -> 1), e.g. by an optimizer step. Its gradient would be computed with the new values; run backward before updating the weights.",
    ),
    "linear-res-type": (
        lambda: fdw.linear_bwd(("not", "res"), torch.ones(1)),
        TypeError,
        "linear_bwd takes the LinearResiduals that linear_fwd returned, got tuple",
    ),
    "linear-dgrad-res-type": (
        lambda: fdw.linear_bwd_dgrad(None, torch.ones(1)),
        TypeError,
        "linear_bwd_dgrad takes the LinearResiduals that linear_fwd returned, got NoneType",
    ),
    "linear-wgrad-res-type": (
        lambda: fdw.linear_bwd_wgrad(None, torch.ones(1)),
        TypeError,
        "linear_bwd_wgrad takes the LinearResiduals that linear_fwd returned, got NoneType",
    ),
    "linear-no-main-grad": (
        lambda: _lin(_w(), fuse_wgrad_accumulation=True),
        ValueError,
        "weight: fuse_wgrad_accumulation=True needs a `main_grad` buffer on the weight (e.g. `w.main_grad = torch.zeros_like(w, dtype=torch.float32)`)",
    ),
    "linear-main-grad-shape": (
        lambda: _lin(_w(main_grad=_f32(MSG_N, MSG_K + 1)), fuse_wgrad_accumulation=True),
        ValueError,
        "weight: main_grad/grad_buffer() must be a (4, 8) tensor, got (4, 9)",
    ),
    "linear-main-grad-type": (
        lambda: _lin(_w(main_grad=[0.0]), fuse_wgrad_accumulation=True),
        ValueError,
        "weight: main_grad/grad_buffer() must be a (4, 8) tensor, got list",
    ),
    "linear-main-grad-int": (
        lambda: _lin(_w(main_grad=_f32(dtype=torch.int32)), fuse_wgrad_accumulation=True),
        TypeError,
        "weight: main_grad/grad_buffer() is torch.int32; it must be a float tensor (float32)",
    ),
    "linear-main-grad-device": (
        lambda: _lin(_w(main_grad=_f32(device="meta")), fuse_wgrad_accumulation=True),
        ValueError,
        "weight: main_grad is on meta but the weight is on cpu",
    ),
    # grouped: the same checks, naming the expert
    "grouped-fuse-flag": (
        lambda: fdw.grouped_linear_fwd(_rand(MSG_T, MSG_K), _ws(), list(MSG_SPLITS), fuse_wgrad_accumulation=0),
        TypeError,
        "fuse_wgrad_accumulation must be a bool, got int",
    ),
    "grouped-dw-x-features": (
        lambda: fdw.grouped_linear(_rand(MSG_T, MSG_K + 1), _dw_group(), list(MSG_SPLITS)),
        ValueError,
        "x has 9 features but the weights are [8, 8] (as materialize_group_for_forward() of the DistributedWeight returned them): x must be [T, 8]",
    ),
    "grouped-dw-fwd-count": (
        lambda: fdw.grouped_linear(
            _rand(MSG_T, MSG_K), _dw_group(forward=lambda s: [m.full for m in s.group][:2]), list(MSG_SPLITS)
        ),
        ValueError,
        "weights: materialize_group_for_forward() of the DistributedWeight returned 2 tensor(s) for a group of 3; it must return one per weight",
    ),
    "grouped-dw-fwd-type": (
        lambda: fdw.grouped_linear(
            _rand(MSG_T, MSG_K), _dw_group(forward=lambda s: [m.full for m in s.group][:2] + ["w"]), list(MSG_SPLITS)
        ),
        TypeError,
        "weights: materialize_group_for_forward() of the DistributedWeight returned a str for weight 2; it must return tensors",
    ),
    "grouped-dw-bwd-shape": (
        lambda: _grp(_dw_group(backward=lambda s: [m.full[:1] for m in s.group])),
        ValueError,
        "weights: materialize_group_for_backward() returned (1, 8) for weight 0, expected (8, 8)",
    ),
    "grouped-dw-finalize-count": (
        lambda: _grp(_dw_group(finalize=lambda s, g: g[:1])),
        ValueError,
        "weights: finalize_group_grads returned 1 grad(s) for 3 weights",
    ),
    "grouped-dw-jvp": (
        lambda: gl_mod.jvp(
            fdw.grouped_linear_fwd(_rand(MSG_T, MSG_K), _dw_group(), list(MSG_SPLITS))[1],
            (None, [_rand(MSG_N, MSG_K), None, None], None, None),
        ),
        ValueError,
        "forward-mode (jvp) tangents for a DistributedWeight are not supported: take the tangent with respect to x or bias, or use plain weights",
    ),
    "grouped-weight-bumped-dgrad": (
        lambda: _grp(ws := _ws(), bump=ws[1:2], part="dgrad"),
        RuntimeError,
        "weights[1] was modified in place between forward and backward (version 0 -> 1), e.g. by an optimizer step. Its gradient would be computed with the new values; run backward before updating the weights.",
    ),
    "grouped-weight-bumped-wgrad": (
        lambda: _grp(ws := _ws(), bump=ws[2:], part="wgrad"),
        RuntimeError,
        "weights[2] was modified in place between forward and backward (version 0 -> 1), e.g. by an optimizer step. Its gradient would be computed with the new values; run backward before updating the weights.",
    ),
    "grouped-stacked-bumped": (
        lambda: _grp(W := _rand(MSG_E, MSG_N, MSG_K, grad=True), bump=[W], part="wgrad"),
        RuntimeError,
        "weights was modified in place between forward and backward (version 0 -> 1), e.g. by an optimizer step. Its gradient would be computed with the new values; run backward before updating the weights.",
    ),
    "grouped-res-type": (
        lambda: fdw.grouped_linear_bwd(None, torch.ones(1)),
        TypeError,
        "grouped_linear_bwd takes the GroupedLinearResiduals that grouped_linear_fwd returned, got NoneType",
    ),
    "grouped-dgrad-res-type": (
        lambda: fdw.grouped_linear_bwd_dgrad(None, torch.ones(1)),
        TypeError,
        "grouped_linear_bwd_dgrad takes the GroupedLinearResiduals that grouped_linear_fwd returned, got NoneType",
    ),
    "grouped-wgrad-res-type": (
        lambda: fdw.grouped_linear_bwd_wgrad(None, torch.ones(1)),
        TypeError,
        "grouped_linear_bwd_wgrad takes the GroupedLinearResiduals that grouped_linear_fwd returned, got NoneType",
    ),
    "grouped-no-main-grad": (
        lambda: _grp(_ws(), fuse_wgrad_accumulation=True),
        ValueError,
        "weights[0]: fuse_wgrad_accumulation=True needs a `main_grad` buffer on the weight (e.g. `w.main_grad = torch.zeros_like(w, dtype=torch.float32)`)",
    ),
    "grouped-main-grad-shape": (
        lambda: _grp(_mg_group(_f32(), _f32(MSG_N, MSG_K + 1), _f32()), fuse_wgrad_accumulation=True),
        ValueError,
        "weights[1]: main_grad/grad_buffer() must be a (4, 8) tensor, got (4, 9)",
    ),
    "grouped-main-grad-type": (
        lambda: _grp(_mg_group(_f32(), _f32(), "buffer"), fuse_wgrad_accumulation=True),
        ValueError,
        "weights[2]: main_grad/grad_buffer() must be a (4, 8) tensor, got str",
    ),
    "grouped-main-grad-device": (
        lambda: _grp(_mg_group(_f32(), _f32(device="meta"), _f32()), fuse_wgrad_accumulation=True),
        ValueError,
        "weights[1]: main_grad is on meta but the weight is on cpu",
    ),
    "grouped-main-grad-dtypes": (
        lambda: _grp(_mg_group(_f32(), _f32(dtype=D), _f32()), fuse_wgrad_accumulation=True),
        TypeError,
        "weights[1]: main_grad is torch.float64 but another weight's is torch.float32: the weights of a group share one main_grad dtype (one wgrad GEMM writes them all)",
    ),
    "grouped-splits-meta": (
        lambda: fdw.grouped_linear(_rand(MSG_T, MSG_K), _ws(), torch.tensor(MSG_SPLITS, device="meta")),
        ValueError,
        "splits is a tensor on the meta device, which holds no counts: give the splits as a list of ints (shape inference needs their values) or a tensor on a real device",
    ),
    "grouped-splits-str": (
        lambda: fdw.grouped_linear_fwd(_rand(MSG_T, MSG_K), _ws(), "235"),
        TypeError,
        "splits must be a list/tuple of ints or a 1-D integer tensor, got str",
    ),
    "grouped-bias-3d": (
        lambda: fdw.grouped_linear(_rand(MSG_T, MSG_K), _ws(), list(MSG_SPLITS), _rand(MSG_E, MSG_N, 1)),
        ValueError,
        "bias must be 2-D, got shape (3, 4, 1)",
    ),
    "grouped-bias-item-2d": (
        lambda: fdw.grouped_linear(
            _rand(MSG_T, MSG_K), _ws(), list(MSG_SPLITS), [_rand(MSG_N), _rand(1, MSG_N), _rand(MSG_N)]
        ),
        ValueError,
        "bias[1] must be 1-D, got shape (1, 4)",
    ),
    "grouped-bias-item-dtype": (
        lambda: fdw.grouped_linear(
            _rand(MSG_T, MSG_K),
            _ws(),
            list(MSG_SPLITS),
            [_rand(MSG_N), _rand(MSG_N), _rand(MSG_N, dtype=torch.float32)],
        ),
        TypeError,
        "bias[2] has dtype torch.float32 but x has torch.float64; cast one of them",
    ),
    "grouped-bias-count": (
        lambda: fdw.grouped_linear(_rand(MSG_T, MSG_K), _ws(), list(MSG_SPLITS), [_rand(MSG_N)] * 2),
        ValueError,
        "bias must be None, a sequence of 3 [4] tensors or one [3, 4] tensor; got 2 items",
    ),
    "grouped-bias-type": (
        lambda: fdw.grouped_linear_fwd(_rand(MSG_T, MSG_K), _ws(), list(MSG_SPLITS), 5),
        ValueError,
        "bias must be None, a sequence of 3 [4] tensors or one [3, 4] tensor; got int",
    ),
    "grouped-stacked-dtype": (
        lambda: fdw.grouped_linear(
            _rand(MSG_T, MSG_K), _rand(MSG_E, MSG_N, MSG_K, dtype=torch.float32), list(MSG_SPLITS)
        ),
        TypeError,
        "weights has dtype torch.float32 but x has torch.float64; cast one of them",
    ),
    "grouped-weights-2d-tensor": (
        lambda: fdw.grouped_linear(_rand(MSG_T, MSG_K), _rand(MSG_N, MSG_K), list(MSG_SPLITS)),
        ValueError,
        "weights must be 3-D, got shape (4, 8)",
    ),
    "grouped-weight-3d-in-list": (
        lambda: fdw.grouped_linear(
            _rand(MSG_T, MSG_K), [_rand(MSG_N, MSG_K), _rand(1, MSG_N, MSG_K), _rand(MSG_N, MSG_K)], list(MSG_SPLITS)
        ),
        ValueError,
        "weights[1] must be 2-D, got shape (1, 4, 8)",
    ),
    "grouped-weight-shape-in-list": (
        lambda: fdw.grouped_linear(
            _rand(MSG_T, MSG_K), [_rand(MSG_N, MSG_K), _rand(MSG_N + 1, MSG_K), _rand(MSG_N, MSG_K)], list(MSG_SPLITS)
        ),
        ValueError,
        "weights[1] is (5, 8); every expert's weight must be [4, 8] like weights[0]",
    ),
    "grouped-weights-empty": (
        lambda: fdw.grouped_linear_fwd(_rand(MSG_T, MSG_K), [], []),
        TypeError,
        "weights must be a non-empty sequence of [out, in] tensors or one [E, out, in] tensor, got list (empty)",
    ),
    "grouped-weights-int": (
        lambda: fdw.grouped_linear_fwd(_rand(MSG_T, MSG_K), 5, list(MSG_SPLITS)),
        TypeError,
        "weights must be a non-empty sequence of [out, in] tensors or one [E, out, in] tensor, got int",
    ),
    "grouped-weights-str-item": (
        lambda: fdw.grouped_linear_fwd(
            _rand(MSG_T, MSG_K), [_rand(MSG_N, MSG_K), "w", _rand(MSG_N, MSG_K)], list(MSG_SPLITS)
        ),
        TypeError,
        "weights[1] must be a torch.Tensor, got str",
    ),
    "grouped-x-features": (
        lambda: fdw.grouped_linear(_rand(MSG_T, MSG_K + 1), _ws(), list(MSG_SPLITS)),
        ValueError,
        "x has 9 features but the weights are [4, 8]: x must be [T, 8]",
    ),
    "dw-not-a-tensor": (
        lambda: fdw.is_distributed_weight(type("NotATensor", (), {"is_distributed_weight": True})()),
        TypeError,
        "weight: a DistributedWeight must be a torch.Tensor subclass, got NotATensor",
    ),
    "grouped-dw-buffer-shape": (
        lambda: _grp(_with_buffer(_dw_group(fused=True), 1, _f32(MSG_N, MSG_K)), fuse_wgrad_accumulation=True),
        ValueError,
        "weights[1]: main_grad/grad_buffer() must be a (8, 8) tensor, got (4, 8)",
    ),
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


def test_finalize_gets_a_bare_tensor_for_one_weight_and_may_return_none():
    got = []
    w = _dw(finalize=lambda s, g: got.append(g))  # returns None: no grad for the parameter
    dx, dw, db = _lin(w)
    assert dw is None and isinstance(got[0], torch.Tensor) and got[0].shape == (2 * MSG_N, MSG_K)  # TE: bare for one
    ws = _dw_group(finalize=lambda s, g: got.append(g))
    _, dws, _ = _grp(ws)
    assert dws == [None] * MSG_E and isinstance(got[1], list) and len(got[1]) == MSG_E
