"""The MoE expert MLP, forward+backward, on one CUDA GPU: every contender in one process (issue 31).

    python benchmarks/moe_mlp.py [--shapes all|smoke|0,3,...] [--routing balanced,skewed] [--repeats N]
                                 [--budget SECONDS] [--only CONTENDERS] [--align N] [--out DIR] [--append]

The MLP is Megatron's TEGroupedMLP with SwiGLU, per expert e on its rows of x (E experts, hidden H, ffn F,
T tokens sorted by expert, bf16 activations and weights, float32 router probs ``p [T]``, no bias):

    z = x W1_e^T  [T, 2F]  (gate half, then up half);  h = silu(gate) * up * p;  y = h W2_e^T  [T, H]

A contender's step runs the forward and ``torch.autograd.backward(y, dy)``: grads of x, p, W1 and W2 (the
weights' accumulating into ``.grad``; ``x.grad`` and ``p.grad`` set to None first, as for activations).
Contenders (``--only`` takes these keys):

* ``torch``: torch's composition: ``torch._grouped_mm`` under autograd for fc1 and fc2 (one ``[E, 2F, H]`` and
  one ``[E, H, F]`` parameter, offsets from the CUDA counts at every step, as moe_layer.py's torch contender),
  ``(F.silu(gate) * up * p[:, None]).to(bf16)`` between them (Megatron's unfused weighted activation);
* ``fd``: ``functional_dw.grouped_mlp(backend="auto")`` on the same two stacked parameters; ``fd_save_h``,
  ``fd_x_only``: the same with ``save="h"`` / ``save="x_only"``; ``fd_rowwise``: the same with
  ``recipe=fp8.RowwiseScaling(bf16_below=0)`` (FP8 at every size, beside torchao's and TE's FP8); ``fd_default``: ``functional_dw.nn.GroupedMLP(E, H, F)`` as a user writes it
  (default backend and layout: one ``[E, out, in]`` weight per linear); ``fd_list``: the same with
  ``single_grouped_weight=False``, E weights per linear (TE's layout, one buffer each); each given
  the splits as a CUDA int tensor;
* ``te_bf16``, ``te_fp8_block``, ``te_fp8_current``: two ``te.GroupedLinear`` (host list of splits, its API) with
  the activation in torch ops as ``torch``'s, bf16 and under TE's autocast with ``Float8BlockScaling`` /
  ``Float8CurrentScaling`` (TE's FP8 recipes for Hopper);
* ``torchao``: torchao's FP8 rowwise grouped GEMM (``_to_fp8_rowwise_then_scaled_grouped_mm``) for fc1 and fc2
  on the stacked parameters, the activation as ``torch``'s;
* ``fd_graphed``, ``fd_rowwise_graphed``: ``functional_dw.graphs.graph_step`` of the whole step of ``fd`` /
  ``fd_rowwise`` (own copies of the weights), replayed on its static x, p, dy (grads overwritten).

``torch``, ``fd``, ``fd_save_h``, ``fd_x_only``, ``fd_rowwise`` and ``torchao`` share one pair of parameters
(every step accumulates into the same ``.grad``: the same work as with their own; the memory of 128 experts'
weights once, not six times). No optimizer step runs: fd rowwise quantizes its unchanged weights once
(cached by version), TE and torchao at every forward.

Timing, as moe_layer.py (its ``measure`` runs here): per shape, for each routing (balanced; skewed:
``bench.make_splits``' Zipf counts in multiples of ``--align``), after warm-up each repeat runs every contender
once, in a rotating order: a burst of 4 back-to-back steps (inputs alternate between two (x, p, dy) triples)
after a synchronize, CUDA events around it: ms per step; and the host's wall time until the 4th step returns,
before synchronizing: host ms per step (issue time). Medians over repeats; graphed rows: ms only. A
contender that raises (OOM, a missing kernel) gets its reason instead; the others go on. Each routing checks
every contender's first output against a float32 per-expert reference (``rel_err``).

Saved for backward: for each eager contender, one forward under ``torch.autograd.graph.saved_tensors_hooks``
at the shape's balanced routing and again at half its tokens; the pack hook's tensors (tensor subclasses
flattened to their inner tensors) are counted by unique storage, whole storages (a view keeps its base
alive). Storages of the contender's parameters are counted apart ("params seen": torch and TE pass their
weights through the hooks; fd holds them by reference). Activation bytes per token: the slope between the two
token counts; the constant part (e.g. a quantized weight copy saved by TE) is reported as ``fixed``.

Writes ``results.json`` and ``results.md`` under ``--out`` after every shape (a run cut short keeps what it
measured). ``--budget``: a shape starts only while the time so far plus the last shape's time fits.
``--shapes smoke``: two tiny shapes on the CPU (wall clocks for the CUDA events; checks the script, measures
nothing); the contenders that need CUDA (TE, torchao, graphs) say so in the table.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import moe_layer  # (beside this file: its routing, timing loop, reasons, report and main's parts)
from bench import TIMING, _te_autocast
from moe_layer import _why, cell, free, shape_name

import functional_dw as fd
from functional_dw import fp8
from functional_dw.graphs import graph_step

BF16 = torch.bfloat16
SHAPES = [
    (32, 4096, 1536, 32768, ""),
    (128, 4096, 1536, 65536, ""),
    (8, 4096, 4096, 65536, ""),
    (128, 2048, 768, 32768, "Qwen3-MoE-like"),
    (32, 7168, 2048, 32768, "DeepSeek-V3 8-way EP"),
]
SMOKE_SHAPES = [(4, 64, 32, 512, "smoke"), (8, 32, 48, 1024, "smoke")]
FD_CALLS = {  # key -> grouped_mlp's keywords (on the shared stacked parameters)
    "fd": {},
    "fd_save_h": {"save": "h"},
    "fd_x_only": {"save": "x_only"},
    "fd_rowwise": {"recipe": "rowwise"},
}
TE_RECIPES = {"te_bf16": None, "te_fp8_block": "Float8BlockScaling", "te_fp8_current": "Float8CurrentScaling"}
LABELS = {
    "torch": "torch grouped_mm",
    "fd": "fd",
    "fd_default": "fd GroupedMLP default",
    "fd_list": "fd list (GroupedMLP)",
    "fd_rowwise": "fd rowwise",
    "fd_save_h": "fd save=h",
    "fd_x_only": "fd save=x_only",
    "te_bf16": "te bf16",
    "te_fp8_block": "te fp8 block",
    "te_fp8_current": "te fp8 current",
    "torchao": "torchao fp8 rowwise",
    "fd_graphed": "fd graphed",
    "fd_rowwise_graphed": "fd rowwise graphed",
}
CONTENDERS = list(LABELS)
SHARED = ("torch", "fd", "fd_save_h", "fd_x_only", "fd_rowwise", "torchao")  # one pair of parameters
GPU_ONLY = {
    **{k: "n/a: needs CUDA (Transformer Engine's kernels)" for k in TE_RECIPES},
    "torchao": "n/a: needs CUDA (torchao's FP8 grouped GEMM)",
    "fd_graphed": "n/a: CUDA graphs need a CUDA device",
    "fd_rowwise_graphed": "n/a: CUDA graphs need a CUDA device",
}
ALLOW_CPU = False  # tests set it, with TE, torchao and graphs stood in for on the CPU


class Contender(NamedTuple):
    step: Any  # step((x, p, dy)) -> y: forward and backward
    fwd: Any  # fwd(x, p) -> y, for the saved-bytes count (None: not counted, e.g. a graph)
    params: list  # its parameters (their storages are counted apart)


def swiglu_probs(z: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Megatron's unfused weighted SwiGLU in torch ops: gate half, up half, times the probs, back to z's dtype."""
    gate, up = z.chunk(2, -1)
    return (F.silu(gate) * up * p[:, None]).to(z.dtype)


class Case(moe_layer.Routing):
    """One shape: the master weights (shared by the SHARED contenders as parameters), the routing buffers
    every contender reads (CUDA counts updated in place, so graphs replay the current routing; the host
    list TE takes), two (x, p, dy) triples."""

    def __init__(self, E, H, F_, T, dev, align, te):
        self.E, self.H, self.F, self.T, self.dev, self.align, self.te = E, H, F_, T, dev, align, te
        self.cuda = dev == "cuda"
        self.w1 = torch.nn.Parameter(torch.randn(E, 2 * F_, H, device=dev, dtype=BF16) * H**-0.5)
        self.w2 = torch.nn.Parameter(torch.randn(E, H, F_, device=dev, dtype=BF16) * F_**-0.5)
        self.splits = [T // E] * E
        self.splits_dev = torch.zeros(E, dtype=torch.int64, device=dev)
        self.unaligned = False
        self.inputs = [self.triple(T) for _ in range(2)]

    def triple(self, T):
        return (
            torch.randn(T, self.H, device=self.dev, dtype=BF16, requires_grad=True),
            torch.rand(T, device=self.dev, dtype=torch.float32, requires_grad=True),
            torch.randn(T, self.H, device=self.dev, dtype=BF16),
        )

    def reference(self):
        """y for inputs[0] in float32, one expert at a time, from the bf16 weights."""
        with torch.no_grad():
            x, p, _ = self.inputs[0]
            out = []
            for e, (xe, pe) in enumerate(zip(x.split(self.splits), p.split(self.splits))):
                z = xe.float() @ self.w1[e].float().t()
                gate, up = z.chunk(2, -1)
                out.append((F.silu(gate) * up * pe[:, None]) @ self.w2[e].float().t())
            return torch.cat(out)

    # --- contenders: each a Contender, or the reason it cannot run --------------------------------
    def build(self, key, warmup):
        if key in GPU_ONLY and not self.cuda and not ALLOW_CPU:
            return GPU_ONLY[key]
        if key in TE_RECIPES and self.te is None:
            return "n/a: Transformer Engine is not installed"
        if key == "torch":
            return self.composed(lambda a, w: torch._grouped_mm(a, w.transpose(-2, -1), offs=self.step_offs()))
        if key in FD_CALLS:
            kw = dict(FD_CALLS[key])
            if kw.get("recipe") == "rowwise":
                kw["recipe"] = fp8.RowwiseScaling(bf16_below=0)
            return contender(
                lambda x, p: fd.grouped_mlp(x, self.w1, self.w2, self.splits_dev, probs=p, backend="auto", **kw),
                [self.w1, self.w2],
            )
        if key in ("fd_default", "fd_list"):
            m = self.module(single=key == "fd_default")
            return contender(lambda x, p: m(x, self.splits_dev, p), list(m.parameters()))
        if key.endswith("_graphed"):
            return self.graphed(FD_CALLS[key[: -len("_graphed")]], warmup)
        if key in TE_RECIPES:
            return self.te_mlp(TE_RECIPES[key])
        if key == "torchao":
            return self.torchao_mlp()
        raise ValueError(key)

    def composed(self, gmm, params=None):
        """fc1, torch's weighted SwiGLU, fc2, with ``gmm(a, w)`` as each grouped GEMM (w stacked [E, out, in])."""
        w1, w2 = self.w1, self.w2
        return contender(lambda x, p: gmm(swiglu_probs(gmm(x, w1), p), w2), params or [w1, w2])

    def module(self, single: bool):
        """``nn.GroupedMLP`` as a user writes it (no backend, the default layout: one weight per
        linear), or with TE's E weights per linear."""
        m = fd.nn.GroupedMLP(self.E, self.H, self.F, params_dtype=BF16, device=self.dev, single_grouped_weight=single)
        with torch.no_grad():
            for ws, src in ((m.fc1.weights(), self.w1), (m.fc2.weights(), self.w2)):
                for w, s in zip(ws, src):
                    w.copy_(s)
        return m

    def graphed(self, kw, warmup):
        w1 = torch.nn.Parameter(self.w1.detach().clone())
        w2 = torch.nn.Parameter(self.w2.detach().clone())
        kw = dict(kw)
        if kw.get("recipe") == "rowwise":
            kw["recipe"] = fp8.RowwiseScaling(bf16_below=0)
        x0, p0, dy0 = self.inputs[0]
        x, p, dy = x0.detach().clone().requires_grad_(), p0.detach().clone().requires_grad_(), dy0.clone()

        def body(x, p, dy):
            y = fd.grouped_mlp(x, w1, w2, self.splits_dev, probs=p, backend="auto", **kw)
            torch.autograd.backward(y, dy)
            return y

        g = graph_step(body, x, p, dy, params=[w1, w2], warmup=warmup)
        return Contender(lambda inp: g(), None, [w1, w2])  # a replay on the graph's own x, p, dy

    def te_mlp(self, recipe_name):
        te = self.te
        fc1 = te.GroupedLinear(self.E, self.H, 2 * self.F, bias=False, params_dtype=BF16, device=self.dev)
        fc2 = te.GroupedLinear(self.E, self.F, self.H, bias=False, params_dtype=BF16, device=self.dev)
        with torch.no_grad():
            for e in range(self.E):
                getattr(fc1, f"weight{e}").copy_(self.w1[e])
                getattr(fc2, f"weight{e}").copy_(self.w2[e])
        recipe = None if recipe_name is None else moe_layer.te_recipe(recipe_name)

        def fwd(x, p):
            with _te_autocast(te, recipe) if recipe is not None else contextlib.nullcontext():
                return fc2(swiglu_probs(fc1(x, self.splits), p), self.splits)

        return contender(fwd, [*fc1.parameters(), *fc2.parameters()])

    def torchao_mlp(self):
        gmm = moe_layer.torchao_gmm(self)
        return gmm if isinstance(gmm, str) else self.composed(gmm)


def contender(fwd, params) -> Contender:
    def step(inp):
        x, p, dy = inp
        x.grad = p.grad = None
        y = fwd(x, p)
        torch.autograd.backward(y, dy)
        return y

    return Contender(step, fwd, params)


# --- saved for backward ---------------------------------------------------------------------------


def _plain(t):
    """The plain tensors of ``t``: itself, or a tensor subclass's inner tensors (``__tensor_flatten__``)."""
    if type(t) in (torch.Tensor, torch.nn.Parameter) or not hasattr(t, "__tensor_flatten__"):
        yield t
        return
    names, _ = t.__tensor_flatten__()
    for n in names:
        yield from _plain(getattr(t, n))


def packed_bytes(fwd, x, p, params) -> dict:
    """One forward under a pack hook: bytes of the unique storages packed, those of ``params`` apart."""
    owned = {q.untyped_storage().data_ptr() for q in params}
    packed = []

    def pack(t):
        packed.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = fwd(x, p)
    del y
    act, par = {}, {}
    for t in (u for t in packed for u in _plain(t)):
        s = t.untyped_storage()
        if s.nbytes():
            (par if s.data_ptr() in owned else act)[s.data_ptr()] = s.nbytes()
    packed.clear()
    return {"bytes": sum(act.values()), "storages": len(act), "param_bytes": sum(par.values()), "params": len(par)}


def saved_bytes(case: Case, c: Contender) -> dict:
    """Activation bytes per token (the slope between T and T/2 tokens, balanced), the fixed part, and what
    the hook saw of the parameters, at T."""
    full = list(case.splits)
    try:
        case.set_splits([n // 2 for n in full])
        x, p, _ = case.triple(sum(case.splits))
        half = packed_bytes(c.fwd, x, p, c.params)
        del x, p
    finally:
        case.set_splits(full)
    x, p, _ = case.inputs[0]
    at_t = packed_bytes(c.fwd, x, p, c.params)
    dt = case.T - sum(n // 2 for n in full)
    per_token = (at_t["bytes"] - half["bytes"]) / dt
    return {
        "per_token": round(per_token, 2),
        "fixed_bytes": round(at_t["bytes"] - per_token * case.T),
        "at_T": at_t,
        "at_half": half,
    }


def fd_formulas(H, F_) -> dict:
    """docs/mlp.md's bytes per token for fd's policies (SwiGLU, bf16, float32 probs)."""
    return {"fd_x_only": 2 * H + 4, "fd": 2 * (H + 2 * F_) + 4, "fd_save_h": 2 * (H + 3 * F_) + 4}


# --- a shape ----------------------------------------------------------------------------------------


def run_shape(E, H, F_, T, routings, only, args, dev, te):
    """({"routings": {routing: its row}, "saved": {contender: saved bytes or why not}}, None), or with what
    stopped the shape."""
    warmup = 1 if dev == "cpu" else TIMING["warmup"]
    out, saved, error, case, built, steps = {}, {}, None, None, {}, {}
    try:
        case = Case(E, H, F_, T, dev, args.align, te)
        case.route("balanced")  # (graph captures on the balanced counts; the saved bytes are counted at them)
        steps, built = moe_layer.build_all(case, only, warmup)
        for key in only:  # activations saved for backward, at the balanced routing
            c = steps.get(key)
            if c is None:
                saved[key] = built[key]
            elif c.fwd is None:
                saved[key] = "n/a: a graph replay (as its eager contender)"
            else:
                try:
                    saved[key] = saved_bytes(case, c)
                except Exception as e:  # noqa: BLE001
                    saved[key] = _why(e)
                free(case.cuda)
        timed = {k: c.step for k, c in steps.items()}
        for kind in routings:
            out[kind] = moe_layer.time_routing(case, kind, case.route(kind), timed, built, only, args.repeats, warmup)
    except Exception as e:  # noqa: BLE001  (the shape's inputs or reference: OOM)
        error = _why(e)
        print(f"E={E} H={H} F={F_} T={T}: {error}", flush=True)
    finally:
        case = steps = built = timed = None
        free(dev == "cuda")
    return {"routings": out, "saved": saved}, error


# --- report -----------------------------------------------------------------------------------------

RATIOS = [
    ("fd / torch", "fd", "torch", "ms"),
    ("fd host / torch", "fd", "torch", "host_ms"),
    ("fd default / torch", "fd_default", "torch", "ms"),
    ("fd default host / torch", "fd_default", "torch", "host_ms"),
    ("fd list / fd", "fd_list", "fd", "ms"),
    ("fd list host / fd", "fd_list", "fd", "host_ms"),
    ("fd rowwise host / fd", "fd_rowwise", "fd", "host_ms"),
    ("fd rowwise / fd", "fd_rowwise", "fd", "ms"),
    ("te bf16 / fd", "te_bf16", "fd", "ms"),
    ("fd graphed / torch", "fd_graphed", "torch", "ms"),
]


def _mib(n) -> str:
    return f"{n / 2**20:.0f} MiB" if abs(n) >= 2**20 else f"{n / 2**10:.0f} KiB" if abs(n) >= 2**10 else f"{n} B"


def saved_cell(v) -> str:
    if not isinstance(v, dict):
        return cell(v)
    s = f"{v['per_token']:.0f}"
    if abs(v["fixed_bytes"]) >= 2**20:
        s += f" + {_mib(v['fixed_bytes'])}"
    if v["at_T"]["param_bytes"]:
        s += f" (w {_mib(v['at_T']['param_bytes'])})"
    return s


def markdown(result) -> str:
    keys = result["meta"]["contenders"]
    notes = {}  # (contender, reason) -> where
    lines = moe_layer.report_head(
        result["meta"],
        "The MoE expert MLP (SwiGLU, router probs), forward+backward",
        "bf16 activations and weights, float32 probs",
        "TE and torchao quantize them",
    )
    lines += moe_layer.timing_tables(result, LABELS, RATIOS, notes)
    lines += [
        "## Saved for backward",
        "",
        "Activation bytes per token packed by `saved_tensors_hooks` (unique storages, whole; the slope between T "
        "and T/2 tokens, balanced routing), `+ fixed` where a part does not grow with tokens (e.g. a quantized "
        "weight copy), `(w ...)`: the contender's parameters the hook saw (counted apart). The fd formula "
        "(docs/mlp.md, x_only / default / h): `2H + 4`, `2(H + 2F) + 4`, `2(H + 3F) + 4`.",
        "",
        "| shape (E, hidden, ffn, tokens) | fd formula | " + " | ".join(LABELS[k] for k in keys) + " |",
        "|---|---|" + "---|" * len(keys),
    ]
    for s in result["shapes"]:
        f = fd_formulas(s["hidden"], s["ffn"])
        sv = s.get("saved", {})
        lines.append(
            f"| {shape_name(s)} | {f['fd_x_only']} / {f['fd']} / {f['fd_save_h']} | "
            + " | ".join(saved_cell(sv.get(k)) for k in keys)
            + " |"
        )
        for k in keys:
            if isinstance(sv.get(k), str) and not sv[k].startswith("n/a: a graph"):
                notes.setdefault((LABELS[k], sv[k]), []).append(f"{shape_name(s)} saved bytes")
    lines.append("")
    rows = sum(len(s["routings"]) + 1 for s in result["shapes"])  # (each routing's timings, the saved bytes)
    lines += moe_layer.report_tail(result, LABELS, "a float32 per-expert reference", notes, rows, "Not measured")
    return "\n".join(lines) + "\n"


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    p = moe_layer.make_parser(
        __doc__,
        "all, smoke (two tiny shapes on the CPU) or indices into: "
        + "; ".join(f"{i}: {s[:4]}" for i, s in enumerate(SHAPES)),
        CONTENDERS,
        budget=420,
        align_help="skewed counts in multiples of this many tokens (TE's FP8 block scaling: 128); 1: as drawn",
        out="moe_mlp",
        append_help="add to the results.json in --out (a shape measured again replaces its row)",
        default_repeats="smoke",
    )
    args = p.parse_args(argv)
    only, routings = moe_layer.contenders_and_routings(p, args, CONTENDERS)
    smoke = args.shapes == "smoke"
    if smoke:
        shapes, table = SMOKE_SHAPES, SMOKE_SHAPES
    else:
        table = SHAPES
        try:
            pick = range(len(SHAPES)) if args.shapes == "all" else [int(i) for i in args.shapes.split(",")]
        except ValueError:
            p.error(f"--shapes: all, smoke or indices 0..{len(SHAPES) - 1}")
        shapes = [SHAPES[i] for i in pick if 0 <= i < len(SHAPES)]
        if not torch.cuda.is_available():
            p.error("these shapes need a CUDA GPU; --shapes smoke runs tiny ones on the CPU")
    args.repeats = args.repeats or (2 if smoke else 10)
    dev = "cpu" if smoke else "cuda"
    te, tex = moe_layer.import_te()
    out, earlier, meta = moe_layer.start(
        args, argv, "benchmarks/moe_mlp.py", only, routings, dev, "CPU (--shapes smoke)", smoke, tex
    )
    return moe_layer.run_shapes(
        out,
        meta,
        earlier,
        table,
        shapes,
        args.budget,
        lambda E, H, F_, T: run_shape(E, H, F_, T, routings, only, args, dev, te),
        markdown,
    )


if __name__ == "__main__":
    main()
