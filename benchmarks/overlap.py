"""Overlap benchmark for functional_dw.distributed: a sharded 2-layer MoE expert MLP
(grouped_linear, GELU, grouped_linear), forward + backward per step, median step time.

  nocomm  : plain full weights on every rank (no collectives): the compute floor
  sync    : ShardedWeight, all-gathers and reduce-scatters in line
  overlap : async reduce-scatter (wait_for_grads at the end) + backward prefetch
            (prefetch_on_grad(y, [*w2, *w1]): layer 1's all-gather runs during layer 2's backward)

CPU/gloo by default; with >= W GPUs: NCCL, bf16, TE or torch kernels (backend auto).
Usage: python benchmarks/overlap.py [W] [--trace DIR]   (prints one line per shape)

``--trace DIR``: rank 0 also records three steps of each mode with torch.profiler, writes the
Chrome traces there, and prints how long kernels of two or more CUDA streams ran at once (the
GEMMs on the compute stream with NCCL's on its own): the overlap as measured, not inferred from
step times. Results also go to DIR/overlap.json.
"""

import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import functional_dw as fd
from functional_dw import distributed as fdd



def streams_at_once(trace_path):
    """(ms when kernels of >= 2 streams ran at once, ms when any kernel ran, streams seen) from a
    Chrome trace torch.profiler wrote."""
    with open(trace_path) as f:
        events = json.load(f).get("traceEvents", [])
    edges = []
    streams = set()
    for e in events:
        if e.get("cat") == "kernel" and "dur" in e:
            sid = e.get("args", {}).get("stream")
            streams.add(sid)
            edges += [(e["ts"], 1, sid), (e["ts"] + e["dur"], -1, sid)]
    active, both, busy, last = {}, 0.0, 0.0, None
    for ts, d, sid in sorted(edges, key=lambda x: (x[0], x[1])):
        n = sum(1 for v in active.values() if v > 0)
        if last is not None:
            both += (ts - last) * (n >= 2)
            busy += (ts - last) * (n >= 1)
        active[sid] = active.get(sid, 0) + d
        last = ts
    return both / 1e3, busy / 1e3, len(streams)


def job(E, T, H, Fh, iters, mode, trace_dir=None):
    rank = dist.get_rank()
    gpu = dist.get_backend() == "nccl"
    dev, dt = (f"cuda:{rank}", torch.bfloat16) if gpu else ("cpu", torch.float32)
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    torch.manual_seed(0)
    f1 = [(torch.randn(Fh, H) / H**.5).to(dt).to(dev) for _ in range(E)]
    f2 = [(torch.randn(H, Fh) / Fh**.5).to(dt).to(dev) for _ in range(E)]
    overlap = mode == "overlap"
    if mode == "nocomm":
        w1, w2 = [f.requires_grad_() for f in f1], [f.requires_grad_() for f in f2]
    else:
        w1 = fdd.shard_grouped_weights(f1, async_grad_reduce=overlap)
        w2 = fdd.shard_grouped_weights(f2, async_grad_reduce=overlap)
    torch.manual_seed(1 + rank)
    splits = torch.randint(0, E, (T,)).bincount(minlength=E).tolist()
    x = torch.randn(T, H).to(dt).to(dev).requires_grad_()
    dy = torch.randn(T, H).to(dt).to(dev)

    def step():
        y = fd.grouped_linear(F.gelu(fd.grouped_linear(x, w1, splits)), w2, splits)
        if overlap:
            fdd.prefetch_on_grad(y, [*w2, *w1])
        y.backward(dy)
        if overlap:
            fdd.wait_for_grads([*w1, *w2])
        sync()

    ts = []
    for i in range(iters + 3):
        sync()
        dist.barrier()
        sync()
        t0 = time.perf_counter()
        step()
        if i >= 3:
            ts.append(time.perf_counter() - t0)
        for w in (*w1, *w2, x):
            w.grad = None
    if trace_dir:  # every rank steps (the collectives need them all); rank 0 records
        import contextlib

        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
        with profile(activities=acts) if rank == 0 else contextlib.nullcontext() as prof:
            for _ in range(3):
                step()
        if rank:
            return statistics.median(ts)
        os.makedirs(trace_dir, exist_ok=True)
        path = os.path.join(trace_dir, f"{mode}_W{dist.get_world_size()}_E{E}_T{T}_H{H}_F{Fh}.json")
        prof.export_chrome_trace(path)
        return statistics.median(ts), streams_at_once(path)
    return statistics.median(ts)



if __name__ == "__main__":
    args = sys.argv[1:]
    trace = args[args.index("--trace") + 1] if "--trace" in args else None
    W = int(args[0]) if args and args[0].isdigit() else 2
    gpu = torch.cuda.device_count() >= W
    shapes = [(8, 8192, 2048, 4096), (8, 2048, 2048, 4096)] if gpu else [(8, 2048, 512, 1024), (8, 512, 512, 1024), (8, 4096, 256, 512)]
    rows = []
    for E, T, H, Fh in shapes:
        res, overlaps = {}, {}
        for mode in ["nocomm", "sync", "overlap"] * 3:
            out = fdd.launch(job, W, E, T, H, Fh, 15, mode, trace)
            times = [o[0] if isinstance(o, tuple) else o for o in out]
            overlaps.update({mode: o[1] for o in out if isinstance(o, tuple)})
            res.setdefault(mode, []).append(max(times))
        print(f"W={W} {'nccl' if gpu else 'gloo'} E={E} T/rank={T} H={H} F={Fh}: " + ", ".join(
            f"{m} {statistics.median(v)*1e3:.1f} ms (runs {[round(t*1e3, 1) for t in v]})" for m, v in res.items()), flush=True)
        for m, (both, busy, n) in overlaps.items():
            print(f"    {m}: kernels of >= 2 streams at once {both:.2f} ms of {busy:.2f} ms with any kernel "
                  f"(3 steps, rank 0, {n} streams)", flush=True)
        rows.append({"W": W, "backend": "nccl" if gpu else "gloo", "E": E, "tokens_per_rank": T, "hidden": H, "ffn": Fh,
                     "ms": {m: statistics.median(v) * 1e3 for m, v in res.items()},
                     "streams_at_once_ms": {m: o[0] for m, o in overlaps.items()},
                     "any_kernel_ms": {m: o[1] for m, o in overlaps.items()}})
    if trace:
        with open(os.path.join(trace, "overlap.json"), "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "rows": rows}, f, indent=1)
