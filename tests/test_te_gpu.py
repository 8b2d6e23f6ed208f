"""The TE backend on a GPU: bitwise parity with te.Linear / te.GroupedLinear on both grouped
paths, E > 64 experts, no host sync, fused main_grad, CUDA graphs, dtype fallback, and
DistributedWeight hooks under saved-tensor hooks; and ordinary uses that once crashed or were
silently wrong: any layout gives the contiguous run's bits, a strided main_grad, partly frozen
groups with fused wgrad, main_grad dtypes, inference tensors, fake CUDA tensors. Skips cleanly
without CUDA or TE.

Shapes stay small (K, N multiples of 64; T up to a few thousand): the file runs in seconds.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections import Counter

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
te = pytest.importorskip("transformer_engine.pytorch", reason="needs Transformer Engine for PyTorch")

import functional_dw as fd  # noqa: E402
from conftest import assert_close, assert_same  # noqa: E402
from helpers import grouped_inputs, randn  # noqa: E402
from functional_dw.kernels.te import TE  # noqa: E402

BF16, DEV = torch.bfloat16, "cuda"
E, K, N = 4, 256, 128
SIZES = [37, 0, 101, 62]  # uneven, with a zero-token expert
T = sum(SIZES)


# --- helpers -------------------------------------------------------------------------------


def grouped_unavailable(dtype=BF16) -> str | None:
    x = torch.empty(8, K, dtype=dtype, device=DEV)
    return TE.grouped_path_unsupported(x, [torch.empty(N, K, dtype=dtype, device=DEV)])


def needs_grouped(dtype=BF16) -> None:
    """Skip unless TE's grouped-tensor GEMM runs here (cuBLASLt >= 13.4 on Hopper); with
    FDW_EXPECT_GROUPED=1 (the H200 command sets it) fail instead: there it must run."""
    why = grouped_unavailable(dtype)
    if why is not None and os.environ.get("FDW_EXPECT_GROUPED") == "1":
        pytest.fail(f"FDW_EXPECT_GROUPED=1 but TE's grouped-tensor path cannot run: {why}")
    if why is not None:
        pytest.skip(f"TE grouped-tensor path unavailable: {why}")


randn = functools.partial(randn, seed=None, dtype=BF16, device=DEV)  # (seed=None: torch's global generator)


def splits_arg(sizes, grouped: bool):
    """A CUDA int64 tensor for the grouped path (TE requires it), a list for the split path."""
    return torch.tensor(sizes, dtype=torch.int64, device=DEV) if grouped else list(sizes)


def te_grouped(dtype=BF16, grouped=False, bias=True, fuse=False, experts=E, seed=0):
    m = te.GroupedLinear(
        experts,
        K,
        N,
        bias=bias,
        params_dtype=dtype,
        device=DEV,
        use_grouped_tensor=grouped,
        fuse_wgrad_accumulation=fuse,
    )
    with torch.no_grad():
        for e in range(experts):
            getattr(m, f"weight{e}").copy_(randn(N, K, dtype=dtype, scale=0.05, seed=seed + e))
            if bias:
                getattr(m, f"bias{e}").copy_(randn(N, dtype=dtype, seed=1000 + seed + e))
    return m


def te_params(m, name):
    return [getattr(m, f"{name}{e}") for e in range(m.num_gemms)]


def clone_params(ts):
    return [torch.nn.Parameter(t.detach().clone()) for t in ts]


def run_te_grouped(m, x, splits, dy):
    x = x.detach().clone().requires_grad_()
    y = m(x, splits)
    y.backward(dy)
    return {
        "y": y.detach(),
        "dx": x.grad,
        "dw": [w.grad for w in te_params(m, "weight")],
        "db": [b.grad for b in te_params(m, "bias")] if m.use_bias else None,
    }


def run_fd_grouped(x, ws, bs, splits, dy, grouped, **kw):
    with torch.no_grad():  # the path that will run: asked for, and possible here
        res = fd.grouped_linear_fwd(x, ws, splits, bs, use_grouped_tensor=grouped, backend="te", **kw)[1]
    assert res.path == ("grouped" if grouped else "split") and res.kernels.name == "te", (res.path, res.kernels)
    x = x.detach().clone().requires_grad_()
    y = fd.grouped_linear(x, ws, splits, bs, use_grouped_tensor=grouped, backend="te", **kw)
    y.backward(dy)
    return {
        "y": y.detach(),
        "dx": x.grad,
        "dw": [w.grad for w in ws] if not kw.get("fuse_wgrad_accumulation") else None,
        "db": None if bs is None else [b.grad for b in bs],
    }


def equal(a, b, what):
    assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    assert torch.equal(a, b), f"{what}: max diff {(a.double() - b.double()).abs().max().item()}"


def compare_to_te(got, want, grouped, sizes=SIZES):
    equal(got["y"], want["y"], "y")
    equal(got["dx"], want["dx"], "dgrad")
    for e, (a, b) in enumerate(zip(got["dw"], want["dw"])):
        if grouped and sizes[e] == 0:  # TE leaves torch.empty here if cuBLAS skips a K=0 GEMM
            assert torch.count_nonzero(a) == 0, f"wgrad[{e}] of a zero-token expert must be zeros"
        else:
            equal(a, b, f"wgrad[{e}]")
    if want["db"] is not None:
        for e, (a, b) in enumerate(zip(got["db"], want["db"])):
            if grouped:  # TE's grouped dbias is a Triton kernel with fp32 atomics
                torch.testing.assert_close(a, b, msg=f"dbias[{e}]")
            else:
                equal(a, b, f"dbias[{e}]")


@torch.no_grad()
def ref_grouped_f64(x, ws, bs, sizes, dy):
    """float64 y, dx, dw (list), db (list) for one grouped linear."""
    x, dy = x.double(), dy.double()
    xs, dys = x.split(list(sizes)), dy.split(list(sizes))
    y = torch.cat(
        [
            xe @ w.double().t() + (0 if bs is None else b.double())
            for xe, w, b in zip(xs, ws, bs if bs is not None else [None] * len(ws))
        ]
    )
    dx = torch.cat([d @ w.double() for d, w in zip(dys, ws)])
    dw = [d.t() @ xe for d, xe in zip(dys, xs)]
    db = [d.sum(0) for d in dys]
    return y, dx, dw, db


# --- a. Linear ----------------------------------------------------------------------------


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused-main_grad"])
def test_linear_bitwise_equals_te_linear(fused):
    lin = te.Linear(K, N, bias=True, params_dtype=BF16, device=DEV, fuse_wgrad_accumulation=fused)
    with torch.no_grad():
        lin.weight.copy_(randn(N, K, scale=0.05, seed=1))
        lin.bias.copy_(randn(N, seed=2))
    w, b = clone_params([lin.weight, lin.bias])
    if fused:
        lin.weight.main_grad = torch.zeros(N, K, dtype=torch.float32, device=DEV)
        w.main_grad = torch.zeros(N, K, dtype=torch.float32, device=DEV)
    x, dy = randn(4, 50, K, seed=3), randn(4, 50, N, seed=4)
    x_te, x_fd = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_te = lin(x_te)
    y_te.backward(dy)
    y_fd = fd.linear(x_fd, w, b, fuse_wgrad_accumulation=fused, backend="te")
    y_fd.backward(dy)
    equal(y_fd, y_te, "y")
    equal(x_fd.grad, x_te.grad, "dgrad")
    equal(b.grad, lin.bias.grad, "dbias")
    if fused:
        equal(w.main_grad, lin.weight.main_grad, "main_grad")
        assert w.grad is None
    else:
        equal(w.grad, lin.weight.grad, "wgrad")


# --- b. GroupedLinear, both paths ---------------------------------------------------------


@pytest.mark.parametrize("grouped", [False, True], ids=["split", "grouped"])
def test_grouped_linear_bitwise_equals_te(grouped):
    if grouped:
        needs_grouped()
    m = te_grouped(grouped=grouped)
    ws, bs = clone_params(te_params(m, "weight")), clone_params(te_params(m, "bias"))
    x, dy = randn(T, K, seed=5), randn(T, N, seed=6)
    _, res = fd.grouped_linear_fwd(x, ws, splits_arg(SIZES, grouped), bs, use_grouped_tensor=grouped, backend="te")
    assert res.path == ("grouped" if grouped else "split")
    want = run_te_grouped(m, x, splits_arg(SIZES, grouped), dy)
    got = run_fd_grouped(x, ws, bs, splits_arg(SIZES, grouped), dy, grouped)
    compare_to_te(got, want, grouped)


# --- c. E > 64 on the grouped path --------------------------------------------------------


def _many_experts(experts=128, seed=7):
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(0, 40, (experts,), generator=g)
    sizes[::9] = 0
    return sizes.tolist()


@pytest.mark.parametrize("layout", ["separate", "stacked"])
def test_grouped_path_beyond_64_experts(layout):
    needs_grouped()
    Kc, Nc, experts = 128, 64, 128
    sizes = _many_experts(experts)
    Tc = sum(sizes)
    W = randn(experts, Nc, Kc, scale=0.05, seed=8)
    B = randn(experts, Nc, seed=9)
    x, dy = randn(Tc, Kc, seed=10), randn(Tc, Nc, seed=11)

    def run(grouped):
        xx = x.clone().requires_grad_()
        if layout == "stacked":
            ws, bs = torch.nn.Parameter(W.clone()), torch.nn.Parameter(B.clone())
        else:
            ws, bs = clone_params(W.unbind(0)), clone_params(B.unbind(0))
        splits = splits_arg(sizes, grouped)
        _, res = fd.grouped_linear_fwd(xx, ws, splits, bs, use_grouped_tensor=grouped, backend="te")
        assert res.path == ("grouped" if grouped else "split")
        y = fd.grouped_linear(xx, ws, splits, bs, use_grouped_tensor=grouped, backend="te")
        y.backward(dy)
        stack = (lambda t: t.grad) if layout == "stacked" else (lambda ts: torch.stack([t.grad for t in ts]))
        return y.detach(), xx.grad, stack(ws), stack(bs)

    got, split = run(True), run(False)
    y, dx, dw, db = ref_grouped_f64(x, W.unbind(0), B.unbind(0), sizes, dy)
    mags = ref_grouped_f64(x.abs(), W.abs().unbind(0), B.abs().unbind(0), sizes, dy.abs())
    for i, (r, what) in enumerate(zip((y, dx, torch.stack(dw), torch.stack(db)), ("y", "dx", "dw", "db"))):
        m = mags[i] if i < 2 else torch.stack(mags[i])
        rounds = 2 if what == "y" else 1  # beyond 64 experts the bias is added after the GEMM
        assert_close(got[i], r, BF16, f"{what} (grouped path) vs float64", mag=m, rounds=rounds)
        assert_close(split[i], r, BF16, f"{what} (split path) vs float64", mag=m, rounds=rounds)
    assert torch.count_nonzero(got[2][0]) == 0 and torch.count_nonzero(got[3][0]) == 0, "expert 0 has no tokens"


@pytest.mark.parametrize("main_grad", ["separate", "one-buffer"])
def test_grouped_path_beyond_64_experts_fused_main_grad(main_grad):
    """E > 64 list outputs: a scratch buffer then add (separate), or a zero-copy view (one buffer)."""
    needs_grouped()
    Kc, Nc, experts = 128, 64, 96
    sizes = _many_experts(experts, seed=12)
    Tc = sum(sizes)
    W = randn(experts, Nc, Kc, scale=0.05, seed=13)
    x, dy = randn(Tc, Kc, seed=14), randn(Tc, Nc, seed=15)

    def run(grouped):
        ws = clone_params(W.unbind(0))
        buf = torch.zeros(experts, Nc, Kc, dtype=torch.float32, device=DEV)
        for e, w in enumerate(ws):
            w.main_grad = buf[e] if main_grad == "one-buffer" else torch.zeros(Nc, Kc, dtype=torch.float32, device=DEV)
        snaps = []
        for _ in range(2):
            run_fd_grouped(x, ws, None, splits_arg(sizes, grouped), dy, grouped, fuse_wgrad_accumulation=True)
            snaps.append(torch.stack([w.main_grad for w in ws]).clone())
        assert all(w.grad is None for w in ws)
        return snaps

    (g1, g2), (s1, _) = run(True), run(False)
    equal(g2, 2 * g1, "second backward accumulates")
    _, _, dw, _ = ref_grouped_f64(x, W.unbind(0), None, sizes, dy)
    torch.testing.assert_close(g1, torch.stack(dw).float(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(g1, s1, rtol=1e-4, atol=1e-4)


# --- d. no host sync -----------------------------------------------------------------------


@pytest.mark.parametrize("experts", [E, 80])
def test_grouped_path_never_syncs(experts):
    needs_grouped()
    sizes = SIZES if experts == E else _many_experts(experts, seed=16)
    Tc = sum(sizes)
    ws = clone_params(randn(experts, N, K, scale=0.05, seed=17).unbind(0))
    bs = clone_params(randn(experts, N, seed=18).unbind(0))
    for w in ws:
        w.main_grad = torch.zeros(N, K, dtype=torch.float32, device=DEV)
    x, dy = randn(Tc, K, seed=19).requires_grad_(), randn(Tc, N, seed=20)
    splits = splits_arg(sizes, True)

    def step():
        y = fd.grouped_linear(x, ws, splits, bs, use_grouped_tensor=True, backend="te", fuse_wgrad_accumulation=True)
        y.backward(dy)

    step()  # warm-up: TE's workspaces, cuBLAS handles, the Triton dbias kernel
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


# --- e. fused wgrad accumulation -----------------------------------------------------------


@pytest.mark.parametrize("grouped", [False, True], ids=["split", "grouped"])
def test_fused_main_grad_accumulates_and_matches_te(grouped):
    if grouped:
        needs_grouped()
    m = te_grouped(grouped=grouped, fuse=True)
    ws, bs = clone_params(te_params(m, "weight")), clone_params(te_params(m, "bias"))
    for w in (*ws, *te_params(m, "weight")):
        w.main_grad = torch.zeros(N, K, dtype=torch.float32, device=DEV)
    x, dy = randn(T, K, seed=21), randn(T, N, seed=22)
    want = run_te_grouped(m, x, splits_arg(SIZES, grouped), dy)
    got = run_fd_grouped(x, ws, bs, splits_arg(SIZES, grouped), dy, grouped, fuse_wgrad_accumulation=True)
    first = [w.main_grad.clone() for w in ws]
    for e, (a, b) in enumerate(zip(first, te_params(m, "weight"))):
        equal(a, b.main_grad, f"main_grad[{e}] vs TE")
    assert all(w.grad is None for w in ws)
    equal(got["y"], want["y"], "y")
    equal(got["dx"], want["dx"], "dgrad")
    for e, (a, b) in enumerate(zip(got["db"], want["db"])):
        if grouped:
            torch.testing.assert_close(a, b)
        else:
            equal(a, b, f"dbias[{e}]")
    run_fd_grouped(x, ws, bs, splits_arg(SIZES, grouped), dy, grouped, fuse_wgrad_accumulation=True)
    for e, (w, f) in enumerate(zip(ws, first)):
        equal(w.main_grad, 2 * f, f"main_grad[{e}] after two backwards")


# --- f. CUDA graphs ------------------------------------------------------------------------


def test_cuda_graph_grouped_path_replays_like_eager():
    needs_grouped()
    x = randn(T, K, seed=23).requires_grad_()
    ws = clone_params(randn(E, N, K, scale=0.05, seed=24).unbind(0))
    bs = clone_params(randn(E, N, seed=25).unbind(0))
    dy = randn(T, N, seed=26)
    splits = splits_arg(SIZES, True)

    def step():
        y = fd.grouped_linear(x, ws, splits, bs, use_grouped_tensor=True, backend="te")
        y.backward(dy)
        return y

    def eager():  # fresh leaves with the static tensors' current values
        xx, ww, bb = x.detach().clone().requires_grad_(), clone_params(ws), clone_params(bs)
        y = fd.grouped_linear(xx, ww, splits.clone(), bb, use_grouped_tensor=True, backend="te")
        y.backward(dy.clone())
        return [y.detach(), xx.grad, *[w.grad for w in ww], *[b.grad for b in bb]]

    def clear():
        for t in (x, *ws, *bs):
            t.grad = None

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up, as torch.cuda.graphs' docs do
        for _ in range(2):
            clear()
            step()
    torch.cuda.current_stream().wait_stream(side)
    clear()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_static = step()

    for i, new_sizes in enumerate([SIZES, [0, 120, 40, 40]]):  # same T, new device splits
        with torch.no_grad():
            x.copy_(randn(T, K, seed=30 + i))
            dy.copy_(randn(T, N, seed=40 + i))
            splits.copy_(torch.tensor(new_sizes, device=DEV))
        want = eager()
        graph.replay()
        torch.cuda.synchronize()
        got = [y_static, x.grad, *[w.grad for w in ws], *[b.grad for b in bs]]
        for j, (a, b) in enumerate(zip(got, want)):
            if j >= 2 + E:  # bias grads: TE's Triton kernel uses fp32 atomics
                torch.testing.assert_close(a, b)
            else:
                equal(a, b, f"replay {i}, output {j}")


# --- g. other dtypes ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("grouped", [False, True], ids=["split", "grouped"])
def test_other_dtypes_match_te(dtype, grouped):
    if grouped and dtype == torch.float32:
        pytest.skip("fp32 has no grouped path (see the fallback test)")
    if grouped:
        needs_grouped(dtype)
    m = te_grouped(dtype=dtype, grouped=grouped)
    ws, bs = clone_params(te_params(m, "weight")), clone_params(te_params(m, "bias"))
    x, dy = randn(T, K, dtype=dtype, seed=27), randn(T, N, dtype=dtype, seed=28)
    want = run_te_grouped(m, x, splits_arg(SIZES, grouped), dy)
    got = run_fd_grouped(x, ws, bs, splits_arg(SIZES, grouped), dy, grouped)
    compare_to_te(got, want, grouped)
    if dtype == torch.float32:  # TE runs fp32 GEMMs in TF32: compare at TF32 precision
        y, dx, dw, db = ref_grouped_f64(x, ws, bs, SIZES, dy)
        for a, r, what in [(got["y"], y, "y"), (got["dx"], dx, "dx"), (torch.stack(got["dw"]), torch.stack(dw), "dw")]:
            err, scale = (a.double() - r).abs().max().item(), r.abs().max().item()
            assert err <= 5e-3 * max(scale, 1.0), f"{what}: {err} vs scale {scale} (TF32)"


def test_fp32_falls_back_to_split_path_with_a_warning():
    ws = clone_params(randn(E, N, K, dtype=torch.float32, scale=0.05, seed=29).unbind(0))
    x = randn(T, K, dtype=torch.float32, seed=30)
    with pytest.warns(UserWarning, match="bfloat16 or float16"):
        _, res = fd.grouped_linear_fwd(x, ws, splits_arg(SIZES, True), use_grouped_tensor=True, backend="te")
    assert res.path == "split"


# --- h. torch.autocast: TE's modules under it ------------------------------------------------


def _under_autocast(fn, x, dy):
    """(y, x's grad) of ``fn(x)`` run under bf16 autocast, backward outside it."""
    x = x.detach().clone().requires_grad_()
    with torch.autocast("cuda", dtype=BF16):
        y = fn(x)
    y.backward(dy)
    return y.detach(), x.grad


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused-main_grad"])
def test_linear_under_autocast_equals_te_linear(fused):
    """fp32 x and parameters under torch.autocast(bf16): te.Linear casts them to the autocast
    dtype (its activation dtype) and runs bf16 GEMMs; fd.linear on the TE backend gives its
    output and grads bitwise, the grads of fp32 tensors in fp32 (NOTE: [Autocast]); the bias
    grad as torch's composition rounds it."""
    lin = te.Linear(K, N, bias=True, params_dtype=torch.float32, device=DEV, fuse_wgrad_accumulation=fused)
    with torch.no_grad():
        lin.weight.copy_(randn(N, K, dtype=torch.float32, scale=0.05, seed=41))
        lin.bias.copy_(randn(N, dtype=torch.float32, seed=42))
    w, b = clone_params([lin.weight, lin.bias])
    if fused:
        lin.weight.main_grad = torch.zeros(N, K, dtype=torch.float32, device=DEV)
        w.main_grad = torch.zeros(N, K, dtype=torch.float32, device=DEV)
    x, dy = randn(4, 50, K, dtype=torch.float32, seed=43), randn(4, 50, N, seed=44)
    y_te, dx_te = _under_autocast(lin, x, dy)
    y_fd, dx_fd = _under_autocast(lambda x: fd.linear(x, w, b, fuse_wgrad_accumulation=fused, backend="te"), x, dy)
    assert y_fd.dtype == BF16 and dx_fd.dtype == torch.float32
    equal(y_fd, y_te, "y")
    equal(dx_fd, dx_te, "dgrad")
    # te.Linear (unfused) hands an fp32 bias the fp32 sum; torch's composition, and fd, the sum
    # rounded to the autocast dtype, as the product it belongs to (te.GroupedLinear does too)
    equal(b.grad, lin.bias.grad.to(BF16).float(), "dbias")
    if fused:
        equal(w.main_grad, lin.weight.main_grad, "main_grad")
    else:
        equal(w.grad, lin.weight.grad, "wgrad")


@pytest.mark.parametrize("grouped", [False, True], ids=["split", "grouped"])
def test_grouped_linear_under_autocast_equals_te(grouped):
    """The same for te.GroupedLinear with fp32 parameters, on both paths."""
    if grouped:
        needs_grouped()
    m = te_grouped(dtype=torch.float32, grouped=grouped)
    ws, bs = clone_params(te_params(m, "weight")), clone_params(te_params(m, "bias"))
    x, dy = randn(T, K, dtype=torch.float32, seed=45), randn(T, N, seed=46)
    splits = splits_arg(SIZES, grouped)
    y_te, dx_te = _under_autocast(lambda x: m(x, splits), x, dy)
    y_fd, dx_fd = _under_autocast(
        lambda x: fd.grouped_linear(x, ws, splits, bs, use_grouped_tensor=grouped, backend="te"), x, dy
    )
    want = {"y": y_te, "dx": dx_te, "dw": [w.grad for w in te_params(m, "weight")]}
    want["db"] = [b.grad for b in te_params(m, "bias")]
    got = {"y": y_fd, "dx": dx_fd, "dw": [w.grad for w in ws], "db": [b.grad for b in bs]}
    assert y_fd.dtype == BF16 and all(g.dtype == torch.float32 for g in [dx_fd, *got["dw"], *got["db"]])
    compare_to_te(got, want, grouped)


# --- DistributedWeight under saved-tensor hooks ----------------------------------------------


class FullDW(torch.nn.Parameter):
    """A DistributedWeight whose 'shard' is the full weight: materialize returns the group's
    weights as they are, finalize returns the grads unchanged; calls are counted."""

    is_distributed_weight = True

    def __new__(cls, data):
        self = super().__new__(cls, data.detach().clone(), True)
        self.group, self.calls = [self], Counter()
        return self

    @classmethod
    def group_of(cls, tensors):
        members = [cls(t) for t in tensors]
        for m in members:
            m.group = members
        return members

    def _gather(self, phase):
        self.calls[phase] += 1
        full = [m.detach() for m in self.group]
        return full if len(full) > 1 else full[0]

    def materialize_group_for_forward(self):
        return self._gather("forward")

    def materialize_group_for_backward(self, **kwargs):
        return self._gather("backward")

    def finalize_group_grads(self, wgrads):
        self.calls["finalize"] += 1
        return wgrads

    def grad_buffer(self):
        raise AssertionError("not fused in these tests")


LAYERS = [("linear", None), ("grouped", False), ("grouped", True)]
LAYER_IDS = ["linear", "grouped-split", "grouped-grouped"]


def _dw_run(layer, grouped, dw, hooks, backwards=1):
    experts = 1 if layer == "linear" else E
    W, B = randn(experts, N, K, scale=0.05, seed=31), randn(experts, N, seed=32)
    x = randn(T, K, seed=33).requires_grad_()
    dy = randn(T, N, seed=34)
    ws = FullDW.group_of(W.unbind(0)) if dw else clone_params(W.unbind(0))
    bs = clone_params(B.unbind(0))
    ctx = torch.autograd.graph.save_on_cpu(pin_memory=True) if hooks else contextlib.nullcontext()
    with ctx:
        if layer == "linear":
            y = fd.linear(x, ws[0], bs[0], backend="te")
        else:
            y = fd.grouped_linear(x, ws, splits_arg(SIZES, grouped), bs, use_grouped_tensor=grouped, backend="te")
    for i in range(backwards):
        y.backward(dy, retain_graph=i < backwards - 1)
    return {"y": y.detach(), "dx": x.grad, "dw": [w.grad for w in ws], "db": [b.grad for b in bs]}, ws


@pytest.mark.parametrize("layer,grouped", LAYERS, ids=LAYER_IDS)
def test_distributed_weight_under_save_on_cpu(layer, grouped):
    if grouped:
        needs_grouped()
    want, _ = _dw_run(layer, grouped, dw=False, hooks=False)
    got, ws = _dw_run(layer, grouped, dw=True, hooks=True)
    assert ws[0].calls == Counter(forward=1, backward=1, finalize=1)
    assert all(not w.calls for w in ws[1:]), "followers are never called"
    equal(got["y"], want["y"], "y")
    equal(got["dx"], want["dx"], "dgrad")
    for e, (a, b) in enumerate(zip(got["dw"], want["dw"])):
        equal(a, b, f"wgrad[{e}]")
    for e, (a, b) in enumerate(zip(got["db"], want["db"])):
        if grouped:  # TE's grouped dbias kernel uses fp32 atomics
            torch.testing.assert_close(a, b)
        else:
            equal(a, b, f"dbias[{e}]")


def test_retain_graph_twice_on_grouped_path_under_hooks():
    needs_grouped()
    once, _ = _dw_run("grouped", True, dw=True, hooks=True)
    twice, ws = _dw_run("grouped", True, dw=True, hooks=True, backwards=2)
    assert ws[0].calls == Counter(forward=1, backward=2, finalize=2)
    equal(twice["dx"], 2 * once["dx"], "dgrad x2")
    for e, (a, b) in enumerate(zip(twice["dw"], once["dw"])):
        equal(a, 2 * b, f"wgrad[{e}] x2")
    for a, b in zip(twice["db"], once["db"]):
        torch.testing.assert_close(a, 2 * b)


# --- any layout, strided main_grad, partly frozen groups, inference tensors, fake CUDA tensors ---


def _paths():
    """Both paths where TE's grouped path runs, else the split path only; with
    FDW_EXPECT_GROUPED=1 both (the grouped cases then fail in needs_grouped(): it must run)."""
    why = grouped_unavailable()
    return [False, True] if why is None or os.environ.get("FDW_EXPECT_GROUPED") == "1" else [False]


PATHS = _paths()


def _data(experts=E, sizes=SIZES, seed=0):
    return grouped_inputs(sizes, K, N, experts=experts, seed=seed, dtype=BF16, w_div=16, device=DEV)


def _strided(t: torch.Tensor) -> torch.Tensor:
    """The same values, column-major (a transposed copy viewed back)."""
    return t.t().contiguous().t() if t.dim() == 2 else t[None].expand(2, *t.shape)[1]


def _run(x, ws, bs, dy, sizes, path, fuse=False, main_grads=None):
    if path:
        needs_grouped()
    x = x.detach().clone().requires_grad_()
    params = [w.detach().requires_grad_() for w in ws]
    biases = [b.detach().requires_grad_() for b in bs]
    for p, mg in zip(params, main_grads or []):
        p.main_grad = mg
    splits = torch.tensor(sizes, device=DEV) if path else list(sizes)
    y, res = fd.grouped_linear_fwd(
        x, params, splits, biases, use_grouped_tensor=path, backend="te", fuse_wgrad_accumulation=fuse
    )
    assert res.path == ("grouped" if path else "split") and res.kernels.name == "te"
    dx, dws, dbs = fd.grouped_linear_bwd(res, dy)
    return y, dx, dws, dbs


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("operand", ["x", "weights", "bias", "dy"])
def test_te_any_layout_gives_the_contiguous_bits(path, operand):
    x, ws, bs, dy = _data()
    want = _run(x, ws, bs, dy, SIZES, path)
    if operand == "x":
        x = _strided(x)
    elif operand == "weights":
        ws = [_strided(w) for w in ws]
    elif operand == "bias":
        bs = [_strided(b) for b in bs]
    else:
        dy = _strided(dy)
    got = _run(x, ws, bs, dy, SIZES, path)
    for a, b in zip(got[:2], want[:2]):
        assert_same(a, b, operand)
    assert_same(list(got[2]), list(want[2]), f"{operand}: dW")
    assert_same(list(got[3]), list(want[3]), f"{operand}: db")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("experts", [4, 70])
def test_te_strided_main_grad_accumulates_into_the_callers_tensor(path, experts):
    sizes = [T // experts] * experts
    sizes[0] += T - sum(sizes)
    x, ws, bs, dy = _data(experts, sizes)
    dense = [torch.full((N, K), 0.25, device=DEV) for _ in range(experts)]
    strided = [torch.full((K, N), 0.25, device=DEV).t() for _ in range(experts)]
    _run(x, ws, bs, dy, sizes, path, fuse=True, main_grads=dense)
    _run(x, ws, bs, dy, sizes, path, fuse=True, main_grads=strided)
    for a, b in zip(strided, dense):
        assert not a.is_contiguous()
        assert_same(a.contiguous(), b, "main_grad")


@pytest.mark.parametrize("path", PATHS)
def test_te_partly_frozen_group_with_fused_wgrad(path):
    if path:
        needs_grouped()
    x, ws, bs, dy = _data()
    params = [w.detach().requires_grad_(e != 2) for e, w in enumerate(ws)]
    for e, p in enumerate(params):
        if e != 2:
            p.main_grad = torch.zeros(N, K, device=DEV)
    params[2].main_grad = torch.full((N, K), 7.0, device=DEV)  # frozen: untouched
    splits = torch.tensor(SIZES, device=DEV) if path else SIZES
    y = fd.grouped_linear(x, params, splits, fuse_wgrad_accumulation=True, use_grouped_tensor=path, backend="te")
    y.backward(dy)
    assert_same(params[2].main_grad, torch.full((N, K), 7.0, device=DEV))
    for e in (0, 1, 3):
        xe = x.float().split(SIZES)[e]
        dye = dy.float().split(SIZES)[e]
        torch.testing.assert_close(params[e].main_grad, dye.T @ xe, rtol=1e-2, atol=1e-2)


def test_te_refuses_a_float64_main_grad():
    x, ws, _, dy = _data()
    w = ws[0].detach().requires_grad_()
    w.main_grad = torch.zeros(N, K, dtype=torch.float64, device=DEV)
    y = fd.linear(x, w, fuse_wgrad_accumulation=True, backend="te")
    with pytest.raises(TypeError, match="main_grad is torch.float64, but backend='te'"):
        y.backward(dy)


@pytest.mark.parametrize("path", PATHS)
def test_te_inference_weights(path):
    if path:
        needs_grouped()
    with torch.inference_mode():
        x, ws, bs, _ = _data()
        mod = fd.nn.GroupedLinear(E, K, N, params_dtype=BF16, device=DEV, use_grouped_tensor=path, backend="te")
    splits = torch.tensor(SIZES, device=DEV) if path else SIZES
    with torch.inference_mode():
        y = fd.grouped_linear(x, ws, splits, bs, use_grouped_tensor=path, backend="te")
        ym = mod(x, splits)
    with torch.no_grad():
        y2 = fd.grouped_linear(
            x.clone(), [w.clone() for w in ws], splits, [b.clone() for b in bs], use_grouped_tensor=path, backend="te"
        )
    assert_same(y, y2)
    assert ym.shape == (T, N) and ym.grad_fn is None


def test_fake_cuda_tensors_get_shapes_from_te_ops():
    from torch._subclasses.fake_tensor import FakeTensorMode

    if True in PATHS:
        needs_grouped()
    with FakeTensorMode():
        x = torch.empty(T, K, dtype=BF16, device=DEV, requires_grad=True)
        ws = [torch.empty(N, K, dtype=BF16, device=DEV, requires_grad=True) for _ in range(E)]
        for path in PATHS:
            y = fd.grouped_linear(x, ws, SIZES, use_grouped_tensor=path)
            assert y.shape == (T, N) and y.device.type == "cuda"
            y.sum().backward()
        assert x.grad.shape == (T, K) and ws[0].grad.shape == (N, K)
        assert fd.linear(x, ws[0]).shape == (T, N)
