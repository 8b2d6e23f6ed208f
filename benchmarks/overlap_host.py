"""Host time per step of overlap.py's sharded 2-layer expert MLP (E=8, hidden 2048, ffn 4096,
bf16) on one GPU, NCCL with one rank, in this process: the time to issue the forward and the
whole step, the step, and (mode sync) the host cost of one group's all-gather against a bare
all_gather of the same bytes.

Usage: python benchmarks/overlap_host.py MODE [T]   MODE: nocomm, sync, prefetch, overlap
(as in overlap.py); T tokens (8192). EHF=E,H,F sets experts, hidden and ffn (8,2048,4096)."""

import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import functional_dw as fd
from functional_dw import distributed as fdd

mode = sys.argv[1]
T = int(sys.argv[2]) if len(sys.argv) > 2 else 8192
os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda", 0))
E, H, Fh = (int(v) for v in os.environ.get("EHF", "8,2048,4096").split(","))
torch.manual_seed(0)
f1 = [(torch.randn(Fh, H) / H**0.5).bfloat16().cuda() for _ in range(E)]
f2 = [(torch.randn(H, Fh) / Fh**0.5).bfloat16().cuda() for _ in range(E)]
if mode == "nocomm":
    w1, w2 = [f.requires_grad_() for f in f1], [f.requires_grad_() for f in f2]
else:
    ov = mode == "overlap"
    w1 = fdd.shard_grouped_weights(f1, async_grad_reduce=ov)
    w2 = fdd.shard_grouped_weights(f2, async_grad_reduce=ov, **({"reshard_after_forward": False} if ov else {}))
    if ov:
        fdd.set_prefetch_order([*w1, *w2])
splits = torch.randint(0, E, (T,)).bincount(minlength=E).tolist()
x = torch.randn(T, H).bfloat16().cuda().requires_grad_()
dy = torch.randn(T, H).bfloat16().cuda()
fs, hs, ts = [], [], []
for i in range(30):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    y = fd.grouped_linear(F.gelu(fd.grouped_linear(x, w1, splits)), w2, splits)
    tf = time.perf_counter()
    y.backward(dy)
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    for w in (*w1, *w2, x):
        w.grad = None
    if i >= 5:
        fs.append(tf - t0)
        hs.append(t1 - t0)
        ts.append(t2 - t0)
md = lambda v: statistics.median(v) * 1e3
print(
    f"{mode} E={E} H={H} F={Fh} T={T}: host forward {md(fs):.2f} ms, host step {md(hs):.2f} ms, step {md(ts):.2f} ms",
    flush=True,
)
if mode == "sync":  # a group's all-gather alone: host time to issue, and to complete
    g = w1[0]._dw
    for name, fn in [
        ("group all-gather (pack, collective, unpack)", lambda: g.gather().weights(Fh)),
        (
            "one all_gather_into_tensor of the same bytes, no copies",
            lambda: dist.all_gather_into_tensor(
                torch.empty(E * Fh * H, dtype=torch.bfloat16, device="cuda"),
                torch.empty(E * Fh * H, dtype=torch.bfloat16, device="cuda"),
                async_op=True,
            ).wait(),
        ),
    ]:
        iss, tot = [], []
        for i in range(25):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            if i >= 5:
                iss.append(t1 - t0)
                tot.append(t2 - t0)
        print(f"   {name}: issue {md(iss):.3f} ms, done {md(tot):.3f} ms", flush=True)
