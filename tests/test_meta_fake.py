"""Shape inference without data: the meta device, FakeTensorMode, FSDP2-style meta init and
torch.export, for every layer, path and dtype.

torch's grouped GEMM has a CPU kernel for float32/bfloat16/float16, but its meta (fake) rule
mirrors CUDA and takes bfloat16 only: on meta or fake tensors the reference kernels give
other dtypes an empty result of the right shape (NOTE: [Shapes only] in torch_ref.py), and
record the path a CPU run would take.
"""

from __future__ import annotations

import sys
import warnings

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

import functional_dw as fd
from functional_dw.kernels import get_kernels
from functional_dw.kernels.torch_ref import TORCH

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
PATHS = [None, True, False]
E, K, N, SPLITS = 3, 8, 16, [3, 0, 7]
T = sum(SPLITS)


def _cpu_path(dtype, path) -> str:
    """The path the real CPU run records."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, res = fd.grouped_linear_fwd(
            torch.randn(T, K, dtype=dtype), torch.randn(E, N, K, dtype=dtype), SPLITS, use_grouped_tensor=path
        )
    return res.path


def _grouped_fwd_bwd(device, dtype, path, form, bias):
    x = torch.randn(T, K, device=device, dtype=dtype, requires_grad=True)
    w = torch.randn(E, N, K, device=device, dtype=dtype, requires_grad=True)
    ws = w if form == "stacked" else list(w.unbind(0))
    b = torch.randn(E, N, device=device, dtype=dtype, requires_grad=True) if bias else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, res = fd.grouped_linear_fwd(x, ws, SPLITS, b, use_grouped_tensor=path)
        y = fd.grouped_linear(x, ws, SPLITS, b, use_grouped_tensor=path)
    y.sum().backward()
    assert y.shape == (T, N) and y.dtype == dtype and y.device.type == torch.device(device).type
    assert x.grad.shape == x.shape and w.grad.shape == w.shape
    if bias:
        assert b.grad.shape == b.shape
    return y, res


def _linear_fwd_bwd(device, dtype, bias):
    x = torch.randn(2, 5, K, device=device, dtype=dtype, requires_grad=True)
    w = torch.randn(N, K, device=device, dtype=dtype, requires_grad=True)
    b = torch.randn(N, device=device, dtype=dtype, requires_grad=True) if bias else None
    y = fd.linear(x, w, b)
    y.sum().backward()
    assert y.shape == (2, 5, N) and x.grad.shape == x.shape and w.grad.shape == w.shape
    return y


@pytest.mark.parametrize("form", ["list", "stacked"])
@pytest.mark.parametrize("path", PATHS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_meta_grouped_linear_forward_backward(dtype, path, form):
    y, res = _grouped_fwd_bwd("meta", dtype, path, form, bias=True)
    assert y.is_meta
    assert res.path == _cpu_path(dtype, path)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_meta_linear_forward_backward(dtype):
    assert _linear_fwd_bwd("meta", dtype, bias=True).is_meta


@pytest.mark.parametrize("path", PATHS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_meta_nn_modules(dtype, path):
    gl = fd.nn.GroupedLinear(E, K, N, params_dtype=dtype, device="meta", use_grouped_tensor=path)
    lin = fd.nn.Linear(N, K, params_dtype=dtype, device="meta")
    x = torch.randn(T, K, dtype=dtype, device="meta", requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        y = lin(gl(x, SPLITS))
    y.sum().backward()
    assert y.shape == (T, K) and x.grad.shape == (T, K)
    assert all(p.grad is not None and p.grad.shape == p.shape for p in [*gl.parameters(), *lin.parameters()])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fsdp2_style_meta_init(dtype):
    """Build on meta, ``to_empty(device="cpu")``, then reset or load the parameters, and run."""
    torch.manual_seed(0)
    ref = fd.nn.GroupedLinear(E, K, N, params_dtype=dtype)
    with torch.device("meta"):
        m = fd.nn.GroupedLinear(E, K, N, params_dtype=dtype)
    assert all(p.is_meta for p in m.parameters())
    m.to_empty(device="cpu")
    torch.manual_seed(0)
    m.reset_parameters()  # the same init, in the same order, as the eager constructor
    for (name, p), q in zip(m.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), name
    m2 = fd.nn.GroupedLinear(E, K, N, params_dtype=dtype, device="meta").to_empty(device="cpu")
    m2.load_state_dict(ref.state_dict())
    x = torch.randn(T, K, dtype=dtype)
    torch.testing.assert_close(m(x, SPLITS), ref(x, SPLITS), rtol=0, atol=0)
    torch.testing.assert_close(m2(x, SPLITS), ref(x, SPLITS), rtol=0, atol=0)
    lin = fd.nn.Linear(K, N, params_dtype=dtype, device="meta").to_empty(device="cpu")
    lin.reset_parameters()
    assert lin(x).shape == (T, N)


@pytest.mark.parametrize("form", ["list", "stacked"])
@pytest.mark.parametrize("path", PATHS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fake_cpu_tensors(dtype, path, form):
    with FakeTensorMode():
        y, res = _grouped_fwd_bwd("cpu", dtype, path, form, bias=True)
        assert isinstance(y, FakeTensor)
        _linear_fwd_bwd("cpu", dtype, bias=True)
    assert res.path == _cpu_path(dtype, path)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only build's fake CUDA tensors")
def test_fake_cuda_tensors_pick_a_path_without_te():
    """This CPU build makes fake CUDA tensors, but views of them (select, unbind), copies to
    them and autograd on them need CUDA support it lacks, so a layer cannot run end to end
    here. What can be checked: the backend choice (TE is never imported when it is not
    installed; with TE a fake routes to te_ops' custom ops, whose fake rules give shapes) and
    the grouped-path rule (no GPU is asked for its capability)."""
    with FakeTensorMode():
        x = torch.empty(T, K, device="cuda", dtype=torch.bfloat16)
        w = torch.empty(E, N, K, device="cuda", dtype=torch.bfloat16)
        assert isinstance(x, FakeTensor) and x.is_cuda
        if not fd.kernels.te_available():
            assert get_kernels(None, x) is TORCH
            assert "transformer_engine" not in sys.modules
        assert TORCH.grouped_path_unsupported(x, w) is None
        assert "bfloat16 only" in TORCH.grouped_path_unsupported(x.float(), w.float())


class _ExpertMLP(torch.nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.up = fd.nn.GroupedLinear(E, K, N, params_dtype=dtype)
        self.down = fd.nn.GroupedLinear(E, N, K, params_dtype=dtype)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x, SPLITS)), SPLITS)


@pytest.mark.parametrize("strict", [False, True], ids=["non-strict", "strict"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_torch_export_expert_mlp(dtype, strict):
    """Export traces the forward (inference graph) with list splits baked in: float32 as
    per-expert ``linear`` (grouped_mm's traced shape rule takes bf16 only), bfloat16 as
    grouped_mm on the module's weights list (the ``ref_weights_gmm`` op, which reads them in
    place at run time: NOTE: [One buffer]); the exported program gives the eager result bit for bit."""
    torch.manual_seed(0)
    m = _ExpertMLP(dtype)
    x = torch.randn(T, K, dtype=dtype)
    ep = torch.export.export(m, (x,), strict=strict)
    assert torch.equal(ep.module()(x), m(x))
    if not strict:  # (strict mode wraps the layers in a set_grad_enabled subgraph)
        ops = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
        assert ("functional_dw.ref_weights_gmm.default" in ops) == (dtype == torch.bfloat16), ops
