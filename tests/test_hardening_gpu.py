"""Issue 12's classes on the TE backend (H200): any layout gives the contiguous run's bits,
inference tensors, partly frozen groups with fused wgrad, main_grad dtypes, fake CUDA shapes.
Skips cleanly without CUDA or TE; fails (does not skip) on a machine where
FDW_EXPECT_GROUPED=1 says TE's grouped path must run."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("transformer_engine.pytorch", reason="needs Transformer Engine for PyTorch")

import functional_dw as fd  # noqa: E402
from conftest import assert_same  # noqa: E402
from functional_dw.kernels.te import TE  # noqa: E402

BF16, DEV = torch.bfloat16, "cuda"
E, K, N = 4, 256, 128
SIZES = [37, 0, 101, 62]
T = sum(SIZES)


def _paths():
    why = TE.grouped_path_unsupported(torch.empty(8, K, dtype=BF16, device=DEV), [torch.empty(N, K, dtype=BF16, device=DEV)])
    if why is not None and os.environ.get("FDW_EXPECT_GROUPED") == "1":
        raise AssertionError(f"FDW_EXPECT_GROUPED=1 but TE's grouped path cannot run: {why}")
    return [False] if why else [False, True]


PATHS = _paths()


def _data(experts=E, sizes=SIZES, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(sum(sizes), K, device=DEV, generator=g).to(BF16)
    ws = [(torch.randn(N, K, device=DEV, generator=g) / 16).to(BF16) for _ in range(experts)]
    bs = [torch.randn(N, device=DEV, generator=g).to(BF16) for _ in range(experts)]
    dy = torch.randn(sum(sizes), N, device=DEV, generator=g).to(BF16)
    return x, ws, bs, dy


def _strided(t: torch.Tensor) -> torch.Tensor:
    """The same values, column-major (a transposed copy viewed back)."""
    return t.t().contiguous().t() if t.dim() == 2 else t[None].expand(2, *t.shape)[1]


def _run(x, ws, bs, dy, sizes, path, fuse=False, main_grads=None):
    x = x.detach().clone().requires_grad_()
    params = [w.detach().requires_grad_() for w in ws]
    biases = [b.detach().requires_grad_() for b in bs]
    for p, mg in zip(params, main_grads or []):
        p.main_grad = mg
    splits = torch.tensor(sizes, device=DEV) if path else list(sizes)
    y, res = fd.grouped_linear_fwd(x, params, splits, biases, use_grouped_tensor=path, backend="te",
                                   fuse_wgrad_accumulation=fuse)
    assert res.path == ("grouped" if path else "split") and res.kernels.name == "te"
    dx, dws, dbs = fd.grouped_linear_bwd(res, dy)
    return y, dx, dws, dbs


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("operand", ["x", "weights", "bias", "dy"])
def test_te_any_layout_gives_the_contiguous_bits(path, operand):
    x, ws, bs, dy = _data()
    want = _run(x, ws, bs, dy, SIZES, path)
    if operand == "x":
        x = _strided(x)
    elif operand == "weights":
        ws = [_strided(w) for w in ws]
    elif operand == "bias":
        bs = [_strided(b) for b in bs]
    else:
        dy = _strided(dy)
    got = _run(x, ws, bs, dy, SIZES, path)
    for a, b in zip(got[:2], want[:2]):
        assert_same(a, b, operand)
    assert_same(list(got[2]), list(want[2]), f"{operand}: dW")
    assert_same(list(got[3]), list(want[3]), f"{operand}: db")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("experts", [4, 70])
def test_te_strided_main_grad_accumulates_into_the_callers_tensor(path, experts):
    sizes = [T // experts] * experts
    sizes[0] += T - sum(sizes)
    x, ws, bs, dy = _data(experts, sizes)
    dense = [torch.full((N, K), 0.25, device=DEV) for _ in range(experts)]
    strided = [torch.full((K, N), 0.25, device=DEV).t() for _ in range(experts)]
    _run(x, ws, bs, dy, sizes, path, fuse=True, main_grads=dense)
    _run(x, ws, bs, dy, sizes, path, fuse=True, main_grads=strided)
    for a, b in zip(strided, dense):
        assert not a.is_contiguous()
        assert_same(a.contiguous(), b, "main_grad")


@pytest.mark.parametrize("path", PATHS)
def test_te_partly_frozen_group_with_fused_wgrad(path):
    x, ws, bs, dy = _data()
    params = [w.detach().requires_grad_(e != 2) for e, w in enumerate(ws)]
    for e, p in enumerate(params):
        if e != 2:
            p.main_grad = torch.zeros(N, K, device=DEV)
    params[2].main_grad = torch.full((N, K), 7.0, device=DEV)  # frozen: untouched
    splits = torch.tensor(SIZES, device=DEV) if path else SIZES
    y = fd.grouped_linear(x, params, splits, fuse_wgrad_accumulation=True, use_grouped_tensor=path, backend="te")
    y.backward(dy)
    assert_same(params[2].main_grad, torch.full((N, K), 7.0, device=DEV))
    for e in (0, 1, 3):
        xe = x.float().split(SIZES)[e]
        dye = dy.float().split(SIZES)[e]
        torch.testing.assert_close(params[e].main_grad, dye.T @ xe, rtol=1e-2, atol=1e-2)


def test_te_refuses_a_float64_main_grad():
    x, ws, _, dy = _data()
    w = ws[0].detach().requires_grad_()
    w.main_grad = torch.zeros(N, K, dtype=torch.float64, device=DEV)
    y = fd.linear(x, w, fuse_wgrad_accumulation=True, backend="te")
    with pytest.raises(TypeError, match="main_grad is torch.float64, but backend='te'"):
        y.backward(dy)


@pytest.mark.parametrize("path", PATHS)
def test_te_inference_weights(path):
    with torch.inference_mode():
        x, ws, bs, _ = _data()
        mod = fd.nn.GroupedLinear(E, K, N, params_dtype=BF16, device=DEV, use_grouped_tensor=path, backend="te")
    splits = torch.tensor(SIZES, device=DEV) if path else SIZES
    with torch.inference_mode():
        y = fd.grouped_linear(x, ws, splits, bs, use_grouped_tensor=path, backend="te")
        ym = mod(x, splits)
    with torch.no_grad():
        y2 = fd.grouped_linear(x.clone(), [w.clone() for w in ws], splits, [b.clone() for b in bs],
                               use_grouped_tensor=path, backend="te")
    assert_same(y, y2)
    assert ym.shape == (T, N) and ym.grad_fn is None


def test_fake_cuda_tensors_get_shapes_from_te_ops():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(T, K, dtype=BF16, device=DEV, requires_grad=True)
        ws = [torch.empty(N, K, dtype=BF16, device=DEV, requires_grad=True) for _ in range(E)]
        for path in PATHS:
            y = fd.grouped_linear(x, ws, SIZES, use_grouped_tensor=path)
            assert y.shape == (T, N) and y.device.type == "cuda"
            y.sum().backward()
        assert x.grad.shape == (T, K) and ws[0].grad.shape == (N, K)
        assert fd.linear(x, ws[0]).shape == (T, N)
