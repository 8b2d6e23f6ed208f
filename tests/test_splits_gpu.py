"""Device-only splits on a GPU: the one-launch Triton bookkeeping (``kernels/triton_splits``)
gives the same memory-safe counts and ends as the torch ops, and the layer on torch's grouped
GEMM survives bad device splits without a device-side assert. Skips cleanly without CUDA."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

import functional_dw as fd  # noqa: E402
from functional_dw.kernels import Splits  # noqa: E402
from functional_dw.kernels.triton_splits import triton  # noqa: E402

CASES = [
    ([5, -3, 9, 4], 10),
    ([3, 0, 7], 10),
    ([0] * 5, 0),
    (list(range(-3, 40)), 100),
    ([2**31 - 1, 5], 7),
    ([1] * 1000, 1000),
    ([2, 3], 10),
    ([4, -1, 0], 9),
]


def expected(sizes, T):
    counts, ends, run = [], [], 0
    for s in sizes:
        start = min(run, T)
        run += max(s, 0)
        counts.append(min(run, T) - start)
        ends.append(min(run, T))
    if sizes:  # the last expert ends at T: it takes the rows the counts leave over
        counts[-1] += T - ends[-1]
        ends[-1] = T
    return counts, ends


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("sizes,T", CASES)
def test_device_splits_are_clamped_in_one_launch(sizes, T, dtype):
    if triton is None:
        pytest.skip("Triton is not installed: the torch ops run (tested on the CPU)")
    s = Splits(
        host=None,
        tensor=torch.tensor(sizes, dtype=dtype, device="cuda"),
        device=torch.device("cuda"),
        num_tokens=T,
        num_experts=len(sizes),
    )
    counts, ends = expected(sizes, T)
    assert s.on_device().dtype == torch.int64 and s.on_device().tolist() == counts
    assert s.ends(torch.int32).tolist() == ends
    assert s.ends(torch.int64).tolist() == ends  # the torch ops, for the int64 request
    assert s._cache.get("fused") is not None, "the Triton path ran"


@pytest.mark.parametrize("sizes,T", [([2**62, 2**62, 5], 10), ([3, 2**63 - 1, 2**63 - 1, 1], 9)])
def test_device_counts_near_int64s_limit_do_not_wrap_in_the_triton_launch(sizes, T):
    if triton is None:
        pytest.skip("Triton is not installed")
    s = Splits(
        host=None,
        tensor=torch.tensor(sizes, dtype=torch.int64, device="cuda"),
        device=torch.device("cuda"),
        num_tokens=T,
        num_experts=len(sizes),
    )
    counts, ends = expected(sizes, T)
    assert s.on_device().tolist() == counts and s.ends(torch.int32).tolist() == ends
    assert s._cache.get("fused") is not None, "the Triton path ran"


def test_grouped_mm_layer_with_bad_device_splits_does_not_assert():
    """Splits summing past T and a negative count: wrong rows, not a device-side assert."""
    x = torch.randn(64, 32, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(3, 16, 32, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    bad = torch.tensor([48, -16, 48], device="cuda")
    y = fd.grouped_linear(x, w, bad, backend="auto")
    y.sum().backward()
    torch.cuda.synchronize()
    good = fd.grouped_linear(x.detach(), w.detach(), [48, 0, 16], backend="torch")
    torch.testing.assert_close(y.detach(), good, rtol=0, atol=0)  # the same kernels on the clamped offsets


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_device_splits_on_a_second_gpu_while_the_first_is_current():
    """The one-launch kernel runs on the splits' GPU and its stream, not the current device's."""
    torch.cuda.set_device(0)
    x = torch.randn(64, 32, device="cuda:1", dtype=torch.bfloat16)
    w = torch.randn(3, 16, 32, device="cuda:1", dtype=torch.bfloat16)
    y = fd.grouped_linear(x, w, torch.tensor([16, 0, 48], device="cuda:1"), backend="auto")
    torch.testing.assert_close(y, fd.grouped_linear(x, w, [16, 0, 48], backend="auto"), rtol=0, atol=0)
