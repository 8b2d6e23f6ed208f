"""Host (Python) time per forward+backward at tiny CPU shapes: functional_dw next to torch.

    python benchmarks/host_cpu.py [--rounds R] [--iters I] [--out PATH]

E=8 experts, T=64 tokens, K=N=32, fp32, backend="torch", on the CPU: the GEMMs cost next to
nothing, so the numbers are what each call costs the host. Each row is the min over R
interleaved rounds (every implementation once per round) of the mean us per step over I steps.
Writes benchmarks/results/host_cpu.json.
"""
import argparse
import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's functional_dw

import torch
import torch.nn.functional as F

import functional_dw as fd

E, T, K, N = 8, 64, 32, 32


def cases():
    torch.manual_seed(0)
    x = torch.randn(T, K, requires_grad=True)
    dy_lin = torch.randn(T, N)
    w = torch.nn.Parameter(torch.randn(N, K) * 0.1)
    w_ENK = torch.nn.Parameter(torch.randn(E, N, K) * 0.1)
    host = [T // E] * E
    splits_t = torch.tensor(host)
    offs = splits_t.cumsum(0).to(torch.int32)
    m = fd.nn.GroupedLinear(E, K, N, bias=False)
    ws = list(m.parameters())

    def step(f, params):
        return lambda: torch.autograd.grad(f(x), [x, *params], dy_lin)

    return {
        "fd linear": step(lambda x: fd.linear(x, w, backend="torch"), [w]),
        "F.linear (autograd)": step(lambda x: F.linear(x, w), [w]),
        "fd grouped, stacked [E,N,K]": step(lambda x: fd.grouped_linear(x, w_ENK, host, backend="torch"), [w_ENK]),
        "fd grouped, list (nn.GroupedLinear)": step(lambda x: fd.grouped_linear(x, ws, host, backend="torch"), ws),
        "fd grouped, stacked, tensor splits": step(
            lambda x: fd.grouped_linear(x, w_ENK, splits_t, backend="torch"), [w_ENK]),
        "torch._grouped_mm (autograd)": step(
            lambda x: torch._grouped_mm(x, w_ENK.transpose(-2, -1), offs=offs), [w_ENK]),
    }


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "host_cpu.json")
    args = p.parse_args()
    torch.set_num_threads(1)
    steps = cases()
    for f in steps.values():
        for _ in range(50):
            f()
    best = {k: float("inf") for k in steps}
    for _ in range(args.rounds):
        for k, f in steps.items():
            t0 = time.perf_counter()
            for _ in range(args.iters):
                f()
            best[k] = min(best[k], (time.perf_counter() - t0) / args.iters * 1e6)
    print(f"E={E} T={T} K={K} N={N} fp32 CPU, backend='torch'; us per fwd+bwd, min of {args.rounds} interleaved rounds")
    w = max(map(len, best))
    for k, v in best.items():
        print(f"  {k:<{w}}  {v:8.1f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "shape": {"E": E, "T": T, "K": K, "N": N, "dtype": "float32", "device": "cpu", "backend": "torch"},
        "torch": torch.__version__, "python": platform.python_version(), "rounds": args.rounds, "iters": args.iters,
        "us_per_step": best,
    }, indent=1) + "\n")


if __name__ == "__main__":
    main()
