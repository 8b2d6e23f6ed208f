"""Residual records: what a forward keeps for its backward, stated as data.

A residual record is a frozen dataclass registered as a ``torch.utils._pytree`` node.
Fields declared with :func:`saved` are the pytree *children*: activation tensors that the
autograd bridge hands to ``ctx.save_for_backward`` (and so to any saved-tensor hooks).
Every other field is pytree *context*, held by reference: weights (plain or
DistributedWeight), split sizes, dtypes, flags, the kernel backend.

NOTE: [Why weights are context, not leaves]
  A saved-tensor hook (``save_on_cpu``, Megatron's activation offloading) replaces a saved
  tensor with whatever its unpack returns: a fresh plain tensor. A DistributedWeight saved
  that way comes back without its subclass or its ``is_distributed_weight`` marker, and TE's
  backward then takes the plain-weight branch. Weights are parameters that outlive the graph,
  so holding them by reference costs nothing, keeps their identity, and keeps them out of
  the hooks' traffic (an offloading hook would otherwise copy every weight to the host).

Example::

    @residuals
    class ScaleResiduals:
        x: torch.Tensor = saved()   # goes through save_for_backward
        scale: float                # context, by reference
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

import torch
import torch.utils._pytree as pytree

__all__ = ["residuals", "saved", "needed", "with_needs", "saved_activations"]

_SAVED = "functional_dw.saved"
_NEEDS = "functional_dw.needs"
T = TypeVar("T")


def saved(**kwargs: Any) -> Any:
    """Declare a residual field as a saved activation (a pytree leaf)."""
    return dataclasses.field(metadata={_SAVED: True}, **kwargs)


def needed(**kwargs: Any) -> Any:
    """Declare the field that says which gradients backward computes: a pytree of bools shaped
    like fwd's arguments, or None for all. Context, not saved. The autograd bridge fills it in
    backward from autograd's ``needs_input_grad`` (right under ``torch.func`` too), so a pure
    bwd skips the GEMM of a gradient nobody asked for; a direct ``*_fwd`` call leaves None."""
    return dataclasses.field(default=None, metadata={_NEEDS: True}, **kwargs)


def with_needs(res: T, needs: Any) -> T:
    """``res`` with its :func:`needed` field set to ``needs``."""
    field = type(res).__needs_field__
    if torch.compiler.is_compiling():
        return dataclasses.replace(res, **{field: needs})
    record = object.__new__(type(res))
    record.__dict__.update(res.__dict__)
    record.__dict__[field] = needs
    return record


def residuals(cls: type[T]) -> type[T]:
    """Make ``cls`` a frozen residual record and register it as a pytree node."""
    cls = dataclasses.dataclass(frozen=True, repr=False, eq=False)(cls)
    leaves = tuple(f.name for f in dataclasses.fields(cls) if f.metadata.get(_SAVED))
    static = tuple(f.name for f in dataclasses.fields(cls) if not f.metadata.get(_SAVED))

    def flatten(r: Any) -> tuple[list, tuple]:
        return [getattr(r, n) for n in leaves], tuple(getattr(r, n) for n in static)

    def flatten_with_keys(r: Any) -> tuple[list, tuple]:
        return [(pytree.GetAttrKey(n), getattr(r, n)) for n in leaves], flatten(r)[1]

    def unflatten(values: Any, context: tuple) -> Any:
        if torch.compiler.is_compiling():  # dynamo traces the constructor, not __dict__.update
            return cls(**dict(zip(leaves, values)), **dict(zip(static, context)))
        record = object.__new__(cls)  # the fields were checked when forward made the record:
        record.__dict__.update(zip(leaves, values))  # skip the frozen __init__'s per-field
        record.__dict__.update(zip(static, context))  # object.__setattr__ (backward's hot path)
        return record

    pytree.register_pytree_node(cls, flatten, unflatten, flatten_with_keys_fn=flatten_with_keys)
    cls.__needs_field__ = next((f.name for f in dataclasses.fields(cls) if f.metadata.get(_NEEDS)), None)
    cls.__repr__ = _describe  # type: ignore[method-assign]
    return cls


def saved_activations(res: Any) -> list[torch.Tensor]:
    """The tensors of ``res`` that go through ``save_for_backward`` (and saved-tensor hooks)."""
    return [t for t in pytree.tree_leaves(res) if isinstance(t, torch.Tensor)]


def _nbytes(v: Any) -> int:
    return sum(t.numel() * t.element_size() for t in pytree.tree_leaves(v) if isinstance(t, torch.Tensor))


def _describe_value(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        kind = type(v).__name__
        return f"{kind}{list(v.shape)} {str(v.dtype).removeprefix('torch.')} {v.numel() * v.element_size()} B"
    if isinstance(v, (list, tuple)) and v and all(isinstance(t, torch.Tensor) for t in v):
        shapes = {tuple(t.shape) for t in v}
        shape = list(shapes.pop()) if len(shapes) == 1 else "mixed"
        return f"{len(v)} x {type(v[0]).__name__}{shape} (by reference)"
    nested = pytree.tree_leaves(v) if not isinstance(v, (str, bytes)) else []
    if any(isinstance(t, torch.Tensor) for t in nested):  # a pytree node holding tensors, e.g. a
        # quantized tensor (its repr says the FP8 dtype and scaling), or a list of them (one per expert)
        if isinstance(v, (list, tuple)):
            return f"{len(v)} x {type(v[0]).__name__}, e.g. {v[0]!r}: {_nbytes(v)} B"
        return f"{v!r} {_nbytes(v)} B"
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _describe(self: Any) -> str:
    lines = [f"{type(self).__name__}("]
    for f in dataclasses.fields(self):
        tag = "saved" if f.metadata.get(_SAVED) else "ref  "
        lines.append(f"  [{tag}] {f.name} = {_describe_value(getattr(self, f.name))}")
    total = _nbytes(saved_activations(self))
    lines.append(f")  # {total} B through save_for_backward")
    return "\n".join(lines)
