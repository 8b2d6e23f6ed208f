"""fd's RowwiseScaling vs fd bf16 auto, each alone (20 steps back to back, CUDA events), and per-step
CUDA kernel times (torch.profiler), at one or more shapes:

    python3 benchmarks/profile_rowwise.py [E,H,F,T ...] [--no-table] [KEY=VALUE ...]

``KEY=VALUE``: a launch CONFIG entry of ``kernels/triton_rowwise.py``. ``--no-table``: the ms per step only (what ran at each commit for
``git show f696c1f:benchmarks/results/fp8_rowwise/alone_by_commit.log``)."""

import sys

import torch
from torch.profiler import ProfilerActivity, profile

import functional_dw as fd
from functional_dw import fp8

args = [a for a in sys.argv[1:] if not a.startswith("--") and "=" not in a]
table = "--no-table" not in sys.argv
overrides = dict(a.split("=") for a in sys.argv[1:] if "=" in a)  # KEY=VALUE: launch CONFIG entries
if overrides:
    from functional_dw.kernels import triton_rowwise

    triton_rowwise.CONFIG.update({k: int(v) for k, v in overrides.items()})
    print("CONFIG", triton_rowwise.CONFIG, flush=True)
print("package:", fd.__file__, flush=True)  # (which checkout ran)
for shape in args or ["32,4096,1536,32768"]:
    E, H, F, T = map(int, shape.split(","))
    dev = "cuda"
    torch.manual_seed(0)
    m = fd.nn.GroupedLinear(E, H, F, bias=False, params_dtype=torch.bfloat16, device=dev)
    ws = m.weights()
    splits = torch.full((E,), T // E, device=dev)
    x = torch.randn(T, H, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(T, F, device=dev, dtype=torch.bfloat16)
    r = fp8.RowwiseScaling(bf16_below=0)  # FP8 at every size: the profile is of the FP8 step
    steps = {
        "rowwise": lambda: torch.autograd.grad(fd.grouped_linear(x, ws, splits, recipe=r), [x, *ws], dy),
        "bf16 auto": lambda: torch.autograd.grad(fd.grouped_linear(x, ws, splits, backend="auto"), [x, *ws], dy),
    }
    for name, step in steps.items():
        for _ in range(5):
            step()
        torch.cuda.synchronize()
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        ev[0].record()
        for _ in range(20):
            step()
        ev[1].record()
        torch.cuda.synchronize()
        ms = ev[0].elapsed_time(ev[1]) / 20
        print(f"== {shape} {name}: {ms:.3f} ms/step, {6 * T * H * F / ms / 1e9:.0f} TFLOP/s", flush=True)
        if table:
            with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as p:
                for _ in range(10):
                    step()
                torch.cuda.synchronize()
            print(p.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=70), flush=True)
