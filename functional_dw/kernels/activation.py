"""The expert MLP's elementwise steps behind the kernels seam: the activation between fc1 and
fc2 (with the router's probs), and fc2's bias where the probs weight it. ``grouped_mlp`` calls
only these. On CUDA the fused Triton kernels (``triton_activation.py``: one launch forward, one
backward) run them; a backend may bring its own (the same four methods); :func:`select` decides,
once per call.

Shape legend: ``T`` tokens, ``F`` the MLP's ffn width (fc2's in-features), ``H`` fc2's
out-features, ``E`` experts. ``fc1_out`` is ``[T, 2F]`` for SwiGLU (Megatron's layout: the
gate half, then the up half) and ``[T, F]`` for GELU and SiLU; ``probs`` is None or ``[T]``.

=================  ==============================================================================
method             math (per token row t; ``p_t`` = 1 without probs)
=================  ==============================================================================
act_fwd            ``h = act(fc1_out) * p``:  swiglu ``silu(gate) * up``; gelu ``gelu(z)``
                   (exact, erf: Megatron's default ``F.gelu``); silu ``silu(z)``
act_bwd            ``dfc1_out = act'(fc1_out) * (dh * p)``;  ``dprobs = sum_F act(fc1_out) * dh``
                   (+ ``dprobs_in``, an fp32 partial from :meth:`probs_bias_bwd`)
probs_bias_fwd     ``y + p * b[e(t)]``  (Megatron's ``_apply_bias``: fc2's bias weighted by probs)
probs_bias_bwd     ``db_e = sum_{t in e} p_t dy_t``;  ``dprobs_t = sum_H dy_t * b[e(t)]`` (fp32, unrounded)
=================  ==============================================================================

Numerics (the contract a fused kernel matches). Every method reads its operands, casts them
to the compute dtype (float32; float64 when the activations are float64), runs the formulas
below in that dtype, and rounds ONCE: ``h`` and ``dfc1_out`` to ``fc1_out``'s dtype, ``y`` to
its own, ``db`` to the bias's, ``dprobs`` to the probs' (which may differ from the activations':
Megatron's router probs are float32). In the compute dtype, with ``s = sigmoid(g)``::

    silu(g)   = g / (1 + exp(-g))                 (torch's F.silu)
    silu'(g)  = s * (1 + g * (1 - s))             (Megatron's swiglu_back)
    gelu(z)   = 0.5 * z * (1 + erf(z / sqrt(2)))  (torch's F.gelu)
    gelu'(z)  = 0.5 * (1 + erf(z / sqrt(2))) + z * exp(-z^2 / 2) / sqrt(2 pi)
    swiglu:  a = silu(gate) * up;  dgate = (dh * p) * silu'(gate) * up;  dup = (dh * p) * silu(gate)

so the elementwise outputs are bitwise what a kernel computing the same fp32 expressions with
accurate ``exp``/``erf`` gives; ``dprobs`` and ``db`` are sums whose order is torch's reduction
(a kernel matches them within fp32 summation error). Megatron's jit-fused weighted SwiGLU rounds
``silu(gate) * up`` to the activations' dtype before multiplying by the probs; this rounds once.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from . import Splits
from .splits import row_expert as _row_expert

__all__ = [
    "ACTIVATIONS",
    "ActivationKernels",
    "TorchActivation",
    "REFERENCE",
    "activation_kernels",
    "select",
    "act_fwd",
    "act_bwd",
    "act_jvp",
    "probs_bias_fwd",
    "probs_bias_bwd",
    "glu_width",
]

ACTIVATIONS = ("swiglu", "gelu", "silu")
_GATED = frozenset({"swiglu"})
_INV_SQRT2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def glu_width(activation: str) -> int:
    """fc1's out-features per ffn feature: 2 for a gated unit (SwiGLU), else 1."""
    return 2 if activation in _GATED else 1


class ActivationKernels(Protocol):
    """What ``grouped_mlp`` calls between its two GEMMs (see the module docstring)."""

    def act_fwd(self, fc1_out: torch.Tensor, probs: torch.Tensor | None, activation: str) -> torch.Tensor: ...
    def act_bwd(
        self,
        fc1_out: torch.Tensor,
        probs: torch.Tensor | None,
        dh: torch.Tensor,
        activation: str,
        *,
        dprobs_in: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]: ...
    def probs_bias_fwd(
        self, y: torch.Tensor, b_EH: torch.Tensor, probs: torch.Tensor, splits: Splits
    ) -> torch.Tensor: ...
    def probs_bias_bwd(
        self, dy: torch.Tensor, b_EH: torch.Tensor, probs: torch.Tensor, splits: Splits
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _silu_grad(g: torch.Tensor) -> torch.Tensor:
    s = torch.sigmoid(g)
    return s * (1 + g * (1 - s))


def _gelu_grad(z: torch.Tensor) -> torch.Tensor:
    return 0.5 * (1 + torch.erf(z * _INV_SQRT2)) + z * torch.exp(-0.5 * z * z) * _INV_SQRT_2PI


def _act(z: torch.Tensor, activation: str) -> torch.Tensor:
    """act(z) in z's (compute) dtype, unweighted."""
    if activation == "swiglu":
        gate, up = z.chunk(2, dim=-1)
        return F.silu(gate) * up
    if activation == "gelu":
        return F.gelu(z)
    return F.silu(z)


class TorchActivation:
    """The reference: plain torch ops in fp32 (fp64 for fp64 activations), rounded once."""

    name = "torch"

    def __repr__(self) -> str:
        return "TorchActivation()"

    def act_fwd(self, fc1_out: torch.Tensor, probs: torch.Tensor | None, activation: str) -> torch.Tensor:
        acc = _acc(fc1_out.dtype)
        a = _act(fc1_out.to(acc), activation)
        if probs is not None:
            a = a * probs.to(acc)[:, None]
        return a.to(fc1_out.dtype)

    def act_bwd(
        self,
        fc1_out: torch.Tensor,
        probs: torch.Tensor | None,
        dh: torch.Tensor,
        activation: str,
        *,
        dprobs_in: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        acc = _acc(fc1_out.dtype)
        z, g = fc1_out.to(acc), dh.to(acc)
        dprobs = None
        if probs is not None:
            dprobs = (_act(z, activation) * g).sum(-1)
            if dprobs_in is not None:
                dprobs = dprobs + dprobs_in.to(acc)
            dprobs = dprobs.to(probs.dtype)
            g = g * probs.to(acc)[:, None]
        if activation == "swiglu":
            gate, up = z.chunk(2, dim=-1)
            dz = torch.cat([g * _silu_grad(gate) * up, g * F.silu(gate)], dim=-1)
        elif activation == "gelu":
            dz = g * _gelu_grad(z)
        else:
            dz = g * _silu_grad(z)
        return dz.to(fc1_out.dtype), dprobs

    def probs_bias_fwd(self, y: torch.Tensor, b_EH: torch.Tensor, probs: torch.Tensor, splits: Splits) -> torch.Tensor:
        """``splits``: the token counts (the rows of expert e get ``b_EH[e]``)."""
        acc, rows = _acc(y.dtype), _row_expert(splits)
        return (y.to(acc) + b_EH.to(acc)[rows] * probs.to(acc)[:, None]).to(y.dtype)

    def probs_bias_bwd(
        self, dy: torch.Tensor, b_EH: torch.Tensor, probs: torch.Tensor, splits: Splits
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(db ``[E, H]`` in the bias's dtype, dprobs ``[T]`` in the compute dtype: a partial
        that :meth:`act_bwd` adds before its one rounding)."""
        acc, rows = _acc(dy.dtype), _row_expert(splits)
        dy32, b32 = dy.to(acc), b_EH.to(acc)
        weighted = dy32 * probs.to(acc)[:, None]
        db = torch.zeros(b_EH.shape, dtype=acc, device=dy.device).index_add(
            0, rows, weighted
        )  # (out of place: vmap-safe)
        return db.to(b_EH.dtype), (dy32 * b32[rows]).sum(-1)


REFERENCE = TorchActivation()

_METHODS = ("act_fwd", "act_bwd", "probs_bias_fwd", "probs_bias_bwd")


def select(kernels: Any, x: Any) -> ActivationKernels:
    """The activation kernels a grouped_mlp call runs (decided once per call, kept on its record):
    the backend's own (``kernels`` with all four methods); else the fused Triton kernels
    (``triton_activation``) where they run on ``x`` (a plain CUDA tensor, Triton installed, not
    under ``torch.compile``: inductor fuses the reference's ops itself); else the reference."""
    if _own(kernels):
        return kernels
    if torch.compiler.is_compiling():
        return REFERENCE
    from . import triton_activation  # (imports this module: loaded on first use)

    return triton_activation.FUSED if triton_activation.available(x) else REFERENCE


def _own(kernels: Any) -> bool:
    return (
        kernels is not None and kernels is not REFERENCE and all(callable(getattr(kernels, m, None)) for m in _METHODS)
    )


def activation_kernels(kernels: Any, *operands: Any) -> ActivationKernels:
    """The activation kernels that run on ``operands``: ``kernels`` (a record's, from
    :func:`select`), except where autograd would record the step (an operand requiring grad
    with grad mode on: a backward run with ``create_graph``), forward-mode AD is active or an
    operand is a functorch wrapper: a fused kernel reads raw pointers and has no derivative, so
    the reference runs (as the GEMMs route in ``plan.route``). The reference for kernels
    without the four methods."""
    if not _own(kernels):
        return REFERENCE
    if torch.compiler.is_compiling():
        return kernels if getattr(kernels, "name", None) != "triton" else REFERENCE
    if torch.autograd.forward_ad._current_level >= 0:
        return REFERENCE
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in operands):
        return REFERENCE
    if torch._C._functorch.peek_interpreter_stack() is not None:
        wrapped = torch._C._functorch.is_functorch_wrapped_tensor
        if any(isinstance(t, torch.Tensor) and wrapped(t) for t in operands):
            return REFERENCE
    return kernels


def act_jvp(
    fc1_out: torch.Tensor,
    probs: torch.Tensor | None,
    t_fc1_out: torch.Tensor | None,
    t_probs: torch.Tensor | None,
    activation: str,
) -> torch.Tensor:
    """Forward mode (grouped_mlp's jvp rule): ``dh = act'(fc1_out) t_fc1_out * p + act(fc1_out)
    t_probs`` in the compute dtype, rounded once (None tangents are zeros)."""
    acc = _acc(fc1_out.dtype)
    z = fc1_out.to(acc)
    T, W = z.shape
    dh = z.new_zeros(T, W // glu_width(activation))
    if t_fc1_out is not None:
        t = t_fc1_out.to(acc)
        if activation == "swiglu":
            (gate, up), (tg, tu) = z.chunk(2, dim=-1), t.chunk(2, dim=-1)
            dh = _silu_grad(gate) * tg * up + F.silu(gate) * tu
        else:
            dh = (_gelu_grad(z) if activation == "gelu" else _silu_grad(z)) * t
        if probs is not None:
            dh = dh * probs.to(acc)[:, None]
    if t_probs is not None:
        dh = dh + _act(z, activation) * t_probs.to(acc)[:, None]
    return dh.to(fc1_out.dtype)


def act_fwd(fc1_out: torch.Tensor, probs: torch.Tensor | None, activation: str) -> torch.Tensor:
    """The reference :meth:`TorchActivation.act_fwd`."""
    return REFERENCE.act_fwd(fc1_out, probs, activation)


def act_bwd(
    fc1_out: torch.Tensor,
    probs: torch.Tensor | None,
    dh: torch.Tensor,
    activation: str,
    *,
    dprobs_in: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The reference :meth:`TorchActivation.act_bwd`."""
    return REFERENCE.act_bwd(fc1_out, probs, dh, activation, dprobs_in=dprobs_in)


def probs_bias_fwd(y: torch.Tensor, b_EH: torch.Tensor, probs: torch.Tensor, splits: Splits) -> torch.Tensor:
    """The reference :meth:`TorchActivation.probs_bias_fwd`."""
    return REFERENCE.probs_bias_fwd(y, b_EH, probs, splits)


def probs_bias_bwd(
    dy: torch.Tensor, b_EH: torch.Tensor, probs: torch.Tensor, splits: Splits
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference :meth:`TorchActivation.probs_bias_bwd`."""
    return REFERENCE.probs_bias_bwd(dy, b_EH, probs, splits)
