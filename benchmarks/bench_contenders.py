"""bench.py's contenders: the layer every implementation computes, and the implementations.

* :func:`make_splits` (balanced, or Zipf-skewed with empty experts), :func:`make_inputs`;
* :class:`Layer`: one grouped layer ``x[T, H] -> [T, FF]`` with the same weights in every form the
  implementations take (a stacked ``[E, FF, H]`` parameter, an ``fd.nn.GroupedLinear``, TE's
  ``GroupedLinear`` on either path), and a step (forward+backward) per implementation;
* :func:`impls_grouped`: name -> step (or the reason it cannot run) for the bf16 grouped
  sections: functional_dw's three paths in both weight layouts (``FD_NAMES``), TE's two paths,
  torch's grouped_mm raw and under autograd, a loop of torch.mm (``PEER_NAMES``).

A step takes one ``(x, dy)`` and runs forward and backward; an implementation that cannot run is
a string (``reason``) the report prints instead of a time.
"""

from __future__ import annotations

import torch

import functional_dw as fd

import bench_timing
from bench_timing import BF16


# --- shapes and splits ---------------------------------------------------------------------


def make_splits(E, T, kind, seed=0):
    """balanced: T/E each; zipf: counts ~ 1/rank^1.2 with the tail experts getting zero tokens."""
    if kind == "balanced":
        base = [T // E] * E
        base[0] += T - sum(base)
        return base
    g = torch.Generator().manual_seed(seed)
    w = torch.tensor([1.0 / (r + 1) ** 1.2 for r in range(E)])
    w[-max(1, E // 8) :] = 0.0  # the coldest experts get nothing
    counts = torch.multinomial(w / w.sum(), T, replacement=True, generator=g).bincount(minlength=E)
    return counts[torch.randperm(E, generator=g)].tolist()


def make_inputs(T, H, FF, n=2):
    return [
        (
            torch.randn(T, H, device=bench_timing.DEV, dtype=BF16, requires_grad=True),
            torch.randn(T, FF, device=bench_timing.DEV, dtype=BF16),
        )
        for _ in range(n)
    ]


# --- implementations (each a step(inputs) for forward+backward) ------------------------------


def grads_step(forward, params):
    def step(inp):
        x, dy = inp
        y = forward(x)
        return torch.autograd.grad(y, [x, *params], dy)

    return step


def reason(e: Exception) -> str:
    """What an implementation that raised records instead of a time: ``raises: <first line>``."""
    return f"raises: {str(e).splitlines()[0][:90] if str(e) else type(e).__name__}"


def if_runs(step, T, H, FF):
    """``step`` if one forward+backward runs, else the reason (TE's grouped path beyond 64
    experts; torch's grouped GEMM backward where the build lacks it)."""
    try:
        step(
            (
                torch.randn(T, H, device=bench_timing.DEV, dtype=BF16, requires_grad=True),
                torch.randn(T, FF, device=bench_timing.DEV, dtype=BF16),
            )
        )
        return step
    except Exception as e:  # noqa: BLE001
        return reason(e)


class Layer:
    """One grouped layer x[T, H] -> [T, FF] with the same weights in every form the
    implementations take: a stacked [E, FF, H] parameter, an ``fd.nn.GroupedLinear`` (the list
    a module user has), TE's modules (trainable, and frozen copies when asked)."""

    def __init__(self, E, H, FF, splits, te, frozen_te=False):
        self.E, self.H, self.FF, self.splits, self.te = E, H, FF, splits, te
        self.T = sum(splits)
        self.w_ENK = torch.nn.Parameter(torch.randn(E, FF, H, device=bench_timing.DEV, dtype=BF16) * 0.02)
        self.mod = fd.nn.GroupedLinear(E, H, FF, bias=False, params_dtype=BF16, device=bench_timing.DEV)
        with torch.no_grad():
            for w, src in zip(self.mod.weights(), self.w_ENK):
                w.copy_(src)
        self.splits_dev = torch.tensor(splits, device=bench_timing.DEV)
        self.offs = torch.cumsum(self.splits_dev, 0).to(torch.int32)
        self.te_mods, self.te_frozen = {}, {}
        for grouped in (False, True):
            self.te_mods[grouped] = self._te_module(grouped, trainable=True)
            if frozen_te:
                self.te_frozen[grouped] = self._te_module(grouped, trainable=False)

    def _te_module(self, grouped, trainable):
        if self.te is None:
            return "n/a: Transformer Engine is not installed"
        try:
            m = self.te.GroupedLinear(
                self.E,
                self.H,
                self.FF,
                bias=False,
                params_dtype=BF16,
                device=bench_timing.DEV,
                use_grouped_tensor=grouped,
            )
            with torch.no_grad():
                for e in range(self.E):
                    getattr(m, f"weight{e}").copy_(self.w_ENK[e])
            for p in m.parameters():
                p.requires_grad_(trainable)
            return m
        except Exception as e:  # noqa: BLE001
            return reason(e)

    def split_arg(self, grouped):
        """The grouped path reads a CUDA splits tensor (no sync); the split path needs host sizes."""
        return self.splits_dev if grouped is not False else self.splits

    # forward(x, frozen) -> y, and the parameters a trainable step differentiates
    def fd_forward(self, backend, grouped, layout):
        arg = self.split_arg(grouped)
        if layout == "stacked":
            return (
                lambda x, frozen=False: fd.grouped_linear(
                    x, self.w_ENK.detach() if frozen else self.w_ENK, arg, backend=backend, use_grouped_tensor=grouped
                )
            ), [self.w_ENK]
        ws = self.mod.weights()
        return (
            lambda x, frozen=False: fd.grouped_linear(
                x, [w.detach() for w in ws] if frozen else ws, arg, backend=backend, use_grouped_tensor=grouped
            )
        ), ws

    def fd_step(self, backend, grouped, layout):
        if backend == "te" and self.te is None:
            return "n/a: Transformer Engine is not installed"
        if layout == "list":  # what nn.GroupedLinear's forward passes: its weights, fetched per call
            arg = self.split_arg(grouped)

            def step(inp):
                x, dy = inp
                ws = self.mod.weights()
                y = fd.grouped_linear(x, ws, arg, backend=backend, use_grouped_tensor=grouped)
                return torch.autograd.grad(y, [x, *ws], dy)

            return step
        fwd, params = self.fd_forward(backend, grouped, layout)
        return grads_step(fwd, params)

    def te_step(self, grouped):
        m = self.te_mods[grouped]
        if isinstance(m, str):
            return m
        arg = self.split_arg(grouped)
        return if_runs(grads_step(lambda x: m(x, arg), list(m.parameters())), self.T, self.H, self.FF)

    def gm_autograd_step(self):
        gm = getattr(torch, "_grouped_mm", None)
        if gm is None:
            return f"n/a: torch {torch.__version__} has no _grouped_mm"
        return if_runs(
            grads_step(lambda x: gm(x, self.w_ENK.transpose(-2, -1), offs=self.offs), [self.w_ENK]),
            self.T,
            self.H,
            self.FF,
        )


FD_NAMES = [
    "fd auto stacked",
    "fd auto list",
    "fd te grouped stacked",
    "fd te grouped list",
    "fd te split stacked",
    "fd te split list",
]
FD_PATHS = {"fd auto": ("auto", None), "fd te grouped": ("te", True), "fd te split": ("te", False)}
PEER_NAMES = ["te grouped", "te split", "torch._grouped_mm", "torch._grouped_mm (autograd)", "torch.mm loop"]
GROUPED_NAMES = FD_NAMES + PEER_NAMES
PEERS_FOR_RATIO = ("te split", "te grouped", "torch._grouped_mm")


def impls_grouped(layer: Layer) -> dict:
    """name -> step, or the reason it cannot run: forward+backward of one grouped layer."""
    out = {}
    for prefix, (backend, grouped) in FD_PATHS.items():
        for layout in ("stacked", "list"):
            out[f"{prefix} {layout}"] = layer.fd_step(backend, grouped, layout)
    out["te grouped"], out["te split"] = layer.te_step(True), layer.te_step(False)
    gm = getattr(torch, "_grouped_mm", None)
    if gm is not None:
        w, offs = layer.w_ENK, layer.offs

        def torch_gm(inp):
            x, dy = inp
            gm(x, w.transpose(-2, -1), offs=offs)
            gm(dy, w, offs=offs)
            gm(dy.t(), x, offs=offs)

        out["torch._grouped_mm"] = torch_gm
    out["torch._grouped_mm (autograd)"] = layer.gm_autograd_step()
    ws, sizes = layer.mod.weights(), layer.splits

    def mm_loop(inp):
        x, dy = inp
        for e, (xe, de) in enumerate(zip(x.split(sizes), dy.split(sizes))):
            xe @ ws[e].t(), de @ ws[e], de.t() @ xe

    out["torch.mm loop"] = mm_loop
    return out
