"""torch.compile with a new routing every step on CUDA, backends te, auto and torch (issue 12).

The same check as tests/test_compile.py (see NOTE: [Splits under torch.compile]): GroupedLinear
and a two-layer expert MLP, compiled once with fullgraph=True, run over ten routings with 0-
and 1-token experts; at most 2 graphs for a list with dynamic=None, else 1; outputs and grads
equal eager's; the ops in the captured graph show which kernels and path ran (for 'te' the
functional_dw::te_* custom ops). Splits go in as a list, a CUDA tensor or a CPU tensor.

CUDA cases are marked gpu and skip cleanly without CUDA (and 'te' without Transformer Engine).
The torch backend's cases also run on the CPU, so this file's logic is checked in CI.
"""

from __future__ import annotations

import pytest
import torch

import functional_dw as fd
from support.compile_cases import E, K, N, T, check_routings, make_model, max_graphs
from functional_dw.kernels import te_available

F32, BF16, F16, F64 = torch.float32, torch.bfloat16, torch.float16, torch.float64
CUDA = pytest.param(
    "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
)
FORMS = [("list", None), ("tensor", None), ("cpu-tensor", True), ("list", True)]
FORM_IDS = ["list-dynNone", "tensor-dynNone", "cputensor-dynTrue", "list-dynTrue"]
SPLIT_OPS = {f"functional_dw.ref_split_{m}.default" for m in ("fprop", "dgrad", "wgrad")}
TE_OPS = {f"functional_dw.te_grouped_{m}.default" for m in ("fprop", "dgrad", "wgrad")}


def _id(dtype, path, bias):
    return f"{str(dtype)[6:]}-{'grouped' if path else 'split'}-{'bias' if bias else 'nobias'}"


def _expected(backend, device, dtype, path):
    """(kernels, path) the compiled step must run: what eager picks, except that on the CPU
    torch's grouped_mm takes bfloat16 only under compile (elsewhere compile picks as eager)."""
    x = torch.zeros(T, K, dtype=dtype, device=device)
    ws = [torch.zeros(N, K, dtype=dtype, device=device) for _ in range(E)]
    res = fd.grouped_linear_fwd(x, ws, [T] + [0] * (E - 1), use_grouped_tensor=path, backend=backend)[1]
    ran = res.path
    if device == "cpu" and dtype != BF16:
        ran = "split"
    return res.kernels.name, ran


def _run(kind, backend, device, dtype, path, bias, form, dynamic, inner="aot_eager"):
    if backend == "te" and not te_available():
        pytest.skip("needs Transformer Engine")
    name, ran = _expected(backend, device, dtype, path)
    model = make_model(kind, dtype, device, path, bias, backend)
    counter = check_routings(model, form, dynamic, device, backend=inner)
    assert counter.graphs <= max_graphs(form, dynamic), counter.graphs
    ops = counter.ops
    if name == "te":  # TE's kernels as custom ops; their last argument says which path
        assert TE_OPS <= ops and not SPLIT_OPS & ops, ops
        fprops = [args for op, args in counter.calls if op == "functional_dw.te_grouped_fprop.default"]
        assert fprops and all(args[-1] == (ran == "grouped") for args in fprops), fprops
    elif ran == "grouped":
        assert any("grouped_mm" in o for o in ops) and not SPLIT_OPS & ops, ops
    else:
        assert SPLIT_OPS <= ops and not any("grouped_mm" in o for o in ops), ops


TE_CASES = [(F32, False, True), (BF16, False, False), (F16, False, True), (BF16, True, True), (F16, True, False)]


@pytest.mark.gpu
@pytest.mark.parametrize("form,dynamic", FORMS, ids=FORM_IDS)
@pytest.mark.parametrize("dtype,path,bias", TE_CASES, ids=[_id(*c) for c in TE_CASES])
def test_te_layer(dtype, path, bias, form, dynamic):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    _run("layer", "te", "cuda", dtype, path, bias, form, dynamic)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "dtype,path,form,dynamic,inner",
    [
        (BF16, True, "list", None, "aot_eager"),
        (F32, False, "tensor", True, "aot_eager"),
        (BF16, False, "tensor", None, "inductor"),
        (BF16, True, "cpu-tensor", None, "inductor"),
    ],
    ids=[
        "bf16-grouped-list-dynNone",
        "fp32-split-tensor-dynTrue",
        "bf16-split-tensor-inductor",
        "bf16-grouped-cputensor-inductor",
    ],
)
def test_te_expert_mlp(dtype, path, form, dynamic, inner):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    _run("mlp", "te", "cuda", dtype, path, True, form, dynamic, inner)


AUTO_CASES = [(BF16, True, True), (BF16, None, False), (F32, True, True), (F16, False, False)]


@pytest.mark.gpu
@pytest.mark.parametrize("form,dynamic", FORMS, ids=FORM_IDS)
@pytest.mark.parametrize("dtype,path,bias", AUTO_CASES, ids=[_id(*c) for c in AUTO_CASES])
def test_auto_layer(dtype, path, bias, form, dynamic):
    """auto: torch's grouped GEMM where it runs (bf16), else what None picks (TE, or torch)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    _run("layer", "auto", "cuda", dtype, path, bias, form, dynamic)


@pytest.mark.gpu
def test_auto_expert_mlp():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    _run("mlp", "auto", "cuda", BF16, True, True, "tensor", None, "inductor")


TORCH_CASES = [(BF16, True, True), (F32, False, True), (F64, False, False), (F16, True, False)]


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("form,dynamic", [FORMS[1], FORMS[2]], ids=[FORM_IDS[1], FORM_IDS[2]])
@pytest.mark.parametrize("dtype,path,bias", TORCH_CASES, ids=[_id(*c) for c in TORCH_CASES])
def test_torch_layer(dtype, path, bias, form, dynamic, device):
    _run("layer", "torch", device, dtype, path, bias, form, dynamic)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize(
    "dtype,path,form,dynamic",
    [(BF16, True, "list", None), (F32, False, "list", True)],
    ids=["bf16-grouped-list-dynNone", "fp32-split-list-dynTrue"],
)
def test_torch_expert_mlp(dtype, path, form, dynamic, device):
    _run("mlp", "torch", device, dtype, path, True, form, dynamic)
