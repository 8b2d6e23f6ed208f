"""torch.compile of a grouped MLP block on the reference backend: no graph breaks, eager numerics,
and one compiled graph for a new routing every step; no graph break where the grouped path
falls back to the split path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import functional_dw as fd
from conftest import HOOKS, assert_same
from helpers import grouped_inputs, ref_grouped
from support.compile_cases import check_routings, make_model, max_graphs

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
        return fd.linear(
            fd.grouped_linear(F.gelu(h), w2, SPLITS, b2, use_grouped_tensor=path), torch.eye(H, dtype=x.dtype)
        )

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


@pytest.mark.parametrize("dtype,path,stacked", CASES, ids=IDS)
def test_compiled_block_under_hooks_packs_no_weight(dtype, path, stacked):
    """The partitioner picks what a compiled graph saves; with per-expert GEMMs, a stacked
    [E, N, K] parameter, or a list of weights on the grouped path (which goes into the
    ref_weights_gmm op, not through a traced stack), no weight nor a copy of one reaches the hooks."""
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


@pytest.mark.parametrize("path,where", [(False, "inside"), (True, "around")], ids=["split-inside", "grouped-around"])
def test_compiled_under_autocast_is_eager_under_autocast(path, where):
    """fp32 parameters under bf16 autocast, entered inside the compiled function or around the
    call: no graph break, and the eager run's bf16 output and fp32 grads bitwise (NOTE:
    [Autocast] in functional_dw/_amp.py: the call decides AMP at its top, which dynamo traces
    and guards)."""
    torch._dynamo.reset()
    mlp = _block(path)

    def inside(*args):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return mlp(*args)

    f = inside if where == "inside" else mlp
    ctx = torch.autocast("cpu", dtype=torch.bfloat16, enabled=where == "around")
    args = _params(torch.float32, False)
    with ctx:
        explained = torch._dynamo.explain(f)(*args)
    assert explained.graph_break_count == 0, explained.break_reasons
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    results = []
    for run in (compiled, f):
        with ctx:
            y = run(*args)
        results.append([y, *torch.autograd.grad(y.float().square().sum(), _leaves(*args))])
    assert results[0][0].dtype == torch.bfloat16 and all(g.dtype == torch.float32 for g in results[0][1:])
    assert_same(results[0], results[1])


# --- a new routing every step (issue 12) -----------------------------------------------------
# NOTE: [Splits under torch.compile] (kernels/splits.py): the counts are data, so one compiled
# graph serves every routing. Each case compiles once (fullgraph) and runs ten routings with 0-
# and 1-token experts; every step's output and grads equal eager's. The grouped path on the CPU
# is torch's grouped_mm, which under compile takes bfloat16 only: other dtypes with
# use_grouped_tensor=True run the split path (asserted from the ops in the graph).

F32, BF16, F16, F64 = torch.float32, torch.bfloat16, torch.float16, torch.float64
# (dtype, use_grouped_tensor, bias): the layer runs each with a list (dynamic=None) and a tensor
# (dynamic=True); the expert MLP covers the other two (form, dynamic) pairs of each path.
LAYER_CASES = [
    (F32, False, True),
    (BF16, True, True),
    (F16, False, False),
    (F64, False, True),
    (F32, True, False),
    (BF16, False, False),
]


def _case_id(dtype, path, bias):
    return f"{str(dtype)[6:]}-{'grouped' if path else 'split'}-{'bias' if bias else 'nobias'}"


def _assert_path(ops, dtype, path):
    split_ops = {f"functional_dw.ref_split_{m}.default" for m in ("fprop", "dgrad", "wgrad")}
    if path and dtype == torch.bfloat16:
        assert any("grouped_mm" in o for o in ops) and not split_ops & ops, ops
    else:
        assert split_ops <= ops and not any("grouped_mm" in o for o in ops), ops


def _check(kind, dtype, path, bias, form, dynamic, backend="aot_eager"):
    model = make_model(kind, dtype, "cpu", path, bias, "torch")
    counter = check_routings(model, form, dynamic, "cpu", backend=backend)
    assert counter.graphs <= max_graphs(form, dynamic), counter.graphs
    _assert_path(counter.ops, dtype, path)


@pytest.mark.parametrize("form,dynamic", [("list", None), ("tensor", True)], ids=["list-dynNone", "tensor-dynTrue"])
@pytest.mark.parametrize("dtype,path,bias", LAYER_CASES, ids=[_case_id(*c) for c in LAYER_CASES])
def test_compiled_layer_new_routing_every_step(dtype, path, bias, form, dynamic):
    _check("layer", dtype, path, bias, form, dynamic)


@pytest.mark.parametrize(
    "dtype,path,form,dynamic",
    [
        (F32, False, "list", True),
        (BF16, True, "list", True),
        (BF16, True, "tensor", None),
    ],
    ids=["fp32-split-list-dynTrue", "bf16-grouped-list-dynTrue", "bf16-grouped-tensor-dynNone"],
)
def test_compiled_expert_mlp_new_routing_every_step(dtype, path, form, dynamic):
    _check("mlp", dtype, path, True, form, dynamic)


def test_compiled_expert_mlp_inductor():
    """The split path's custom ops through inductor (the other cases use aot_eager)."""
    _check("mlp", F32, False, True, "tensor", None, backend="inductor")


def test_compiled_split_path_validates_splits_at_run_time():
    """Under compile the split path's op reads the sizes at run time and checks them as eager
    does (the grouped path clamps them instead: NOTE: [Device splits are clamped])."""
    torch._dynamo.reset()
    model = make_model("layer", F32, "cpu", False, True, "torch")
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    x = torch.randn(12, 16)
    compiled(x, torch.tensor([3, 3, 3, 3]))
    with pytest.raises(ValueError, match="splits sum to 11"):
        compiled(x, torch.tensor([3, 3, 3, 2]))
    with pytest.raises(ValueError, match="non-negative"):
        compiled(x, torch.tensor([3, 3, 9, -3]))


# --- use_grouped_tensor=True where the compiled grouped GEMM cannot run ------------------------

FALLBACK_SPLITS = [2, 0, 3, 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_compile_with_grouped_fallback_has_no_graph_break(dtype):
    """use_grouped_tensor=True in a dtype the compiled grouped GEMM cannot take: the split path,
    no warnings.warn inside the trace (dynamo cannot trace it)."""
    torch._dynamo.reset()
    x, ws, _, _ = grouped_inputs(FALLBACK_SPLITS, 16, 8, dtype=dtype, w_div=4, dy=False, grad=True)
    f = lambda x, ws: fd.grouped_linear(x, ws, FALLBACK_SPLITS, use_grouped_tensor=True)  # noqa: E731
    explained = torch._dynamo.explain(f)(x, ws)
    assert explained.graph_break_count == 0, explained.break_reasons
    torch.testing.assert_close(
        torch.compile(f, fullgraph=True, backend="aot_eager")(x, ws), ref_grouped(x, ws, FALLBACK_SPLITS)
    )


def test_compiled_calls_trace_the_setup_context_bridge(monkeypatch):
    """Under compile the bridge is the setup_context Function dynamo is built for, never the
    eager-only lean one (NOTE: [The lean run]; torch 2.11's dynamo cannot trace the lean
    forward's record): a lean forward that raises is not reached by a fullgraph compile, and
    the compiled grads match eager's, with or without optree."""
    import importlib

    import torch.utils._pytree as pytree

    # Without optree (the GPU machine's case) the eager flattening is the Python pytree's too,
    # the one a compiled call uses: the bridge must still tell a compiled call from an eager one.
    for name in ("functional_dw.custom_vjp", "functional_dw._bridge_tree"):
        monkeypatch.setattr(importlib.import_module(name), "fast_pytree", pytree)
    torch._dynamo.reset()
    cube = fd.custom_vjp(lambda x: (x**3, (x,)), lambda res, g: (3 * res[0] ** 2 * g,), name="cube")
    x = torch.randn(5, requires_grad=True)
    want = torch.autograd.grad(cube(x).sum(), x)

    def lean_forward(ctx, *args):
        raise AssertionError("the lean bridge ran under torch.compile")

    monkeypatch.setattr(cube.Lean, "forward", staticmethod(lean_forward))
    with pytest.raises(AssertionError, match="lean bridge ran"):  # the patch reaches eager calls
        cube(x)
    got = torch.autograd.grad(torch.compile(lambda x: cube(x).sum(), backend="aot_eager", fullgraph=True)(x), x)
    torch.testing.assert_close(got, want)


def test_autocast_reaches_a_renamed_privateuse1_backend():
    """An out-of-tree backend renames privateuse1 (torch_npu: "npu"): autocast on it is still
    seen (the device types autocast serves are asked once, for dynamo's sake, and privateuse1
    by its current name). In a subprocess: a backend is renamed once per process."""
    import subprocess
    import sys

    code = """
import torch
torch.utils.rename_privateuse1_backend("npu")
from functional_dw import _amp
class OnNPU(torch.Tensor):
    @staticmethod
    def __new__(cls, shape):
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=torch.float32, device="npu")
    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError
x = OnNPU((4, 4))
torch.set_autocast_enabled("npu", True)
torch.set_autocast_dtype("npu", torch.float16)
assert torch.amp.is_autocast_available("npu")
assert _amp.dtype(x) == torch.float16, _amp.dtype(x)
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
