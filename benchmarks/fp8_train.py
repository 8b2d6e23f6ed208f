"""Does an FP8 recipe train like bf16? Trains a small MoE expert MLP twice from the same initial
weights on the same data stream, once in bf16 (recipe None) and once under an FP8 recipe, and
compares the loss curves.

The model: ``GroupedLinear`` (hidden -> ffn, no bias), GELU, ``GroupedLinear`` (ffn -> hidden),
E experts, with a fixed random top-1 routing: each token goes to a random expert, drawn once
for the run; the tokens are sorted by expert and each expert's block is padded with zero rows
to a multiple of 16 (as TE's ``Fp8Padding``; ``--unaligned`` leaves the counts as drawn). The
task: regression onto a fixed random "teacher" MLP of the same shape (plain fp32 torch) plus
noise (std 0.01), inputs ~ N(0, 1), a fresh batch each step; MSE (in fp32) over the real tokens.
Parameters are bf16 (the modules are made in bfloat16 on the device), the optimizer is
``torch.optim.AdamW`` on them directly (no fp32 master weights), so both runs differ only in
the recipe.

Measured: the loss per step of each run; the max over steps >= 50 (for runs under 100 steps:
the second half) of ``|fp8 - bf16| / bf16`` on 10-step trailing moving averages of the two
curves; the mean loss of the last 10 steps of each. Written: ``<out>/losses_<recipe>.json``
and ``<out>/loss_<recipe>.png``; a markdown summary goes to stdout. Exit status 1 when the gap
exceeds ``--tolerance`` (or is not finite), 2 for a recipe this checkout lacks.

On the H200:
  python3 benchmarks/fp8_train.py --device cuda --recipe rowwise --steps 300 --experts 8 --hidden 1024 --ffn 2048 --tokens 16384
"""

from __future__ import annotations

import argparse
import json
import math
import platform
from pathlib import Path

import torch
import torch.nn.functional as F

from functional_dw import fp8
from functional_dw.nn import GroupedLinear

RECIPES = {
    "rowwise": "RowwiseScaling",
    "current": "Float8CurrentScaling",
    "block": "Float8BlockScaling",
    "delayed": "DelayedScaling",
    "none": None,
}  # --recipe -> the class in functional_dw.fp8
ALIGN = 16  # FP8 GEMMs need each expert's token count to be a multiple of 16
NOISE = 0.01  # std of the noise added to the teacher's targets
SMOOTH = 10  # window of the moving averages, and the number of final steps averaged
GAP_FROM = 50  # first step whose gap counts


class ExpertMLP(torch.nn.Module):
    """fc1 (hidden -> ffn), GELU, fc2 (ffn -> hidden), one GEMM per expert in each."""

    def __init__(
        self, experts: int, hidden: int, ffn: int, recipe: fp8.Recipe | None, device: torch.device, backend: str | None
    ) -> None:
        super().__init__()
        kw = dict(bias=False, params_dtype=torch.bfloat16, device=device, recipe=recipe, backend=backend)
        self.fc1 = GroupedLinear(experts, hidden, ffn, **kw)
        self.fc2 = GroupedLinear(experts, ffn, hidden, **kw)

    def forward(self, x: torch.Tensor, splits: list[int]) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x, splits)), splits)


def make_recipe(name: str) -> fp8.Recipe | None:
    """The recipe ``--recipe name`` stands for (looked up when asked: it may be newer than this
    checkout's ``functional_dw.fp8``); a LookupError names what is missing."""
    if RECIPES[name] is None:
        return None
    cls = getattr(fp8, RECIPES[name], None)
    if cls is None:
        raise LookupError(f"--recipe {name}: functional_dw.fp8.{RECIPES[name]} does not exist in this checkout")
    return cls(bf16_below=0) if cls is fp8.RowwiseScaling else cls()  # FP8 at every size: a study of FP8


def route(tokens: int, experts: int, align: int, g: torch.Generator) -> tuple[list[int], torch.Tensor]:
    """A random top-1 routing: (splits, rows). ``splits[e]``: expert e's token count rounded up
    to a multiple of ``align``; ``rows``: the padded row of each real token, in expert order."""
    counts = torch.randint(0, experts, (tokens,), generator=g).bincount(minlength=experts).tolist()
    splits = [-(-c // align) * align for c in counts]
    starts = [sum(splits[:e]) for e in range(experts)]
    return splits, torch.cat([torch.arange(s, s + c) for s, c in zip(starts, counts)])


def teacher(x: torch.Tensor, w1: list[torch.Tensor], w2: list[torch.Tensor], splits: list[int]) -> torch.Tensor:
    """The target MLP in plain fp32 torch, one expert at a time."""
    return torch.cat([F.linear(F.gelu(F.linear(xe, a)), b) for xe, a, b in zip(x.split(splits), w1, w2)])


def moving_average(curve: torch.Tensor, window: int) -> torch.Tensor:
    """Trailing mean over the last ``window`` points (fewer at the start); NaN stays NaN."""
    return torch.stack([curve[max(0, i + 1 - window) : i + 1].mean() for i in range(len(curve))])


def summarize(loss_bf16: list[float], loss_fp8: list[float]) -> dict:
    """The max relative gap of the smoothed curves from step ``GAP_FROM`` (NaN if either curve
    has one there), and the mean of each curve's last ``SMOOTH`` losses."""
    a, b = torch.tensor(loss_bf16, dtype=torch.float64), torch.tensor(loss_fp8, dtype=torch.float64)
    start = min(GAP_FROM, len(a) // 2)
    ref = moving_average(a, SMOOTH)
    gaps = (moving_average(b, SMOOTH) - ref).abs() / ref
    return dict(
        max_rel_gap=gaps[start:].max().item(),
        gap_from_step=start,
        smoothing_window=SMOOTH,
        final_bf16=a[-SMOOTH:].mean().item(),
        final_fp8=b[-SMOOTH:].mean().item(),
    )


def train(args: argparse.Namespace, recipe: fp8.Recipe | None) -> tuple[list[float], list[float]]:
    """The two runs, stepped side by side on each batch: (bf16 losses, recipe losses)."""
    device = torch.device(args.device)
    E, H, F_ = args.experts, args.hidden, args.ffn
    g = torch.Generator().manual_seed(args.seed)
    splits, rows = route(args.tokens, E, 1 if args.unaligned else ALIGN, g)
    rows = rows.to(device)
    w1 = [(torch.randn(F_, H, generator=g) / H**0.5).to(device) for _ in range(E)]
    w2 = [(torch.randn(H, F_, generator=g) / F_**0.5).to(device) for _ in range(E)]
    torch.manual_seed(args.seed)
    models = [ExpertMLP(E, H, F_, None, device, args.backend), ExpertMLP(E, H, F_, recipe, device, args.backend)]
    models[1].load_state_dict(models[0].state_dict())
    opts = [torch.optim.AdamW(m.parameters(), lr=args.lr) for m in models]
    data = torch.Generator(device).manual_seed(args.seed + 1)
    losses: list[list[torch.Tensor]] = [[], []]
    for _ in range(args.steps):
        x = torch.zeros(sum(splits), H, device=device)
        x[rows] = torch.randn(len(rows), H, generator=data, device=device)
        target = teacher(x, w1, w2, splits)[rows]
        target += NOISE * torch.randn(target.shape, generator=data, device=device)
        x = x.bfloat16()
        for model, opt, curve in zip(models, opts, losses):
            loss = F.mse_loss(model(x, splits)[rows].float(), target)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            curve.append(loss.detach())
    return torch.stack(losses[0]).tolist(), torch.stack(losses[1]).tolist()


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend, or None (saying so) without matplotlib; mlp_train.py's too."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plot")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def add_backend_argument(p: argparse.ArgumentParser, module: str) -> None:
    """``--backend``, the backend of the script's ``module``; mlp_train.py's too."""
    p.add_argument(
        "--backend",
        choices=["torch", "te", "auto"],
        default=None,
        help=f"{module}'s backend (default: the fastest measured, as backend=None picks)",
    )


def run_info(args: argparse.Namespace, device: torch.device) -> dict:
    """The result's description of the run: the arguments, torch, the device's name, the steps; mlp_train.py's too."""
    return dict(
        config={k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        torch=torch.__version__,
        device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        steps=list(range(args.steps)),
    )


def plot(path: Path, result: dict, title: str) -> None:
    """Both loss curves on a log scale, into ``path`` (skipped, saying so, without matplotlib)."""
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(8, 5))
    ax.plot(result["steps"], result["loss_bf16"], label="bf16", lw=1)
    ax.plot(result["steps"], result["loss_fp8"], label=f"recipe {result['config']['recipe']}", lw=1)
    ax.set(yscale="log", xlabel="step", ylabel="MSE loss", title=title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument(
        "--recipe",
        choices=list(RECIPES),
        default="rowwise",
        help="the FP8 recipe of the second run (none: a second bf16 run, gap 0)",
    )
    p.add_argument("--device", default="cuda", help="cuda or cpu (the reference backend emulates FP8)")
    add_backend_argument(p, "GroupedLinear")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument(
        "--unaligned",
        action="store_true",
        help="leave each expert's token count as drawn (default: padded to a multiple of 16)",
    )
    p.add_argument("--tolerance", type=float, default=0.05, help="largest smoothed relative gap that passes")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/fp8_train"))
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:
        recipe = make_recipe(args.recipe)
    except LookupError as e:
        p.error(str(e))

    loss_bf16, loss_fp8 = train(args, recipe)
    summary = summarize(loss_bf16, loss_fp8)
    ok = summary["max_rel_gap"] <= args.tolerance  # (False for NaN)
    device = torch.device(args.device)
    result = dict(
        **run_info(args, device),
        loss_bf16=loss_bf16,
        loss_fp8=loss_fp8,
        summary=dict(summary, ok=ok),
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"losses_{args.recipe}.json").write_text(json.dumps(result, indent=1))
    config = (
        f"E={args.experts} H={args.hidden} F={args.ffn} T={args.tokens}"
        f"{' unaligned' if args.unaligned else ''}, {args.steps} steps, lr {args.lr}"
    )
    plot(
        args.out / f"loss_{args.recipe}.png",
        result,
        f"bf16 vs {args.recipe}: {config}\nmax relative gap (smoothed, steps >= {summary['gap_from_step']}): "
        f"{summary['max_rel_gap']:.4f}",
    )

    print(f"## FP8 training check: recipe {args.recipe} vs bf16 ({config}, {result['device_name']})\n")
    print(f"| run | first loss | final loss (mean of last {SMOOTH}) |")
    print("|-----|------------|-----------------------------|")
    print(f"| bf16 | {loss_bf16[0]:.5g} | {summary['final_bf16']:.5g} |")
    print(f"| {args.recipe} | {loss_fp8[0]:.5g} | {summary['final_fp8']:.5g} |")
    gap = summary["max_rel_gap"]
    print(
        f"\nmax relative gap ({SMOOTH}-step moving averages, steps >= {summary['gap_from_step']}): {gap:.4g} "
        f"(tolerance {args.tolerance}): {'OK' if ok else 'FAIL'}" + ("" if math.isfinite(gap) else " (not finite)")
    )
    print(f"written: {args.out / f'losses_{args.recipe}.json'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
