"""Fused wgrad accumulation (``fuse_wgrad_accumulation=True``): the weight gradient is added into
the weight's fp32 ``main_grad`` (or a DistributedWeight's ``grad_buffer()``, or Megatron FSDP's
``get_main_grad()``) instead of being returned; frozen weights, all or some of a group, get no
gradient and their buffers are left alone; ``main_grad`` dtypes (float64 accumulates in float64,
integers are refused); the split wgrad kernel's ``out=`` and ``accumulate``."""

from __future__ import annotations

import contextlib
import functools
import importlib

import pytest
import torch

import functional_dw as fd
from conftest import FakeDW, assert_close, assert_same
from functional_dw.kernels.torch_ref import TorchKernels
from helpers import grouped_inputs, randn, ref_grouped

dwp = importlib.import_module("functional_dw.distributed_weight")

# (The tests up to the next section were written to kill mutants of `bash .ci/mutation`, with these sizes.)
D = torch.float64
SPLITS = (2, 0, 3)
E, K, N, T = 3, 8, 4, sum(SPLITS)
_rand = functools.partial(randn, dtype=D, draw_dtype=None)  # (drawn in the given dtype)


# --- frozen weights: no weight grad, the bias grad still comes ---------------------------------


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


# --- where the wgrad GEMM writes: Megatron FSDP's main grad, a DistributedWeight's buffer, out= ---


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


@pytest.mark.parametrize("layer", ["linear", "grouped"])
def test_fused_distributed_weight_buffer_is_overwritten_not_accumulated(layer):
    """A DW's finalize does the accumulating (TE's rule): the wgrad GEMM overwrites whatever
    the gathered grad buffer held."""
    n = 1 if layer == "linear" else E
    ws = FakeDW.group_of([_rand(2 * N, K, seed=5 + e) for e in range(n)], fused=True)
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


# --- a partly frozen group; main_grad dtypes ---------------------------------------------------

GROUP_SPLITS = [2, 0, 3, 1]
GROUP_K, GROUP_N = 16, 8
PATHS = [pytest.param(False, id="split"), pytest.param(True, id="grouped")]


def _group(dtype=torch.float32, seed=0, requires_grad=True):
    """x, weights and biases (lists); weights drawn / 4."""
    return grouped_inputs(
        GROUP_SPLITS, GROUP_K, GROUP_N, seed=seed, dtype=dtype, w_div=4, dy=False, grad=requires_grad
    )[:3]


@pytest.mark.parametrize("path", PATHS)
def test_partly_frozen_group_leaves_frozen_main_grads_alone(path):
    x, ws, _ = _group()
    frozen = {1, 3}
    for e, w in enumerate(ws):
        w.requires_grad_(e not in frozen)
        if e not in frozen:
            w.main_grad = torch.full((GROUP_N, GROUP_K), 0.5)
            w.grad_added_to_main_grad = False
    ws[3].main_grad = torch.full((GROUP_N, GROUP_K), 7.0)  # frozen, but holding a buffer: must stay 7
    y = fd.grouped_linear(x, ws, GROUP_SPLITS, fuse_wgrad_accumulation=True, use_grouped_tensor=path)
    y.square().sum().backward()
    ref_ws = [w.detach().double().requires_grad_() for w in ws]
    dws = torch.autograd.grad(ref_grouped(x.detach().double(), ref_ws, GROUP_SPLITS).square().sum(), ref_ws)
    for e, w in enumerate(ws):
        if e in frozen:
            assert w.grad is None and not hasattr(w, "grad_added_to_main_grad")
        else:
            assert_close(w.main_grad, dws[e] + 0.5, torch.float32, f"main_grad[{e}]")
            assert w.grad_added_to_main_grad is True
            assert_same(w.grad, torch.zeros_like(w))
    assert_same(ws[3].main_grad, torch.full((GROUP_N, GROUP_K), 7.0))
    assert x.grad is not None


def test_linear_frozen_weight_without_main_grad_is_fine():
    x, ws, bs = _group()
    ws[0].requires_grad_(False)
    fd.linear(x, ws[0], bs[0], fuse_wgrad_accumulation=True).sum().backward()
    assert ws[0].grad is None and not hasattr(ws[0], "main_grad") and bs[0].grad is not None


@pytest.mark.parametrize("layer", ["linear", "grouped-split", "grouped-grouped"])
def test_float64_main_grad_accumulates_in_float64(layer):
    x, ws, _ = _group(torch.bfloat16)
    for w in ws:
        w.main_grad = torch.zeros(GROUP_N, GROUP_K, dtype=torch.float64)
    if layer == "linear":
        y, used = fd.linear(x, ws[0], fuse_wgrad_accumulation=True), ws[:1]
    else:
        y, used = (
            fd.grouped_linear(
                x, ws, GROUP_SPLITS, fuse_wgrad_accumulation=True, use_grouped_tensor=layer.endswith("grouped")
            ),
            ws,
        )
    dy = torch.randn(y.shape).to(y.dtype)
    y.backward(dy)
    xs = x.detach().double().split(GROUP_SPLITS) if layer != "linear" else [x.detach().double()]
    dys = dy.double().split(GROUP_SPLITS) if layer != "linear" else [dy.double()]
    for w, xe, dye in zip(used, xs, dys):
        assert w.main_grad.dtype == torch.float64
        torch.testing.assert_close(w.main_grad, dye.T @ xe, rtol=1e-12, atol=1e-12)  # products of bf16 values: exact


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool])
@pytest.mark.parametrize("layer", ["linear", "grouped"])
def test_integer_main_grad_is_refused(dtype, layer):
    x, ws, _ = _group()
    for w in ws:
        w.main_grad = torch.zeros(GROUP_N, GROUP_K, dtype=dtype)
    y = (
        fd.linear(x, ws[0], fuse_wgrad_accumulation=True)
        if layer == "linear"
        else fd.grouped_linear(x, ws, GROUP_SPLITS, fuse_wgrad_accumulation=True)
    )
    with pytest.raises(TypeError, match=r"weights?(\[0\])?: main_grad/grad_buffer\(\) is torch\.(int|bool)"):
        y.sum().backward()
    assert all(not w.main_grad.any() for w in ws)


# --- under torch.autocast (NOTE: [Autocast] in functional_dw/_amp.py) -------------------------------


@pytest.mark.parametrize("path", [False, True], ids=["split", "grouped"])
@pytest.mark.parametrize("layer", ["linear", "grouped"])
def test_fused_under_autocast_writes_the_fp32_main_grad_of_the_parameter(layer, path):
    """fp32 weights with fp32 main_grads under bf16 autocast: the wgrad GEMM of the bf16 operands
    lands in each parameter's own main_grad at fp32 accuracy (the float64 product of the bf16
    values), the parameters get no .grad; x's grad comes back fp32. (The original refused the
    bf16 dy in backward.)"""
    splits = [40, 0, 20, 4]
    x, ws, _, dy = grouped_inputs(splits, 16, 8, seed=4, w_div=4, bias=False, experts=1 if layer == "linear" else 4)
    if layer == "linear":
        splits = [sum(splits)]
    for w in ws:
        w.requires_grad_()
        w.main_grad = torch.full_like(w, 0.5)
    x.requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        if layer == "linear":
            y = fd.linear(x, ws[0], fuse_wgrad_accumulation=True)
        else:
            y = fd.grouped_linear(x, ws, splits, fuse_wgrad_accumulation=True, use_grouped_tensor=path)
    y.backward(dy.to(torch.bfloat16))
    assert y.dtype == torch.bfloat16 and x.grad.dtype == torch.float32
    x16, dy16 = x.detach().to(torch.bfloat16).double(), dy.to(torch.bfloat16).double()
    for w, xe, de in zip(ws, x16.split(splits), dy16.split(splits)):
        assert w.grad is None and w.main_grad.dtype == torch.float32
        assert_close(w.main_grad, 0.5 + de.T @ xe, torch.bfloat16, "main_grad", mag=0.5 + de.abs().T @ xe.abs())


def test_backward_inside_an_autocast_region_keeps_fp32_products():
    """autograd runs backward under the autocast state of the thread that calls it: a backward
    called inside an autocast region runs with autocast off, so an fp32 main_grad still gets the
    fp32 product of bf16 operands (autocast would make the split path's and linear's matmuls
    bf16), bitwise the backward outside it; on each path and for linear."""
    splits = [40, 0, 20, 4]
    x, ws, _, dy = grouped_inputs(splits, 16, 8, seed=5, dtype=torch.bfloat16, bias=False)
    for case in ("split", "grouped", "linear"):
        mains = []
        for inside in (False, True):
            params = [w.detach().clone().requires_grad_() for w in ws]
            for p in params:
                p.main_grad = torch.zeros(p.shape)
            if case == "linear":
                y = fd.linear(x, params[0], fuse_wgrad_accumulation=True)
            else:
                y = fd.grouped_linear(
                    x, params, splits, fuse_wgrad_accumulation=True, use_grouped_tensor=case == "grouped"
                )
            with torch.autocast("cpu", dtype=torch.bfloat16) if inside else contextlib.nullcontext():
                y.backward(dy)
            mains.append([p.main_grad for p in params])
        assert_same(mains[1], mains[0], case)
