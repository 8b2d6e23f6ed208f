"""The expert MLP's activation on CUDA: one Triton launch forward, one backward.

``activation.py`` defines the math and the numerics contract; these kernels compute the same
float32 expressions in the same order (``triton_math.py``: IEEE division, libdevice's
``exp``/``erf``, no fused multiply-adds) and round once, so ``h`` and ``dfc1_out`` are
bitwise the reference's on the same GPU (GELU's not quite: NOTE: [erf] in ``triton_math.py``; the GPU
tests check it); ``dprobs`` is a row sum in the kernel's order (equal within fp32 summation
error).

What the fusion saves: the reference runs each expression as its own torch kernel (SwiGLU
forward with probs: chunk, silu, mul, mul, cast: ~5 launches, each a pass over ``[T, F]``;
backward ~15), these read ``fc1_out`` (and ``dh``) once and write ``h`` (``dfc1_out`` and
``dprobs``) once.

Forward: a 2-D grid of ``[BT, BF]`` tiles. Backward: one program per ``BT`` rows, stepping
through the ffn width in ``BF`` columns (``dprobs`` is a row sum: each program owns its rows,
so the sum is deterministic, no atomics).
"""

from __future__ import annotations

from typing import Any

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch builds ship no Triton
    triton = None

from ..activations import get
from .torch_activation import TorchActivation
from .triton_math import act, act_grad, h_tile, interpreting
from .triton_launch import launch

__all__ = ["TritonActivation", "available"]

_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


def available(t: Any) -> bool:
    """Whether the kernels run on ``t``: a plain CUDA tensor of bf16/fp16/fp32 with Triton
    (float64 and functorch wrappers run the reference)."""
    return (
        triton is not None
        and isinstance(t, torch.Tensor)
        and t.is_cuda
        and t.dtype in _FLOATS
        and not torch._C._functorch.is_functorch_wrapped_tensor(t)
    )


if triton is not None:

    @triton.jit
    def _fwd_kernel(
        z_ptr,
        stride_z,
        p_ptr,
        h_ptr,
        T,
        F,
        ACT: tl.constexpr,
        GATED: tl.constexpr,
        HAS_P: tl.constexpr,
        BT: tl.constexpr,
        BF: tl.constexpr,
        INTERP: tl.constexpr,
    ):
        """``h [T, F] = act(fc1_out) * probs`` for one ``[BT, BF]`` tile (ACT, GATED: ``triton_math.py``)."""
        rows = tl.program_id(0) * BT + tl.arange(0, BT)
        cols = tl.program_id(1) * BF + tl.arange(0, BF)
        rmask = rows < T
        m = rmask[:, None] & (cols < F)[None, :]
        rows64 = rows.to(tl.int64)
        a = h_tile(z_ptr, stride_z, rows, rmask, cols, cols < F, p_ptr, F, ACT, GATED, HAS_P, INTERP)
        tl.store(h_ptr + rows64[:, None] * F + cols[None, :], a.to(h_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _bwd_kernel(
        z_ptr,
        stride_z,
        p_ptr,
        dh_ptr,
        stride_dh,
        dz_ptr,
        dp_in_ptr,
        dp_ptr,
        T,
        F,
        ACT: tl.constexpr,
        GATED: tl.constexpr,
        HAS_P: tl.constexpr,
        HAS_DP_IN: tl.constexpr,
        BT: tl.constexpr,
        BF: tl.constexpr,
        INTERP: tl.constexpr,
    ):
        """``dfc1_out = act'(fc1_out) * (dh * p)`` for ``BT`` rows, and ``dprobs = sum_F act * dh``
        (+ ``dprobs_in``)."""
        rows = tl.program_id(0) * BT + tl.arange(0, BT)
        rmask = rows < T
        rows64 = rows.to(tl.int64)
        W = F * 2 if GATED else F  # dfc1_out's row stride
        if HAS_P:
            p = tl.load(p_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
        dp = tl.zeros([BT], dtype=tl.float32)
        for f0 in range(0, F, BF):
            cols = f0 + tl.arange(0, BF)
            m = rmask[:, None] & (cols < F)[None, :]
            z_at = z_ptr + rows64[:, None] * stride_z + cols[None, :]
            dz_at = dz_ptr + rows64[:, None] * W + cols[None, :]
            g = tl.load(dh_ptr + rows64[:, None] * stride_dh + cols[None, :], mask=m, other=0.0).to(tl.float32)
            z = tl.load(z_at, mask=m, other=0.0).to(tl.float32)
            if GATED:
                up = tl.load(z_at + F, mask=m, other=0.0).to(tl.float32)
                s = act(z, ACT, INTERP)
                if HAS_P:
                    dp += tl.sum(s * up * g, axis=1)
                    g = g * p[:, None]
                tl.store(dz_at, (g * act_grad(z, ACT, INTERP) * up).to(dz_ptr.dtype.element_ty), mask=m)
                tl.store(dz_at + F, (g * s).to(dz_ptr.dtype.element_ty), mask=m)
            else:
                if HAS_P:
                    dp += tl.sum(act(z, ACT, INTERP) * g, axis=1)
                    g = g * p[:, None]
                tl.store(dz_at, (g * act_grad(z, ACT, INTERP)).to(dz_ptr.dtype.element_ty), mask=m)
        if HAS_P:
            if HAS_DP_IN:
                dp = dp + tl.load(dp_in_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
            tl.store(dp_ptr + rows, dp.to(dp_ptr.dtype.element_ty), mask=rmask)


# Tile shapes (rows x ffn columns) and warps; forward is a 2-D grid, backward steps through F.
CONFIG = dict(FWD_BT=32, FWD_BF=128, FWD_WARPS=4, BWD_BT=16, BWD_BF=128, BWD_WARPS=4)


def _rowmajor(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _meta(activation: str, probs: torch.Tensor | None, side: str, **flags: bool) -> dict:
    """The constexprs and launch options of the forward (``side`` "FWD") or backward ("BWD") kernel."""
    a, c = get(activation), CONFIG
    return dict(
        ACT=a.triton,
        GATED=a.gated,
        HAS_P=probs is not None,
        **flags,
        BT=c[f"{side}_BT"],
        BF=c[f"{side}_BF"],
        INTERP=interpreting(),
        num_warps=c[f"{side}_WARPS"],
        enable_fp_fusion=False,
    )


def act_fwd(fc1_out: torch.Tensor, probs: torch.Tensor | None, activation: str) -> torch.Tensor:
    """``h = act(fc1_out) * probs`` by the forward kernel (any Triton device; see
    :class:`TritonActivation` for when it runs)."""
    z, probs = _rowmajor(fc1_out), None if probs is None else _rowmajor(probs)
    T, W = z.shape
    F = W // 2 if get(activation).gated else W
    h = torch.empty(T, F, dtype=z.dtype, device=z.device)
    if T and F:
        c = CONFIG
        grid = (triton.cdiv(T, c["FWD_BT"]), triton.cdiv(F, c["FWD_BF"]))
        with torch.cuda.device(z.device):
            launch(
                _fwd_kernel,
                grid,
                (
                    z,
                    z.stride(0),
                    z if probs is None else probs,
                    h,
                    T,
                    F,
                ),
                _meta(activation, probs, "FWD"),
            )
    return h


def act_bwd(
    fc1_out: torch.Tensor,
    probs: torch.Tensor | None,
    dh: torch.Tensor,
    activation: str,
    *,
    dprobs_in: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(``dfc1_out``, ``dprobs``) by the backward kernel (any Triton device)."""
    z, g = _rowmajor(fc1_out), _rowmajor(dh)
    probs = None if probs is None else _rowmajor(probs)
    dprobs_in = None if dprobs_in is None else _rowmajor(dprobs_in)  # (read at its rows: stride 1)
    T, W = z.shape
    F = g.shape[1]
    dz = torch.empty(T, W, dtype=z.dtype, device=z.device)
    dprobs = None if probs is None else torch.empty(T, dtype=probs.dtype, device=z.device)
    if T:
        c = CONFIG
        with torch.cuda.device(z.device):
            launch(
                _bwd_kernel,
                (triton.cdiv(T, c["BWD_BT"]),),
                (
                    z,
                    z.stride(0),
                    z if probs is None else probs,
                    g,
                    g.stride(0),
                    dz,
                    z if dprobs_in is None else dprobs_in,
                    z if dprobs is None else dprobs,
                    T,
                    F,
                ),
                _meta(activation, probs, "BWD", HAS_DP_IN=dprobs_in is not None),
            )
    return dz, dprobs


class TritonActivation(TorchActivation):
    """``act_fwd``/``act_bwd`` as one Triton kernel each on CUDA (bf16/fp16/fp32 operands:
    :func:`available`) for activations with Triton code; the reference's for anything else
    (float64, an activation whose record's ``triton`` is None) and the two bias methods."""

    name = "triton"

    def __repr__(self) -> str:
        return "TritonActivation()"

    def act_fwd(self, fc1_out: torch.Tensor, probs: torch.Tensor | None, activation: str) -> torch.Tensor:
        if not available(fc1_out) or get(activation).triton is None:
            return super().act_fwd(fc1_out, probs, activation)
        return act_fwd(fc1_out, probs, activation)

    def act_bwd(
        self,
        fc1_out: torch.Tensor,
        probs: torch.Tensor | None,
        dh: torch.Tensor,
        activation: str,
        *,
        dprobs_in: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not (available(fc1_out) and available(dh)) or get(activation).triton is None:
            return super().act_bwd(fc1_out, probs, dh, activation, dprobs_in=dprobs_in)
        return act_bwd(fc1_out, probs, dh, activation, dprobs_in=dprobs_in)


FUSED = TritonActivation()
