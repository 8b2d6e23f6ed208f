"""Long-run soak: many forward/backward iterations of a small grouped MLP under an offloading
saved-tensor hook, with ``retain_graph`` (two backwards) on every other step.

The MLP: ``grouped_linear`` with a FakeDW group and a stacked bias -> gelu -> ``grouped_linear``
with one stacked ``[E, out, in]`` weight and fused wgrad accumulation into ``main_grad`` ->
``linear`` with a bias; an SGD step after each iteration; splits redrawn every step (zeros
included), the GEMM path and the splits form alternating. Every tenth step drops its graph
without any backward.

Checked every step: what the hook packed is alive while a retained graph is, and freed once
the graph dies (weakrefs); a DistributedWeight's forward-gathered weights are not kept by the
graph. Checked after a warm-up, at checkpoints: host RSS, the number of live tensors (gc) and,
on CUDA, allocated device memory stay flat.

CI runs ``CI_ITERATIONS`` (1,000, a few seconds). The full 10,000 is marked ``slow`` and runs
when asked for: ``python -m pytest tests/test_soak.py -m slow -s`` (or ``FDW_SOAK_FULL=1``).
"""

from __future__ import annotations

import gc
import os
import resource
import weakref

import pytest
import torch
import torch.nn.functional as F

import functional_dw as fd
from conftest import FakeDW

CI_ITERATIONS, FULL_ITERATIONS = 1_000, 10_000
WARMUP, CHECKPOINTS = 100, 10
RSS_GROWTH_BOUND = 20 * 2**20  # bytes, host
TENSOR_SLACK = 2  # live tensors may differ from the baseline by at most this
OBJECT_SLACK = 50  # the same for all gc-tracked Python objects
DEVICE_GROWTH_BOUND = 2**20  # bytes, CUDA allocated
E, K, H = 8, 32, 64  # experts, model dim, hidden dim
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


# --- measurements --------------------------------------------------------------------------


def rss_bytes() -> int:
    """Current resident set size (Linux), else the peak (which still bounds growth)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def live_objects() -> tuple[int, int]:
    """(live tensors, all gc-tracked objects) after collections until nothing more is freed
    (one is not always enough: e.g. what earlier torch.compile/export tests leave behind is
    freed by a finalizer, and its tensors only by the next collection)."""
    for _ in range(10):
        if not gc.collect():
            break
    objects = gc.get_objects()
    return sum(1 for o in objects if issubclass(type(o), torch.Tensor)), len(objects)  # type(): no __class__ lookups


def device_bytes() -> int:
    return torch.cuda.memory_allocated() if DEVICE.type == "cuda" else 0


def measure() -> dict:
    tensors, objects = live_objects()
    return {"rss": rss_bytes(), "tensors": tensors, "objects": objects, "device": device_bytes()}


# --- the hook and the model ----------------------------------------------------------------


class Offload:
    """Activation offloading: each saved tensor is copied into a fresh host buffer (pinned for
    a CUDA tensor) and copied back on every unpack, so ``retain_graph`` works. Keeps a weakref
    to every host buffer it made (``live``) and counts what it packed."""

    def __init__(self):
        self.live: list[weakref.ref] = []
        self.packed = 0

    def pack(self, t: torch.Tensor):
        host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.is_cuda)
        host.copy_(t)
        self.live.append(weakref.ref(host))
        self.packed += 1
        return host, t.device

    def unpack(self, packed):
        host, device = packed
        return host.to(device, non_blocking=True)

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


class GroupedMLP:
    def __init__(self, seed: int = 0, lr: float = 1e-2):
        g = torch.Generator().manual_seed(seed)
        self.lr = lr
        self.w1 = FakeDW.group_of([(torch.randn(H, K, generator=g) / K**0.5).to(DEVICE) for _ in range(E)])
        self.b1 = torch.zeros(E, H, device=DEVICE, requires_grad=True)
        self.w2 = (torch.randn(E, K, H, generator=g) / H**0.5).to(DEVICE).requires_grad_()
        self.w2.main_grad = torch.zeros(E, K, H, device=DEVICE)
        self.w2.grad_added_to_main_grad = False
        self.w3 = (torch.randn(K, K, generator=g) / K**0.5).to(DEVICE).requires_grad_()
        self.b3 = torch.zeros(K, device=DEVICE, requires_grad=True)

    def forward(self, x, splits, path):
        h = fd.grouped_linear(x, self.w1, splits, self.b1, use_grouped_tensor=path, backend="torch")
        y = fd.grouped_linear(
            F.gelu(h), self.w2, splits, fuse_wgrad_accumulation=True, use_grouped_tensor=path, backend="torch"
        )
        return fd.linear(y, self.w3, self.b3, backend="torch").pow(2).mean()

    @torch.no_grad()
    def update(self):
        for p in (self.b1, self.w3, self.b3):
            if p.grad is not None:
                p -= self.lr * p.grad
                p.grad = None
        self.w2 -= self.lr * self.w2.main_grad
        self.w2.main_grad.zero_()
        self.w2.grad = None
        self.w2.grad_added_to_main_grad = False
        for w in self.w1:
            w.grad = None


def step(model: GroupedMLP, hook: Offload, g: torch.Generator, i: int) -> float | None:
    """One iteration: i odd -> two backwards (retain_graph); i % 10 == 9 -> no backward."""
    sizes = torch.randint(0, 9, (E,), generator=g)
    sizes[torch.randint(0, E, (2,), generator=g)] = 0  # some experts get no tokens
    T = int(sizes.sum())
    x = torch.randn(T, K, generator=g).to(DEVICE)
    splits = sizes.tolist() if i % 3 else sizes.to(DEVICE)
    path = None if i % 2 else False
    leader = model.w1[0]
    with hook.hooks():
        loss = model.forward(x, splits, path)
    gathered = [weakref.ref(t) for t in leader.materialized]
    leader.materialized.clear()  # FakeDW keeps what it gathered for other tests' checks
    assert gathered and all(r() is None for r in gathered), "the graph kept the forward-gathered DW weights"
    assert hook.live and all(r() is not None for r in hook.live)
    value = None
    if i % 10 == 9:
        pass  # the graph dies without a backward
    elif i % 2:
        loss.backward(retain_graph=True)
        assert all(r() is not None for r in hook.live), "a retained graph keeps its saved activations"
        loss.backward()
        value = loss.item()
    else:
        loss.backward()
        value = loss.item()
    del loss
    assert all(r() is None for r in hook.live), "saved activations outlived their graph"
    hook.live.clear()
    leader.materialized.clear()
    model.update()
    return value


def soak(iterations: int) -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small GEMMs: spin-waiting OpenMP threads only add noise
    try:
        model, hook, g = GroupedMLP(), Offload(), torch.Generator().manual_seed(1)
        losses = []
        for i in range(WARMUP):
            step(model, hook, g, i)
        gc.collect()
        base = measure()
        samples = []
        every = max(1, iterations // CHECKPOINTS)
        for i in range(WARMUP, WARMUP + iterations):
            value = step(model, hook, g, i)
            if value is not None:
                losses.append(value)
            if (i - WARMUP + 1) % every == 0:
                samples.append(measure())
    finally:
        torch.set_num_threads(threads)
    leader = model.w1[0]
    return {
        "base": base,
        "samples": samples,
        "losses": losses,
        "calls": leader.calls,
        "packed": hook.packed,
        "total": WARMUP + iterations,
    }


def check(result: dict) -> None:
    base, samples, n = result["base"], result["samples"], result["total"]
    rss = [s["rss"] for s in samples]
    tensors = [s["tensors"] for s in samples]
    objects = [s["objects"] for s in samples]
    device = [s["device"] for s in samples]
    mb = 2**-20
    print(
        f"\nsoak: {n - WARMUP} iterations after {WARMUP} warm-up; RSS {base['rss'] * mb:.1f} MB -> "
        f"{rss[-1] * mb:.1f} MB (max {max(rss) * mb:.1f}); live tensors {base['tensors']} -> {tensors[-1]} "
        f"(range {min(tensors)}..{max(tensors)}); gc objects {base['objects']} -> {objects[-1]} (range "
        f"{min(objects)}..{max(objects)}); device {base['device']} -> {device[-1]} B; "
        f"{result['packed']} tensors offloaded; loss {result['losses'][0]:.4f} -> {result['losses'][-1]:.4f}\n"
        f"RSS at checkpoints (MB): {' '.join(f'{r * mb:.1f}' for r in rss)}"
    )
    assert max(rss) - base["rss"] < RSS_GROWTH_BOUND, f"host RSS grew by {(max(rss) - base['rss']) * mb:.1f} MB"
    assert all(abs(t - base["tensors"]) <= TENSOR_SLACK for t in tensors), (
        f"live tensors {base['tensors']} -> {tensors}"
    )
    assert all(abs(o - base["objects"]) <= OBJECT_SLACK for o in objects), f"gc objects {base['objects']} -> {objects}"
    assert max(device) - base["device"] <= DEVICE_GROWTH_BOUND, f"device memory {base['device']} -> {device}"
    assert all(v == v and abs(v) != float("inf") for v in result["losses"]), "loss went non-finite"
    trained = sum(1 for i in range(n) if i % 10 != 9)
    twice = sum(1 for i in range(n) if i % 10 != 9 and i % 2)
    assert result["calls"] == {"forward": n, "backward": trained + twice, "finalize": trained + twice}


def test_soak_ci():
    check(soak(CI_ITERATIONS))


def _full_requested(config) -> bool:
    markexpr = config.getoption("markexpr", "") or ""
    return os.environ.get("FDW_SOAK_FULL") == "1" or ("slow" in markexpr and "not slow" not in markexpr)


@pytest.mark.slow
def test_soak_full(request):
    if not _full_requested(request.config):
        pytest.skip("10,000 iterations: run with -m slow or FDW_SOAK_FULL=1")
    check(soak(FULL_ITERATIONS))
