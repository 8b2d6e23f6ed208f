"""Where the host time of one forward+backward goes, on a CUDA machine with TE.

    python benchmarks/profile_host.py [linear|split|grouped|auto ...] [--moe8k]

For each named implementation: CPU microseconds per forward+backward next to TE's module (or
torch's raw grouped GEMM for ``auto``), the top of a cProfile of functional_dw's step, and, with
``--moe8k`` (E=8, hidden 4096, ffn 1536, 8192 tokens), the GPU kernels torch.profiler sees.
"""
import cProfile
import gc
import pstats
import sys
import time

import torch

import functional_dw as fd

BF16, DEV = torch.bfloat16, "cuda"


def host_us(step, iters=300):
    for _ in range(30):
        step()
    torch.cuda.synchronize()
    best = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(iters // 5):
            step()
        torch.cuda.synchronize()
        best.append((time.perf_counter() - t0) / (iters // 5) * 1e6)
    return min(best)


def steps(impl, E, H, FF, T):
    import transformer_engine.pytorch as te

    x = torch.randn(T, H, device=DEV, dtype=BF16, requires_grad=True)
    dy = torch.randn(T, FF, device=DEV, dtype=BF16)
    ws = [torch.nn.Parameter(torch.randn(FF, H, device=DEV, dtype=BF16) * 0.02) for _ in range(E)]
    w_ENK = torch.nn.Parameter(torch.stack([w.detach() for w in ws]))
    host = [T // E] * E
    host[0] += T - sum(host)
    dev = torch.tensor(host, device=DEV)

    def grads(f, params):
        return lambda: torch.autograd.grad(f(x), [x, *params], dy)

    if impl == "linear":
        m = te.Linear(H, FF, bias=False, params_dtype=BF16, device=DEV)
        return grads(lambda x: fd.linear(x, ws[0], backend="te"), ws[:1]), grads(m, [m.weight])
    if impl in ("split", "grouped"):
        grouped = impl == "grouped"
        arg = dev if grouped else host
        m = te.GroupedLinear(E, H, FF, bias=False, params_dtype=BF16, device=DEV, use_grouped_tensor=grouped)
        ours = grads(lambda x: fd.grouped_linear(x, ws, arg, use_grouped_tensor=grouped, backend="te"), ws)
        return ours, grads(lambda x: m(x, arg), list(m.parameters()))
    offs = dev.cumsum(0).to(torch.int32)

    def raw():
        torch._grouped_mm(x, w_ENK.transpose(-2, -1), offs=offs)
        torch._grouped_mm(dy, w_ENK, offs=offs)
        torch._grouped_mm(dy.t(), x, offs=offs)
    return grads(lambda x: fd.grouped_linear(x, w_ENK, dev, backend="auto"), [w_ENK]), raw


def main():
    impls = [a for a in sys.argv[1:] if not a.startswith("--")] or ["linear", "split", "grouped", "auto"]
    shape = (8, 4096, 1536, 8192) if "--moe8k" in sys.argv else (8, 128, 128, 64)
    for impl in impls:
        ours, peer = steps(impl, *shape)
        print(f"\n=== {impl} {shape}: host us per fwd+bwd  fd {host_us(ours):.1f}  peer {host_us(peer):.1f}", flush=True)
        gc.disable()
        print(f"=== {impl} gc off: fd {host_us(ours):.1f}  peer {host_us(peer):.1f}", flush=True)
        gc.enable()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(200):
            ours()
        torch.cuda.synchronize()
        prof.disable()
        stats = pstats.Stats(prof)
        stats.sort_stats("tottime").print_stats(18)
        stats.sort_stats("cumulative").print_stats(25)
        stats.print_callees("tree_unflatten|_flatten_cotangents")
        if "--moe8k" in sys.argv:
            for label, step in (("fd", ours), ("peer", peer)):
                acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
                with torch.profiler.profile(activities=acts) as p:
                    for _ in range(10):
                        step()
                    torch.cuda.synchronize()
                print(label, "(10 steps)\n", p.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
