"""torch.compile of a grouped MLP block on the reference backend: no graph breaks, eager numerics."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import functional_dw as fd
from conftest import HOOKS

SPLITS = (2, 0, 4)
E, H, FF, T = 3, 16, 32, sum(SPLITS)


def _params(dtype, stacked, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype).requires_grad_()
    w1 = [(torch.randn(FF, H, generator=g) / 4).to(dtype).requires_grad_() for _ in range(E)]
    w2 = [(torch.randn(H, FF, generator=g) / 4).to(dtype).requires_grad_() for _ in range(E)]
    if stacked:
        w1, w2 = (torch.stack([w.detach() for w in ws]).requires_grad_() for ws in (w1, w2))
    b2 = torch.zeros(E, H, dtype=dtype, requires_grad=True)
    return x, w1, w2, b2


def _leaves(x, w1, w2, b2):
    return [x, *(w1 if isinstance(w1, list) else [w1]), *(w2 if isinstance(w2, list) else [w2]), b2]


def _block(path):
    def mlp(x, w1, w2, b2):
        h = fd.grouped_linear(x, w1, SPLITS, use_grouped_tensor=path)
        return fd.linear(fd.grouped_linear(F.gelu(h), w2, SPLITS, b2, use_grouped_tensor=path), torch.eye(H, dtype=x.dtype))
    return mlp


CASES = [(torch.float32, False, False), (torch.bfloat16, True, False), (torch.bfloat16, True, True)]
IDS = ["fp32-split-list", "bf16-grouped-list", "bf16-grouped-stacked"]


@pytest.mark.parametrize("dtype,path,stacked", CASES, ids=IDS)
def test_compile_fullgraph_matches_eager(dtype, path, stacked):
    torch._dynamo.reset()
    mlp = _block(path)
    args = _params(dtype, stacked)
    explained = torch._dynamo.explain(mlp)(*args)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1
    compiled = torch.compile(mlp, fullgraph=True)
    y_c = compiled(*args)
    g_c = torch.autograd.grad(y_c.float().square().sum(), _leaves(*args))
    y_e = mlp(*args)
    g_e = torch.autograd.grad(y_e.float().square().sum(), _leaves(*args))
    torch.testing.assert_close(y_c, y_e)
    for a, b in zip(g_c, g_e):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("dtype,path,stacked", [CASES[0], CASES[2]], ids=[IDS[0], IDS[2]])
def test_compiled_block_under_hooks_packs_no_weight(dtype, path, stacked):
    """The partitioner picks what a compiled graph saves; with per-expert GEMMs, or with a
    stacked [E, N, K] parameter, no weight (nor a copy of one) reaches the hooks. (With a
    list of weights on the grouped path the compiled graph saves its stacked copy: see README.)"""
    torch._dynamo.reset()
    args = _params(dtype, stacked)
    compiled = torch.compile(_block(path), fullgraph=True)
    rec = HOOKS["identity"]()
    with rec:
        y = compiled(*args)
    y.float().sum().backward()
    weight_shapes = {(FF, H), (H, FF), (E, FF, H), (E, H, FF), (H, H)}
    assert rec.packed
    assert all(tuple(t.shape) not in weight_shapes for t in rec.packed), [tuple(t.shape) for t in rec.packed]
