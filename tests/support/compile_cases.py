"""Shared by test_compile.py (CPU) and test_compile_gpu.py: a graph-counting compile backend,
the routings, the two compiled models and the compiled-vs-eager check over many routings."""

from __future__ import annotations

import random

import torch
from torch._dynamo.backends.registry import lookup_backend

from conftest import TOL
from helpers import ExpertMLP
from functional_dw import nn as fnn

E, K, N, T = 4, 16, 32, 12


def random_routings(n: int, seed: int = 0, experts: int = E, tokens: int = T) -> list[list[int]]:
    """``n`` random routings of ``tokens`` to ``experts`` (random cut points)."""
    r = random.Random(seed)
    out = []
    for _ in range(n):
        cuts = sorted(r.randint(0, tokens) for _ in range(experts - 1))
        out.append([b - a for a, b in zip([0, *cuts], [*cuts, tokens])])
    return out


# Ten routings of T tokens to E experts: 0- and 1-token experts, all tokens on one expert, then
# random ones. The first two differ in every count: a list's ints reach dynamo as inputs, and
# with dynamic=None its automatic dynamic makes symbolic only the counts that changed between
# the first two steps (see NOTE: [Splits under torch.compile]).
ROUTINGS = [[5, 0, 1, 6], [2, 3, 4, 3], [0, 12, 0, 0], [1, 1, 1, 9], *random_routings(6)]


class GraphCounter:
    """A ``torch.compile`` backend that counts the graphs dynamo compiles and records every op
    they call (the autograd.Function's forward and backward bodies are submodules)."""

    def __init__(self, inner: str = "aot_eager"):
        self.inner, self.graphs, self.ops, self.calls = inner, 0, set(), []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        self.graphs += 1
        for m in gm.modules():
            if isinstance(m, torch.fx.GraphModule):
                nodes = [n for n in m.graph.nodes if n.op == "call_function"]
                self.ops |= {str(n.target) for n in nodes}
                self.calls += [(str(n.target), n.args) for n in nodes]  # (op, arguments)
        return lookup_backend(self.inner)(gm, example_inputs)


def make_model(kind: str, dtype, device, path, bias, backend):
    """A GroupedLinear (``kind="layer"``) or an ExpertMLP of two (K -> N -> K), from seed 0."""
    torch.manual_seed(0)
    kw = dict(bias=bias, params_dtype=dtype, device=device, use_grouped_tensor=path, backend=backend)
    return fnn.GroupedLinear(E, K, N, **kw) if kind == "layer" else ExpertMLP(E, K, N, **kw)


def step(model, x, splits):
    """Output and grads (of x and every parameter) of one forward/backward."""
    x = x.detach().requires_grad_()
    y = model(x, splits)
    leaves = [x, *model.parameters()]
    return y, torch.autograd.grad(y.float().square().sum(), leaves)


def check_routings(model, splits_form, dynamic, device, backend="aot_eager", routings=ROUTINGS, tol=None):
    """Compile ``model`` once (fullgraph) and run it over ``routings``; every step's output and
    grads must equal eager's. Returns the counting backend (graphs compiled, ops seen)."""
    torch._dynamo.reset()
    counter = GraphCounter(backend)
    compiled = torch.compile(model, backend=counter, fullgraph=True, dynamic=dynamic)
    dtype = next(model.parameters()).dtype
    g = torch.Generator().manual_seed(1)
    for sizes in routings:
        splits = as_form(sizes, splits_form, device)
        x = torch.randn(T, model_in(model), generator=g).to(device, dtype)
        y_c, g_c = step(compiled, x, splits)
        y_e, g_e = step(model, x, splits)
        t = tol if tol is not None else TOL[dtype] * 10
        for what, a, b in [("y", y_c, y_e), *[(f"grad[{i}]", a, b) for i, (a, b) in enumerate(zip(g_c, g_e))]]:
            scale = max(b.double().abs().max().item() if b.numel() else 0.0, 1.0)
            err = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
            assert a.shape == b.shape and a.dtype == b.dtype, (what, sizes)
            assert err <= t * scale, f"{what} at splits {sizes}: error {err} vs scale {scale} ({dtype})"
    return counter


def as_form(sizes: list[int], form: str, device) -> list[int] | torch.Tensor:
    """The splits as a ``list``, a ``tensor`` on the activations' device, or a ``cpu-tensor``."""
    forms = {
        "list": lambda: list(sizes),
        "tensor": lambda: torch.tensor(sizes, device=device),
        "cpu-tensor": lambda: torch.tensor(sizes),
    }
    return forms[form]()


def model_in(model) -> int:
    return (model.fc1 if isinstance(model, ExpertMLP) else model).in_features


def max_graphs(form: str, dynamic) -> int:  # form: "list", "tensor" or "cpu-tensor"
    """The bound (T fixed): a splits tensor's values are data, so one graph; so is a list with
    dynamic=True. With dynamic=None a list's first graph bakes its ints in, and the second makes
    them symbolic (routings whose first two differ in every count: see ROUTINGS)."""
    return 2 if form == "list" and not dynamic else 1
