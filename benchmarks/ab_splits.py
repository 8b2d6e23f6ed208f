"""A/B on a CUDA machine: host microseconds of the device splits' bookkeeping, one Triton
launch vs the torch ops, alone and inside a launch-bound fd.grouped_linear step (auto path)."""

import torch

import functional_dw as fd
from functional_dw.kernels import Splits, triton_splits
from profile_host import issue_and_wall_us  # beside this script (its folder is on sys.path)

DEV, BF16 = "cuda", torch.bfloat16
E, T = 8, 64
raw = torch.tensor([T // E] * E, device=DEV)


def bookkeeping():
    s = Splits(host=None, tensor=raw, device=raw.device, num_tokens=T, num_experts=E)
    return s.ends(torch.int32), s.on_device()


x = torch.randn(T, 128, device=DEV, dtype=BF16, requires_grad=True)
w = torch.randn(E, 128, 128, device=DEV, dtype=BF16, requires_grad=True)
dy = torch.randn(T, 128, device=DEV, dtype=BF16)


def step():
    torch.autograd.grad(fd.grouped_linear(x, w, raw, backend="auto"), [x, w], dy)


real = triton_splits.triton
res = {}
for f, name in ((bookkeeping, "bookkeeping"), (step, "fd auto step")):
    times = {"triton": [], "torch ops": []}
    for r in range(15):  # interleaved blocks, so host drift falls on both alike
        for label, tr in (("triton", real), ("torch ops", None)):
            triton_splits.triton = tr
            times[label].append(issue_and_wall_us(f, iters=200, rounds=1)[0])
    for label, t in times.items():
        print(f"{name:14s} {label:9s} min {min(t):7.1f} us  median {sorted(t)[len(t) // 2]:7.1f} us", flush=True)
triton_splits.triton = real
