"""Residual records: what a forward keeps for its backward, stated as data.

A residual record is a frozen dataclass registered as a ``torch.utils._pytree`` node.
Fields declared with :func:`saved` are the pytree *children*: activation tensors that the
autograd bridge hands to ``ctx.save_for_backward`` (and so to any saved-tensor hooks).
Every other field is pytree *context*, held by reference: weights (plain or
DistributedWeight), split sizes, dtypes, flags, the kernel backend.

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

__all__ = ["residuals", "saved", "needed", "with_needs", "any_needed", "split", "RecordSpec", "saved_activations"]


# NOTE: [Why weights are context, not leaves]
#   A saved-tensor hook (``save_on_cpu``, Megatron's activation offloading) replaces a saved
#   tensor with whatever its unpack returns: a fresh plain tensor. A DistributedWeight saved
#   that way comes back without its subclass or its ``is_distributed_weight`` marker, and TE's
#   backward then takes the plain-weight branch. Weights are parameters that outlive the graph,
#   so holding them by reference costs nothing, keeps their identity, and keeps them out of
#   the hooks' traffic (an offloading hook would otherwise copy every weight to the host).

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


class RecordSpec:
    """How to rebuild a residual record from its saved fields' values: its other fields, by
    reference, and None where a saved one was (a strong ref to a saved tensor would defeat
    offloading hooks); a saved field that is itself a record (grouped_mlp's fc1 and fc2) by its
    own spec, its values in line. What :func:`split` returns; the bridge keeps it in place of a
    pytree spec (same ``unflatten``) for a record in eager code and under torch.func."""

    __slots__ = ("cls", "shell", "nested")

    def __init__(self, cls: type, shell: dict, nested: dict | None = None) -> None:
        self.cls, self.shell, self.nested = cls, shell, nested  # nested: field -> (its spec, its count)

    def unflatten(self, values: Any, needs: Any = None) -> Any:
        """The record again, with ``values`` in its saved fields and ``needs`` (when given) in
        its :func:`needed` field. Fresh, and checked when forward made it: no frozen
        ``__init__`` (one ``object.__setattr__`` per field) on backward's hot path."""
        record = object.__new__(self.cls)
        fields = record.__dict__
        fields.update(self.shell)
        names = self.cls.__saved_fields__
        if self.nested is None:
            fields.update(zip(names, values))
        else:
            i = 0
            for n in names:
                inner = self.nested.get(n)
                if inner is None:
                    fields[n] = values[i]
                    i += 1
                else:
                    fields[n] = inner[0].unflatten(values[i : i + inner[1]])
                    i += inner[1]
        if needs is not None and self.cls.__needs_field__:
            fields[self.cls.__needs_field__] = needs
        return record

    def refs(self) -> list:
        """What the record holds by reference, nested records' included."""
        out = list(self.shell.values())
        for spec, _ in (self.nested or {}).values():
            out += spec.refs()
        return out


def split(res: Any) -> tuple[list, RecordSpec] | None:
    """A residual record whose saved fields hold tensors, None or records of the same kind as
    (their values, a :class:`RecordSpec`), without a pytree walk; None for anything else: a
    saved field holding a pytree of tensors (whose leaves must be saved), a subclass not itself
    declared a record."""
    names = type(res).__dict__.get("__saved_fields__")
    if names is None:
        return None
    shell = dict(res.__dict__)
    values: list = []
    nested = None
    for n in names:
        v = shell[n]
        shell[n] = None
        if v is None or isinstance(v, torch.Tensor):
            values.append(v)
            continue
        inner = split(v)
        if inner is None:
            return None
        values += inner[0]
        nested = nested or {}
        nested[n] = (inner[1], len(inner[0]))
    return values, RecordSpec(type(res), shell, nested)


def any_needed(needs: Any) -> bool:
    """Whether any leaf of a :func:`needed` (sub)tree is True: a bool, or a sequence of them
    (the usual shapes, read without a pytree walk); anything else through the pytree."""
    if type(needs) is bool:
        return needs
    if needs is None:  # an argument that was None (no bias): nothing to differentiate
        return False
    if isinstance(needs, (list, tuple)) and set(map(type, needs)) <= {bool}:  # (C loops: E experts)
        return any(needs)
    return any(pytree.tree_leaves(needs))


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
    cls.__saved_fields__ = leaves
    cls.__repr__ = _describe  # type: ignore[method-assign]
    _fast_init(cls)
    return cls


def _fast_init(cls: type) -> None:
    """A frozen dataclass's ``__init__`` sets each field with ``object.__setattr__`` (about a
    quarter of a microsecond each; a layer's record has a dozen fields, made on every forward):
    replace it by one that fills the instance dict at once, with the same signature and
    defaults. Dynamo traces the dataclass's own (it cannot trace ``__dict__`` writes). Records
    with a ``default_factory``, ``__post_init__``, keyword-only or non-init fields keep it."""
    fields = dataclasses.fields(cls)
    names = [f.name for f in fields]
    code = cls.__init__.__code__  # (its parameters are exactly the fields: no InitVar)
    if (
        hasattr(cls, "__post_init__")
        or code.co_varnames[1 : code.co_argcount + code.co_kwonlyargcount] != tuple(names)
        or any(f.default_factory is not dataclasses.MISSING or not f.init or f.kw_only for f in fields)
    ):
        return
    scope = {"_fdw_init": cls.__init__, "_fdw_compiling": torch.compiler.is_compiling}
    params = []
    for f in fields:
        if f.default is dataclasses.MISSING:
            params.append(f.name)
        else:
            scope[f"_fdw_default_{f.name}"] = f.default
            params.append(f"{f.name}=_fdw_default_{f.name}")
    source = (
        f"def __init__(self, {', '.join(params)}):\n"
        f"    if _fdw_compiling():\n"
        f"        return _fdw_init(self, {', '.join(names)})\n"
        f"    self.__dict__.update({{{', '.join(f'{n!r}: {n}' for n in names)}}})\n"
    )
    exec(source, scope)  # (as dataclasses itself builds __init__)
    init = scope["__init__"]
    init.__qualname__, init.__wrapped__ = f"{cls.__qualname__}.__init__", cls.__init__
    cls.__init__ = init  # type: ignore[misc]


def saved_activations(res: Any) -> list[torch.Tensor]:
    """The tensors of ``res`` that go through ``save_for_backward`` (and saved-tensor hooks)."""
    return [t for t in pytree.tree_leaves(res) if isinstance(t, torch.Tensor)]


def nbytes(v: Any) -> int:
    """The bytes of every tensor in the pytree ``v``."""
    return sum(t.numel() * t.element_size() for t in pytree.tree_leaves(v) if isinstance(t, torch.Tensor))


def describe_value(v: Any) -> str:
    """One line for a record's field: a tensor's type, shape, dtype and bytes; else its repr."""
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
            return f"{len(v)} x {type(v[0]).__name__}, e.g. {v[0]!r}: {nbytes(v)} B"
        return f"{v!r} {nbytes(v)} B"
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _describe(self: Any) -> str:
    lines = [f"{type(self).__name__}("]
    for f in dataclasses.fields(self):
        tag = "saved" if f.metadata.get(_SAVED) else "ref  "
        lines.append(f"  [{tag}] {f.name} = {describe_value(getattr(self, f.name))}")
    total = nbytes(saved_activations(self))
    lines.append(f")  # {total} B through save_for_backward")
    return "\n".join(lines)
