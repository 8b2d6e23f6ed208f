"""The whole MoE block, router to combine, forward+backward, on one CUDA GPU (issue 41).

    python benchmarks/moe_block.py [--shapes all|smoke|0,2,...] [--repeats N] [--budget SECONDS]
                                   [--only CONTENDERS] [--out DIR]

One MoE layer: the router's GEMM ``x Wr^T`` (``Wr [E, H]``), the top-k with softmax over the chosen logits,
the tokens sorted by expert, the expert MLP (SwiGLU weighted by the router's probs), each token's ``k`` rows
summed back. bf16 activations and weights, T tokens, dropless. A contender's step runs the forward and
``torch.autograd.backward(y, dy)``. Contenders (``--only`` takes these keys):

* ``torch``: torch's composition: ``F.linear``, ``torch.topk`` + softmax, a stable ``argsort`` of the experts,
  ``index_select``, ``torch._grouped_mm`` for fc1 and fc2 (offsets from device counts: no sync), the weighted
  SwiGLU in torch ops, ``index_add_`` back to the tokens;
* ``fd``: ``functional_dw.nn.MoE(E, H, F, k)`` as a user writes it; ``fd_rowwise``: the same with
  ``recipe=fp8.RowwiseScaling()`` (each expert GEMM in FP8 where the measured rule says it pays, else
  bf16); ``fd_fp8``: ``RowwiseScaling(bf16_below=0)``, every expert GEMM in FP8 (what the rule weighs);
  ``fd_graphed``, ``fd_fp8_graphed``: ``graphs.graph_step`` of the whole step (router to combine, no
  host sync);
* ``te``: Transformer Engine's ``moe_permute`` (index map, ``num_out_tokens = T * k``) + two ``te.GroupedLinear`` (host counts: one sync)
  with the SwiGLU in torch ops + ``moe_unpermute`` merging the probs (Megatron's path);
* ``liger``: Liger-Kernel's fused MoE (``LigerFusedMoEFunction``, liger-kernel >= 0.8.5) after torch's
  router, where it is installed (else the row says so).

All share one set of weights (the router's and the experts' ``[E, 2F, H]`` / ``[E, H, F]``). Timing as
``moe_layer.py``'s ``measure``: interleaved bursts of 4 steps after a synchronize, CUDA events (ms per step)
and the host's wall time until the 4th step returns (host ms), medians of ``--repeats``; graphed rows ms
only. Also: TFLOP/s (``18 * T * k * H * F`` per step: fc1, fc2, each three GEMMs), activation bytes per token
through ``saved_tensors_hooks`` (the slope between T and T/2 tokens, unique storages, parameters apart),
and the kernel timeline of one ``fd_fp8`` step (``torch.profiler``: the CUDA kernels by total time).
``--shapes smoke``: one tiny shape on the CPU (checks the script, measures nothing). Writes ``results.json``
and ``results.md`` under ``--out`` (default ``benchmarks/results/moe_block/``), keeping the shapes this
run did not measure from the previous results there (each row says the date of its run).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's functional_dw
sys.path.insert(0, str(Path(__file__).resolve().parent))

import functional_dw as fd  # noqa: E402
from functional_dw import fp8  # noqa: E402
from functional_dw.graphs import graph_step  # noqa: E402
from moe_layer import free, measure, train_step  # noqa: E402

SHAPES = [  # E, H, F, k, T, name
    (128, 2048, 768, 8, 8192, "Qwen3-30B-A3B"),
    (128, 2048, 768, 8, 32768, "Qwen3-30B-A3B"),
    (32, 4096, 1536, 4, 8192, ""),
    (8, 4096, 4096, 2, 32768, ""),
]
SMOKE = [(4, 32, 16, 2, 64, "smoke")]
CONTENDERS = ["torch", "fd", "fd_rowwise", "fd_fp8", "te", "liger", "fd_graphed", "fd_fp8_graphed"]
BF16 = torch.bfloat16
RECIPES = {"fd": None, "fd_rowwise": fp8.RowwiseScaling(), "fd_fp8": fp8.RowwiseScaling(bf16_below=0)}


def router(x, wr, k):
    """torch's router, every contender's but fd's: (fp32 softmax over the k chosen logits, their expert indices)."""
    vals, idx = torch.topk(F.linear(x, wr), k, dim=-1)
    return torch.softmax(vals.float(), -1), idx


def torch_moe(x, wr, w1, w2, k):
    """torch's composition of the block (no host sync)."""
    E = wr.shape[0]
    probs, idx = router(x, wr, k)
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(E, dtype=torch.int64, device=x.device).index_add_(0, flat, torch.ones_like(flat))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    token = torch.div(order, k, rounding_mode="floor")
    gate, up = torch._grouped_mm(x.index_select(0, token), w1.transpose(-2, -1), offs=offs).chunk(2, -1)
    h = (F.silu(gate.float()) * up.float() * probs.reshape(-1)[order, None]).to(x.dtype)
    out = torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs)
    return torch.zeros_like(x).index_add_(0, token, out)


class Block:
    """One shape: the weights every contender reads, two (x, dy) pairs, and the contenders' steps
    (``moe_layer.measure`` reads ``inputs``, ``cuda`` and ``reference()``)."""

    def __init__(self, E, H, F_, k, T, dev):
        self.E, self.H, self.F, self.k, self.T, self.dev, self.cuda = E, H, F_, k, T, dev, dev == "cuda"
        g = torch.Generator().manual_seed(0)
        self.wr = (torch.randn(E, H, generator=g) * 0.02).to(dev, BF16)
        self.w1 = (torch.randn(E, 2 * F_, H, generator=g) * 0.02).to(dev, BF16)
        self.w2 = (torch.randn(E, H, F_, generator=g) * 0.02).to(dev, BF16)
        self.inputs = [
            (torch.randn(T, H, device=dev, dtype=BF16, requires_grad=True), torch.randn(T, H, device=dev, dtype=BF16))
            for _ in range(2)
        ]

    def reference(self):
        with torch.no_grad():
            return torch_moe(self.inputs[0][0].float(), self.wr.float(), self.w1.float(), self.w2.float(), self.k)

    def module(self, recipe=None):
        m = fd.nn.MoE(self.E, self.H, self.F, self.k, params_dtype=BF16, device=self.dev, recipe=recipe)
        with torch.no_grad():
            m.router.weight.copy_(self.wr), m.experts.fc1.weight.copy_(self.w1), m.experts.fc2.weight.copy_(self.w2)
        return m

    def params(self):
        return [torch.nn.Parameter(t.clone()) for t in (self.wr, self.w1, self.w2)]

    def forward(self, key):
        """``(fwd(x) -> y, its parameters)``, or why it cannot run."""
        if key == "torch":
            wr, w1, w2 = p = self.params()
            return (lambda x: torch_moe(x, wr, w1, w2, self.k)), p
        if key in RECIPES:
            m = self.module(RECIPES[key])
            return m, list(m.parameters())
        if key == "te":
            return self.te_forward()
        if key == "liger":
            return self.liger_forward()
        raise KeyError(key)

    def build(self, key, warmup):
        if key.endswith("_graphed"):
            if not self.cuda:
                return "n/a: CUDA graphs need CUDA"
            fwd, params = self.forward(key[: -len("_graphed")])
            x0, dy0 = self.inputs[0]

            def body(x, dy):
                y = fwd(x)
                y.backward(dy)
                return y.detach()  # what a replay returns (its first is checked against the reference)

            g = graph_step(body, x0.detach().clone().requires_grad_(), dy0.clone(), params=params, warmup=warmup)
            return lambda inp: g()
        made = self.forward(key)
        return made if isinstance(made, str) else train_step(made[0])

    def te_forward(self):
        try:
            import transformer_engine.pytorch as te
        except ImportError as e:
            return f"n/a: Transformer Engine is not importable ({e})"
        if not self.cuda:
            return "n/a: TE needs CUDA"
        E, H, F_, k = self.E, self.H, self.F, self.k
        fc1 = te.GroupedLinear(E, H, 2 * F_, bias=False, params_dtype=BF16, device="cuda")
        fc2 = te.GroupedLinear(E, F_, H, bias=False, params_dtype=BF16, device="cuda")
        wr = torch.nn.Parameter(self.wr.clone())
        with torch.no_grad():
            for e in range(E):
                getattr(fc1, f"weight{e}").copy_(self.w1[e]), getattr(fc2, f"weight{e}").copy_(self.w2[e])

        def fwd(x):
            probs, idx = router(x, wr, k)
            rows, row_map = te.moe_permute(x, idx.to(torch.int32), num_out_tokens=x.shape[0] * k, map_type="index")
            splits = torch.bincount(idx.reshape(-1), minlength=E).tolist()  # TE's API: host counts (a sync)
            gate, up = fc1(rows, splits).chunk(2, -1)
            out = fc2((F.silu(gate) * up).contiguous(), splits)
            return te.moe_unpermute(out, row_map, merging_probs=probs, map_type="index")

        return fwd, [wr, *fc1.parameters(), *fc2.parameters()]

    def liger_forward(self):
        """Liger-Kernel's fused MoE (``LigerFusedMoEFunction``: gather, fc1, SwiGLU, fc2 and the weighted
        sum in Triton; its forward takes ``(x, gate_up [E, 2F, H], down [E, H, F], top-k indices int32,
        top-k weights)``) after torch's router; its first output is checked against the reference."""
        try:
            from liger_kernel.ops.fused_moe import LigerFusedMoEFunction
        except ImportError as e:
            return f"n/a: Liger-Kernel's fused_moe is not importable ({e})"
        if not self.cuda:
            return "n/a: Liger's kernels need CUDA"
        wr, w1, w2 = p = self.params()

        def fwd(x):
            probs, idx = router(x, wr, self.k)
            return LigerFusedMoEFunction.apply(x, w1, w2, idx.to(torch.int32), probs.to(x.dtype))

        return fwd, p


def saved_per_token(block: Block, key: str) -> dict | str:
    """Activation bytes per token through saved_tensors_hooks (slope between T and T/2), params apart."""
    made = block.forward(key)
    if isinstance(made, str):
        return made
    fwd, params = made
    pids = {p.untyped_storage().data_ptr() for p in params}

    def packed(T):
        seen, weights = {}, 0

        def pack(t):
            nonlocal weights
            s = t.untyped_storage()
            if s.data_ptr() in pids:
                weights += 1
            else:
                seen[s.data_ptr()] = s.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fwd(block.inputs[0][0][:T].detach().requires_grad_())
        return sum(seen.values()), weights

    (b1, n_w), (b2, _) = packed(block.T), packed(block.T // 2)
    return {"bytes_per_token": round((b1 - b2) / (block.T - block.T // 2), 1), "params_seen": n_w}


def timeline(block: Block) -> list | str:
    """The CUDA kernels of one fd_fp8 step (every expert GEMM in FP8) by total time (us), from torch.profiler."""
    if not block.cuda:
        return "n/a: needs CUDA"
    from torch.profiler import ProfilerActivity, profile

    step = train_step(block.forward("fd_fp8")[0])
    for i in range(3):
        step(block.inputs[i % 2])
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        step(block.inputs[0])
        torch.cuda.synchronize()
    rows = [(e.key, e.device_time_total, e.count) for e in p.key_averages() if e.device_time_total > 0]
    return [{"kernel": k[:90], "us": round(t, 1), "launches": n} for k, t, n in sorted(rows, key=lambda r: -r[1])[:25]]


def markdown(result: dict) -> str:
    keys = [k for k in CONTENDERS if any(k in r["times"] for r in result["shapes"])]
    out = [f"# The MoE block, router to combine, forward+backward ({result['date']}, {result['device']})", ""]
    out += [f"`{result['command']}`", "", f"torch {result['torch']}. Cells: ms per step (host ms), TFLOP/s.", ""]
    out += ["Each shape's row comes from its latest run [date]; shapes this command did not measure are kept"]
    out += ["from the previous results (`merged`).", ""]
    out += ["| shape (E, H, F, top-k, T) | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
    for r in result["shapes"]:
        cells = []
        for k in keys:
            v = r["times"].get(k, "-")
            if isinstance(v, dict):
                host = f" ({v['host_ms']:.3f})" if "host_ms" in v else ""
                cells.append(f"{v['ms']:.3f}{host}, {r['flops'] / v['ms'] / 1e9:.0f}")
            else:
                cells.append(str(v))
        out.append(f"| {r['shape']} [{r.get('run', result['date'])}] | " + " | ".join(cells) + " |")
    out += ["", "Speedups (time over time; > 1: the first is faster):", ""]
    pairs = [
        ("fd", "torch"),
        ("fd", "liger"),
        ("fd", "te"),
        ("fd_rowwise", "fd"),
        ("fd_fp8", "fd"),
        ("fd_fp8_graphed", "fd_graphed"),
    ]
    for r in result["shapes"]:
        t = {k: v["ms"] for k, v in r["times"].items() if isinstance(v, dict)}
        cells = [f"{a} over {b} {t[b] / t[a]:.2f}x" for a, b in pairs if a in t and b in t]
        out.append(f"- {r['shape']} ({r.get('seconds', '?')} s): " + ", ".join(cells))
    out += ["", "Activation bytes per token through saved-tensor hooks (parameters the hook saw):", ""]
    for r in result["shapes"]:
        out.append(f"- {r['shape']}: " + ", ".join(f"{k} {v}" for k, v in r["saved"].items()))
    for r in result["shapes"]:
        if isinstance(r.get("timeline"), list):
            out += ["", f"Kernel timeline of one fd_fp8 step at {r['shape']} (us):", ""]
            out += [f"- {t['us']} us, {t['launches']}x: `{t['kernel']}`" for t in r["timeline"]]
    return "\n".join(out) + "\n"


def merged(result: dict, previous: dict | None) -> dict:
    """``result`` with the previous results' shapes that it did not measure appended (the latest
    data per shape), each tagged with the run that measured it (``run``: its date)."""
    measured = {r["shape"] for r in result["shapes"]}
    kept = [dict(r, run=r.get("run", previous["date"])) for r in (previous or {}).get("shapes", [])]
    return dict(result, shapes=result["shapes"] + [r for r in kept if r["shape"] not in measured])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="all")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--budget", type=float, default=0)
    p.add_argument("--only", default=",".join(CONTENDERS))
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "moe_block"))
    args = p.parse_args(argv)
    smoke = args.shapes == "smoke"
    dev = "cpu" if smoke else "cuda"
    shapes = SMOKE if smoke else SHAPES if args.shapes == "all" else [SHAPES[int(i)] for i in args.shapes.split(",")]
    only = [k for k in args.only.split(",") if k]
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu (smoke)",
        "torch": torch.__version__,
        "command": "python benchmarks/moe_block.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "shapes": [],
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prev_file = out / "results.json"
    previous = json.loads(prev_file.read_text()) if prev_file.exists() and not smoke else None
    t_start = time.monotonic()
    for E, H, F_, k, T, name in shapes:
        if args.budget and time.monotonic() - t_start > args.budget:
            break
        t_shape = time.monotonic()
        block = Block(E, H, F_, k, T, dev)
        steps, times = {}, {}
        for key in only:
            try:
                s = block.build(key, warmup=3)
            except Exception as e:  # noqa: BLE001  (the row says why)
                s = f"{type(e).__name__}: {str(e)[:80]}"
            (times if isinstance(s, str) else steps)[key] = s
        measure(steps, block, 2 if smoke else args.repeats, 3, times)
        shape = f"{E}, {H}, {F_}, {k}, {T}" + (f" ({name})" if name else "")
        saved = {k: saved_per_token(block, k) for k in ("torch", "fd") if k in only}
        result["shapes"].append(
            {"shape": shape, "flops": 18 * T * k * H * F_, "times": times, "saved": saved, "timeline": timeline(block)}
        )
        result["shapes"][-1]["seconds"] = round(time.monotonic() - t_shape, 1)
        result["shapes"][-1]["run"] = result["date"]
        del block, steps
        free(dev == "cuda")
        kept = merged(result, previous)
        (out / "results.json").write_text(json.dumps(kept, indent=1))
        (out / "results.md").write_text(markdown(kept))
    print(markdown(result))


if __name__ == "__main__":
    main()
