"""Input checks shared by the layers: each error names the argument and the fix."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def tensor(name: str, t: Any, ndim: int | tuple[int, ...] | None = None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
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


def dense(t: torch.Tensor, shape: Sequence[int] | None = None) -> torch.Tensor:
    """``t`` contiguous (and reshaped to ``shape``). An empty tensor may keep odd strides
    through ``.contiguous()``, which grouped GEMMs reject: it gets fresh storage instead."""
    shape = tuple(t.shape) if shape is None else tuple(shape)
    if t.numel() == 0:
        return t if tuple(t.shape) == shape and t.stride() == _row_major(shape) else t.new_empty(shape)
    return t.contiguous() if tuple(t.shape) == shape else t.reshape(shape).contiguous()


def _row_major(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))
