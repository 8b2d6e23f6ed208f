"""Splits (tokens per expert): the forms a caller may pass (lists, tuples, numpy arrays and ints,
tensors on the host or the device), host counts validated, device counts made memory-safe
without a sync (clamped, never wrapping near int64's limit, eager and compiled), and traced
splits always a tensor. (The GPU side: test_splits_gpu.py.)"""

from __future__ import annotations

import importlib
from unittest import mock

import numpy as np
import pytest
import torch

import functional_dw as fd
from functional_dw.kernels import Splits
from helpers import grouped_inputs, randn, ref_grouped

gl_mod = importlib.import_module("functional_dw.grouped_linear")  # (fd.grouped_linear is the function)

SPLITS = [2, 0, 3, 1]
E, T, K, N = len(SPLITS), sum(SPLITS), 16, 8
PATHS = [pytest.param(False, id="split"), pytest.param(True, id="grouped")]


def _group(dtype=torch.float32, seed=0, requires_grad=True):
    """x, weights and biases (lists); weights drawn / 4."""
    return grouped_inputs(SPLITS, K, N, seed=seed, dtype=dtype, w_div=4, dy=False, grad=requires_grad)[:3]


# --- forms: any sequence of weights and biases, numpy splits -----------------------------------


@pytest.mark.parametrize("path", PATHS)
def test_parameter_lists_and_numpy_splits(path):
    x, ws, bs = _group()
    pw = torch.nn.ParameterList([torch.nn.Parameter(w.detach().clone()) for w in ws])
    pb = torch.nn.ParameterList([torch.nn.Parameter(b.detach().clone()) for b in bs])
    for splits in (np.array(SPLITS), [np.int64(s) for s in SPLITS], tuple(np.int32(s) for s in SPLITS)):
        y = fd.grouped_linear(x, pw, splits, pb, use_grouped_tensor=path)
        y.square().sum().backward()
    y_ref = ref_grouped(x, ws, SPLITS, bs)
    y_ref.square().sum().backward()
    torch.testing.assert_close(y, y_ref)
    for p, w in zip([*pw, *pb], [*ws, *bs]):
        torch.testing.assert_close(p.grad, 3 * w.grad)  # three calls accumulated
    y2, res = fd.grouped_linear_fwd(x, pw, np.array(SPLITS), pb, use_grouped_tensor=path)
    assert res.splits.host == tuple(SPLITS) and all(type(s) is int for s in res.splits.host)


# --- device counts near int64's limit; huge host counts ----------------------------------------


@pytest.mark.parametrize(
    "sizes,T,ends",
    [
        ([2**62, 2**62, 5], 10, [10, 10, 10]),
        ([3, 2**63 - 1, 2**63 - 1, 1], 9, [3, 9, 9, 9]),
        ([-(2**63), 2**62, 2**62], 4, [0, 4, 4]),
    ],
)
@pytest.mark.parametrize("compiled", [False, True])
def test_device_counts_near_int64s_limit_do_not_wrap(sizes, T, ends, compiled):
    # the running sum of counts such as 2**62 + 2**62 wrapped negative, the clamp kept it, and
    # the "memory-safe" ends went backwards (a negative count, rows read out of order)
    def run(t):
        s = Splits(host=None, tensor=t, device=torch.device("cpu"), num_tokens=T, num_experts=len(sizes))
        return s.ends(torch.int32), s.ends(torch.int64), s.on_device()

    if compiled:
        run = torch.compile(run, backend="aot_eager", fullgraph=True)
    e32, e64, counts = run(torch.tensor(sizes, dtype=torch.int64))
    assert e32.tolist() == ends and e64.tolist() == ends
    assert counts.tolist() == [b - a for a, b in zip([0] + ends[:-1], ends)]


def test_huge_host_readable_counts_are_refused_with_their_sum():
    # CPU split tensors are read on the host and validated: a clear error, not a wrapped sum
    x, ws = torch.randn(10, 8), [torch.randn(4, 8) for _ in range(3)]
    with pytest.raises(ValueError, match="must sum to x.shape"):
        fd.grouped_linear(x, ws, torch.tensor([2**62, 2**62, 5]))


# --- under a trace: a tensor, never host ints --------------------------------------------------


def test_splits_in_a_traced_graph_are_a_tensor_never_host_ints():
    x = randn(5, 8, dtype=torch.float64, draw_dtype=None)
    with mock.patch("torch.compiler.is_compiling", return_value=True):
        s = gl_mod.as_splits([2, 0, 3], 3, x)
    assert s.host is None and s.device == x.device and (s.num_tokens, s.num_experts) == (5, 3)
    assert s.tensor.dtype == torch.int64 and s.tensor.tolist() == [2, 0, 3]
    t = torch.tensor([2, 0, 3], dtype=torch.int32)
    with mock.patch("torch.compiler.is_compiling", return_value=True):
        s = gl_mod.as_splits(t, 3, x)
    assert s.host is None and s.tensor is not t and torch.equal(s.tensor, t)  # a copy: the buffer may be reused
