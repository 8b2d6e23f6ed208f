"""Where the host time of one forward+backward goes (cProfile, launch-bound shapes, TE backend)."""
import cProfile
import pstats
import sys

import torch

import functional_dw as fd

E, H, FF, T = 8, 128, 128, 64
grouped = len(sys.argv) > 1 and sys.argv[1] == "grouped"
ws = [torch.nn.Parameter(torch.randn(FF, H, device="cuda", dtype=torch.bfloat16)) for _ in range(E)]
x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
dy = torch.randn(T, FF, device="cuda", dtype=torch.bfloat16)
splits = torch.tensor([T // E] * E, device="cuda") if grouped else [T // E] * E


def step():
    y = fd.grouped_linear(x, ws, splits, use_grouped_tensor=grouped, backend="te")
    torch.autograd.grad(y, [x, *ws], dy)


for _ in range(50):
    step()
torch.cuda.synchronize()
prof = cProfile.Profile()
prof.enable()
for _ in range(300):
    step()
torch.cuda.synchronize()
prof.disable()
pstats.Stats(prof).sort_stats("tottime").print_stats(25)
