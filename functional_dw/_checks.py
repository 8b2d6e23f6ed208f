"""Input checks shared by the layers: each error names the argument and the fix."""

from __future__ import annotations

import contextlib
import contextvars
import operator
import os
import sys
import warnings
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake

PLAIN_TYPES = frozenset({torch.Tensor, torch.nn.Parameter})  # no subclass: attributes read in C loops mean the same
_INT = frozenset({int})
_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def bottom(t: Any) -> Any:
    """``t`` under all its functorch wrappers (grad, jvp and vmap levels): the tensor a
    layer's forward ran on (custom_vjp's NOTE: [Context per level]), whose version counter
    in-place changes bump, and whose subclass and methods (a DistributedWeight's) a wrapper
    hides. Anything else as it is."""
    while isinstance(t, torch.Tensor) and torch._C._functorch.is_functorch_wrapped_tensor(t):
        t = torch._C._functorch.get_unwrapped(t)
    return t


def tensor(name: str, t: Any, ndim: int | tuple[int, ...] | None = None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.is_nested:  # (a strided nested tensor has layout strided, and no .shape to report)
        raise TypeError(
            f"{name} must be a dense (strided) tensor, got a nested tensor; call .to_padded_tensor() or .unbind() first"
        )
    if t.layout != torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {t.layout}; call .to_dense() first")
    if t.dtype not in _FLOATS:
        raise TypeError(f"{name} must be float32, bfloat16, float16 or float64, got {t.dtype}")
    dims = (ndim,) if isinstance(ndim, int) else ndim
    if dims is not None and t.dim() not in dims:
        want = " or ".join(f"{d}-D" for d in dims)
        raise ValueError(f"{name} must be {want}, got shape {tuple(t.shape)}")
    return t


def like(name: str, t: torch.Tensor, x: torch.Tensor) -> None:
    """``t`` must share ``x``'s dtype and device (no silent casts or copies)."""
    if t.dtype != x.dtype:
        raise TypeError(f"{name} has dtype {t.dtype} but x has {x.dtype}; cast one of them")
    if t.device != x.device:
        raise ValueError(f"{name} is on {t.device} but x is on {x.device}; move them to one device")


def shape(name: str, t: torch.Tensor, expected: Sequence[int]) -> None:
    if tuple(t.shape) != tuple(expected):
        raise ValueError(f"{name} must have shape {tuple(expected)}, got {tuple(t.shape)}")


def flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def fuse_flag(value: Any) -> bool:
    """``fuse_wgrad_accumulation``: a bool, and False under torch.func, whose transforms return
    gradients and cannot follow a write into ``main_grad``."""
    if (
        flag("fuse_wgrad_accumulation", value)
        and not torch.compiler.is_compiling()
        and torch._C._functorch.peek_interpreter_stack() is not None
    ):
        raise ValueError(
            "fuse_wgrad_accumulation=True writes weight grads into main_grad in place, which "
            "torch.func transforms cannot follow: pass False under torch.func (the grads are returned)"
        )
    return value


def dense(t: torch.Tensor, shape: Sequence[int] | None = None) -> torch.Tensor:
    """``t`` contiguous (and reshaped to ``shape``). An empty tensor may keep odd strides
    through ``.contiguous()``, which grouped GEMMs reject: it gets fresh storage instead."""
    if t.numel() == 0:
        shape = tuple(t.shape) if shape is None else tuple(shape)
        return t if tuple(t.shape) == shape and t.stride() == _row_major(shape) else t.new_empty(shape)
    if shape is None or tuple(t.shape) == tuple(shape):
        return t.contiguous()
    return t.reshape(shape).contiguous()


def _row_major(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def sequence(v: Any) -> list | None:
    """``v`` as a list when it is an ordered sequence of items (list, tuple, ``nn.ParameterList``,
    a 1-D numpy array: sized and indexable), else None. Sets (no order), mappings and
    ``ParameterDict`` (keys, not items), tensors and strings are not sequences here."""
    if isinstance(v, (list, tuple)):
        return list(v)
    if (
        isinstance(v, (torch.Tensor, str, bytes))
        or hasattr(v, "keys")
        or not hasattr(v, "__len__")
        or not hasattr(v, "__getitem__")
    ):
        return None
    return list(v)


def count(name: str, v: Any) -> int:
    """A Python int from an int-like element (int, numpy integer); bools, floats and tensors are
    refused with their position, e.g. ``splits[1] is 1.5 (float)``. (An int is returned as it
    is: under torch.compile it may be symbolic, and ``operator.index`` would specialize it.)"""
    if type(v) is int:
        return v
    if isinstance(v, torch.Tensor):
        raise TypeError(f"{name} is a tensor ({v}); give ints, or the counts as one 1-D integer tensor")
    if isinstance(v, bool):
        raise TypeError(f"{name} is {v} (bool); each count must be an int")
    try:
        return operator.index(v)
    except TypeError:
        raise TypeError(f"{name} is {v!r} ({type(v).__name__}); each count must be an int") from None


def counts(name: str, items: Sequence[Any]) -> tuple[int, ...]:
    """:func:`count` for each item, as a tuple; plain ints (the usual case) in one pass, and an
    error names the position, e.g. ``splits[1] is 1.5 (float)``."""
    if set(map(type, items)) <= _INT:  # (C loops: E experts)
        return tuple(items)
    return tuple(count(f"{name}[{e}]", v) for e, v in enumerate(items))


def cotangent(name: str, d: Any, shape: Sequence[int], like: torch.Tensor) -> torch.Tensor:
    """A bwd's incoming gradient: a dense float tensor of the output's shape, dtype and device."""

    def want() -> str:  # built only for an error (shapes may be symbolic under torch.compile)
        return (
            f"{name} must be a [{', '.join(map(str, shape))}] {str(like.dtype).removeprefix('torch.')} "
            "tensor (the output's shape and dtype)"
        )

    if not isinstance(d, torch.Tensor):
        raise TypeError(f"{want()}, got {type(d).__name__}")
    if tuple(d.shape) != tuple(shape):
        raise ValueError(f"{want()}, got shape {tuple(d.shape)}")
    if d.dtype != like.dtype:
        raise TypeError(f"{want()}, got dtype {d.dtype}")
    if d.device != like.device:
        raise ValueError(f"{name} is on {d.device} but the layer ran on {like.device}; move it there")
    if not torch.compiler.is_compiling() and d.layout != torch.strided:  # (a traced backward may not ask)
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {d.layout}")
    return d


def record(fn: str, res: Any, cls: type, made_by: str) -> None:
    """``res`` is the residual record ``fn`` takes (TypeError naming both otherwise)."""
    if not isinstance(res, cls):
        raise TypeError(f"{fn} takes the {cls.__name__} that {made_by} returned, got {type(res).__name__}")


# --- version stamps: the check autograd's version counter does for saved tensors -----------

Stamp = Any  # (weakref to the tensor, its version), or None where no check is possible


def stamp(t: torch.Tensor) -> Stamp:
    """Remember ``t``'s version. None under torch.compile (no version counters in a traced graph)
    and for inference tensors (they have none)."""
    if torch.compiler.is_compiling() or t.is_inference():
        return None
    return weakref.ref(t), t._version


def check_stamp(name: str, t: torch.Tensor, st: Stamp) -> None:
    """Raise if ``t`` is the very tensor stamped and changed in place since. A tensor that came
    back through a saved-tensor hook is a new object: autograd checked the original already."""
    if st is not None and st[0]() is t and t._version != st[1]:
        raise RuntimeError(
            f"{name} was modified in place between forward and backward (version {st[1]} -> "
            f"{t._version}); its gradient would be computed with the new values"
        )


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """Warn at the first frame outside functional_dw and torch: the caller's line."""
    if torch.compiler.is_compiling():  # dynamo cannot trace warnings.warn; the path taken is
        return  # recorded on the residuals, and an eager call warns
    level, frame = 2, sys._getframe(1)  # stacklevel 2 is warn's caller
    while frame is not None and frame.f_code.co_filename.startswith(_INTERNAL):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


_INTERNAL = (os.path.dirname(__file__) + os.sep, os.path.dirname(torch.__file__) + os.sep)


def values_free(t: torch.Tensor) -> bool:
    """Whether ``t``'s values can be read for free, to check them: a CPU tensor in eager code (on
    CUDA reading them is a host sync; meta and fake tensors, and tensors being compiled, hold none)."""
    return t.device.type == "cpu" and not torch.compiler.is_compiling() and not is_fake(t)


def live(t: torch.Tensor) -> torch.Tensor:
    """``t`` without the torch.func wrappers of exited levels around it (NOTE: [A transform's
    dead level] in ``_steps.py``): what a Function applied now may take as an input."""
    while torch._C._functorch.is_functorch_wrapped_tensor(t) and torch._C._functorch.is_dead_tensor_wrapper(t):
        t = torch._C._functorch.unwrap_if_dead(t)
    return t


def tracked(t: torch.Tensor) -> bool:
    """Whether autograd records ops on ``t`` at any level: a live torch.func grad level's wrapper
    of it, or the tensor under every wrapper, requires grad."""
    func = torch._C._functorch
    while func.is_functorch_wrapped_tensor(t):
        if func.is_dead_tensor_wrapper(t):
            t = func.unwrap_if_dead(t)
            continue
        if func.is_gradtrackingtensor(t) and t.requires_grad:
            return True
        t = func.get_unwrapped(t)
    return t.requires_grad


_TRANSFORMS_BACKWARD: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "functional_dw_transforms_backward", default=False
)


def transforms_backward() -> bool:
    """Whether the backward running now is a torch.func transform's where nothing else shows it:
    a vmap rule's per-element run (the interpreter stack is lowered there), a composite's layers
    at a vjp_fn's dead level. Its ``create_graph=True`` is then not autograd's own (NOTE: [A
    transform's dead level] in ``_steps.py``). Only for the autograd node that was running when
    the context was entered: a ``torch.autograd.grad`` inside it (a user's bwd) is autograd's own."""
    got = _TRANSFORMS_BACKWARD.get()
    return got is not False and got[0] is torch._C._current_autograd_node()


def transforms_outside() -> bool:
    """Within :func:`transforms_backward`: whether live grad or jvp levels the stack no longer
    shows are outside it (a vjp_fn's backward run per element inside a grad: they may
    differentiate it through tensors that carry no graph, as an FP8 copy of x)."""
    return transforms_backward() and _TRANSFORMS_BACKWARD.get()[1]


@contextlib.contextmanager
def in_transforms_backward(outside: bool = False) -> Any:
    """Context for :func:`transforms_backward` and :func:`transforms_outside` (per thread and
    task: a ContextVar), bound to the autograd node running now."""
    token = _TRANSFORMS_BACKWARD.set((torch._C._current_autograd_node(), outside))
    try:
        yield
    finally:
        _TRANSFORMS_BACKWARD.reset(token)


def has_dead_wrapper(t: torch.Tensor) -> bool:
    """Whether a torch.func wrapper of an exited level wraps ``t`` (or is ``t``): a backward run
    by ``torch.func.vjp``'s vjp_fn after vjp returned (NOTE: [A transform's dead level] in
    ``_steps.py``)."""
    func = torch._C._functorch
    while func.is_functorch_wrapped_tensor(t):
        if func.is_dead_tensor_wrapper(t):
            return True
        t = func.get_unwrapped(t)
    return False
