"""Rowwise quantization kernels on the H200: bitwise vs the reference, time of quantize_activation
(rowwise + columnwise) per launch config, and the layer step vs bf16 (rw_prof)."""
import torch
from functional_dw import fp8
from functional_dw.fp8 import rowwise as ref
from functional_dw.kernels import triton_rowwise as tr
spec = fp8.tensor_spec(fp8.RowwiseScaling(), "input")
def ev_time(fn, n=20):
    for _ in range(3): fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n): fn()
    b.record(); torch.cuda.synchronize()
    return a.elapsed_time(b) / n * 1e3
base = dict(tr.CONFIG)
cfgs = [{}, dict(BD=256), dict(CAST_BT=64)]
for T, D, E in [(32768, 4096, 32), (32768, 1536, 32), (65536, 4096, 8), (65536, 1536, 128), (8192, 2048, 8)]:
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    sizes = torch.full((E,), T // E, device="cuda"); sizes[::3] += 5; sizes[1::3] -= 5; sizes[0] += T - int(sizes.sum())
    ends = sizes.cumsum(0).to(torch.int32); pends = ref.padded_ends(sizes)
    want = ref.quantize_activation(x, ends, pends, spec, rowwise=True, columnwise=True)
    out = []
    for c in cfgs:
        tr.CONFIG.clear(); tr.CONFIG.update(base, **c)
        got = tr.quantize_activation(x, ends, pends, spec, rowwise=True, columnwise=True)
        ok = all(torch.equal(getattr(got, n).float(), getattr(want, n).float()) for n in ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv"))
        us = ev_time(lambda: tr.quantize_activation(x, ends, pends, spec, rowwise=True, columnwise=True))
        out.append(f"{c or 'current'}: {us:.0f} us ({6 * T * D / us / 1e3:.0f} GB/s eff){'' if ok else ' NOT BITWISE'}")
    print(f"== {T}x{D} E={E}:", " | ".join(out), flush=True)
tr.CONFIG.clear(); tr.CONFIG.update(base)
