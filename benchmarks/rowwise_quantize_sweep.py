"""Rowwise quantization kernels on the H200: bitwise vs the reference, the time of
quantize_activation (both copies) per launch config, against a bf16 copy of the same tensor
(the bandwidth one read and one write get). ``python benchmarks/rowwise_quantize_sweep.py [old]
[variants]`` (``old``: a module at benchmarks/_old_triton_rowwise.py timed alongside, if present;
``variants``: only the CONFIG variants in VARIANTS)."""

import itertools
import sys

import torch

from functional_dw import fp8
from functional_dw.fp8 import rowwise as ref
from functional_dw.kernels import triton_rowwise as tr

spec = fp8.tensor_spec(fp8.RowwiseScaling(), "input")
SHAPES = [(65536, 4096, 128), (65536, 1536, 128), (32768, 4096, 32), (65536, 4096, 8), (8192, 2048, 8)]
CAST = [dict(CAST_BT=bt, CAST_WARPS=w, BD=bd) for bt, w, bd in itertools.product((32, 64, 128), (4, 8), (64, 128))]
VARIANTS = [dict(CAST_BT=64), dict(CAST_BT=32, CAST_WARPS=8)]  # (2026-12-02: ROW_PARTS, since made the only path)
AMAX = [dict(RB=rb, BT=bt, AMAX_WARPS=w) for rb, bt, w in itertools.product((128, 256, 512), (16, 32, 64), (4, 8))]


def ev_time(fn, n=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / n * 1e3


def case(T, D, E):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16, generator=g)
    sizes = torch.full((E,), T // E, device="cuda")
    sizes[::3] += 5
    sizes[1::3] -= 5
    sizes[0] += T - int(sizes.sum())
    return x, sizes.cumsum(0).to(torch.int32), ref.padded_ends(sizes)


def run(mod, x, ends, pends, want):
    got = mod.quantize_activation(x, ends, pends, spec, rowwise=True, columnwise=True)
    ok = all(
        torch.equal(getattr(got, n).float(), getattr(want, n).float())
        for n in ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv")
    )
    return ev_time(lambda: mod.quantize_activation(x, ends, pends, spec, rowwise=True, columnwise=True)), ok


try:
    import triton
    import triton.language as tl

    @triton.jit
    def _bare_cast(x_ptr, row_ptr, col_ptr, T, D, BT: tl.constexpr, BD: tl.constexpr):
        """The cast kernel's memory traffic alone: a tile in, its FP8 copy and its transpose out."""
        rows = tl.program_id(0) * BT + tl.arange(0, BT)
        cols = tl.program_id(1) * BD + tl.arange(0, BD)
        m = (rows < T)[:, None] & (cols < D)[None, :]
        v = tl.load(x_ptr + rows[:, None].to(tl.int64) * D + cols[None, :], mask=m, other=0.0).to(tl.float32)
        f = v.to(tl.float8e4nv)
        tl.store(row_ptr + rows[:, None].to(tl.int64) * D + cols[None, :], f, mask=m)
        tl.store(col_ptr + cols[None, :].to(tl.int64) * T + rows[:, None], f, mask=m)
except ImportError:
    triton = None


def bare(x, BT, BD, warps):
    T, D = x.shape
    row = torch.empty(T, D, dtype=torch.float8_e4m3fn, device=x.device)
    col = torch.empty(D, T, dtype=torch.float8_e4m3fn, device=x.device)
    return lambda: _bare_cast[(triton.cdiv(T, BT), triton.cdiv(D, BD))](
        x, row, col, T, D, BT=BT, BD=BD, num_warps=warps
    )


def kernel_times(mod, x, ends, pends):
    """Each kernel's mean time (us) over 10 quantizations, from the profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            mod.quantize_activation(x, ends, pends, spec, rowwise=True, columnwise=True)
        torch.cuda.synchronize()
    return ", ".join(
        f"{e.key[:40]} {e.device_time_total / 10:.0f}" for e in prof.key_averages() if e.device_time_total > 0
    )


def main():
    mods = [("new", tr)]
    if "old" in sys.argv[1:]:
        sys.path.insert(0, "benchmarks")
        import _old_triton_rowwise as old

        mods.append(("old", old))
    base = dict(tr.CONFIG)
    if "variants" in sys.argv[1:]:  # only the CONFIG variants below, with each kernel's time
        for T, D, E in SHAPES:
            x, ends, pends = case(T, D, E)
            want = ref.quantize_activation(x, ends, pends, spec, rowwise=True, columnwise=True)
            for v in VARIANTS:
                tr.CONFIG.clear()
                tr.CONFIG.update(base, **v)
                us, ok = run(tr, x, ends, pends, want)
                print(
                    f"{T}x{D} E={E} {v}: {us:.0f} us{'' if ok else ' NOT BITWISE'} | {kernel_times(tr, x, ends, pends)}",
                    flush=True,
                )
        tr.CONFIG.clear()
        tr.CONFIG.update(base)
        return
    for T, D, E in SHAPES:
        x, ends, pends = case(T, D, E)
        want = ref.quantize_activation(x, ends, pends, spec, rowwise=True, columnwise=True)
        copy = ev_time(lambda: x.clone())
        amax = ev_time(lambda: x.abs().amax(0))
        b = min((ev_time(bare(x, *c)), c) for c in itertools.product((32, 64, 128), (64, 128), (4, 8)))
        line = [
            f"copy {copy:.0f} us ({4 * T * D / copy / 1e3:.0f} GB/s)",
            f"torch abs+amax(0) {amax:.0f} us",
            f"bare cast {b[0]:.0f} us ({4 * T * D / b[0] / 1e3:.0f} GB/s, BT,BD,warps={b[1]})",
        ]
        for name, m in mods:
            us, ok = run(m, x, ends, pends, want)
            line.append(
                f"{name} {us:.0f} us ({6 * T * D / us / 1e3:.0f} GB/s eff, {us / copy:.2f}x copy)"
                f"{'' if ok else ' NOT BITWISE'}"
            )
        print(f"== {T}x{D} E={E}:", " | ".join(line), flush=True)
        res = []
        for c in CAST:
            tr.CONFIG.clear()
            tr.CONFIG.update(base, **c)
            res.append((*run(tr, x, ends, pends, want), c))
        res.sort(key=lambda r: r[0])
        print(
            "   cast configs, best first:",
            "; ".join(f"{c} {us:.0f}{'' if ok else ' NOT BITWISE'}" for us, ok, c in res[:6]),
            flush=True,
        )
        ares = []
        for a in AMAX:
            tr.CONFIG.clear()
            tr.CONFIG.update(base, **res[0][2], **a)
            ares.append((*run(tr, x, ends, pends, want), a))
        ares.sort(key=lambda r: r[0])
        print(
            "   amax configs (with the best cast), best first:",
            "; ".join(f"{c} {us:.0f}{'' if ok else ' NOT BITWISE'}" for us, ok, c in ares[:4]),
            flush=True,
        )
        tr.CONFIG.clear()
        tr.CONFIG.update(base)
        print("   kernels (new, current config):", kernel_times(tr, x, ends, pends), flush=True)


if __name__ == "__main__":
    main()
