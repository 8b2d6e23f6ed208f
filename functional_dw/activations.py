"""The expert MLP's activations as records: one frozen :class:`Activation` per activation,
registered by name (``grouped_mlp(..., activation="swiglu")``, ``nn.GroupedMLP``, Megatron's
``GroupedMLP``). Everything that differs between activations is read from its record:

=================  ==============================================================================
who                reads
=================  ==============================================================================
grouped_mlp        the names it accepts (:func:`get`'s error), fc1's width (:attr:`Activation.width`)
reference kernels  ``fn`` and ``grad`` (``kernels/torch_activation.py``: forward, backward, jvp)
Triton kernels     ``triton``: the ``ACT`` constexpr ``triton_math.act``/``act_grad`` switch on,
                   and ``gated`` (None: the reference kernels run it on CUDA too)
megatron.py        ``megatron``: Megatron-Core's ``config.activation_func`` (:func:`from_megatron`)
=================  ==============================================================================

Adding one is a record and :func:`register` (docs/mlp.md, "Adding an activation").
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from types import MappingProxyType

import torch
import torch.nn.functional as F

__all__ = ["Activation", "ACTIVATIONS", "register", "unregister", "get", "glu_width", "from_megatron"]

_INV_SQRT2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def silu_grad(g: torch.Tensor) -> torch.Tensor:
    """silu'(g) = s * (1 + g * (1 - s)), s = sigmoid(g) (Megatron's ``swiglu_back``)."""
    s = torch.sigmoid(g)
    return s * (1 + g * (1 - s))


def gelu_grad(z: torch.Tensor) -> torch.Tensor:
    """gelu'(z) = 0.5 * (1 + erf(z / sqrt(2))) + z * exp(-z^2 / 2) / sqrt(2 pi) (exact GELU)."""
    return 0.5 * (1 + torch.erf(z * _INV_SQRT2)) + z * torch.exp(-0.5 * z * z) * _INV_SQRT_2PI


@dataclass(frozen=True)
class Activation:
    """One activation of the expert MLP.

    Attributes:
        name: what ``activation=`` calls it.
        fn: ``act(z)`` elementwise in torch ops, on ``z`` in the compute dtype (float32; float64
            for float64 activations); for a gated unit the gate's: ``h = fn(gate) * up``.
        grad: ``fn``'s derivative elementwise: backward is ``grad(z) * dh``, forward mode
            ``grad(z) * t`` (the chain rule: no rule of its own to keep in step).
        gated: a gated linear unit: fc1 writes ``2F`` features, the gate half then the up half
            (Megatron's layout), and ``h = fn(gate) * up``.
        triton: the fused kernels' ``ACT`` code (its branch in ``kernels/triton_math.py``'s
            ``act`` and ``act_grad``); None: no fused kernel, the reference kernels run it
            everywhere (on CUDA too).
        megatron: Megatron-Core's ``config.activation_func`` for it (with ``gated_linear_unit =
            gated``); None: ``functional_dw.megatron.GroupedMLP`` maps no config to it.
    """

    name: str
    fn: Callable[[torch.Tensor], torch.Tensor]
    grad: Callable[[torch.Tensor], torch.Tensor]
    gated: bool = False
    triton: int | None = None
    megatron: Callable[..., torch.Tensor] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"Activation's name must be a non-empty str, got {self.name!r}")
        for field in ("fn", "grad"):
            if not callable(getattr(self, field)):
                raise TypeError(f"Activation {self.name!r}: {field} must be callable, got {getattr(self, field)!r}")
        if not isinstance(self.gated, bool):
            raise TypeError(f"Activation {self.name!r}: gated must be a bool, got {self.gated!r}")
        if self.triton is not None and (type(self.triton) is not int or self.triton < 0):
            raise TypeError(f"Activation {self.name!r}: triton must be None or an ACT code >= 0, got {self.triton!r}")
        if self.megatron is not None and not callable(self.megatron):
            raise TypeError(f"Activation {self.name!r}: megatron must be None or callable, got {self.megatron!r}")

    @property
    def width(self) -> int:
        """fc1's out-features per ffn feature: 2 for a gated unit, else 1."""
        return 2 if self.gated else 1


# The built-in ones; triton_math.act and act_grad have a branch for each ``triton`` code here.
_BUILT_IN = (
    Activation("swiglu", F.silu, silu_grad, gated=True, triton=0, megatron=F.silu),
    Activation("gelu", F.gelu, gelu_grad, triton=1, megatron=F.gelu),  # exact (erf): Megatron's default
    Activation("silu", F.silu, silu_grad, triton=2, megatron=F.silu),
)
_REGISTRY: dict[str, Activation] = {a.name: a for a in _BUILT_IN}
ACTIVATIONS = MappingProxyType(_REGISTRY)
"""The registered activations by name (a read-only view: :func:`register` adds to it)."""


def register(activation: Activation) -> Activation:
    """Adds ``activation`` under its name and returns it. It runs on the reference kernels (``triton`` must be None: the fused kernels have no
    branch for it)."""
    if not isinstance(activation, Activation):
        raise TypeError(f"register takes an Activation record, got {type(activation).__name__}: {activation!r}")
    if activation.name in _REGISTRY:
        raise ValueError(
            f"activation {activation.name!r} is registered already: unregister({activation.name!r}) first, "
            "or give the record another name"
        )
    if activation.triton is not None:
        raise ValueError(
            f"activation {activation.name!r}: triton={activation.triton}, but the fused kernels have a branch "
            "only for the built-in codes; register it with triton=None (the reference kernels run it)"
        )
    taken = None if activation.megatron is None else from_megatron(activation.megatron, activation.gated)
    if taken is not None:
        raise ValueError(
            f"activation {activation.name!r}: megatron={activation.megatron!r} with gated={activation.gated} "
            f"is {taken.name!r}'s Megatron config already; one config maps to one activation"
        )
    _REGISTRY[activation.name] = activation
    return activation


def unregister(name: str) -> Activation:
    """Removes the registered activation ``name`` (not a built-in one) and returns its record."""
    if any(a.name == name for a in _BUILT_IN):
        raise ValueError(f"activation {name!r} is built in; only registered ones can be unregistered")
    if not isinstance(name, str) or name not in _REGISTRY:
        raise ValueError(f"no activation {name!r} is registered (registered: {', '.join(map(repr, _REGISTRY))})")
    return _REGISTRY.pop(name)


def get(name: str | Activation) -> Activation:
    """The record of the activation ``name``; ValueError naming the registered ones else. A
    record is returned as given: a call's residuals hold the record forward ran (a name
    re-registered or unregistered before backward does not change that call's backward)."""
    if isinstance(name, Activation):
        return name
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):  # (TypeError: an unhashable argument)
        raise ValueError(f"activation must be one of {', '.join(map(repr, _REGISTRY))}, got {name!r}") from None


def glu_width(name: str) -> int:
    """fc1's out-features per ffn feature for the activation ``name``: 2 gated (SwiGLU), else 1."""
    return get(name).width


def from_megatron(activation_func: Callable[..., torch.Tensor], gated_linear_unit: bool) -> Activation | None:
    """The activation of Megatron-Core's (``config.activation_func``, ``config.gated_linear_unit``),
    or None where no record maps it."""
    for a in _REGISTRY.values():
        if a.megatron is activation_func and a.gated == bool(gated_linear_unit):
            return a
    return None
