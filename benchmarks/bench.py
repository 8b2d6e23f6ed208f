"""functional_dw vs Transformer Engine's modules vs torch's grouped GEMM, on one CUDA GPU.

    python benchmarks/bench.py [--quick] [--only SECTION,...] [--budget S] [--out benchmarks/results/bench]

One interleaved run (bf16) records, in this order:

* versions: torch, CUDA, TE, cuBLASLt (TE's answer and the library actually loaded);
* host: CPU microseconds to issue one forward+backward and wall microseconds per step at a
  launch-bound shape (E=8, 128x128, 64 tokens), functional_dw vs TE's modules vs torch's
  grouped_mm under autograd, and CUDA-graph replays of the same steps;
* linear: Linear at two shapes, fd vs te.Linear;
* offload: bytes through saved-tensor hooks, time under ``save_on_cpu(pin_memory=True)``,
  peak memory;
* frozen: backward time with frozen weights and with an x that needs no grad, vs trainable;
* graphed: eager vs CUDA-graph replay (``functional_dw.graphs.graph_step``) of a whole
  forward+backward at launch-bound shapes (8k tokens, tiny);
* grouped: forward+backward TFLOP/s of GroupedLinear on MoE shapes (balanced and Zipf-skewed
  splits with empty experts); functional_dw's three paths with both weight layouts (one
  stacked ``[E, N, K]`` tensor, and the E ``[N, K]`` weights an ``nn.GroupedLinear`` holds),
  next to te.GroupedLinear's two paths and torch's grouped_mm. Shapes go by token count, so
  ``--budget`` (seconds for the whole run) drops the largest if time runs short;
* fp8: forward+backward TFLOP/s of GroupedLinear under TE's Hopper FP8 recipes (delayed scaling
  on the split path; current and block scaling on the split and grouped paths), fd vs
  te.GroupedLinear with the same recipe, path and weights (under TE's autocast), next to the best
  bf16 rows and torchao's FP8 rowwise grouped GEMM (if importable); and the bytes through a
  saved-tensor pack hook per layer call, bf16 vs each recipe;
* the dense bf16 peak: the highest of several dense GEMMs (shapes and layouts, torch and TE),
  measured at the start and again at the end.

Timing: CUDA events around bursts of back-to-back steps after warm-up, median of repeats, the
implementations interleaved (each repeat times all of them, in a rotating order), inputs
rotated between steps. Host times: interleaved blocks, the minimum per implementation.
Writes ``results.md``, ``results.json`` and ``tflops.png`` under ``--out`` (``partial.json``
after each section, so a run cut short keeps what it measured). Without TE the TE rows say so.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import statistics
import time
import traceback
import warnings
from pathlib import Path

import torch

import functional_dw as fd
from functional_dw.graphs import graph_step

BF16 = torch.bfloat16
DEV = "cuda"
SECTIONS = ("host", "linear", "offload", "frozen", "graphed", "fp8", "grouped")


# --- timing --------------------------------------------------------------------------------


TIMING = {"warmup": 3, "burst": 4}  # (--smoke: 1 and 1)


def cuda_time(step, inputs, warmup=None, repeats=15, burst=None):
    """Median milliseconds per ``step`` (CUDA events around ``burst`` back-to-back steps, so
    the host runs ahead as in training and launch latency is not counted once per step; the
    inputs rotate between steps so caches do not flatter)."""
    return cuda_times({"step": step}, inputs, warmup, repeats, burst)["step"]


def cuda_times(steps: dict, inputs, warmup=None, repeats=15, burst=None) -> dict:
    """Like :func:`cuda_time` for several implementations at once, interleaved: each repeat
    times every implementation (in a rotating order), so clock and thermal drift and the
    allocator's state fall on all of them alike rather than on whichever ran first."""
    warmup = TIMING["warmup"] if warmup is None else warmup
    burst = TIMING["burst"] if burst is None else burst
    names = list(steps)
    for name in names:
        for i in range(warmup):
            steps[name](inputs[i % len(inputs)])
    torch.cuda.synchronize()
    times = {n: [] for n in names}
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for j in range(burst):
                steps[name](inputs[(r + j) % len(inputs)])
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) / burst)
    return {n: statistics.median(t) for n, t in times.items()}


def backward_times(cases: dict, inputs, warmup=2, repeats=15) -> dict:
    """Median milliseconds of backward alone (the forward runs before the start event).
    ``cases``: name -> (forward(x) -> y, wrt(x) -> the tensors to differentiate, x_grad: bool);
    interleaved like :func:`cuda_times`."""
    names = list(cases)

    def run(name, i, timed):
        fwd, wrt, x_grad = cases[name]
        x, dy = inputs[i % len(inputs)]
        x = x if x_grad else x.detach()
        y = fwd(x)
        start, end = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if timed else (None, None)
        if timed:
            start.record()
        torch.autograd.grad(y, wrt(x), dy)
        if timed:
            end.record()
        return start, end

    for name in names:
        for i in range(warmup):
            run(name, i, False)
    torch.cuda.synchronize()
    times = {n: [] for n in names}
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            start, end = run(name, r, True)
            end.synchronize()
            times[name].append(start.elapsed_time(end))
    return {n: statistics.median(t) for n, t in times.items()}


def host_times(steps: dict, inp, iters=100, blocks=9, warmup=20) -> dict:
    """Per step at launch-bound sizes (the GPU idles: the host is the limit): ``issue`` (CPU
    microseconds until the step is enqueued, before any sync) and ``wall`` (microseconds per
    step with the GPU, over a block). Blocks of ``iters`` calls, interleaved across
    implementations; the minimum block per implementation (host noise only ever adds time)."""
    for step in steps.values():
        for _ in range(warmup):
            step(inp)
    torch.cuda.synchronize()
    issue = {n: [] for n in steps}
    wall = {n: [] for n in steps}
    for _ in range(blocks):
        for name, step in steps.items():
            t0 = time.perf_counter()
            for _ in range(iters):
                step(inp)
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            issue[name].append((t1 - t0) / iters * 1e6)
            wall[name].append((t2 - t0) / iters * 1e6)
    return {n: {"issue": round(min(issue[n]), 1), "wall": round(min(wall[n]), 1)} for n in steps}


# --- versions and the dense peak -------------------------------------------------------------


def _te_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("transformer_engine", "transformer-engine-torch", "transformer_engine_torch"):
        try:
            return version(dist)
        except PackageNotFoundError:
            pass
    return "?"


def _cublaslt_loaded() -> tuple[int | None, str | None]:
    """(cublasLtGetVersion(), path) of the libcublasLt this process has loaded, if any."""
    try:
        path = next((ln.split()[-1] for ln in open("/proc/self/maps") if "libcublasLt" in ln), None)
        if path is None:
            return None, None
        lib = ctypes.CDLL(path)
        lib.cublasLtGetVersion.restype = ctypes.c_size_t
        return int(lib.cublasLtGetVersion()), path
    except Exception:  # noqa: BLE001  (not Linux, a stripped library: record nothing)
        return None, None


def versions(tex) -> dict:
    out = {"torch": torch.__version__, "cuda": torch.version.cuda, "te": _te_version() if tex is not None else None,
           "cublaslt_te": tex.get_cublasLt_version() if tex is not None else None}
    torch.zeros(8, 8, device=DEV, dtype=BF16) @ torch.zeros(8, 8, device=DEV, dtype=BF16)  # loads cuBLAS(Lt)
    out["cublaslt_loaded"], out["cublaslt_path"] = _cublaslt_loaded()
    v = out["cublaslt_te"] or out["cublaslt_loaded"]
    out["cublaslt"] = f"{v // 10000}.{v // 100 % 100}.{v % 100}" if v else "?"
    return out


def dense_samples(smoke: bool, have_te: bool, round_: int) -> list[dict]:
    """Dense bf16 GEMMs (median ms of bursts -> TFLOP/s): torch's matmul at square shapes and
    the three layouts of the Linear shape, and TE's (cuBLASLt) at two of them."""
    n = 256 if smoke else 8192
    shapes = [("torch mm TN", n, n, n), ("torch mm NN", n, n, n)]
    if not smoke:
        shapes += [("torch mm TN", 16384, 16384, 16384), ("torch mm TN", 8192, 4096, 4096),
                   ("torch mm NN", 8192, 4096, 4096), ("torch mm NT", 4096, 4096, 8192)]
    if have_te:
        shapes += [("te gemm TN", n, n, n)] + ([] if smoke else [("te gemm TN", 8192, 4096, 4096)])
    out = []
    for name, M, N, K in shapes:  # out [M, N] from a [M, K] and b [N, K] (TN) / [K, N] (NN); NT: a^T [K, M]
        try:
            a = torch.randn(K, M, device=DEV, dtype=BF16) if name.endswith("NT") else torch.randn(M, K, device=DEV, dtype=BF16)
            b = torch.randn(K, N, device=DEV, dtype=BF16) if name.endswith(("NN", "NT")) else torch.randn(N, K, device=DEV, dtype=BF16)
            if name.startswith("te"):
                from functional_dw.kernels.te import TE

                step = lambda _: TE.fprop(a, b, None)  # noqa: E731
            elif name.endswith("TN"):
                step = lambda _: a @ b.t()  # noqa: E731
            elif name.endswith("NN"):
                step = lambda _: a @ b  # noqa: E731
            else:
                step = lambda _: a.t() @ b  # noqa: E731
            ms = cuda_time(step, [None], warmup=1 if smoke else 5, repeats=2 if smoke else 20)
            out.append({"gemm": name, "M": M, "N": N, "K": K, "round": round_, "ms": round(ms, 4),
                        "tflops": round(2 * M * N * K / ms / 1e9, 1)})
        except Exception as e:  # noqa: BLE001
            out.append({"gemm": name, "M": M, "N": N, "K": K, "round": round_, "error": str(e).splitlines()[0][:120]})
        finally:
            a = b = None
    return out


# --- shapes and splits ---------------------------------------------------------------------


def make_splits(E, T, kind, seed=0):
    """balanced: T/E each; zipf: counts ~ 1/rank^1.2 with the tail experts getting zero tokens."""
    if kind == "balanced":
        base = [T // E] * E
        base[0] += T - sum(base)
        return base
    g = torch.Generator().manual_seed(seed)
    w = torch.tensor([1.0 / (r + 1) ** 1.2 for r in range(E)])
    w[-max(1, E // 8):] = 0.0  # the coldest experts get nothing
    counts = torch.multinomial(w / w.sum(), T, replacement=True, generator=g).bincount(minlength=E)
    return counts[torch.randperm(E, generator=g)].tolist()


def make_inputs(T, H, FF, n=2):
    return [(torch.randn(T, H, device=DEV, dtype=BF16, requires_grad=True), torch.randn(T, FF, device=DEV, dtype=BF16))
            for _ in range(n)]


# --- implementations (each a step(inputs) for forward+backward) ------------------------------


def grads_step(forward, params):
    def step(inp):
        x, dy = inp
        y = forward(x)
        return torch.autograd.grad(y, [x, *params], dy)
    return step


def _reason(e: Exception) -> str:
    return f"raises: {str(e).splitlines()[0][:90] if str(e) else type(e).__name__}"


def _if_runs(step, T, H, FF):
    """``step`` if one forward+backward runs, else the reason (TE's grouped path beyond 64
    experts; torch's grouped GEMM backward where the build lacks it)."""
    try:
        step((torch.randn(T, H, device=DEV, dtype=BF16, requires_grad=True), torch.randn(T, FF, device=DEV, dtype=BF16)))
        return step
    except Exception as e:  # noqa: BLE001
        return _reason(e)


class Layer:
    """One grouped layer x[T, H] -> [T, FF] with the same weights in every form the
    implementations take: a stacked [E, FF, H] parameter, an ``fd.nn.GroupedLinear`` (the list
    a module user has), TE's modules (trainable, and frozen copies when asked)."""

    def __init__(self, E, H, FF, splits, te, frozen_te=False):
        self.E, self.H, self.FF, self.splits, self.te = E, H, FF, splits, te
        self.T = sum(splits)
        self.w_ENK = torch.nn.Parameter(torch.randn(E, FF, H, device=DEV, dtype=BF16) * 0.02)
        self.mod = fd.nn.GroupedLinear(E, H, FF, bias=False, params_dtype=BF16, device=DEV)
        with torch.no_grad():
            for w, src in zip(self.mod.weights(), self.w_ENK):
                w.copy_(src)
        self.splits_dev = torch.tensor(splits, device=DEV)
        self.offs = torch.cumsum(self.splits_dev, 0).to(torch.int32)
        self.te_mods, self.te_frozen = {}, {}
        for grouped in (False, True):
            self.te_mods[grouped] = self._te_module(grouped, trainable=True)
            if frozen_te:
                self.te_frozen[grouped] = self._te_module(grouped, trainable=False)

    def _te_module(self, grouped, trainable):
        if self.te is None:
            return "n/a: Transformer Engine is not installed"
        try:
            m = self.te.GroupedLinear(self.E, self.H, self.FF, bias=False, params_dtype=BF16, device=DEV,
                                      use_grouped_tensor=grouped)
            with torch.no_grad():
                for e in range(self.E):
                    getattr(m, f"weight{e}").copy_(self.w_ENK[e])
            for p in m.parameters():
                p.requires_grad_(trainable)
            return m
        except Exception as e:  # noqa: BLE001
            return _reason(e)

    def split_arg(self, grouped):
        """The grouped path reads a CUDA splits tensor (no sync); the split path needs host sizes."""
        return self.splits_dev if grouped is not False else self.splits

    # forward(x, frozen) -> y, and the parameters a trainable step differentiates
    def fd_forward(self, backend, grouped, layout):
        arg = self.split_arg(grouped)
        if layout == "stacked":
            return (lambda x, frozen=False: fd.grouped_linear(x, self.w_ENK.detach() if frozen else self.w_ENK, arg,
                                                              backend=backend, use_grouped_tensor=grouped)), [self.w_ENK]
        ws = self.mod.weights()
        return (lambda x, frozen=False: fd.grouped_linear(x, [w.detach() for w in ws] if frozen else ws, arg,
                                                          backend=backend, use_grouped_tensor=grouped)), ws

    def fd_step(self, backend, grouped, layout):
        if backend == "te" and self.te is None:
            return "n/a: Transformer Engine is not installed"
        if layout == "list":  # what nn.GroupedLinear's forward passes: its weights, fetched per call
            arg = self.split_arg(grouped)

            def step(inp):
                x, dy = inp
                ws = self.mod.weights()
                y = fd.grouped_linear(x, ws, arg, backend=backend, use_grouped_tensor=grouped)
                return torch.autograd.grad(y, [x, *ws], dy)
            return step
        fwd, params = self.fd_forward(backend, grouped, layout)
        return grads_step(fwd, params)

    def te_step(self, grouped):
        m = self.te_mods[grouped]
        if isinstance(m, str):
            return m
        arg = self.split_arg(grouped)
        return _if_runs(grads_step(lambda x: m(x, arg), list(m.parameters())), self.T, self.H, self.FF)

    def gm_autograd_step(self):
        gm = getattr(torch, "_grouped_mm", None)
        if gm is None:
            return f"n/a: torch {torch.__version__} has no _grouped_mm"
        return _if_runs(grads_step(lambda x: gm(x, self.w_ENK.transpose(-2, -1), offs=self.offs), [self.w_ENK]),
                        self.T, self.H, self.FF)


FD_NAMES = ["fd auto stacked", "fd auto list", "fd te grouped stacked", "fd te grouped list", "fd te split stacked",
            "fd te split list"]
FD_PATHS = {"fd auto": ("auto", None), "fd te grouped": ("te", True), "fd te split": ("te", False)}
PEER_NAMES = ["te grouped", "te split", "torch._grouped_mm", "torch._grouped_mm (autograd)", "torch.mm loop"]
GROUPED_NAMES = FD_NAMES + PEER_NAMES
PEERS_FOR_RATIO = ("te split", "te grouped", "torch._grouped_mm")


def impls_grouped(layer: Layer) -> dict:
    """name -> step, or the reason it cannot run: forward+backward of one grouped layer."""
    out = {}
    for prefix, (backend, grouped) in FD_PATHS.items():
        for layout in ("stacked", "list"):
            out[f"{prefix} {layout}"] = layer.fd_step(backend, grouped, layout)
    out["te grouped"], out["te split"] = layer.te_step(True), layer.te_step(False)
    gm = getattr(torch, "_grouped_mm", None)
    if gm is not None:
        w, offs = layer.w_ENK, layer.offs

        def torch_gm(inp):
            x, dy = inp
            gm(x, w.transpose(-2, -1), offs=offs)
            gm(dy, w, offs=offs)
            gm(dy.t(), x, offs=offs)
        out["torch._grouped_mm"] = torch_gm
    out["torch._grouped_mm (autograd)"] = layer.gm_autograd_step()
    ws, sizes = layer.mod.weights(), layer.splits

    def mm_loop(inp):
        x, dy = inp
        for e, (xe, de) in enumerate(zip(x.split(sizes), dy.split(sizes))):
            xe @ ws[e].t(), de @ ws[e], de.t() @ xe
    out["torch.mm loop"] = mm_loop
    return out


def _timing(flops, ms):
    """ms and TFLOP/s; no TFLOP/s for a time that is not positive (the readers print a dash)."""
    return {"ms": round(ms, 4)} | ({"tflops": round(flops / ms / 1e9, 1)} if ms > 0 else {})


def _auto_choice(x, E, FF, H, splits):
    y, res = fd.grouped_linear_fwd(x.detach(), torch.empty(E, FF, H, device=DEV, dtype=BF16), torch.tensor(splits, device=DEV), backend="auto")
    return f"{res.kernels.name} {res.path}"


def _te_choice(x, E, FF, H, splits, te):
    if te is None:
        return "n/a"
    return fd.grouped_linear_fwd(x.detach(), [torch.empty(FF, H, device=DEV, dtype=BF16)] * E,
                                 torch.tensor(splits, device=DEV), backend="te")[1].path


def grouped_shapes(args):
    if args.smoke:
        return [(4, 64, 64, 256), (80, 64, 64, 160)]
    if args.quick:
        return [(8, 4096, 2048, 16384), (32, 4096, 1536, 32768), (128, 2048, 1536, 65536)]
    full = [(E, 4096, FF, T) for T in (8192, 32768, 65536) for E in (8, 32, 128) for FF in (1536, 4096)
            if not (E == 128 and FF == 4096 and T == 65536)]
    return full[:12] + [(64, 4096, 1536, 32768)] + full[12:] + [(128, 2048, 1536, 65536)]  # by token count


def grouped_rows(args, te, clock):
    rows = []
    for (E, H, FF, T) in grouped_shapes(args):
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
                res[name] = _timing(flops, ms)
            x0 = inputs[0][0]
            res["chosen"] = {"te, use_grouped_tensor=None": _te_choice(x0, E, FF, H, splits, te),
                             "auto": _auto_choice(x0, E, FF, H, splits)}
            rows.append({"E": E, "hidden": H, "ffn": FF, "tokens": T, "splits": kind,
                         "zero_experts": sum(s == 0 for s in splits), "results": res})
            clock.save("grouped", rows)
            print(E, H, FF, T, kind, {k: (v["tflops"] if isinstance(v, dict) and "tflops" in v else v) for k, v in res.items()}, flush=True)
            del inputs, layer, impls
            torch.cuda.empty_cache()
    return rows


# --- frozen experts (backward alone) ----------------------------------------------------------


FROZEN_CASES = ("trainable", "frozen weights", "x without grad")
FROZEN_NAMES = ["fd auto stacked", "fd te grouped list", "fd te split list", "te grouped", "te split",
                "torch._grouped_mm (autograd)"]


def frozen_rows(args, te):
    """Backward time (forward outside the timed region) with frozen weights (requires_grad=False;
    x requires grad: no wgrad GEMM) and with an x that needs no grad (no dgrad GEMM), vs
    trainable, per implementation."""
    shapes = [(4, 64, 64, 256)] if args.smoke else [(32, 4096, 1536, 32768)] if args.quick else [
        (32, 4096, 1536, 32768), (8, 4096, 4096, 32768)]
    rows = []
    for (E, H, FF, T) in shapes:
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
                runs = _if_runs(grads_step(fwd, params), T, H, FF)
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
                res.setdefault(key[0], {})[key[1]] = _reason(e)
                del cases[key]
        timed = backward_times(cases, inputs, warmup=1 if args.smoke else 2, repeats=args.repeats)
        for (name, case), ms in timed.items():
            res.setdefault(name, {})[case] = round(ms, 4)
        for name, r in res.items():
            if isinstance(r, dict):
                for case in FROZEN_CASES[1:]:
                    ok = isinstance(r.get(case), float) and isinstance(r.get("trainable"), float)
                    r[f"{case} / trainable"] = ("n/a" if not ok else round(r[case] / r["trainable"], 3) if r["trainable"] > 0
                                                else "-")
        rows.append({"E": E, "hidden": H, "ffn": FF, "tokens": T, "results": res})
        print("frozen", E, H, FF, T, res, flush=True)
        del layer, inputs, cases
        torch.cuda.empty_cache()
    return rows


# --- CUDA graphs -------------------------------------------------------------------------------


GRAPHED_NAMES = ["fd auto stacked", "fd te grouped list", "fd te split list", "te grouped", "te split",
                 "torch._grouped_mm (autograd)"]


def graphed_step(step, T, H, FF):
    """A CUDA graph of ``step`` (functional_dw.graphs.graph_step, the README's recipe) as a step
    that copies each new (x, dy) into the static ones and replays; or why it cannot be captured."""
    try:
        x = torch.randn(T, H, device=DEV, dtype=BF16, requires_grad=True)
        dy = torch.randn(T, FF, device=DEV, dtype=BF16)
        g = graph_step(lambda x, dy: step((x, dy)), x, dy, warmup=TIMING["warmup"])
        return lambda inp, g=g: g(inp[0].detach(), inp[1])
    except Exception as e:  # noqa: BLE001
        print(f"graph capture failed ({T} tokens, hidden {H}, ffn {FF}): {e}", flush=True)
        return _reason(e)


def graphed_rows(args, te):
    """Eager vs graph replay of a whole forward+backward (the replay includes copying the new
    x and dy into the graph's static inputs) at launch-bound shapes. Host splits on the split
    paths are baked into the graph (this benchmark's routing is fixed)."""
    shapes = [(4, 64, 64, 256)] if args.smoke else [(8, 128, 128, 64), (32, 4096, 1536, 8192)] if args.quick else [
        (8, 128, 128, 64), (8, 4096, 1536, 8192), (32, 4096, 1536, 8192), (128, 4096, 1536, 8192)]
    rows = []
    for (E, H, FF, T) in shapes:
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
            r["eager"] = _timing(flops, timed[name])
            if f"{name} (graph)" in timed:
                r["graph"] = _timing(flops, timed[f"{name} (graph)"])
                r["graph / eager"] = round(r["graph"]["ms"] / r["eager"]["ms"], 3) if r["eager"]["ms"] > 0 else "-"
        rows.append({"E": E, "hidden": H, "ffn": FF, "tokens": T, "results": res})
        print("graphed", E, H, FF, T, {k: (v.get("graph / eager") if isinstance(v, dict) else v) for k, v in res.items()},
              flush=True)
        del layer, impls, steps, inputs
        torch.cuda.empty_cache()
    return rows


# --- Linear, host time, offloading -----------------------------------------------------------


def linear_rows(args, te):
    rows = []
    for (T, K, N) in ([(64, 64, 64)] if args.smoke else [(8192, 4096, 4096)] if args.quick
                      else [(8192, 4096, 4096), (8192, 8192, 28672)]):
        w = torch.nn.Parameter(torch.randn(N, K, device=DEV, dtype=BF16) * 0.02)
        steps = {"fd linear (te)": grads_step(lambda x: fd.linear(x, w, backend="te" if te else None), [w])}
        if te is not None:
            m = te.Linear(K, N, bias=False, params_dtype=BF16, device=DEV)
            with torch.no_grad():
                m.weight.copy_(w)
            steps["te.Linear"] = grads_step(m, [m.weight])
        inputs = [(torch.randn(T, K, device=DEV, dtype=BF16, requires_grad=True), torch.randn(T, N, device=DEV, dtype=BF16)) for _ in range(2)]
        timed = cuda_times(steps, inputs, repeats=args.repeats)
        res = {name: _timing(3 * 2 * T * K * N, ms) for name, ms in timed.items()}
        rows.append({"tokens": T, "in": K, "out": N, "results": res})
        print("linear", T, K, N, res, flush=True)
    return rows


HOST_NAMES = ["fd auto", "fd te grouped", "fd te split", "fd linear (te)", "te grouped", "te split", "te.Linear",
              "torch._grouped_mm (autograd)"]


def host_rows(args, te):
    """E=8, 128x128, 64 tokens: the GPU work is tiny, so a step's time is the host's. fd's
    TE paths and Linear through the modules a user calls (fd.nn.*), next to TE's; fd auto on a
    stacked weight next to torch's grouped_mm under its own autograd; then graph replays."""
    E, H, FF, T = 8, 128, 128, 64
    splits = [T // E] * E
    x = torch.randn(T, H, device=DEV, dtype=BF16, requires_grad=True)
    dy = torch.randn(T, FF, device=DEV, dtype=BF16)
    splits_dev = torch.tensor(splits, device=DEV)
    steps = {}
    w_ENK = torch.nn.Parameter(torch.randn(E, FF, H, device=DEV, dtype=BF16))
    steps["fd auto"] = grads_step(lambda x: fd.grouped_linear(x, w_ENK, splits_dev, backend="auto"), [w_ENK])
    for grouped in (True, False):
        tag, arg = ("grouped", splits_dev) if grouped else ("split", splits)
        if te is None:
            steps[f"fd te {tag}"] = steps[f"te {tag}"] = "n/a: Transformer Engine is not installed"
            continue
        m = fd.nn.GroupedLinear(E, H, FF, bias=False, params_dtype=BF16, device=DEV, use_grouped_tensor=grouped, backend="te")
        steps[f"fd te {tag}"] = grads_step(lambda x, m=m, arg=arg: m(x, arg), list(m.parameters()))
        try:
            tm = te.GroupedLinear(E, H, FF, bias=False, params_dtype=BF16, device=DEV, use_grouped_tensor=grouped)
            steps[f"te {tag}"] = _if_runs(grads_step(lambda x, m=tm, arg=arg: m(x, arg), list(tm.parameters())), T, H, FF)
        except Exception as e:  # noqa: BLE001
            steps[f"te {tag}"] = _reason(e)
    lin = fd.nn.Linear(H, FF, bias=False, params_dtype=BF16, device=DEV, backend="te" if te else None)
    steps["fd linear (te)"] = grads_step(lin, [lin.weight])
    if te is not None:
        tlin = te.Linear(H, FF, bias=False, params_dtype=BF16, device=DEV)
        steps["te.Linear"] = grads_step(tlin, [tlin.weight])
    gm = getattr(torch, "_grouped_mm", None)
    if gm is not None:
        offs = splits_dev.cumsum(0).to(torch.int32)
        steps["torch._grouped_mm (autograd)"] = _if_runs(grads_step(lambda x: gm(x, w_ENK.transpose(-2, -1), offs=offs), [w_ENK]), T, H, FF)
    for name in ("fd auto", "fd te grouped", "te grouped", "torch._grouped_mm (autograd)"):
        if callable(steps.get(name)):
            steps[f"{name} (graph)"] = graphed_step(steps[name], T, H, FF)
    runnable = {n: s for n, s in steps.items() if callable(s)}
    res = host_times(runnable, (x.detach().clone().requires_grad_(), dy),
                     **(dict(iters=3, blocks=2, warmup=1) if args.smoke else {}))
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
    ws = [torch.nn.Parameter(torch.randn(FF, H, device=DEV, dtype=BF16) * 0.02) for _ in range(E)]
    backend = "te" if te is not None else None
    impls = {"fd te split": (lambda x: fd.grouped_linear(x, ws, splits, use_grouped_tensor=False, backend=backend), ws)}
    if te is not None:
        m = te.GroupedLinear(E, H, FF, bias=False, params_dtype=BF16, device=DEV)
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
        out[name] = {"hook_tensors": c.count, "hook_bytes": c.bytes, "peak_mem_bytes": torch.cuda.max_memory_allocated() - base}
    plain = cuda_times(steps, inputs, repeats=args.repeats)
    off_ms = cuda_times(offloaded, inputs, repeats=max(5, args.repeats // 2))
    for name in impls:
        out[name].update(ms=round(plain[name], 3), ms_save_on_cpu=round(off_ms[name], 3))
    print("offload", out, flush=True)
    return {"shape": {"E": E, "hidden": H, "ffn": FF, "tokens": T}, "results": out}


# --- FP8 -------------------------------------------------------------------------------------


FP8_CONFIGS = [("delayed", False), ("current", False), ("current", True), ("block", False), ("block", True)]
FP8_TE_CLASSES = {"delayed": "DelayedScaling", "current": "Float8CurrentScaling", "block": "Float8BlockScaling"}
FP8_OTHERS = ["fd rowwise", "fd rowwise new weights", "bf16 fd auto", "bf16 te grouped", "torchao fp8 rowwise"]
FP8_SPLITS = ("balanced", "zipf")
FP8_ONLY: set = set()  # --fp8-configs
FP8_HOOK_SHAPE = (8, 2048, 2048, 8192)


def fp8_tag(kind, grouped):
    return f"{kind} {'grouped' if grouped else 'split'}"


def fp8_shapes(args):
    if args.smoke:
        return [(2, 128, 128, 256)]  # 128 tokens per expert: block scaling's grouped path
    if args.quick:
        return [FP8_HOOK_SHAPE, (32, 4096, 1536, 32768)]
    return [FP8_HOOK_SHAPE, (32, 4096, 1536, 32768), (128, 4096, 1536, 65536), (8, 4096, 4096, 65536)]


def fp8_splits(E, T, kind):
    """balanced, or zipf rounded to multiples of 128 tokens per expert (what TE's grouped block
    scaling takes; every FP8 path here runs them), summing to T."""
    if kind == "balanced":
        return make_splits(E, T, kind)
    raw = make_splits(E, T, kind)
    counts = [c // 128 * 128 for c in raw]
    hot = max(range(E), key=lambda e: raw[e])
    counts[hot] += T - sum(counts)
    return counts


def _te_autocast(te, recipe):
    """TE 2.x's ``te.autocast(enabled=True, recipe=)``; older TE's ``fp8_autocast``."""
    if hasattr(te, "autocast"):
        try:
            return te.autocast(enabled=True, recipe=recipe)
        except TypeError:
            pass
    return te.fp8_autocast(enabled=True, fp8_recipe=recipe)


def _torchao_gmm():
    """torchao's FP8 rowwise grouped GEMM (``_to_fp8_rowwise_then_scaled_grouped_mm(A [M, K],
    B_t [E, K, N] column-major, offs int32 group ends)``), or why not."""
    try:
        from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm as f
        return f
    except Exception as e:  # noqa: BLE001
        return f"n/a: torchao not importable ({str(e).splitlines()[0][:80] if str(e) else type(e).__name__})"


def fp8_impls(layer: Layer, te) -> dict:
    """name -> (forward(x) -> y, params, after_step or None), or the reason it cannot run. fd:
    fd.grouped_linear on the E weights of an fd.nn.GroupedLinear (backend te), delayed scaling's
    state updated after each step (fp8.update_state_); TE: te.GroupedLinear with the same weights
    under TE's autocast with the same recipe (TE updates its state itself)."""
    from functional_dw import fp8

    out = {}
    ws = layer.mod.weights()
    rowwise = fp8.RowwiseScaling()  # (its own name: the loop below rebinds r, which a lambda reading
    # r would see: with TE installed, "fd rowwise" then ran the last TE recipe)
    out["fd rowwise"] = ((lambda x: fd.grouped_linear(x, ws, layer.splits_dev, recipe=rowwise)), ws, None)

    def bump():  # what an optimizer step does to the weights (an in-place update, here of +0): their
        with torch.no_grad():  # versions change, so the next step quantizes them again
            for w in ws:
                w.add_(0)
    out["fd rowwise new weights"] = ((lambda x: fd.grouped_linear(x, ws, layer.splits_dev, recipe=rowwise)), ws, bump)
    for kind, grouped in FP8_CONFIGS:
        if FP8_ONLY and fp8_tag(kind, grouped) not in FP8_ONLY:
            continue
        tag, arg = fp8_tag(kind, grouped), layer.split_arg(grouped)
        if te is None:
            out[f"fd {tag}"] = out[f"te {tag}"] = "n/a: Transformer Engine is not installed"
            continue
        try:
            r = {"delayed": fp8.DelayedScaling, "current": fp8.Float8CurrentScaling, "block": fp8.Float8BlockScaling}[kind]()
            state = fp8.init_state(r, num_gemms=layer.E, device=DEV) if kind == "delayed" else None
            out[f"fd {tag}"] = ((lambda x, r=r, state=state, arg=arg, grouped=grouped: fd.grouped_linear(
                x, ws, arg, backend="te", use_grouped_tensor=grouped, recipe=r, fp8_state=state)), ws,
                (lambda r=r, state=state: fp8.update_state_(state, r)) if state is not None else None)
        except Exception as e:  # noqa: BLE001
            out[f"fd {tag}"] = _reason(e)
        try:
            from transformer_engine.common import recipe as te_recipes

            tr = getattr(te_recipes, FP8_TE_CLASSES[kind])()
            m = layer._te_module(grouped, trainable=True)
            if isinstance(m, str):
                out[f"te {tag}"] = m
                continue

            def te_fwd(x, m=m, tr=tr, arg=arg):
                with _te_autocast(te, tr):
                    return m(x, arg)
            out[f"te {tag}"] = (te_fwd, list(m.parameters()), None)
        except Exception as e:  # noqa: BLE001
            out[f"te {tag}"] = _reason(e)
    fwd, params = layer.fd_forward("auto", None, "list")
    out["bf16 fd auto"] = (fwd, params, None)
    m = layer.te_mods[True]
    out["bf16 te grouped"] = m if isinstance(m, str) else ((lambda x, m=m: m(x, layer.splits_dev)), list(m.parameters()), None)
    f = _torchao_gmm()
    if isinstance(f, str):
        out["torchao fp8 rowwise"] = f
    else:
        import inspect

        try:
            kw = {"pad_token_groups_for_grouped_mm": False} if "pad_token_groups_for_grouped_mm" in inspect.signature(f).parameters else {}
        except (TypeError, ValueError):
            kw = {}
        w = layer.w_ENK  # B_t = w^T: [E, K, N] with strides (N*K, 1, K), the column-major layout torchao asks for
        out["torchao fp8 rowwise"] = ((lambda x: f(x, w.transpose(-2, -1), layer.offs, out_dtype=BF16, **kw)), [w], None)
    return out


def fp8_step(fwd, params, after):
    def step(inp):
        x, dy = inp
        g = torch.autograd.grad(fwd(x), [x, *params], dy)
        if after is not None:
            after()
        return g
    return step


def _packed_bytes(t) -> int:
    """Bytes of one packed tensor; a quantized tensor subclass (TE's Float8Tensor...) counts its
    data and scales, not its nominal dtype."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        inner = [getattr(t, a, None) for a in ("_data", "_transpose", "_rowwise_data", "_columnwise_data", "_scale_inv",
                                               "_rowwise_scale_inv", "_columnwise_scale_inv")]
        inner = [u for u in inner if isinstance(u, torch.Tensor)]
        if inner:
            return sum(u.numel() * u.element_size() for u in inner)
    return t.numel() * t.element_size()


class Fp8PackCounter:
    def __init__(self):
        self.count, self.bytes, self.param_bytes, self.types = 0, 0, 0, set()

    def pack(self, t):
        n = _packed_bytes(t)
        self.count += 1
        self.bytes += n
        self.types.add(type(t).__name__)
        if isinstance(t, torch.nn.Parameter):
            self.param_bytes += n
        return t

    def unpack(self, t):
        return t


def fp8_hook_bytes(layer: Layer, impls: dict, inputs) -> dict:
    """Bytes through a saved-tensor pack hook for one forward (then backward) per implementation."""
    out = {}
    cases = {"bf16 fd te split": ((lambda x: fd.grouped_linear(x, layer.mod.weights(), layer.splits, backend="te",
                                                               use_grouped_tensor=False)), layer.mod.weights(), None)}
    m = layer.te_mods[False]
    cases["bf16 te split"] = m if isinstance(m, str) else ((lambda x: m(x, layer.splits)), list(m.parameters()), None)
    cases |= {n: v for n, v in impls.items() if n.startswith(("fd ", "te "))}
    x, dy = inputs[0]
    for name, impl in cases.items():
        if isinstance(impl, str):
            out[name] = impl
            continue
        fwd, params, after = impl
        try:
            c = Fp8PackCounter()
            with torch.autograd.graph.saved_tensors_hooks(c.pack, c.unpack):
                y = fwd(x)
            torch.autograd.grad(y, [x, *params], dy)
            if after is not None:
                after()
            out[name] = {"hook_tensors": c.count, "hook_bytes": c.bytes, "param_bytes": c.param_bytes,
                         "types": sorted(c.types)}
        except Exception as e:  # noqa: BLE001
            out[name] = _reason(e)
    base = out.get("bf16 fd te split")
    for v in out.values():
        if isinstance(v, dict) and isinstance(base, dict) and base["hook_bytes"]:
            v["/ bf16 fd"] = round(v["hook_bytes"] / base["hook_bytes"], 3)
    print("fp8 hook bytes", out, flush=True)
    return out


def _fd_path(layer, kind, grouped):
    """The path fd.grouped_linear takes for this recipe (grouped, or split when it falls back)."""
    from functional_dw import fp8

    try:
        r = {"delayed": fp8.DelayedScaling, "current": fp8.Float8CurrentScaling, "block": fp8.Float8BlockScaling}[kind]()
        st = fp8.init_state(r, num_gemms=layer.E, device=DEV) if kind == "delayed" else None
        x = torch.zeros(layer.T, layer.H, device=DEV, dtype=BF16)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return fd.grouped_linear_fwd(x, layer.mod.weights(), layer.split_arg(grouped), backend="te",
                                         use_grouped_tensor=grouped, recipe=r, fp8_state=st)[1].path
    except Exception as e:  # noqa: BLE001
        return _reason(e)


def fp8_rows(args, te, clock):
    """Forward+backward of one grouped layer under each FP8 recipe and path, fd vs te.GroupedLinear
    with the same recipe, path and weights; the best bf16 rows and torchao's FP8 rowwise grouped
    GEMM next to them; balanced splits (multiples of 128 tokens per expert); and the bytes through
    a saved-tensor hook at one shape."""
    rows, hooks = [], None
    for (E, H, FF, T), kind in [(shape, k) for shape in fp8_shapes(args) for k in (FP8_SPLITS if not args.smoke else ("balanced",))]:
        if clock.over():
            clock.skipped.append(f"fp8 E={E} hidden={H} ffn={FF} tokens={T} {kind}")
            continue
        splits = fp8_splits(E, T, kind)
        assert all(s % 128 == 0 for s in splits), splits
        layer = Layer(E, H, FF, splits, te)
        inputs = make_inputs(T, H, FF)
        flops = 3 * 2 * T * H * FF
        impls = fp8_impls(layer, te)
        if hooks is None and ((E, H, FF, T) == FP8_HOOK_SHAPE or args.smoke):
            hooks = {"shape": {"E": E, "hidden": H, "ffn": FF, "tokens": T}, "results": fp8_hook_bytes(layer, impls, inputs)}
            clock.save("fp8", {"rows": rows, "hook_bytes": hooks})
        res, steps = {}, {}
        for name, impl in impls.items():
            if isinstance(impl, str):
                res[name] = impl
                continue
            step = fp8_step(*impl)
            try:  # runs at all (and delayed scaling's warm-up: a few steps with state updates)
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    for i in range(3 if "delayed" in name else 1):
                        step(inputs[i % len(inputs)])
                steps[name] = step
                if caught:
                    res[f"{name} warning"] = str(caught[0].message)[:200]
            except Exception as e:  # noqa: BLE001
                print(f"fp8 {name} at E={E} hidden={H} ffn={FF} tokens={T}: {e}", flush=True)
                res[name] = _reason(e)
        try:
            timed = cuda_times(steps, inputs, repeats=args.repeats)
        except Exception as e:  # noqa: BLE001  (one implementation failing mid-timing: time the rest one by one)
            timed = {}
            for name, step in steps.items():
                try:
                    timed |= cuda_times({name: step}, inputs, repeats=args.repeats)
                except Exception as e2:  # noqa: BLE001
                    res[name] = _reason(e2)
            print("fp8 interleaved timing failed, timed one by one:", e, flush=True)
        for name, ms in timed.items():
            res[name] = _timing(flops, ms)
        res["fd path"] = {fp8_tag(k, g): _fd_path(layer, k, g) for k, g in FP8_CONFIGS
                          if not FP8_ONLY or fp8_tag(k, g) in FP8_ONLY} if te is not None else {}
        rows.append({"E": E, "hidden": H, "ffn": FF, "tokens": T, "splits": kind, "results": res})
        clock.save("fp8", {"rows": rows, "hook_bytes": hooks})
        print("fp8", E, H, FF, T, {k: (v["tflops"] if isinstance(v, dict) and "tflops" in v else v) for k, v in res.items()},
              flush=True)
        del layer, inputs, impls, steps
        torch.cuda.empty_cache()
    return {"rows": rows, "hook_bytes": hooks}


# --- report ----------------------------------------------------------------------------------


def add_fractions(result, peak):
    """frac_peak on every timing that has TFLOP/s, from the final peak (known at the end);
    none without a positive peak."""
    if not (isinstance(peak, (int, float)) and peak > 0):
        return

    def walk(v):
        if isinstance(v, dict):
            if "tflops" in v and "ms" in v:
                v["frac_peak"] = round(v["tflops"] / peak, 3)
            for u in v.values():
                walk(u)
        elif isinstance(v, list):
            for u in v:
                walk(u)
    for key in ("grouped", "linear", "graphed", "fp8"):
        walk(result.get(key))


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = GROUPED_NAMES
    labels = [f"E{r['E']} {r['ffn']} {r['tokens'] // 1024}k {r['splits'][0]}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(10, len(rows) * 1.1), 5))
    width = 0.8 / len(names)
    for i, n in enumerate(names):
        vals = [_tflops(r["results"].get(n)) or 0 for r in rows]
        ax.bar([j + i * width for j in range(len(rows))], vals, width, label=n)
    ax.set_xticks([j + 0.4 for j in range(len(rows))], labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("TFLOP/s (bf16, fwd+bwd)")
    ax.legend(fontsize=7, ncol=4)
    ax.set_title("GroupedLinear fwd+bwd, hidden in/ffn out (0 = raises, n/a or no time)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# The readers of a row take what is there: a timing may lack its fraction of peak (no positive
# peak: add_fractions gives none), its TFLOP/s (a time that is not positive), or be a reason it
# did not run; a missing number prints a dash, a ratio over a zero time too.


def _number(x):
    return x if isinstance(x, (int, float)) and not isinstance(x, bool) and x == x else None  # (not NaN)


def _tflops(v):
    return _number(v.get("tflops")) if isinstance(v, dict) else None


def _ms_of(v):
    return _number(v.get("ms")) if isinstance(v, dict) else None


def _cell(v):
    if isinstance(v, dict) and ("tflops" in v or "ms" in v):
        tflops, frac = _tflops(v), _number(v.get("frac_peak"))
        return f"{'-' if tflops is None else tflops} ({'-' if frac is None else f'{frac:.2f}'})"
    return "raises" if isinstance(v, str) and v.startswith("raises") else "n/a"


def _ms(v):
    return f"{v['ms']}" if isinstance(v, dict) and "ms" in v else "raises" if isinstance(v, str) and v.startswith("raises") else "n/a"


def _ratio(a, b, digits=2):
    """a's time over b's: n/a when either is not a timing, a dash when there is no time to divide by."""
    if not (isinstance(a, dict) and isinstance(b, dict)):
        return "n/a"
    x, y = _ms_of(a), _ms_of(b)
    return f"{x / y:.{digits}f}" if x is not None and y is not None and y > 0 else "-"


def _fmt(x, spec=".2f"):
    return "-" if _number(x) is None else format(x, spec)


def best_fd_over_peers(res):
    """functional_dw's best time over the best peer's; NaN without both or with a zero peer time."""
    ours = [t for t in (_ms_of(res.get(n)) for n in FD_NAMES) if t is not None]
    peers = [t for t in (_ms_of(res.get(n)) for n in PEERS_FOR_RATIO) if t is not None]
    return min(ours) / min(peers) if ours and peers and min(peers) > 0 else float("nan")


def markdown(result):
    meta, peak = result["meta"], _number(result.get("dense_peak_tflops"))
    v = meta["versions"]
    lines = [f"# Benchmarks ({meta['date']}, {meta['card']})", "",
             f"torch {v['torch']} (CUDA {v['cuda']}), TE {v['te']}, cuBLASLt {v['cublaslt']} (TE reports {v['cublaslt_te']}; "
             f"loaded: {v['cublaslt_loaded']} from {v['cublaslt_path']}). Dense bf16 peak: **{f'{peak:.0f}' if peak else '-'} TFLOP/s**, the highest "
             f"of {len([s for s in result['dense_samples'] if 'tflops' in s])} dense GEMM measurements below (fractions of peak "
             "use it). Forward+backward, bf16, median of repeats, CUDA events, implementations interleaved."
             + (" Run with --quick." if meta["quick"] else "")
             + (f" Skipped for time (--budget {meta['budget_s']} s): {', '.join(meta['skipped'])}." if meta["skipped"] else "")
             + "".join(f" **Section {k} failed**: {e}." for k, e in meta["errors"].items()),
             "", "Seconds per section: " + ", ".join(f"{k} {s}" for k, s in meta["elapsed_s"].items()), ""]
    if result.get("grouped"):
        names = GROUPED_NAMES
        lines += ["## GroupedLinear: TFLOP/s (fraction of peak)", "",
                  "| E | hidden | ffn | tokens | splits | " + " | ".join(names)
                  + " | fd / best peer | fd auto / autograd grouped_mm | chosen (te None / auto) |",
                  "|" + "---|" * (8 + len(names))]
        for r in result["grouped"]:
            res = r["results"]
            ag, ours = res.get("torch._grouped_mm (autograd)"), res.get("fd auto stacked")
            ratio_ag = _ratio(ours, ag)
            ch = res["chosen"]
            lines.append(f"| {r['E']} | {r['hidden']} | {r['ffn']} | {r['tokens']} | {r['splits']} ({r['zero_experts']} empty) | "
                         + " | ".join(_cell(res.get(n)) for n in names)
                         + f" | {_fmt(best_fd_over_peers(res))} | {ratio_ag} | {ch['te, use_grouped_tensor=None']} / {ch['auto']} |")
        lines += ["", "fd / best peer: functional_dw's best time (any path, either layout) over the best of te split, te "
                  "grouped and torch._grouped_mm (<= 1.00: at least as fast). stacked: one [E, out, in] weight; list: the E "
                  "[out, in] weights of an fd.nn.GroupedLinear (what a module user passes). torch._grouped_mm is its three raw "
                  "GEMMs (no autograd); torch._grouped_mm (autograd) is the same op differentiated by torch's autograd; fd auto "
                  "/ autograd grouped_mm compares fd auto stacked with it.", "",
                  "## Weight layout: time of the list (nn.GroupedLinear) over the stacked [E, out, in] weight", "",
                  "| E | hidden | ffn | tokens | splits | fd auto | fd te grouped | fd te split |", "|---|---|---|---|---|---|---|---|"]
        for r in result["grouped"]:
            res = r["results"]
            cells = []
            for p in FD_PATHS:
                a, b = res.get(f"{p} list"), res.get(f"{p} stacked")
                cells.append(_ratio(a, b))
            lines.append(f"| {r['E']} | {r['hidden']} | {r['ffn']} | {r['tokens']} | {r['splits']} | " + " | ".join(cells) + " |")
    if result.get("fp8") and result["fp8"].get("rows"):
        lines += ["", "## FP8: forward+backward TFLOP/s (fraction of the bf16 peak), fd vs te.GroupedLinear, same recipe and path", "",
                  "| E | hidden | ffn | tokens | recipe | path | fd ms | te ms | fd | te | fd / te | fd path taken |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in result["fp8"]["rows"]:
            res = r["results"]
            for kind, grouped in FP8_CONFIGS:
                tag = fp8_tag(kind, grouped)
                a, b = res.get(f"fd {tag}"), res.get(f"te {tag}")
                ratio = _ratio(a, b)
                lines.append(f"| {r['E']} | {r['hidden']} | {r['ffn']} | {r['tokens']} | {kind} | "
                             f"{'grouped' if grouped else 'split'} | {_ms(a)} | {_ms(b)} | {_cell(a)} | {_cell(b)} | {ratio} | "
                             f"{res.get('fd path', {}).get(tag, 'n/a')} |")
        lines += ["", "Same shapes: fd's own RowwiseScaling, bf16 and torchao, TFLOP/s (fraction of peak); speedups of fd "
                  "rowwise (time of the other / time of fd rowwise)", "",
                  "| E | hidden | ffn | tokens | splits | " + " | ".join(FP8_OTHERS)
                  + " | rowwise / bf16 fd | rowwise / best te FP8 | rowwise / torchao |",
                  "|---|---|---|---|---|" + "---|" * (len(FP8_OTHERS) + 3)]
        for r in result["fp8"]["rows"]:
            res = r["results"]
            ms = lambda n: _ms_of(res.get(n))  # noqa: E731
            te8 = [ms(f"te {fp8_tag(k, g)}") for k, g in FP8_CONFIGS if ms(f"te {fp8_tag(k, g)}")]
            ours = ms("fd rowwise")
            speed = lambda other: "n/a" if other is None or ours is None else f"{other / ours:.2f}" if ours > 0 else "-"  # noqa: E731
            lines.append(f"| {r['E']} | {r['hidden']} | {r['ffn']} | {r['tokens']} | {r.get('splits', 'balanced')} | "
                         + " | ".join(_cell(res.get(n)) for n in FP8_OTHERS)
                         + f" | {speed(ms('bf16 fd auto'))} | {speed(min(te8) if te8 else None)} | "
                         f"{speed(ms('torchao fp8 rowwise'))} |")
        warned = [f"{r['E']}/{r['hidden']}/{r['ffn']}/{r['tokens']} {k[:-len(' warning')]}: {v}"
                  for r in result["fp8"]["rows"] for k, v in r["results"].items() if k.endswith(" warning")]
        lines += ["", "Balanced and zipf splits (multiples of 128 tokens per expert, so block scaling can take the grouped path), bf16 "
                  "activations. fd: fd.grouped_linear(..., recipe=fp8.<Recipe>(), backend='te', use_grouped_tensor=path), "
                  "delayed scaling with fp8.update_state_ after each step (in the timed step); te: te.GroupedLinear with fd's "
                  "weights under TE's autocast with TE's recipe of the same class; delayed scaling warmed up 3 steps for both. "
                  "fd / te <= 1.00: fd at least as fast. bf16 fd auto: fd's bf16 auto path (list weights); torchao fp8 "
                  "rowwise: torchao.prototype.moe_training._to_fp8_rowwise_then_scaled_grouped_mm (per-row scales, "
                  "differentiable). fd rowwise: fd.grouped_linear(..., recipe=fp8.RowwiseScaling()) on device splits, "
                  "weights unchanged between steps (quantized once, NOTE: [FP8 weights per version]); fd rowwise new "
                  "weights: the same with an in-place update of the weights after each step (an optimizer step), so "
                  "every step quantizes them again."] + ([""] + [f"Warning: {w}" for w in warned] if warned else [])
    hb = (result.get("fp8") or {}).get("hook_bytes")
    if hb:
        s = hb["shape"]
        lines += ["", f"## FP8: bytes through a saved-tensor pack hook per layer call (E={s['E']}, hidden {s['hidden']}, "
                  f"ffn {s['ffn']}, {s['tokens']} tokens)", "",
                  "| impl | tensors packed | bytes packed | of which parameters | / bf16 fd | packed types |", "|---|---|---|---|---|---|"]
        for k, v in hb["results"].items():
            if isinstance(v, dict):
                lines.append(f"| {k} | {v['hook_tensors']} | {v['hook_bytes']:,} | {v['param_bytes']:,} | "
                             f"{v.get('/ bf16 fd', 'n/a')} | {', '.join(v['types'])} |")
            else:
                lines.append(f"| {k} | {v} | | | | |")
    if result.get("frozen"):
        lines += ["", "## Frozen experts: backward ms (forward not timed), and the ratio to trainable", "",
                  "| E | hidden | ffn | tokens | impl | trainable | frozen weights | x without grad | frozen / trainable | "
                  "x without grad / trainable |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in result["frozen"]:
            for name, v in r["results"].items():
                head = f"| {r['E']} | {r['hidden']} | {r['ffn']} | {r['tokens']} | {name} | "
                if isinstance(v, dict):
                    ratios = [_fmt(v[f"{c} / trainable"]) if _number(v.get(f"{c} / trainable")) is not None
                              else v.get(f"{c} / trainable", "n/a") for c in FROZEN_CASES[1:]]
                    lines.append(head + " | ".join(str(v.get(c, "n/a")) for c in FROZEN_CASES) + f" | {ratios[0]} | {ratios[1]} |")
                else:
                    lines.append(head + f"{v} | | | | |")
        lines += ["", "frozen weights: requires_grad=False on the weights, x requires grad (no wgrad GEMM); x without grad: "
                  "trainable weights (no dgrad GEMM)."]
    if result.get("graphed"):
        lines += ["", "## CUDA graphs: ms per forward+backward, eager vs graph replay (functional_dw.graphs.graph_step)", "",
                  "| E | hidden | ffn | tokens | impl | eager ms | graph ms | graph / eager | graph TFLOP/s (fraction of peak) |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in result["graphed"]:
            for name, v in r["results"].items():
                head = f"| {r['E']} | {r['hidden']} | {r['ffn']} | {r['tokens']} | {name} | "
                if not isinstance(v, dict):
                    lines.append(head + f"{v} | | | |")
                    continue
                g = v.get("graph")
                lines.append(head + f"{_ms(v.get('eager'))} | {_ms(g) if isinstance(g, dict) else g} | "
                             f"{v.get('graph / eager', 'n/a')} | {_cell(g) if isinstance(g, dict) else 'n/a'} |")
        lines += ["", "A replay includes copying the new x and dy into the graph's static inputs. Splits: a CUDA tensor on "
                  "the grouped paths (read at each replay); a host list on the split paths (baked into the graph)."]
    if result.get("linear"):
        lines += ["", "## Linear: TFLOP/s (fraction of peak)", "", "| tokens | in | out | fd linear (te) | te.Linear | fd / te |",
                  "|---|---|---|---|---|---|"]
        for r in result["linear"]:
            a, b = r["results"].get("fd linear (te)"), r["results"].get("te.Linear")
            ratio = _ratio(a, b, 3)
            lines.append(f"| {r['tokens']} | {r['in']} | {r['out']} | {_cell(a)} | {_cell(b)} | {ratio} |")
    if result.get("host"):
        lines += ["", "## Host time (launch-bound: E=8, 128x128, 64 tokens): microseconds per forward+backward", "",
                  "| impl | issue us (host, before sync) | wall us (with the GPU) |", "|---|---|---|"]
        for name, v in result["host"].items():
            lines.append(f"| {name} | {v['issue']} | {v['wall']} |" if isinstance(v, dict) else f"| {name} | {v} | |")
        lines += ["", "Minimum over interleaved blocks of 100 steps. fd te grouped/split and fd linear run through the "
                  "fd.nn modules, as te.GroupedLinear and te.Linear do; fd auto on a stacked weight, as torch._grouped_mm. "
                  "(graph): a CUDA-graph replay of that step, with its inputs copied in."]
    if result.get("offload"):
        s = result["offload"]["shape"]
        lines += ["", f"## Saved-tensor hooks and memory (E={s['E']}, hidden {s['hidden']}, ffn {s['ffn']}, {s['tokens']} tokens, split path)", "",
                  "| impl | tensors packed | bytes packed | fwd+bwd ms | under save_on_cpu(pin_memory) ms | peak memory MiB |",
                  "|---|---|---|---|---|---|"]
        for k, v in result["offload"]["results"].items():
            lines.append(f"| {k} | {v['hook_tensors']} | {v['hook_bytes']:,} | {v['ms']} | {v['ms_save_on_cpu']} | {v['peak_mem_bytes'] / 2**20:.0f} |")
    lines += ["", "## Dense bf16 GEMMs (the peak is the highest)", "", "| gemm | M | N | K | round | ms | TFLOP/s |",
              "|---|---|---|---|---|---|---|"]
    for d in result["dense_samples"]:
        lines.append(f"| {d['gemm']} | {d['M']} | {d['N']} | {d['K']} | {d['round']} | {d.get('ms', d.get('error'))} | {d.get('tflops', '')} |")
    return "\n".join(lines) + "\n"


class Clock:
    """Elapsed seconds per section, the budget, and partial results written as they come."""

    def __init__(self, budget, out, result):
        self.t0, self.budget, self.out, self.result = time.monotonic(), budget, out, result
        self.skipped: list[str] = []
        self.errors: dict[str, str] = {}
        self.elapsed: dict[str, float] = {}
        self.reserve = 25.0  # for the closing peak measurement and the report

    def over(self) -> bool:
        return self.budget is not None and time.monotonic() - self.t0 > self.budget - self.reserve

    def save(self, key, value):
        self.result[key] = value
        (self.out / "partial.json").write_text(json.dumps(self.result))

    def section(self, name, fn):
        t = time.monotonic()
        try:
            value = fn()
        except Exception as e:  # noqa: BLE001  (one section's failure must not lose the run)
            traceback.print_exc()
            self.errors[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            value = None
        self.elapsed[name] = round(time.monotonic() - t, 1)
        print(f"--- {name}: {self.elapsed[name]} s (total {time.monotonic() - self.t0:.0f} s)", flush=True)
        self.save(name, value)
        return value


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="few shapes per section (about a third of the full run's time)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes: checks the script, measures nothing")
    p.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated sections to run, of {','.join(SECTIONS)}")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--fp8-configs", default="", help="fp8 section: only these TE recipe/path rows, e.g. "
                   "'delayed split,block grouped' (default: all)")
    p.add_argument("--budget", type=float, default=450,
                   help="seconds for the whole run (default 450; 0: none): fp8 and grouped shapes that would start later are "
                        "skipped, and listed in the results")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "bench"))
    args = p.parse_args(argv)
    global FP8_ONLY
    FP8_ONLY = {c.strip() for c in args.fp8_configs.split(",") if c.strip()}
    only = [s for s in args.only.split(",") if s]
    if set(only) - set(SECTIONS):
        p.error(f"unknown section(s) {sorted(set(only) - set(SECTIONS))}; choose from {SECTIONS}")
    try:
        import transformer_engine.pytorch as te
        import transformer_engine_torch as tex
    except Exception as e:  # noqa: BLE001
        print(f"Transformer Engine not importable ({str(e).splitlines()[0][:120]}): TE rows are n/a", flush=True)
        te = tex = None

    if args.smoke:
        TIMING.update(warmup=1, burst=1)
    torch.manual_seed(0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"date": datetime.date.today().isoformat(), "card": torch.cuda.get_device_name(), "versions": versions(tex),
            "quick": args.quick, "smoke": args.smoke, "sections": only, "budget_s": args.budget}
    result = {"meta": meta}
    clock = Clock(args.budget or None, out, result)
    print(meta, flush=True)
    samples = clock.section("dense_samples", lambda: dense_samples(args.smoke, te is not None, 1))
    runs = {"host": lambda: host_rows(args, te), "linear": lambda: linear_rows(args, te),
            "offload": lambda: offload_rows(args, te), "frozen": lambda: frozen_rows(args, te),
            "graphed": lambda: graphed_rows(args, te), "fp8": lambda: fp8_rows(args, te, clock),
            "grouped": lambda: grouped_rows(args, te, clock)}
    for name in SECTIONS:
        result[name] = clock.section(name, runs[name]) if name in only else None
    end = clock.section("dense_samples_end", lambda: dense_samples(args.smoke, te is not None, 2))
    result.pop("dense_samples_end")
    result["dense_samples"] = (samples or []) + (end or [])
    peak = max((s["tflops"] for s in result["dense_samples"] if "tflops" in s), default=float("nan"))
    result["dense_peak_tflops"] = round(peak, 3)  # (to 0.1, a slow CPU's peak was 0.0)
    add_fractions(result, result["dense_peak_tflops"])
    meta["skipped"], meta["errors"] = clock.skipped, clock.errors
    meta["elapsed_s"] = clock.elapsed | {"total": round(time.monotonic() - clock.t0, 1)}
    (out / "results.json").write_text(json.dumps(result, indent=1))
    (out / "results.md").write_text(markdown(result))
    if result.get("grouped"):
        plot(result["grouped"], out / "tflops.png")
    print((out / "results.md").read_text())
    print(f"total {meta['elapsed_s']['total']} s", flush=True)


if __name__ == "__main__":
    main()
