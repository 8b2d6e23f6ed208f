"""The DistributedWeight protocol of Transformer Engine 2.20, and the weight bookkeeping
both layers share: materialize, gradient targets (``main_grad``), finalize, version checks.

A DistributedWeight is a ``torch.Tensor`` subclass holding a shard, with
``is_distributed_weight = True`` and::

    materialize_group_for_forward()   -> full weight(s) for the fprop GEMM (tensor or list)
    materialize_group_for_backward()  -> full weight(s) for the dgrad GEMM (tensor or list)
    finalize_group_grads(wgrads)      -> the parameter grad(s): shard-shaped, dummies or None
    grad_buffer()                     -> gathered-shape buffer the fused wgrad GEMM writes into

For a group (GroupedLinear) the leader ``weights[0]`` acts for all; the followers are ignored.
A DW from TE's tests or Megatron works unchanged: only these names are used.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["DistributedWeight", "is_distributed_weight"]


@runtime_checkable
class DistributedWeight(Protocol):
    is_distributed_weight: bool

    def materialize_group_for_forward(self) -> torch.Tensor | list[torch.Tensor]: ...
    def materialize_group_for_backward(self, **kwargs: Any) -> torch.Tensor | list[torch.Tensor]: ...
    def finalize_group_grads(self, wgrads: Any) -> Any: ...
    def grad_buffer(self) -> torch.Tensor: ...


def unwrap(w: Any) -> Any:
    """The object under functorch's wrappers: ``torch.func.jvp`` (unlike ``grad``) hands the
    function a wrapper that hides a DistributedWeight's subclass and methods."""
    while isinstance(w, torch.Tensor) and torch._C._functorch.is_functorch_wrapped_tensor(w):
        w = torch._C._functorch.get_unwrapped(w)
    return w


def is_distributed_weight(w: Any) -> bool:
    """True for an object that declares ``is_distributed_weight``; it must be a tensor."""
    if not torch.compiler.is_compiling() and isinstance(w, torch.Tensor) and torch._C._functorch.is_functorch_wrapped_tensor(w):
        w = unwrap(w)
    if not getattr(w, "is_distributed_weight", False):
        return False
    if not isinstance(w, torch.Tensor):
        raise TypeError(
            f"weight: a DistributedWeight must be a torch.Tensor subclass, got {type(w).__name__}"
        )
    return True


def _as_list(x: Any) -> list:
    return list(x) if isinstance(x, (list, tuple)) else [x]


def materialize(params: Sequence[torch.Tensor], dw: bool, *, for_backward: bool) -> list[torch.Tensor]:
    """The weights the GEMMs use: ``params`` themselves, or what the DW leader gathers."""
    if not dw:
        return list(params)
    leader = params[0] if torch.compiler.is_compiling() else unwrap(params[0])
    full = leader.materialize_group_for_backward() if for_backward else leader.materialize_group_for_forward()
    full = _as_list(full)
    if len(full) != len(params):
        phase = "backward" if for_backward else "forward"
        raise ValueError(
            f"weights: materialize_group_for_{phase}() of the DistributedWeight leader returned "
            f"{len(full)} tensor(s) for a group of {len(params)}; it must return one per weight"
        )
    return full


def check_materialized(full: Sequence[torch.Tensor], shapes: Sequence[tuple], what: str) -> None:
    """Raise if a materialized weight does not have the shape the forward used."""
    for e, (w, shape) in enumerate(zip(full, shapes)):
        if not isinstance(w, torch.Tensor) or tuple(w.shape) != tuple(shape):
            got = tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__
            raise ValueError(f"weights: {what} returned {got} for weight {e}, expected {tuple(shape)}")


def grad_targets(params: Sequence[torch.Tensor], dw: bool, shapes: Sequence[tuple], name: str) -> list[torch.Tensor]:
    """Where the fused wgrad GEMM writes: ``grad_buffer()`` (DW), ``get_main_grad()``
    (Megatron FSDP) or ``main_grad``; each must have the gathered weight's shape."""
    out = []
    for e, (p, shape) in enumerate(zip(params, shapes)):
        where = name if len(params) == 1 else f"{name}[{e}]"
        if dw:
            buf = p.grad_buffer()
        elif hasattr(p, "__fsdp_param__") and hasattr(p, "get_main_grad"):
            buf = p.get_main_grad()
        else:
            buf = getattr(p, "main_grad", None)
            if buf is None:
                raise ValueError(
                    f"{where}: fuse_wgrad_accumulation=True needs a `main_grad` buffer on the "
                    "weight (e.g. `w.main_grad = torch.zeros_like(w, dtype=torch.float32)`)"
                )
            p.main_grad = buf  # TE writes it back; harmless for a plain attribute
        if not isinstance(buf, torch.Tensor) or tuple(buf.shape) != tuple(shape):  # any strides (kernels copy if they must)
            got = tuple(buf.shape) if isinstance(buf, torch.Tensor) else type(buf).__name__
            raise ValueError(f"{where}: main_grad/grad_buffer() must be a {tuple(shape)} tensor, got {got}")
        out.append(buf)
    return out


def accumulates(params: Sequence[torch.Tensor], dw: bool) -> bool:
    """TE's rule: a DW's finalize does the accumulation; ``overwrite_main_grad`` overwrites."""
    return not dw and not getattr(params[0], "overwrite_main_grad", False)


def finalize(params: Sequence[torch.Tensor], dw: bool, fused: bool, wgrads: list[Any]) -> list[Any]:
    """The grads autograd receives for ``params``.

    DW: whatever ``finalize_group_grads`` returns (a bare tensor for a group of one).
    Fused plain weights: ``None``, or a zero dummy when the weight has
    ``grad_added_to_main_grad`` (Megatron DDP), which is then set to True.
    """
    if dw:
        got = params[0].finalize_group_grads(wgrads[0] if len(wgrads) == 1 else list(wgrads))
        if got is None:
            return [None] * len(params)
        got = _as_list(got)
        if len(got) != len(params):
            raise ValueError(
                f"weights: finalize_group_grads returned {len(got)} grad(s) for {len(params)} weights"
            )
        return got
    if not fused:
        return wgrads
    grads: list[Any] = []
    for p in params:
        if hasattr(p, "grad_added_to_main_grad"):
            p.grad_added_to_main_grad = True
            grads.append(torch.zeros_like(p))
        else:
            grads.append(None)
    return grads


def versions(params: Sequence[torch.Tensor]) -> tuple[int, ...]:
    # NOTE: under torch.compile a traced graph has no version counters to read (and the
    # compiled graph owns its inputs): the check is eager-only.
    return () if torch.compiler.is_compiling() else tuple(p._version for p in params)


def check_versions(params: Sequence[torch.Tensor], recorded: tuple[int, ...], name: str) -> None:
    """The check autograd's version counter would have done had the weights been saved."""
    for e, (p, v) in enumerate(zip(params, recorded)):
        if p._version != v:
            where = name if len(params) == 1 else f"{name}[{e}]"
            raise RuntimeError(
                f"{where} was modified in place between forward and backward (version {v} -> "
                f"{p._version}), e.g. by an optimizer step. Its gradient would be computed with the "
                "new values; run backward before updating the weights."
            )
