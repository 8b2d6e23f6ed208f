"""bench.py's bf16 sections: each a function ``<section>_rows(args, te[, clock])`` that builds its
shapes, times its contenders (bench_contenders) with bench_timing's timers, and returns the rows
bench.py stores under the section's name in results.json (bench_report turns them into tables).

* grouped: GroupedLinear forward+backward on MoE shapes, balanced and Zipf splits, every
  implementation of ``bench_contenders.impls_grouped``, and the path fd and TE choose;
* frozen: backward alone with frozen weights, and with an x that needs no grad, vs trainable;
* graphed: eager vs a CUDA-graph replay (``functional_dw.graphs.graph_step``) of the whole step;
* linear: ``fd.linear`` (TE backend) vs ``te.Linear``;
* host: host microseconds to issue a step at a launch-bound shape, and wall microseconds;
* offload: bytes through saved-tensor hooks, time under ``save_on_cpu``, peak memory.

The fp8 section is in bench_fp8.
"""

from __future__ import annotations

import torch

import functional_dw as fd
from functional_dw.graphs import graph_step

import bench_timing
from bench_contenders import FD_PATHS, Layer, grads_step, if_runs, impls_grouped, make_inputs, make_splits, reason
from bench_timing import BF16, TIMING, backward_times, cuda_times, host_times, ms_tflops


# --- grouped: GroupedLinear on MoE shapes -----------------------------------------------------


def grouped_shapes(args):
    if args.smoke:
        return [(4, 64, 64, 256), (80, 64, 64, 160)]
    if args.quick:
        return [(8, 4096, 2048, 16384), (32, 4096, 1536, 32768), (128, 2048, 1536, 65536)]
    full = [
        (E, 4096, FF, T)
        for T in (8192, 32768, 65536)
        for E in (8, 32, 128)
        for FF in (1536, 4096)
        if not (E == 128 and FF == 4096 and T == 65536)
    ]
    return full[:12] + [(64, 4096, 1536, 32768)] + full[12:] + [(128, 2048, 1536, 65536)]  # by token count


def grouped_rows(args, te, clock):
    rows = []
    for E, H, FF, T in grouped_shapes(args):
        if clock.over():
            clock.skipped.append(f"grouped E={E} hidden={H} ffn={FF} tokens={T}")
            continue
        for kind in ("balanced", "zipf"):
            splits = make_splits(E, T, kind)
            inputs = make_inputs(T, H, FF)
            flops = 3 * 2 * T * H * FF
            layer = Layer(E, H, FF, splits, te)
            impls = impls_grouped(layer)
            res = {name: step for name, step in impls.items() if isinstance(step, str)}  # cannot run
            timed = cuda_times({n: s for n, s in impls.items() if not isinstance(s, str)}, inputs, repeats=args.repeats)
            for name, ms in timed.items():
                res[name] = ms_tflops(flops, ms)
            x0 = inputs[0][0]
            res["chosen"] = {
                "te, use_grouped_tensor=None": _te_choice(x0, E, FF, H, splits, te),
                "auto": _auto_choice(x0, E, FF, H, splits),
            }
            rows.append(
                {
                    "E": E,
                    "hidden": H,
                    "ffn": FF,
                    "tokens": T,
                    "splits": kind,
                    "zero_experts": sum(s == 0 for s in splits),
                    "results": res,
                }
            )
            clock.save("grouped", rows)
            print(
                E,
                H,
                FF,
                T,
                kind,
                {k: (v["tflops"] if isinstance(v, dict) and "tflops" in v else v) for k, v in res.items()},
                flush=True,
            )
            del inputs, layer, impls
            torch.cuda.empty_cache()
    return rows


def _auto_choice(x, E, FF, H, splits):
    y, res = fd.grouped_linear_fwd(
        x.detach(),
        torch.empty(E, FF, H, device=bench_timing.DEV, dtype=BF16),
        torch.tensor(splits, device=bench_timing.DEV),
        backend="auto",
    )
    return f"{res.kernels.name} {res.path}"


def _te_choice(x, E, FF, H, splits, te):
    if te is None:
        return "n/a"
    return fd.grouped_linear_fwd(
        x.detach(),
        [torch.empty(FF, H, device=bench_timing.DEV, dtype=BF16)] * E,
        torch.tensor(splits, device=bench_timing.DEV),
        backend="te",
    )[1].path


# --- frozen experts (backward alone) ----------------------------------------------------------


FROZEN_CASES = ("trainable", "frozen weights", "x without grad")
FROZEN_NAMES = [
    "fd auto stacked",
    "fd te grouped list",
    "fd te split list",
    "te grouped",
    "te split",
    "torch._grouped_mm (autograd)",
]


def frozen_rows(args, te):
    """Backward time (forward outside the timed region) with frozen weights (requires_grad=False;
    x requires grad: no wgrad GEMM) and with an x that needs no grad (no dgrad GEMM), vs
    trainable, per implementation."""
    shapes = (
        [(4, 64, 64, 256)]
        if args.smoke
        else [(32, 4096, 1536, 32768)]
        if args.quick
        else [(32, 4096, 1536, 32768), (8, 4096, 4096, 32768)]
    )
    rows = []
    for E, H, FF, T in shapes:
        splits = make_splits(E, T, "balanced")
        layer = Layer(E, H, FF, splits, te, frozen_te=True)
        inputs = make_inputs(T, H, FF)
        cases, res = {}, {}
        for name in FROZEN_NAMES:
            if name.startswith("fd"):
                prefix, layout = name.rsplit(" ", 1)
                backend, grouped = FD_PATHS[prefix]
                if backend == "te" and te is None:
                    res[name] = "n/a: Transformer Engine is not installed"
                    continue
                fwd, params = layer.fd_forward(backend, grouped, layout)
                fwd_frozen = lambda x, fwd=fwd: fwd(x, frozen=True)  # noqa: E731
            elif name.startswith("te "):
                grouped = name == "te grouped"
                m, mf = layer.te_mods[grouped], layer.te_frozen[grouped]
                if isinstance(m, str) or isinstance(mf, str):
                    res[name] = m if isinstance(m, str) else mf
                    continue
                arg = layer.split_arg(grouped)
                fwd, params = (lambda x, m=m, arg=arg: m(x, arg)), list(m.parameters())
                fwd_frozen = lambda x, mf=mf, arg=arg: mf(x, arg)  # noqa: E731
                runs = if_runs(grads_step(fwd, params), T, H, FF)
                if isinstance(runs, str):
                    res[name] = runs
                    continue
            else:
                gm = getattr(torch, "_grouped_mm", None)
                if gm is None:
                    res[name] = "n/a: no torch._grouped_mm"
                    continue
                w, offs = layer.w_ENK, layer.offs
                fwd, params = (lambda x, w=w: gm(x, w.transpose(-2, -1), offs=offs)), [w]
                fwd_frozen = lambda x, w=w: gm(x, w.detach().transpose(-2, -1), offs=offs)  # noqa: E731
            cases[(name, "trainable")] = (fwd, lambda x, params=params: [x, *params], True)
            cases[(name, "frozen weights")] = (fwd_frozen, lambda x: [x], True)
            cases[(name, "x without grad")] = (fwd, lambda x, params=params: list(params), False)
        for key, (fwd, wrt, x_grad) in list(cases.items()):  # a case that raises is recorded, not timed
            try:
                x, dy = inputs[0]
                x = x if x_grad else x.detach()
                torch.autograd.grad(fwd(x), wrt(x), dy)
            except Exception as e:  # noqa: BLE001
                res.setdefault(key[0], {})[key[1]] = reason(e)
                del cases[key]
        timed = backward_times(cases, inputs, warmup=1 if args.smoke else 2, repeats=args.repeats)
        for (name, case), ms in timed.items():
            res.setdefault(name, {})[case] = round(ms, 4)
        for name, r in res.items():
            if isinstance(r, dict):
                for case in FROZEN_CASES[1:]:
                    ok = isinstance(r.get(case), float) and isinstance(r.get("trainable"), float)
                    r[f"{case} / trainable"] = (
                        "n/a" if not ok else round(r[case] / r["trainable"], 3) if r["trainable"] > 0 else "-"
                    )
        rows.append({"E": E, "hidden": H, "ffn": FF, "tokens": T, "results": res})
        print("frozen", E, H, FF, T, res, flush=True)
        del layer, inputs, cases
        torch.cuda.empty_cache()
    return rows


# --- CUDA graphs -------------------------------------------------------------------------------


GRAPHED_NAMES = [
    "fd auto stacked",
    "fd te grouped list",
    "fd te split list",
    "te grouped",
    "te split",
    "torch._grouped_mm (autograd)",
]


def graphed_step(step, T, H, FF):
    """A CUDA graph of ``step`` (functional_dw.graphs.graph_step, the README's recipe) as a step
    that copies each new (x, dy) into the static ones and replays; or why it cannot be captured."""
    try:
        x = torch.randn(T, H, device=bench_timing.DEV, dtype=BF16, requires_grad=True)
        dy = torch.randn(T, FF, device=bench_timing.DEV, dtype=BF16)
        g = graph_step(lambda x, dy: step((x, dy)), x, dy, warmup=TIMING["warmup"])
        return lambda inp, g=g: g(inp[0].detach(), inp[1])
    except Exception as e:  # noqa: BLE001
        print(f"graph capture failed ({T} tokens, hidden {H}, ffn {FF}): {e}", flush=True)
        return reason(e)


def graphed_rows(args, te):
    """Eager vs graph replay of a whole forward+backward (the replay includes copying the new
    x and dy into the graph's static inputs) at launch-bound shapes. Host splits on the split
    paths are baked into the graph (this benchmark's routing is fixed)."""
    shapes = (
        [(4, 64, 64, 256)]
        if args.smoke
        else [(8, 128, 128, 64), (32, 4096, 1536, 8192)]
        if args.quick
        else [(8, 128, 128, 64), (8, 4096, 1536, 8192), (32, 4096, 1536, 8192), (128, 4096, 1536, 8192)]
    )
    rows = []
    for E, H, FF, T in shapes:
        splits = make_splits(E, T, "balanced")
        layer = Layer(E, H, FF, splits, te)
        impls = impls_grouped(layer)
        inputs = make_inputs(T, H, FF)
        flops = 3 * 2 * T * H * FF
        steps, res = {}, {}
        for name in GRAPHED_NAMES:
            step = impls[name]
            if isinstance(step, str):
                res[name] = step
                continue
            steps[name] = step
            g = graphed_step(step, T, H, FF)
            if isinstance(g, str):
                res[name] = {"graph": g}
            else:
                steps[f"{name} (graph)"] = g
        timed = cuda_times(steps, inputs, repeats=args.repeats)
        for name in GRAPHED_NAMES:
            if name not in steps:
                continue
            r = res.setdefault(name, {})
            r["eager"] = ms_tflops(flops, timed[name])
            if f"{name} (graph)" in timed:
                r["graph"] = ms_tflops(flops, timed[f"{name} (graph)"])
                r["graph / eager"] = round(r["graph"]["ms"] / r["eager"]["ms"], 3) if r["eager"]["ms"] > 0 else "-"
        rows.append({"E": E, "hidden": H, "ffn": FF, "tokens": T, "results": res})
        print(
            "graphed",
            E,
            H,
            FF,
            T,
            {k: (v.get("graph / eager") if isinstance(v, dict) else v) for k, v in res.items()},
            flush=True,
        )
        del layer, impls, steps, inputs
        torch.cuda.empty_cache()
    return rows


# --- Linear, host time, offloading -----------------------------------------------------------


def linear_rows(args, te):
    rows = []
    for T, K, N in (
        [(64, 64, 64)]
        if args.smoke
        else [(8192, 4096, 4096)]
        if args.quick
        else [(8192, 4096, 4096), (8192, 8192, 28672)]
    ):
        w = torch.nn.Parameter(torch.randn(N, K, device=bench_timing.DEV, dtype=BF16) * 0.02)
        steps = {"fd linear (te)": grads_step(lambda x: fd.linear(x, w, backend="te" if te else None), [w])}
        if te is not None:
            m = te.Linear(K, N, bias=False, params_dtype=BF16, device=bench_timing.DEV)
            with torch.no_grad():
                m.weight.copy_(w)
            steps["te.Linear"] = grads_step(m, [m.weight])
        inputs = [
            (
                torch.randn(T, K, device=bench_timing.DEV, dtype=BF16, requires_grad=True),
                torch.randn(T, N, device=bench_timing.DEV, dtype=BF16),
            )
            for _ in range(2)
        ]
        timed = cuda_times(steps, inputs, repeats=args.repeats)
        res = {name: ms_tflops(3 * 2 * T * K * N, ms) for name, ms in timed.items()}
        rows.append({"tokens": T, "in": K, "out": N, "results": res})
        print("linear", T, K, N, res, flush=True)
    return rows


HOST_NAMES = [
    "fd auto",
    "fd te grouped",
    "fd te split",
    "fd linear (te)",
    "te grouped",
    "te split",
    "te.Linear",
    "torch._grouped_mm (autograd)",
]


def host_rows(args, te):
    """E=8, 128x128, 64 tokens: the GPU work is tiny, so a step's time is the host's. fd's
    TE paths and Linear through the modules a user calls (fd.nn.*), next to TE's; fd auto on a
    stacked weight next to torch's grouped_mm under its own autograd; then graph replays."""
    E, H, FF, T = 8, 128, 128, 64
    splits = [T // E] * E
    x = torch.randn(T, H, device=bench_timing.DEV, dtype=BF16, requires_grad=True)
    dy = torch.randn(T, FF, device=bench_timing.DEV, dtype=BF16)
    splits_dev = torch.tensor(splits, device=bench_timing.DEV)
    steps = {}
    w_ENK = torch.nn.Parameter(torch.randn(E, FF, H, device=bench_timing.DEV, dtype=BF16))
    steps["fd auto"] = grads_step(lambda x: fd.grouped_linear(x, w_ENK, splits_dev, backend="auto"), [w_ENK])
    for grouped in (True, False):
        tag, arg = ("grouped", splits_dev) if grouped else ("split", splits)
        if te is None:
            steps[f"fd te {tag}"] = steps[f"te {tag}"] = "n/a: Transformer Engine is not installed"
            continue
        m = fd.nn.GroupedLinear(
            E, H, FF, bias=False, params_dtype=BF16, device=bench_timing.DEV, use_grouped_tensor=grouped, backend="te"
        )
        steps[f"fd te {tag}"] = grads_step(lambda x, m=m, arg=arg: m(x, arg), list(m.parameters()))
        try:
            tm = te.GroupedLinear(
                E, H, FF, bias=False, params_dtype=BF16, device=bench_timing.DEV, use_grouped_tensor=grouped
            )
            steps[f"te {tag}"] = if_runs(
                grads_step(lambda x, m=tm, arg=arg: m(x, arg), list(tm.parameters())), T, H, FF
            )
        except Exception as e:  # noqa: BLE001
            steps[f"te {tag}"] = reason(e)
    lin = fd.nn.Linear(H, FF, bias=False, params_dtype=BF16, device=bench_timing.DEV, backend="te" if te else None)
    steps["fd linear (te)"] = grads_step(lin, [lin.weight])
    if te is not None:
        tlin = te.Linear(H, FF, bias=False, params_dtype=BF16, device=bench_timing.DEV)
        steps["te.Linear"] = grads_step(tlin, [tlin.weight])
    gm = getattr(torch, "_grouped_mm", None)
    if gm is not None:
        offs = splits_dev.cumsum(0).to(torch.int32)
        steps["torch._grouped_mm (autograd)"] = if_runs(
            grads_step(lambda x: gm(x, w_ENK.transpose(-2, -1), offs=offs), [w_ENK]), T, H, FF
        )
    for name in ("fd auto", "fd te grouped", "te grouped", "torch._grouped_mm (autograd)"):
        if callable(steps.get(name)):
            steps[f"{name} (graph)"] = graphed_step(steps[name], T, H, FF)
    runnable = {n: s for n, s in steps.items() if callable(s)}
    res = host_times(
        runnable, (x.detach().clone().requires_grad_(), dy), **(dict(iters=3, blocks=2, warmup=1) if args.smoke else {})
    )
    res |= {n: s for n, s in steps.items() if not callable(s)}
    print("host us", res, flush=True)
    return res


class PackCounter:
    def __init__(self):
        self.count, self.bytes = 0, 0

    def pack(self, t):
        self.count += 1
        self.bytes += t.numel() * t.element_size()
        return t

    def unpack(self, t):
        return t


def offload_rows(args, te):
    E, H, FF, T = (4, 64, 64, 256) if args.smoke else (32, 4096, 1536, 32768)
    splits = make_splits(E, T, "balanced")
    ws = [torch.nn.Parameter(torch.randn(FF, H, device=bench_timing.DEV, dtype=BF16) * 0.02) for _ in range(E)]
    backend = "te" if te is not None else None
    impls = {"fd te split": (lambda x: fd.grouped_linear(x, ws, splits, use_grouped_tensor=False, backend=backend), ws)}
    if te is not None:
        m = te.GroupedLinear(E, H, FF, bias=False, params_dtype=BF16, device=bench_timing.DEV)
        impls["te split"] = (lambda x: m(x, splits), list(m.parameters()))
    inputs = make_inputs(T, H, FF)
    out, steps, offloaded = {}, {}, {}
    for name, (f, params) in impls.items():
        c = PackCounter()
        with torch.autograd.graph.saved_tensors_hooks(c.pack, c.unpack):
            y = f(inputs[0][0])
        torch.autograd.grad(y, [inputs[0][0], *params], inputs[0][1])
        steps[name] = step = grads_step(f, params)

        def off(inp, step=step):
            with torch.autograd.graph.save_on_cpu(pin_memory=True):
                step(inp)

        offloaded[name] = off
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step(inputs[0])
        torch.cuda.synchronize()
        out[name] = {
            "hook_tensors": c.count,
            "hook_bytes": c.bytes,
            "peak_mem_bytes": torch.cuda.max_memory_allocated() - base,
        }
    plain = cuda_times(steps, inputs, repeats=args.repeats)
    off_ms = cuda_times(offloaded, inputs, repeats=max(5, args.repeats // 2))
    for name in impls:
        out[name].update(ms=round(plain[name], 3), ms_save_on_cpu=round(off_ms[name], 3))
    print("offload", out, flush=True)
    return {"shape": {"E": E, "hidden": H, "ffn": FF, "tokens": T}, "results": out}
