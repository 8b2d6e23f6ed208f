"""One expert-MLP step's kernel timeline (issue 31): where a fwd+bwd step of ``functional_dw.grouped_mlp``
spends the GPU's time, in bf16 and with RowwiseScaling, at MoE shapes (CUDA, torch.profiler):

    python3 benchmarks/profile_mlp.py [E,H,F,T ...] [--out DIR]

For each shape and recipe: ms per step (20 steps back to back, CUDA events), the host time to issue one
step, the GPU time by kind (GEMMs, RowwiseScaling's quantization, the fused activation, autograd's adds into
the weights' ``.grad``, the rest: copies, fills, split bookkeeping), and the kernels of one step in launch
order with their durations. Writes ``results.md`` and ``results.json`` into ``--out`` (default
``benchmarks/results/profile_mlp``).
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import functional_dw as fd
from functional_dw import fp8

KINDS = (
    ("gemm", re.compile(r"gemm|cutlass|nvjet|xmma|cublas|sm90|Kernel2", re.I)),
    ("quantize", re.compile(r"_amax_kernel|_cast_kernel")),
    ("activation", re.compile(r"_fwd_kernel|_bwd_kernel")),
    ("accumulate", re.compile(r"CUDAFunctor_add<c10::BFloat16>")),  # autograd adding into the weights' .grad
)


def kind(name: str) -> str:
    return next((k for k, pat in KINDS if pat.search(name)), "other")


def make(E: int, H: int, F: int, T: int):
    g = torch.Generator(device="cuda").manual_seed(0)
    w1 = (torch.randn(E, 2 * F, H, device="cuda", generator=g) * H**-0.5).bfloat16().requires_grad_()
    w2 = (torch.randn(E, H, F, device="cuda", generator=g) * F**-0.5).bfloat16().requires_grad_()
    x = torch.randn(T, H, device="cuda", generator=g).bfloat16().requires_grad_()
    probs = torch.rand(T, device="cuda", generator=g).requires_grad_()
    dy = torch.randn(T, H, device="cuda", generator=g).bfloat16()
    splits = torch.full((E,), T // E, device="cuda")
    return x, w1, w2, probs, dy, splits


def profile_one(shape: tuple[int, int, int, int], recipe) -> dict:
    x, w1, w2, probs, dy, splits = make(*shape)

    def step():  # the weights' grads accumulate into .grad (as moe_mlp.py's eager rows); x's and probs' do not
        x.grad = probs.grad = None
        y = fd.grouped_mlp(x, w1, w2, splits, probs=probs, recipe=recipe)
        torch.autograd.backward(y, dy)

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    ev[0].record()
    for _ in range(20):
        step()
    ev[1].record()
    torch.cuda.synchronize()
    ms = ev[0].elapsed_time(ev[1]) / 20
    t0 = time.perf_counter()
    for _ in range(4):
        step()
    host_ms = (time.perf_counter() - t0) / 4 * 1e3
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        step()
        torch.cuda.synchronize()
    kernels = sorted(
        (e for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA),
        key=lambda e: e.time_range.start,
    )
    timeline = [(e.name, e.time_range.elapsed_us()) for e in kernels]
    by_kind: dict[str, float] = {}
    for name, us in timeline:
        by_kind[kind(name)] = by_kind.get(kind(name), 0.0) + us
    span = (kernels[-1].time_range.end - kernels[0].time_range.start) if kernels else 0
    return dict(ms=ms, host_ms=host_ms, gpu_us=by_kind, span_us=span, timeline=timeline)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shapes", nargs="*", default=["32,4096,1536,32768", "128,2048,768,32768"])
    ap.add_argument("--out", default="benchmarks/results/profile_mlp")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    results, md = (
        {},
        [
            "# One expert-MLP step's kernels (`benchmarks/profile_mlp.py`)",
            "",
            f"`python benchmarks/profile_mlp.py {' '.join(a.shapes)}` on {torch.cuda.get_device_name()}, "
            f"torch {torch.__version__}; SwiGLU weighted by float32 probs, stacked bf16 weights, device splits, "
            "backend None. GPU us by kind: the kernels of one profiled step.",
            "",
        ],
    )
    for s in a.shapes:
        shape = tuple(map(int, s.split(",")))
        for name, recipe in (("bf16", None), ("rowwise", fp8.RowwiseScaling(bf16_below=0))):
            r = profile_one(shape, recipe)
            results[f"{s} {name}"] = r
            kinds = ", ".join(f"{k} {v:.0f}" for k, v in sorted(r["gpu_us"].items()))
            line = (
                f"{s} {name}: {r['ms']:.3f} ms/step, host {r['host_ms']:.2f} ms, kernels span "
                f"{r['span_us'] / 1e3:.3f} ms, GPU us: {kinds}"
            )
            print(line, flush=True)
            md += [f"## {s} {name}", "", line, "", "| # | kernel | kind | us |", "|---|---|---|---|"]
            md += [f"| {i} | `{n[:90]}` | {kind(n)} | {us:.0f} |" for i, (n, us) in enumerate(r["timeline"])]
            md.append("")
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "results.md").write_text("\n".join(md) + "\n")
    print("written:", out / "results.md", flush=True)


if __name__ == "__main__":
    main()
