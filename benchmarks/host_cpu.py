"""The host-time proxy on the CPU: functional_dw's expert layer next to torch's autograd grouped_mm.

    python benchmarks/host_cpu.py [--experts 8,32,128] [--rounds R] [--iters I] [--quick] [--out DIR]

Tiny shapes (4 tokens per expert, K = N = 32, float32, ``backend="torch"``), so the GEMMs cost
next to nothing and each number is what a fwd+bwd step costs the host: Python, the autograd
engine, the dispatcher. Contenders, interleaved (every one once per round; each number is the
min over R rounds of the mean over I steps, in microseconds):

* ``torch grouped_mm``: ``torch._grouped_mm`` under autograd on one ``[E, N, K]`` parameter, its offsets
  computed from the counts at every step (torchtitan's ``cumsum``), as a torch MoE does;
* ``fd, one [E, N, K] weight``: ``nn.GroupedLinear(single_grouped_weight=True)``;
* ``fd, E weights (TE's layout)``: ``nn.GroupedLinear`` with per-expert parameters (views of one
  buffer): the autograd engine accumulates E gradients, one per parameter;
* ``torch MLP``: the expert MLP as torch composes it (Megatron's unfused SwiGLU weighted by the router's
  probs between two autograd ``grouped_mm`` on one ``[E, 2F, K]`` / ``[E, K, F]`` parameter each, F = N);
  ``fd GroupedMLP``: ``nn.GroupedMLP(E, K, N)`` as constructed (one weight per linear), ``m(x, splits, probs)``;
* ``autograd engine, E leaves``: what the engine alone charges for E parameters: a no-op
  autograd Function whose backward hands E views of one buffer to E leaves, minus the same
  with one leaf (so the per-parameter cost of TE's layout, which no layer can avoid).

The splits are host lists (the split counts a CPU step reads). ``--quick`` (E=8 and 32, few
rounds: seconds) is what the CI runs; the numbers it writes are not meant to be compared.
Writes ``DIR/host_cpu.json`` and ``DIR/host_cpu.md`` (default ``benchmarks/results/host_cpu/``; with
``--quick``, a temporary folder).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's functional_dw

import torch

import functional_dw as fd

K = N = 32
RESULTS = Path(__file__).parent / "results" / "host_cpu"
TOKENS_PER_EXPERT = 4


class _Leaves(torch.autograd.Function):
    """y = x; backward hands each of the E leaves a view of one zero buffer (no GEMM)."""

    @staticmethod
    def forward(x, *ws):
        return x.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.shape = (len(inputs) - 1, *inputs[1].shape)

    @staticmethod
    def backward(ctx, g):
        return (g, *torch.zeros(ctx.shape).unbind(0))


def _torch_mlp(x, w1, w2, probs, counts):
    """torch's expert MLP: grouped_mm, the weighted SwiGLU in torch ops, grouped_mm (offsets per step)."""
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    gate, up = torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs).chunk(2, -1)
    h = torch.nn.functional.silu(gate) * up * probs[:, None]
    return torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs)


def contenders(E: int) -> dict:
    torch.manual_seed(0)
    T = TOKENS_PER_EXPERT * E
    x = torch.randn(T, K, requires_grad=True)
    dy = torch.randn(T, N)
    splits = [TOKENS_PER_EXPERT] * E
    counts = torch.tensor(splits)
    w_ENK = torch.nn.Parameter(torch.randn(E, N, K) * 0.1)
    single = fd.nn.GroupedLinear(E, K, N, bias=False, backend="torch", single_grouped_weight=True)
    per_expert = fd.nn.GroupedLinear(E, K, N, bias=False, backend="torch")
    mlp = fd.nn.GroupedMLP(E, K, N, backend="torch")
    w1, w2 = torch.nn.Parameter(torch.randn(E, 2 * N, K) * 0.1), torch.nn.Parameter(torch.randn(E, K, N) * 0.1)
    probs = torch.rand(T, requires_grad=True)
    dy_K = torch.randn(T, K)
    leaves = [torch.nn.Parameter(t) for t in torch.zeros(E, N, K).unbind(0)]
    one_leaf = [torch.nn.Parameter(torch.zeros(N, K))]

    def step(forward):
        def run():
            torch.autograd.backward(forward(), dy)

        return run

    return {
        "torch grouped_mm": step(
            lambda: torch._grouped_mm(x, w_ENK.transpose(-2, -1), offs=torch.cumsum(counts, 0, dtype=torch.int32))
        ),
        "fd, one [E, N, K] weight": step(lambda: single(x, splits)),
        "fd, E weights (TE's layout)": step(lambda: per_expert(x, splits)),
        "torch MLP": lambda: torch.autograd.backward(_torch_mlp(x, w1, w2, probs, counts), dy_K),
        "fd GroupedMLP": lambda: torch.autograd.backward(mlp(x, splits, probs), dy_K),
        "engine, E leaves": lambda: torch.autograd.backward(_Leaves.apply(x, *leaves), dy[:, :1].expand(T, K)),
        "engine, 1 leaf": lambda: torch.autograd.backward(_Leaves.apply(x, *one_leaf), dy[:, :1].expand(T, K)),
    }


def measure(E: int, rounds: int, iters: int) -> dict[str, float]:
    steps = contenders(E)
    for f in steps.values():
        for _ in range(max(5, iters // 10)):
            f()
    best = {k: float("inf") for k in steps}
    for _ in range(rounds):
        for k, f in steps.items():
            t0 = time.perf_counter()
            for _ in range(iters):
                f()
            best[k] = min(best[k], (time.perf_counter() - t0) / iters * 1e6)
    best["engine per extra parameter"] = (best.pop("engine, E leaves") - best.pop("engine, 1 leaf")) / max(E - 1, 1)
    return best


def markdown(result: dict) -> str:
    lines = [
        f"# Host time per fwd+bwd step on the CPU (us; {result['shape']})",
        "",
        f"torch {result['torch']}, Python {result['python']}, {result['rounds']} rounds x {result['iters']} steps"
        f"{' (quick: not for comparison)' if result['quick'] else ''}.",
        "",
        "| E | torch grouped_mm | fd, one [E,N,K] weight | ratio | fd, E weights | ratio | engine per extra parameter "
        "| torch MLP | fd GroupedMLP | ratio |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for E, r in result["us_per_step"].items():
        t = r["torch grouped_mm"]
        one, per = r["fd, one [E, N, K] weight"], r["fd, E weights (TE's layout)"]
        tm, fm = r["torch MLP"], r["fd GroupedMLP"]
        lines.append(
            f"| {E} | {t:.1f} | {one:.1f} | {one / t:.2f}x | {per:.1f} | {per / t:.2f}x | "
            f"{r['engine per extra parameter']:.2f} | {tm:.1f} | {fm:.1f} | {fm / tm:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", default="8,32,128")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--quick", action="store_true", help="E=8,32, 2 rounds of 20 steps (seconds; what the CI runs)")
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="default benchmarks/results/host_cpu/; with --quick a temporary folder (its numbers are not data)",
    )
    args = p.parse_args(argv)
    experts = [int(e) for e in args.experts.split(",")]
    if args.quick:
        experts, args.rounds, args.iters = [e for e in experts if e <= 32] or experts[:1], 2, 20
    torch.set_num_threads(1)
    result = {
        "shape": f"{TOKENS_PER_EXPERT} tokens per expert, K=N={K}, float32, backend='torch'",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "rounds": args.rounds,
        "iters": args.iters,
        "quick": args.quick,
        "us_per_step": {E: measure(E, args.rounds, args.iters) for E in experts},
    }
    if args.out is None:
        args.out = Path(tempfile.mkdtemp(prefix="host_cpu_")) if args.quick else RESULTS
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "host_cpu.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "host_cpu.md").write_text(markdown(result))
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
