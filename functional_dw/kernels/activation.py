"""The expert MLP's elementwise steps behind the kernels seam: the activation between fc1 and
fc2 (with the router's probs), and fc2's bias where the probs weight it. ``grouped_mlp`` calls
only these. The reference kernels (``torch_activation.py``) run them anywhere; on CUDA the fused
Triton kernels (``triton_activation.py``: one launch forward, one backward); a backend may bring
its own (the same four methods). :func:`select` decides once per call, ``plan.route`` per step
(:func:`activation_kernels`). Each activation's math is its record in
``functional_dw/activations.py`` (``fn``, ``grad``; a gated unit is ``fn(gate) * up``).

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

from typing import Any, Protocol

import torch

from ..activations import ACTIVATIONS, get, glu_width
from ..plan import route
from .splits import Splits
from .torch_activation import REFERENCE, TorchActivation, act_jvp

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


_METHODS = ("act_fwd", "act_bwd", "probs_bias_fwd", "probs_bias_bwd")


def select(kernels: Any, x: Any, activation: str) -> ActivationKernels:
    """The activation kernels a grouped_mlp call runs (decided once per call, kept on its record):
    the backend's own (``kernels`` with all four methods); else the fused Triton kernels
    (``triton_activation``) where they run on ``x`` (a plain CUDA tensor, Triton installed, not
    under ``torch.compile``: inductor fuses the reference's ops itself) and ``activation``'s record
    has Triton code; else the reference (an activation without Triton code runs it on CUDA too)."""
    if _own(kernels):
        return kernels
    if torch.compiler.is_compiling() or get(activation).triton is None:
        return REFERENCE
    from . import triton_activation  # (loaded on first use: it imports Triton)

    return triton_activation.FUSED if triton_activation.available(x) else REFERENCE


def _own(kernels: Any) -> bool:
    return (
        kernels is not None and kernels is not REFERENCE and all(callable(getattr(kernels, m, None)) for m in _METHODS)
    )


def activation_kernels(kernels: Any, *operands: Any) -> ActivationKernels:
    """The activation kernels that run on ``operands``: ``kernels`` (a record's, from
    :func:`select`) where ``plan.route`` keeps them, else the reference (NOTE: [Transforms
    without a rule]: a fused kernel has no derivative). The reference for kernels without the
    four methods."""
    return route(kernels if _own(kernels) else REFERENCE, False, *operands, reference=REFERENCE)[0]


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
