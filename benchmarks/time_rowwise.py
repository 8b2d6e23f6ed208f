"""ms per step of fd RowwiseScaling and fd bf16 auto, each alone (20 steps back to back, CUDA events), module-list weights, balanced device splits: python3 benchmarks/time_rowwise.py E,H,F,T [...]"""
import sys, torch, functional_dw as fd
from functional_dw import fp8
print("package:", fd.__file__)  # (which checkout ran)
for shape in sys.argv[1:]:
    E, H, F, T = map(int, shape.split(","))
    torch.manual_seed(0)
    m = fd.nn.GroupedLinear(E, H, F, bias=False, params_dtype=torch.bfloat16, device="cuda")
    ws = m.weights()
    splits = torch.full((E,), T // E, device="cuda")
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(T, F, device="cuda", dtype=torch.bfloat16)
    r = fp8.RowwiseScaling()
    out = []
    for name, step in {"rowwise": lambda: torch.autograd.grad(fd.grouped_linear(x, ws, splits, recipe=r), [x, *ws], dy),
                       "bf16": lambda: torch.autograd.grad(fd.grouped_linear(x, ws, splits, backend="auto"), [x, *ws], dy)}.items():
        for _ in range(5): step()
        torch.cuda.synchronize()
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        ev[0].record()
        for _ in range(20): step()
        ev[1].record(); torch.cuda.synchronize()
        ms = ev[0].elapsed_time(ev[1]) / 20
        out.append(f"{name} {ms:.3f} ms {6*T*H*F/ms/1e9:.0f} TF")
    print(shape, " | ".join(out), flush=True)
