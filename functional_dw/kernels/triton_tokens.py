"""An MoE's per-token sum on CUDA in one Triton launch: each token's ``k`` rows, read through
the rows' positions, summed in choice order in float32 and rounded once (``moe_ep.token_sum``
defines it; this computes the same float32 adds in the same order, so the same bits).

What the fusion saves: torch's composition gathers the ``[T * k, H]`` rows into token order
(``index_select``: a read and a write of every row), then reduces them (another read; torch's
reduction over a middle dimension of ``k`` runs at about half the bandwidth, measured on the
H100). This reads every row once and writes ``[T, H]`` once: the combine's forward, the
dispatch's backward and grouped_mlp's ``TopkRows`` dx each take one launch.
"""

from __future__ import annotations

import contextlib

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch builds ship no Triton
    triton = None

from .triton_launch import launch

__all__ = ["available", "token_sum"]

_FLOATS = (torch.bfloat16, torch.float16, torch.float32)

if triton is not None:

    @triton.jit
    def _token_sum_kernel(
        rows_ptr,
        stride_r,
        pos_ptr,
        out_ptr,
        T,
        H,
        K,
        BT: tl.constexpr,
        BH: tl.constexpr,
    ):
        t = tl.program_id(0) * BT + tl.arange(0, BT)
        h = tl.program_id(1) * BH + tl.arange(0, BH)
        t_ok = t < T
        mask = t_ok[:, None] & (h < H)[None, :]
        r = tl.load(pos_ptr + t.to(tl.int64) * K, mask=t_ok, other=0).to(tl.int64)
        # choice 0 as loaded, not 0.0 + r_0 (which turns -0.0 into +0.0): the torch ops' first term
        acc = tl.load(rows_ptr + r[:, None] * stride_r + h[None, :], mask=mask, other=0.0).to(tl.float32)
        for j in range(1, K):  # choice order: ((r_0 + r_1) + r_2) + ... in float32
            r = tl.load(pos_ptr + t.to(tl.int64) * K + j, mask=t_ok, other=0).to(tl.int64)
            acc += tl.load(rows_ptr + r[:, None] * stride_r + h[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + t.to(tl.int64)[:, None] * H + h[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


def available(rows: torch.Tensor) -> bool:
    """Whether the kernel runs on ``rows`` here: a plain CUDA tensor (no subclass, no functorch
    wrapper) of bf16/fp16/fp32, 2-D with unit column stride, Triton importable, and nothing to
    record (the kernel has no derivative: not while autograd records rows, under forward-mode
    AD, a torch.func transform or a compile, where the torch ops run: the same adds, the same bits)."""
    return (
        triton is not None
        and not torch.compiler.is_compiling()  # first: dynamo cannot trace what follows (a graph break)
        and type(rows) is torch.Tensor  # (no subclass: fake tensors, DTensor, a wrapper's data pointer)
        and rows.is_cuda
        and rows.dtype in _FLOATS
        and rows.dim() == 2
        and (rows.stride(1) == 1 or rows.shape[1] <= 1)
        and not torch._C._functorch.is_functorch_wrapped_tensor(rows)
        and not (torch.is_grad_enabled() and rows.requires_grad)
        and torch.autograd.forward_ad._current_level < 0
        and torch._C._functorch.peek_interpreter_stack() is None
    )


def token_sum(rows: torch.Tensor, pos: torch.Tensor, top_k: int) -> torch.Tensor:
    """``[T, H]``: ``out[t] = sum_j rows[pos[t * k + j]]``, the adds in float32 in ``j`` order,
    rounded once to rows' dtype. ``rows`` ``[T * k, H]`` (:func:`available`), ``pos`` ``[T * k]``
    int64 on its device (the inverse of the dispatch's order: where each (token, choice) row is)."""
    R, H = rows.shape
    T = R // top_k
    out = torch.empty((T, H), dtype=rows.dtype, device=rows.device)
    if T == 0 or H == 0:
        return out
    BH = min(256, triton.next_power_of_2(H))
    BT = max(1, 2048 // BH)
    with torch.cuda.device(rows.device) if rows.is_cuda else contextlib.nullcontext():  # (the interpreter: CPU)
        launch(
            _token_sum_kernel,
            (triton.cdiv(T, BT), triton.cdiv(H, BH)),
            (rows, rows.stride(0), pos.contiguous(), out, T, H, top_k),
            dict(BT=BT, BH=BH, num_warps=4),
        )
    return out
