"""The expert MLP's reference activation kernels: plain torch ops in float32 (float64 for
float64 activations), rounded once, on any device and under every transform. The contract
they define is ``activation.py``'s docstring; each activation's math is its record's ``fn`` and
``grad`` (``functional_dw/activations.py``), composed here the same way for all: a gated unit
is ``fn(gate) * up``."""

from __future__ import annotations

import torch

from ..activations import get
from .splits import Splits
from .splits import row_expert

__all__ = ["TorchActivation", "REFERENCE", "act_jvp"]


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _act(z: torch.Tensor, activation: str) -> torch.Tensor:
    """act(z) in z's (compute) dtype, unweighted."""
    a = get(activation)
    if a.gated:
        gate, up = z.chunk(2, dim=-1)
        return a.fn(gate) * up
    return a.fn(z)


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
        a = get(activation)
        if a.gated:
            gate, up = z.chunk(2, dim=-1)
            dz = torch.cat([g * a.grad(gate) * up, g * a.fn(gate)], dim=-1)
        else:
            dz = g * a.grad(z)
        return dz.to(fc1_out.dtype), dprobs

    def probs_bias_fwd(self, y: torch.Tensor, b_EH: torch.Tensor, probs: torch.Tensor, splits: Splits) -> torch.Tensor:
        """``splits``: the token counts (the rows of expert e get ``b_EH[e]``)."""
        acc, rows = _acc(y.dtype), row_expert(splits)
        return (y.to(acc) + b_EH.to(acc)[rows] * probs.to(acc)[:, None]).to(y.dtype)

    def probs_bias_bwd(
        self, dy: torch.Tensor, b_EH: torch.Tensor, probs: torch.Tensor, splits: Splits
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(db ``[E, H]`` in the bias's dtype, dprobs ``[T]`` in the compute dtype: a partial
        that :meth:`act_bwd` adds before its one rounding)."""
        acc, rows = _acc(dy.dtype), row_expert(splits)
        dy32, b32 = dy.to(acc), b_EH.to(acc)
        weighted = dy32 * probs.to(acc)[:, None]
        db = torch.zeros(b_EH.shape, dtype=acc, device=dy.device).index_add(
            0, rows, weighted
        )  # (out of place: vmap-safe)
        return db.to(b_EH.dtype), (dy32 * b32[rows]).sum(-1)


REFERENCE = TorchActivation()


def act_jvp(
    fc1_out: torch.Tensor,
    probs: torch.Tensor | None,
    t_fc1_out: torch.Tensor | None,
    t_probs: torch.Tensor | None,
    activation: str,
) -> torch.Tensor:
    """Forward mode (grouped_mlp's jvp rule): ``dh = act'(fc1_out) t_fc1_out * p + act(fc1_out)
    t_probs`` in the compute dtype, rounded once (None tangents are zeros)."""
    acc, a = _acc(fc1_out.dtype), get(activation)
    z = fc1_out.to(acc)
    T, W = z.shape
    dh = z.new_zeros(T, W // a.width)
    if t_fc1_out is not None:
        t = t_fc1_out.to(acc)
        if a.gated:
            (gate, up), (tg, tu) = z.chunk(2, dim=-1), t.chunk(2, dim=-1)
            dh = a.grad(gate) * tg * up + a.fn(gate) * tu
        else:
            dh = a.grad(z) * t
        if probs is not None:
            dh = dh * probs.to(acc)[:, None]
    if t_probs is not None:
        dh = dh + _act(z, activation) * t_probs.to(acc)[:, None]
    return dh.to(fc1_out.dtype)
