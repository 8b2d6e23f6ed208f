"""functional_dw vs Transformer Engine's modules vs torch's grouped GEMM, on one CUDA GPU.

    python benchmarks/bench.py [--quick] [--out benchmarks/results]

Measures, in one run (bf16): forward+backward time and TFLOP/s of GroupedLinear on MoE
shapes (balanced and Zipf-skewed splits with zero-token experts), Linear at two shapes, host
overhead at launch-bound shapes, bytes through saved-tensor hooks and time under
``save_on_cpu(pin_memory=True)``, peak device memory; and the card's dense bf16 peak.
Timing: CUDA events after warm-up around bursts of back-to-back steps, median of repeats,
inputs rotated between steps.
Writes ``results.md``, ``results.json`` and ``tflops.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from pathlib import Path

import torch

import functional_dw as fd

BF16 = torch.bfloat16
DEV = "cuda"


# --- timing --------------------------------------------------------------------------------


def cuda_time(step, inputs, warmup=3, repeats=15, burst=4):
    """Median milliseconds per ``step`` (CUDA events around ``burst`` back-to-back steps, so
    the host runs ahead as in training and launch latency is not counted once per step; the
    inputs rotate between steps so caches do not flatter)."""
    for i in range(warmup):
        step(inputs[i % len(inputs)])
    torch.cuda.synchronize()
    times = []
    for i in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for j in range(burst):
            step(inputs[(i + j) % len(inputs)])
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / burst)
    return statistics.median(times)


def cuda_times(steps: dict, inputs, warmup=3, repeats=15, burst=4) -> dict:
    """Like :func:`cuda_time` for several implementations at once, interleaved: each repeat
    times every implementation (in a rotating order), so clock and thermal drift and the
    allocator's state fall on all of them alike rather than on whichever ran first."""
    names = list(steps)
    for name in names:
        for i in range(warmup):
            steps[name](inputs[i % len(inputs)])
    torch.cuda.synchronize()
    times = {n: [] for n in names}
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for j in range(burst):
                steps[name](inputs[(r + j) % len(inputs)])
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) / burst)
    return {n: statistics.median(t) for n, t in times.items()}


def host_us(steps: dict, inp, iters=100, blocks=9, warmup=20) -> dict:
    """CPU microseconds per call at launch-bound sizes (the GPU idles: the host is the limit).
    Blocks of ``iters`` calls, interleaved across implementations; the minimum block per
    implementation (host noise only ever adds time)."""
    for step in steps.values():
        for _ in range(warmup):
            step(inp)
    torch.cuda.synchronize()
    times = {n: [] for n in steps}
    for b in range(blocks):
        for name, step in steps.items():
            t0 = time.perf_counter()
            for _ in range(iters):
                step(inp)
            torch.cuda.synchronize()
            times[name].append((time.perf_counter() - t0) / iters * 1e6)
    return {n: min(t) for n, t in times.items()}


def dense_peak_tflops(n=8192):
    a, b = (torch.randn(n, n, device=DEV, dtype=BF16) for _ in range(2))
    ms = cuda_time(lambda _: a @ b, [None], warmup=5, repeats=20)
    return 2 * n**3 / ms / 1e9


# --- shapes and splits ---------------------------------------------------------------------


def make_splits(E, T, kind, seed=0):
    """balanced: T/E each; zipf: counts ~ 1/rank^1.2 with the tail experts getting zero tokens."""
    if kind == "balanced":
        base = [T // E] * E
        base[0] += T - sum(base)
        return base
    g = torch.Generator().manual_seed(seed)
    w = torch.tensor([1.0 / (r + 1) ** 1.2 for r in range(E)])
    w[-max(1, E // 8):] = 0.0  # the coldest experts get nothing
    counts = torch.multinomial(w / w.sum(), T, replacement=True, generator=g).bincount(minlength=E)
    return counts[torch.randperm(E, generator=g)].tolist()


# --- implementations (each returns a step(inputs) for forward+backward) ----------------------


def grads_step(forward, params):
    def step(inp):
        x, dy = inp
        y = forward(x)
        torch.autograd.grad(y, [x, *params], dy)
    return step


def _if_runs(step, T, H, FF):
    """``step`` if one forward+backward runs, else the reason (TE's grouped path beyond 64
    experts; torch's grouped GEMM backward where the build lacks it)."""
    try:
        step((torch.randn(T, H, device=DEV, dtype=BF16, requires_grad=True), torch.randn(T, FF, device=DEV, dtype=BF16)))
        return step
    except Exception as e:
        return f"raises: {str(e).splitlines()[0][:90]}"


def impls_grouped(E, H, FF, splits, te):
    """name -> (step or None, reason): forward+backward of one grouped layer x[T,H] -> [T,FF]."""
    w_list = [torch.nn.Parameter(torch.randn(FF, H, device=DEV, dtype=BF16) * 0.02) for _ in range(E)]
    w_ENK = torch.nn.Parameter(torch.stack([w.detach() for w in w_list]))
    splits_dev = torch.tensor(splits, device=DEV)
    offs = torch.cumsum(splits_dev, 0).to(torch.int32)
    out = {}

    def fd_step(**kw):
        params = [w_ENK] if kw.pop("stacked", False) else w_list
        w = params[0] if len(params) == 1 else params
        arg = splits_dev if kw.get("use_grouped_tensor") or kw.get("backend") == "auto" else splits
        return grads_step(lambda x: fd.grouped_linear(x, w, arg, **kw), params)

    out["fd te split"] = fd_step(use_grouped_tensor=False, backend="te")
    out["fd te grouped"] = fd_step(use_grouped_tensor=True, backend="te")
    out["fd auto"] = fd_step(stacked=True, backend="auto")
    for name, grouped in (("te split", False), ("te grouped", True)):
        try:
            m = te.GroupedLinear(E, H, FF, bias=False, params_dtype=BF16, device=DEV, use_grouped_tensor=grouped)
            with torch.no_grad():
                for e in range(E):
                    getattr(m, f"weight{e}").copy_(w_list[e])
            arg = splits_dev if grouped else splits
        except Exception as e:
            out[name] = f"raises: {str(e).splitlines()[0][:90]}"
            continue
        out[name] = _if_runs(grads_step(lambda x, m=m, arg=arg: m(x, arg), list(m.parameters())), sum(splits), H, FF)
    gm = getattr(torch, "_grouped_mm", None)
    if gm is not None:
        def torch_gm(inp):
            x, dy = inp
            gm(x, w_ENK.transpose(-2, -1), offs=offs)
            gm(dy, w_ENK, offs=offs)
            gm(dy.t(), x, offs=offs)
        out["torch._grouped_mm"] = torch_gm
        out["torch._grouped_mm (autograd)"] = _if_runs(
            grads_step(lambda x: gm(x, w_ENK.transpose(-2, -1), offs=offs), [w_ENK]), sum(splits), H, FF)

    sizes = splits

    def mm_loop(inp):
        x, dy = inp
        for e, (xe, de) in enumerate(zip(x.split(sizes), dy.split(sizes))):
            xe @ w_list[e].t(), de @ w_list[e], de.t() @ xe
    out["torch.mm loop"] = mm_loop
    return out


def grouped_rows(args, te, peak):
    shapes = [(4, 64, 64, 256), (80, 64, 64, 160)] if args.smoke else [
        (8, 4096, 2048, 16384), (32, 4096, 1536, 32768), (128, 2048, 1536, 65536)] if args.quick else [
        (E, 4096, FF, T) for E in (8, 32, 128) for FF in (1536, 4096) for T in (8192, 32768, 65536)
        if not (E == 128 and FF == 4096 and T == 65536)] + [(64, 4096, 1536, 32768), (128, 2048, 1536, 65536)]
    rows = []
    for (E, H, FF, T) in shapes:
        for kind in (("balanced", "zipf") if not args.quick else ("balanced", "zipf")):
            splits = make_splits(E, T, kind)
            inputs = [(torch.randn(T, H, device=DEV, dtype=BF16, requires_grad=True),
                       torch.randn(T, FF, device=DEV, dtype=BF16)) for _ in range(2)]
            flops = 3 * 2 * T * H * FF
            impls = impls_grouped(E, H, FF, splits, te)
            res = {name: step for name, step in impls.items() if isinstance(step, str)}  # cannot run
            timed = cuda_times({n: s for n, s in impls.items() if not isinstance(s, str)}, inputs, repeats=args.repeats)
            for name, ms in timed.items():
                res[name] = {"ms": round(ms, 4), "tflops": round(flops / ms / 1e9, 1), "frac_peak": round(flops / ms / 1e9 / peak, 3)}
            x0 = inputs[0][0]
            res["chosen"] = {
                "te, use_grouped_tensor=None": fd.grouped_linear_fwd(x0.detach(), [torch.empty(FF, H, device=DEV, dtype=BF16)] * E,
                                                                   torch.tensor(splits, device=DEV), backend="te")[1].path,
                "auto": _auto_choice(x0, E, FF, H, splits),
            }
            rows.append({"E": E, "hidden": H, "ffn": FF, "tokens": T, "splits": kind,
                         "zero_experts": sum(s == 0 for s in splits), "results": res})
            (Path(args.out) / "partial.json").write_text(json.dumps(rows))  # survives a timeout
            print(E, H, FF, T, kind, {k: (v["tflops"] if isinstance(v, dict) and "tflops" in v else v) for k, v in res.items()}, flush=True)
            del inputs
            torch.cuda.empty_cache()
    return rows


def _auto_choice(x, E, FF, H, splits):
    y, res = fd.grouped_linear_fwd(x.detach(), torch.empty(E, FF, H, device=DEV, dtype=BF16), torch.tensor(splits, device=DEV), backend="auto")
    return f"{res.kernels.name} {res.path}"


def linear_rows(args, te, peak):
    rows = []
    for (T, K, N) in ([(64, 64, 64)] if args.smoke else [(8192, 4096, 4096)] if args.quick
                      else [(8192, 4096, 4096), (8192, 8192, 28672)]):
        w = torch.nn.Parameter(torch.randn(N, K, device=DEV, dtype=BF16) * 0.02)
        m = te.Linear(K, N, bias=False, params_dtype=BF16, device=DEV)
        with torch.no_grad():
            m.weight.copy_(w)
        inputs = [(torch.randn(T, K, device=DEV, dtype=BF16, requires_grad=True), torch.randn(T, N, device=DEV, dtype=BF16)) for _ in range(2)]
        flops = 3 * 2 * T * K * N
        timed = cuda_times({"fd linear (te)": grads_step(lambda x: fd.linear(x, w, backend="te"), [w]),
                            "te.Linear": grads_step(m, [m.weight])}, inputs, repeats=args.repeats)
        res = {name: {"ms": round(ms, 4), "tflops": round(flops / ms / 1e9, 1), "frac_peak": round(flops / ms / 1e9 / peak, 3)}
               for name, ms in timed.items()}
        rows.append({"tokens": T, "in": K, "out": N, "results": res})
        print("linear", T, K, N, res, flush=True)
    return rows


def overhead_rows(te, smoke=False):
    E, H, FF, T = 8, 128, 128, 64
    splits = [T // E] * E
    ws = [torch.nn.Parameter(torch.randn(FF, H, device=DEV, dtype=BF16)) for _ in range(E)]
    x = torch.randn(T, H, device=DEV, dtype=BF16, requires_grad=True)
    dy = torch.randn(T, FF, device=DEV, dtype=BF16)
    splits_dev = torch.tensor(splits, device=DEV)
    steps = {}
    for grouped in (False, True):
        tag = "grouped" if grouped else "split"
        arg = splits_dev if grouped else splits
        steps[f"fd te {tag}"] = grads_step(lambda x, arg=arg, g=grouped: fd.grouped_linear(x, ws, arg, use_grouped_tensor=g, backend="te"), ws)
        m = te.GroupedLinear(E, H, FF, bias=False, params_dtype=BF16, device=DEV, use_grouped_tensor=grouped)
        steps[f"te {tag}"] = grads_step(lambda x, m=m, arg=arg: m(x, arg), list(m.parameters()))
    w_ENK = torch.nn.Parameter(torch.stack([w.detach() for w in ws]))
    steps["fd auto"] = grads_step(lambda x: fd.grouped_linear(x, w_ENK, splits_dev, backend="auto"), [w_ENK])
    gm = getattr(torch, "_grouped_mm", None)
    if gm is not None:
        offs = splits_dev.cumsum(0).to(torch.int32)
        steps["torch._grouped_mm (autograd)"] = grads_step(lambda x: gm(x, w_ENK.transpose(-2, -1), offs=offs), [w_ENK])
    w = torch.nn.Parameter(torch.randn(FF, H, device=DEV, dtype=BF16))
    lin = te.Linear(H, FF, bias=False, params_dtype=BF16, device=DEV)
    steps["fd linear (te)"] = grads_step(lambda x: fd.linear(x, w, backend="te"), [w])
    steps["te.Linear"] = grads_step(lin, [lin.weight])
    res = host_us(steps, (x, dy), **(dict(iters=3, blocks=2, warmup=1) if smoke else {}))
    print("host us", res, flush=True)
    return {k: round(v, 1) for k, v in res.items()}


class PackCounter:
    def __init__(self):
        self.count, self.bytes = 0, 0

    def pack(self, t):
        self.count += 1
        self.bytes += t.numel() * t.element_size()
        return t

    def unpack(self, t):
        return t


def offload_rows(args, te):
    E, H, FF, T = (4, 64, 64, 256) if args.smoke else (32, 4096, 1536, 32768)
    splits = make_splits(E, T, "balanced")
    ws = [torch.nn.Parameter(torch.randn(FF, H, device=DEV, dtype=BF16) * 0.02) for _ in range(E)]
    m = te.GroupedLinear(E, H, FF, bias=False, params_dtype=BF16, device=DEV)
    impls = {"fd te split": (lambda x: fd.grouped_linear(x, ws, splits, use_grouped_tensor=False, backend="te"), ws),
             "te split": (lambda x: m(x, splits), list(m.parameters()))}
    inputs = [(torch.randn(T, H, device=DEV, dtype=BF16, requires_grad=True), torch.randn(T, FF, device=DEV, dtype=BF16)) for _ in range(2)]
    out, steps, offloaded = {}, {}, {}
    for name, (f, params) in impls.items():
        c = PackCounter()
        with torch.autograd.graph.saved_tensors_hooks(c.pack, c.unpack):
            y = f(inputs[0][0])
        torch.autograd.grad(y, [inputs[0][0], *params], inputs[0][1])
        steps[name] = step = grads_step(f, params)

        def off(inp, step=step):
            with torch.autograd.graph.save_on_cpu(pin_memory=True):
                step(inp)
        offloaded[name] = off
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step(inputs[0])
        torch.cuda.synchronize()
        out[name] = {"hook_tensors": c.count, "hook_bytes": c.bytes, "peak_mem_bytes": torch.cuda.max_memory_allocated() - base}
    plain = cuda_times(steps, inputs, repeats=args.repeats)
    off_ms = cuda_times(offloaded, inputs, repeats=max(5, args.repeats // 2))
    for name in impls:
        out[name].update(ms=round(plain[name], 3), ms_save_on_cpu=round(off_ms[name], 3))
    print("offload", out, flush=True)
    return {"shape": {"E": E, "hidden": H, "ffn": FF, "tokens": T}, "results": out}


GROUPED_NAMES = ["fd te split", "fd te grouped", "fd auto", "te split", "te grouped", "torch._grouped_mm",
                 "torch._grouped_mm (autograd)", "torch.mm loop"]


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = GROUPED_NAMES
    labels = [f"E{r['E']} {r['ffn']} {r['tokens'] // 1024}k {r['splits'][0]}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(10, len(rows) * 0.9), 5))
    width = 0.8 / len(names)
    for i, n in enumerate(names):
        vals = [r["results"][n]["tflops"] if isinstance(r["results"].get(n), dict) else 0 for r in rows]
        ax.bar([j + i * width for j in range(len(rows))], vals, width, label=n)
    ax.set_xticks([j + 0.4 for j in range(len(rows))], labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("TFLOP/s (bf16, fwd+bwd)")
    ax.legend(fontsize=7, ncol=4)
    ax.set_title("GroupedLinear fwd+bwd, hidden in/ffn out (0 = raises or n/a)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def markdown(meta, peak, grouped, linear, overhead, offload):
    names = GROUPED_NAMES
    lines = [f"# Benchmarks ({meta['date']}, {meta['card']})", "",
             f"torch {meta['torch']}, TE {meta['te']}, cuBLASLt {meta['cublaslt']}; dense bf16 {meta['dense_n']}^3 matmul: "
             f"**{peak:.0f} TFLOP/s** (the peak below). Forward+backward, bf16, median of repeats, CUDA events.", "",
             "## GroupedLinear: TFLOP/s (fraction of peak)", "",
             "| E | hidden | ffn | tokens | splits | " + " | ".join(names) + " | fd / best peer | fd auto / autograd grouped_mm | chosen (te None / auto) |",
             "|" + "---|" * (8 + len(names))]
    for r in grouped:
        res = r["results"]
        cells = []
        for n in names:
            v = res.get(n)
            cells.append(f"{v['tflops']} ({v['frac_peak']:.2f})" if isinstance(v, dict) else "raises" if v else "n/a")
        peers = [res[n]["ms"] for n in ("te split", "te grouped", "torch._grouped_mm") if isinstance(res.get(n), dict)]
        ours = min(res[n]["ms"] for n in ("fd te split", "fd te grouped", "fd auto") if isinstance(res.get(n), dict))
        ratio = ours / min(peers) if peers else float("nan")
        ag = res.get("torch._grouped_mm (autograd)")
        ratio_ag = f"{res['fd auto']['ms'] / ag['ms']:.2f}" if isinstance(ag, dict) and isinstance(res.get("fd auto"), dict) else "n/a"
        ch = res["chosen"]
        lines.append(f"| {r['E']} | {r['hidden']} | {r['ffn']} | {r['tokens']} | {r['splits']} ({r['zero_experts']} empty) | "
                     + " | ".join(cells) + f" | {ratio:.2f} | {ratio_ag} | {ch['te, use_grouped_tensor=None']} / {ch['auto']} |")
    lines += ["", "fd / best peer: functional_dw's best time over the best of te split, te grouped and torch._grouped_mm "
              "(<= 1.00 means at least as fast). torch._grouped_mm is its three raw GEMMs (no autograd); "
              "torch._grouped_mm (autograd) is the same op differentiated by torch's autograd, the layer a user "
              "would otherwise write; fd auto / autograd grouped_mm compares those two.", "",
              "## Linear: TFLOP/s", "", "| tokens | in | out | fd linear (te) | te.Linear | fd / te |", "|---|---|---|---|---|---|"]
    for r in linear:
        a, b = r["results"]["fd linear (te)"], r["results"]["te.Linear"]
        lines.append(f"| {r['tokens']} | {r['in']} | {r['out']} | {a['tflops']} | {b['tflops']} | {a['ms'] / b['ms']:.3f} |")
    lines += ["", "## Host overhead (launch-bound: E=8, 128x128, 64 tokens): CPU microseconds per forward+backward", "",
              "| impl | us |", "|---|---|"] + [f"| {k} | {v} |" for k, v in overhead.items()]
    s = offload["shape"]
    lines += ["", f"## Saved-tensor hooks and memory (E={s['E']}, hidden {s['hidden']}, ffn {s['ffn']}, {s['tokens']} tokens, split path)", "",
              "| impl | tensors packed | bytes packed | fwd+bwd ms | under save_on_cpu(pin_memory) ms | peak memory MiB |",
              "|---|---|---|---|---|---|"]
    for k, v in offload["results"].items():
        lines.append(f"| {k} | {v['hook_tensors']} | {v['hook_bytes']:,} | {v['ms']} | {v['ms_save_on_cpu']} | {v['peak_mem_bytes'] / 2**20:.0f} |")
    return "\n".join(lines) + "\n"


def _te_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("transformer_engine", "transformer-engine-torch", "transformer_engine_torch"):
        try:
            return version(dist)
        except PackageNotFoundError:
            pass
    return "?"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="three MoE shapes, one Linear shape")
    p.add_argument("--smoke", action="store_true", help="tiny shapes: checks the script, measures nothing")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = p.parse_args()
    import transformer_engine.pytorch as te
    import transformer_engine_torch as tex

    torch.manual_seed(0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"date": datetime.date.today().isoformat(), "card": torch.cuda.get_device_name(), "torch": torch.__version__,
            "te": _te_version(), "cublaslt": tex.get_cublasLt_version(), "dense_n": 8192, "quick": args.quick}
    meta["dense_n"] = 256 if args.smoke else 8192
    peak = dense_peak_tflops(meta["dense_n"])
    print(meta, f"peak {peak:.0f} TFLOP/s", flush=True)
    overhead = overhead_rows(te, args.smoke)
    linear = linear_rows(args, te, peak)
    offload = offload_rows(args, te)
    grouped = grouped_rows(args, te, peak)
    result = {"meta": meta, "dense_peak_tflops": round(peak, 1), "grouped": grouped, "linear": linear,
              "host_overhead_us": overhead, "offload": offload}
    (out / "results.json").write_text(json.dumps(result, indent=1))
    (out / "results.md").write_text(markdown(meta, peak, grouped, linear, overhead, offload))
    plot(grouped, out / "tflops.png")
    print((out / "results.md").read_text())


if __name__ == "__main__":
    main()
