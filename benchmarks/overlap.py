"""Overlap benchmark for functional_dw.distributed: a sharded 2-layer MoE expert MLP
(grouped_linear, GELU, grouped_linear), forward + backward per step, median step time.

  nocomm  : plain full weights on every rank (no collectives): the compute floor
  sync    : ShardedWeight, all-gathers and reduce-scatters in line
  overlap : async reduce-scatter (wait_for_grads at the end) + backward prefetch
            (prefetch_on_grad(y, [*w2, *w1]): layer 1's all-gather runs during layer 2's backward)

CPU/gloo by default; with >= W GPUs: NCCL, bf16, TE or torch kernels (backend auto).
Usage: python benchmarks/overlap.py [W]     (prints one line per shape)
"""

import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import functional_dw as fd
from functional_dw import distributed as fdd



def job(E, T, H, Fh, iters, mode):
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
    ts = []
    for i in range(iters + 3):
        sync()
        dist.barrier()
        sync()
        t0 = time.perf_counter()
        y = fd.grouped_linear(F.gelu(fd.grouped_linear(x, w1, splits)), w2, splits)
        if overlap:
            fdd.prefetch_on_grad(y, [*w2, *w1])
        y.backward(dy)
        if overlap:
            fdd.wait_for_grads([*w1, *w2])
        sync()
        if i >= 3:
            ts.append(time.perf_counter() - t0)
        for w in (*w1, *w2, x):
            w.grad = None
    return statistics.median(ts)



if __name__ == "__main__":
    W = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    gpu = torch.cuda.device_count() >= W
    shapes = [(8, 8192, 2048, 4096), (8, 2048, 2048, 4096)] if gpu else [(8, 2048, 512, 1024), (8, 512, 512, 1024), (8, 4096, 256, 512)]
    for E, T, H, Fh in shapes:
        res = {}
        for mode in ["nocomm", "sync", "overlap"] * 3:
            res.setdefault(mode, []).append(max(fdd.launch(job, W, E, T, H, Fh, 15, mode)))
        print(f"W={W} {'nccl' if gpu else 'gloo'} E={E} T/rank={T} H={H} F={Fh}: " + ", ".join(
            f"{m} {statistics.median(v)*1e3:.1f} ms (runs {[round(t*1e3, 1) for t in v]})" for m, v in res.items()), flush=True)
