"""bench.py's clocks: the device, how a step is timed, what the run ran on, and the section clock.

* ``DEV`` (the device every section runs on; tests/support/bench_mock.py sets it to "cpu"), ``BF16``,
  ``TIMING`` (warm-up steps and burst length; ``--smoke`` lowers them);
* :func:`cuda_times` (CUDA events around bursts of back-to-back steps, implementations
  interleaved, median of repeats), :func:`backward_times` (backward alone), :func:`host_times`
  (host microseconds to issue a step, and wall microseconds with the GPU), :func:`ms_tflops` (a
  time as the ``{"ms", "tflops"}`` record every section stores);
* :func:`versions` (torch, CUDA, TE, cuBLASLt) and :func:`dense_samples` (dense bf16 GEMMs: the
  peak the fractions of peak divide by);
* :class:`Clock`: seconds per section, the ``--budget``, and ``partial.json`` after each section.
"""

from __future__ import annotations

import ctypes
import json
import statistics
import time
import traceback

import torch

BF16 = torch.bfloat16
DEV = "cuda"  # read as bench_timing.DEV at call time, so setting it here reaches every section


# --- timers --------------------------------------------------------------------------------


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
        for name in names[r % len(names) :] + names[: r % len(names)]:
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
        start, end = (
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if timed else (None, None)
        )
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
        for name in names[r % len(names) :] + names[: r % len(names)]:
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


def ms_tflops(flops, ms):
    """ms and TFLOP/s; no TFLOP/s for a time that is not positive (the readers print a dash)."""
    return {"ms": round(ms, 4)} | ({"tflops": round(flops / ms / 1e9, 1)} if ms > 0 else {})


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
    """torch, CUDA, TE and cuBLASLt versions (cuBLASLt as TE reports it and as loaded in this process)."""
    out = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "te": _te_version() if tex is not None else None,
        "cublaslt_te": tex.get_cublasLt_version() if tex is not None else None,
    }
    if torch.cuda.is_available():  # a GEMM on CUDA loads cuBLAS(Lt), whatever device the run times
        torch.zeros(8, 8, device="cuda", dtype=BF16) @ torch.zeros(8, 8, device="cuda", dtype=BF16)
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
        shapes += [
            ("torch mm TN", 16384, 16384, 16384),
            ("torch mm TN", 8192, 4096, 4096),
            ("torch mm NN", 8192, 4096, 4096),
            ("torch mm NT", 4096, 4096, 8192),
        ]
    if have_te:
        shapes += [("te gemm TN", n, n, n)] + ([] if smoke else [("te gemm TN", 8192, 4096, 4096)])
    out = []
    for name, M, N, K in shapes:  # out [M, N] from a [M, K] and b [N, K] (TN) / [K, N] (NN); NT: a^T [K, M]
        try:
            a = (
                torch.randn(K, M, device=DEV, dtype=BF16)
                if name.endswith("NT")
                else torch.randn(M, K, device=DEV, dtype=BF16)
            )
            b = (
                torch.randn(K, N, device=DEV, dtype=BF16)
                if name.endswith(("NN", "NT"))
                else torch.randn(N, K, device=DEV, dtype=BF16)
            )
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
            out.append(
                {
                    "gemm": name,
                    "M": M,
                    "N": N,
                    "K": K,
                    "round": round_,
                    "ms": round(ms, 4),
                    "tflops": round(2 * M * N * K / ms / 1e9, 1),
                }
            )
        except Exception as e:  # noqa: BLE001
            out.append({"gemm": name, "M": M, "N": N, "K": K, "round": round_, "error": str(e).splitlines()[0][:120]})
        finally:
            a = b = None
    return out


# --- the section clock -----------------------------------------------------------------------


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

    def total(self) -> float:
        """Seconds since the run started."""
        return round(time.monotonic() - self.t0, 1)

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
