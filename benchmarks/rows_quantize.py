"""The gather as the load (issue 41): an MoE's expert input ``x[rows]`` quantized by RowwiseScaling,
gathered first (what runs today) against read through the index (``rows=``), on one sm_90 GPU.

    python benchmarks/rows_quantize.py [--out DIR]

Per MoE shape (T tokens, hidden H, E experts, top-k; rows = each sorted dispatch row's token, a
random top-k routing): microseconds (CUDA events, mean of 20 after 3 warm-ups) of

* ``bf16 gather``: ``x.index_select(0, rows)``, what a bf16 step pays for its input;
* ``gather + quantize``: that, then both FP8 copies of the gathered rows (today's FP8 input);
* ``quantize through rows``: both FP8 copies read through the index (the gathered rows never written);

and whether the last two give the same bits. Writes ``results.json`` and ``results.md`` under
``--out`` (default ``benchmarks/results/rows_quantize/``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's functional_dw

from bench_timing import cuda_times  # noqa: E402
from functional_dw import fp8  # noqa: E402
from functional_dw.fp8 import rowwise as ref  # noqa: E402
from functional_dw.kernels import triton_rowwise as tr  # noqa: E402

SHAPES = [  # T, H, E, k
    (8192, 2048, 128, 8),
    (32768, 2048, 128, 8),
    (8192, 4096, 32, 4),
    (32768, 4096, 8, 2),
]
SPEC = fp8.tensor_spec(fp8.RowwiseScaling(), "input")
NAMES = ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv")


def case(T: int, H: int, E: int, k: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=g)
    experts = torch.rand(T, E, device="cuda", generator=g).topk(k, dim=-1).indices.reshape(-1)
    rows = torch.div(torch.argsort(experts, stable=True), k, rounding_mode="floor")
    counts = torch.bincount(experts, minlength=E)
    ends, pends = counts.cumsum(0).to(torch.int32), ref.padded_ends(counts)

    def gathered(_=None):
        return tr.quantize_activation(x.index_select(0, rows), ends, pends, SPEC, rowwise=True, columnwise=True)

    def fused(_=None):
        return tr.quantize_activation(x, ends, pends, SPEC, rowwise=True, columnwise=True, rows=rows)

    a, b = gathered(), fused()
    same = all(torch.equal(getattr(a, n).view(torch.uint8 if n.endswith("data") else torch.float32),
                           getattr(b, n).view(torch.uint8 if n.endswith("data") else torch.float32))
               for n in NAMES)  # fmt: skip
    steps = {
        "bf16 gather": lambda _: x.index_select(0, rows),
        "gather + quantize": gathered,
        "quantize through rows": fused,
    }
    t = {name: ms * 1e3 for name, ms in cuda_times(steps, [None], repeats=20).items()}  # (interleaved medians)
    return {"shape": f"T={T}, H={H}, E={E}, top-{k} (rows {T * k})", "us": t, "bitwise": same}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "rows_quantize"))
    args = p.parse_args(argv)
    if not (torch.cuda.is_available() and tr.triton is not None and torch.cuda.get_device_capability() == (9, 0)):
        sys.exit("rows_quantize.py needs an sm_90 (Hopper) GPU and Triton: RowwiseScaling's kernels run only there")
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cases": [case(*s) for s in SHAPES],
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=1))
    md = [f"# RowwiseScaling's input through the gather's index ({result['date']}, {result['device']})", ""]
    md += ["| shape | bf16 gather | gather + quantize | quantize through rows | fused over today | bitwise |"]
    md += ["|---|---|---|---|---|---|"]
    for c in result["cases"]:
        u = c["us"]
        speed = u["gather + quantize"] / u["quantize through rows"]
        md.append(
            f"| {c['shape']} | {u['bf16 gather']:.0f} | {u['gather + quantize']:.0f} | "
            f"{u['quantize through rows']:.0f} | {speed:.2f}x | {c['bitwise']} |"
        )
    (out / "results.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
