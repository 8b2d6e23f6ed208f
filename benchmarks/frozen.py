"""Backward time with frozen experts vs trainable ones (issue 14, item 2): a frozen weight's
wgrad GEMM and an x without grad's dgrad GEMM are skipped.

    python benchmarks/frozen.py [--smoke]    # CUDA (+ TE for backend "te"); writes results/frozen.json

Per backend and path: median ms of backward alone (forward done outside the timed region) for
trainable experts, frozen experts, and an x that needs no grad, and their ratio to trainable.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

import functional_dw as fd

BF16 = torch.bfloat16


def backward_ms(x, ws, splits, dy, backend, path, repeats=20):
    times = []
    for i in range(repeats + 3):
        y = fd.grouped_linear(x, ws, splits, backend=backend, use_grouped_tensor=path)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        y.backward(dy)
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end))
        for t in (x, *ws):
            t.grad = None
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = p.parse_args()
    E, H, FF, T = (4, 64, 64, 256) if args.smoke else (32, 4096, 1536, 32768)
    splits = [T // E] * E
    g = torch.Generator(device="cuda").manual_seed(0)
    x0 = torch.randn(T, H, device="cuda", generator=g).to(BF16)
    w0 = [(torch.randn(FF, H, device="cuda", generator=g) * 0.02).to(BF16) for _ in range(E)]
    dy = torch.randn(T, FF, device="cuda", generator=g).to(BF16)
    rows = []
    for backend, path in (("te", False), ("te", True), ("auto", None)):
        sp = torch.tensor(splits, device="cuda") if path is not False else splits
        res = {}
        for case, x_grad, w_grad in (("trainable", True, True), ("frozen experts", True, False),
                                     ("x without grad", False, True)):
            x = x0.clone().requires_grad_(x_grad)
            ws = [w.clone().requires_grad_(w_grad) for w in w0]
            res[case] = round(backward_ms(x, ws, sp, dy, backend, path), 4)
        for case in ("frozen experts", "x without grad"):
            res[f"{case} / trainable"] = round(res[case] / res["trainable"], 3)
        rows.append({"backend": backend, "use_grouped_tensor": path, **res})
        print(rows[-1], flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"card": torch.cuda.get_device_name(), "torch": torch.__version__, "E": E, "hidden": H, "ffn": FF, "tokens": T}
    (out / "frozen.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
