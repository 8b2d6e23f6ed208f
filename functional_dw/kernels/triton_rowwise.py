"""RowwiseScaling's quantization on CUDA: two Triton launches per tensor (``fp8/rowwise.py``
defines the math; these kernels reproduce it bit for bit).

An activation ``[T, D]`` (x or dy) needs two copies for its two GEMMs: rowwise (one scale per
token, over D) and columnwise (one scale per expert and feature, over the expert's tokens,
written transposed into padded token columns). A scale must be known before its first cast,
and the columnwise amax spans an expert's tokens, so the work is:

1. ``_amax_kernel`` (one read of x): per ``[512, 128]`` block, each row's partial amax (the
   cast kernel takes the max of a row's partials) and the per-expert column amaxes
   (``atomic_max`` into ``[E, D]``, once per block and expert).
2. ``_cast_kernel`` (one more read of x): both casts from one load of each tile, the inverse
   scales, and the zeros of the padded columns.

A group's weights ``[E, N, K]`` take the same two kernels, as ``E * N`` rows in E groups of N
(rowwise ``[E, N, K]`` over K; columnwise ``[E, K, N]`` over N, no padding). Counts may live
only on the device (``ends``: int32 running ends; no host sync).

NOTE: [Why two reads] Reading x once would need every scale local to the tile being read
(1x128 / 128x1 blocks, DeepSeek-style), and Hopper's only grouped FP8 GEMM with such scales is
cuBLASLt's block-scaled one, which runs with split accumulation (TE's Float8BlockScaling:
slower than bf16 at fine-grained MoE shapes, ``../shared/docs/fp8-hopper.md``). torch's
rowwise-scaled grouped GEMM is 1.3-1.7x bf16's speed but takes one scale per row/column of the
summed dimension, whose amax spans the whole row (x's) or the whole expert (wgrad's). So the
second read is the price of the fast GEMM; the first pass writes nothing but amaxes.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch builds ship no Triton
    triton = None

from ..fp8.rowwise import PAD, RowwiseActivation, RowwiseWeight, padded_columns

__all__ = ["available", "quantize_activation", "quantize_weight"]

_EXPONENT_BITS = -8388608  # 0xFF800000: sign and exponent of an fp32


def available(t: torch.Tensor) -> bool:
    """Whether these kernels run on ``t`` (CUDA, with Triton)."""
    return triton is not None and t.is_cuda


if triton is not None:

    @triton.jit
    def _scale(amax, fp8_max, eps, POW2: tl.constexpr):
        """fp32 scales of fp32 amaxes: ``compute_scale_from_amax`` (value_for_inf FLT_MAX)."""
        a = tl.where(amax < eps, eps, amax)
        special = (a == 0) | (a != a) | (a == float("inf"))
        s = fp8_max / a
        s = tl.where(s == float("inf"), 3.4028234663852886e38, s)
        if POW2:
            s = (s.to(tl.int32, bitcast=True) & -8388608).to(tl.float32, bitcast=True)
        return tl.where(special, 1.0, s)

    @triton.jit
    def _cast(v, fp8_max):
        sat = tl.minimum(tl.maximum(v, -fp8_max), fp8_max)
        return tl.where(v != v, v, sat).to(tl.float8e4nv)

    @triton.jit
    def _group_of(rows, ends_ptr, E, EB: tl.constexpr):
        """The expert of each row: how many ends are <= it."""
        i = tl.arange(0, EB)
        ends = tl.load(ends_ptr + i, mask=i < E, other=2147483647)
        return tl.sum((ends[None, :] <= rows[:, None]).to(tl.int32), axis=1)

    @triton.jit
    def _amax_kernel(x_ptr, stride_x, ends_ptr, row_part_ptr, col_amax_ptr, T, D, E, n_part,
                     ROWS: tl.constexpr, COLS: tl.constexpr, RB: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
                     EB: tl.constexpr):
        """One ``[RB, BD]`` block: each row's max over the block's columns into ``row_part[row,
        block]`` (the cast kernel finishes the row), and each expert's column maxes, kept in
        registers while the rows stay in one expert and ``atomic_max``-ed into ``col_amax [E,
        D]`` when the expert changes (one atomic per column per block and expert)."""
        pid_d = tl.program_id(1)
        cols = pid_d * BD + tl.arange(0, BD)
        cmask = cols < D
        acc = tl.zeros([BD], dtype=tl.float32)
        acc_g = tl.program_id(0) * 0  # the expert acc belongs to (any, while acc is 0)
        for i in range(0, RB, BT):
            rows = tl.program_id(0) * RB + i + tl.arange(0, BT)
            rmask = rows < T
            v = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + cols[None, :],
                        mask=rmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)
            a = tl.abs(v)
            a = tl.where(a != a, 0.0, a)  # amaxes skip NaN
            if ROWS:
                tl.store(row_part_ptr + rows.to(tl.int64) * n_part + pid_d, tl.max(a, axis=1), mask=rmask)
            if COLS:
                g = _group_of(rows, ends_ptr, E, EB)
                g_lo = tl.min(tl.where(rmask, g, E), axis=0)
                g_hi = tl.max(tl.where(rmask, g, -1), axis=0)
                if g_lo == g_hi:  # the usual case: these rows lie in one expert
                    if g_lo != acc_g:
                        tl.atomic_max(col_amax_ptr + acc_g * D + cols, acc, mask=cmask)
                        acc = tl.zeros([BD], dtype=tl.float32)
                        acc_g = g_lo
                    acc = tl.maximum(acc, tl.max(a, axis=0))
                elif g_lo < g_hi:  # an expert boundary (or several) inside these rows
                    for e in range(g_lo, g_hi + 1):
                        ae = tl.where((g == e)[:, None], a, 0.0)
                        tl.atomic_max(col_amax_ptr + e * D + cols, tl.max(ae, axis=0), mask=cmask)
        if COLS:
            tl.atomic_max(col_amax_ptr + acc_g * D + cols, acc, mask=cmask)

    @triton.jit
    def _cast_kernel(x_ptr, stride_x, ends_ptr, pends_ptr, row_part_ptr, col_amax_ptr,
                     row_out_ptr, row_sinv_ptr, col_out_ptr, col_sinv_ptr,
                     T, D, E, n_part, col_stride_g, col_stride_d, fp8_max, eps,
                     ROWS: tl.constexpr, COLS: tl.constexpr, PADDED: tl.constexpr, POW2: tl.constexpr,
                     BT: tl.constexpr, BD: tl.constexpr, EB: tl.constexpr, PB: tl.constexpr, NP: tl.constexpr):
        pid_t = tl.program_id(0)
        pid_d = tl.program_id(1)
        rows = pid_t * BT + tl.arange(0, BT)
        cols = pid_d * BD + tl.arange(0, BD)
        rmask = rows < T
        cmask = cols < D
        m = rmask[:, None] & cmask[None, :]
        v = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + cols[None, :], mask=m, other=0.0).to(tl.float32)
        if ROWS:
            parts = tl.arange(0, NP)
            part = tl.load(row_part_ptr + rows[:, None].to(tl.int64) * n_part + parts[None, :],
                           mask=rmask[:, None] & (parts < n_part)[None, :], other=0.0)
            s_r = _scale(tl.max(part, axis=1), fp8_max, eps, POW2)
            tl.store(row_out_ptr + rows[:, None].to(tl.int64) * D + cols[None, :], _cast(v * s_r[:, None], fp8_max), mask=m)
            if pid_d == 0:
                tl.store(row_sinv_ptr + rows, 1.0 / s_r, mask=rmask)
        if COLS:
            g = _group_of(rows, ends_ptr, E, EB)
            g_lo = tl.min(tl.where(rmask, g, E), axis=0)
            g_hi = tl.max(tl.where(rmask, g, -1), axis=0)
            if g_lo == g_hi:  # one expert: a scalar base, so the transposed store is seen contiguous along rows
                base = g_lo.to(tl.int64) * col_stride_g - tl.load(ends_ptr + g_lo - 1, mask=g_lo > 0, other=0)
                if PADDED:
                    base += tl.load(pends_ptr + g_lo - 1, mask=g_lo > 0, other=0)
                s_c = _scale(tl.load(col_amax_ptr + g_lo * D + cols, mask=cmask, other=0.0), fp8_max, eps, POW2)
                dest = base + cols[None, :].to(tl.int64) * col_stride_d + rows[:, None]
                tl.store(col_out_ptr + dest, _cast(v * s_c[None, :], fp8_max), mask=m)
            elif g_lo < g_hi:  # an expert boundary inside the tile: per-row bases
                start = tl.load(ends_ptr + g - 1, mask=g > 0, other=0)
                s_c = _scale(tl.load(col_amax_ptr + g[:, None] * D + cols[None, :], mask=m, other=0.0), fp8_max, eps, POW2)
                column = rows - start
                if PADDED:
                    column += tl.load(pends_ptr + g - 1, mask=g > 0, other=0)
                dest = g[:, None].to(tl.int64) * col_stride_g + cols[None, :].to(tl.int64) * col_stride_d + column[:, None]
                tl.store(col_out_ptr + dest, _cast(v * s_c, fp8_max), mask=m)
            if pid_t == 0:  # once per column block: every expert's inverse scales and padding zeros
                pad = tl.arange(0, PB)
                zeros = tl.zeros([PB, BD], dtype=tl.float32).to(tl.float8e4nv)
                for e in range(0, E):
                    amax = tl.load(col_amax_ptr + e * D + cols, mask=cmask, other=0.0)
                    tl.store(col_sinv_ptr + e * D + cols, 1.0 / _scale(amax, fp8_max, eps, POW2), mask=cmask)
                    if PADDED:
                        end = tl.load(ends_ptr + e)
                        begin = tl.load(ends_ptr + e - 1, mask=e > 0, other=0)
                        pend = tl.load(pends_ptr + e)
                        first = tl.load(pends_ptr + e - 1, mask=e > 0, other=0) + end - begin  # first pad column
                        pm = (first + pad < pend)[:, None] & cmask[None, :]
                        tl.store(col_out_ptr + cols[None, :].to(tl.int64) * col_stride_d + (first + pad)[:, None],
                                 zeros, mask=pm)


_RB, _BT, _BD = 512, 64, 128  # rows per amax program, rows per tile, columns per tile


def _launch(t2d: torch.Tensor, ends: torch.Tensor, pends: torch.Tensor | None, E: int, spec, rowwise: bool,
            columnwise: bool, col_out: torch.Tensor | None, col_stride_g: int, col_stride_d: int):
    """Both kernels on ``t2d [R, D]`` in E groups (``ends``); returns (row data, row inverse scales
    ``[R]``, column inverse scales ``[E, D]``) and fills ``col_out``."""
    R, D = t2d.shape
    dev = t2d.device
    EB = max(16, triton.next_power_of_2(E))
    n_part = triton.cdiv(D, _BD)
    row_part = torch.empty(R if rowwise else 1, n_part, dtype=torch.float32, device=dev)
    col_amax = torch.zeros(E if columnwise else 1, D, dtype=torch.float32, device=dev)
    row_out = torch.empty(R, D, dtype=spec.fp8_dtype, device=dev) if rowwise else row_part
    row_sinv = torch.empty(R, dtype=torch.float32, device=dev) if rowwise else row_part
    col_sinv = torch.empty(E, D, dtype=torch.float32, device=dev) if columnwise else row_part
    if R and D:
        with torch.cuda.device(dev):
            _amax_kernel[(triton.cdiv(R, _RB), n_part)](
                t2d, t2d.stride(0), ends, row_part, col_amax, R, D, E, n_part, ROWS=rowwise, COLS=columnwise,
                RB=_RB, BT=_BT, BD=_BD, EB=EB, num_warps=4)
            _cast_kernel[(triton.cdiv(R, _BT), n_part)](
                t2d, t2d.stride(0), ends, pends if pends is not None else ends, row_part, col_amax,
                row_out, row_sinv, col_out if col_out is not None else row_part, col_sinv,
                R, D, E, n_part, col_stride_g, col_stride_d, spec.fp8_max, float(spec.amax_epsilon),
                ROWS=rowwise, COLS=columnwise, PADDED=pends is not None, POW2=spec.power_2_scale,
                BT=_BT, BD=_BD, EB=EB, PB=PAD, NP=max(2, triton.next_power_of_2(n_part)), num_warps=4)
    elif columnwise:
        col_sinv.fill_(1.0)  # no rows: every amax is 0, scale 1
        if col_out is not None and pends is not None:
            col_out.zero_()
    return (row_out if rowwise else None), (row_sinv if rowwise else None), (col_sinv if columnwise else None)


def quantize_activation(t_TD: torch.Tensor, ends_E: torch.Tensor, pends_E: torch.Tensor, spec, *, rowwise: bool,
                        columnwise: bool) -> RowwiseActivation:
    """``fp8.rowwise.quantize_activation`` on CUDA (``ends``/``pends`` int32 on t's device)."""
    T, D = t_TD.shape
    E = ends_E.shape[0]
    t = t_TD if t_TD.stride(-1) == 1 else t_TD.contiguous()
    col = None
    if columnwise:
        P = padded_columns(T, E)
        col = torch.empty(D, P, dtype=spec.fp8_dtype, device=t.device)
    row, row_sinv, col_sinv = _launch(t, ends_E, pends_E, E, spec, rowwise, columnwise, col, 0, col.shape[1] if col is not None else 0)
    return RowwiseActivation(row, row_sinv, col, col_sinv, (T, D), t_TD.dtype)


def quantize_weight(w_ENK: torch.Tensor, spec, *, rowwise: bool = True, columnwise: bool = True) -> RowwiseWeight:
    """``fp8.rowwise.quantize_weight`` on CUDA."""
    E, N, K = w_ENK.shape
    w = w_ENK.contiguous()
    ends = torch.arange(1, E + 1, dtype=torch.int32, device=w.device) * N  # E groups of N rows
    col = torch.empty(E, K, N, dtype=spec.fp8_dtype, device=w.device) if columnwise else None
    row, row_sinv, col_sinv = _launch(w.view(E * N, K), ends, None, E, spec, rowwise, columnwise, col, K * N, N)
    return RowwiseWeight(row.view(E, N, K) if rowwise else None, row_sinv.view(E, N) if rowwise else None, col,
                         col_sinv, (E, N, K), w_ENK.dtype)
