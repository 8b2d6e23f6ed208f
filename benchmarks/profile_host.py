"""Where the time of one forward+backward goes, on a CUDA machine (TE for the te paths).

    python benchmarks/profile_host.py [linear|split|grouped|auto ...] [--moe8k | --shape E,H,F,T]
        [--recipe delayed|current|block] [--cprofile] [--kernels] [--trace DIR]

For each implementation, functional_dw next to its peer (TE's module; for ``auto``, torch's
grouped GEMM under torch's own autograd): the host's microseconds to *issue* one step (no
sync: what the CPU costs) and the wall microseconds per step in steady state (with the GPU).
When issue time exceeds the GPU's time, the step is host-bound. Shapes: launch-bound tiny
(E=8, 128x128, 64 tokens) or ``--moe8k`` (E=8, hidden 4096, ffn 1536, 8192 tokens).
``--recipe`` runs split/grouped in FP8 (fd with the recipe, backend te; TE's module under
``te.autocast`` with TE's recipe of the class; delayed scaling's state updated after each fd step).
``--cprofile`` adds the top of a cProfile of functional_dw's step; ``--kernels`` a table of the
CUDA kernels of five steps of each (count, total us); ``--trace DIR`` writes Chrome traces
(torch.profiler, CPU and CUDA) of three steps of each.
"""

import argparse
import cProfile
import pstats
import time
from pathlib import Path

import torch

import functional_dw as fd

BF16, DEV = torch.bfloat16, "cuda"
IMPLS = ["linear", "split", "grouped", "auto"]


def issue_and_wall_us(step, iters=60, rounds=7) -> tuple[float, float]:
    """(min over rounds of host us per step before the sync, min of wall us per step)."""
    for _ in range(20):
        step()
    torch.cuda.synchronize()
    issue, wall = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(iters):
            step()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        issue.append((t1 - t0) / iters * 1e6)
        wall.append((t2 - t0) / iters * 1e6)
    return min(issue), min(wall)


def fp8_steps(impl, recipe, E, H, FF, T):
    """(fd step, TE step) in FP8 with ``recipe`` (delayed/current/block) on the split or grouped path."""
    import transformer_engine.pytorch as te
    from transformer_engine.common import recipe as te_recipes

    from functional_dw import fp8

    cls = {"delayed": "DelayedScaling", "current": "Float8CurrentScaling", "block": "Float8BlockScaling"}[recipe]
    x = torch.randn(T, H, device=DEV, dtype=BF16, requires_grad=True)
    dy = torch.randn(T, FF, device=DEV, dtype=BF16)
    grouped = impl == "grouped"
    host = [T // E] * E
    host[0] += T - sum(host)
    arg = torch.tensor(host, device=DEV) if grouped else host
    m = fd.nn.GroupedLinear(E, H, FF, bias=False, params_dtype=BF16, device=DEV)
    ws = m.weights()
    r = getattr(fp8, cls)()
    state = fp8.init_state(r, num_gemms=E, device=DEV) if recipe == "delayed" else None
    tm = te.GroupedLinear(E, H, FF, bias=False, params_dtype=BF16, device=DEV, use_grouped_tensor=grouped)
    tr = getattr(te_recipes, cls)()

    def ours():
        y = fd.grouped_linear(x, ws, arg, backend="te", use_grouped_tensor=grouped, recipe=r, fp8_state=state)
        g = torch.autograd.grad(y, [x, *ws], dy)
        if state is not None:
            fp8.update_state_(state, r)
        return g

    def peer():
        with te.autocast(enabled=True, recipe=tr):
            y = tm(x, arg)
        return torch.autograd.grad(y, [x, *tm.parameters()], dy)

    return ours, peer


def kernel_table(step, label, n=5):
    """The CUDA kernels of ``n`` steps: name, count per step, us per step (top 25 by time)."""
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=acts) as p:
        for _ in range(n):
            step()
        torch.cuda.synchronize()
    rows = [
        (e.key, e.count / n, e.self_device_time_total / n) for e in p.key_averages() if e.self_device_time_total > 0
    ]
    rows.sort(key=lambda r: -r[2])
    print(f"--- kernels of {label}: {sum(r[1] for r in rows):.0f} per step, {sum(r[2] for r in rows):.0f} us per step")
    for name, count, us in rows[:25]:
        print(f"  {us:9.1f} us  x{count:5.1f}  {name[:110]}")


def steps(impl, E, H, FF, T):
    x = torch.randn(T, H, device=DEV, dtype=BF16, requires_grad=True)
    dy = torch.randn(T, FF, device=DEV, dtype=BF16)
    ws = [torch.nn.Parameter(torch.randn(FF, H, device=DEV, dtype=BF16) * 0.02) for _ in range(E)]
    w_ENK = torch.nn.Parameter(torch.stack([w.detach() for w in ws]))
    host = [T // E] * E
    host[0] += T - sum(host)
    dev = torch.tensor(host, device=DEV)

    def grads(f, params):
        return lambda: torch.autograd.grad(f(x), [x, *params], dy)

    if impl == "auto":
        offs = dev.cumsum(0).to(torch.int32)
        return (
            grads(lambda x: fd.grouped_linear(x, w_ENK, dev, backend="auto"), [w_ENK]),
            grads(lambda x: torch._grouped_mm(x, w_ENK.transpose(-2, -1), offs=offs), [w_ENK]),
        )
    import transformer_engine.pytorch as te

    if impl == "linear":
        m = te.Linear(H, FF, bias=False, params_dtype=BF16, device=DEV)
        return grads(lambda x: fd.linear(x, ws[0], backend="te"), ws[:1]), grads(m, [m.weight])
    grouped = impl == "grouped"
    arg = dev if grouped else host
    m = te.GroupedLinear(E, H, FF, bias=False, params_dtype=BF16, device=DEV, use_grouped_tensor=grouped)
    return (
        grads(lambda x: fd.grouped_linear(x, ws, arg, use_grouped_tensor=grouped, backend="te"), ws),
        grads(lambda x: m(x, arg), list(m.parameters())),
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("impls", nargs="*", help=f"any of {IMPLS} (default: all)")
    parser.add_argument("--moe8k", action="store_true")
    parser.add_argument("--shape", help="E,H,F,T (default: E=8, 128x128, 64 tokens)")
    parser.add_argument("--recipe", choices=["delayed", "current", "block"])
    parser.add_argument("--cprofile", action="store_true")
    parser.add_argument("--kernels", action="store_true")
    parser.add_argument("--trace", type=Path)
    args = parser.parse_args()
    if set(args.impls) - set(IMPLS):  # not choices=: argparse rejects an empty "*" list with it
        parser.error(f"unknown implementation(s) {sorted(set(args.impls) - set(IMPLS))}; choose from {IMPLS}")
    shape = (8, 4096, 1536, 8192) if args.moe8k else (8, 128, 128, 64)
    if args.shape:
        shape = tuple(int(v) for v in args.shape.split(","))
    if args.recipe and set(args.impls or IMPLS) - {"split", "grouped"}:
        parser.error("--recipe runs the split and grouped implementations only")
    for impl in args.impls or IMPLS:
        ours, peer = fp8_steps(impl, args.recipe, *shape) if args.recipe else steps(impl, *shape)
        for label, step in (("fd", ours), ("peer", peer)):
            issue, wall = issue_and_wall_us(step)
            print(
                f"=== {impl} {args.recipe or 'bf16'} {shape} {label:4s}: issue {issue:7.1f} us/step, wall {wall:7.1f} us/step",
                flush=True,
            )
        for label, step in (("fd", ours), ("peer", peer)) if args.cprofile else ():
            print(f"--- cProfile of {impl} {args.recipe or 'bf16'} {shape} {label}, 50 steps")
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(50):
                step()
            torch.cuda.synchronize()
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(30)
        if args.kernels:
            for label, step in (("fd", ours), ("peer", peer)):
                kernel_table(step, f"{impl} {args.recipe or 'bf16'} {shape} {label}")
        if args.trace is not None:
            args.trace.mkdir(parents=True, exist_ok=True)
            acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            for label, step in (("fd", ours), ("peer", peer)):
                with torch.profiler.profile(activities=acts) as p:
                    for _ in range(3):
                        step()
                    torch.cuda.synchronize()
                p.export_chrome_trace(str(args.trace / f"{impl}-{label}.json"))


if __name__ == "__main__":
    main()
