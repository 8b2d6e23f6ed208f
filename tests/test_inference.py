"""Forward passes with no backward to come: under ``torch.inference_mode`` and ``torch.no_grad``
the layers (functional and nn) build no residuals and record nothing, as torch.nn.Linear does;
weights made under inference_mode run in every grad mode, and still give dx for an x that
needs grad."""

from __future__ import annotations

import sys

import pytest
import torch

import functional_dw as fd
from helpers import grouped_inputs, ref_grouped

SPLITS = [2, 0, 3, 1]
E, T, K, N = len(SPLITS), sum(SPLITS), 16, 8


def _group(dtype=torch.float32, seed=0, requires_grad=True):
    """x, weights and biases (lists); weights drawn / 4."""
    return grouped_inputs(SPLITS, K, N, seed=seed, dtype=dtype, w_div=4, dy=False, grad=requires_grad)[:3]


@pytest.mark.parametrize("mode", ["inference_mode", "no_grad", "grad_enabled"])
@pytest.mark.parametrize("layer", ["linear", "grouped", "nn.Linear", "nn.GroupedLinear"])
def test_weights_made_under_inference_mode_run_forward(mode, layer):
    with torch.inference_mode():  # how a model is built or loaded for serving
        x, ws, bs = _group(requires_grad=False)
        lin, grp = fd.nn.Linear(K, N), fd.nn.GroupedLinear(E, K, N)
    call = {
        "linear": lambda: fd.linear(x, ws[0], bs[0]),
        "grouped": lambda: fd.grouped_linear(x, ws, SPLITS, bs),
        "nn.Linear": lambda: lin(x),
        "nn.GroupedLinear": lambda: grp(x, SPLITS),
    }[layer]
    want = {
        "linear": lambda: x @ ws[0].T + bs[0],
        "grouped": lambda: ref_grouped(x, ws, SPLITS, bs),
        "nn.Linear": lambda: x @ lin.weight.T + lin.bias,
        "nn.GroupedLinear": lambda: ref_grouped(x, grp.weights(), SPLITS, grp.biases()),
    }[layer]
    ctx = {"inference_mode": torch.inference_mode, "no_grad": torch.no_grad, "grad_enabled": torch.enable_grad}[mode]
    with ctx():
        y = call()
    # Parameters made under inference_mode say requires_grad=True, but autograd records nothing
    # through inference tensors: torch.nn.Linear's output has no grad_fn either.
    assert y.grad_fn is None and not y.requires_grad
    with torch.inference_mode():
        torch.testing.assert_close(y, want())


def test_inference_weights_with_an_x_that_needs_grad():
    """Weights held by reference are never saved, so inference-made weights still give dx."""
    with torch.inference_mode():
        _, ws, _ = _group(requires_grad=False)
    x = torch.randn(T, K, requires_grad=True)
    y = fd.grouped_linear(x, ws, SPLITS)
    (dx,) = torch.autograd.grad(y.square().sum(), x)
    xr = x.detach().clone().requires_grad_()
    (want,) = torch.autograd.grad(ref_grouped(xr, [w.clone() for w in ws], SPLITS).square().sum(), xr)
    torch.testing.assert_close(dx, want)


def test_no_grad_forward_builds_no_residuals(monkeypatch):
    """Under no_grad the bridge calls the layer's primal: no record, no autograd node."""
    gl = sys.modules["functional_dw.grouped_linear"]  # (fd.grouped_linear is the function)
    built = []
    monkeypatch.setattr(gl, "GroupedLinearResiduals", lambda **kw: built.append(kw))
    x, ws, bs = _group()
    with torch.no_grad():
        y = fd.grouped_linear(x, ws, SPLITS, bs)
    assert built == [] and y.grad_fn is None
    torch.testing.assert_close(y, ref_grouped(x, ws, SPLITS, bs).detach())


def test_enable_grad_inside_inference_mode_records_nothing_like_torch():
    x = torch.randn(T, K, requires_grad=True)
    w = torch.randn(N, K, requires_grad=True)
    with torch.inference_mode(), torch.enable_grad():
        y, ref = fd.linear(x, w), torch.nn.functional.linear(x, w)
    assert ref.grad_fn is None and y.grad_fn is None and not y.requires_grad
