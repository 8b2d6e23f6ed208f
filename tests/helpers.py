"""Shared test helpers: seeded inputs, module builders and the plain-PyTorch reference.

    from helpers import randn, draws, grouped_inputs, grouped_module, ExpertMLP, ref_grouped

Every input is drawn from a generator seeded where it is made, so a test's numbers depend on
its own arguments only, never on the tests that ran before it. (conftest.py holds the rest of
what tests share: the fakes of the protocols (FakeDW, PathRecorder, CopyCounter), the
saved-tensor hooks, and the tolerance rule with its float64 ``reference``.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

import functional_dw as fd

# NOTE: [Hang guards]
# A multi-process test's collective timeout and deadline guard against a hang, not against a
# slow machine: CI is 2 loaded cores, where W ranks importing torch and computing references
# beside other processes can take minutes. They are one generous number, never a claim about
# speed; a test of the launcher's failure paths asserts what failed, not how long it took.
HANG_S = 900  # seconds

# --- seeded inputs -------------------------------------------------------------------------


def gen(seed: int, device="cpu") -> torch.Generator:
    """A generator on ``device`` seeded with ``seed``."""
    return torch.Generator(device=device).manual_seed(seed)


def randn(
    *shape: int,
    seed: int | None = 0,
    dtype: torch.dtype = torch.float32,
    scale: float = 1.0,
    device="cpu",
    draw_device=None,
    draw_dtype: torch.dtype | None = torch.float32,
    grad: bool = False,
) -> torch.Tensor:
    """Normal values: drawn from a generator seeded with ``seed`` (None: torch's global one) on
    ``draw_device`` (default: ``device``) in ``draw_dtype`` (None: in ``dtype`` itself; a
    float64 draw gives other values than a float32 one), times ``scale``, as ``dtype`` on
    ``device``; ``grad``: a leaf that requires grad."""
    draw_device = device if draw_device is None else draw_device
    g = None if seed is None else gen(seed, draw_device)
    t = torch.randn(*shape, generator=g, device=draw_device, dtype=draw_dtype or dtype)
    if scale != 1.0:
        t = t * scale
    t = t.to(dtype).to(device)
    return t.requires_grad_() if grad else t


def draws(
    *shapes: Sequence[int],
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device="cpu",
    draw_device=None,
    draw_dtype: torch.dtype | None = torch.float32,
) -> list[torch.Tensor]:
    """One tensor per shape, drawn one after another from one generator seeded with ``seed``
    (each as :func:`randn` draws it), e.g. ``x, dy = draws((T, K), (T, N), seed=1)``."""
    draw_device = device if draw_device is None else draw_device
    g = gen(seed, draw_device)
    return [
        torch.randn(*s, generator=g, device=draw_device, dtype=draw_dtype or dtype).to(dtype).to(device) for s in shapes
    ]


class GroupedInputs(NamedTuple):
    x: torch.Tensor  # [T, K]
    ws: list[torch.Tensor] | torch.Tensor  # E [N, K], or one [E, N, K] (stacked)
    bs: list[torch.Tensor] | torch.Tensor | None  # E [N], or one [E, N] (stacked)
    dy: torch.Tensor | None  # [T, N]


def grouped_inputs(
    splits: Sequence[int],
    K: int,
    N: int,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    w_div: float = 1.0,
    bias: bool = True,
    dy: bool = True,
    experts: int | None = None,
    stacked: bool = False,
    grad: bool = False,
    device="cpu",
    draw_device=None,
    draw_dtype: torch.dtype | None = torch.float32,
) -> GroupedInputs:
    """One grouped-linear call's inputs, drawn in this order from one generator seeded with
    ``seed``: x [T, K] (T = sum(splits)), E weights [N, K] (divided by ``w_div``), E biases [N]
    (``bias``), dy [T, N] (``dy``); E = ``experts`` (default len(splits)). Each drawn as
    :func:`randn` draws (``draw_device``, ``draw_dtype``), then cast to ``dtype`` on ``device``.
    ``stacked``: weights and biases as one [E, N, K] and one [E, N] tensor. ``grad``: x, the
    weights and the biases are leaves that require grad (dy never does)."""
    E = len(splits) if experts is None else experts
    T = sum(int(s) for s in splits)
    draw_device = device if draw_device is None else draw_device
    g = gen(seed, draw_device)

    def draw(*shape, div=1.0):
        t = torch.randn(*shape, generator=g, device=draw_device, dtype=draw_dtype or dtype)
        if div != 1.0:
            t = t / div
        return t.to(dtype).to(device)

    x = draw(T, K)
    ws = [draw(N, K, div=w_div) for _ in range(E)]
    bs = [draw(N) for _ in range(E)] if bias else None
    d = draw(T, N) if dy else None
    if stacked:
        ws = torch.stack(ws)
        bs = None if bs is None else torch.stack(bs)
    if grad:
        for t in [x, *([ws] if stacked else ws), *([] if bs is None else [bs] if stacked else bs)]:
            t.requires_grad_()
    return GroupedInputs(x, ws, bs, d)


# --- modules -------------------------------------------------------------------------------


def grouped_module(E: int, K: int, N: int, *, seed: int = 0, **kw) -> fd.nn.GroupedLinear:
    """``fd.nn.GroupedLinear(E, K, N, **kw)`` initialized after ``torch.manual_seed(seed)``
    (the modules draw their weights from torch's global generator, as TE's do)."""
    torch.manual_seed(seed)
    return fd.nn.GroupedLinear(E, K, N, **kw)


def linear_module(K: int, N: int, *, seed: int = 0, **kw) -> fd.nn.Linear:
    """``fd.nn.Linear(K, N, **kw)`` initialized after ``torch.manual_seed(seed)``."""
    torch.manual_seed(seed)
    return fd.nn.Linear(K, N, **kw)


class ExpertMLP(torch.nn.Module):
    """An MoE expert block: fc1 (GroupedLinear, E experts, H -> F) -> GELU -> fc2 (F -> H);
    ``kw`` goes to both layers (bias, params_dtype, device, use_grouped_tensor, backend, ...)."""

    def __init__(self, E: int, H: int, F_: int, **kw):
        super().__init__()
        self.fc1 = fd.nn.GroupedLinear(E, H, F_, **kw)
        self.fc2 = fd.nn.GroupedLinear(E, F_, H, **kw)

    def forward(self, x: torch.Tensor, splits) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x, splits)), splits)


# --- the plain-PyTorch reference -----------------------------------------------------------


def ref_grouped(x, ws, splits, bs=None):
    """A loop of F.linear, one per expert's rows: the semantics grouped_linear must match
    (differentiable; pass float64 copies for a float64 reference)."""
    xs = x.split(list(splits))
    return torch.cat([F.linear(xe, ws[e], None if bs is None else bs[e]) for e, xe in enumerate(xs)])
