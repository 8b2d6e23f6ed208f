"""The bridge's pytree layer (:mod:`functional_dw.custom_vjp`): ``fwd``'s arguments, its output
and its residuals as flat leaves with a spec, the outputs as the Function hands them out, and
``bwd``'s cotangents checked against the arguments' structure. Pure functions of their
arguments; the bridge (``custom_vjp.py``) decides when each runs.

``rules`` below is the bridge's per-pair record; only its ``name`` and ``nondiff`` (the
``nondiff_argnums``) are read, for error messages.
"""

from __future__ import annotations

import itertools
import operator
from typing import Any

import torch
import torch.utils._pytree as pytree

from ._checks import PLAIN_TYPES
from .residuals import split

try:  # see NOTE: [Pytrees]
    import torch.utils._cxx_pytree as fast_pytree
except ImportError:  # optree is not installed
    fast_pytree = pytree

__all__ = [
    "SCALARS",
    "FlatSpec",
    "fast_pytree",
    "flatten_args",
    "flatten_cotangents",
    "flatten_out",
    "fresh_outputs",
    "is_leaf",
    "is_tensor",
    "kept_residuals",
    "output_leaves",
    "pair",
    "residual_sources",
    "tree_of",
    "unflatten_out",
]


# NOTE: [Pytrees]
#   Eager calls and ``torch.func`` flatten with torch's C++ pytree (optree; several times faster
#   than the Python one) when it is installed; compiled code uses the Python one (dynamo traces
#   it). Both read the same registrations (our residual records), and both kinds of spec
#   unflatten themselves (``spec.unflatten``).


def is_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


def tree_of(spec: Any) -> Any:
    """The pytree module that made ``spec`` (see NOTE: [Pytrees]; a flat spec: the fast one)."""
    return pytree if isinstance(spec, pytree.TreeSpec) else fast_pytree


class FlatSpec:
    """The structure of a layer's arguments without a pytree walk: each argument a tensor, a
    scalar or string, None, or a list/tuple of tensors (every layer's arguments), as (kind,
    count) pairs: ``unflatten`` and ``num_leaves`` as a pytree spec has them, and
    :meth:`cotangent_leaves` for bwd's result: several times faster than a pytree spec, C++ or
    Python (torch installs no C++ pytree by default; NOTE: [Pytrees])."""

    __slots__ = ("kinds", "num_leaves")

    def __init__(self, kinds: tuple, num_leaves: int) -> None:
        self.kinds, self.num_leaves = kinds, num_leaves

    @staticmethod
    def flatten(args: tuple) -> tuple[list, "FlatSpec"] | None:
        """(leaves, spec), or None where an argument is anything else (the pytree then)."""
        leaves: list = []
        kinds = []
        for a in args:
            if isinstance(a, torch.Tensor) or type(a) in SCALARS or is_leaf(a):
                leaves.append(a)
                kinds.append(_LEAF)
            elif a is None:
                kinds.append(_NONE)
            elif type(a) in (list, tuple) and (
                set(map(type, a)) <= PLAIN_TYPES or all(isinstance(t, torch.Tensor) for t in a)
            ):
                leaves.extend(a)
                kinds.append((type(a), len(a)))
            else:
                return None
        return leaves, FlatSpec(tuple(kinds), len(leaves))

    def unflatten(self, leaves: Any) -> tuple:
        out, i = [], 0
        for kind in self.kinds:
            if kind is _LEAF:
                out.append(leaves[i])
                i += 1
            elif kind is _NONE:
                out.append(None)
            else:
                cls, n = kind
                out.append(cls(leaves[i : i + n]))
                i += n
        return tuple(out)

    def cotangent_leaves(self, d: Any, rules: Any) -> list:
        """bwd's cotangents (a tuple shaped like the arguments) as leaves: None for a whole list
        (no cotangent for any of it), any cotangent given for an argument that was None ignored
        (nothing to differentiate); a TypeError that names the argument otherwise."""

        def bad(what: str) -> TypeError:
            return TypeError(
                f"custom_vjp({rules.name}): bwd must return one cotangent per {_per(rules)} of fwd, "
                f"shaped like the arguments (None for no gradient), as a tuple; {what}"
            )

        if not isinstance(d, tuple):
            raise bad(f"got {type(d).__name__}")
        if len(d) != len(self.kinds):
            raise bad(f"expected {len(self.kinds)} cotangents, got {len(d)}")
        leaves: list = []
        for i, (kind, v) in enumerate(zip(self.kinds, d)):
            if kind is _LEAF:
                leaves.append(v)
            elif kind is not _NONE:
                cls, n = kind
                if v is None:
                    leaves.extend([None] * n)
                elif isinstance(v, (list, tuple)) and len(v) == n:
                    leaves.extend(v)
                else:
                    got = f"{type(v).__name__} of {len(v)}" if isinstance(v, (list, tuple)) else type(v).__name__
                    raise bad(f"argument {i} is a {cls.__name__} of {n} tensors, its cotangent a {got}")
        return leaves


_LEAF, _NONE = "leaf", "none"
SCALARS = frozenset({int, float, bool, str})


def is_leaf(a: Any) -> bool:
    """A pytree leaf (both pytrees): no registered node, list, dict, namedtuple or structseq."""
    t = type(a)
    if a is None or t in pytree.SUPPORTED_NODES or isinstance(a, (list, dict)):
        return False
    if isinstance(a, tuple):  # a plain tuple subclass is a leaf; a namedtuple or structseq is a node
        return not hasattr(t, "_fields") and not hasattr(t, "n_fields")
    return True


def flatten_args(args: tuple, tree: Any) -> tuple[list, Any]:
    """fwd's differentiable arguments as leaves and a spec: the flat spec where it applies,
    else ``tree``'s (the Python pytree while compiling: dynamo traces it)."""
    if tree is fast_pytree:
        flat = FlatSpec.flatten(args)
        if flat is not None:
            return flat
    return tree.tree_flatten(args)


def pair(result: Any, name: str) -> tuple[Any, Any]:
    """``fwd``'s result, checked against the contract ``fwd(*args) -> (out, residuals)``."""
    if not isinstance(result, tuple) or len(result) != 2:
        got = f"a tuple of {len(result)}" if isinstance(result, tuple) else type(result).__name__
        if isinstance(result, torch.Tensor):
            got = f"a bare Tensor of shape {tuple(result.shape)}"
        raise TypeError(
            f"custom_vjp({name}): fwd must return a pair (out, residuals), e.g. `return y, (x,)`; got {got}"
        )
    return result


def flatten_out(out: Any, tree: Any, name: str) -> tuple[tuple, Any]:
    """fwd's output as tensor leaves and a spec; one tensor (every layer here) needs no pytree:
    spec None stands for it."""
    if is_tensor(out):
        return (out,), None
    leaves, spec = tree.tree_flatten(out)
    if not all(is_tensor(t) for t in leaves):
        i, bad = next((i, t) for i, t in enumerate(leaves) if not is_tensor(t))
        raise TypeError(
            f"custom_vjp({name}): fwd's output must be tensors; got {spec}: output leaf {i} is "
            f"{str(bad)[:40]} ({type(bad).__name__}) (return other values through the residuals)"
        )
    return tuple(leaves), spec


def unflatten_out(leaves: Any, spec: Any) -> Any:
    return leaves[0] if spec is None else spec.unflatten(leaves)


def output_leaves(out: Any, spec: Any) -> list:
    """``out`` (an output, its tangent or its vmap dims) flattened along the output's spec."""
    return [out] if spec is None else spec.flatten_up_to(out)


def residual_sources(
    res: Any, in_leaves: tuple, tree: Any, out_leaves: tuple = ()
) -> tuple[list, list[torch.Tensor], Any]:
    """How each residual leaf is kept: ("in", i) an input, ("y", j) fwd's output j (saved as
    that output: returned again as a non-differentiable extra output, the same tensor object,
    it would make the output itself non-differentiable), ("out", j) an intermediate (saved
    and returned as extra output j, see NOTE: [What goes where]), ("ref", obj) by reference.
    A residual record splits itself (no pytree walk), except in a traced graph."""
    parts = None if torch.compiler.is_compiling() else split(res)
    leaves, spec = parts if parts is not None else tree.tree_flatten(res)
    sources, extra = [], []
    for leaf in leaves:
        if not is_tensor(leaf):
            sources.append(("ref", leaf))
            continue
        for i, t in enumerate(in_leaves):
            if t is leaf:
                sources.append(("in", i))
                break
        else:
            for j, t in enumerate(out_leaves):
                if t is leaf:
                    sources.append(("y", j))
                    break
            else:
                sources.append(("out", len(extra)))
                # NOTE: [Closed-over tensors] A residual fwd did not make (it closed over a
                # Parameter or a non-leaf: fwd runs under no_grad, so only such a tensor requires
                # grad) is saved as a constant: a detached alias, because autograd detaches a
                # non-differentiable output in place, which would freeze the caller's Parameter
                # or cut its non-leaf from the graph.
                extra.append(leaf.detach() if leaf.requires_grad else leaf)
    return sources, extra, spec


def kept_residuals(res: Any, in_leaves: tuple, out_leaves: tuple, outs: tuple) -> tuple[list, list, Any]:
    """How an eager old-style forward keeps the residuals (NOTE: [The lean run] in
    ``custom_vjp.py``): (sources, the tensors to save, spec), each source ("saved", None) or
    ("ref", obj), as :func:`residual_sources` has them. An input is saved as the input and fwd's
    output ``out_leaves[j]`` as the output handed out, ``outs[j]`` (both keep their graph for a
    double backward); any other tensor that requires grad (one fwd closed over) is saved
    detached (NOTE: [Closed-over tensors])."""
    parts = split(res)
    leaves, spec = parts if parts is not None else fast_pytree.tree_flatten(res)
    sources, saved = [], []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            sources.append(_SAVED)
            if not any(map(operator.is_, itertools.repeat(leaf), in_leaves)):  # (an input: as it is)
                j = next((j for j, o in enumerate(out_leaves) if o is leaf), None)
                if j is not None:
                    leaf = outs[j]
                elif leaf.requires_grad:
                    leaf = leaf.detach()
            saved.append(leaf)
        else:
            sources.append(("ref", leaf))
    return sources, saved, spec


_SAVED = ("saved", None)


# NOTE: [Outputs are new tensors] autograd attaches the node to each output tensor object in
# place. An output fwd made is handed out as ``detach()`` (the same storage, no copy, not a
# view), so that (1) a tensor fwd closed over and returned (a Parameter, a buffer, a
# non-leaf) is never turned into this node's output behind the caller's back (see NOTE:
# [Closed-over tensors]), and (2) a view of a tensor fwd made (e.g. Linear's ``[T, N] ->
# [B, S, N]`` reshape) does not reach the caller as "a view created in a custom Function",
# which autograd forbids modifying in place (``y += r``, an in-place activation, FSDP2
# hooks). A view of an input keeps torch's rule (its base is the caller's tensor), and so do
# outputs that share storage with each other (``(y, y[0])``): detached, an in-place change
# to one would reach the other's value but not its gradient. (``_base``, not ``_is_view()``:
# dynamo traces the one, not the other.)
def fresh_outputs(out_leaves: tuple, in_leaves: tuple) -> tuple:
    """fwd's outputs as the Function hands them out.

    An input returned as an output becomes a view of it (``view_as``), as torch asks of a
    setup_context Function that also saves that input.

    An output fwd made is handed out as ``detach()`` (NOTE: [Outputs are new tensors])."""
    if len(out_leaves) == 1 and out_leaves[0]._base is None:  # the common case: one tensor
        o = out_leaves[0]
        return (o.view_as(o) if any(map(operator.is_, itertools.repeat(o), in_leaves)) else o.detach(),)
    roots: dict[int, torch.Tensor] = {}  # id(a storage-sharing group's root) -> its detached alias
    return tuple(_fresh(o, in_leaves, out_leaves, roots) for o in out_leaves)


def _fresh(o: torch.Tensor, in_leaves: tuple, out_leaves: tuple, roots: dict) -> torch.Tensor:
    if any(o is t for t in in_leaves):
        return o.view_as(o)
    base = o._base
    if base is not None and any(is_tensor(t) and (base is t or base is t._base) for t in in_leaves):
        return o
    root = o if base is None else base
    if not any(p is not o and (p is root or p._base is root) for p in out_leaves):
        return o.detach()
    # Outputs that share storage (``(y, y[0])``, or a closed-over W with a view of it) keep
    # torch's view rule among themselves, around a detached alias of their root (the root
    # itself may be the caller's tensor: NOTE: [Closed-over tensors]). (Compiled: as they
    # are; dynamo cannot trace storage_offset() on CUDA, and a traced graph has functional
    # outputs anyway.)
    if torch.compiler.is_compiling():
        return o
    alias = roots.get(id(root))
    if alias is None:
        alias = roots[id(root)] = root.detach()
    return alias if o is root else alias.as_strided(o.size(), o.stride(), o.storage_offset())


def _cotangent_leaves(d: Any, spec: pytree.TreeSpec, name: str, per: str = "argument") -> list:
    """Flatten ``d`` along ``spec``; ``None`` stands for "no cotangent" for a whole subtree."""
    if d is None:
        return [None] * spec.num_leaves
    if spec.is_leaf():
        return [d]
    node = pytree.SUPPORTED_NODES.get(spec.type)
    children = node.flatten_fn(d)[0] if node is not None and isinstance(d, spec.type) else None
    specs = spec.children() if hasattr(spec, "children") else spec.children_specs  # torch >= 2.13
    if children is None or len(children) != len(specs):
        raise TypeError(
            f"custom_vjp({name}): bwd must return one cotangent per {per} of fwd, shaped like "
            f"the arguments (None for no gradient); expected {spec}, got {pytree.tree_structure(d)}"
        )
    return [leaf for c, s in zip(children, specs) for leaf in _cotangent_leaves(c, s, name, per)]


def _per(rules: Any) -> str:
    """What bwd returns a cotangent for, in an error message."""
    return "argument" if not rules.nondiff else f"differentiable argument (nondiff_argnums={rules.nondiff} excluded)"


def flatten_cotangents(d: Any, spec: Any, rules: Any) -> list:
    """bwd's cotangents as leaves along ``spec``. A pytree spec: fast path when ``d`` has the
    arguments' full structure, else None allowed for a subtree."""
    if isinstance(spec, FlatSpec):
        return spec.cotangent_leaves(d, rules)
    try:
        return spec.flatten_up_to(d)
    except (ValueError, TypeError, RuntimeError):
        if tree_of(spec) is not pytree:  # redo the structure with the Python pytree
            spec = pytree.tree_structure(fast_pytree.tree_unflatten([0] * spec.num_leaves, spec))
        return _cotangent_leaves(d, spec, rules.name, _per(rules))
