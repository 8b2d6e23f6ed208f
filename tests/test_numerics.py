"""Numerics of both layers on the reference backend against a float64 reference; bias grads in
the layer's dtype at fp32 accuracy; under ``torch.autocast``, what torch's own composition gives."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import functional_dw as fd
from conftest import assert_close, assert_same, reference
from helpers import gen, grouped_inputs, grouped_module, linear_module, ref_grouped

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
PATHS = [False, True, None]


def _make(E, K, N, splits, dtype, bias=True, seed=0):
    return grouped_inputs(splits, K, N, experts=E, seed=seed, dtype=dtype, w_div=K**0.5, bias=bias, grad=True)


def _grads(y, inputs, dy):
    return torch.autograd.grad(y, inputs, dy, allow_unused=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("path", PATHS, ids=["split", "grouped", "auto"])
@pytest.mark.parametrize(
    "splits", [[5, 0, 11, 3], [0, 0, 0, 0], [19, 0, 0, 0], [1, 2, 3, 4]], ids=["uneven", "T=0", "one-expert", "small"]
)
def test_grouped_matches_float64_and_F_linear(dtype, path, splits):
    x, ws, bs, dy = _make(4, 16, 8, splits, dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # float64 on the grouped path warns and runs split
        y = fd.grouped_linear(x, ws, splits, bs, use_grouped_tensor=path)
    got = _grads(y, [x, *ws, *bs], dy)
    # float64 reference (the semantics: a loop of F.linear per expert), and its magnitudes
    (y64, want), (y_mag, mags) = reference(lambda x, *p: ref_grouped(x, p[:4], splits, p[4:]), [x, *ws, *bs], dy)
    assert_close(y, y64, dtype, "y", mag=y_mag, rounds=2)  # GEMM, then + bias: two roundings
    for i, (a, b, m) in enumerate(zip(got, want, mags)):
        assert a is not None and a.dtype == dtype, f"grad {i} is {a if a is None else a.dtype}"
        assert_close(a, b, dtype, f"grad {i}", mag=m)
    assert not got[2].any() if splits[1] == 0 else True, "a zero-token expert's wgrad is zeros"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(7, 16), (2, 3, 16), (0, 16), (16,)], ids=["2d", "3d", "empty", "1d"])
def test_linear_matches_float64(dtype, shape):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(*shape, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(8, 16, generator=g) / 4).to(dtype).requires_grad_()
    b = torch.randn(8, generator=g).to(dtype).requires_grad_()
    y = fd.linear(x, w, b)
    assert y.shape == (*shape[:-1], 8)
    dy = torch.randn(y.shape, generator=g).to(dtype)
    got = _grads(y, [x, w, b], dy)
    (y64, want), (y_mag, mags) = reference(F.linear, [x, w, b], dy)
    assert_close(y, y64, dtype, "y", mag=y_mag)  # F.linear adds the bias in the GEMM: one rounding
    for a, e, m in zip(got, want, mags):
        assert_close(a, e, dtype, "grad", mag=m)


def test_path_is_recorded_and_auto_picks_a_supported_one():
    x, ws, bs, _ = _make(3, 16, 8, [2, 3, 4], torch.float32)
    assert fd.grouped_linear_fwd(x, ws, [2, 3, 4])[1].path == "grouped"
    assert fd.grouped_linear_fwd(x, ws, [2, 3, 4], use_grouped_tensor=False)[1].path == "split"
    x64, ws64, _, _ = _make(3, 16, 8, [2, 3, 4], torch.float64)
    assert fd.grouped_linear_fwd(x64, ws64, [2, 3, 4])[1].path == "split"  # no warning for None
    with pytest.warns(UserWarning, match="float64"):
        fd.grouped_linear_fwd(x64, ws64, [2, 3, 4], use_grouped_tensor=True)
    xb, wsb, _, _ = _make(3, 12, 8, [2, 3, 4], torch.bfloat16)  # 24-byte rows: misaligned
    assert "16-byte" in fd.kernels.get_kernels("torch", xb).grouped_path_unsupported(xb, wsb)


@pytest.mark.parametrize("splits_kind", ["list", "tuple", "int64", "int32"])
@pytest.mark.parametrize("path", [False, True], ids=["split", "grouped"])
def test_splits_forms_agree(splits_kind, path):
    sizes = [4, 0, 6]
    x, ws, bs, dy = _make(3, 16, 8, sizes, torch.float32)
    conv = {
        "list": list,
        "tuple": tuple,
        "int64": lambda s: torch.tensor(s),
        "int32": lambda s: torch.tensor(s, dtype=torch.int32),
    }
    y = fd.grouped_linear(x, ws, conv[splits_kind](sizes), bs, use_grouped_tensor=path)
    assert_same(y, fd.grouped_linear(x, ws, sizes, bs, use_grouped_tensor=path))


@pytest.mark.parametrize("path", [False, True], ids=["split", "grouped"])
def test_stacked_weight_and_bias(path):
    sizes = [3, 0, 5]
    x, ws, bs, dy = _make(3, 16, 8, sizes, torch.float32)
    w3 = torch.stack([w.detach() for w in ws]).requires_grad_()
    b2 = torch.stack([b.detach() for b in bs]).requires_grad_()
    y = fd.grouped_linear(x, w3, sizes, b2, use_grouped_tensor=path)
    dx, dw3, db2 = _grads(y, [x, w3, b2], dy)
    y_l = fd.grouped_linear(x, ws, sizes, bs, use_grouped_tensor=path)
    g = _grads(y_l, [x, *ws, *bs], dy)
    torch.testing.assert_close(y, y_l)
    torch.testing.assert_close(dx, g[0])
    torch.testing.assert_close(dw3, torch.stack(g[1:4]))
    torch.testing.assert_close(db2, torch.stack(g[4:7]))


def test_frozen_weight_trainable_bias():
    sizes = [3, 4]
    x, ws, bs, dy = _make(2, 16, 8, sizes, torch.float32)
    for w in ws:
        w.requires_grad_(False)
    y = fd.grouped_linear(x, ws, sizes, bs)
    y.backward(dy)
    assert all(w.grad is None for w in ws)
    for b, d in zip(bs, dy.split(sizes)):
        torch.testing.assert_close(b.grad, d.sum(0))
    w = torch.randn(8, 16)
    b = torch.zeros(8, requires_grad=True)
    fd.linear(torch.randn(5, 16), w, b).sum().backward()
    torch.testing.assert_close(b.grad, torch.full((8,), 5.0))


@pytest.mark.parametrize("path", [False, True], ids=["split", "grouped"])
def test_split_backward_combines_to_bwd(path):
    sizes = [3, 0, 5]
    x, ws, bs, dy = _make(3, 16, 8, sizes, torch.float32)
    y, res = fd.grouped_linear_fwd(x, ws, sizes, bs, use_grouped_tensor=path)
    dx, dws, dbs = fd.grouped_linear_bwd(res, dy)
    assert_same(fd.grouped_linear_bwd_dgrad(res, dy), dx)
    assert_same(list(fd.grouped_linear_bwd_wgrad(res, dy)), [dws, dbs])
    assert_same(
        [dx, dws, dbs], list(_grads(fd.grouped_linear(x, ws, sizes, bs, use_grouped_tensor=path), [x], dy)) + [dws, dbs]
    )
    y1, r1 = fd.linear_fwd(x, ws[0], bs[0])
    full = fd.linear_bwd(r1, y1)
    assert_same(list(full), [fd.linear_bwd_dgrad(r1, y1), *fd.linear_bwd_wgrad(r1, y1)])


def test_auto_backend_on_cpu_is_the_reference():
    x, ws, _, _ = _make(2, 16, 8, [3, 4], torch.float32)
    y, res = fd.grouped_linear_fwd(x, ws, [3, 4], backend="auto")
    assert res.kernels.name == "torch" and res.path == "grouped"
    assert_same(y, fd.grouped_linear(x, ws, [3, 4], backend="torch"))


def test_device_only_splits_are_made_memory_safe():
    """Splits known only on the device (a CUDA tensor) are not validated (that would sync):
    they are clamped so that no kernel reads past x."""
    from functional_dw.kernels import Splits

    bad = torch.tensor([5, -3, 9, 4])
    s = Splits(host=None, tensor=bad, device=torch.device("cpu"), num_tokens=10, num_experts=4)
    sizes = s.on_device()
    assert sizes.tolist() == [5, 0, 5, 0] and int(sizes.sum()) <= 10
    good = torch.tensor([3, 0, 7])
    s = Splits(host=None, tensor=good, device=torch.device("cpu"), num_tokens=10, num_experts=3)
    assert s.on_device().tolist() == [3, 0, 7]
    for dtype in (torch.int32, torch.int64):  # the end offsets grouped GEMMs read: monotone, <= T
        ends = Splits(host=None, tensor=bad, device=torch.device("cpu"), num_tokens=10, num_experts=4).ends(dtype)
        assert ends.dtype == dtype and ends.tolist() == [5, 5, 10, 10]
    huge = torch.tensor([2**31 - 1, 5], dtype=torch.int32)  # the running sum overflows int32
    s = Splits(host=None, tensor=huge, device=torch.device("cpu"), num_tokens=7, num_experts=2)
    assert s.ends(torch.int32).tolist() == [7, 7] and s.on_device().tolist() == [7, 0]
    host = Splits(host=(3, 0, 7), tensor=None, device=torch.device("cpu"), num_tokens=10, num_experts=3)
    assert host.ends().tolist() == [3, 3, 10] and host.on_device().tolist() == [3, 0, 7]


# --- bias grads: the layer's dtype, fp32 accuracy ----------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_bias_grads_keep_the_layer_dtype_and_fp32_accuracy(dtype):
    g = gen(3)
    x = torch.randn(64, 8, generator=g).to(dtype)
    dy = (torch.randn(64, 4, generator=g) * 100).to(dtype)
    w, b = torch.randn(4, 8, generator=g).to(dtype), torch.zeros(4, dtype=dtype)
    want = dy.double().sum(0)
    y, res = fd.linear_fwd(x, w, b)
    _, db = fd.linear_bwd_wgrad(res, dy)
    assert db.dtype == dtype
    torch.testing.assert_close(db.double(), want.to(dtype).double(), rtol=0, atol=0)
    splits = [30, 34]
    y, res = fd.grouped_linear_fwd(x, [w, w], splits, torch.zeros(2, 4, dtype=dtype))
    _, db = fd.grouped_linear_bwd_wgrad(res, dy)
    assert db.dtype == dtype
    want = torch.stack([d.double().sum(0) for d in dy.split(splits)]).to(dtype)
    torch.testing.assert_close(db.double(), want.double(), rtol=0, atol=0)


# --- torch.autocast (AMP): what torch's own composition gives ------------------------------------
# NOTE: [Autocast] in functional_dw/_amp.py. The reference is F.linear (per expert, then torch.cat)
# under the same autocast: the outputs' and grads' dtypes equal its (grads of fp32 parameters in
# fp32), the values are its bitwise where the same GEMM runs (the split path: one F.linear per
# expert), and every value is within the tolerance rule of the float64 result from the inputs as
# autocast rounds them (a grad of an fp32 input holds a value of the autocast dtype).

CUDA = pytest.param(
    "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
)
AMP = [torch.bfloat16, torch.float16]


def _under_autocast(fn, inputs, dy, device, dtype):
    """(y, grads of inputs) of ``fn(*inputs)`` run under ``torch.autocast(device, dtype)``."""
    with torch.autocast(device, dtype=dtype):
        y = fn(*inputs)
    return y, list(torch.autograd.grad(y, inputs, dy.to(y.dtype)))


def _check_autocast(ours, torchs, ref, inputs, dy, dtype, *, same: bool, rounds: int = 1):
    """``ours`` and ``torchs`` ((y, grads) under autocast) agree in dtypes, bitwise where ``same``
    (the same GEMMs), and ``ours`` is within the tolerance rule of ``ref`` run in float64 on the
    inputs autocast rounds to ``dtype`` (what ``reference`` does)."""
    (y, grads), (y_t, grads_t) = ours, torchs
    assert y.dtype == y_t.dtype == dtype
    assert [g.dtype for g in grads] == [g.dtype for g in grads_t] == [t.dtype for t in inputs]
    if same:
        assert_same(y, y_t, "y")
        assert_same(grads, grads_t, "grads")
    (y64, want), (y_mag, mags) = reference(ref, [t.to(dtype) for t in inputs], dy.to(dtype))
    assert_close(y, y64, dtype, "y", mag=y_mag, rounds=rounds)
    for i, (g, w, m) in enumerate(zip(grads, want, mags)):
        g16 = g.to(dtype)
        assert torch.equal(g16.to(g.dtype), g), f"grad {i}: computed in {dtype}, then cast to {g.dtype}"
        assert_close(g16, w, dtype, f"grad {i}", mag=m)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("dtype", AMP, ids=str)
@pytest.mark.parametrize("shape", [(7, 16), (2, 3, 16)], ids=["2d", "3d"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_linear_under_autocast_is_F_linear(bias, shape, dtype, device):
    """fd.linear under autocast (fp32 x, weight, bias): F.linear's output dtype and bits, and its
    grads (fp32 for the fp32 inputs, bitwise); the original returned a bf16 y whose backward
    refused the bf16 dy."""
    g = gen(5)
    x = torch.randn(*shape, generator=g).to(device).requires_grad_()
    w = (torch.randn(8, 16, generator=g) / 4).to(device).requires_grad_()
    b = torch.randn(8, generator=g).to(device).requires_grad_() if bias else None
    dy = torch.randn(*shape[:-1], 8, generator=g).to(device)
    inputs = [x, w] + ([b] if bias else [])
    ours = _under_autocast(lambda *t: fd.linear(*t, backend="torch"), inputs, dy, device, dtype)
    torchs = _under_autocast(F.linear, inputs, dy, device, dtype)
    _check_autocast(ours, torchs, F.linear, inputs, dy, dtype, same=True)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("dtype", AMP, ids=str)
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("stacked", [False, True], ids=["list", "stacked"])
@pytest.mark.parametrize("path", [False, True], ids=["split", "grouped"])
def test_grouped_under_autocast_is_torchs_composition(path, stacked, bias, dtype, device):
    """fd.grouped_linear under autocast, fp32 inputs, per-expert list or stacked [E, N, K]
    weights: the dtypes of F.linear per expert and torch.cat under the same autocast, its bits on
    the split path (the same GEMMs), the tolerance rule on the grouped path (grouped_mm, and the
    bias added after it: two roundings). The original's split path refused backward's dy, its
    grouped path ignored autocast."""
    if device == "cuda" and path and dtype != torch.bfloat16:
        pytest.skip("torch's CUDA grouped_mm takes bfloat16 only")
    splits, E = [5, 0, 11, 3], 4
    x, ws, bs, dy = grouped_inputs(splits, 16, 32, seed=2, w_div=4, bias=bias, stacked=stacked, device=device)
    params = ([ws] if stacked else ws) + ([] if bs is None else [bs] if stacked else bs)
    inputs = [t.requires_grad_() for t in [x, *params]]

    def layer(x, *p):
        w, b = (p[0], p[1] if bias else None) if stacked else (list(p[:E]), list(p[E:]) or None)
        return fd.grouped_linear(x, w, splits, b, use_grouped_tensor=path, backend="torch")

    def composition(x, *p):
        w, b = (p[0], p[1] if bias else None) if stacked else (p[:E], p[E:] or None)
        return ref_grouped(x, w, splits, b)

    ours = _under_autocast(layer, inputs, dy, device, dtype)
    torchs = _under_autocast(composition, inputs, dy, device, dtype)
    _check_autocast(ours, torchs, composition, inputs, dy, dtype, same=not path, rounds=2 if bias and path else 1)


@pytest.mark.parametrize("dtype", AMP, ids=str)
@pytest.mark.parametrize("layout", ["one-buffer", "single"])
def test_modules_under_autocast_are_torchs_composition(layout, dtype):
    """nn.Linear and nn.GroupedLinear (its experts one buffer, or one [E, N, K] parameter) under
    autocast: F.linear's dtypes and bits on the split path, fp32 grads for the fp32 parameters;
    the one-buffer experts' grads stay views of one buffer."""
    lin = linear_module(16, 8, seed=1)
    x = torch.randn(6, 16, generator=gen(6), requires_grad=True)
    dy = torch.randn(6, 8, generator=gen(7))
    params = [x, lin.weight, lin.bias]
    ours = _under_autocast(lambda x, *_: lin(x), params, dy, "cpu", dtype)
    torchs = _under_autocast(F.linear, params, dy, "cpu", dtype)
    _check_autocast(ours, torchs, F.linear, params, dy, dtype, same=True)
    splits = [5, 0, 11, 3]
    m = grouped_module(4, 16, 32, seed=2, use_grouped_tensor=False, single_grouped_weight=layout == "single")
    x = torch.randn(19, 16, generator=gen(8), requires_grad=True)
    dy = torch.randn(19, 32, generator=gen(9))
    single = layout == "single"
    ps = [x, m.weight, m.bias] if single else [x, *m.weights(), *m.biases()]
    w = (lambda p: p[0]) if single else (lambda p: list(p[:4]))
    b = (lambda p: p[1]) if single else (lambda p: list(p[4:]))
    ours = _under_autocast(lambda x, *_: m(x, splits), ps, dy, "cpu", dtype)
    torchs = _under_autocast(lambda x, *p: ref_grouped(x, w(p), splits, b(p)), ps, dy, "cpu", dtype)
    _check_autocast(ours, torchs, lambda x, *p: ref_grouped(x, w(p), splits, b(p)), ps, dy, dtype, same=True)
    if not single:
        grads = ours[1][1:5]
        assert [g.data_ptr() for g in grads] == [grads[0].data_ptr() + e * 32 * 16 * 4 for e in range(4)]
