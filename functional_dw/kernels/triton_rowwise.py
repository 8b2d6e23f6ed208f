"""RowwiseScaling's quantization on CUDA: two Triton launches per tensor (``fp8/rowwise.py``
defines the math; these kernels reproduce it bit for bit).

An activation ``[T, D]`` (x or dy) needs two copies for its two GEMMs: rowwise (one scale per
token, over D) and columnwise (one scale per expert and feature, over the expert's tokens,
written transposed into padded token columns). A scale must be known before its first cast,
and the columnwise amax spans an expert's tokens, so the work is:

1. ``_amax_kernel`` (one read of x): per ``[256, 128]`` block, each row's amax over the
   block's columns (into ``[R, D / 128]``; one torch ``amax`` finishes the rows) and the
   per-expert column amaxes (``atomic_max`` into ``[E, D]``, once per block and expert).
   (``atomic_max`` of the rows instead, one launch fewer, made this kernel 1.2-1.45x slower on
   the H200: ``git show f696c1f:benchmarks/results/fp8_rowwise/quantize_row_amax_variants.log``.)
2. ``_cast_kernel`` (one more read of x): both casts from one load of each tile, the inverse
   scales, and the zeros of the padded columns. Its tiles run over the columnwise layout's
   positions, so the transposed store is contiguous and aligned (vector stores; a tile over
   x's rows would store at an expert-dependent shift, byte by byte).

A group's weights ``[E, N, K]`` take the same two kernels, as ``E * N`` rows in E groups of N
(rowwise ``[E, N, K]`` over K; columnwise ``[E, K, N]`` over N, no padding). Counts may live
only on the device (``ends``: int32 running ends; no host sync).

An MoE's experts read ``x[rows]`` (its sorted dispatch rows); with ``rows`` both kernels read x
through the index, and the gathered rows are never written (NOTE: [The gather as the load]).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch builds ship no Triton
    triton = None

from ..fp8.rowwise import RowwiseActivation, RowwiseWeight, check_rows, padded_columns
from ..activations import get as get_activation
from .triton_math import h_tile, interpreting
from .triton_launch import launch

__all__ = ["available", "quantize_activation", "quantize_weight"]


# NOTE: [Why two reads] Reading x once would need every scale local to the tile being read
# (1x128 / 128x1 blocks, DeepSeek-style), and Hopper's only grouped FP8 GEMM with such scales is
# cuBLASLt's block-scaled one, which runs with split accumulation (TE's Float8BlockScaling:
# slower than bf16 at fine-grained MoE shapes, ``../shared/docs/fp8-hopper.md``). torch's
# rowwise-scaled grouped GEMM is 1.3-1.7x bf16's speed but takes one scale per row/column of the
# summed dimension, whose amax spans the whole row (x's) or the whole expert (wgrad's). So the
# second read is the price of the fast GEMM; the first pass writes nothing but amaxes.


# NOTE: [The activation as the load] grouped_mlp's fc2 quantizes h = act(fc1_out) * probs. With
# ``act`` the amax kernel computes its tile of h from fc1's output (``triton_math.h_tile``, the
# activation kernel's own code), rounds it to the activations' dtype as that kernel does, takes
# the amaxes and writes h; the cast kernel reads h as it reads any x. The FP8 copies and scales
# are bitwise those of the h the activation kernel writes; two launches instead of three, and h
# is read once instead of twice. (Computing h again in the cast kernel, h never written, was
# slower on the H200 at F = 1536 and 4096: the activation's math, libdevice exp and IEEE
# division, done twice, and fc1's output read twice, cost more than writing and reading h.)


# NOTE: [The gather as the load] An MoE's experts read ``x[rows]`` ``[R, H]`` (``rows``: each
# sorted dispatch row's token, R = T * top_k). With ``rows`` both kernels load source row
# ``rows[r]`` where they load row ``r`` (GATHER, a constexpr), and every store (row copy, row
# scales, row amax partials, columnwise positions) stays at the gathered row r. So the gathered
# bf16 rows are never written: the FP8 copies of x[rows] cost two reads of x through the index
# and the FP8 writes, instead of the gather's read and write plus the two reads of its output.
# The index is read once per row and 128-column block (8 bytes against the row's 256). Without
# ``rows`` the kernels compile to the same sm_90 PTX as before, but for one unused pointer
# parameter. The index's values are not checked on CUDA (that reads them on the host: a sync):
# one outside ``[0, T)`` reads outside x (garbage rows or a memory fault), as NOTE: [Expert
# indices are not checked on CUDA] in ``moe.py`` trusts its indices; on the CPU the reference's
# ``index_select`` raises IndexError. Only eager launches fuse the gather: compiled (the
# ``rowwise_quantize`` op of ``kernels/rowwise.py``) and under torch.func transforms, x[rows] is
# gathered first.


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
            s = (s.to(tl.int32, bitcast=True) & -8388608).to(
                tl.float32, bitcast=True
            )  # fp8/quantize.py's _EXPONENT_BITS
        return tl.where(special, 1.0, s)

    # NOTE: [Saturating casts] The recipe's cast saturates at +-fp8_max and keeps NaN. On
    # sm_90 Triton's conversion is ``cvt.rn.satfinite.e4m3x2.f32``, which does exactly that,
    # so the kernel spells out the clamp (four operations per element, 20% of the cast
    # kernel's time on the H200) only where Triton's CPU interpreter runs it (SAT).
    @triton.jit
    def _cast(v, fp8_max, SAT: tl.constexpr):
        """``v`` as e4m3, saturated at +-fp8_max, NaN kept (NOTE: [Saturating casts])."""
        if SAT:
            v = tl.where(v != v, v, tl.minimum(tl.maximum(v, -fp8_max), fp8_max))
        return v.to(tl.float8e4nv)

    @triton.jit
    def _group_of(rows, ends_ptr, E, EB: tl.constexpr):
        """The expert of each row: how many ends are <= it."""
        i = tl.arange(0, EB)
        ends = tl.load(ends_ptr + i, mask=i < E, other=2147483647)
        return tl.sum((ends[None, :] <= rows[:, None]).to(tl.int32), axis=1)

    # Over 60 lines: one Triton program (a block of rows: the activation as its load, the row and
    # column amaxes); a helper would be another @triton.jit function the reader must follow.
    @triton.jit
    def _amax_kernel(
        x_ptr,
        stride_x,
        ends_ptr,
        row_part_ptr,
        col_amax_ptr,
        T,
        D,
        E,
        n_part,
        p_ptr,
        h_ptr,
        index_ptr,
        ROWS: tl.constexpr,
        COLS: tl.constexpr,
        RB: tl.constexpr,
        BT: tl.constexpr,
        BD: tl.constexpr,
        EB: tl.constexpr,
        ACT: tl.constexpr,
        GATED: tl.constexpr,
        HAS_P: tl.constexpr,
        INTERP: tl.constexpr,
        GATHER: tl.constexpr,
    ):
        """One ``[RB, BD]`` block of rows: each row's max over the block's columns into
        ``row_part[row, block]``, and each expert's column
        maxes ``atomic_max``-ed into ``col_amax [E, D]``: once per block when its rows lie in
        one expert (the usual case: a running elementwise max, reduced at the end), else per
        ``BT`` rows and expert. ``GATHER``: row r reads x's row ``index[r]`` (NOTE: [The gather
        as the load])."""
        first = tl.program_id(0) * RB
        cols = tl.program_id(1) * BD + tl.arange(0, BD)
        cmask = cols < D
        i_e = tl.arange(0, EB)
        ends = tl.load(ends_ptr + i_e, mask=i_e < E, other=2147483647)
        g_first = tl.sum((ends <= first).to(tl.int32), axis=0)
        g_last = tl.sum((ends <= tl.minimum(first + RB, T) - 1).to(tl.int32), axis=0)
        acc = tl.zeros([BT, BD], dtype=tl.float32)
        for i in range(0, RB, BT):
            rows = first + i + tl.arange(0, BT)
            rmask = rows < T
            if ACT < 0:
                if GATHER:
                    src = tl.load(index_ptr + rows, mask=rmask, other=0)
                else:
                    src = rows
                v = tl.load(
                    x_ptr + src[:, None].to(tl.int64) * stride_x + cols[None, :],
                    mask=rmask[:, None] & cmask[None, :],
                    other=0.0,
                ).to(tl.float32)
            else:  # h's tile from fc1's output, rounded as the activation kernel rounds it, and written
                h = h_tile(x_ptr, stride_x, rows, rmask, cols, cmask, p_ptr, D, ACT, GATED, HAS_P, INTERP)
                h = h.to(h_ptr.dtype.element_ty)
                tl.store(
                    h_ptr + rows[:, None].to(tl.int64) * D + cols[None, :], h, mask=rmask[:, None] & cmask[None, :]
                )
                v = h.to(tl.float32)
            a = tl.abs(v)
            a = tl.where(a != a, 0.0, a)  # amaxes skip NaN
            if ROWS:
                tl.store(row_part_ptr + rows.to(tl.int64) * n_part + tl.program_id(1), tl.max(a, axis=1), mask=rmask)
            if COLS:
                if g_first == g_last:
                    acc = tl.maximum(acc, a)
                else:  # expert boundaries inside the block: per expert of these rows
                    g = _group_of(rows, ends_ptr, E, EB)
                    g_lo = tl.min(tl.where(rmask, g, E), axis=0)
                    g_hi = tl.max(tl.where(rmask, g, -1), axis=0)
                    for e in range(g_lo, g_hi + 1):
                        ae = tl.where((g == e)[:, None], a, 0.0)
                        tl.atomic_max(col_amax_ptr + e * D + cols, tl.max(ae, axis=0), mask=cmask)
        if COLS:
            if g_first == g_last:
                tl.atomic_max(col_amax_ptr + g_first * D + cols, tl.max(acc, axis=0), mask=cmask)

    # Over 60 lines: one Triton program (scale and cast a block, rowwise and columnwise, with the
    # columnwise copy padded per expert); split, its pieces would share most of their arguments.
    @triton.jit
    def _cast_kernel(
        x_ptr,
        stride_x,
        ends_ptr,
        pends_ptr,
        row_amax_ptr,
        col_amax_ptr,
        row_out_ptr,
        row_sinv_ptr,
        col_out_ptr,
        col_sinv_ptr,
        P,
        D,
        E,
        col_stride_g,
        col_stride_d,
        col_shift_g,
        fp8_max,
        eps,
        index_ptr,
        ROWS: tl.constexpr,
        COLS: tl.constexpr,
        POW2: tl.constexpr,
        BT: tl.constexpr,
        BD: tl.constexpr,
        EB: tl.constexpr,
        SAT: tl.constexpr,
        GATHER: tl.constexpr,
    ):
        """One tile of ``BT`` positions of the columnwise layout by ``BD`` features. Position
        ``p`` is expert ``g``'s token ``p - pstart[g]`` (``pends``: the padded ends; the rows'
        own ends for weights), so the transposed store runs along ``p``, contiguous and aligned
        (vector stores), and positions past an expert's tokens (its padding, the tail) load 0 and
        store zeros. Each real row's rowwise copy is written by the tile that holds it.
        ``GATHER``: row r reads x's row ``index[r]`` (NOTE: [The gather as the load])."""
        pid_d = tl.program_id(1)
        pos = tl.program_id(0) * BT + tl.arange(0, BT)
        cols = pid_d * BD + tl.arange(0, BD)
        cmask = cols < D
        i_e = tl.arange(0, EB)
        pends = tl.load(pends_ptr + i_e, mask=i_e < E, other=2147483647)
        g_first = tl.sum((pends <= tl.program_id(0) * BT).to(tl.int32), axis=0)
        g_last = tl.sum((pends <= tl.program_id(0) * BT + BT - 1).to(tl.int32), axis=0)
        one = g_first == g_last  # the usual case: the tile lies in one expert's positions
        if one:  # scalar loads (broadcast), and below the expert's column scales once per column
            g = g_first + tl.zeros([BT], dtype=tl.int32)
            inside = g < E
            pstart = tl.load(pends_ptr + g_first - 1, mask=g_first > 0, other=0) + tl.zeros([BT], dtype=tl.int32)
            start = tl.load(ends_ptr + g_first - 1, mask=g_first > 0, other=0) + tl.zeros([BT], dtype=tl.int32)
            count = tl.load(ends_ptr + g_first, mask=g_first < E, other=0) - start
            local = pos - pstart
        else:
            g = _group_of(pos, pends_ptr, E, EB)  # E past the last expert
            inside = g < E
            pstart = tl.load(pends_ptr + g - 1, mask=inside & (g > 0), other=0)
            start = tl.load(ends_ptr + g - 1, mask=inside & (g > 0), other=0)
            count = tl.load(ends_ptr + g, mask=inside, other=0) - start
            local = pos - pstart
        valid = inside & (local < count)
        rows = start + local
        m = valid[:, None] & cmask[None, :]
        if GATHER:
            src = tl.load(index_ptr + rows, mask=valid, other=0)
        else:
            src = rows
        v = tl.load(x_ptr + src[:, None].to(tl.int64) * stride_x + cols[None, :], mask=m, other=0.0).to(tl.float32)
        if ROWS:
            s_r = _scale(tl.load(row_amax_ptr + rows, mask=valid, other=0.0), fp8_max, eps, POW2)
            tl.store(
                row_out_ptr + rows[:, None].to(tl.int64) * D + cols[None, :],
                _cast(v * s_r[:, None], fp8_max, SAT),
                mask=m,
            )
            if pid_d == 0:
                tl.store(row_sinv_ptr + rows, 1.0 / s_r, mask=valid)
        if COLS:
            col_ok = (pos < P)[:, None] & cmask[None, :]
            if one:
                amax_d = tl.load(col_amax_ptr + g_first * D + cols, mask=cmask & (cols * 0 + g_first < E), other=0.0)
                dest = (
                    g_first.to(tl.int64) * (col_stride_g - col_shift_g)
                    + cols[None, :].to(tl.int64) * col_stride_d
                    + pos[:, None]
                )
                tl.store(
                    col_out_ptr + dest,
                    _cast(v * _scale(amax_d, fp8_max, eps, POW2)[None, :], fp8_max, SAT),
                    mask=col_ok,
                )
            else:
                amax_td = tl.load(
                    col_amax_ptr + g[:, None] * D + cols[None, :], mask=inside[:, None] & cmask[None, :], other=0.0
                )
                dest = (
                    (g.to(tl.int64) * (col_stride_g - col_shift_g))[:, None]
                    + cols[None, :].to(tl.int64) * col_stride_d
                    + pos[:, None]
                )
                tl.store(col_out_ptr + dest, _cast(v * _scale(amax_td, fp8_max, eps, POW2), fp8_max, SAT), mask=col_ok)
            for e in range(tl.program_id(0), E, tl.num_programs(0)):  # each expert's inverse scales, once
                amax_e = tl.load(col_amax_ptr + e * D + cols, mask=cmask, other=0.0)
                tl.store(col_sinv_ptr + e * D + cols, 1.0 / _scale(amax_e, fp8_max, eps, POW2), mask=cmask)


# Launch shapes: rows per amax program, rows per tile (amax loop step), columns per tile, the
# cast kernel's rows per tile, warps of each kernel (benchmarks/rowwise_quantize_sweep.py; its
# runs on the H200 that chose them are in git history: benchmarks/results/fp8_rowwise/quantize_sweep_*.log
# at commit f696c1f).
CONFIG = dict(RB=256, BT=32, BD=128, CAST_BT=64, AMAX_WARPS=4, CAST_WARPS=4)


def _activation(act: tuple[str, torch.Tensor | None] | None, D: int) -> tuple[int, bool, torch.Tensor | None, int]:
    """The amax kernel's (ACT, GATED), the probs and h's width for ``act`` (activation, probs):
    from the activation's record (-1: no activation)."""
    if act is None:
        return -1, False, None, D
    record = get_activation(act[0])
    if record.triton is None:
        raise ValueError(f"act: activation {act[0]!r} has no Triton code (its record's triton is None)")
    return record.triton, record.gated, act[1], D // 2 if record.gated else D


def _launch(
    t2d: torch.Tensor,
    ends: torch.Tensor,
    pends: torch.Tensor,
    E: int,
    spec,
    rowwise: bool,
    columnwise: bool,
    col_out: torch.Tensor | None,
    P: int,
    col_stride_g: int,
    col_stride_d: int,
    col_shift_g: int,
    act: tuple[str, torch.Tensor | None] | None = None,
    index: torch.Tensor | None = None,
):
    """Both kernels on ``t2d [R, D]`` (``t2d[index]``, read through the contiguous ``index [R]``: NOTE: [The gather
    as the load]) in E groups (``ends``; ``pends`` their padded ends, or ``ends`` again); returns (row data, row
    inverse scales ``[R]``, column inverse scales ``[E, D]``) and fills ``col_out`` (``P`` positions; position p of
    expert g at ``g * (col_stride_g - col_shift_g) + feature * col_stride_d + p``). ``act``: (activation, probs):
    ``t2d`` is fc1's output and the tensor quantized is ``h = act(t2d) * probs``."""
    R, D = t2d.shape if index is None else (index.shape[0], t2d.shape[1])
    code, gated, probs, D = _activation(act, D)
    h = None if act is None else torch.empty(R, D, dtype=t2d.dtype, device=t2d.device)
    dev = t2d.device
    c = CONFIG
    if c["RB"] % c["BT"]:  # the amax kernel steps BT rows through its RB: a remainder reads the next block
        raise ValueError(f"triton_rowwise.CONFIG: RB ({c['RB']}) must be a multiple of BT ({c['BT']})")
    EB = max(16, triton.next_power_of_2(E))
    # the column amaxes [E, D] the first kernel max-es into (zeros; a 1-element stand-in for absent operands)
    n_col = E * D if columnwise else 0
    amaxes = torch.zeros(n_col + 1, dtype=torch.float32, device=dev)
    row_amax = amaxes
    row_out = torch.empty(R, D, dtype=spec.fp8_dtype, device=dev) if rowwise else None
    row_sinv = torch.empty(R, dtype=torch.float32, device=dev) if rowwise else None
    col_sinv = torch.empty(E, D, dtype=torch.float32, device=dev) if columnwise else None
    if not D and rowwise:  # rows of no features: every amax is 0, scale 1 (as the reference)
        row_sinv.fill_(1.0)
    if D and (R or columnwise):
        with torch.cuda.device(dev):
            if R:
                row_amax = _amax_pass(t2d, D, ends, amaxes, E, EB, rowwise, columnwise, code, gated, probs, h, index)
            src = t2d if h is None else h  # (with act: the h the first kernel wrote)
            outs = [amaxes if o is None else o for o in (row_out, row_sinv, col_out, col_sinv)]
            n = P if columnwise else R
            shape = (n, E, col_stride_g, col_stride_d, col_shift_g, EB)
            cends = pends if columnwise else ends
            _cast_pass(src, ends, cends, row_amax, amaxes, outs, shape, spec, rowwise, columnwise, index)
    return row_out, row_sinv, col_sinv  # (None where not asked for)


def _amax_pass(t2d, D, ends, amaxes, E, EB, rowwise, columnwise, code, gated, probs, h, index):
    """The first kernel on ``D`` features (h's, with an activation): the column amaxes max-ed
    into ``amaxes`` (and ``h`` written); returns the row amaxes ``[R]`` (``amaxes`` when not
    rowwise). ``index``: the rows are ``t2d[index]``."""
    c, R = CONFIG, t2d.shape[0] if index is None else index.shape[0]
    n_part = triton.cdiv(D, c["BD"])
    row_part = torch.empty(R, n_part, dtype=torch.float32, device=t2d.device) if rowwise else amaxes
    launch(
        _amax_kernel,
        (triton.cdiv(R, c["RB"]), n_part),
        (
            t2d,
            t2d.stride(0),
            ends,
            row_part,
            amaxes,
            R,
            D,
            E,
            n_part,
            t2d if probs is None else probs,
            t2d if h is None else h,
            t2d if index is None else index,
        ),
        dict(
            ROWS=rowwise,
            COLS=columnwise,
            RB=c["RB"],
            BT=c["BT"],
            BD=c["BD"],
            EB=EB,
            ACT=code,
            GATED=gated,
            HAS_P=probs is not None,
            INTERP=interpreting(),
            GATHER=index is not None,
            num_warps=c["AMAX_WARPS"],
            enable_fp_fusion=False,
        ),
    )
    return row_part.amax(dim=1) if rowwise else amaxes  # each row's: the max of its blocks' (one small reduction)


def _cast_pass(src, ends, cends, row_amax, col_amax, outs, shape, spec, rowwise, columnwise, index):
    """The second kernel: scale and cast ``src`` (``src[index]``) into ``outs`` (row data, row
    inverse scales, column data, column inverse scales; stand-ins where not asked for)."""
    c, D = CONFIG, src.shape[1]  # (h's width with an activation: src is h)
    n, E, col_stride_g, col_stride_d, col_shift_g, EB = shape
    launch(
        _cast_kernel,
        (triton.cdiv(max(n, 1), c["CAST_BT"]), triton.cdiv(D, c["BD"])),
        (
            src,
            src.stride(0),
            ends,
            cends,
            row_amax,
            col_amax,
            *outs,
            n,
            D,
            E,
            col_stride_g,
            col_stride_d,
            col_shift_g,
            spec.fp8_max,
            float(spec.amax_epsilon),
            src if index is None else index,
        ),
        dict(
            ROWS=rowwise,
            COLS=columnwise,
            POW2=spec.power_2_scale,
            BT=c["CAST_BT"],
            BD=c["BD"],
            EB=EB,
            SAT=interpreting(),
            GATHER=index is not None,
            num_warps=c["CAST_WARPS"],
        ),
    )


def quantize_activation(
    t_TD: torch.Tensor,
    ends_E: torch.Tensor,
    pends_E: torch.Tensor,
    spec,
    *,
    rowwise: bool,
    columnwise: bool,
    act: tuple[str, torch.Tensor | None] | None = None,
    rows: torch.Tensor | None = None,
) -> RowwiseActivation:
    """``fp8.rowwise.quantize_activation`` on CUDA (``ends``/``pends`` int32 on t's device).
    ``act`` (activation, probs): ``t_TD`` is fc1's output ``[T, W]`` and the copies are those of
    ``h = act(t_TD) * probs`` ``[T, F]`` (as the activation kernel writes it), computed in the
    first kernel (NOTE: [The activation as the load]). ``rows`` (int64 or int32 ``[R]``, values in
    ``[0, T)``, not checked on CUDA): the copies are those of ``t_TD[rows]`` ``[R, D]`` (``ends``/
    ``pends`` its groups), read through the index (NOTE: [The gather as the load]); not with ``act``."""
    T, D = t_TD.shape
    if rows is not None:
        if act is not None:
            raise ValueError("rows and act together are not supported: quantize act's h, or gather fc1's output first")
        check_rows(rows, t_TD)
        T, rows = rows.shape[0], rows.contiguous()  # (the result's rows; the kernels read index[r] at r)
    if act is not None and get_activation(act[0]).gated:
        D //= 2
    E = ends_E.shape[0]
    t = t_TD if t_TD.stride(-1) == 1 else t_TD.contiguous()
    if act is not None and act[1] is not None and act[1].stride(0) != 1:
        act = (act[0], act[1].contiguous())
    P = padded_columns(T, E)
    col = torch.empty(D, P, dtype=spec.fp8_dtype, device=t.device) if columnwise else None
    row, row_sinv, col_sinv = _launch(t, ends_E, pends_E, E, spec, rowwise, columnwise, col, P, 0, P, 0, act, rows)
    return RowwiseActivation(row, row_sinv, col, col_sinv, (T, D), t_TD.dtype)


def quantize_weight(w_ENK: torch.Tensor, spec, *, rowwise: bool = True, columnwise: bool = True) -> RowwiseWeight:
    """``fp8.rowwise.quantize_weight`` on CUDA: E groups of N rows, columnwise ``[E, K, N]``."""
    E, N, K = w_ENK.shape
    w = w_ENK.contiguous()
    ends = torch.arange(1, E + 1, dtype=torch.int32, device=w.device) * N
    col = torch.empty(E, K, N, dtype=spec.fp8_dtype, device=w.device) if columnwise else None
    row, row_sinv, col_sinv = _launch(
        w.view(E * N, K), ends, ends, E, spec, rowwise, columnwise, col, E * N, K * N, N, N
    )
    return RowwiseWeight(
        row.view(E, N, K) if rowwise else None,
        row_sinv.view(E, N) if rowwise else None,
        col,
        col_sinv,
        (E, N, K),
        w_ENK.dtype,
    )
