"""CUDA graph cases that run in a process of their own (tests/test_graphs_gpu.py starts them):
captures that CUDA invalidates (the process may not be fit to go on afterwards), and an NCCL
process group (global state, and a hang must not take the test session with it).

    python tests/support/graphs_subprocess.py save_on_cpu_capture | live_eager_graph | sharded_nccl

Prints one JSON line (``RESULT {...}``) and exits 0 when the case behaved as documented."""

from __future__ import annotations

import gc
import json
import os
import sys

import torch
import torch.nn.functional as F

import functional_dw as fd
from functional_dw.graphs import graph_step

BF16, DEV = torch.bfloat16, "cuda"
E, H, FF = 4, 256, 512
SIZES = [100, 0, 200, 84]
T = sum(SIZES)


def randn(*shape, seed, scale=1.0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.randn(*shape, device=DEV, generator=g) * scale).to(BF16)


def mlp(x, w1, w2, splits):
    return fd.grouped_linear(F.gelu(fd.grouped_linear(x, w1, splits, backend="auto")), w2, splits, backend="auto")


def save_on_cpu_capture() -> dict:
    """torch's save_on_cpu(pin_memory=True) packs into a pinned buffer it allocates per saved
    tensor per step (async copies, no sync) and frees after backward. Under capture either the
    capture fails, or it succeeds with the graph's copies aimed at host blocks the allocator
    has freed: pinned tensors allocated after the capture get them, and a replay writes into
    them. Reports which (ok: one of the two, i.e. not a usable path)."""
    x = randn(T, H, seed=1).requires_grad_()
    w1 = randn(E, FF, H, seed=2, scale=0.05).requires_grad_()
    w2 = randn(E, H, FF, seed=3, scale=0.05).requires_grad_()
    splits = torch.tensor(SIZES, device=DEV)
    dy = randn(T, H, seed=4)
    packed: list[tuple[int, int]] = []  # (host address, bytes) of what save_on_cpu packed

    def step():
        hooks = torch.autograd.graph.save_on_cpu(pin_memory=True)

        def pack(t):
            out = hooks.pack_hook(t)
            packed.append((out[1].data_ptr(), out[1].numel() * out[1].element_size()))
            return out

        with torch.autograd.graph.saved_tensors_hooks(pack, hooks.unpack_hook):
            y = mlp(x, w1, w2, splits)
        torch.autograd.grad(y, [x, w1, w2], dy)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    packed.clear()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            step()
    except Exception as e:  # noqa: BLE001  (what torch raises is the finding)
        return {"ok": True, "captured": False, "raised": type(e).__name__, "message": str(e)[:500]}
    captured = list(packed)
    try:
        probes = [torch.full((n,), 0xAB, dtype=torch.uint8, pin_memory=True) for _, n in captured for _ in range(2)]
        reused = sum(any(p.data_ptr() <= a < p.data_ptr() + p.numel() for p in probes) for a, _ in captured)
        with torch.no_grad():
            x.copy_(randn(T, H, seed=9))
        graph.replay()
        torch.cuda.synchronize()
        overwritten = sum(bool((p != 0xAB).any()) for p in probes)
    except Exception as e:  # noqa: BLE001  (pinned allocation or replay failing after such a capture)
        return {"ok": True, "captured": True, "raised_after_capture": type(e).__name__, "message": str(e)[:500]}
    return {
        "ok": reused > 0 or overwritten > 0,
        "captured": True,
        "packed_at_capture": len(captured),
        "host_blocks_handed_out_again": reused,
        "pinned_tensors_overwritten_by_replay": overwritten,
        "message": "captured; the replay's copies target host memory save_on_cpu freed after the capture"
        if reused or overwritten
        else "captured, and no freed block was handed out again in this probe",
    }


def live_eager_graph() -> dict:
    """An eager step's output kept alive (its graph holds the leaves' gradient accumulators, made
    on the default stream): graph_step's capture fails with CUDA's "legacy stream" error, and
    must say why and leave the process's CUDA RNG working (NOTE: [A failed capture's RNG])."""
    w1 = randn(E, FF, H, seed=2, scale=0.05).requires_grad_()
    w2 = randn(E, H, FF, seed=3, scale=0.05).requires_grad_()
    x, dy, splits = randn(T, H, seed=1), randn(T, H, seed=4), torch.tensor(SIZES, device=DEV)

    def step(x, splits, dy):
        return torch.autograd.grad(mlp(x, w1, w2, splits), [w1, w2], dy)

    kept = mlp(x, w1, w2, splits)  # alive: its grad_fn reaches w1's and w2's accumulators
    out: dict = {}
    try:
        graph_step(step, x, splits, dy)
        out["captured"] = True  # a torch that lets capture wait on the accumulators' stream
    except RuntimeError as e:
        out.update(captured=False, hint="still alive" in str(e), message=str(e)[-300:])
    try:
        out["randn_after"] = bool(torch.randn(4, device=DEV).isfinite().all())
        del kept
        gc.collect()  # (the failed capture's traceback holds a cycle through the step's graph)
        g = graph_step(step, x, splits, dy)  # nothing alive now: captures
        got, want = g(), step(x, splits, dy)
        torch.cuda.synchronize()
        out["replay_equal"] = all(torch.equal(a, b) for a, b in zip(got, want))
    except RuntimeError as e:
        out.update(randn_after=out.get("randn_after", False), replay_equal=False, after=str(e)[-800:])
    out["ok"] = (out["captured"] or out["hint"]) and out["randn_after"] and out["replay_equal"]
    return out


def sharded_nccl() -> dict:
    """ShardedWeight groups on a one-rank NCCL process group: the all-gathers and the
    reduce-scatter are captured and replayed; the Python side (stats) runs at capture only."""
    import torch.distributed as dist

    from functional_dw.distributed import shard_grouped_weights

    loopback = next((n for _, n in __import__("socket").if_nameindex() if n.startswith("lo")), "lo")
    os.environ.setdefault("NCCL_SOCKET_IFNAME", loopback)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device(DEV, 0))
    try:
        fulls1 = [randn(FF, H, seed=10 + e, scale=0.05) for e in range(E)]
        fulls2 = [randn(H, FF, seed=20 + e, scale=0.05) for e in range(E)]
        w1, w2 = shard_grouped_weights(fulls1), shard_grouped_weights(fulls2)
        x, dy = randn(T, H, seed=1).requires_grad_(), randn(T, H, seed=2)
        splits = torch.tensor(SIZES, device=DEV)

        def step(x, splits, dy):
            y = mlp(x, w1, w2, splits)
            return (y.detach(), *torch.autograd.grad(y, [x, *w1, *w2], dy))

        warmup = 3
        g = graph_step(step, x, splits, dy, warmup=warmup)
        stats_after_capture = dict(w1[0]._dw.stats)
        worst = []
        for i, sizes in enumerate([[0, T, 0, 0], [96, 96, 96, 96], SIZES]):
            with torch.no_grad():  # new weights (in place: the graph reads these addresses), tokens, routing
                for e, w in enumerate(w1):
                    w.copy_(randn(FF, H, seed=100 * i + e, scale=0.05))
            xi, dyi, si = randn(T, H, seed=30 + i), randn(T, H, seed=40 + i), torch.tensor(sizes, device=DEV)
            got = [t.clone() for t in g(xi, si, dyi)]
            r1 = shard_grouped_weights([w.detach().clone() for w in w1])  # eager, fresh groups, same values
            r2 = shard_grouped_weights([w.detach().clone() for w in w2])
            xr = xi.clone().requires_grad_()
            yr = mlp(xr, r1, r2, si)
            want = [yr.detach(), *torch.autograd.grad(yr, [xr, *r1, *r2], dyi)]
            worst.append(max((a.double() - b.double()).abs().max().item() for a, b in zip(got, want)))
        ok = (
            max(worst) == 0.0
            and stats_after_capture == {"all_gather": 2 * (warmup + 1), "reduce_scatter": warmup + 1}
            and dict(w1[0]._dw.stats) == stats_after_capture
        )
        return {
            "ok": ok,
            "max_abs_diff_per_replay": worst,
            "stats_after_capture": stats_after_capture,
            "stats_after_replays": dict(w1[0]._dw.stats),
            "nccl": str(torch.cuda.nccl.version()),
        }
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    case = sys.argv[1]
    cases = {
        "save_on_cpu_capture": save_on_cpu_capture,
        "live_eager_graph": live_eager_graph,
        "sharded_nccl": sharded_nccl,
    }
    result = cases[case]()
    result["torch"] = torch.__version__
    print("RESULT " + json.dumps(result), flush=True)
    sys.exit(0 if result["ok"] else 1)
