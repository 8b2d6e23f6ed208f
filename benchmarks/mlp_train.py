"""Does FP8 train a MoE block like bf16? Trains a small MoE block (router, permute, the expert MLP as
``functional_dw.nn.GroupedMLP``, unpermute) once in bf16 and once per FP8 recipe, from the same initial
weights on the same data stream, and compares the loss curves (issue 31).

The block, for x ``[T, H]``:

* router: ``torch.nn.Linear(H, E, bias=False)`` in float32 on ``x.float()``; top-k of the logits, softmax over
  the k chosen (the probs, float32, get gradients through the MLP's ``dprobs``);
* permute: the T*k (token, choice) rows sorted by expert, each expert's block padded with zero rows (probs 0)
  to a multiple of 16 (FP8 GEMMs' rule, as TE's ``Fp8Padding``), the splits passed as a host list;
* ``GroupedMLP(E, H, F, activation="swiglu")`` (bf16 parameters, stacked ``[E, out, in]`` weights), the probs
  weighting the activation: ``fc2(silu(gate) * up * probs)``;
* unpermute: each token sums its k rows (in float32).

The task: regression onto a fixed random "teacher" MoE block of the same shape (plain float32 torch, its own
router, weights ~ N(0, 1/in)) plus noise (std 0.01); inputs ~ N(0, 1), a fresh batch each step; MSE in
float32. The optimizer is ``torch.optim.AdamW`` on the parameters directly (no fp32 master weights), so the
runs differ only in the recipe. Runs (``--recipes``): ``rowwise`` (``fp8.RowwiseScaling``), ``current``
(``fp8.Float8CurrentScaling``, TE's recipe: TE's kernels on CUDA with TE installed, emulated otherwise) and
``block`` (``fp8.Float8BlockScaling``); a run that raises is reported with its reason, the others go on. A
control run (``--control``, on by default) is bf16 again with the router's initial weights perturbed by a
relative 1e-3: its gap is how far two bf16 trajectories drift apart once routing decisions differ, the
floor against which the FP8 runs' gaps read (it is reported, not judged).

Measured: each run's loss per step; for each FP8 run, over the last 50 steps (the second half of shorter
runs), the max of ``|fp8 - bf16| / bf16`` on 10-step trailing moving averages of the two curves (the goal:
within 1%, ``--tolerance``) and per step (raw); each run's final loss (mean of its last 10). Written to
``--out``: ``losses.json`` (every curve, the configuration, the summary), ``loss.png`` (matplotlib if
importable) and ``summary.md`` (also printed). Exit status 1 when a smoothed gap exceeds ``--tolerance`` (or is
not finite) or a run raised.

On the H200 (defaults on CUDA: E=8, top-2, H=1024, F=1024, 8192 tokens, 300 steps):
  python3 benchmarks/mlp_train.py --device cuda
On the CPU (smaller defaults: E=4, H=64, F=64, 256 tokens; the FP8 recipes emulated):
  python3 benchmarks/mlp_train.py --device cpu --steps 20
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fp8_train import add_backend_argument, moving_average, pyplot, run_info  # (beside this file)

from functional_dw import fp8
from functional_dw.nn import GroupedMLP

RECIPES = {"rowwise": "RowwiseScaling", "current": "Float8CurrentScaling", "block": "Float8BlockScaling"}
ALIGN = 16  # each expert's rows padded to a multiple of this (FP8 GEMMs' rule)
NOISE = 0.01  # std of the noise added to the teacher's targets
SMOOTH = 10  # moving-average window, and the number of final steps averaged
LAST = 50  # the gap counts over this many final steps (at most half the run)
DEFAULTS = {  # --device -> (experts, top_k, hidden, ffn, tokens)
    "cuda": (8, 2, 1024, 1024, 8192),
    "cpu": (4, 2, 64, 64, 256),
}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
CONTROL = "control"  # bf16, the router's initial weights times (1 + 1e-3 N(0, 1))
PERTURB = 1e-3


class MoEBlock(torch.nn.Module):
    """Router (float32), top-k softmax, permute (padded per expert), GroupedMLP, unpermute."""

    def __init__(self, experts, top_k, hidden, ffn, recipe, device, dtype, backend) -> None:
        super().__init__()
        self.top_k = top_k
        self.router = torch.nn.Linear(hidden, experts, bias=False, device=device, dtype=torch.float32)
        self.mlp = GroupedMLP(
            experts,
            hidden,
            ffn,
            activation="swiglu",
            params_dtype=dtype,
            device=device,
            backend=backend,
            single_grouped_weight=True,
            recipe=recipe,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs, experts = route(self.router(x.float()), self.top_k)
        rows, splits, token, pos = permute(experts, self.router.out_features, ALIGN)
        xp = x.new_zeros(rows, x.shape[1]).index_copy(0, pos, x[token])
        pp = probs.new_zeros(rows).index_copy(0, pos, probs.reshape(-1)[_order(experts)])
        yp = self.mlp(xp, splits, pp)
        return torch.zeros(x.shape, device=x.device).index_add(0, token, yp[pos].float())


def route(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of the logits, softmax over the k chosen: (probs [T, k], experts [T, k])."""
    top, experts = logits.topk(k, dim=-1)
    return top.softmax(-1), experts


def _order(experts: torch.Tensor) -> torch.Tensor:
    return experts.reshape(-1).argsort(stable=True)


def permute(experts: torch.Tensor, E: int, align: int) -> tuple[int, list[int], torch.Tensor, torch.Tensor]:
    """The expert-sorted layout of the T*k (token, choice) rows, each expert's block padded to a multiple of
    ``align``: (rows in all, the padded splits as a host list, each sorted row's token, its padded row)."""
    flat = experts.reshape(-1)
    order = _order(experts)
    counts = torch.bincount(flat, minlength=E)
    padded = (counts + align - 1) // align * align
    starts, pstarts = counts.cumsum(0) - counts, padded.cumsum(0) - padded
    e = flat[order]
    pos = pstarts[e] + torch.arange(len(flat), device=flat.device) - starts[e]
    splits = padded.tolist()  # (a host sync per step: a training loop, not a benchmark)
    return sum(splits), splits, order // experts.shape[1], pos


class Teacher:
    """The target: a fixed random MoE block in plain float32 torch, one expert at a time."""

    def __init__(self, E, k, H, F_, g, device) -> None:
        self.k = k
        self.wr = (torch.randn(E, H, generator=g) / H**0.5).to(device)
        self.w1 = (torch.randn(E, 2 * F_, H, generator=g) / H**0.5).to(device)
        self.w2 = (torch.randn(E, H, F_, generator=g) / F_**0.5).to(device)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        probs, experts = route(x @ self.wr.t(), self.k)
        y = torch.zeros_like(x)
        for e in range(self.w1.shape[0]):
            t, j = (experts == e).nonzero(as_tuple=True)
            gate, up = (x[t] @ self.w1[e].t()).chunk(2, -1)
            y.index_add_(0, t, (F.silu(gate) * up * probs[t, j, None]) @ self.w2[e].t())
        return y


def summarize(ref: list[float], run: list[float]) -> dict:
    """The max relative gap of ``run`` to ``ref`` over the last ``LAST`` steps (at most half the run): on
    ``SMOOTH``-step moving averages, and per step; each curve's mean over its last ``SMOOTH`` steps."""
    a, b = torch.tensor(ref, dtype=torch.float64), torch.tensor(run, dtype=torch.float64)
    last = min(LAST, max(1, len(a) // 2))
    smooth = (moving_average(b, SMOOTH) - moving_average(a, SMOOTH)).abs() / moving_average(a, SMOOTH)
    raw = (b - a).abs() / a
    return dict(
        gap_steps=last,
        max_rel_gap=smooth[-last:].max().item(),
        max_rel_gap_raw=raw[-last:].max().item(),
        final=b[-SMOOTH:].mean().item(),
        final_bf16=a[-SMOOTH:].mean().item(),
    )


def make_recipe(name: str) -> fp8.Recipe:
    cls = getattr(fp8, RECIPES[name], None)
    if cls is None:
        raise LookupError(f"functional_dw.fp8.{RECIPES[name]} does not exist in this checkout")
    return cls(bf16_below=0) if cls is fp8.RowwiseScaling else cls()  # FP8 at every size: a study of FP8


def _why(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"raises {type(e).__name__}: {msg[0][:200] if msg else ''}"


def train(args: argparse.Namespace, names: list[str]) -> tuple[dict[str, list[float]], dict[str, str]]:
    """Every run stepped side by side on each batch: ({run: its losses}, {run: why it stopped})."""
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    g = torch.Generator().manual_seed(args.seed)
    teacher = Teacher(args.experts, args.top_k, args.hidden, args.ffn, g, device)
    torch.manual_seed(args.seed)
    shape = (args.experts, args.top_k, args.hidden, args.ffn)
    models, errors = {"bf16": MoEBlock(*shape, None, device, dtype, args.backend)}, {}
    for name in names:
        try:
            models[name] = MoEBlock(*shape, None if name == CONTROL else make_recipe(name), device, dtype, args.backend)
            models[name].load_state_dict(models["bf16"].state_dict())
            if name == CONTROL:
                w = models[name].router.weight
                with torch.no_grad():
                    w.mul_(1 + PERTURB * torch.randn(w.shape, generator=g).to(device))
        except Exception as e:  # noqa: BLE001  (a recipe this checkout or machine lacks: the others go on)
            errors[name] = _why(e)
            models.pop(name, None)
    opts = {n: torch.optim.AdamW(m.parameters(), lr=args.lr) for n, m in models.items()}
    data = torch.Generator(device).manual_seed(args.seed + 1)
    losses: dict[str, list[torch.Tensor]] = {n: [] for n in models}
    for _ in range(args.steps):
        x = torch.randn(args.tokens, args.hidden, generator=data, device=device)
        target = teacher(x) + NOISE * torch.randn(x.shape, generator=data, device=device)
        x = x.to(dtype)
        for name in list(models):
            try:
                loss = F.mse_loss(models[name](x), target)
                opts[name].zero_grad(set_to_none=True)
                loss.backward()
                opts[name].step()
                losses[name].append(loss.detach())
            except Exception as e:  # noqa: BLE001
                if name == "bf16":
                    raise
                errors[name] = f"step {len(losses[name])}: {_why(e)}"
                del models[name], opts[name], losses[name]
    return {n: torch.stack(c).tolist() for n, c in losses.items()}, errors


def plot(path: Path, result: dict, title: str) -> None:
    """The loss curves (log scale) and each FP8 run's smoothed relative gap, into ``path`` (skipped, saying
    so, without matplotlib)."""
    plt = pyplot()
    if plt is None:
        return
    fig, (ax, gap) = plt.subplots(2, 1, figsize=(8, 7), sharex=True, height_ratios=(2, 1))
    ref = torch.tensor(result["losses"]["bf16"], dtype=torch.float64)
    for name, curve in result["losses"].items():
        ax.plot(result["steps"], curve, label=name, lw=1)
        if name != "bf16":
            b = torch.tensor(curve, dtype=torch.float64)
            rel = (moving_average(b, SMOOTH) - moving_average(ref, SMOOTH)) / moving_average(ref, SMOOTH)
            gap.plot(result["steps"], (100 * rel).tolist(), label=name, lw=1)
    ax.set(yscale="log", ylabel="MSE loss", title=title)
    ax.legend()
    gap.axhline(0, color="k", lw=0.5)
    gap.set(xlabel="step", ylabel=f"vs bf16, %\n({SMOOTH}-step averages)")
    if len(result["losses"]) > 1:
        gap.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def markdown(result: dict, tolerance: float) -> str:
    c, losses, summary = result["config"], result["losses"], result["summary"]
    lines = [
        f"# MoE block training: FP8 vs bf16 ({result['device_name']}, torch {result['torch']})",
        "",
        f"`{result['command']}`",
        "",
        f"E={c['experts']} top-{c['top_k']}, hidden {c['hidden']}, ffn {c['ffn']} (SwiGLU), {c['tokens']} tokens per "
        f"step, {c['steps']} steps, AdamW lr {c['lr']}, {c['dtype']} parameters and activations, seed {c['seed']}. Gap: "
        f"max over the last {next(iter(summary.values()))['gap_steps'] if summary else LAST} steps of |fp8 - bf16| / "
        f"bf16, on {SMOOTH}-step moving averages (and per step); final: mean of the last {SMOOTH} losses.",
        "",
        f"| run | first loss | final loss | max gap vs bf16 ({SMOOTH}-step averages) | max gap per step | "
        f"within {tolerance:.0%} |",
        "|---|---|---|---|---|---|",
        f"| bf16 | {losses['bf16'][0]:.5g} | {sum(losses['bf16'][-SMOOTH:]) / len(losses['bf16'][-SMOOTH:]):.5g} "
        "| - | - | - |",
    ]
    for name, s in summary.items():
        label = f"{CONTROL} (bf16, router init x (1 + {PERTURB:g} N(0, 1)))" if name == CONTROL else name
        judged = "- (the floor)" if s["ok"] is None else "yes" if s["ok"] else "NO"
        lines.append(
            f"| {label} | {losses[name][0]:.5g} | {s['final']:.5g} | {s['max_rel_gap']:.3%} | "
            f"{s['max_rel_gap_raw']:.3%} | {judged} |"
        )
    for name, why in result["errors"].items():
        lines.append(f"| {name} | {why} | | | | NO |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda or cpu (the reference backend emulates FP8)")
    p.add_argument("--steps", type=int, default=300)
    for name in ("experts", "top_k", "hidden", "ffn", "tokens"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=None, help="default: by --device")
    p.add_argument(
        "--recipes",
        default="rowwise,current",
        help=f"the FP8 runs beside bf16, of {','.join(RECIPES)} (default rowwise,current)",
    )
    p.add_argument(
        "--control",
        action=argparse.BooleanOptionalAction,
        default=True,
        help=f"a second bf16 run, the router's initial weights perturbed by a relative {PERTURB:g} (default on)",
    )
    p.add_argument(
        "--dtype", choices=list(DTYPES), default="bf16", help="parameters and activations (fp32: a stand-in)"
    )
    add_backend_argument(p, "GroupedMLP")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--tolerance", type=float, default=0.01, help="largest smoothed relative gap that passes")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "mlp_train")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    argv_used = argv if argv is not None else __import__("sys").argv[1:]
    names = [n for n in args.recipes.split(",") if n]
    if set(names) - set(RECIPES):
        p.error(f"--recipes: unknown {sorted(set(names) - set(RECIPES))}; choose from {','.join(RECIPES)}")
    device = torch.device(args.device)
    for name, default in zip(("experts", "top_k", "hidden", "ffn", "tokens"), DEFAULTS[device.type]):
        if getattr(args, name) is None:
            setattr(args, name, default)
    if not 1 <= args.top_k <= args.experts:
        p.error("--top-k: between 1 and --experts")

    runs = names + ([CONTROL] if args.control else [])
    losses, errors = train(args, runs)
    summary = {}
    for name in runs:
        if name in losses:
            s = summarize(losses["bf16"], losses[name])
            summary[name] = dict(s, ok=None if name == CONTROL else s["max_rel_gap"] <= args.tolerance)  # (NaN: False)
    result = dict(
        command=" ".join(["python benchmarks/mlp_train.py", *argv_used]),
        **run_info(args, device),
        losses=losses,
        summary=summary,
        errors=errors,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "losses.json").write_text(json.dumps(result, indent=1))
    md = markdown(result, args.tolerance)
    (args.out / "summary.md").write_text(md)
    gaps = ", ".join(f"{n} {s['max_rel_gap']:.2%}" for n, s in summary.items())  # (the control's too)
    plot(
        args.out / "loss.png",
        result,
        f"MoE block, E={args.experts} top-{args.top_k} H={args.hidden} F={args.ffn} T={args.tokens}\n"
        f"max gap vs bf16 (last {LAST} steps, smoothed): {gaps or '-'}",
    )
    print(md)
    print(f"written: {args.out / 'losses.json'}, {args.out / 'summary.md'}, {args.out / 'loss.png'}")
    ok = not errors and all(s["ok"] and math.isfinite(s["max_rel_gap"]) for n, s in summary.items() if n != CONTROL)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
