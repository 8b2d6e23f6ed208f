"""The package's layers under plain FSDP2 (``torch.distributed.fsdp.fully_shard``): one all-gather
and one reduce-scatter per ``functional_dw.nn`` layer (a GroupedMLP is one).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["shard_module"]


def shard_module(model: torch.nn.Module, mesh: Any = None, **fsdp_kwargs: Any) -> torch.nn.Module:
    """Shard ``model`` with FSDP2: ``fully_shard`` on each ``functional_dw.nn`` layer (one
    all-gather and one reduce-scatter per layer, prefetched by FSDP2 one layer ahead), a
    GroupedMLP as one layer (its fc1 and fc2 in one group: it runs them as one node, NOTE: [FSDP2
    over GroupedMLP] in ``nn.py``), then on ``model`` for the rest. Returns ``model`` (FSDP2
    shards in place).

    ``mesh``: a DeviceMesh (1-D: FSDP; 2-D ``(replicate, shard)``: HSDP); default: every rank
    of the default group in one dimension, on the device type of ``model``'s parameters. ``fsdp_kwargs`` go to ``fully_shard`` as they are
    (``reshard_after_forward``, ``mp_policy=MixedPrecisionPolicy(...)``, ``offload_policy``).
    This is plain FSDP2: calling ``fully_shard`` yourself works the same."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from ..nn import GroupedLinear, Linear

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: shard_module takes a torch.nn.Module, got {type(model).__name__}")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "shard_module needs a process group: call torch.distributed.init_process_group "
            "first (torchrun, or functional_dw.distributed.launch)"
        )
    if mesh is None:
        device = next((p.device.type for p in model.parameters()), "cpu")
        mesh = init_device_mesh(device, (dist.get_world_size(),))
    for m in _layers(model, (Linear, GroupedLinear)):
        fully_shard(m, mesh=mesh, **fsdp_kwargs)
    fully_shard(model, mesh=mesh, **fsdp_kwargs)
    return model


def _layers(model: torch.nn.Module, layer_types: tuple[type, ...]) -> list[torch.nn.Module]:
    """The modules below ``model`` that get a ``fully_shard`` of their own: each module that runs
    its layers fused (a GroupedMLP: whole, NOTE: [FSDP2 over GroupedMLP] in ``nn.py``) and each
    layer of ``layer_types`` outside those."""
    fused = [m for m in model.modules() if getattr(m, "_runs_children_fused", False)]
    inside = {c for f in fused for c in f.modules() if c is not f}
    return [
        m for m in model.modules() if m is not model and m not in inside and (m in fused or isinstance(m, layer_types))
    ]
