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
  ``recipe=fp8.RowwiseScaling()``; ``fd_list``: ``functional_dw.nn.GroupedMLP(backend="auto")``, E weights per
  linear (TE's layout, one buffer each); each given the splits as a CUDA int tensor;
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

import argparse
import contextlib
import datetime
import json
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import moe_layer  # (beside this file: its timing loop, reasons, report cells)
from bench import TIMING, _te_autocast, _torchao_gmm, make_splits
from moe_layer import _versions, _why, cell, free, key4, ratio, shape_name

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


class Case:
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

    def set_splits(self, counts):
        self.splits[:] = counts
        self.unaligned = any(c % 16 for c in counts)
        self.splits_dev.copy_(torch.tensor(counts))

    def route(self, kind: str) -> list[int]:
        raw = make_splits(self.E, self.T, "balanced" if kind == "balanced" else "zipf")
        counts = [c // self.align * self.align for c in raw]
        counts[max(range(self.E), key=lambda e: raw[e])] += self.T - sum(counts)
        self.set_splits(counts)
        return counts

    def offs(self):
        """The group ends from the CUDA counts, at every step (torchtitan's one cumsum), as moe_layer.py."""
        return torch.cumsum(self.splits_dev, 0, dtype=torch.int32)

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
            return self.composed(lambda a, w: torch._grouped_mm(a, w.transpose(-2, -1), offs=self.offs()))
        if key in FD_CALLS:
            kw = dict(FD_CALLS[key])
            if kw.get("recipe") == "rowwise":
                kw["recipe"] = fp8.RowwiseScaling()
            return contender(
                lambda x, p: fd.grouped_mlp(x, self.w1, self.w2, self.splits_dev, probs=p, backend="auto", **kw),
                [self.w1, self.w2],
            )
        if key == "fd_list":
            m = self.module()
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

    def module(self):
        m = fd.nn.GroupedMLP(self.E, self.H, self.F, params_dtype=BF16, device=self.dev, backend="auto")
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
            kw["recipe"] = fp8.RowwiseScaling()
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
        recipe = None
        if recipe_name is not None:
            from transformer_engine.common import recipe as te_recipes

            recipe = getattr(te_recipes, recipe_name)()

        def fwd(x, p):
            with _te_autocast(te, recipe) if recipe is not None else contextlib.nullcontext():
                return fc2(swiglu_probs(fc1(x, self.splits), p), self.splits)

        return contender(fwd, [*fc1.parameters(), *fc2.parameters()])

    def torchao_mlp(self):
        f = _torchao_gmm()
        if isinstance(f, str):
            return f
        import inspect

        try:
            padded = "pad_token_groups_for_grouped_mm" in inspect.signature(f).parameters
        except (TypeError, ValueError):
            padded = False

        def gmm(a, w):  # B_t = w^T [E, in, out], column-major as torchao asks
            kw = {"pad_token_groups_for_grouped_mm": self.unaligned} if padded else {}
            return f(a, w.transpose(-2, -1), self.offs(), out_dtype=BF16, **kw)

        return self.composed(gmm)


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
    """({routing: its row}, {contender: saved bytes or why not}, None), or with what stopped the shape."""
    warmup = 1 if dev == "cpu" else TIMING["warmup"]
    out, saved, error, case, built, steps = {}, {}, None, None, {}, {}
    try:
        case = Case(E, H, F_, T, dev, args.align, te)
        case.route("balanced")  # (graph captures on the balanced counts; the saved bytes are counted at them)
        for key in only:
            try:
                c = case.build(key, warmup)
            except Exception as e:  # noqa: BLE001
                c = _why(e)
            (built if isinstance(c, str) else steps)[key] = c
            if isinstance(c, str):
                free(case.cuda)
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
            splits = case.route(kind)
            res = dict(built)
            moe_layer.measure(timed, case, args.repeats, warmup, res)
            built |= {k: v for k, v in res.items() if isinstance(v, str)}  # dropped for the later routings too
            out[kind] = {
                "splits": splits,
                "zero_experts": sum(s == 0 for s in splits),
                "results": {k: res[k] for k in only},
            }
            print(
                f"E={E} H={H} F={F_} T={T} {kind}:",
                {k: (v["ms"] if isinstance(v, dict) else v) for k, v in out[kind]["results"].items()},
                flush=True,
            )
    except Exception as e:  # noqa: BLE001  (the shape's inputs or reference: OOM)
        error = _why(e)
        print(f"E={E} H={H} F={F_} T={T}: {error}", flush=True)
    finally:
        case = steps = built = timed = None
        free(dev == "cuda")
    return out, saved, error


# --- report -----------------------------------------------------------------------------------------

RATIOS = [
    ("fd / torch", "fd", "torch", "ms"),
    ("fd host / torch", "fd", "torch", "host_ms"),
    ("fd list / fd", "fd_list", "fd", "ms"),
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
    meta, v = result["meta"], result["meta"]["versions"]
    keys = meta["contenders"]
    lines = [
        f"# The MoE expert MLP (SwiGLU, router probs), forward+backward ({meta['date']}, {meta['card']})",
        "",
        *[f"`{c}`" for c in meta["commands"]],
        "",
        (
            f"torch {v['torch']} (CUDA {v['cuda']}), TE {v['te']}, cuBLASLt {v['cublaslt']}, {meta['torchao']}. bf16 "
            "activations and weights, float32 probs. Cells: ms per step (host ms per step): CUDA events around "
            f"bursts of {meta['burst']} back-to-back steps (host: the wall time until the last step's call returns, "
            f"before synchronizing), median of {meta['repeats']} interleaved repeats; graphed rows: ms only. "
            "Ratios: time over time (< 1: the first is faster). Skewed routing: Zipf counts in multiples of "
            f"{meta['align']} tokens. No optimizer step: fd rowwise quantizes its unchanged weights once, TE and "
            "torchao quantize them at every forward."
        ),
        "",
    ]
    if meta["skipped"]:
        lines += [f"Skipped for time (--budget {meta['budget_s']} s): {', '.join(meta['skipped'])}.", ""]
    notes = {}  # (contender, reason) -> where
    for routing in meta["routings"]:
        lines += [
            f"## {routing} routing",
            "",
            "| shape (E, hidden, ffn, tokens) | empty experts | "
            + " | ".join(LABELS[k] for k in keys)
            + " | "
            + " | ".join(r[0] for r in RATIOS)
            + " |",
            "|---|---|" + "---|" * (len(keys) + len(RATIOS)),
        ]
        for s in result["shapes"]:
            row = s["routings"].get(routing)
            if row is None:
                lines.append(f"| {shape_name(s)} | {s.get('error', 'not run')} |" + " |" * (len(keys) + len(RATIOS)))
                continue
            res = row["results"]
            lines.append(
                f"| {shape_name(s)} | {row['zero_experts']} | "
                + " | ".join(cell(res.get(k)) for k in keys)
                + " | "
                + " | ".join(ratio(res, a, b, f) for _, a, b, f in RATIOS)
                + " |"
            )
            for k in keys:
                if isinstance(res.get(k), str):
                    notes.setdefault((LABELS[k], res[k]), []).append(f"{shape_name(s)} {routing}")
        lines.append("")
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
    errs = {}
    for s in result["shapes"]:
        for row in s["routings"].values():
            for k, r in row["results"].items():
                if isinstance(r, dict):
                    errs[k] = max(errs.get(k, 0.0), r["rel_err"])
    if errs:
        lines += [
            "Largest relative error of the forward output against a float32 per-expert reference: "
            + ", ".join(f"{LABELS[k]} {e:.2g}" for k, e in errs.items())
            + ".",
            "",
        ]
    if notes:
        rows = sum(len(s["routings"]) + 1 for s in result["shapes"])  # (each routing's timings, the saved bytes)
        lines += ["Not measured:", ""] + [
            f"- {k}: {why} ({'every row' if len(where) == rows else '; '.join(where)})"
            for (k, why), where in notes.items()
        ]
        lines.append("")
    lines += [f"Seconds per shape: {', '.join(f'{k} {t}' for k, t in meta['elapsed_s'].items())}."]
    return "\n".join(lines) + "\n"


def write(out: Path, result) -> None:
    (out / "results.json").write_text(json.dumps(result, indent=1))
    (out / "results.md").write_text(markdown(result))


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--shapes",
        default="all",
        help="all, smoke (two tiny shapes on the CPU) or indices into: "
        + "; ".join(f"{i}: {s[:4]}" for i, s in enumerate(SHAPES)),
    )
    p.add_argument("--routing", default="balanced,skewed")
    p.add_argument("--repeats", type=int, default=None, help="repeats per contender (default 10; smoke 2)")
    p.add_argument("--budget", type=float, default=420, help="seconds (0: none); default 420")
    p.add_argument("--only", default=",".join(CONTENDERS), help="contenders: " + ",".join(CONTENDERS))
    p.add_argument(
        "--align",
        type=int,
        default=128,
        help="skewed counts in multiples of this many tokens (TE's FP8 block scaling: 128); 1: as drawn",
    )
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "moe_mlp"))
    p.add_argument(
        "--append",
        action="store_true",
        help="add to the results.json in --out (a shape measured again replaces its row)",
    )
    args = p.parse_args(argv)
    only = [k for k in args.only.split(",") if k]
    routings = [r for r in args.routing.split(",") if r]
    if set(only) - set(CONTENDERS) or not only:
        p.error(f"--only: unknown contender(s) {sorted(set(only) - set(CONTENDERS))}; choose from {CONTENDERS}")
    if set(routings) - {"balanced", "skewed"} or not routings:
        p.error("--routing: balanced and/or skewed")
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
    try:
        import transformer_engine.pytorch as te
        import transformer_engine_torch as tex
    except Exception as e:  # noqa: BLE001
        print(f"Transformer Engine not importable ({str(e).splitlines()[0][:120] if str(e) else e!r}): TE rows are n/a")
        te = tex = None
    ao = _torchao_gmm()
    torch.manual_seed(0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    earlier = (
        json.loads((out / "results.json").read_text()) if args.append and (out / "results.json").exists() else None
    )
    meta = {
        "date": datetime.date.today().isoformat(),
        "commands": (earlier["meta"]["commands"] if earlier else [])
        + [" ".join(["python benchmarks/moe_mlp.py", *argv])],
        "card": torch.cuda.get_device_name() if dev == "cuda" else "CPU (--shapes smoke)",
        "versions": _versions(tex, dev),
        "torchao": ao if isinstance(ao, str) else "torchao " + getattr(sys.modules.get("torchao"), "__version__", "?"),
        "contenders": only,
        "routings": routings,
        "repeats": args.repeats,
        "burst": TIMING["burst"],
        "warmup": 1 if smoke else TIMING["warmup"],
        "align": args.align,
        "budget_s": args.budget,
        "smoke": smoke,
        "skipped": [],
        "elapsed_s": {},
    }
    order = {r[:4]: i for i, r in enumerate(table)}
    done = [s for s in earlier["shapes"] if key4(s) not in {r[:4] for r in shapes}] if earlier else []
    if earlier:
        meta["elapsed_s"] = {k: v for k, v in earlier["meta"]["elapsed_s"].items() if k != "total"}
    result = {"meta": meta, "shapes": done}
    t0, last = time.monotonic(), 0.0
    for E, H, F_, T, label in shapes:
        name = f"{E}, {H}, {F_}, {T}"
        if args.budget and last and time.monotonic() - t0 + last > args.budget:
            meta["skipped"].append(name)
            continue
        t = time.monotonic()
        routes, saved, error = run_shape(E, H, F_, T, routings, only, args, dev, te)
        last = time.monotonic() - t
        meta["elapsed_s"][name] = round(last, 1)
        done.append(
            {"E": E, "hidden": H, "ffn": F_, "tokens": T, "label": label, "routings": routes, "saved": saved}
            | ({"error": error} if error else {})
        )
        done.sort(key=lambda s: order.get(key4(s), len(order)))
        meta["elapsed_s"]["total"] = round(time.monotonic() - t0, 1)
        write(out, result)
        del meta["elapsed_s"]["total"]
    meta["elapsed_s"]["total"] = round(time.monotonic() - t0, 1)
    write(out, result)
    print((out / "results.md").read_text(), flush=True)
    return result


if __name__ == "__main__":
    main()
