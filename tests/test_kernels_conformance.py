"""One conformance suite for every ``Kernels`` object (``kernels/protocol.py``): the bf16 kernels
and each FP8 family's (NOTE: [FP8 kernels by family]) run the protocol's methods on small shapes,
empty experts included, against float64 torch within the output dtype's rounding.

A new backend is checked by adding one line to ``KERNELS`` below: how to make its operands from
plain tensors (identity for bf16 kernels; its own quantization for FP8 ones). The inputs are small
integers, which FP8 with power-of-two scales holds exactly, so every backend's product is the
float64 one rounded once to the output dtype. GPU-only backends (TE, Triton) are marked ``gpu``
and skip cleanly without CUDA, Transformer Engine or Triton.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Callable
from typing import Any

import pytest
import torch

from functional_dw import fp8
from functional_dw.fp8.spec import TensorSpec
from functional_dw.kernels import Splits, te_available

K, N = 32, 48  # in/out features: multiples of 16 (FP8's rule)
SPLITS = {"empty-middle": (16, 0, 32), "empty-ends": (0, 16, 0), "no-tokens": (0, 0)}
DT = torch.bfloat16
RTOL = 2.0**-8  # one bf16 rounding of an exact product (fp32 main_grad: exact)


def _current(role: str) -> TensorSpec:
    """Current scaling with power-of-two scales: the integer inputs quantize exactly."""
    return TensorSpec(role, "current", torch.float8_e4m3fn, power_2_scale=True)


def _rowwise(role: str) -> TensorSpec:
    return fp8.tensor_spec(fp8.RowwiseScaling(power_2_scale=True), role)


@dataclasses.dataclass(frozen=True)
class Case:
    """A kernels object and how its operands are made from plain tensors: ``act(k, t, splits,
    rowwise, columnwise)`` for x or dy (``splits`` None: one GEMM's), ``group(k, ws, rowwise,
    columnwise)`` for a group's weights, ``one(k, w, rowwise, columnwise)`` for one weight (None:
    a grouped-only backend, whose one-GEMM methods refuse with ValueError). ``fp8``: the layer
    sums the bias grad (``with_dbias`` refused)."""

    name: str
    kernels: Callable[[], Any]
    device: str
    act: Callable[..., Any]
    group: Callable[..., Any]
    one: Callable[..., Any] | None
    fp8: bool


def _plain_act(k, t, splits, rowwise, columnwise):
    return t


def _plain_group(k, ws, rowwise, columnwise):
    return list(ws)


def _plain_one(k, w, rowwise, columnwise):
    return w


def _q_act(k, t, splits, rowwise, columnwise):
    """Per-tensor FP8 (emulated, TE): one GEMM's x/dy, or each expert's rows."""
    spec = _current("input")
    if splits is None:
        return k.quantize(t, spec, rowwise=rowwise, columnwise=columnwise)
    return k.grouped_quantize(t, splits, spec, rowwise=rowwise, columnwise=columnwise)


def _q_group(k, ws, rowwise, columnwise):
    return [k.quantize(w, _current("weight"), rowwise=rowwise, columnwise=columnwise) for w in ws]


def _q_one(k, w, rowwise, columnwise):
    return k.quantize(w, _current("weight"), rowwise=rowwise, columnwise=columnwise)


def _rw_act(k, t, splits, rowwise, columnwise):
    return k.grouped_quantize(t, splits, _rowwise("input"), rowwise=rowwise, columnwise=columnwise)


def _rw_group(k, ws, rowwise, columnwise):
    return k.quantize_group(torch.stack(list(ws)), _rowwise("weight"), rowwise=rowwise, columnwise=columnwise)


def _torch():
    from functional_dw.kernels.torch_ref import TORCH

    return TORCH


def _emulated():
    from functional_dw.kernels.emulated import EMULATED

    return EMULATED


def _rowwise_kernels():
    from functional_dw.kernels.rowwise import ROWWISE

    return ROWWISE


def _te():
    from functional_dw.kernels.te import TE

    return TE


def _te_fp8():
    from functional_dw.kernels.te_fp8_gemm import TE_FP8

    return TE_FP8


class LoopKernels:
    """A bf16 backend written from scratch, as a user would add one (docs/design.md, "Add a
    backend"): this class and its line in ``KERNELS`` are the whole change. Each product runs
    per expert in float32 and rounds once to the operands' dtype; no one-kernel grouped path."""

    name = "loop"

    def fprop(self, x_TK, w_NK, b_N, *, split_accumulator=False):
        y = x_TK.float() @ w_NK.float().t()
        return (y if b_N is None else y + b_N.float()).to(x_TK.dtype)

    def dgrad(self, dy_TN, w_NK, *, split_accumulator=False):
        return (dy_TN.float() @ w_NK.float()).to(dy_TN.dtype)

    def wgrad(self, x_TK, dy_TN, *, out=None, accumulate=False, with_dbias=False, split_accumulator=False):
        dw = dy_TN.float().t() @ x_TK.float()
        db = dy_TN.float().sum(0).to(dy_TN.dtype) if with_dbias else None
        if out is None:
            return dw.to(x_TK.dtype), db
        out.add_(dw) if accumulate else out.copy_(dw)
        return out, db

    def grouped_path_unsupported(self, x_TK, w_ENK, recipe=None):
        return "the loop backend runs one GEMM per expert"

    def grouped_fprop(self, x_TK, w_ENK, b_EN, splits, grouped, *, split_accumulator=False):
        ws = list(w_ENK)
        parts = [
            self.fprop(x, ws[e], None if b_EN is None else b_EN[e]) for e, x in enumerate(x_TK.split(splits.sizes()))
        ]
        return torch.cat(parts)

    def grouped_dgrad(self, dy_TN, w_ENK, splits, grouped, *, split_accumulator=False):
        ws = list(w_ENK)
        return torch.cat([self.dgrad(dy, ws[e]) for e, dy in enumerate(dy_TN.split(splits.sizes()))])

    def grouped_wgrad(
        self, x_TK, dy_TN, splits, grouped, *, out=None, accumulate=False, with_dbias=False, split_accumulator=False
    ):
        pairs = zip(x_TK.split(splits.sizes()), dy_TN.split(splits.sizes()))
        got = [
            self.wgrad(x, dy, out=None if out is None else out[e], accumulate=accumulate, with_dbias=with_dbias)
            for e, (x, dy) in enumerate(pairs)
        ]
        dws = out if out is not None else torch.stack([dw for dw, _ in got])  # (the protocol: one [E, N, K])
        return dws, (torch.stack([db for _, db in got]) if with_dbias else None)


def _loop():
    return LoopKernels()


def _gpu(needs_te: bool = False, needs_triton: bool = False) -> list:
    why = None
    if not torch.cuda.is_available():
        why = "needs CUDA"
    elif needs_te and not te_available():
        why = "needs Transformer Engine"
    elif needs_triton and importlib.util.find_spec("triton") is None:
        why = "needs Triton"
    return [pytest.mark.gpu, pytest.mark.skipif(why is not None, reason=why or "")]


# one line per backend: (case, marks)
KERNELS = [
    (Case("torch", _torch, "cpu", _plain_act, _plain_group, _plain_one, fp8=False), []),
    (Case("loop", _loop, "cpu", _plain_act, _plain_group, _plain_one, fp8=False), []),
    (Case("emulated", _emulated, "cpu", _q_act, _q_group, _q_one, fp8=True), []),
    (Case("rowwise-torch", _rowwise_kernels, "cpu", _rw_act, _rw_group, None, fp8=True), []),
    (Case("te", _te, "cuda", _plain_act, _plain_group, _plain_one, fp8=False), _gpu(needs_te=True)),
    (Case("te-fp8", _te_fp8, "cuda", _q_act, _q_group, _q_one, fp8=True), _gpu(needs_te=True)),
    (Case("rowwise-triton", _rowwise_kernels, "cuda", _rw_act, _rw_group, None, fp8=True), _gpu(needs_triton=True)),
]
CASES = [pytest.param(case, marks=marks, id=case.name) for case, marks in KERNELS]


def _ints(*shape, seed: int, device: str) -> torch.Tensor:
    """Integers in [-4, 4] (FP8 with power-of-two scales holds them exactly), in bfloat16."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-4, 5, shape, generator=g).to(device=device, dtype=DT)


def _splits(sizes: tuple[int, ...], device: str) -> Splits:
    return Splits(
        host=tuple(sizes), tensor=None, device=torch.device(device), num_tokens=sum(sizes), num_experts=len(sizes)
    )


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape, (got.shape, want.shape)
    torch.testing.assert_close(got.double().cpu(), want, rtol=RTOL, atol=0.0)


def _f64(t: torch.Tensor) -> torch.Tensor:
    return t.double().cpu()


@pytest.mark.parametrize("case", CASES)
def test_one_gemm(case):
    """fprop (bias added), dgrad, wgrad (fresh, into ``out`` overwritten or accumulated, and the
    bias grad where the backend sums it); a grouped-only backend refuses them (ValueError)."""
    k, dev = case.kernels(), case.device
    x, w, dy, b = (
        _ints(16, K, seed=1, device=dev),
        _ints(N, K, seed=2, device=dev),
        _ints(16, N, seed=3, device=dev),
        _ints(N, seed=4, device=dev),
    )
    if case.one is None:
        for call in (lambda: k.fprop(x, w, b), lambda: k.dgrad(dy, w), lambda: k.wgrad(x, dy)):
            with pytest.raises(ValueError, match="grouped"):
                call()
        return
    xq, dyq = case.act(k, x, None, True, True), case.act(k, dy, None, True, True)
    wq = case.one(k, w, True, True)
    _close(k.fprop(xq, wq, b), _f64(x) @ _f64(w).t() + _f64(b))
    _close(k.fprop(xq, wq, None), _f64(x) @ _f64(w).t())
    _close(k.dgrad(dyq, wq), _f64(dy) @ _f64(w))
    dw_want = _f64(dy).t() @ _f64(x)
    dw, db = k.wgrad(xq, dyq)
    _close(dw, dw_want)
    assert db is None
    out = torch.full((N, K), 3.0, device=dev)
    assert k.wgrad(xq, dyq, out=out)[0] is out
    _close(out, dw_want)
    k.wgrad(xq, dyq, out=out, accumulate=True)
    _close(out, 2 * dw_want)
    _check_dbias(case, lambda: k.wgrad(xq, dyq, with_dbias=True)[1], _f64(dy).sum(0))


def _check_dbias(case, db: Callable[[], Any], want: torch.Tensor) -> None:
    """``with_dbias=True``: the bias grad (bf16 kernels); FP8 kernels either give it (TE's, from
    a dy quantized with its bias grad) or refuse with a ValueError that names ``with_dbias`` (the
    layer then sums it from its high-precision dy)."""
    if not case.fp8:
        _close(db(), want)
        return
    try:
        got = db()
    except ValueError as e:
        assert "with_dbias" in str(e), e
    else:
        _close(got, want)


def _group_inputs(case, sizes):
    dev = case.device
    T, E = sum(sizes), len(sizes)
    x, dy = _ints(T, K, seed=5, device=dev), _ints(T, N, seed=6, device=dev)
    ws, b = [_ints(N, K, seed=10 + e, device=dev) for e in range(E)], _ints(E, N, seed=7, device=dev)
    return x, dy, ws, b


def _group_reference(x, dy, ws, b, sizes):
    """(y, dx, dw_ENK, db_EN) in float64, per expert."""
    xs, dys = _f64(x).split(sizes), _f64(dy).split(sizes)
    y = torch.cat([xe @ _f64(w).t() + _f64(b[e]) for e, (xe, w) in enumerate(zip(xs, ws))])
    dx = torch.cat([dye @ _f64(w) for dye, w in zip(dys, ws)])
    dw = torch.stack([dye.t() @ xe for xe, dye in zip(xs, dys)])
    return y, dx, dw, torch.stack([dye.sum(0) for dye in dys])


def _paths(k, x, ws) -> list[bool]:
    """The paths to run: the split path, and the grouped one where the backend runs it."""
    return [False] + ([True] if k.grouped_path_unsupported(x, ws) is None else [])


@pytest.mark.parametrize("sizes", list(SPLITS.values()), ids=list(SPLITS))
@pytest.mark.parametrize("case", CASES)
def test_grouped_products(case, sizes):
    """grouped_fprop/dgrad/wgrad on either path the backend runs, experts without tokens
    included: y and dx rows per expert, dw one ``[E, N, K]`` tensor (zero for an empty expert),
    db where the backend sums it."""
    k = case.kernels()
    splits = _splits(sizes, case.device)
    x, dy, ws, b = _group_inputs(case, sizes)
    y_want, dx_want, dw_want, db_want = _group_reference(x, dy, ws, b, sizes)
    xq, dyq = case.act(k, x, splits, True, True), case.act(k, dy, splits, True, True)
    wq = case.group(k, ws, True, True)
    for grouped in _paths(k, x, ws):
        _close(k.grouped_fprop(xq, wq, b, splits, grouped), y_want)
        _close(
            k.grouped_fprop(xq, wq, None, splits, grouped), y_want - _f64(b).repeat_interleave(torch.tensor(sizes), 0)
        )
        _close(k.grouped_dgrad(dyq, wq, splits, grouped), dx_want)
        dw, db = k.grouped_wgrad(xq, dyq, splits, grouped)
        assert isinstance(dw, torch.Tensor), "grouped_wgrad without out returns one [E, N, K] tensor"
        _close(dw, dw_want)
        assert db is None
        _check_dbias(case, lambda: k.grouped_wgrad(xq, dyq, splits, grouped, with_dbias=True)[1], db_want)


@pytest.mark.parametrize("case", CASES)
def test_grouped_wgrad_into_main_grads(case):
    """``out``: E fp32 ``[N, K]`` main_grads written in place (overwritten, or added with
    ``accumulate``) and returned; an empty expert's gets zeros (or keeps its value when accumulating)."""
    k, sizes = case.kernels(), SPLITS["empty-middle"]
    splits = _splits(sizes, case.device)
    x, dy, ws, b = _group_inputs(case, sizes)
    dw_want = _group_reference(x, dy, ws, b, sizes)[2]
    xq, dyq = case.act(k, x, splits, False, True), case.act(k, dy, splits, False, True)
    for grouped in _paths(k, x, ws):
        out = [torch.full((N, K), 3.0, device=case.device) for _ in sizes]
        got, _ = k.grouped_wgrad(xq, dyq, splits, grouped, out=out)
        assert got is out
        _close(torch.stack(out), dw_want)
        k.grouped_wgrad(xq, dyq, splits, grouped, out=out, accumulate=True)
        _close(torch.stack(out), 2 * dw_want)


@pytest.mark.parametrize("case", CASES)
def test_quantized_operands_keep_the_copies_asked_for(case):
    """FP8 backends: an operand holds ``dtype`` (the source's) and ``shape``, ``with_usage`` keeps
    one copy, and its tensors are pytree leaves (it rides in a residuals record); the path
    verdict is None or a reason."""
    k, sizes = case.kernels(), SPLITS["empty-middle"]
    x, _, ws, _ = _group_inputs(case, sizes)
    why = k.grouped_path_unsupported(x, ws)
    assert why is None or (isinstance(why, str) and why)
    if not case.fp8:
        return
    q = case.act(k, x, _splits(sizes, case.device), True, True)
    parts = q if isinstance(q, list) else [q]
    assert all(p.dtype == DT for p in parts) and sum(p.shape[0] for p in parts) == x.shape[0]
    cols = [p.with_usage(rowwise=False, columnwise=True) for p in parts]
    leaves = torch.utils._pytree.tree_leaves(cols)
    assert leaves and all(isinstance(t, torch.Tensor) for t in leaves)
    assert len(leaves) < len(torch.utils._pytree.tree_leaves(parts))  # a copy was dropped


@pytest.mark.parametrize("layer", ["linear", "grouped_linear", "grouped_linear_one_weight"])
def test_a_new_backend_runs_the_layers(layer):
    """The toy backend above, passed as ``backend=``, trains both layers as the reference does:
    forward, and every gradient through autograd (a new backend needs no other file)."""
    import functional_dw as fd

    sizes, dev = SPLITS["empty-middle"], "cpu"
    x, dy, ws, b = _group_inputs(Case("loop", _loop, dev, _plain_act, _plain_group, _plain_one, False), sizes)
    x, dy = x.float(), dy.float()
    ws = torch.stack(ws).float() if layer == "grouped_linear_one_weight" else [w.float() for w in ws]

    def run(backend):
        leaves = [x.clone().requires_grad_()]
        if layer == "linear":
            leaves += [ws[0].clone().requires_grad_(), b[0].float().clone().requires_grad_()]
            y = fd.linear(leaves[0], leaves[1], leaves[2], backend=backend)
            y.backward(dy[:, :N] if y.shape == (x.shape[0], N) else dy)
            return y, [t.grad for t in leaves]
        w = ws.clone().requires_grad_() if isinstance(ws, torch.Tensor) else [w.clone().requires_grad_() for w in ws]
        bias = b.float().clone().requires_grad_()
        y = fd.grouped_linear(leaves[0], w, list(sizes), bias, backend=backend)
        y.backward(dy)
        return y, [leaves[0].grad, *([w.grad] if isinstance(w, torch.Tensor) else [t.grad for t in w]), bias.grad]

    (y, grads), (y_ref, grads_ref) = run(LoopKernels()), run("torch")
    torch.testing.assert_close(y, y_ref)
    assert len(grads) == len(grads_ref) and all(g is not None for g in grads)
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, g_ref)


@pytest.mark.parametrize("layer", ["linear", "grouped_linear", "grouped_mlp"])
def test_an_fp8_familys_kernels_without_a_recipe_are_refused(layer):
    """The FP8 families' kernels multiply FP8 operands only: as ``backend=`` of a call without a
    recipe they are refused naming the fix (they crashed deep inside: ``dequantize()`` of a
    plain tensor, ``rowwise_data``)."""
    import functional_dw as fd

    x = torch.randn(4, K)
    for k in (_emulated(), _rowwise_kernels()):
        with pytest.raises(TypeError, match=f"backend {type(k).__name__} multiplies FP8 operands only.*recipe="):
            if layer == "linear":
                fd.linear(x, torch.randn(N, K), backend=k)
            elif layer == "grouped_linear":
                fd.grouped_linear(x, [torch.randn(N, K)] * 2, [1, 3], backend=k)
            else:
                fd.grouped_mlp(x, [torch.randn(2 * N, K)] * 2, [torch.randn(K, N)] * 2, [1, 3], backend=k)
