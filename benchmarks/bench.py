"""functional_dw vs Transformer Engine's modules vs torch's grouped GEMM, on one CUDA GPU.

    python benchmarks/bench.py [--quick] [--only SECTION,...] [--budget S] [--out benchmarks/results/bench]

One interleaved run (bf16) records, in this order:

* versions: torch, CUDA, TE, cuBLASLt (TE's answer and the library actually loaded);
* host: CPU microseconds to issue one forward+backward and wall microseconds per step at a
  launch-bound shape (E=8, 128x128, 64 tokens), functional_dw vs TE's modules vs torch's
  grouped_mm under autograd, and CUDA-graph replays of the same steps;
* linear: Linear at two shapes, fd vs te.Linear;
* offload: bytes through saved-tensor hooks, time under ``save_on_cpu(pin_memory=True)``,
  peak memory;
* frozen: backward time with frozen weights and with an x that needs no grad, vs trainable;
* graphed: eager vs CUDA-graph replay (``functional_dw.graphs.graph_step``) of a whole
  forward+backward at launch-bound shapes (8k tokens, tiny);
* grouped: forward+backward TFLOP/s of GroupedLinear on MoE shapes (balanced and Zipf-skewed
  splits with empty experts); functional_dw's three paths with both weight layouts (one
  stacked ``[E, N, K]`` tensor, and the E ``[N, K]`` weights an ``nn.GroupedLinear`` holds),
  next to te.GroupedLinear's two paths and torch's grouped_mm. Shapes go by token count, so
  ``--budget`` (seconds for the whole run) drops the largest if time runs short;
* fp8: forward+backward TFLOP/s of GroupedLinear under TE's Hopper FP8 recipes (delayed scaling
  on the split path; current and block scaling on the split and grouped paths), fd vs
  te.GroupedLinear with the same recipe, path and weights (under TE's autocast), next to the best
  bf16 rows and torchao's FP8 rowwise grouped GEMM (if importable); and the bytes through a
  saved-tensor pack hook per layer call, bf16 vs each recipe;
* the dense bf16 peak: the highest of several dense GEMMs (shapes and layouts, torch and TE),
  measured at the start and again at the end.

Timing: CUDA events around bursts of back-to-back steps after warm-up, median of repeats, the
implementations interleaved (each repeat times all of them, in a rotating order), inputs
rotated between steps. Host times: interleaved blocks, the minimum per implementation.
Writes ``results.md``, ``results.json`` and ``tflops.png`` under ``--out`` (``partial.json``
after each section, so a run cut short keeps what it measured). Without TE the TE rows say so.

The code, by section: this file (arguments, the run), bench_timing.py (the device, the timers,
versions, the dense peak, the section clock), bench_contenders.py (the layer and the bf16
implementations), bench_sections.py (host, linear, offload, frozen, graphed, grouped),
bench_fp8.py (fp8), bench_report.py (results.md and tflops.png). What each result folder holds and
the command that made it: benchmarks/results/<study>/README.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import torch

from bench_contenders import make_splits
from bench_fp8 import _te_autocast, _torchao_gmm, fp8_rows
from bench_report import add_fractions, markdown, plot
from bench_sections import frozen_rows, graphed_rows, grouped_rows, host_rows, linear_rows, offload_rows
from bench_timing import DEV, TIMING, Clock, dense_samples, versions

SECTIONS = ("host", "linear", "offload", "frozen", "graphed", "fp8", "grouped")

# moe_layer.py imports TIMING, _te_autocast, _torchao_gmm, make_splits and versions from here, and
# sets bench.DEV around versions() (which no longer reads it: the device is bench_timing.DEV).
__all__ = ["DEV", "SECTIONS", "TIMING", "_te_autocast", "_torchao_gmm", "main", "make_splits", "versions"]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="few shapes per section (about a third of the full run's time)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes: checks the script, measures nothing")
    p.add_argument(
        "--only", default=",".join(SECTIONS), help=f"comma-separated sections to run, of {','.join(SECTIONS)}"
    )
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument(
        "--fp8-configs",
        default="",
        help="fp8 section: only these TE recipe/path rows, e.g. 'delayed split,block grouped' (default: all)",
    )
    p.add_argument(
        "--budget",
        type=float,
        default=450,
        help="seconds for the whole run (default 450; 0: none): fp8 and grouped shapes that would start later are "
        "skipped, and listed in the results",
    )
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "bench"))
    args = p.parse_args(argv)
    only = [s for s in args.only.split(",") if s]
    if set(only) - set(SECTIONS):
        p.error(f"unknown section(s) {sorted(set(only) - set(SECTIONS))}; choose from {SECTIONS}")
    try:
        import transformer_engine.pytorch as te
        import transformer_engine_torch as tex
    except Exception as e:  # noqa: BLE001
        print(f"Transformer Engine not importable ({str(e).splitlines()[0][:120]}): TE rows are n/a", flush=True)
        te = tex = None

    if args.smoke:
        TIMING.update(warmup=1, burst=1)
    torch.manual_seed(0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "date": datetime.date.today().isoformat(),
        "card": torch.cuda.get_device_name(),
        "versions": versions(tex),
        "quick": args.quick,
        "smoke": args.smoke,
        "sections": only,
        "budget_s": args.budget,
    }
    result = {"meta": meta}
    clock = Clock(args.budget or None, out, result)
    print(meta, flush=True)
    samples = clock.section("dense_samples", lambda: dense_samples(args.smoke, te is not None, 1))
    runs = {
        "host": lambda: host_rows(args, te),
        "linear": lambda: linear_rows(args, te),
        "offload": lambda: offload_rows(args, te),
        "frozen": lambda: frozen_rows(args, te),
        "graphed": lambda: graphed_rows(args, te),
        "fp8": lambda: fp8_rows(args, te, clock),
        "grouped": lambda: grouped_rows(args, te, clock),
    }
    for name in SECTIONS:
        result[name] = clock.section(name, runs[name]) if name in only else None
    end = clock.section("dense_samples_end", lambda: dense_samples(args.smoke, te is not None, 2))
    result.pop("dense_samples_end")
    result["dense_samples"] = (samples or []) + (end or [])
    peak = max((s["tflops"] for s in result["dense_samples"] if "tflops" in s), default=float("nan"))
    result["dense_peak_tflops"] = round(peak, 3)  # (to 0.1, a slow CPU's peak was 0.0)
    add_fractions(result, result["dense_peak_tflops"])
    meta["skipped"], meta["errors"] = clock.skipped, clock.errors
    meta["elapsed_s"] = clock.elapsed | {"total": clock.total()}
    (out / "results.json").write_text(json.dumps(result, indent=1))
    (out / "results.md").write_text(markdown(result))
    if result.get("grouped"):
        plot(result["grouped"], out / "tflops.png")
    print((out / "results.md").read_text())
    print(f"total {meta['elapsed_s']['total']} s", flush=True)


if __name__ == "__main__":
    main()
