"""Checkpoints of sharded models: ``torch.distributed.checkpoint`` state dicts (FSDP2's DTensors,
:class:`~.sharded.ShardedWeight` groups as DTensors, the layers' FP8 ``_extra_state``), and full
(unsharded, TE-format) state dicts loaded into any sharding.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from .sharded import ShardedWeight

__all__ = ["checkpoint_state_dict", "save_checkpoint", "load_checkpoint", "load_full_state_dict"]


def _as_dtensor(w: ShardedWeight) -> torch.Tensor:
    """``w``'s rows as a ``Shard(0)`` DTensor of the full ``[N, K]`` weight, sharing w's
    memory. ShardedWeight's layout (blocks of ``ceil(N / W)`` rows, the last ranks short or
    empty) is DTensor's ``Shard(0)`` layout (``torch.chunk``'s)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    g = w._dw
    mesh = DeviceMesh.from_group(g.pg or dist.group.WORLD, w.device.type)
    return DTensor.from_local(
        w.detach(), mesh, [Shard(0)], run_check=False, shape=torch.Size((g.N, g.K)), stride=(g.K, 1)
    )


def checkpoint_state_dict(model: torch.nn.Module) -> dict[str, Any]:
    """``model``'s state dict for ``torch.distributed.checkpoint``: FSDP2's sharded parameters
    as they are (DTensors, from ``get_model_state_dict``), each :class:`ShardedWeight` as a
    DTensor over its group sharing its memory, the rest as is, except the ``_extra_state`` of
    ``functional_dw.nn`` layers (TE's format: FP8 delayed scaling's state, or nothing), which
    goes in as ``bytes``: its size changes with the state, and DCP loads an object whole where
    it loads a tensor into one of the size it has. ``dcp.load`` fills the tensors in place
    but only hands the objects back: :func:`load_checkpoint` applies them."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from ..nn_fp8 import FP8Module

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: checkpoints are taken of a torch.nn.Module, got {type(model).__name__}")
    sd = get_model_state_dict(model)
    for name, p in model.named_parameters():
        if isinstance(p, ShardedWeight):
            sd[name] = _as_dtensor(p)
    for key, _m in _fp8_modules(model, FP8Module):
        if isinstance(sd.get(key), torch.Tensor):
            sd[key] = sd[key].cpu().numpy().tobytes()
    return sd


def _fp8_modules(model: torch.nn.Module, cls: type) -> list[tuple[str, Any]]:
    return [(f"{n}._extra_state" if n else "_extra_state", m) for n, m in model.named_modules() if isinstance(m, cls)]


def save_checkpoint(model: torch.nn.Module, checkpoint_id: str | os.PathLike) -> None:
    """``dcp.save`` of :func:`checkpoint_state_dict`: every rank writes its shards."""
    import torch.distributed.checkpoint as dcp

    dcp.save(checkpoint_state_dict(model), checkpoint_id=checkpoint_id)


def load_checkpoint(model: torch.nn.Module, checkpoint_id: str | os.PathLike, *, strict: bool = True) -> Any:
    """Load a :func:`save_checkpoint` checkpoint into ``model``, sharded for any number of
    ranks (or not sharded, without a process group): the parameters in place (``dcp.load``),
    then the layers' FP8 state (``_extra_state``). Returns the missing keys (left as they are)
    and the unexpected ones (ignored), as ``load_state_dict``'s ``_IncompatibleKeys``. With
    ``strict=True`` a missing or unexpected key raises before anything is loaded, as a tensor
    of another shape does: inside ``dcp.load``, so on every rank as DCP's ``CheckpointException``
    (a BaseException) holding the error."""
    import torch.distributed.checkpoint as dcp

    from ..nn_fp8 import FP8Module

    class Planner(dcp.DefaultLoadPlanner):
        # DCP's planner raises on keys the checkpoint lacks but ignores the ones the model
        # lacks: both are checked against the checkpoint's metadata (the same on every rank)
        def create_local_plan(self) -> Any:
            self.incompatible = _incompatible_keys(
                model, self.state_dict, self.metadata.state_dict_metadata, strict, "the checkpoint"
            )
            return super().create_local_plan()

    sd = checkpoint_state_dict(model)
    planner = Planner(allow_partial_load=not strict)
    dcp.load(sd, checkpoint_id=checkpoint_id, planner=planner)
    for key, m in _fp8_modules(model, FP8Module):
        if key in sd and key not in planner.incompatible.missing_keys:
            m.set_extra_state(sd[key])
    return planner.incompatible


def _incompatible_keys(
    model: torch.nn.Module, have: Iterable[str], given: Iterable[str], strict: bool, where: str = "state_dict"
) -> Any:
    """The keys of ``have`` (the model's) not ``given`` and the other way round, as
    ``load_state_dict``'s ``_IncompatibleKeys``; with ``strict``, any raises its RuntimeError."""
    from torch.nn.modules.module import _IncompatibleKeys

    have, given = list(have), list(given)
    have_set, given_set = set(have), set(given)
    out = _IncompatibleKeys([k for k in have if k not in given_set], [k for k in given if k not in have_set])
    if strict and (out.missing_keys or out.unexpected_keys):
        msg = [f"Error(s) in loading state_dict for {type(model).__name__} (nothing was loaded):"]
        for what, keys in (("Missing", out.missing_keys), ("Unexpected", out.unexpected_keys)):
            if keys:
                msg.append(f"\t{what} key(s) in {where}: " + ", ".join(f'"{k}"' for k in keys) + ".")
        raise RuntimeError("\n".join(msg))
    return out


def _misfits(model: torch.nn.Module, sd: dict[str, Any]) -> list[str]:
    """The state dict's entries that do not fit ``model``: a parameter or buffer not of its full
    (unsharded) shape or a meta tensor, an ``_extra_state`` the module cannot decode."""
    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(model.named_buffers(remove_duplicate=False))
    bad = []
    for key, v in sd.items():
        if key in tensors:
            t = tensors[key]
            full = [t._dw.N, t._dw.K] if isinstance(t, ShardedWeight) else list(t.shape)
            if not isinstance(v, torch.Tensor) or list(v.shape) != full:
                got = list(v.shape) if isinstance(v, torch.Tensor) else f"a {type(v).__name__}"
                bad.append(f"{key}: expected full shape {full}, given {got}")
            elif v.is_meta:
                bad.append(f"{key}: a meta tensor, which holds no values")
        elif key == "_extra_state" or key.endswith("._extra_state"):  # decoded as the module will load it
            module = model.get_submodule(key.rpartition(".")[0])
            if hasattr(module, "read_extra_state"):
                try:
                    module.read_extra_state(v)
                except (TypeError, ValueError) as e:
                    bad.append(f"{key}: {e}")
    return bad


def load_full_state_dict(model: torch.nn.Module, state_dict: dict[str, Any], *, strict: bool = True) -> Any:
    """Load a full (unsharded) state dict, the same on every rank (e.g. ``torch.load`` of a
    Transformer Engine ``GroupedLinear``/``Linear`` checkpoint), into ``model``: plain, sharded
    with FSDP2, or holding :class:`ShardedWeight` groups (each rank keeps its rows). Grouped
    layers' keys are converted to each module's layout first (``nn.remap_layouts``: TE's
    ``weight0..`` into ``single_grouped_weight=True`` and back). ``state_dict`` is not changed.

    Before anything is loaded, on every rank alike: the keys are matched with
    ``model.state_dict()``'s (parameters, persistent buffers, ``_extra_state``), and with
    ``strict=True`` a missing or unexpected key raises RuntimeError (as ``load_state_dict``);
    each tensor of a parameter or buffer must have its full (unsharded) shape, else ValueError
    (the key, both shapes). Returns the missing keys (left as they are) and the unexpected ones
    (ignored), as ``load_state_dict``'s ``_IncompatibleKeys``."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from ..nn import remap_layouts

    sd = remap_layouts(model, state_dict)
    # NOTE: these checks read only the state dict and the model's full shapes, the same on every
    # rank: every rank comes to the same verdict with no collective, and a bad state dict raises
    # on every rank before any rank changes a weight (no rank left waiting in a collective).
    incompatible = _incompatible_keys(model, model.state_dict(keep_vars=True), sd, strict)
    for key in incompatible.unexpected_keys:
        del sd[key]
    bad = _misfits(model, sd)
    if bad:
        raise ValueError(
            "load_full_state_dict: entries that do not fit the model (nothing was loaded):\n  " + "\n  ".join(bad)
        )
    for name, p in model.named_parameters(remove_duplicate=False):  # (a tied weight: under each name)
        if isinstance(p, ShardedWeight) and name in sd:
            g, start = p._dw, min(p._dw.rank * p._dw.R, p._dw.N)
            sd[name] = sd[name][start : start + g.rows]
    set_model_state_dict(model, sd, options=StateDictOptions(full_state_dict=True, strict=False))
    return incompatible
