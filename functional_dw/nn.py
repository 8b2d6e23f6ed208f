"""Thin modules for users coming from TE: parameters named as ``te.Linear`` and
``te.GroupedLinear`` name them, so a TE module's ``state_dict`` loads unchanged, and a
``forward`` that is one call of the functional API."""

from __future__ import annotations

import math
import operator
import warnings
from collections.abc import Sequence

import torch

from .grouped_linear import grouped_linear
from .linear import linear

__all__ = ["Linear", "GroupedLinear"]


def _init_(w: torch.Tensor, b: torch.Tensor | None, fan_in: int) -> None:
    """torch.nn.Linear's default init (zero in-features: nothing to draw for w, b bound 0)."""
    if w.numel():
        torch.nn.init.kaiming_uniform_(w, a=math.sqrt(5))
    if b is not None:
        bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0.0
        torch.nn.init.uniform_(b, -bound, bound)


def _size(name: str, v: object, least: int = 0) -> int:
    """An int size (numpy ints too, as torch.nn.Linear takes them) of at least ``least``."""
    try:
        n = operator.index(v) if not isinstance(v, bool) else None
    except TypeError:
        n = None
    if n is None:
        raise TypeError(f"{name} must be an int, got {v!r} ({type(v).__name__})")
    if n < least:
        raise ValueError(f"{name} must be an int >= {least}, got {n}")
    return n


class _TEStateDict:
    """TE modules save an ``_extra_state`` entry (FP8 metadata; empty without FP8). Accept it
    so a TE ``state_dict`` loads with ``strict=True``; FP8 state has no meaning here."""

    def get_extra_state(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8)

    def set_extra_state(self, state) -> None:
        if isinstance(state, torch.Tensor) and state.numel():
            warnings.warn(f"{type(self).__name__}: ignoring TE's FP8 extra state (functional_dw runs without FP8)")


class Linear(_TEStateDict, torch.nn.Module):
    """``y = x W^T + b`` with parameters ``weight [out, in]`` and ``bias [out]``."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 params_dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                 fuse_wgrad_accumulation: bool = False, backend: str | None = None) -> None:
        super().__init__()
        kw = dict(dtype=params_dtype, device=device)
        self.in_features, self.out_features = _size("in_features", in_features), _size("out_features", out_features)
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features, **kw))
        self.bias = torch.nn.Parameter(torch.empty(out_features, **kw)) if bias else None
        self.fuse_wgrad_accumulation, self.backend = fuse_wgrad_accumulation, backend
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initialize the parameters (torch.nn.Linear's rule); FSDP2-style meta init calls it
        after ``to_empty``."""
        _init_(self.weight, self.bias, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, fuse_wgrad_accumulation=self.fuse_wgrad_accumulation,
                      backend=self.backend)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class GroupedLinear(_TEStateDict, torch.nn.Module):
    """E experts with parameters ``weight0..weight{E-1}`` ``[out, in]`` and ``bias0..``."""

    def __init__(self, num_gemms: int, in_features: int, out_features: int, bias: bool = True, *,
                 params_dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                 fuse_wgrad_accumulation: bool = False, use_grouped_tensor: bool | None = None,
                 backend: str | None = None) -> None:
        super().__init__()
        kw = dict(dtype=params_dtype, device=device)
        self.num_gemms = _size("num_gemms", num_gemms, least=1)
        self.in_features, self.out_features = _size("in_features", in_features), _size("out_features", out_features)
        self.use_bias = bias
        for e in range(num_gemms):
            w = torch.nn.Parameter(torch.empty(out_features, in_features, **kw))
            b = torch.nn.Parameter(torch.empty(out_features, **kw)) if bias else None
            self.register_parameter(f"weight{e}", w)
            self.register_parameter(f"bias{e}", b)
        self.fuse_wgrad_accumulation, self.use_grouped_tensor = fuse_wgrad_accumulation, use_grouped_tensor
        self.backend = backend
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initialize each expert's parameters (torch.nn.Linear's rule); FSDP2-style meta init
        calls it after ``to_empty``."""
        for w, b in zip(self.weights(), self.biases() or [None] * self.num_gemms):
            _init_(w, b, self.in_features)

    def weights(self) -> list[torch.Tensor]:
        return [getattr(self, f"weight{e}") for e in range(self.num_gemms)]

    def biases(self) -> list[torch.Tensor] | None:
        return [getattr(self, f"bias{e}") for e in range(self.num_gemms)] if self.use_bias else None

    def forward(self, x: torch.Tensor, m_splits: Sequence[int] | torch.Tensor) -> torch.Tensor:
        return grouped_linear(x, self.weights(), m_splits, self.biases(),
                              fuse_wgrad_accumulation=self.fuse_wgrad_accumulation,
                              use_grouped_tensor=self.use_grouped_tensor, backend=self.backend)

    def extra_repr(self) -> str:
        return (f"num_gemms={self.num_gemms}, in_features={self.in_features}, "
                f"out_features={self.out_features}, bias={self.use_bias}")
