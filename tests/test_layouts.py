"""Layouts: whatever strides a caller or a saved-tensor hook hands over, the result is the
contiguous run's, bit for bit. (Also: a non-contiguous x is saved as given and differentiated
twice through, non-contiguous jvp tangents, and which grouped_mm operands must be copied.)

A drawn *layout* keeps a tensor's values and changes only where they live: the dims stored
in a drawn order (a transposed or permuted copy, as ``t.mT.contiguous().mT``), each dim
padded (a slice of a wider buffer, so rows are not 16-byte multiples apart), a storage offset,
odd strides on size-1 dims (which ``is_contiguous`` ignores), and for dy zero strides
(``expand``, what ``y.sum().backward()`` hands over). The padding is filled with NaN, so a
kernel that reads past the values poisons the result.

Each drawn case applies a layout to some of x, dy, the weights (list or stacked), the bias
(list or stacked), the fp32 ``main_grad`` (fused accumulation) and to the saved x through an
unpack hook, and compares output and every gradient with the run on contiguous copies, on
the reference backend, on both paths (``use_grouped_tensor`` None/True/False).

The rule: **bitwise** whenever the weights are contiguous. x, dy and the saved x reach the
GEMMs as dense copies (the same kernel on the same values, so the same bits), and the bias
and ``main_grad`` are only read or written elementwise. A weight in another layout is read
in place where the kernel takes it (a transposed weight by the split path's ``mm``, a
column-major one by ``grouped_mm``: no copy), and a CPU BLAS may then sum in another order
(e.g. a one-token ``[1, K]`` product as a GEMV): then within the dtype's tolerance of the
contiguous run. ``main_grad`` must be accumulated into the caller's own tensor.

Budget (``HYPOTHESIS_PROFILE``, default ``ci``): 40 grouped + 20 linear examples,
derandomized, one intra-op thread: a few seconds on 2 cores. ``long``: 1000 each.
"""

from __future__ import annotations

import importlib
import math
import os
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import functional_dw as fd
from conftest import PathRecorder, assert_close, assert_same
from helpers import grouped_inputs, ref_grouped

ref_mod = importlib.import_module("functional_dw.kernels.torch_ref")

PROFILES = {
    "ci": dict(
        examples={"grouped": 40, "linear": 20},
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow],
        print_blob=True,
    ),
    "long": dict(
        examples={"grouped": 1000, "linear": 1000},
        deadline=None,
        derandomize=False,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        print_blob=True,
    ),
}
PROFILE = PROFILES[os.environ.get("HYPOTHESIS_PROFILE", "ci")]


def profile(test: str) -> settings:
    kw = dict(PROFILE)
    return settings(max_examples=kw.pop("examples")[test], **kw)


DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --- layouts -------------------------------------------------------------------------------


@st.composite
def layouts(draw, ndim: int, expand: bool = False):
    """A layout for an ``ndim``-D tensor: None (contiguous) or a dict (see :func:`relayout`)."""
    if draw(st.booleans()):
        return None
    kind = draw(st.sampled_from(["strided", "strided", "odd_unit"] + (["expand_row", "expand_all"] if expand else [])))
    return dict(
        kind=kind,
        order=draw(st.permutations(range(ndim))),
        pads=draw(st.lists(st.sampled_from([0, 0, 1, 3, 5]), min_size=ndim, max_size=ndim)),
        offset=draw(st.integers(0, 5)),
        unit_stride=draw(st.integers(1, 7)),
    )


def relayout(t: torch.Tensor, lay: dict | None) -> torch.Tensor:
    """``t``'s values (not a view of ``t``) stored as ``lay`` says. ``expand_*`` layouts are
    handled by the caller (they change values); here they read as ``strided``."""
    if lay is None:
        return t.clone()
    order, pads, off = lay["order"], lay["pads"], lay["offset"]
    dims = [t.shape[d] + pads[i] for i, d in enumerate(order)]  # storage dims, outermost first
    buf = torch.full((off + math.prod(dims),), float("nan"), dtype=t.dtype)
    big = buf[off:].view(dims)
    view = big[tuple(slice(0, t.shape[d]) for d in order)]
    out = view.permute([order.index(d) for d in range(t.dim())])
    if lay["kind"] == "odd_unit" and 1 in t.shape:  # size-1 dims with arbitrary strides
        strides = [lay["unit_stride"] if n == 1 else s for n, s in zip(out.shape, out.stride())]
        out = out.as_strided(out.shape, strides)
    with torch.no_grad():
        out.copy_(t)
    return out


def dy_values(g: torch.Generator, shape: tuple, dtype: torch.dtype, lay: dict | None) -> torch.Tensor:
    """dy with the layout's values: ``expand_row`` one [N] row for every token, ``expand_all``
    one scalar everywhere (zero strides, as from ``y.sum()``); else drawn per element."""
    kind = lay["kind"] if lay else None
    if kind == "expand_row":
        return torch.randn(shape[-1], generator=g, dtype=torch.float64).to(dtype).expand(shape)
    if kind == "expand_all":
        return torch.randn((), generator=g, dtype=torch.float64).to(dtype).expand(shape)
    return relayout(torch.randn(shape, generator=g, dtype=torch.float64).to(dtype), lay)


class _Restride:
    """A saved-tensor hook that hands back the same values with other strides."""

    def __init__(self, lay: dict | None):
        self.lay, self.unpacked = lay, 0

    def __enter__(self):
        self._ctx = torch.autograd.graph.saved_tensors_hooks(lambda t: t, self._unpack)
        self._ctx.__enter__()

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)

    def _unpack(self, t):
        self.unpacked += 1
        return relayout(t.detach(), self.lay)


# --- cases ---------------------------------------------------------------------------------

ALIGNED = st.sampled_from([8, 16, 24])


@st.composite
def grouped_cases(draw):
    E = draw(st.integers(1, 5))
    dtype = draw(st.sampled_from(DTYPES))
    K, N = draw(ALIGNED), draw(ALIGNED)
    if draw(st.integers(0, 5)) == 0:  # sometimes unaligned: the grouped path falls back to split
        K = draw(st.sampled_from([3, 5]))
    splits = draw(st.lists(st.sampled_from([0, 1, 2, 5]), min_size=E, max_size=E))
    stacked = draw(st.booleans())
    bias = draw(st.sampled_from([None, "list", "stacked"]))
    fused = draw(st.booleans())
    return dict(
        E=E,
        K=K,
        N=N,
        dtype=dtype,
        splits=splits,
        stacked=stacked,
        bias=bias,
        fused=fused,
        path=draw(st.sampled_from([None, True, False])),
        seed=draw(st.integers(0, 2**16)),
        x=draw(layouts(2)),
        dy=draw(layouts(2, expand=True)),
        w=draw(layouts(3 if stacked else 2)),
        b=draw(layouts(2 if bias == "stacked" else 1)),
        mg=draw(layouts(3 if stacked else 2)) if fused else None,
        hook=draw(layouts(2)),
    )


def _grouped_run(case: dict, layout: bool):
    """One forward and backward; ``layout=False``: every operand contiguous, no hook."""
    g = torch.Generator().manual_seed(case["seed"])
    E, K, N, dt, T = case["E"], case["K"], case["N"], case["dtype"], sum(case["splits"])
    lay = (lambda name: case[name]) if layout else (lambda name: None)
    randn = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(dt)  # noqa: E731
    x = relayout(randn(T, K), lay("x")).requires_grad_()
    w_vals = randn(E, N, K)
    if case["stacked"]:
        ws = [relayout(w_vals, lay("w")).requires_grad_()]
    else:
        ws = [relayout(w, lay("w")).requires_grad_() for w in w_vals]
    b_vals = randn(E, N)
    bs = []
    if case["bias"] == "stacked":
        bs = [relayout(b_vals, lay("b")).requires_grad_()]
    elif case["bias"] == "list":
        bs = [relayout(b, lay("b")).requires_grad_() for b in b_vals]
    mgs = []
    if case["fused"]:
        mg_vals = torch.randn(E, N, K, generator=g)
        mgs = [relayout(mg_vals, lay("mg"))] if case["stacked"] else [relayout(m, lay("mg")) for m in mg_vals]
        for w, m in zip(ws, mgs):
            w.main_grad = m
    dy = dy_values(g, (T, N), dt, case["dy"])
    if not layout:
        dy = dy.contiguous()
    weights = ws[0] if case["stacked"] else ws
    bias = None if case["bias"] is None else (bs[0] if case["bias"] == "stacked" else bs)
    hook = _Restride(lay("hook"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback warning (unaligned K, fp64)
        with hook:
            rec = PathRecorder()
            y = fd.grouped_linear(
                x,
                weights,
                case["splits"],
                bias,
                fuse_wgrad_accumulation=case["fused"],
                use_grouped_tensor=case["path"],
                backend=rec,
            )
    y.backward(dy)
    rec.check(case["path"], x, weights)
    assert hook.unpacked == 1
    for w, m in zip(ws, mgs):
        assert w.main_grad is m, "main_grad must be the caller's tensor, accumulated in place"
    return dict(y=y.detach(), dx=x.grad, dw=[w.grad for w in ws], db=[b.grad for b in bs], mg=mgs)


@profile("grouped")
@given(case=grouped_cases())
def test_grouped_linear_any_layout_is_bitwise_the_contiguous_run(case):
    want = _grouped_run(case, layout=False)
    got = _grouped_run(case, layout=True)
    _compare(got, want, case)


@st.composite
def linear_cases(draw):
    lead = tuple(draw(st.lists(st.sampled_from([1, 2, 3, 5]), min_size=1, max_size=2)))
    nd = len(lead) + 1
    fused = draw(st.booleans())
    return dict(
        lead=lead,
        K=draw(st.sampled_from([1, 8, 13])),
        N=draw(st.sampled_from([1, 8, 13])),
        dtype=draw(st.sampled_from(DTYPES)),
        bias=draw(st.booleans()),
        fused=fused,
        seed=draw(st.integers(0, 2**16)),
        x=draw(layouts(nd)),
        dy=draw(layouts(nd, expand=True)),
        w=draw(layouts(2)),
        b=draw(layouts(1)),
        mg=draw(layouts(2)) if fused else None,
        hook=draw(layouts(nd)),
    )


def _linear_run(case: dict, layout: bool):
    g = torch.Generator().manual_seed(case["seed"])
    K, N, dt = case["K"], case["N"], case["dtype"]
    lay = (lambda name: case[name]) if layout else (lambda name: None)
    randn = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(dt)  # noqa: E731
    x = relayout(randn(*case["lead"], K), lay("x")).requires_grad_()
    w = relayout(randn(N, K), lay("w")).requires_grad_()
    b = relayout(randn(N), lay("b")).requires_grad_() if case["bias"] else None
    mg = None
    if case["fused"]:
        mg = relayout(torch.randn(N, K, generator=g), lay("mg"))
        w.main_grad = mg
    dy = dy_values(g, (*case["lead"], N), dt, case["dy"])
    if not layout:
        dy = dy.contiguous()
    hook = _Restride(lay("hook"))
    with hook:
        y = fd.linear(x, w, b, fuse_wgrad_accumulation=case["fused"])
    y.backward(dy)
    assert hook.unpacked == 1
    if mg is not None:
        assert w.main_grad is mg
    return dict(y=y.detach(), dx=x.grad, dw=w.grad, db=None if b is None else b.grad, mg=mg)


@profile("linear")
@given(case=linear_cases())
def test_linear_any_layout_is_bitwise_the_contiguous_run(case):
    want = _linear_run(case, layout=False)
    got = _linear_run(case, layout=True)
    _compare(got, want, case)


def _compare(got: dict, want: dict, case: dict) -> None:
    """Bitwise, or (weights in another layout) within the dtype's tolerance; see the docstring."""
    for key in want:
        if case["w"] is None:
            assert_same(got[key], want[key], key)
            continue
        gs, ws = (got[key], want[key]) if isinstance(want[key], list) else ([got[key]], [want[key]])
        for g, w in zip(gs, ws):
            assert (g is None) == (w is None), key
            if w is not None:
                assert g.dtype == w.dtype and g.shape == w.shape, key
                assert_close(g, w, torch.float32 if w.dtype == torch.float64 else w.dtype, key)


# --- pinned cases (each failed before: a stride error or a refusal) ---------------------------


def _grouped(x, ws, splits, **kw):
    y = fd.grouped_linear(x, ws, splits, **kw)
    y.backward(torch.ones_like(y))
    return y


@pytest.mark.parametrize("form", ["list", "stacked"])
def test_hook_returning_transposed_copy_on_grouped_path(form):
    x = torch.randn(10, 8, requires_grad=True)  # T = 10: a column-major x has a 40-byte stride
    w = torch.randn(3, 16, 8)
    ws = w.requires_grad_() if form == "stacked" else [t.requires_grad_() for t in w.clone().unbind(0)]
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t.t().contiguous().t()):
        y = fd.grouped_linear(x, ws, [3, 0, 7])
    y.backward(torch.ones_like(y))
    x2 = x.detach().clone().requires_grad_()
    ws2 = (
        w.detach().clone().requires_grad_() if form == "stacked" else [t.detach().clone().requires_grad_() for t in ws]
    )
    _grouped(x2, ws2, [3, 0, 7])
    assert_same(x.grad, x2.grad)
    assert_same(
        w.grad if form == "stacked" else [t.grad for t in ws], ws2.grad if form == "stacked" else [t.grad for t in ws2]
    )


@pytest.mark.parametrize("view", ["slice", "transposed"])
def test_stacked_weight_views(view):
    w = torch.randn(3, 16, 8)
    if view == "slice":  # rows 11 elements apart: not a 16-byte multiple
        big = torch.full((3, 16, 11), float("nan"))
        big[:, :, :8] = w
        wv = big[:, :, :8].requires_grad_()
    else:  # a [E, K, N] buffer viewed as [E, N, K], with N not a 16-byte multiple apart
        w = torch.randn(3, 12, 8)
        big = torch.full((3, 8, 13), float("nan"))
        big[:, :, :12] = w.transpose(1, 2)
        wv = big[:, :, :12].transpose(1, 2).requires_grad_()
    x = torch.randn(10, 8, requires_grad=True)
    y = _grouped(x, wv, [3, 0, 7])
    w2 = w.clone().requires_grad_()
    x2 = x.detach().clone().requires_grad_()
    assert_same(y.detach(), _grouped(x2, w2, [3, 0, 7]).detach())
    assert_same(x.grad, x2.grad)
    assert_same(wv.grad, w2.grad)


def test_single_token_row_with_odd_stride_on_grouped_path():
    big = torch.randn(2, 11)
    x = big[:1, :8].requires_grad_()  # "contiguous", but its one row is 11 elements apart
    ws = [torch.randn(8, 8, requires_grad=True) for _ in range(2)]
    _grouped(x, ws, [0, 1])
    assert x.grad.shape == (1, 8)


@pytest.mark.parametrize("layer", ["linear", "grouped"])
@pytest.mark.parametrize("path", [None, False])
def test_fused_wgrad_into_transposed_main_grad(layer, path):
    x = torch.randn(6, 8)
    ws = [torch.randn(16, 8, requires_grad=True) for _ in range(2)]
    for w in ws:
        w.main_grad = torch.ones(8, 16).t()  # a transposed view: not contiguous
    ref = [torch.ones(16, 8) for _ in ws]
    if layer == "linear":
        fd.linear(x, ws[0], fuse_wgrad_accumulation=True).sum().backward()
        ref[0] += torch.ones(6, 16).t() @ x
        ws, ref = ws[:1], ref[:1]
    else:
        rec = PathRecorder()
        fd.grouped_linear(
            x, ws, [2, 4], fuse_wgrad_accumulation=True, use_grouped_tensor=path, backend=rec
        ).sum().backward()
        rec.check(path, x, ws)
        for e, xe in enumerate(x.split([2, 4])):
            ref[e] += torch.ones(xe.shape[0], 16).t() @ xe
    for w, r in zip(ws, ref):
        assert not w.main_grad.is_contiguous()
        torch.testing.assert_close(w.main_grad, r)


# --- a non-contiguous x: saved as given, second order through it; non-contiguous tangents ------

SPLITS = [2, 0, 3, 1]
E, T, K, N = len(SPLITS), sum(SPLITS), 16, 8
PATHS = [pytest.param(False, id="split"), pytest.param(True, id="grouped")]


def _group(dtype=torch.float32, seed=0, requires_grad=True):
    """x, weights and biases (lists); weights drawn / 4."""
    return grouped_inputs(SPLITS, K, N, seed=seed, dtype=dtype, w_div=4, dy=False, grad=requires_grad)[:3]


def test_non_contiguous_x_is_saved_as_given():
    """The residuals hold x itself (not forward's dense copy), so an in-place change is seen."""
    x, ws, _ = _group(requires_grad=False)
    xt = x.t().contiguous().t()
    y, res = fd.grouped_linear_fwd(xt, ws, SPLITS)
    assert res.x_TK is xt
    xt.mul_(2)
    with pytest.raises(RuntimeError, match="x was modified in place"):
        fd.grouped_linear_bwd(res, torch.ones_like(y))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("layer", ["linear", "grouped"])
def test_second_order_through_a_non_contiguous_x(layer, path):
    """The x term of d(dW)/dx survives when forward had to copy x (found by an adversarial pass)."""
    x, ws, _ = _group(torch.float64)
    xt = x.detach().t().contiguous().t().requires_grad_()
    f = (
        (lambda x, w: fd.linear(x, w[0]))
        if layer == "linear"
        else (lambda x, w: fd.grouped_linear(x, w, SPLITS, use_grouped_tensor=path))
    )
    ref = (lambda x, w: x @ w[0].T) if layer == "linear" else (lambda x, w: ref_grouped(x, w, SPLITS))
    params = [xt, ws[0]] if layer == "linear" else [xt, *ws]
    out = []
    for fn in (f, ref):
        g = torch.autograd.grad(fn(xt, ws).square().sum(), params, create_graph=True)
        out.append(torch.autograd.grad(sum(t.sum() for t in g), params))
    for a, b in zip(*out):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("stacked", [False, True], ids=["list", "stacked"])
def test_jvp_with_non_contiguous_tangents_on_the_grouped_path(stacked):
    x, ws, _ = _group(requires_grad=False)
    W = torch.stack(ws) if stacked else ws
    xt = x.t().contiguous().t()
    tx = torch.randn(K, T).t()
    tW = torch.randn(E, K, N).transpose(1, 2) if stacked else [torch.randn(K, N).t() for _ in range(E)]
    y, ty = torch.func.jvp(lambda x, W: fd.grouped_linear(x, W, SPLITS, use_grouped_tensor=True), (xt, W), (tx, tW))
    _, want = torch.func.jvp(lambda x, W: ref_grouped(x, W, SPLITS), (xt, W), (tx, tW))
    torch.testing.assert_close(ty, want)


# --- grouped_mm operands: kept as they are where grouped_mm takes them, else one dense copy ----

_F32, _BF16 = torch.float32, torch.bfloat16  # a = 16 bytes / element size: 4 and 8 elements

_LAYOUTS = [  # (device, dtype, size, stride, storage offset, kept)
    ("cpu", _F32, (4, 8), (8, 1), 0, True),  # row-major
    ("cpu", _F32, (3, 4, 8), (32, 8, 1), 0, True),
    ("cpu", _F32, (4, 8), (12, 1), 0, True),  # rows of a wider buffer, 48-byte stride
    ("cpu", _F32, (4, 8), (10, 1), 0, False),  # 40-byte rows
    ("cpu", _F32, (4, 8), (1, 4), 0, True),  # column-major, 16-byte columns
    ("cpu", _F32, (4, 8), (1, 6), 0, False),  # column-major, 24-byte columns
    ("cpu", _F32, (4, 8), (1, 2), 0, False),  # columns overlap
    ("cpu", _F32, (4, 2), (1, 4), 0, True),
    ("cpu", _F32, (1, 8), (3, 1), 0, False),  # one row, an odd stride is_contiguous() ignores
    ("cpu", _F32, (1, 8), (8, 1), 0, True),
    ("cpu", _F32, (1, 8), (12, 1), 0, True),
    ("cpu", _F32, (8, 1), (4, 1), 0, True),  # one column, row stride 16 bytes
    ("cpu", _F32, (4, 1), (1, 4), 0, True),
    ("cpu", _F32, (8, 1), (1, 1), 0, True),  # contiguous: the CPU kernel takes it as it is
    ("cuda", _BF16, (8, 1), (1, 1), 0, True),  # contiguous with an aligned start
    ("cuda", _BF16, (8, 1), (1, 1), 2, False),  # contiguous, 4-byte aligned start
    ("cpu", _F32, (4, 8), (8, 1), 2, True),  # an offset is fine on the CPU
    ("cuda", _BF16, (4, 8), (8, 1), 0, True),
    ("cuda", _BF16, (4, 8), (8, 1), 8, True),
    ("cuda", _BF16, (4, 8), (8, 1), 4, False),  # 8-byte aligned start
    ("cuda", _BF16, (4, 8), (16, 1), 4, False),
    ("cuda", _BF16, (4, 8), (16, 1), 8, True),
    ("cuda", _BF16, (4, 8), (1, 8), 0, True),
    ("cuda", _BF16, (4, 8), (1, 4), 0, False),
    ("cuda", _BF16, (3, 4, 8), (32, 8, 1), 0, True),
    ("cuda", _BF16, (3, 4, 8), (40, 8, 1), 0, True),  # batch stride 80 bytes
    ("cuda", _BF16, (3, 4, 8), (36, 8, 1), 0, False),  # batch stride 72 bytes
    ("cuda", _BF16, (3, 4, 8), (36, 8, 1), 8, False),
    ("cuda", _BF16, (1, 8), (8, 1), 0, True),
    ("cuda", _BF16, (1, 8), (8, 1), 4, False),
    ("cuda", _BF16, (1, 8), (3, 1), 0, False),
]


@pytest.mark.parametrize(
    "case", _LAYOUTS, ids=lambda c: f"{c[0]}-{c[2]}-{c[3]}-off{c[4]}-{'kept' if c[5] else 'copied'}"
)
def test_grouped_mm_operands_copied_only_when_they_must(case):
    from torch._subclasses.fake_tensor import FakeTensorMode

    device, dtype, size, stride, offset, kept = case
    with FakeTensorMode() if device == "cuda" else torch.device("cpu"):  # CUDA: fake tensors
        base = (
            torch.arange(200, dtype=torch.float32).to(dtype)
            if device == "cpu"
            else torch.empty(200, dtype=dtype, device="cuda")
        )
        t = base.as_strided(size, stride, offset)
        out = ref_mod._mm_ready(t)
        assert (out is t) == kept
        if not kept:
            assert out.is_contiguous() and out.stride() == torch.empty(size).stride()
            if device == "cpu":
                assert torch.equal(out, t)
