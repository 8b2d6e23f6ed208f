"""Semantics that fakes and tolerances used to hide (issue 13): the splits cache keyed by dtype,
jvp through a DistributedWeight gathering with the forward method, the path a module asks for,
a DW's grad buffer overwritten (not accumulated into), and fp32 accumulators held to fp32."""

from __future__ import annotations

import pytest
import torch

import functional_dw as fd
from conftest import BWD_SCALE, FWD_SCALE, STALE, FakeDW, PathRecorder, assert_close, assert_same, reference
from helpers import grouped_inputs, ref_grouped
from functional_dw.kernels import Splits

SPLITS = [3, 0, 5, 2]
E, T, K, N = len(SPLITS), sum(SPLITS), 16, 8


def _data(dtype=torch.float32, seed=0):
    x, ws, _, dy = grouped_inputs(SPLITS, K, N, seed=seed, dtype=dtype, w_div=4, bias=False)
    return x, ws, dy


# --- the splits cache ----------------------------------------------------------------------


@pytest.mark.parametrize("first", [torch.int32, torch.int64])
def test_device_splits_cache_one_entry_per_dtype(first):
    """A device-only splits record (host unknown, as for CUDA splits or under torch.compile):
    end offsets asked for in both dtypes on the same record come back in each dtype."""
    sp = Splits(host=None, tensor=torch.tensor(SPLITS), device=torch.device("cpu"), num_tokens=T, num_experts=E)
    second = torch.int64 if first == torch.int32 else torch.int32
    a, b = sp.ends(first), sp.ends(second)
    assert (a.dtype, b.dtype) == (first, second)
    assert a.tolist() == b.tolist() == [3, 3, 8, 10]
    assert sp.ends(first) is a and sp.ends(second) is b  # cached, each under its own key
    assert sp.on_device().dtype == torch.int64 and sp.on_device().tolist() == SPLITS
    assert sp.sizes() == tuple(SPLITS)


def test_device_splits_are_clamped_not_trusted():
    sp = Splits(host=None, tensor=torch.tensor([4, -2, 9, 1]), device=torch.device("cpu"), num_tokens=T, num_experts=E)
    assert sp.ends(torch.int64).tolist() == [4, 4, 10, 10]  # negatives as 0, running sum capped at T
    assert sp.ends(torch.int32).tolist() == [4, 4, 10, 10]
    short = Splits(
        host=None, tensor=torch.tensor([2, 0, 3, 1]), device=torch.device("cpu"), num_tokens=T, num_experts=E
    )
    assert short.ends(torch.int32).tolist() == [2, 2, 5, 10]  # the last expert takes the rows left over
    assert short.on_device().tolist() == [2, 0, 3, 5]


def test_compiled_grouped_path_with_short_splits_computes_every_row():
    """Under torch.compile the counts are not validated on the grouped path (no sync): splits
    summing to less than T give the last expert the rest, never unwritten rows (found by the
    probe: garbage or NaN in y and dx)."""
    torch._dynamo.reset()
    w = torch.randn(E, N, K, dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(E, N, dtype=torch.bfloat16, requires_grad=True)
    f = torch.compile(lambda x, s: fd.grouped_linear(x, w, s, b), backend="aot_eager", fullgraph=True)
    x = torch.randn(T, K, dtype=torch.bfloat16, requires_grad=True)
    y = f(x, torch.tensor([3, 0, 5, 1]))  # sums to 9, T = 10
    y.float().sum().backward()
    want = fd.grouped_linear(x.detach(), w.detach(), [3, 0, 5, 2], b.detach())
    torch.testing.assert_close(y.detach(), want, rtol=0, atol=0)
    assert torch.isfinite(x.grad).all()


def test_compiled_split_path_reads_forwards_routing_in_backward():
    """The caller may reuse its splits buffer before backward (found by the probe)."""
    torch._dynamo.reset()
    w = torch.randn(E, N, K, requires_grad=True)
    f = torch.compile(
        lambda x, s: fd.grouped_linear(x, w, s, use_grouped_tensor=False), backend="aot_eager", fullgraph=True
    )
    x = torch.randn(T, K, requires_grad=True)
    s = torch.tensor(SPLITS)
    y = f(x, s)
    s.copy_(torch.tensor([0, 5, 5, 0]))
    (dx,) = torch.autograd.grad(y.sum(), x)
    xr = x.detach().clone().requires_grad_()
    (want,) = torch.autograd.grad(fd.grouped_linear(xr, w.detach(), SPLITS).sum(), xr)
    torch.testing.assert_close(dx, want)


# --- jvp through a DistributedWeight: forward's gather ---------------------------------------


@pytest.mark.parametrize("layer", ["linear", "grouped"])
def test_jvp_uses_the_forward_gather(layer):
    """FakeDW gathers x2 for forward and x4 for backward: a jvp is a forward quantity."""
    x, ws, _ = _data()
    tx = torch.randn(T, K)
    if layer == "linear":
        w = FakeDW(ws[0])
        y, t = torch.func.jvp(lambda x: fd.linear(x, w), (x,), (tx,))
        want_y, want_t = x @ (FWD_SCALE * ws[0]).T, tx @ (FWD_SCALE * ws[0]).T
        assert w.calls["backward"] == 0
    else:
        group = FakeDW.group_of(ws)
        y, t = torch.func.jvp(lambda x: fd.grouped_linear(x, group, SPLITS), (x,), (tx,))
        scaled = [FWD_SCALE * w for w in ws]
        want_y, want_t = ref_grouped(x, scaled, SPLITS), ref_grouped(tx, scaled, SPLITS)
        assert group[0].calls["backward"] == 0
    torch.testing.assert_close(y, want_y)
    torch.testing.assert_close(t, want_t)
    assert not torch.allclose(t, want_t * BWD_SCALE / FWD_SCALE)


# --- the path a module asks for reaches the kernels ----------------------------------------


@pytest.mark.parametrize("use_grouped_tensor, want", [(False, False), (True, True), (None, True)])
def test_module_passes_use_grouped_tensor_through(use_grouped_tensor, want):
    rec = PathRecorder()
    m = fd.nn.GroupedLinear(E, K, N, use_grouped_tensor=use_grouped_tensor, backend=rec)
    x = torch.randn(T, K, requires_grad=True)
    m(x, SPLITS).sum().backward()
    assert rec.paths == [("fprop", want), ("dgrad", want), ("wgrad", want)]
    y, res = fd.grouped_linear_fwd(x, m.weights(), SPLITS, use_grouped_tensor=use_grouped_tensor, backend=rec)
    assert res.path == ("grouped" if want else "split")


# --- a DW's grad buffer: the fused wgrad GEMM overwrites it -------------------------------


@pytest.mark.parametrize("path", [False, True], ids=["split", "grouped"])
@pytest.mark.parametrize("layer", ["linear", "grouped"])
def test_fused_dw_grad_buffer_is_overwritten(layer, path):
    """FakeDW's buffers hold stale values (STALE): accumulating into them instead of
    overwriting shows up in main_grad."""
    x, ws, dy = _data()
    n_w = 1 if layer == "linear" else E
    group = FakeDW.group_of(ws[:n_w], fused=True)
    assert all((m.buffer == STALE).all() for m in group)
    if layer == "linear":
        y = fd.linear(x, group[0], fuse_wgrad_accumulation=True)
        dWs = [dy.double().T @ x.double()]
    else:
        y = fd.grouped_linear(x, group, SPLITS, fuse_wgrad_accumulation=True, use_grouped_tensor=path)
        dWs = [d.T @ xe for d, xe in zip(dy.double().split(SPLITS), x.double().split(SPLITS))]
    y.backward(dy, retain_graph=True)
    y.backward(dy)
    for m, dW in zip(group, dWs):
        rows = m.shape[0]
        assert_close(m.main_grad, 2 * dW[:rows], torch.float32, "main_grad", rounds=2)


# --- fp32 accumulators are held to fp32 ------------------------------------------------------

CUDA = pytest.param(
    "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("path", [False, True], ids=["split", "grouped"])
def test_bf16_layer_fp32_main_grad_and_bias_sums_at_fp32_accuracy(path, device):
    """bf16 inputs: main_grad (fp32) within fp32 error of the float64 product of the same bf16
    values; the bias grad (bf16) within half a bf16 ulp of the fp32-accumulated sum. (On the
    CPU torch accumulates every bf16 reduction in fp32 whatever it is asked; on CUDA a bf16
    index_add accumulates in bf16: there a bias grad summed in bf16 shows.)"""
    x, ws, dy = _data(torch.bfloat16)
    T2 = 640 if device == "cuda" else 64  # long enough a sum that bf16 accumulation errs by ulps
    g = torch.Generator().manual_seed(3)
    x = torch.randn(T2, K, generator=g).to(torch.bfloat16).to(device)
    dy = torch.randn(T2, N, generator=g).to(torch.bfloat16).to(device)
    splits = [400, 0, 200, 40] if device == "cuda" else [40, 0, 20, 4]
    params = [w.to(device).requires_grad_() for w in ws]
    for p in params:
        p.main_grad = torch.zeros(N, K, device=device)
    bias = torch.zeros(E, N, dtype=torch.bfloat16, device=device, requires_grad=True)
    y = fd.grouped_linear(
        x, params, splits, bias, fuse_wgrad_accumulation=True, use_grouped_tensor=path, backend="torch"
    )
    y.backward(dy)
    x64, dy64 = x.double(), dy.double()
    for p, xe, de in zip(params, x64.split(splits), dy64.split(splits)):
        assert_close(p.main_grad, de.T @ xe, torch.bfloat16, "main_grad", mag=de.abs().T @ xe.abs())
    db = torch.stack([d.sum(0) for d in dy64.split(splits)])
    db_mag = torch.stack([d.abs().sum(0) for d in dy64.split(splits)])
    assert_close(bias.grad, db, torch.bfloat16, "bias grad", mag=db_mag)


def test_bf16_linear_fp32_main_grad_at_fp32_accuracy():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(64, K, generator=g).to(torch.bfloat16)
    dy = torch.randn(64, N, generator=g).to(torch.bfloat16)
    w = (torch.randn(N, K, generator=g) / 4).to(torch.bfloat16).requires_grad_()
    w.main_grad = torch.full((N, K), 0.5)
    b = torch.zeros(N, dtype=torch.bfloat16, requires_grad=True)
    fd.linear(x, w, b, fuse_wgrad_accumulation=True).backward(dy)
    x64, dy64 = x.double(), dy.double()
    assert_close(w.main_grad, 0.5 + dy64.T @ x64, torch.bfloat16, "main_grad", mag=0.5 + dy64.abs().T @ x64.abs())
    assert_close(b.grad, dy64.sum(0), torch.bfloat16, "bias grad", mag=dy64.abs().sum(0))


# --- no GEMM for a gradient nobody needs ----------------------------------------------------


@pytest.mark.parametrize("path", [False, True], ids=["split", "grouped"])
@pytest.mark.parametrize(
    "x_grad, w_grad, b_grad, want",
    [
        (True, True, True, ["dgrad", "wgrad"]),
        (False, True, True, ["wgrad"]),  # an input that needs no grad: no dgrad
        (True, False, True, ["dgrad"]),  # frozen experts: no wgrad (the bias grad is a column sum)
        (True, False, False, ["dgrad"]),
    ],
)
def test_grouped_backward_runs_only_the_gemms_needed(path, x_grad, w_grad, b_grad, want):
    x, ws, dy = _data()
    x.requires_grad_(x_grad)
    ws = [w.clone().requires_grad_(w_grad) for w in ws]
    bias = torch.randn(E, N, requires_grad=b_grad)
    rec = PathRecorder()
    y = fd.grouped_linear(x, ws, SPLITS, bias, use_grouped_tensor=path, backend=rec)
    y.backward(dy)
    assert rec.gemms() == want
    (y64, grads), _ = reference(lambda x, *p: ref_grouped(x, p[:E], SPLITS, p[E]), [x, *ws, bias], dy)
    got = [x.grad, *[w.grad for w in ws], bias.grad]
    for g, want_g, needed in zip(got, grads, [x_grad] + [w_grad] * E + [b_grad]):
        assert (g is not None) == needed
        if needed:
            torch.testing.assert_close(g.double(), want_g, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("x_grad, w_grad, want", [(False, True, ["linear wgrad"]), (True, False, ["linear dgrad"])])
def test_linear_backward_runs_only_the_gemms_needed(x_grad, w_grad, want):
    x, ws, dy = _data()
    x.requires_grad_(x_grad)
    w = ws[0].clone().requires_grad_(w_grad)
    rec = PathRecorder()
    fd.linear(x, w, backend=rec).backward(dy)
    assert rec.gemms() == want
    assert (x.grad is not None) == x_grad and (w.grad is not None) == w_grad


@pytest.mark.parametrize("argnums, want", [(0, ["dgrad"]), (1, ["wgrad"]), ((0, 1), ["dgrad", "wgrad"])])
def test_torch_func_grad_runs_only_the_gemms_it_differentiates(argnums, want):
    x, ws, _ = _data()
    W = torch.stack(ws)
    rec = PathRecorder()
    got = torch.func.grad(lambda x, W: fd.grouped_linear(x, W, SPLITS, backend=rec).square().sum(), argnums)(x, W)
    assert rec.gemms() == want
    ref = torch.func.grad(lambda x, W: ref_grouped(x, list(W), SPLITS).square().sum(), argnums)(x, W)
    torch.testing.assert_close(got, ref)


@pytest.mark.parametrize("layer", ["linear", "grouped"])
@pytest.mark.parametrize("frozen", ["x", "weights"])
def test_distributed_weight_gathers_and_finalizes_once_when_a_gemm_is_skipped(layer, frozen):
    """Collectives must match across ranks: one backward gather and one finalize per backward."""
    x, ws, dy = _data()
    x.requires_grad_(frozen != "x")
    group = FakeDW.group_of(ws[:1] if layer == "linear" else ws)
    for m in group:
        m.requires_grad_(frozen != "weights")
    rec = PathRecorder()
    y = fd.linear(x, group[0], backend=rec) if layer == "linear" else fd.grouped_linear(x, group, SPLITS, backend=rec)
    y.backward(dy)
    assert group[0].calls == {"forward": 1, "backward": 1, "finalize": 1}
    assert len(rec.gemms()) == 1


def test_linear_pure_fwd_bwd_use_bias_backend_and_hand_kernels_token_rows():
    """linear_fwd with a bias and a backend: y has the bias, the record keeps that backend, whose
    fprop gets x as [T, K] rows (also in the no-grad primal path); a record without bias gets no
    bias grad, and a direct record (needs None) gets every other gradient."""
    from test_fp8_layers import OneGemmLog

    from functional_dw.kernels.torch_ref import TorchKernels

    class _KernelLog(OneGemmLog, TorchKernels):  # the reference kernels, logging each GEMM
        pass

    g = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((2, 3, 4), (5, 4), (5,)))
    dy = torch.randn(2, 3, 5, generator=g, dtype=torch.float64)
    k = _KernelLog()
    y, res = fd.linear_fwd(x, w, b, backend=k)
    assert res.kernels is k and k.log == [("fprop", (6, 4), "default")]
    torch.testing.assert_close(y, x @ w.t() + b)
    k.log.clear()
    fd.linear(x, w, b, backend=k)  # nothing requires grad: forward alone
    assert k.log == [("fprop", (6, 4), "default")]
    y, res = fd.linear_fwd(x, w)
    dx, dw, db = fd.linear_bwd(res, dy)
    assert db is None
    torch.testing.assert_close(dx, dy @ w)
    torch.testing.assert_close(dw, dy.reshape(6, 5).t() @ x.reshape(6, 4))


class _FrozenDW(FakeDW):
    """A fused FakeDW whose finalize_group_grads records what it was handed."""

    def finalize_group_grads(self, wgrads):
        self.handed = wgrads
        return self.reply(wgrads) if hasattr(self, "reply") else super().finalize_group_grads(wgrads)


def test_linear_frozen_fused_distributed_weight_finalizes_its_grad_buffer():
    """A DistributedWeight whose gradient is not wanted still finalizes once (every rank joins
    the collective), fused: with its own grad_buffer(); the buffer's and finalize's checks name
    the weight."""
    from functional_dw.residuals import with_needs

    g = torch.Generator().manual_seed(0)
    full, x = torch.randn(4, 6, generator=g), torch.randn(3, 6, generator=g)
    dy = torch.randn(3, 4, generator=g)
    dw = _FrozenDW.group_of([full], fused=True)[0]
    _, res = fd.linear_fwd(x, dw, fuse_wgrad_accumulation=True)
    res = with_needs(res, (True, False, False))
    buf = dw.grad_buffer()
    got, db = fd.linear_bwd_wgrad(res, dy)
    assert dw.handed is buf and db is None and dw.calls["finalize"] == 1
    dw.buffer = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=r"^weight: main_grad/grad_buffer\(\) must be a \(4, 6\) tensor"):
        fd.linear_bwd_wgrad(res, dy)
    dw.buffer, dw.reply = buf, lambda wgrads: [None, None]
    with pytest.raises(ValueError, match=r"^weight: finalize_group_grads returned 2 grad"):
        fd.linear_bwd_wgrad(res, dy)


@pytest.mark.parametrize("layer", ["linear", "grouped"])
def test_a_frozen_fused_dw_finalizes_zeros_not_its_stale_buffer(layer):
    """Every weight frozen, fused wgrad: the leader still finalizes (its collectives match the
    other ranks'), with zeros in its fp32 grad buffers, never what a gather left there (which a
    reduce-scatter would add into the other ranks' main_grad)."""
    n = 1 if layer == "linear" else E
    group = FakeDW.group_of([torch.randn(N, K) for _ in range(n)], fused=True)
    for m in group:
        m.requires_grad_(False)
    x = torch.randn(T, K, requires_grad=True)
    y = (
        fd.linear(x, group[0], fuse_wgrad_accumulation=True)
        if layer == "linear"
        else fd.grouped_linear(x, group, SPLITS, fuse_wgrad_accumulation=True)
    )
    y.sum().backward()
    assert x.grad is not None
    for m in group:
        assert m.grad_added_to_main_grad and torch.equal(m.main_grad, torch.zeros_like(m.main_grad)), m.main_grad


# --- the pure API under torch.autocast ---------------------------------------------------------


def test_pure_pairs_compute_in_the_dtypes_given_under_autocast():
    """``*_fwd``/``*_bwd`` (and the split backward) under autocast compute in the dtypes they are
    given, autocast off inside (NOTE: [Autocast] in functional_dw/_amp.py), so the record and its
    backward agree: bitwise the calls outside autocast. (The original's fwd ran autocast's bf16
    GEMMs into an fp32 record.)"""
    x, ws, dy = _data()
    b = torch.randn(N, generator=torch.Generator().manual_seed(1))
    x3 = x.view(2, T // 2, K)
    w1 = [torch.randn(2 * K, K, generator=torch.Generator().manual_seed(e)) / 4 for e in range(E)]
    w2 = [torch.randn(K, K, generator=torch.Generator().manual_seed(9 + e)) / 4 for e in range(E)]
    calls = {
        "linear": lambda: fd.linear_bwd(*_fwd_dy(fd.linear_fwd(x3, ws[0], b), dy.view(2, T // 2, N))),
        "linear split": lambda: _split(fd.linear_bwd_dgrad, fd.linear_bwd_wgrad, fd.linear_fwd(x, ws[0]), dy),
        "grouped": lambda: fd.grouped_linear_bwd(*_fwd_dy(fd.grouped_linear_fwd(x, ws, SPLITS), dy)),
        "grouped split": lambda: _split(
            fd.grouped_linear_bwd_dgrad, fd.grouped_linear_bwd_wgrad, fd.grouped_linear_fwd(x, ws, SPLITS), dy
        ),
        "mlp": lambda: fd.grouped_mlp_bwd(*_fwd_dy(fd.grouped_mlp_fwd(x, w1, w2, SPLITS), x)),
    }
    for name, call in calls.items():
        want = call()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = call()
        assert_same(list(pytree_leaves(got)), list(pytree_leaves(want)), name)
        assert all(t.dtype == torch.float32 for t in pytree_leaves(got)), name


def _fwd_dy(out, dy):
    """(residuals, dy) of a ``*_fwd`` call, checking its output is fp32: the dtype it was given."""
    y, res = out
    assert y.dtype == torch.float32
    return res, dy


def _split(dgrad, wgrad, out, dy):
    return dgrad(_fwd_dy(out, dy)[0], dy), wgrad(out[1], dy)


def pytree_leaves(t):
    return [u for u in torch.utils._pytree.tree_leaves(t) if u is not None]
