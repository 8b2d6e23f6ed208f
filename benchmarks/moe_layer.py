"""One MoE expert layer, forward+backward, on one CUDA GPU: every contender in one process.

    python benchmarks/moe_layer.py [--shapes all|quick|0,3,...] [--routing balanced,skewed] [--repeats N]
                                   [--budget SECONDS] [--only CONTENDERS] [--align N] [--out DIR] [--append] [--smoke]

The layer is ``y[T, F] = x[T, H] W_e^T`` per expert e (E experts, hidden H = in-features, ffn F =
out-features, T tokens, bf16, no bias). A contender's step runs the forward and
``torch.autograd.backward(y, dy)``: dgrad and wgrad, weight grads accumulating into ``.grad``
(``x.grad`` is set to None first, as for an activation). Contenders (``--only`` takes these keys):

* ``torch``: ``torch._grouped_mm(x, w.transpose(-2, -1), offs=...)`` under autograd, one ``[E, F, H]`` parameter,
  the offsets computed from the CUDA counts at every step as torchtitan does (``cumsum``, one launch);
* ``fd``, ``fd_1w``: ``functional_dw.nn.GroupedLinear(E, H, F)`` as a user writes it (default backend,
  TE's layout: per-expert parameters) / with ``single_grouped_weight=True``; ``rowwise``: the same (per expert) with ``recipe=fp8.RowwiseScaling()``;
  ``rowwise_fp8``: one weight, ``RowwiseScaling(bf16_below=0)`` (FP8 at every size: what its bf16 rule weighs);
  ``fd_te``: per expert, ``backend="te"``; each called as ``m(x, splits)`` with the splits a CUDA int tensor;
* ``te_bf16``, ``te_block``, ``te_current``: ``te.GroupedLinear`` (host list of splits, its API), bf16 and
  under TE's autocast with ``Float8BlockScaling`` / ``Float8CurrentScaling``;
* ``torchao``: torchao's FP8 rowwise grouped GEMM (``_to_fp8_rowwise_then_scaled_grouped_mm``), one ``[E, F, H]`` parameter;
* ``<fd|fd_1w|rowwise>_compiled``: ``torch.compile`` of the module (dynamo reset per shape);
  ``<...>_graphed``: ``functional_dw.graphs.graph_step`` of the whole step, replayed on its static x, dy
  (grads overwritten, not accumulated: that mode's recipe); ``torch_graphed``: torch's step captured the same way (the graphed peer).

Timing, per shape, for each routing (balanced; skewed: ``bench.make_splits(..., "zipf")``, Zipf counts with
the coldest experts empty, rounded down to multiples of ``--align`` tokens, the hottest expert taking the rest):
after warm-up, each repeat runs every contender once, in a rotating order: a burst of 4 back-to-back steps
(inputs alternate between two (x, dy) pairs) after a synchronize, with CUDA events around it: ms per step;
and the host's wall time from the first step's call until the 4th step's return, before synchronizing: host
ms per step (issue time: the GPU work may still be running). Medians over repeats. Graphed rows: ms only.
A contender that raises (compile errors, OOM) gets its reason instead of numbers; the others go on. Each
routing checks every contender's first output against a per-expert matmul (``rel_err``). No optimizer step
runs: fd rowwise quantizes its unchanged weights once (cached by version), TE at every forward.

Writes ``results.json`` and ``results.md`` under ``--out`` after every shape, so a run cut short keeps
what it measured. ``--budget``: a shape starts only while the time so far plus the last shape's time is
within the budget. ``--smoke``: tiny shapes on the CPU, wall clocks for the CUDA events (checks the script,
measures nothing); CUDA graphs then say why not.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # (beside this file)
from bench import TIMING, _te_autocast, _torchao_gmm, make_splits, versions

import functional_dw as fd
from functional_dw import fp8
from functional_dw.graphs import graph_step

BF16 = torch.bfloat16
SHAPES = [
    (8, 2048, 2048, 8192, ""),
    (32, 4096, 1536, 32768, ""),
    (128, 4096, 1536, 65536, ""),
    (8, 4096, 4096, 65536, ""),
    (128, 2048, 768, 32768, "Qwen3-MoE-like"),
    (32, 7168, 2048, 32768, "DeepSeek-V3 8-way EP"),
]
QUICK = [0, 1, 4]
SMOKE_SHAPES = [(4, 32, 48, 512, "smoke"), (8, 64, 32, 1024, "smoke")]
FD_MODULES = {
    "fd": ("fd default", {}),
    "fd_1w": ("fd default, one weight", {"single_grouped_weight": True}),
    "rowwise": ("fd rowwise", {"recipe": "rowwise"}),
    "fd_te": ("fd te", {"backend": "te"}),
    "rowwise_fp8": ("fd rowwise FP8 forced, one weight", {"recipe": "rowwise_fp8", "single_grouped_weight": True}),
}
VARIANTS = ("fd", "fd_1w", "rowwise")  # also compiled and graphed
TE_RECIPES = {"te_bf16": None, "te_block": "Float8BlockScaling", "te_current": "Float8CurrentScaling"}
LABELS = {
    "torch": "torch grouped_mm",
    **{k: v[0] for k, v in FD_MODULES.items()},
    "te_bf16": "te bf16",
    "te_block": "te fp8 block",
    "te_current": "te fp8 current",
    "torchao": "torchao fp8 rowwise",
    "torch_graphed": "torch grouped_mm graphed",
}
LABELS |= {f"{k}_{how}": f"{LABELS[k]} {how}" for how in ("compiled", "graphed") for k in VARIANTS}
CONTENDERS = list(LABELS)
now = time.perf_counter  # the host clock (and the device's in --smoke); tests fix it


def _why(e: BaseException) -> str:
    if isinstance(e, torch.OutOfMemoryError):
        return "OOM"
    msg = str(e).strip().splitlines()
    return f"raises {type(e).__name__}: {msg[0][:160] if msg else ''}"


def free(cuda: bool) -> None:
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()


class Routing:
    """A case's routing: ``splits`` (the host list TE takes) and ``splits_dev`` (the CUDA counts, updated in
    place, so graphs replay the current routing), set by ``route``; moe_mlp.py's case routes the same way."""

    def set_splits(self, counts):
        self.splits[:] = counts
        self.unaligned = any(c % 16 for c in counts)  # (torchao's FP8 GEMM then pads the groups, when asked)
        self.splits_dev.copy_(torch.tensor(counts))

    def route(self, kind: str) -> list[int]:
        raw = make_splits(self.E, self.T, "balanced" if kind == "balanced" else "zipf")
        counts = [c // self.align * self.align for c in raw]
        counts[max(range(self.E), key=lambda e: raw[e])] += self.T - sum(counts)
        self.set_splits(counts)
        return counts

    def step_offs(self):
        """The group ends a torch MoE computes from its routing's counts at every step (torchtitan:
        ``torch.cumsum(counts, 0, dtype=torch.int32)``, one launch): fd's contenders take the counts too."""
        return torch.cumsum(self.splits_dev, 0, dtype=torch.int32)


class Case(Routing):
    """One shape: the master weights, the routing buffers every contender reads (the CUDA splits,
    updated in place per routing, so graphs replay the current routing; the host list TE takes), two (x, dy) pairs, and the contenders' steps."""

    def __init__(self, E, H, F, T, dev, align, te):
        self.E, self.H, self.F, self.T, self.dev, self.align, self.te = E, H, F, T, dev, align, te
        self.cuda = dev == "cuda"
        self.w = torch.randn(E, F, H, device=dev, dtype=BF16) * 0.02
        self.splits = [T // E] * E
        self.splits_dev = torch.zeros(E, dtype=torch.int64, device=dev)
        self.inputs = [
            (torch.randn(T, H, device=dev, dtype=BF16, requires_grad=True), torch.randn(T, F, device=dev, dtype=BF16))
            for _ in range(2)
        ]

    def reference(self):
        with torch.no_grad():
            x = self.inputs[0][0]
            return torch.cat([xe @ self.w[e].t() for e, xe in enumerate(x.split(self.splits))])

    # --- contenders: each returns step(inp) -> y, or the reason it cannot run ----------------
    def module(self, key):
        kw = dict(FD_MODULES[key][1])
        if kw.get("recipe") == "rowwise":
            kw["recipe"] = fp8.RowwiseScaling()
        elif kw.get("recipe") == "rowwise_fp8":  # FP8 at every size: what the bf16_below rule weighs
            kw["recipe"] = fp8.RowwiseScaling(bf16_below=0)
        m = fd.nn.GroupedLinear(self.E, self.H, self.F, bias=False, params_dtype=BF16, device=self.dev, **kw)
        with torch.no_grad():
            for w, src in zip(m.weights(), self.w):
                w.copy_(src)
        return m

    def torch_forward(self):
        """(torch's forward ``fwd(x, *_)``, its one ``[E, F, H]`` parameter): autograd ``grouped_mm``."""
        w = torch.nn.Parameter(self.w.clone())
        return (lambda x, *_: torch._grouped_mm(x, w.transpose(-2, -1), offs=self.step_offs())), w

    def build(self, key, warmup):
        if key == "torch":
            return train_step(self.torch_forward()[0])
        if (key == "fd_te" or key in TE_RECIPES) and self.te is None:
            return "n/a: Transformer Engine is not installed"
        if key in FD_MODULES:
            m = self.module(key)
            return train_step(lambda x: m(x, self.splits_dev))
        if key.endswith("_compiled"):
            cm = torch.compile(self.module(key[: -len("_compiled")]), backend="inductor" if self.cuda else "aot_eager")
            return train_step(lambda x: cm(x, self.splits_dev))  # compiles at its first call (the warm-up)
        if key == "torch_graphed":  # torch's own step captured whole: the graphed peer
            fwd, w = self.torch_forward()
            return self.graphed(fwd, warmup, [w])
        if key.endswith("_graphed"):
            m = self.module(key[: -len("_graphed")])
            return self.graphed(m, warmup, list(m.parameters()))
        if key in TE_RECIPES:
            return self.te_step(TE_RECIPES[key])
        if key == "torchao":
            return self.torchao_step()
        raise ValueError(key)

    def graphed(self, m, warmup, params):
        x0, dy0 = self.inputs[0]
        x, dy = x0.detach().clone().requires_grad_(), dy0.clone()

        def body(x, dy):
            y = m(x, self.splits_dev)
            torch.autograd.backward(y, dy)
            return y

        g = graph_step(body, x, dy, params=params, warmup=warmup)
        return lambda inp: g()  # a replay on the graph's own x and dy: nothing copied in

    def te_step(self, recipe_name):
        te = self.te
        m = te.GroupedLinear(self.E, self.H, self.F, bias=False, params_dtype=BF16, device=self.dev)
        with torch.no_grad():
            for e in range(self.E):
                getattr(m, f"weight{e}").copy_(self.w[e])
        if recipe_name is None:
            return train_step(lambda x: m(x, self.splits))
        recipe = te_recipe(recipe_name)

        def fwd(x):
            with _te_autocast(te, recipe):
                return m(x, self.splits)

        return train_step(fwd)

    def torchao_step(self):
        gmm = torchao_gmm(self)
        if isinstance(gmm, str):
            return gmm
        w = torch.nn.Parameter(self.w.clone())
        return train_step(lambda x: gmm(x, w))


def te_recipe(name):
    """TE's recipe ``name`` (a class in ``transformer_engine.common.recipe``), made."""
    from transformer_engine.common import recipe as te_recipes

    return getattr(te_recipes, name)()


def torchao_gmm(case: Routing):
    """torchao's FP8 rowwise grouped GEMM as ``gmm(a, w)`` for a stacked ``[E, out, in]`` weight (B_t = w^T,
    column-major as torchao asks), the group ends from the case's counts at every step; or why not."""
    f = _torchao_gmm()
    if isinstance(f, str):
        return f
    import inspect

    try:
        padded = "pad_token_groups_for_grouped_mm" in inspect.signature(f).parameters
    except (TypeError, ValueError):
        padded = False

    def gmm(a, w):
        kw = {"pad_token_groups_for_grouped_mm": case.unaligned} if padded else {}
        return f(a, w.transpose(-2, -1), case.step_offs(), out_dtype=BF16, **kw)

    return gmm


def train_step(fwd):
    def step(inp):
        x, dy = inp
        x.grad = None
        y = fwd(x)
        torch.autograd.backward(y, dy)
        return y

    return step


def device_timer(cuda: bool):
    """Start timing the device now; the returned stop() gives the milliseconds since (CUDA events;
    the host's clock in --smoke, where the device is the host)."""
    if not cuda:
        t0 = now()
        return lambda: (now() - t0) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()

    def stop():
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    return stop


def measure(steps: dict, case: Case, repeats: int, warmup: int, res: dict) -> None:
    """Warm up each step (its first output checked against the reference), then interleaved bursts;
    ``res[name]``: the timing, or why the step did not run (it is dropped, the others go on)."""
    burst, cuda = TIMING["burst"], case.cuda
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    ref = case.reference().float()
    info, ms, host = {}, {n: [] for n in steps}, {n: [] for n in steps}

    def warm(name):
        t = time.monotonic()
        y = steps[name](case.inputs[0]).detach().float()
        info[name] = {"rel_err": round(((y - ref).norm() / ref.norm().clamp_min(1e-30)).item(), 5)}
        for i in range(1, warmup):
            steps[name](case.inputs[i % 2])
        sync()
        info[name]["warmup_s"] = round(time.monotonic() - t, 2)

    def timed_burst(name, r):
        sync()
        stop = device_timer(cuda)
        h0 = now()
        for j in range(burst):
            steps[name](case.inputs[(r + j) % 2])
        h1 = now()
        ms[name].append(stop() / burst)
        host[name].append((h1 - h0) * 1e3 / burst)

    def attempt(fn, name, *a):
        try:
            return fn(name, *a)
        except Exception as e:  # noqa: BLE001  (OOM, compile errors, a missing kernel: the row says why)
            res[name] = _why(e)
        del steps[name]
        free(cuda)  # (after the except clause: its traceback, and the tensors it holds, are gone)

    for name in list(steps):
        attempt(warm, name)
    names = list(steps)
    for r in range(repeats if names else 0):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            if name in steps:
                attempt(timed_burst, name, r)
    for name in steps:
        fields = {"ms": ms[name]} | ({} if name.endswith("_graphed") else {"host_ms": host[name]})
        res[name] = (
            {k: round(statistics.median(t), 4) for k, t in fields.items()}
            | info[name]
            | {f"{k}_all": [round(x, 4) for x in t] for k, t in fields.items()}
        )


def build_all(case, only, warmup) -> tuple[dict, dict]:
    """The contenders ``only`` built on ``case``: ({key: its step}, {key: why it cannot run})."""
    steps, built = {}, {}
    for key in only:
        try:
            s = case.build(key, warmup)
        except Exception as e:  # noqa: BLE001
            s = _why(e)
        (built if isinstance(s, str) else steps)[key] = s
        if isinstance(s, str):
            free(case.cuda)
    return steps, built


def time_routing(case, kind, splits, steps, built, only, repeats, warmup) -> dict:
    """The row of one routing (``splits``, the case's current one): ``steps`` measured, the reasons in
    ``built`` for the others; a step that fails is dropped from ``steps`` and its reason added to ``built``."""
    res = dict(built)
    measure(steps, case, repeats, warmup, res)
    built |= {k: v for k, v in res.items() if isinstance(v, str)}  # dropped for the later routings too
    row = {"splits": splits, "zero_experts": sum(s == 0 for s in splits), "results": {k: res[k] for k in only}}
    print(
        f"E={case.E} H={case.H} F={case.F} T={case.T} {kind}:",
        {k: (v["ms"] if isinstance(v, dict) else v) for k, v in row["results"].items()},
        flush=True,
    )
    return row


def run_shape(E, H, F, T, routings, only, args, dev, te):
    """({"routings": {routing: its row}}, None), or what is there and why the shape stopped (its inputs: OOM)."""
    warmup = 1 if args.smoke else TIMING["warmup"]
    out, error, case, steps, built = {}, None, None, {}, {}
    try:
        case = Case(E, H, F, T, dev, args.align, te)
        for i, kind in enumerate(routings):
            splits = case.route(kind)
            if i == 0:  # the contenders (compiles, graph captures) once per shape, on the first routing
                steps, built = build_all(case, only, warmup)
            out[kind] = time_routing(case, kind, splits, steps, built, only, args.repeats, warmup)
    except Exception as e:  # noqa: BLE001  (the shape's inputs or reference: OOM)
        error = _why(e)
        print(f"E={E} H={H} F={F} T={T}: {error}", flush=True)
    finally:
        case = steps = built = None
        torch._dynamo.reset()
        free(dev == "cuda")
    return {"routings": out}, error


# --- report ------------------------------------------------------------------------------------

RATIOS = [
    ("fd default / torch", "fd", "torch", "ms"),
    ("fd default host / torch", "fd", "torch", "host_ms"),
    ("fd default host / one weight", "fd", "fd_1w", "host_ms"),
    ("fd one weight / torch", "fd_1w", "torch", "ms"),
    ("fd one weight host / torch", "fd_1w", "torch", "host_ms"),
    ("Rowwise / fd bf16", "rowwise", "fd", "ms"),
    ("Rowwise host / fd bf16", "rowwise", "fd", "host_ms"),
    ("FP8 forced / one weight", "rowwise_fp8", "fd_1w", "ms"),
    ("fd one weight graphed / torch graphed", "fd_1w_graphed", "torch_graphed", "ms"),
]


def cell(v) -> str:
    if isinstance(v, dict):
        return f"{v['ms']:.3f}" + (f" ({v['host_ms']:.3f})" if "host_ms" in v else "")
    return v if v == "OOM" else "n/a" if str(v).startswith("n/a") else "raises" if str(v).startswith("raises") else "-"


def ratio(res, a, b, field) -> str:
    x, y = res.get(a), res.get(b)
    if not (isinstance(x, dict) and isinstance(y, dict) and field in x and field in y and y[field] > 0):
        return "-"
    return f"{x[field] / y[field]:.2f}"


def key4(s) -> tuple:
    return s["E"], s["hidden"], s["ffn"], s["tokens"]


def shape_name(s) -> str:
    return f"{s['E']}, {s['hidden']}, {s['ffn']}, {s['tokens']}" + (f" ({s['label']})" if s["label"] else "")


def report_head(meta, title: str, data: str, quantized: str) -> list[str]:
    """The report's title, commands, the paragraph on versions and timing, and the shapes skipped for time:
    ``data`` says what the inputs are, ``quantized`` who quantizes the weights at every forward."""
    v = meta["versions"]
    lines = [
        f"# {title} ({meta['date']}, {meta['card']})",
        "",
        *[f"`{c}`" for c in meta["commands"]],
        "",
        (
            f"torch {v['torch']} (CUDA {v['cuda']}), TE {v['te']}, cuBLASLt {v['cublaslt']}, {meta['torchao']}. "
            f"{data}. Cells: ms per step (host ms per step): CUDA events around bursts of {meta['burst']} "
            "back-to-back steps (host: the wall time until the last step's call returns, before synchronizing), "
            f"median of {meta['repeats']} interleaved repeats; graphed rows: ms only. Ratios: time over time (< 1: "
            f"the first is faster). Skewed routing: Zipf counts in multiples of {meta['align']} tokens. No "
            f"optimizer step: fd rowwise quantizes its unchanged weights once, {quantized} at every forward."
        ),
        "",
    ]
    if meta["skipped"]:
        lines += [f"Skipped for time (--budget {meta['budget_s']} s): {', '.join(meta['skipped'])}.", ""]
    return lines


def timing_tables(result, labels: dict, ratios: list, notes: dict) -> list[str]:
    """A table per routing: a row per shape, a cell per contender, then the ratios; ``notes`` gets
    ``{(label, reason): [where]}`` for the contenders not timed."""
    keys, lines = result["meta"]["contenders"], []
    for routing in result["meta"]["routings"]:
        lines += [
            f"## {routing} routing",
            "",
            "| shape (E, hidden, ffn, tokens) | empty experts | "
            + " | ".join(labels[k] for k in keys)
            + " | "
            + " | ".join(r[0] for r in ratios)
            + " |",
            "|---|---|" + "---|" * (len(keys) + len(ratios)),
        ]
        for s in result["shapes"]:
            row = s["routings"].get(routing)
            if row is None:
                lines.append(f"| {shape_name(s)} | {s.get('error', 'not run')} |" + " |" * (len(keys) + len(ratios)))
                continue
            res = row["results"]
            lines.append(
                f"| {shape_name(s)} | {row['zero_experts']} | "
                + " | ".join(cell(res.get(k)) for k in keys)
                + " | "
                + " | ".join(ratio(res, a, b, f) for _, a, b, f in ratios)
                + " |"
            )
            for k in keys:
                if isinstance(res.get(k), str):
                    notes.setdefault((labels[k], res[k]), []).append(f"{shape_name(s)} {routing}")
        lines.append("")
    return lines


def report_tail(result, labels: dict, reference: str, notes: dict, rows: int, title: str) -> list[str]:
    """Each contender's largest ``rel_err`` (against ``reference``), the ``notes`` under ``title`` (``rows``:
    how many rows make "every row"), the seconds per shape."""
    meta, lines, errs = result["meta"], [], {}
    for s in result["shapes"]:
        for row in s["routings"].values():
            for k, r in row["results"].items():
                if isinstance(r, dict):
                    errs[k] = max(errs.get(k, 0.0), r["rel_err"])
    if errs:
        lines += [
            f"Largest relative error of the forward output against {reference}: "
            + ", ".join(f"{labels[k]} {e:.2g}" for k, e in errs.items())
            + ".",
            "",
        ]
    if notes:
        lines += (
            [f"{title}:", ""]
            + [
                f"- {k}: {why} ({'every row' if len(where) == rows else '; '.join(where)})"
                for (k, why), where in notes.items()
            ]
            + [""]
        )
    lines += [f"Seconds per shape: {', '.join(f'{k} {t}' for k, t in meta['elapsed_s'].items())}."]
    return lines


def markdown(result) -> str:
    notes = {}  # (contender, reason) -> where
    lines = report_head(
        result["meta"], "One MoE expert layer, forward+backward", "bf16 activations and weights", "TE quantizes them"
    )
    lines += timing_tables(result, LABELS, RATIOS, notes)
    rows = sum(len(s["routings"]) for s in result["shapes"])
    lines += report_tail(result, LABELS, "a per-expert matmul", notes, rows, "Not timed")
    return "\n".join(lines) + "\n"


def write(out: Path, result, render=markdown) -> None:
    (out / "results.json").write_text(json.dumps(result, indent=1))
    (out / "results.md").write_text(render(result))


def _versions(tex, dev) -> dict:
    old, bench.DEV = bench.DEV, dev  # (bench.versions loads cuBLAS on bench's device)
    try:
        return versions(tex)
    finally:
        bench.DEV = old


def make_parser(doc, shapes_help, contenders, budget, align_help, out, append_help, default_repeats):
    """The arguments moe_layer.py and moe_mlp.py both take (their help as given)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="all", help=shapes_help)
    p.add_argument("--routing", default="balanced,skewed")
    p.add_argument("--repeats", type=int, default=None, help=f"repeats per contender (default 10; {default_repeats} 2)")
    p.add_argument("--budget", type=float, default=budget, help=f"seconds (0: none); default {budget}")
    p.add_argument("--only", default=",".join(contenders), help="contenders: " + ",".join(contenders))
    p.add_argument("--align", type=int, default=128, help=align_help)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / out))
    p.add_argument("--append", action="store_true", help=append_help)
    return p


def contenders_and_routings(p, args, contenders) -> tuple[list[str], list[str]]:
    """``--only`` and ``--routing`` as lists (the parser exits on an unknown name)."""
    only = [k for k in args.only.split(",") if k]
    routings = [r for r in args.routing.split(",") if r]
    if set(only) - set(contenders) or not only:
        p.error(f"--only: unknown contender(s) {sorted(set(only) - set(contenders))}; choose from {contenders}")
    if set(routings) - {"balanced", "skewed"} or not routings:
        p.error("--routing: balanced and/or skewed")
    return only, routings


def import_te():
    """(transformer_engine.pytorch, transformer_engine_torch), or (None, None), saying why."""
    try:
        import transformer_engine.pytorch as te
        import transformer_engine_torch as tex
    except Exception as e:  # noqa: BLE001
        print(f"Transformer Engine not importable ({str(e).splitlines()[0][:120] if str(e) else e!r}): TE rows are n/a")
        te = tex = None
    return te, tex


def start(args, argv, script: str, only, routings, dev: str, cpu_card: str, smoke: bool, tex):
    """The output folder, the results of an earlier command (``--append``) or None, and this run's meta."""
    ao = _torchao_gmm()
    torch.manual_seed(0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    earlier = (
        json.loads((out / "results.json").read_text()) if args.append and (out / "results.json").exists() else None
    )
    meta = {
        "date": datetime.date.today().isoformat(),
        "commands": (earlier["meta"]["commands"] if earlier else []) + [" ".join([f"python {script}", *argv])],
        "card": torch.cuda.get_device_name() if dev == "cuda" else cpu_card,
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
    return out, earlier, meta


def run_shapes(out: Path, meta, earlier, table, shapes, budget, run, render) -> dict:
    """Each shape measured by ``run(E, H, F, T)`` -> (its fields, error or None) while the budget lasts, the
    results written after each (with an earlier command's other shapes, in ``table``'s order) and at the end."""
    order = {r[:4]: i for i, r in enumerate(table)}
    done = [s for s in earlier["shapes"] if key4(s) not in {r[:4] for r in shapes}] if earlier else []
    if earlier:  # (a shape measured again gets its new seconds)
        meta["elapsed_s"] = {k: v for k, v in earlier["meta"]["elapsed_s"].items() if k != "total"}
    result = {"meta": meta, "shapes": done}
    t0, last = time.monotonic(), 0.0
    for E, H, F, T, label in shapes:
        name = f"{E}, {H}, {F}, {T}"
        if budget and last and time.monotonic() - t0 + last > budget:
            meta["skipped"].append(name)
            continue
        t = time.monotonic()
        fields, error = run(E, H, F, T)
        last = time.monotonic() - t
        meta["elapsed_s"][name] = round(last, 1)
        done.append(
            {"E": E, "hidden": H, "ffn": F, "tokens": T, "label": label} | fields | ({"error": error} if error else {})
        )
        done.sort(key=lambda s: order.get(key4(s), len(order)))
        meta["elapsed_s"]["total"] = round(time.monotonic() - t0, 1)
        write(out, result, render)
        del meta["elapsed_s"]["total"]
    meta["elapsed_s"]["total"] = round(time.monotonic() - t0, 1)
    write(out, result, render)
    print((out / "results.md").read_text(), flush=True)
    return result


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    p = make_parser(
        __doc__,
        f"all, quick ({', '.join(map(str, QUICK))}) or indices into: "
        + "; ".join(f"{i}: {s[:4]}" for i, s in enumerate(SHAPES)),
        CONTENDERS,
        budget=360,
        align_help="skewed counts in multiples of this many tokens (FP8 "
        "GEMMs need multiples of 16; TE's grouped block scaling 128); 1: make_splits' counts as they are",
        out="moe_layer",
        append_help="add to the results.json in --out (from an earlier "
        "command: the 9-minute limit per GPU command); a shape measured again replaces its row",
        default_repeats="--smoke",
    )
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: checks the script, measures nothing")
    args = p.parse_args(argv)
    only, routings = contenders_and_routings(p, args, CONTENDERS)
    table = SMOKE_SHAPES if args.smoke else SHAPES
    pick = (
        range(len(table))
        if args.shapes == "all"
        else QUICK
        if args.shapes == "quick"
        else [int(i) for i in args.shapes.split(",")]
    )
    shapes = [table[i] for i in pick if i < len(table)]
    args.repeats = args.repeats or (2 if args.smoke else 10)
    dev = "cpu" if args.smoke else "cuda"
    te, tex = import_te()
    out, earlier, meta = start(
        args, argv, "benchmarks/moe_layer.py", only, routings, dev, "CPU (--smoke)", args.smoke, tex
    )
    return run_shapes(
        out,
        meta,
        earlier,
        table,
        shapes,
        args.budget,
        lambda E, H, F, T: run_shape(E, H, F, T, routings, only, args, dev, te),
        markdown,
    )


if __name__ == "__main__":
    main()
