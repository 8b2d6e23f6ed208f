"""The MoE layer on CUDA (``functional_dw/moe.py``): bf16 against the float64 per-token reference
of ``test_moe.py`` without a host sync, and the whole layer (router to combine, forward and
backward) in one CUDA graph replaying new tokens bit for bit like eager. Marked ``gpu``: skipped
without CUDA."""

from __future__ import annotations

import pytest
import torch
from test_moe import _reference

import functional_dw as fd

pytestmark = pytest.mark.gpu


# --- on CUDA: the layer against the reference, no host sync, one CUDA graph ----------------------


def _cuda_moe(dtype: torch.dtype, seed: int = 0) -> fd.nn.MoE:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.manual_seed(seed)
    return fd.nn.MoE(8, 64, 32, 2, params_dtype=dtype, device="cuda")


def _eager_grads(m: fd.nn.MoE, x: torch.Tensor, dy: torch.Tensor) -> list[torch.Tensor]:
    """y, dx and every parameter's grad of one eager step, through autograd.grad (no .grad touched)."""
    x = x.detach().requires_grad_()
    y = m(x)
    return [y.detach(), *torch.autograd.grad(y, [x, *m.parameters()], dy)]


def test_cuda_layer_matches_the_reference_without_a_host_sync():
    """bf16 on CUDA (torch's grouped GEMM over device-side splits) against the float64 per-token
    reference; the eager step runs with CUDA's sync debug mode set to raise."""
    m = _cuda_moe(torch.bfloat16)
    x = torch.randn(96, 64, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    _eager_grads(m, x, dy)  # (plans made and kernels compiled before the check)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y, dx, *_ = _eager_grads(m, x, dy)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    w = [
        p.detach().double().cpu().requires_grad_()
        for p in (m.router.weight, m.experts.fc1.weight, m.experts.fc2.weight)
    ]
    x64 = x.double().cpu().requires_grad_()
    want = _reference(x64, *w, 2)
    (dx_want,) = torch.autograd.grad(want, [x64], dy.double().cpu())
    torch.testing.assert_close(y.double().cpu(), want, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(dx.double().cpu(), dx_want, atol=3e-2, rtol=3e-2)


def test_graph_step_captures_the_whole_layer_and_replays_new_tokens_like_eager():
    """Router to combine, forward and backward, in one CUDA graph (graph_step checks that no
    warm-up syncs): each replay with new tokens (so a new routing) gives eager's y, dx and
    parameter grads bit for bit."""
    from functional_dw.graphs import graph_step

    m = _cuda_moe(torch.bfloat16, seed=1)
    x = torch.randn(128, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(128, 64, device="cuda", dtype=torch.bfloat16)

    def step(x, dy):
        y = m(x)
        y.backward(dy)
        return y.detach()

    params = list(m.parameters())
    g = graph_step(step, x, dy, params=params)
    for i in range(3):
        gen = torch.Generator(device="cuda").manual_seed(100 + i)
        xi = torch.randn(128, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
        dyi = torch.randn(128, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
        y = g(xi, dyi)
        got = [y, x.grad, *[p.grad for p in params]]
        want = _eager_grads(m, xi, dyi)
        for name, a, b in zip(["y", "dx", *[n for n, _ in m.named_parameters()]], got, want):
            assert torch.equal(a, b), f"replay {i}: {name} differs from eager"


# --- expert parallelism over NCCL -----------------------------------------------------------------


@pytest.mark.parametrize("P", [1, 2], ids=lambda p: f"{p}gpus")
def test_expert_parallel_over_nccl_is_bitwise_one_rank(P):
    """moe_ep's exchange over NCCL (one GPU per rank, bf16, the default backend): as on gloo,
    each rank's y, dx and expert grads bitwise one rank holding every token and expert. One
    rank runs the CUDA exchange path on any GPU machine; two need two GPUs."""
    if torch.cuda.device_count() < P:
        pytest.skip(f"needs {P} GPUs")
    fdd = pytest.importorskip("functional_dw.distributed")
    from test_moe import _ep_job, check_ep

    results = fdd.launch(_ep_job, P, 8, 256, 2, "cuda", (64, 32), backend="nccl", timeout=120, deadline=300)
    check_ep(P, results, E=8)
