"""Where each microsecond of a step's host time goes: the run path, phase by phase.

    python benchmarks/host_phases.py [--layer linear|mlp] [--recipe none|rowwise] [--shape E,H,F,T]
                                     [--layout single|list] [--device cuda|cpu] [--out DIR]

One ``nn.GroupedLinear`` step, or with ``--layer mlp`` one ``nn.GroupedMLP`` step (SwiGLU weighted
by float32 router probs) (forward, then ``backward``; bf16 on CUDA with a CUDA splits tensor and
the default backend, float32 on the CPU with host splits and ``backend="torch"``); ``--recipe
rowwise``: ``RowwiseScaling(bf16_below=0)`` (FP8 at every size). Each function of the run path
is wrapped by a timer: inclusive microseconds per step, nested as they call each other (a wrapper
costs about 0.1 us; a phase an MLP step runs twice, once per linear, adds both). Beside it, without
timers, the host time of the whole step, of torch's (autograd ``grouped_mm``; for the MLP, torch's
composition: ``grouped_mm``, the weighted SwiGLU in torch ops, ``grouped_mm``), and of the floor
of any design that runs its backward in Python: a bare ``torch.autograd.Function`` doing the same
three grouped GEMMs (no checks, no plan, no residual record; for the MLP, that floor layer twice
around torch's SwiGLU). All compute their int32 offsets from the counts at every step, as a torch
MoE does (one ``cumsum``). Host time: from the first call to the return of the last of 4
back-to-back steps after a synchronize, per step, median of 15 bursts. Writes
``DIR/host_phases_<device>_[mlp_][rowwise_]E<E>_<layout>.json`` and ``.md`` (default
``benchmarks/results/host_phases/``).
"""

from __future__ import annotations

import argparse
import collections
import importlib
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's functional_dw

import torch

import functional_dw as fd

from functional_dw import fp8  # noqa: E402

gl = sys.modules["functional_dw.grouped_linear"]
gm = sys.modules["functional_dw.grouped_mlp"]
cv = sys.modules["functional_dw.custom_vjp"]
bp = importlib.import_module("functional_dw._bridge_planned")
nn_mod = sys.modules["functional_dw.nn"]

# (label, owner, attribute, depth): the run path, in call order
PHASES = [
    ("module forward", nn_mod.GroupedLinear, "forward", 0),
    ("grouped_linear (options, bridge entry)", nn_mod, "grouped_linear", 1),
    ("Function.forward (the planned node)", bp._PlannedRun, "forward", 2),
    ("Function.forward (the lean bridge: FP8)", cv._LeanBridge, "forward", 2),
    ("prepare (plan lookup, splits, operands)", gl, "prepare", 3),
    ("forward (GEMM, record)", gl, "forward", 3),
    ("kernels: grouped_fprop", None, "grouped_fprop", 4),
    ("kept_residuals (what is saved)", cv, "kept_residuals", 3),
    ("backward (torch.autograd.backward)", None, None, 0),
    ("Function.backward (the planned node)", bp._PlannedRun, "backward", 1),
    ("Function.backward (the lean bridge: FP8)", cv._LeanBridge, "backward", 1),
    ("ctx_residuals (rebuild the record)", cv, "ctx_residuals", 2),
    ("_checked (record, versions, dy: the bridge's)", gl, "_checked", 2),
    ("_dgrad", gl, "_dgrad", 2),
    ("kernels: grouped_dgrad", None, "grouped_dgrad", 3),
    ("_wgrad (GEMM, finalize)", gl, "_wgrad", 2),
    ("kernels: grouped_wgrad", None, "grouped_wgrad", 3),
]
# the expert MLP's run path: the layer's seam twice (names as grouped_mlp looks them up)
MLP_PHASES = [
    ("module forward", nn_mod.GroupedMLP, "forward", 0),
    ("grouped_mlp (options, bridge entry)", nn_mod, "grouped_mlp", 1),
    ("Function.forward (the planned node)", bp._PlannedRun, "forward", 2),
    ("Function.forward (the lean bridge: FP8)", cv._LeanBridge, "forward", 2),
    ("_run (fc1, activation, fc2)", gm, "_run", 3),
    ("prepare, fc1 and fc2 (plan lookup, splits, operands)", gm, "prepare", 4),
    ("forward, fc1 and fc2 (GEMM, record)", gm, "forward", 4),
    ("kernels: grouped_fprop (x2)", None, "grouped_fprop", 5),
    ("kept_residuals (what is saved)", cv, "kept_residuals", 3),
    ("backward (torch.autograd.backward)", None, None, 0),
    ("Function.backward (the planned node)", bp._PlannedRun, "backward", 1),
    ("Function.backward (the lean bridge: FP8)", cv._LeanBridge, "backward", 1),
    ("ctx_residuals (rebuild the record)", cv, "ctx_residuals", 2),
    ("_backward (fc2, activation, fc1)", gm, "_backward", 2),
    ("grouped_linear_bwd, fc2 and fc1", gm, "grouped_linear_bwd", 3),
    ("_dgrad (x2)", gl, "_dgrad", 4),
    ("kernels: grouped_dgrad (x2)", None, "grouped_dgrad", 5),
    ("_wgrad (x2)", gl, "_wgrad", 4),
    ("kernels: grouped_wgrad (x2)", None, "grouped_wgrad", 5),
]


def build(E, H, F, T, layout, device, layer="linear", recipe="none"):
    """(the module, the probe's (args, dy), the steps timed whole)."""
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    kw = dict(
        backend="auto" if device == "cuda" else "torch",
        params_dtype=dtype,
        device=device,
        single_grouped_weight=layout == "single",
    )
    if recipe == "rowwise":
        kw["recipe"] = fp8.RowwiseScaling(bf16_below=0)  # FP8 at every size
    mlp = layer == "mlp"
    m = fd.nn.GroupedMLP(E, H, F, **kw) if mlp else fd.nn.GroupedLinear(E, H, F, bias=False, **kw)
    x = torch.randn(T, H, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn(T, H if mlp else F, device=device, dtype=dtype)
    splits = torch.full((E,), T // E, device=device, dtype=torch.int64) if device == "cuda" else [T // E] * E
    probs = torch.rand(T, device=device, dtype=torch.float32)
    counts = torch.full((E,), T // E, device=device, dtype=torch.int64)

    def step_offs():  # from the counts at every step, as a torch MoE does (torchtitan: one cumsum)
        return torch.cumsum(counts, 0, dtype=torch.int32)

    class Floor(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            offs = step_offs()
            ctx.save_for_backward(x, w, offs)
            return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)

        @staticmethod
        def backward(ctx, g):
            x, w, offs = ctx.saved_tensors
            return torch._grouped_mm(g, w, offs=offs), torch._grouped_mm(g.t(), x, offs=offs)

    def torch_gmm(x, w):
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=step_offs())

    def swiglu(z):  # Megatron's unfused weighted SwiGLU in torch ops
        gate, up = z.chunk(2, -1)
        return (torch.nn.functional.silu(gate) * up * probs[:, None]).to(z.dtype)

    if mlp:
        w1 = torch.nn.Parameter(torch.randn(E, 2 * F, H, device=device, dtype=dtype))
        w2 = torch.nn.Parameter(torch.randn(E, H, F, device=device, dtype=dtype))
        args = (x, splits, probs)
        steps = {
            "fd": lambda: m(*args).backward(dy),
            "torch composition": lambda: torch_gmm(swiglu(torch_gmm(x, w1)), w2).backward(dy),
            "floor: bare autograd.Function x2 around torch's SwiGLU": lambda: Floor.apply(
                swiglu(Floor.apply(x, w1)), w2
            ).backward(dy),
        }
    else:
        w = torch.nn.Parameter(torch.randn(E, F, H, device=device, dtype=dtype))
        args = (x, splits)
        steps = {
            "fd": lambda: m(*args).backward(dy),
            "torch autograd grouped_mm": lambda: torch_gmm(x, w).backward(dy),
            "floor: bare autograd.Function": lambda: Floor.apply(x, w).backward(dy),
        }
    return m, (args, dy), steps


def host_ms(step, device, bursts=15, burst=4) -> float:
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(5):
        step()
    sync()
    times = []
    for _ in range(bursts):
        sync()
        t0 = time.perf_counter()
        for _ in range(burst):
            step()
        times.append((time.perf_counter() - t0) / burst * 1e3)
        sync()
    return statistics.median(times)


def phases(m, step, device, table, probe, n=200) -> dict[str, float]:
    acc: collections.Counter = collections.Counter()
    undo = []

    def wrap(owner, attr, label, static):
        f = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
        fn = f.__func__ if isinstance(f, staticmethod) else f

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                acc[label] += time.perf_counter() - t0

        setattr(owner, attr, staticmethod(timed) if static else timed)
        undo.append((owner, attr, f))

    gl.PLANS.clear()
    step()  # (the plan, and the kernels the layer runs on)
    kern_cls = type(next(iter(gl.PLANS._plans.values())).kernels)
    for label, owner, attr, _ in table:
        if attr is None:
            continue
        owner = kern_cls if owner is None else owner
        wrap(owner, attr, label, static=isinstance(owner.__dict__.get(attr), staticmethod))
    try:
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        for _ in range(20):
            step()
        sync()
        acc.clear()
        for _ in range(n):
            t1 = time.perf_counter()
            y = m(*probe[0])
            t2 = time.perf_counter()
            y.backward(probe[1])
            acc["backward (torch.autograd.backward)"] += time.perf_counter() - t2
            acc["module forward (outer)"] += t2 - t1
        sync()
    finally:
        for owner, attr, f in reversed(undo):
            setattr(owner, attr, f)
    return {label: acc[label] / n * 1e6 for label, *_ in table}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default=None, help="E,H,F,T (default 8,2048,2048,8192 on CUDA; 8,32,32,32 on the CPU)")
    p.add_argument("--layer", default="linear", choices=["linear", "mlp"])
    p.add_argument("--recipe", default="none", choices=["none", "rowwise"])
    p.add_argument("--layout", default="single", choices=["single", "list"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "host_phases")
    args = p.parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(1)  # (tiny GEMMs: threads only add contention)
    shape = args.shape or ("8,2048,2048,8192" if args.device == "cuda" else "8,32,32,32")
    E, H, F, T = map(int, shape.split(","))
    m, probe, steps = build(E, H, F, T, args.layout, args.device, args.layer, args.recipe)
    table = MLP_PHASES if args.layer == "mlp" else PHASES
    whole = {k: host_ms(f, args.device) * 1e3 for k, f in steps.items()}
    per_phase = phases(m, steps["fd"], args.device, table, probe)
    result = {
        "shape": dict(E=E, H=H, F=F, T=T),
        "layer": args.layer,
        "recipe": args.recipe,
        "layout": args.layout,
        "device": args.device,
        "torch": torch.__version__,
        "host_us_per_step": whole,
        "phases_us_per_step": per_phase,
    }
    lines = [
        f"# Host us per fwd+bwd step, {args.layer}{' RowwiseScaling' if args.recipe == 'rowwise' else ''}, "
        f"{args.device}, E={E} H={H} F={F} T={T}, {args.layout} weight layout",
        "",
        "| step (no timers) | host us |",
        "|---|---|",
    ]
    lines += [f"| {k} | {v:.0f} |" for k, v in whole.items()]
    lines += ["", "| phase of fd's step (inclusive, nested) | us |", "|---|---|"]
    for label, _, _, depth in table:
        lines.append(f"| {'&nbsp;&nbsp;' * depth}{label} | {per_phase[label]:.1f} |")
    md = "\n".join(lines) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    tag = ("mlp_" if args.layer == "mlp" else "") + ("rowwise_" if args.recipe == "rowwise" else "")
    stem = f"host_phases_{args.device}_{tag}E{E}_{args.layout}"
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / f"{stem}.md").write_text(md)
    print(md)
    return result


if __name__ == "__main__":
    main()
