"""Overlap benchmark for functional_dw.distributed: a sharded 2-layer MoE expert MLP
(grouped_linear, GELU, grouped_linear), forward + backward per step, median step time.

  nocomm   : plain full weights on every rank (no collectives): the compute floor
  sync     : ShardedWeight, all-gathers and reduce-scatters in line
  prefetch : set_prefetch_order([*w1, *w2]) (layer 2's all-gather runs during layer 1's forward
             GEMMs, layer 1's during layer 2's backward) + async reduce-scatter (layer 2's runs
             during layer 1's backward)
  overlap  : prefetch + reshard_after_forward=False on layer 2 (its forward gather serves its
             backward, as FSDP2 does for the root): 3 all-gathers per step instead of 4

CPU/gloo by default; with >= W GPUs: NCCL, bf16, TE or torch kernels (backend auto).
Usage: python benchmarks/overlap.py [W] [--trace DIR] [--reps N] [--modes a,b]   (one line per
shape; each mode runs N times (3), alternating, in fresh processes; the median is reported)

``--trace DIR``: rank 0 also records three steps of each mode with torch.profiler, writes the
Chrome traces there, and prints how long kernels of two or more CUDA streams ran at once (the
GEMMs on the compute stream with NCCL's on its own): the overlap as measured, not inferred from
step times. Results also go to DIR/overlap.json. Each mode's peak memory (rank 0, GPU) is printed:
the in-flight buffers' cost.

W=1 on one GPU runs NCCL with one rank: its "collectives" are local copies, so it checks the
streams' ordering and shows the copies running beside the GEMMs, not the link's speed.
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
    Chrome trace torch.profiler wrote. Device copies count as kernels (NCCL with one rank copies
    with the copy engines)."""
    with open(trace_path) as f:
        events = json.load(f).get("traceEvents", [])
    edges = []
    streams = set()
    for e in events:
        if e.get("cat") in ("kernel", "gpu_memcpy") and "dur" in e:
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
    f1 = [(torch.randn(Fh, H) / H**0.5).to(dt).to(dev) for _ in range(E)]
    f2 = [(torch.randn(H, Fh) / Fh**0.5).to(dt).to(dev) for _ in range(E)]
    overlap = mode in ("prefetch", "overlap")
    if mode == "nocomm":
        w1, w2 = [f.requires_grad_() for f in f1], [f.requires_grad_() for f in f2]
    else:
        w1 = fdd.shard_grouped_weights(f1, async_grad_reduce=overlap)
        keep = {"reshard_after_forward": False} if mode == "overlap" else {}
        w2 = fdd.shard_grouped_weights(f2, async_grad_reduce=overlap, **keep)
        if overlap:
            fdd.set_prefetch_order([*w1, *w2])
    torch.manual_seed(1 + rank)
    splits = torch.randint(0, E, (T,)).bincount(minlength=E).tolist()
    x = torch.randn(T, H).to(dt).to(dev).requires_grad_()
    dy = torch.randn(T, H).to(dt).to(dev)

    def step():
        y = fd.grouped_linear(F.gelu(fd.grouped_linear(x, w1, splits)), w2, splits)
        y.backward(dy)  # async reduce-scatters: delivered into .grad as backward ends

    ts, hs = [], []
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    for i in range(iters + 3):
        sync()
        dist.barrier()
        sync()
        t0 = time.perf_counter()
        step()
        t1 = time.perf_counter()  # the host has issued the step
        sync()
        if i >= 3:
            ts.append(time.perf_counter() - t0)
            hs.append(t1 - t0)
        for w in (*w1, *w2, x):
            w.grad = None
    peak = torch.cuda.max_memory_allocated() / 2**20 if gpu else float("nan")
    host = statistics.median(hs)
    if trace_dir:  # every rank steps (the collectives need them all); rank 0 records
        import contextlib

        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
        with profile(activities=acts) if rank == 0 else contextlib.nullcontext() as prof:
            for _ in range(3):
                step()
                sync()
        if rank:
            return statistics.median(ts), peak, host
        os.makedirs(trace_dir, exist_ok=True)
        path = os.path.join(trace_dir, f"{mode}_W{dist.get_world_size()}_E{E}_T{T}_H{H}_F{Fh}.json")
        prof.export_chrome_trace(path)
        return statistics.median(ts), peak, host, streams_at_once(path)
    return statistics.median(ts), peak, host


if __name__ == "__main__":
    args = sys.argv[1:]
    trace = args[args.index("--trace") + 1] if "--trace" in args else None
    W = int(args[0]) if args and args[0].isdigit() else 2
    reps = int(args[args.index("--reps") + 1]) if "--reps" in args else 3
    modes = (
        args[args.index("--modes") + 1].split(",") if "--modes" in args else ["nocomm", "sync", "prefetch", "overlap"]
    )
    gpu = torch.cuda.device_count() >= W
    shapes = (
        [(8, 8192, 2048, 4096), (8, 2048, 2048, 4096)]
        if gpu
        else [(8, 2048, 512, 1024), (8, 512, 512, 1024), (8, 4096, 256, 512)]
    )
    rows = []
    for E, T, H, Fh in shapes:
        res, overlaps, peaks, hosts = {}, {}, {}, {}
        for mode in modes * reps:
            out = fdd.launch(job, W, E, T, H, Fh, 15, mode, trace)
            overlaps.update({mode: o[3] for o in out if len(o) == 4})
            peaks[mode] = out[0][1]
            hosts.setdefault(mode, []).append(max(o[2] for o in out))
            res.setdefault(mode, []).append(max(o[0] for o in out))
        print(
            f"W={W} {'nccl' if gpu else 'gloo'} E={E} T/rank={T} H={H} F={Fh}: "
            + ", ".join(
                f"{m} {statistics.median(v) * 1e3:.1f} ms (runs {[round(t * 1e3, 1) for t in v]})"
                for m, v in res.items()
            ),
            flush=True,
        )
        for m, (both, busy, n) in overlaps.items() if gpu else ():  # (no CUDA kernels on the CPU)
            print(
                f"    {m}: kernels of >= 2 streams at once {both:.2f} ms of {busy:.2f} ms with any kernel "
                f"(3 steps, rank 0, {n} streams)",
                flush=True,
            )
        print(
            "    host time to issue a step (slowest rank): "
            + ", ".join(f"{m} {statistics.median(v) * 1e3:.1f} ms" for m, v in hosts.items()),
            flush=True,
        )
        if gpu:
            print("    peak memory (rank 0): " + ", ".join(f"{m} {v:.0f} MiB" for m, v in peaks.items()), flush=True)
        rows.append(
            {
                "W": W,
                "backend": "nccl" if gpu else "gloo",
                "E": E,
                "tokens_per_rank": T,
                "hidden": H,
                "ffn": Fh,
                "ms": {m: statistics.median(v) * 1e3 for m, v in res.items()},
                "streams_at_once_ms": {m: o[0] for m, o in overlaps.items()},
                "any_kernel_ms": {m: o[1] for m, o in overlaps.items()},
                "host_issue_ms": {m: statistics.median(v) * 1e3 for m, v in hosts.items()},
                "peak_mib": peaks if gpu else {},
            }
        )
    if trace:
        with open(os.path.join(trace, "overlap.json"), "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "rows": rows}, f, indent=1)
