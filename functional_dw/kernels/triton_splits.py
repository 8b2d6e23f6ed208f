"""Device splits' bookkeeping in one launch (see NOTE: [Device splits are clamped] in
``kernels/splits.py``).

From E raw token counts on the GPU (any integer dtype, possibly negative or summing past T)
one Triton program writes the memory-safe counts (int64, what TE's grouped GEMM reads) and
their running ends (int32, what torch's grouped GEMM reads). The same in torch ops takes six
launches; a launch costs tens of microseconds of host time on a busy GPU, and a small MoE
layer is launch-bound (benchmarks/results). Without Triton, ``Splits`` uses the torch ops.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch builds ship no Triton
    triton = None

from .triton_launch import launch

__all__ = ["clamp_splits"]

_MAX_EXPERTS = 1 << 14  # one program scans them all; beyond this the torch ops run

if triton is not None:

    @triton.jit
    def _clamp_splits_kernel(s_ptr, counts_ptr, ends_ptr, E, T, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        valid = i < E
        s = tl.minimum(tl.maximum(tl.load(s_ptr + i, mask=valid, other=0).to(tl.int64), 0), T)  # no overflow
        running = tl.cumsum(s, axis=0)
        ends = tl.where(i == E - 1, T, tl.minimum(running, T))  # the last expert ends at T
        starts = tl.minimum(running - s, T)
        tl.store(counts_ptr + i, ends - starts, mask=valid)
        tl.store(ends_ptr + i, ends.to(tl.int32), mask=valid)


def clamp_splits(splits_E: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(counts int64 ``[E]``, ends int32 ``[E]``): negatives count as 0, each count is
    capped at ``num_tokens`` (so the int64 running sum cannot overflow), the running sum
    stops at ``num_tokens`` and the last expert ends there. None where Triton cannot run it (the caller uses torch ops)."""
    E = splits_E.shape[0]
    if triton is None or not splits_E.is_cuda or not 0 < E <= _MAX_EXPERTS:
        return None
    counts = torch.empty(E, dtype=torch.int64, device=splits_E.device)
    ends = torch.empty(E, dtype=torch.int32, device=splits_E.device)
    with torch.cuda.device(splits_E.device):
        launch(
            _clamp_splits_kernel,
            (1,),
            (splits_E.contiguous(), counts, ends, E, num_tokens),
            dict(BLOCK=max(16, triton.next_power_of_2(E))),
        )
    return counts, ends
