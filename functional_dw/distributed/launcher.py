"""A local multi-process launcher for tests and examples: :func:`launch` runs a function on
``world_size`` spawned ranks in an initialized process group and returns their results.
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import tempfile
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.utils._pytree as pytree

__all__ = ["launch"]


def _worker(
    rank: int, world: int, backend: str, store: str, timeout: float, queue: Any, fn: Callable, args: tuple
) -> None:
    loopback = next((n for _, n in socket.if_nameindex() if n.startswith("lo")), "lo")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback)  # NOTE: loopback only, never a real NIC
    os.environ.setdefault("NCCL_SOCKET_IFNAME", loopback)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    if backend == "nccl":
        torch.cuda.set_device(rank)
    else:  # W processes share the cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    device = {"device_id": torch.device("cuda", rank)} if backend == "nccl" else {}
    if backend == "nccl" and hasattr(dist, "ProcessGroupNCCL"):
        # NOTE: NCCL's stream at high priority: where the GEMMs hold every SM, a collective's
        # blocks are scheduled as SMs free up instead of after the queued GEMM blocks (overlap)
        opts = dist.ProcessGroupNCCL.Options()
        opts.is_high_priority_stream = True
        device["pg_options"] = opts
    # NOTE: the rendezvous is a file in launch()'s temporary folder, not a TCP port: no race
    # for a "free" port between concurrent launches (pytest-xdist, two suites on one machine)
    dist.init_process_group(
        backend,
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout),
        **device,
    )
    try:
        result = fn(*args)
        result = pytree.tree_map_only(torch.Tensor, lambda t: t.detach().cpu(), result)
        queue.put((rank, pickle.dumps(result)))
        dist.barrier()  # no rank tears down the store while another still uses it
    except BaseException:
        queue.put((rank, traceback.format_exc()))  # in the order the ranks failed
        raise
    finally:
        dist.destroy_process_group()


def launch(
    fn: Callable,
    world_size: int,
    *args: Any,
    backend: str | None = None,
    timeout: float = 60.0,
    deadline: float | None = None,
) -> list:
    """Run ``fn(*args)`` on ``world_size`` local processes (spawned), each inside an initialized
    default process group (rendezvous: a file in a temporary folder, so concurrent launches
    never race for a port; gloo and NCCL talk over loopback); return the ranks' return values, by rank.

    ``backend``: None picks NCCL when there are ``world_size`` GPUs (rank r on ``cuda:r``),
    else gloo. ``fn`` must be importable (module level); its return value is pickled (tensors
    go to the CPU). ``timeout`` (s) bounds every collective; ``deadline`` (s) the whole run.
    If any rank raises, the others are terminated and the error is raised here
    (``torch.multiprocessing.ProcessRaisedException`` with that rank's traceback).
    """
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world_size else "gloo"
    with tempfile.TemporaryDirectory(prefix="fdw-launch-") as tmp:
        return _launch(fn, world_size, args, backend, os.path.join(tmp, "store"), timeout, deadline)


def _launch(
    fn: Callable, world_size: int, args: tuple, backend: str, store: str, timeout: float, deadline: float | None
) -> list:
    queue = mp.get_context("spawn").SimpleQueue()
    ctx = mp.start_processes(
        _worker,
        args=(world_size, backend, store, timeout, queue, fn, args),
        nprocs=world_size,
        join=False,
        start_method="spawn",
    )
    results: dict[int, Any] = {}
    errors: list[tuple[int, str]] = []

    def drain() -> None:
        while not queue.empty():
            rank, item = queue.get()
            if isinstance(item, str):
                errors.append((rank, item))
            else:
                results[rank] = pickle.loads(item)

    end = None if deadline is None else time.monotonic() + deadline
    while True:
        try:
            done = ctx.join(timeout=0.05)  # raises as soon as one rank fails, terminating the others
        except mp.ProcessRaisedException as exc:
            drain()  # NOTE: report the rank that failed first, not the first one spawn noticed
            if not errors:
                raise
            first, tb = errors[0]
            others = ", ".join(str(r) for r, _ in errors[1:]) or "none"
            raise mp.ProcessRaisedException(
                f"\n\n-- rank {first} failed first (then ranks: {others}):\n{tb}", first, ctx.processes[first].pid
            ) from exc
        drain()
        if done:
            break
        if end is not None and time.monotonic() > end:
            for p in ctx.processes:
                p.kill()
                p.join()
            raise TimeoutError(f"launch: {world_size} ranks still running after {deadline} s (killed)")
    return [results.get(r) for r in range(world_size)]
