"""Kernels obey the plan; the plan cache's contract; custom_vjp's ``nondiff_argnums``; which
kernel runs (grouped_mm on the grouped path only) and the fallback warning's text and line.

NOTE: [Plan once, run lean] (``functional_dw/plan.py``): ``grouped_linear`` decides its GEMM
path once, in ``grouped_plan.make_plan``; the layer routes products under transforms in one
place (``plan.route``), and the kernels run exactly the path they are told. The first part
records every product the reference backend runs (its GEMM entry points patched, below the
layer) together with the ``grouped`` flag each kernel call was given, for every path asked,
weight layout, recipe and mode, and checks: (1) every kernel call ran the path it was told and
nothing else, (2) forward ran ``res.path`` (the residual record's, read back from the graph
where autograd holds it), (3) backward ran what ``plan.route`` decided for it, and (4) both are
what the mode's rule says (NOTE: [Transforms without a rule]).

The second part holds the plan cache (``grouped_plan.PLANS``) to its contract: one plan
for a training loop, a new one whenever something a plan reads changes, never a skipped
check, nothing cached under transforms, correct under threads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import importlib
import inspect
import re
import threading
import types
import warnings
import weakref
from unittest import mock

import pytest
import torch
from conftest import FakeDW
from helpers import randn, ref_grouped

import functional_dw as fd
from functional_dw import fp8
from functional_dw._bridge_residuals import ctx_residuals
from functional_dw.grouped_plan import PLANS
from functional_dw.plan import Options
from functional_dw.kernels import packed

gl = importlib.import_module("functional_dw.grouped_linear")  # (fd.grouped_linear is the function)
cv = importlib.import_module("functional_dw.custom_vjp")  # (fd.custom_vjp is the function)
custom_vjp = cv.custom_vjp
ref_mod = importlib.import_module("functional_dw.kernels.torch_ref")
rowwise_ops = importlib.import_module("functional_dw.kernels.rowwise")
TorchKernels = ref_mod.TorchKernels
RowwiseKernels = rowwise_ops.RowwiseKernels
EmulatedKernels = importlib.import_module("functional_dw.kernels.emulated").EmulatedKernels

E, K, N = 3, 32, 48  # N != K: a grouped GEMM's kind is read off its operands' shapes
SPLITS = (16, 0, 32)  # FP8: each expert's tokens a multiple of 16 (an empty expert included)
T = sum(SPLITS)


@pytest.fixture(autouse=True)
def _fresh_plans():
    PLANS.clear()
    yield
    PLANS.clear()


# --- the GEMM recorder ---------------------------------------------------------------------------


@dataclasses.dataclass
class KernelCall:
    kind: str  # "fprop", "dgrad", "wgrad"
    told: str  # the path the layer asked for: "grouped" or "split"
    ran: tuple  # the products that ran inside this call: (kind, path) each


@dataclasses.dataclass
class Recording:
    n: int = N
    ran: list = dataclasses.field(default_factory=list)  # every product, in order: (kind, path)
    calls: list = dataclasses.field(default_factory=list)  # KernelCall per grouped_* call (eager only)
    prepared: list = dataclasses.field(default_factory=list)  # forward's GroupedCall (path after routing)
    res: list = dataclasses.field(default_factory=list)  # every residual record forward made
    bwd_routes: list = dataclasses.field(default_factory=list)  # backward's route: "grouped"/"split"

    def gemm(self, kind: str, path: str) -> None:
        self.ran.append((kind, path))

    def kind_of(self, b: torch.Tensor) -> str:
        """A grouped_mm's product from its second operand: ``[T, N]`` x ``[N, K]`` (wgrad, 2-D),
        ``[E, K, N]`` (fprop: ``W^T``) or ``[E, N, K]`` (dgrad)."""
        return "wgrad" if b.dim() == 2 else "fprop" if b.shape[-1] == self.n else "dgrad"

    def check_obeyed(self) -> None:
        """Every kernel call ran exactly the path it was told (grouped flag True <=> grouped GEMMs
        ran), only products of its own kind, at least one; and no product ran outside a call."""
        assert self.calls, "no kernel call was recorded"
        for c in self.calls:
            assert c.ran, f"{c.kind} told {c.told!r} ran no GEMM"
            assert set(c.ran) == {(c.kind, c.told)}, f"{c.kind} told {c.told!r} ran {c.ran}"
        assert sum(len(c.ran) for c in self.calls) == len(self.ran), (self.calls, self.ran)

    def told(self, *kinds: str) -> list[str]:
        return [c.told for c in self.calls if c.kind in kinds]


_ACTIVE: list[Recording] = []
_ORIG_GMM = ref_mod._torch_grouped_mm


@torch.library.custom_op("fd_test_plan::recorded_grouped_mm", mutates_args=())
def _recorded_gmm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """grouped_mm as an opaque op, so that a compiled graph calls back here at run time."""
    rec = _ACTIVE[-1]
    rec.gemm(rec.kind_of(b), "grouped")
    return _ORIG_GMM(a, b, offs=offs)


@_recorded_gmm.register_fake
def _(a, b, offs):
    if b.dim() == 3:
        return a.new_empty(a.shape[0], b.shape[-1])
    return a.new_empty(offs.shape[0], a.shape[0], b.shape[-1])


@contextlib.contextmanager
def recording(n: int = N):
    """Patch the reference backend's GEMM entry points (below the layer: what actually ran) and
    its three grouped_* methods (what the layer told them). While dynamo traces, nothing is
    recorded (a traced side effect is not a run); the compiled graph's products record at run
    time (the split path's custom ops, the opaque grouped_mm above, RowwiseScaling's ops)."""
    rec = Recording(n=n)

    def grouped_mm(a, b, offs=None):
        if torch.compiler.is_compiling():
            return _recorded_gmm(a, b, offs)
        rec.gemm(rec.kind_of(b), "grouped")
        return _ORIG_GMM(a, b, offs=offs)

    def split(name: str, kind: str):
        f = getattr(TorchKernels, name)

        def run(self, *args, **kwargs):
            if not torch.compiler.is_compiling():
                rec.gemm(kind, "split")
            return f(self, *args, **kwargs)

        return run

    def told(cls: type, name: str, kind: str):
        f = getattr(cls, name)
        sig = inspect.signature(f)

        def run(self, *args, **kwargs):
            if torch.compiler.is_compiling():
                return f(self, *args, **kwargs)
            grouped = sig.bind(self, *args, **kwargs).arguments["grouped"]
            assert isinstance(grouped, bool), grouped
            start = len(rec.ran)
            out = f(self, *args, **kwargs)
            rec.calls.append(KernelCall(kind, "grouped" if grouped else "split", tuple(rec.ran[start:])))
            return out

        return run

    def rowwise(name: str):  # RowwiseScaling: one grouped GEMM per product (RowwiseKernels calls rowwise_ops.<name>)
        f = getattr(rowwise_ops, name)

        def run(*args, **kwargs):
            if not torch.compiler.is_compiling():
                rec.gemm(name, "grouped")
            return f(*args, **kwargs)

        return run

    def spy(name: str, keep):
        f = getattr(gl, name)

        def run(*args, **kwargs):
            out = f(*args, **kwargs)
            if not torch.compiler.is_compiling():
                keep(out)
            return out

        return run

    with contextlib.ExitStack() as stack:
        patch = lambda obj, name, new: stack.enter_context(mock.patch.object(obj, name, new))
        patch(ref_mod, "_torch_grouped_mm", grouped_mm)
        for kind in ("fprop", "dgrad", "wgrad"):
            patch(TorchKernels, f"split_{kind}", split(f"split_{kind}", kind))
            for cls in (TorchKernels, EmulatedKernels, RowwiseKernels):  # bf16, and each FP8 family's on torch
                patch(cls, f"grouped_{kind}", told(cls, f"grouped_{kind}", kind))
            patch(rowwise_ops, kind, rowwise(kind))
        patch(gl, "prepare", spy("prepare", rec.prepared.append))
        patch(gl, "forward", spy("forward", lambda out: rec.res.append(out[1])))
        patch(
            gl, "_checked", spy("_checked", lambda out: rec.bwd_routes.append("grouped" if out[1].grouped else "split"))
        )
        _ACTIVE.append(rec)
        try:
            yield rec
        finally:
            _ACTIVE.pop()


def test_recorder_sees_every_product_and_catches_a_kernel_that_disobeys():
    """The recorder itself: it classifies each product, and a kernel that runs another path than
    it was told fails check_obeyed (so the grid below can fail)."""
    x, ws = _x(torch.float32).requires_grad_(), _weights("list", torch.float32)
    with recording() as rec:
        fd.grouped_linear(x, ws, SPLITS, use_grouped_tensor=True).sum().backward()
    assert rec.ran == [("fprop", "grouped"), ("dgrad", "grouped"), ("wgrad", "grouped")]
    rec.check_obeyed()

    real = TorchKernels.grouped_dgrad

    def disobeying(self, dy, w, splits, grouped, **kw):  # a kernel that re-decides the path
        return real(self, dy, w, splits, True, **kw)

    with mock.patch.object(TorchKernels, "grouped_dgrad", disobeying), recording() as rec:
        fd.grouped_linear(x, ws, SPLITS, use_grouped_tensor=False).sum().backward()
    with pytest.raises(AssertionError, match="dgrad told 'split' ran"):
        rec.check_obeyed()


# --- inputs --------------------------------------------------------------------------------------


def _x(dtype, seed: int = 1, T_: int = T, K_: int = K) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(T_, K_, generator=g) / 4).to(dtype)


def _w_ENK(dtype, seed: int = 0, N_: int = N, K_: int = K) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(E, N_, K_, generator=g) / 8).to(dtype)


def _module(dtype, N_: int = N, K_: int = K, bias: bool = False, seed: int = 0) -> fd.nn.GroupedLinear:
    m = fd.nn.GroupedLinear(E, K_, N_, bias=bias, params_dtype=dtype)
    with torch.no_grad():
        for p, w in zip(m.weights(), _w_ENK(dtype, seed, N_, K_)):
            p.copy_(w)
    return m


def _weights(layout: str, dtype, requires_grad: bool = True):
    """The same values in each layout: E separate ``[N, K]`` tensors, the E one-buffer
    parameters of an ``nn.GroupedLinear``, or one stacked ``[E, N, K]`` tensor."""
    if layout == "stacked":
        return _w_ENK(dtype).requires_grad_(requires_grad)
    if layout == "list":
        return [w.clone().requires_grad_(requires_grad) for w in _w_ENK(dtype)]
    ws = _module(dtype).weights()
    assert packed(ws, layout_only=True) is not None  # one buffer indeed
    for w in ws:
        w.requires_grad_(requires_grad)
    return ws


def _as_list(ws) -> list[torch.Tensor]:
    return list(ws.unbind(0)) if isinstance(ws, torch.Tensor) else list(ws)


# --- every path, layout, recipe and mode ---------------------------------------------------------

LAYOUTS = ("list", "one_buffer", "stacked")
RECIPES = {"none": None, "current": fp8.Float8CurrentScaling(), "rowwise": fp8.RowwiseScaling()}
DTYPES = {"none": torch.float32, "current": torch.float32, "rowwise": torch.bfloat16}
MODES = ("eager", "pure", "no_grad", "grad", "vjp", "jacrev", "jvp", "vmap", "create_graph")
NO_FP8_MODES = ("jvp", "create_graph")  # refused with FP8 (no forward-mode rule; no second order)

# What each mode runs, for the path the plan chose (NOTE: [Transforms without a rule]): "plan"
# is the plan's path; None: no such pass.
RULES = {
    "eager": ("plan", "plan"),
    "pure": ("plan", "plan"),  # grouped_linear_fwd / grouped_linear_bwd
    "no_grad": ("plan", None),  # primal: no residuals, no backward
    "grad": ("plan", "split"),  # backward's dy is grad's wrapper
    "vjp": ("plan", "plan"),  # the vjp function runs outside the transform
    "jacrev": ("plan", "split"),  # backward batched over the cotangents
    "jvp": ("split", None),  # forward-mode AD: the split path for every product (tangents: fprops)
    "vmap": ("plan", None),  # folded into one call (FP8: one call per element), grouped where planned
    "create_graph": ("plan", "plan"),  # first-order products as planned (autograd differentiates them)
}


def _grid():
    for recipe in RECIPES:
        for asked in (None, False, True):
            if recipe == "rowwise" and asked is False:
                continue  # refused: test_rowwise_refuses_the_split_path
            for layout in LAYOUTS:
                for mode in MODES:
                    if recipe != "none" and mode in NO_FP8_MODES:
                        continue
                    yield pytest.param(recipe, asked, layout, mode, id=f"{recipe}-{'ugt' + str(asked)}-{layout}-{mode}")


def _run_mode(mode: str, f, x, ws, dy):
    """Run ``f(x, ws)`` under ``mode``; returns the eager graph's residual record where autograd
    holds one (read back from ``y.grad_fn``), else None."""
    if mode == "eager":
        x.requires_grad_()
        y = f(x, ws)
        res = ctx_residuals(y.grad_fn)  # grad_fn is the Function's ctx
        y.backward(dy)
        return res
    if mode == "pure":
        y, res = gl.grouped_linear_fwd(x, ws, SPLITS, **f.kw)
        dx, _dw, db = gl.grouped_linear_bwd(res, dy)
        assert dx.shape == x.shape and db is None
        return res
    if mode == "no_grad":
        with torch.no_grad():
            f(x, ws)
        return None
    if mode == "grad":
        torch.func.grad(lambda x, ws: (f(x, ws).float() * dy.float()).sum(), argnums=(0, 1))(x, ws)
        return None
    if mode == "vjp":
        _, pullback = torch.func.vjp(f, x, ws)
        pullback(dy)
        return None
    if mode == "jacrev":
        jac = torch.func.jacrev(lambda x: f(x, ws)[:1])(x)
        assert jac.shape == (1, N, T, K)
        return None
    if mode == "jvp":
        tw = torch.ones_like(ws) if isinstance(ws, torch.Tensor) else [torch.ones_like(w) for w in ws]
        torch.func.jvp(f, (x, ws), (torch.ones_like(x), tw))
        return None
    if mode == "vmap":
        y = torch.func.vmap(f, in_dims=(0, None))(torch.stack([x, 2 * x]), ws)
        assert y.shape == (2, T, N)
        return None
    if mode == "create_graph":
        x.requires_grad_()
        y = f(x, ws)
        res = ctx_residuals(y.grad_fn)
        leaves = [x, ws] if isinstance(ws, torch.Tensor) else [x, *ws]
        grads = torch.autograd.grad((y * dy).sum(), leaves, create_graph=True)
        sum(g.square().sum() for g in grads).backward()  # the second order: autograd's own products
        assert x.grad is not None
        return res
    raise AssertionError(mode)


@pytest.mark.parametrize("recipe,asked,layout,mode", list(_grid()))
def test_kernels_run_the_planned_path(recipe, asked, layout, mode):
    dtype = DTYPES[recipe]
    x, ws = _x(dtype), _weights(layout, dtype, requires_grad=mode in ("eager", "create_graph"))
    dy = _x(dtype, seed=2, K_=N)
    kw = {"use_grouped_tensor": asked, "recipe": RECIPES[recipe]}

    def f(x, ws):
        return fd.grouped_linear(x, ws, SPLITS, **kw)

    f.kw = kw

    with recording() as rec:
        graph_res = _run_mode(mode, f, x, ws, dy)
    rec.check_obeyed()

    planned = "split" if asked is False else "grouped"  # fp32/bf16, 16-byte rows: grouped_mm runs them
    want_fwd, want_bwd = (planned if w == "plan" else w for w in RULES[mode])
    if recipe == "rowwise" and want_bwd == "split":  # one path (its grouped GEMM): route leaves it
        want_bwd = planned

    # forward: every fprop ran what the plan (after routing) said: the GroupedCall's path, res.path
    assert rec.prepared and {c.path for c in rec.prepared} == {want_fwd}
    assert set(rec.told("fprop")) == {want_fwd}
    # one forward GEMM per call; jvp: and one per tangent (x's, the weights'); vmap: folded into
    # one call without FP8, one per element with it
    fprops = {"jvp": 3, "vmap": 1 if recipe == "none" else 2}.get(mode, 1)
    assert len(rec.told("fprop")) == fprops and len(rec.prepared) == (1 if mode != "vmap" else fprops)
    if mode == "no_grad":
        assert not rec.res  # the primal: no residuals
    else:
        assert rec.res and {r.path for r in rec.res} == {want_fwd}
        assert all(r.plan.path == planned for r in rec.res)  # the plan's own path, before routing
        # the family's kernels on torch's backend (NOTE: [FP8 kernels by family])
        want_k = {"none": ref_mod.TORCH, "current": EmulatedKernels, "rowwise": RowwiseKernels}[recipe]
        assert all(r.kernels is want_k or type(r.kernels) is want_k for r in rec.res)
    if graph_res is not None:  # the record rebuilt from the graph is forward's
        assert isinstance(graph_res, fd.GroupedLinearResiduals)
        assert graph_res.path == want_fwd and graph_res.plan is rec.res[-1].plan
        assert (graph_res.x_TK is x) == (recipe == "none")  # (FP8 saves x's quantized copy instead)

    # backward: what plan.route decided (gl._checked), and that is the mode's rule
    if want_bwd is None:
        assert not rec.bwd_routes and not rec.told("dgrad", "wgrad")
    else:
        assert rec.bwd_routes and set(rec.bwd_routes) == {want_bwd}
        assert rec.told("dgrad") and set(rec.told("dgrad", "wgrad")) == {want_bwd}
        if mode != "jacrev":  # (jacrev differentiates x only: no wgrad)
            assert rec.told("wgrad")


def test_rowwise_refuses_the_split_path():
    x, ws = _x(torch.bfloat16), _weights("list", torch.bfloat16)
    with recording() as rec, pytest.raises(ValueError, match="RowwiseScaling runs one grouped GEMM per product"):
        fd.grouped_linear(x, ws, SPLITS, use_grouped_tensor=False, recipe=fp8.RowwiseScaling())
    assert rec.ran == [] and len(PLANS) == 0


def test_grouped_path_unsupported_plans_split_and_the_kernels_obey():
    """float64 (grouped_mm takes no float64): the plan's path is split whatever is asked; asking
    for grouped warns, and every product runs split."""
    x, ws = _x(torch.float64).requires_grad_(), _weights("list", torch.float64)
    with recording() as rec:
        with pytest.warns(UserWarning, match="use_grouped_tensor=True but"):
            y = fd.grouped_linear(x, ws, SPLITS, use_grouped_tensor=True)
        res = ctx_residuals(y.grad_fn)
        y.sum().backward()
    rec.check_obeyed()
    assert res.path == res.plan.path == "split" and "float64" in res.plan.why
    assert rec.ran == [("fprop", "split"), ("dgrad", "split"), ("wgrad", "split")]


def test_fused_main_grad_wgrad_path_is_what_plan_wgrad_grouped_says():
    """fuse_wgrad_accumulation with a float64 main_grad of fp32 weights: backward's route is
    grouped, wgrad takes the split path (plan.wgrad_grouped: grouped_mm writes no float64),
    dgrad stays grouped; the kernels run exactly that."""
    x = _x(torch.float32).requires_grad_()
    ws = _weights("one_buffer", torch.float32)
    for w in ws:
        w.main_grad = torch.zeros(N, K, dtype=torch.float64)
    with recording() as rec:
        y = fd.grouped_linear(x, ws, SPLITS, fuse_wgrad_accumulation=True)
        y.backward(_x(torch.float32, seed=2, K_=N))
    rec.check_obeyed()
    assert rec.bwd_routes == ["grouped"]
    assert [(c.kind, c.told) for c in rec.calls] == [("fprop", "grouped"), ("dgrad", "grouped"), ("wgrad", "split")]
    dy = _x(torch.float32, seed=2, K_=N).double()
    want = [dy[a:b].t() @ x.detach().double()[a:b] for a, b in _bounds(SPLITS)]
    for w, g in zip(ws, want):
        torch.testing.assert_close(w.main_grad, g)


# --- torch.compile: the compiled graph's products, recorded at run time -----------------------------

COMPILE_CASES = [  # (recipe, dtype, asked, the path the compiled graph runs, layout): each layout
    # on each path, RowwiseScaling on both weight forms (a compile costs ~1 s: not the full product)
    ("none", torch.float32, None, "split", "list"),  # while compiling grouped_mm's shape rule takes bf16 only
    ("none", torch.bfloat16, None, "grouped", "list"),
    ("none", torch.bfloat16, None, "grouped", "one_buffer"),
    ("none", torch.bfloat16, True, "grouped", "stacked"),
    ("none", torch.bfloat16, False, "split", "one_buffer"),
    ("none", torch.bfloat16, False, "split", "stacked"),
    ("rowwise", torch.bfloat16, None, "grouped", "list"),
    ("rowwise", torch.bfloat16, None, "grouped", "stacked"),
]


@pytest.mark.parametrize(
    "recipe,dtype,asked,want,layout",
    COMPILE_CASES,
    ids=[f"{r}-{str(d)[6:]}-ugt{a}-{lay}" for r, d, a, _, lay in COMPILE_CASES],
)
def test_compiled_graph_runs_the_planned_path(recipe, dtype, asked, want, layout):
    torch._dynamo.reset()
    x, ws = _x(dtype).requires_grad_(), _weights(layout, dtype)
    dy = _x(dtype, seed=2, K_=N)
    kw = {"use_grouped_tensor": asked, "recipe": RECIPES[recipe]}
    with recording() as rec:
        step = torch.compile(lambda x, ws: fd.grouped_linear(x, ws, SPLITS, **kw), backend="aot_eager")
        for i in range(2):  # the second call runs the cached graph: a record is a run, not a trace
            rec.ran.clear()
            y = step(x, ws)
            assert rec.ran == [("fprop", want)], (i, rec.ran)
            assert type(y.grad_fn).__name__ == "CompiledFunctionBackward"
            y.backward(dy)
            assert rec.ran == [("fprop", want), ("dgrad", want), ("wgrad", want)], (i, rec.ran)
    assert not rec.calls and not rec.res  # (nothing recorded while tracing)
    assert len(PLANS) == 0  # compiled calls plan every time (while tracing), never cached
    if recipe == "none":
        want_y = ref_grouped(x.detach().float(), [w.float() for w in _as_list(ws)], SPLITS)
        torch.testing.assert_close(y.float(), want_y, atol=3e-2 if dtype == torch.bfloat16 else 1e-5, rtol=2e-2)


# --- the plan cache ------------------------------------------------------------------------------

FULL = (16, 16, 16)  # every expert has tokens: a stale weight anywhere shows in y and in the grads


def _bounds(splits):
    ends = torch.tensor(list(splits)).cumsum(0).tolist()
    return list(zip([0, *ends[:-1]], ends))


def _reference(x, ws, splits, bias=None, dy=None):
    """y (and with ``dy``: the grads of x, each weight, each bias) of a per-expert float64 loop."""
    with torch.enable_grad():
        return _reference_loop(x, ws, splits, bias, dy)


def _reference_loop(x, ws, splits, bias, dy):
    xd = x.detach().double().requires_grad_()
    wd = [w.detach().double().requires_grad_() for w in _as_list(ws)]
    bd = None if bias is None else [b.detach().double().requires_grad_() for b in _as_list(bias)]
    y = torch.cat([xd[a:b] @ wd[e].t() + (0 if bd is None else bd[e]) for e, (a, b) in enumerate(_bounds(splits))])
    if dy is None:
        return y.detach()
    grads = torch.autograd.grad(y, [xd, *wd, *(bd or [])], dy.double())
    return y.detach(), grads


def _check(x, ws, splits=FULL, bias=None, **kw):
    """One call, forward and (where anything requires grad) backward, against the float64
    reference: y, and the grad of every input that requires grad. Returns the residual record
    (None for the primal)."""
    y = fd.grouped_linear(x, ws, splits, bias, **kw)
    tol = {"atol": 1e-5, "rtol": 1e-5} if x.dtype == torch.float32 else {"atol": 1e-10, "rtol": 1e-10}
    dy = torch.randn(y.shape, dtype=y.dtype, generator=torch.Generator().manual_seed(y.shape[0]))
    want_y, want_g = _reference(x, ws, splits, bias, dy)
    torch.testing.assert_close(y.detach().double(), want_y, **tol)
    if y.grad_fn is None:
        return None
    parts = [x, *_as_list(ws), *(_as_list(bias) if bias is not None else [])]
    want = dict(zip(map(id, parts), want_g))
    if isinstance(ws, torch.Tensor):  # the stacked weight's grad: the experts' stacked
        want[id(ws)] = torch.stack(want_g[1 : 1 + E])
        parts = [x, ws, *(_as_list(bias) if bias is not None else [])]
    if isinstance(bias, torch.Tensor):
        want[id(bias)] = torch.stack(want_g[-E:])
        parts = parts[:-E] + [bias]
    leaves = [t for t in parts if t.requires_grad]
    assert leaves
    res = ctx_residuals(y.grad_fn)
    for t, g in zip(leaves, torch.autograd.grad(y, leaves, dy)):
        torch.testing.assert_close(g.double(), want[id(t)], **tol)
    return res


def _plan_count_grows(fn, by: int = 1):
    before = len(PLANS)
    out = fn()
    assert len(PLANS) == before + by, (before, len(PLANS))
    return out


# (a) one plan for a training loop


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_training_loop_makes_one_plan(layout):
    """Any token count and routing (host lists), grad mode or not, hits the first step's plan:
    the very same plan object every step."""
    ws = _weights(layout, torch.float32)
    g = torch.Generator().manual_seed(3)
    plans = set()
    for step in range(6):
        counts = torch.randint(0, 12, (E,), generator=g).tolist()
        x = torch.randn(sum(counts), K, generator=g).requires_grad_(step % 2 == 0)
        plans.add(id(_check(x, ws, counts).plan))
        with torch.no_grad():
            _check(x, ws, counts)
        assert len(PLANS) == 1, step
    assert len(plans) == 1
    # a splits tensor is another signature (its metadata is in the key): one more plan for all routings
    for counts in ([5, 0, 7], [1, 1, 1]):
        _check(torch.randn(sum(counts), K, generator=g), ws, torch.tensor(counts))
    assert len(PLANS) == 2


@pytest.mark.parametrize("case", ["bias_list", "bias_stacked", "fp8_no_bias", "fp8_bias"])
def test_a_training_loop_with_a_bias_or_fp8_makes_one_plan(case):
    """(At 4b929f4 a call with a bias and no recipe, or a recipe and no bias, was never cached:
    the key's None test was inverted; fixed in a8cc187.)"""
    m = _module(torch.float32, bias=True)
    bias = {"bias_list": m.biases(), "bias_stacked": torch.zeros(E, N), "fp8_no_bias": None, "fp8_bias": m.biases()}[
        case
    ]
    recipe = fp8.Float8CurrentScaling() if case.startswith("fp8") else None
    for step in range(3):
        y = fd.grouped_linear(_x(torch.float32, seed=step).requires_grad_(), m.weights(), FULL, bias, recipe=recipe)
        y.sum().backward()
    assert len(PLANS) == 1


def test_delayed_scaling_plans_on_the_states_metadata_and_keeps_no_state():
    """A plan reads only a delayed-scaling state's metadata, so calls with other state records of
    the same metadata share it, each quantizing with and recording into its own state (NOTE: [The
    state is bound per call]), and no cached plan keeps a state alive. (Before, the key held the
    state's identity and the plan the state: a plan per state record, each keeping its state.)"""
    recipe = fp8.DelayedScaling()
    ws, x = _weights("list", torch.float32), _x(torch.float32)
    states = [fp8.init_state(recipe, num_gemms=E) for _ in range(3)]
    with torch.no_grad():
        states[1].scale_fwd.fill_(2.0**-6)  # other scales: other bits (underflow), if the call used them
    ys = [fd.grouped_linear(x, ws, SPLITS, recipe=recipe, fp8_state=s) for s in states]
    assert len(PLANS) == 1
    assert not torch.equal(ys[0], ys[1]) and torch.equal(ys[0], ys[2])
    hist = states[0].amax_history_fwd  # each call recorded its amaxes into its own state
    assert hist.any() and all(torch.equal(s.amax_history_fwd, hist) for s in states[1:])
    PLANS.clear()
    fresh = fp8.init_state(recipe, num_gemms=E)
    with torch.no_grad():
        fresh.scale_fwd.fill_(2.0**-6)
    assert torch.equal(fd.grouped_linear(x, ws, SPLITS, recipe=recipe, fp8_state=fresh), ys[1])  # planned afresh
    refs = [weakref.ref(t) for s in states for t in (s, s.amax_history_fwd, s.scale_fwd)]
    del states, ys, hist
    gc.collect()
    assert len(PLANS) == 1 and all(r() is None for r in refs)


_FP8_STATE = ("amax_history_fwd", "scale_fwd", "amax_history_bwd", "scale_bwd")


@pytest.mark.parametrize("layer", ["linear", "grouped_linear", "grouped_mlp"])
def test_a_delayed_scaling_module_makes_one_plan_per_layer_and_keeps_nothing_alive(layer):
    """A module's ``fp8_state`` is a new record over its buffers at each access: over 100 training
    steps each grouped layer still makes one plan (Linear caches none), and once the module is
    deleted no plan keeps it or its state's tensors alive. (Before, each step made a plan holding
    that step's record: 100 plans, the cache cleared whole every 1024, the histories of deleted
    modules kept alive.)"""
    recipe = fp8.DelayedScaling()
    make, extra, plans = {
        "linear": (lambda: fd.nn.Linear(K, N, recipe=recipe), (), 0),
        "grouped_linear": (lambda: fd.nn.GroupedLinear(E, K, N, recipe=recipe), (list(SPLITS),), 1),
        "grouped_mlp": (lambda: fd.nn.GroupedMLP(E, K, 16, recipe=recipe), (list(SPLITS),), 2),  # fc1 and fc2
    }[layer]
    m = make()
    g = torch.Generator().manual_seed(0)
    for _ in range(100):
        m(torch.randn(T, K, generator=g, requires_grad=True), *extra).square().sum().backward()
    assert len(PLANS) == plans
    layers = [mod for mod in m.modules() if hasattr(mod, "fp8_state")]
    assert layers and all(mod.fp8_state.amax_history_fwd[-1].any() for mod in layers)  # (the steps ran FP8)
    refs = [weakref.ref(m)] + [weakref.ref(getattr(mod, f"fp8_{n}")) for mod in layers for n in _FP8_STATE]
    del m, layers
    gc.collect()
    assert [r() for r in refs] == [None] * len(refs)


# (b) a new plan whenever what a plan reads changes, and the results stay right


@pytest.mark.parametrize("layout", ["list", "one_buffer"])
@pytest.mark.parametrize("which", [0, 1, E - 1])
def test_weight_data_replaced_makes_a_new_plan(layout, which):
    ws = _weights(layout, torch.float32)
    x = _x(torch.float32).requires_grad_()
    assert _check(x, ws).plan.packed == (layout == "one_buffer")
    ws[which].data = ws[which].data.clone()  # same shape, elsewhere (the old storage stays alive)
    with torch.no_grad():
        ws[which].mul_(-1)  # and other values: a stale view would show
    res = _plan_count_grows(lambda: _check(x, ws))
    assert not res.plan.packed  # no longer one buffer: never read as one
    with torch.no_grad():  # the primal (no autograd view) too
        _check(x, ws)
    assert len(PLANS) == 2


@pytest.mark.parametrize("how", ["moved", "cloned"])
def test_weight_data_rebound_between_forward_and_backward(how):
    """Rebinding an expert's ``.data`` changes no version counter: backward checks the one
    buffer again instead of trusting forward's plan (a view built on the plan read past the
    rebound expert: wrong dx, or a storage error)."""
    m = _module(torch.float32)
    ws = m.weights()
    x = _x(torch.float32).requires_grad_()
    y = fd.grouped_linear(x, ws, FULL)
    assert ctx_residuals(y.grad_fn).plan.packed
    if how == "moved":  # the same values, inside another [E, N, K] buffer
        other = torch.randn(E, N, K)
        other[0] = ws[0].detach()
        ws[0].data = other[0]
    else:
        ws[0].data = ws[0].data.clone()
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(2))
    dx, *dws = torch.autograd.grad(y, [x, *ws], dy)
    _, want = _reference(x, ws, FULL, dy=dy)
    torch.testing.assert_close(dx.double(), want[0], atol=1e-5, rtol=1e-5)
    for dw, w_want in zip(dws, want[1:]):
        torch.testing.assert_close(dw.double(), w_want, atol=1e-5, rtol=1e-5)


def test_te_recipe_class_attributes_are_in_the_key():
    """A TE recipe's ``fp8_quant_*`` are class attributes a user may assign: the key is the
    recipe the object converts to, not its instance dict (a class-level change reused a stale plan)."""
    cls = type("Float8CurrentScaling", (), {"__module__": "transformer_engine.common.recipe"})
    qcls = type("QParams", (), {"__module__": "transformer_engine.common.recipe"})
    mcls = type("MMParams", (), {"__module__": "transformer_engine.common.recipe"})

    def obj(c, **kw):
        o = c()
        o.__dict__.update(kw)
        return o

    for role in ("fwd_inp", "fwd_weight", "bwd_grad"):
        setattr(cls, f"fp8_quant_{role}", obj(qcls, power_2_scale=False, amax_epsilon=0.0))
    for gemm, acc in (("fprop", False), ("dgrad", True), ("wgrad", True)):
        setattr(cls, f"fp8_gemm_{gemm}", obj(mcls, use_split_accumulator=acc))
    r = obj(
        cls,
        use_power_2_scales=False,
        fp8_format=fp8.Format.HYBRID,
        fp8_dpa=False,
        fp8_mha=False,
        backward_override=None,
    )
    x = _x(torch.float32) * 1e-3
    ws = _weights("list", torch.float32, requires_grad=False)
    before = fd.grouped_linear(x, ws, FULL, recipe=r)
    cls.fp8_quant_fwd_inp = obj(qcls, power_2_scale=False, amax_epsilon=1.0)  # x's amax floored at 1.0
    after = fd.grouped_linear(x, ws, FULL, recipe=r)
    assert len(PLANS) == 2 and not torch.equal(after, before)
    PLANS.clear()
    assert torch.equal(after, fd.grouped_linear(x, ws, FULL, recipe=r))


def test_an_empty_stacked_group_is_refused():
    with pytest.raises(ValueError, match=r"weights is one \[0, 8, 8\] tensor.*E >= 1"):
        fd.grouped_linear(torch.randn(0, 8), torch.randn(0, 8, 8), [])


def test_module_retied_makes_new_plans():
    """``m.to(float64)`` and back: new buffers (the old ones kept alive, so no address is
    reused), new plans, each read as one buffer again."""
    m = _module(torch.float32)
    x = _x(torch.float32).requires_grad_()
    assert _check(x, m.weights()).plan.packed
    keep = [m.weights()[0].data]
    m.to(torch.float64)
    res = _plan_count_grows(lambda: _check(x.detach().double().requires_grad_(), m.weights()))
    assert res.plan.packed and res.path == "split"  # (grouped_mm takes no float64)
    keep.append(m.weights()[0].data)
    m.to(torch.float32)
    with torch.no_grad():
        m.weights()[1].mul_(-1)
    res = _plan_count_grows(lambda: _check(x, m.weights()))
    assert res.plan.packed and res.path == "grouped"
    assert m.weights()[0].data_ptr() not in [t.data_ptr() for t in keep]


def test_dtype_change_makes_a_new_plan():
    ws = _weights("one_buffer", torch.float32)
    x = _x(torch.float32).requires_grad_()
    assert _check(x, ws).path == "grouped"
    for w in ws:
        w.data = w.data.double()
    res = _plan_count_grows(lambda: _check(x.detach().double().requires_grad_(), ws))
    assert res.path == "split" and not res.plan.packed
    # x alone in another dtype: the cached float64 plan must not skip the dtype check
    fresh = _error(fd.grouped_linear, x.detach(), ws, FULL)
    _check(x.detach().double(), ws)
    assert _error(fd.grouped_linear, x.detach(), ws, FULL) == fresh
    assert "float" in fresh[1]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_plan_made_under_autocast_is_not_reused_outside_it(layout):
    """bf16 x, fp32 weights: under autocast the weights are cast (NOTE: [Autocast] in _amp.py) and
    the call runs; outside it the same call is refused as ever, not served the autocast plan
    (the autocast dtype is in the key), and under autocast again the first plan is reused."""
    ws, x = _weights(layout, torch.float32), _x(torch.bfloat16)
    fresh = _error(fd.grouped_linear, x, ws, FULL)
    assert fresh[0] is TypeError and "dtype" in fresh[1]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = _plan_count_grows(lambda: fd.grouped_linear(x, ws, FULL))
    assert y.dtype == torch.bfloat16
    ws16 = [w.detach().to(torch.bfloat16) for w in (ws if isinstance(ws, list) else [ws])]
    assert torch.equal(y, fd.grouped_linear(x, ws16 if isinstance(ws, list) else ws16[0], FULL))
    assert _error(fd.grouped_linear, x, ws, FULL) == fresh
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _plan_count_grows(lambda: fd.grouped_linear(x, ws, FULL), by=0)


def test_use_grouped_tensor_change_makes_a_new_plan_and_path():
    ws = _weights("one_buffer", torch.float32)
    x = _x(torch.float32).requires_grad_()
    with recording() as rec:
        assert _check(x, ws).path == "grouped"
        assert _plan_count_grows(lambda: _check(x, ws, use_grouped_tensor=False)).path == "split"
        assert _plan_count_grows(lambda: _check(x, ws, use_grouped_tensor=True)).path == "grouped"
        _plan_count_grows(lambda: _check(x, ws, use_grouped_tensor=None), by=0)  # the first again
    rec.check_obeyed()
    assert rec.told("fprop") == ["grouped", "split", "grouped", "grouped"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_requires_grad_toggled_reaches_every_expert(layout):
    """requires_grad is read per call, not planned (so no new plan is needed): a plan made while
    every weight was frozen (the primal, and a forward that reads the one-buffer view
    unrecorded) must not starve the gradients of weights that require grad later, nor the other
    way round."""
    ws = _weights(layout, torch.float32, requires_grad=False)
    x = _x(torch.float32)
    _check(x, ws)  # the primal: nothing requires grad
    _check(x.requires_grad_(), ws)  # only x
    for w in [ws] if isinstance(ws, torch.Tensor) else ws:
        w.requires_grad_(True)
    res = _check(x.detach(), ws)  # only the weights
    assert res.needs[1] is True or all(res.needs[1])
    if layout != "stacked":  # some experts frozen again, the others still get their gradients
        ws[1].requires_grad_(False)
        _check(x, ws)
        ws[1].requires_grad_(True)
        ws[0].requires_grad_(False)
        ws[2].requires_grad_(False)
        _check(x.detach(), ws)
    assert len(PLANS) == 1  # (one signature throughout)


def test_new_modules_where_old_ones_were_freed_are_planned_afresh():
    """Build, call and free modules in a loop, swapping in and out features: ids and addresses
    may be reused; every result must match the reference (a stale plan's shapes would not)."""
    torch.manual_seed(0)
    for i in range(12):
        n, k = (N, K) if i % 2 else (K, N)
        single = i % 4 >= 2
        m = fd.nn.GroupedLinear(E, k, n, bias=i % 3 == 0, params_dtype=torch.float32, single_grouped_weight=single)
        ws = m.weight if single else m.weights()
        bias = None if not m.use_bias else (m.bias if single else m.biases())
        x = torch.randn(T, k, requires_grad=i % 2 == 0)
        _check(x, ws, FULL, bias)
        with torch.no_grad():
            torch.testing.assert_close(m(x, list(FULL)), _reference(x, ws, FULL, bias).float(), atol=1e-5, rtol=1e-5)
        del m, ws, bias, x  # (refcounting frees them here: the next ones may take their ids and addresses)
    # separate tensors made where freed ones were, swapping shapes as well
    for i in range(8):
        n, k = (N, K) if i % 2 else (K, N)
        ws = [torch.randn(n, k, requires_grad=True) for _ in range(E)]
        _check(torch.randn(T, k), ws)
        del ws


def test_bias_forms_are_planned_and_right():
    m = _module(torch.float32, bias=True)
    x = _x(torch.float32).requires_grad_()
    with torch.no_grad():
        for e, b in enumerate(m.biases()):
            b.fill_(e + 1.0)
    assert _check(x, m.weights()).plan.bias_form is None
    assert _check(x, m.weights(), FULL, m.biases()).plan.bias_form == "list"
    b_EN = torch.stack([b.detach() for b in m.biases()]).requires_grad_()
    assert _check(x, m.weights(), FULL, b_EN).plan.bias_form == "stacked"
    assert _check(x, m.weights()).plan.bias_form is None  # (the first plan again, not a biased one)


def test_bias_forms_make_their_own_plans():
    m = _module(torch.float32, bias=True)
    x = _x(torch.float32).requires_grad_()
    _check(x, m.weights())
    _plan_count_grows(lambda: _check(x, m.weights(), FULL, m.biases()))
    _plan_count_grows(lambda: _check(x, m.weights(), FULL, torch.zeros(E, N, requires_grad=True)))


# (c) the cache never skips a check that depends on the new call


B_LIST = [torch.zeros(N) for _ in range(E)]

BAD_CALLS = {
    "x_features": lambda x, ws: fd.grouped_linear(x[:, :-1], ws, SPLITS),
    "x_1d": lambda x, ws: fd.grouped_linear(x[:, 0], ws, SPLITS),
    "x_3d": lambda x, ws: fd.grouped_linear(x[None], ws, SPLITS),
    "x_dtype": lambda x, ws: fd.grouped_linear(x.double(), ws, SPLITS),
    "fuse_1": lambda x, ws: fd.grouped_linear(x, ws, SPLITS, fuse_wgrad_accumulation=1),
    "ugt_yes": lambda x, ws: fd.grouped_linear(x, ws, SPLITS, use_grouped_tensor="yes"),
    "ugt_1": lambda x, ws: fd.grouped_linear(x, ws, SPLITS, use_grouped_tensor=1),
    "splits_sum": lambda x, ws: fd.grouped_linear(x, ws, (16, 0, 31)),
    "splits_negative": lambda x, ws: fd.grouped_linear(x, ws, (17, -1, 32)),
    "splits_count": lambda x, ws: fd.grouped_linear(x, ws, (16, 32)),
    "splits_tensor_sum": lambda x, ws: fd.grouped_linear(x, ws, torch.tensor([16, 0, 31])),
    "splits_tensor_count": lambda x, ws: fd.grouped_linear(x, ws, torch.tensor([16, 32])),
    "splits_tensor_float": lambda x, ws: fd.grouped_linear(x, ws, torch.tensor([16.0, 0.0, 32.0])),
    "bias_shape": lambda x, ws: fd.grouped_linear(x, ws, SPLITS, [torch.zeros(N)] * (E - 1) + [torch.zeros(N + 1)]),
    "bias_count": lambda x, ws: fd.grouped_linear(x, ws, SPLITS, torch.zeros(E - 1, N)),
    "fewer_weights": lambda x, ws: fd.grouped_linear(x, ws[:2], SPLITS),
    "backend": lambda x, ws: fd.grouped_linear(x, ws, SPLITS, backend="nope"),
    "fp8_tokens": lambda x, ws: fd.grouped_linear(x, ws, (8, 8, 32), B_LIST, recipe=fp8.Float8CurrentScaling()),
    "fp8_rowwise_split": lambda x, ws: fd.grouped_linear(
        x, ws, SPLITS, B_LIST, recipe=fp8.RowwiseScaling(), use_grouped_tensor=False
    ),
}


def _error(fn, *args) -> tuple[type, str]:
    with pytest.raises(Exception) as info:
        fn(*args)
    return info.type, str(info.value)


@pytest.mark.parametrize("bad", list(BAD_CALLS))
def test_bad_calls_raise_the_same_after_a_cached_success(bad):
    x, ws = _x(torch.float32), _weights("one_buffer", torch.float32)
    fresh = _error(BAD_CALLS[bad], x, ws)  # with nothing cached
    assert fresh[0] in (TypeError, ValueError), fresh
    PLANS.clear()
    # the good calls of these signatures, cached (grad and no_grad, host and tensor splits, FP8)
    with torch.no_grad():
        fd.grouped_linear(x, ws, SPLITS)
        fd.grouped_linear(x, ws, torch.tensor(SPLITS))
        fd.grouped_linear(x, ws, SPLITS, B_LIST, recipe=fp8.Float8CurrentScaling())
        fd.grouped_linear(x, ws, SPLITS, B_LIST, recipe=fp8.RowwiseScaling())
    fd.grouped_linear(x.requires_grad_(), ws, SPLITS).sum().backward()
    assert len(PLANS) == 4
    assert _error(BAD_CALLS[bad], x.detach(), ws) == fresh
    assert _error(BAD_CALLS[bad], x.detach(), ws) == fresh  # (and again, after whatever it left cached)


# Stale plans (at 4b929f4 the key held every weight's identity and address but only the first
# and last weight's metadata, and no strides: a weight whose .data became another view at the same
# address kept the key, the cached plan skipped the shape checks and read the group as one
# [E, N, K] view with stale strides; fixed in a8cc187). And what the key still does not hold.


@pytest.mark.parametrize("which", [0, 1, E - 1])
def test_weight_narrowed_in_place_still_raises(which):
    x = _x(torch.float32)
    fresh_ws = _weights("one_buffer", torch.float32, requires_grad=False)
    fresh_ws[which].data = fresh_ws[which].data[: N // 2]
    fresh = _error(fd.grouped_linear, x, fresh_ws, FULL)  # what an uncached call says
    assert fresh[0] is ValueError and "every expert's weight must be" in fresh[1]
    PLANS.clear()
    ws = _weights("one_buffer", torch.float32, requires_grad=False)
    fd.grouped_linear(x, ws, FULL)  # cached
    ws[which].data = ws[which].data[: N // 2]  # the same address, another shape
    assert _error(fd.grouped_linear, x, ws, FULL) == fresh


@pytest.mark.parametrize(
    "recipe",
    [
        None,
        "current",
    ],
)
def test_middle_bias_narrowed_in_place_still_raises(recipe):
    m = _module(torch.float32, bias=True)
    x, kw = _x(torch.float32), {"recipe": RECIPES[recipe] if recipe else None}
    with torch.no_grad():
        fd.grouped_linear(x, m.weights(), FULL, m.biases(), **kw)  # (cached where the key is kept)
        bs = m.biases()
        bs[1].data = bs[1].data[: N // 2]
        with pytest.raises(ValueError, match=re.escape("bias[1]")):
            fd.grouped_linear(x, m.weights(), FULL, bs, **kw)


@pytest.mark.parametrize("which", [0, 1, E - 1])
def test_square_weight_transposed_in_place_gives_the_right_result(which):
    """A square expert's ``.data`` transposed: the same address and shape, other strides."""
    m = _module(torch.float32, N_=K, K_=K)
    ws, x = m.weights(), _x(torch.float32).requires_grad_()
    _check(x, ws)
    ws[which].data = ws[which].data.t()
    _check(x, ws)


@pytest.mark.parametrize("which", [0, 1, E - 1])
def test_the_stale_cases_are_right_uncached(which):
    """The stale-plan cases above with the cache emptied before the second call (the control:
    what a cached call must match)."""
    m = _module(torch.float32, N_=K, K_=K)
    ws, x = m.weights(), _x(torch.float32).requires_grad_()
    _check(x, ws)
    ws[which].data = ws[which].data.t()
    PLANS.clear()
    _check(x, ws)
    ws2 = _weights("one_buffer", torch.float32, requires_grad=False)
    fd.grouped_linear(x.detach(), ws2, FULL)
    ws2[which].data = ws2[which].data[: N // 2]
    PLANS.clear()
    with pytest.raises(ValueError, match="every expert's weight must be"):
        fd.grouped_linear(x.detach(), ws2, FULL)


# (At a8cc187 the key held addresses, shapes, strides and dtypes, but not that the addresses lie in
# ONE storage, which the one-buffer verdict also reads: separate storages at a cached one-buffer
# plan's addresses, as CUDA's caching allocator hands out where a one-buffer module was freed, were
# read through as_strided over weights[0]'s storage: "setStorage: ... out of bounds" where an
# uncached call ran. Fixed in d78f9ef: the first weight's storage is in the key.)


def _separate_storages_at(ws: list[torch.Tensor]) -> list[torch.Tensor]:
    """Tensors at the same addresses as the one-buffer ``ws``, each its own storage (non-owning
    storages over the buffer's memory: what an allocator's adjacent blocks look like)."""
    base = ws[0].detach()
    whole = base.as_strided((len(ws), *base.shape), (base.numel(), *base.stride())).numpy()
    sep = [torch.from_numpy(whole[e]) for e in range(len(ws))]
    assert [t.data_ptr() for t in sep] == [w.data_ptr() for w in ws]
    assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in sep)
    assert packed(sep) is None and packed([w.detach() for w in ws]) is not None
    return sep


def test_separate_storages_uncached_are_right():
    """The control for the case below: nothing cached, separate storages are stacked and right."""
    ws = _weights("one_buffer", torch.float32, requires_grad=False)
    _check(_x(torch.float32), _separate_storages_at(ws))


def test_separate_storages_at_a_one_buffer_plans_addresses():
    ws = _weights("one_buffer", torch.float32, requires_grad=False)
    x = _x(torch.float32)
    assert _check(x.requires_grad_(), ws).plan.packed  # cached: packed=True
    _check(x, _separate_storages_at(ws))  # the same addresses, shapes, strides, dtype: other storages


# (d) nothing is cached outside plain eager calls


def _unplain_calls():
    x, ws = _x(torch.float32), _weights("list", torch.float32, requires_grad=False)
    f = lambda x, ws: fd.grouped_linear(x, ws, SPLITS)
    yield "grad", lambda: torch.func.grad(lambda x, ws: f(x, ws).sum(), argnums=(0, 1))(x, ws)
    yield "vjp", lambda: torch.func.vjp(lambda x: f(x, ws), x)[1](torch.ones(T, N))
    yield "jacrev", lambda: torch.func.jacrev(lambda x: f(x, ws)[:1])(x)
    yield "vmap", lambda: torch.func.vmap(f, in_dims=(0, None))(torch.stack([x, x]), ws)
    yield "vmap_grad", lambda: torch.func.vmap(torch.func.grad(lambda x: f(x, ws).sum()))(torch.stack([x, x]))
    yield "jvp", lambda: torch.func.jvp(lambda x: f(x, ws), (x,), (torch.ones_like(x),))

    def dual():
        import torch.autograd.forward_ad as fwAD

        with fwAD.dual_level():
            return f(fwAD.make_dual(x, torch.ones_like(x)), ws)

    yield "forward_ad", dual

    def fake():
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode() as mode:
            y = f(mode.from_tensor(x), [mode.from_tensor(w) for w in ws])
        assert y.shape == (T, N)

    yield "fake_tensor_mode", fake

    def distributed():
        group = FakeDW.group_of([w.detach() for w in ws])
        assert f(x, group).shape == (T, N)

    yield "distributed_weight", distributed

    def compiled():
        torch._dynamo.reset()
        xb, wb = x.bfloat16().requires_grad_(), [w.bfloat16().requires_grad_() for w in ws]
        torch.compile(f, backend="aot_eager")(xb, wb).sum().backward()

    yield "compile", compiled

    yield "plain", lambda: f(x, ws)  # (the control: a plain call is cached)


@pytest.mark.parametrize(
    "name", [n for n, _ in _unplain_calls() if n not in ("plain", "grad", "vjp", "jacrev", "vmap", "vmap_grad")]
)
def test_nothing_is_cached_under_transforms_compile_or_modes(name):
    calls = dict(_unplain_calls())
    calls[name]()
    assert len(PLANS) == 0, name
    calls["plain"]()  # (the control: the count above can fail)
    assert len(PLANS) == 1


@pytest.mark.parametrize("name", ["grad", "vjp", "jacrev", "vmap", "vmap_grad"])
def test_what_torch_func_caches_is_the_plain_calls_plan(name):
    calls = dict(_unplain_calls())
    calls[name]()
    calls[name]()
    assert len(PLANS) <= 1  # (vmap folds into one plain call of B * T tokens: the same signature)
    calls["plain"]()
    assert len(PLANS) == 1


# (e) threads


def test_threads_share_a_module_correctly():
    """Four threads call one module at once (the cache filled and read concurrently): every
    result and gradient is right."""
    m = _module(torch.float32)
    errors, barrier = [], threading.Barrier(4)

    def worker(t: int):
        try:
            g = torch.Generator().manual_seed(100 + t)
            barrier.wait()
            for step in range(6):
                counts = torch.randint(0, 9, (E,), generator=g).tolist()
                x = torch.randn(sum(counts), K, generator=g, requires_grad=True)
                y = fd.grouped_linear(x, m.weights(), counts, use_grouped_tensor=(None, False, True)[(t + step) % 3])
                dy = torch.randn(y.shape, generator=g)
                grads = torch.autograd.grad(y, [x, *m.weights()], dy)
                want_y, want_g = _reference(x, m.weights(), counts, None, dy)
                torch.testing.assert_close(y.double(), want_y, atol=1e-5, rtol=1e-5)
                for got, want in zip(grads, want_g):
                    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append((t, repr(e)))

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    assert len(PLANS) == 3  # one per use_grouped_tensor value, however the threads raced


# --- custom_vjp(nondiff_argnums=...) -------------------------------------------------------------


class Opts:
    """An option object: not a tensor, not a pytree node, unhashable."""

    __hash__ = None

    def __init__(self, scale: float):
        self.scale = scale


SEEN: list = []


def _scaled_fwd(x, w, opts):  # y = opts.scale * x * w
    SEEN.append(opts)
    return opts.scale * x * w, (x, w, opts.scale)


def _scaled_bwd(res, dy):
    x, w, s = res
    return s * dy * w, s * dy * x  # cotangents of x and w only: opts is nondiff


def _mid_fwd(x, opts, w, shift):  # nondiff in the middle and at the end (opts, a float shift)
    SEEN.append((opts, shift))
    return opts.scale * x * w + shift, (x, w, opts.scale)


def _mid_bwd(res, dy):
    x, w, s = res
    return s * dy * w, s * dy * x


IN_DIMS: list = []


def _fold(batch_size, in_dims, x, w, opts):
    IN_DIMS.append((batch_size, in_dims, opts))
    # one call per element


end = custom_vjp(_scaled_fwd, _scaled_bwd, nondiff_argnums=(2,), vmap=_fold, name="end")
mid = custom_vjp(_mid_fwd, _mid_bwd, nondiff_argnums=(1, 3), name="mid")


def _xw():
    g = torch.Generator().manual_seed(0)
    return torch.randn(5, generator=g, dtype=torch.float64), torch.randn(5, generator=g, dtype=torch.float64)


def test_nondiff_last_under_autograd():
    x, w = (t.requires_grad_() for t in _xw())
    opts = Opts(3.0)
    SEEN.clear()
    y = end(x, w, opts)
    assert SEEN == [opts] and SEEN[0] is opts  # by reference
    y.backward(torch.ones(5, dtype=torch.float64))
    torch.testing.assert_close(x.grad, 3 * w.detach())
    torch.testing.assert_close(w.grad, 3 * x.detach())
    assert torch.autograd.gradcheck(lambda x, w: end(x, w, opts), (x, w))


def test_nondiff_in_the_middle_under_autograd():
    x, w = (t.requires_grad_() for t in _xw())
    opts = Opts(2.0)
    SEEN.clear()
    y = mid(x, opts, w, 0.5)
    assert SEEN == [(opts, 0.5)] and SEEN[0][0] is opts
    torch.testing.assert_close(y, 2 * x * w + 0.5)
    gx, gw = torch.autograd.grad(y.sum(), [x, w])
    torch.testing.assert_close(gx, 2 * w.detach())
    torch.testing.assert_close(gw, 2 * x.detach())
    assert torch.autograd.gradcheck(lambda x, w: mid(x, opts, w, 0.25), (x, w))


@pytest.mark.parametrize("where", ["end", "middle"])
def test_a_tensor_at_a_nondiff_position_is_refused(where):
    """(a8cc187) A nondiff argument is held by reference, out of autograd's and the transforms'
    sight: a Tensor there is refused, in eager and under torch.func alike."""
    x, w = _xw()
    t = torch.ones(5, dtype=torch.float64, requires_grad=True)
    call = (lambda x: end(x, w, t)) if where == "end" else (lambda x: mid(x, Opts(1.0), w, t))
    pos = 2 if where == "end" else 3
    with pytest.raises(TypeError, match=f"argument {pos} is or holds a Tensor but nondiff_argnums"):
        call(x.requires_grad_())
    with pytest.raises(TypeError, match=f"argument {pos} is or holds a Tensor but nondiff_argnums"):
        torch.func.grad(lambda x: call(x).sum())(x.detach())


def test_nondiff_under_torch_func_grad_and_vjp():
    x, w = _xw()
    opts = Opts(-1.5)
    gx, gw = torch.func.grad(lambda x, w: end(x, w, opts).sum(), argnums=(0, 1))(x, w)
    torch.testing.assert_close(gx, -1.5 * w)
    torch.testing.assert_close(gw, -1.5 * x)
    gx, gw = torch.func.grad(lambda x, w: mid(x, opts, w, 3.0).sum(), argnums=(0, 1))(x, w)
    torch.testing.assert_close(gx, -1.5 * w)
    torch.testing.assert_close(gw, -1.5 * x)
    _, pullback = torch.func.vjp(lambda x: mid(x, opts, w, 3.0), x)
    torch.testing.assert_close(pullback(torch.ones(5, dtype=torch.float64))[0], -1.5 * w)


def test_nondiff_under_vmap_gets_none_in_dims():
    x, w = _xw()
    xs = torch.stack([x, 2 * x, 3 * x])
    opts = Opts(2.0)
    IN_DIMS.clear()
    y = torch.func.vmap(lambda x: end(x, w, opts))(xs)
    torch.testing.assert_close(y, 2 * xs * w)
    ((batch, dims, seen),) = IN_DIMS
    assert batch == 3 and dims == (0, None, None) and seen is opts
    # the middle position: no vmap rule, one call per element; the nondiff args unbatched, by reference
    SEEN.clear()
    y = torch.func.vmap(lambda x, w: mid(x, opts, w, 1.0))(xs, torch.stack([w] * 3))
    torch.testing.assert_close(y, 2 * xs * w + 1)
    assert len(SEEN) == 3 and all(o is opts and shift == 1.0 for o, shift in SEEN)
    # vmap(grad): the grad level under the batch
    g = torch.func.vmap(torch.func.grad(lambda x: end(x, w, opts).sum()))(xs)
    torch.testing.assert_close(g, 2 * w.expand(3, 5))


def test_nondiff_vmap_rule_folds_with_the_nondiff_args():
    """A fold rule sees the nondiff arguments among ``args`` and may hand them on."""
    seen = []

    def fold(batch_size, in_dims, x, w, opts):
        seen.append(in_dims)
        assert in_dims[2] is None and opts.scale == 2.0
        return (x.movedim(in_dims[0], 0).reshape(-1), w.repeat(batch_size), opts), lambda y: (y.view(batch_size, -1), 0)

    f = custom_vjp(_scaled_fwd, _scaled_bwd, nondiff_argnums=(2,), vmap=fold)
    x, w = _xw()
    xs = torch.stack([x, -x])
    torch.testing.assert_close(torch.func.vmap(f, in_dims=(0, None, None))(xs, w, Opts(2.0)), 2 * xs * w)
    assert seen == [(0, None, None)]


def test_nondiff_bwd_returning_a_cotangent_for_it_is_refused():
    f = custom_vjp(_scaled_fwd, lambda res, dy: (*_scaled_bwd(res, dy), None), nondiff_argnums=(2,), name="padded")
    x, w = (t.requires_grad_() for t in _xw())
    with pytest.raises(
        TypeError,
        match=r"custom_vjp\(padded\): bwd must return one cotangent per differentiable argument \(nondiff_argnums=\(2,\) excluded\)",
    ):
        f(x, w, Opts(1.0)).sum().backward()


def test_nondiff_jvp_rule_gets_tangents_of_the_diff_args_only():
    seen = []

    def jvp(res, tangents):
        seen.append(len(tangents))
        x, w, s = res
        tx, tw = tangents
        return s * (tx * w + x * tw)

    f = custom_vjp(_scaled_fwd, _scaled_bwd, nondiff_argnums=(2,), jvp=jvp)
    x, w = _xw()
    _, t = torch.func.jvp(lambda x, w: f(x, w, Opts(2.0)), (x, w), (torch.ones_like(x), torch.zeros_like(w)))
    torch.testing.assert_close(t, 2 * w)
    assert seen == [2]


@pytest.mark.parametrize(
    "argnums,error,match",
    [
        ((-1,), TypeError, "nondiff_argnums must be non-negative ints"),
        ((True,), TypeError, "nondiff_argnums must be non-negative ints"),
        ((1.0,), TypeError, "nondiff_argnums must be non-negative ints"),
    ],
)
def test_nondiff_argnums_refused_at_definition(argnums, error, match):
    with pytest.raises(error, match=match):
        custom_vjp(_scaled_fwd, _scaled_bwd, nondiff_argnums=argnums)


def test_nondiff_argnums_out_of_range_refused_at_call():
    f = custom_vjp(_scaled_fwd, _scaled_bwd, nondiff_argnums=(5,), name="far")
    x, w = (t.requires_grad_() for t in _xw())
    with pytest.raises(TypeError, match=re.escape("custom_vjp(far): nondiff_argnums=(5,) but the call has 3")):
        f(x, w, Opts(1.0))
    with pytest.raises(TypeError, match=re.escape("custom_vjp(far): nondiff_argnums=(5,)")):
        torch.func.grad(lambda x: f(x, w, Opts(1.0)).sum())(x.detach())


# --- which kernel runs: grouped_mm on the grouped path only; the fallback warning --------------
# (The first three written to kill mutants of the reference kernels, with these sizes.)
GMM_SPLITS = (2, 0, 3)
GMM_E, GMM_N, GMM_T = 3, 4, sum(GMM_SPLITS)
_rand = functools.partial(randn, dtype=torch.float64, draw_dtype=None)  # (drawn in the given dtype)


@pytest.mark.parametrize("path", [True, False], ids=["grouped", "split"])
def test_path_decides_whether_grouped_mm_runs(path):
    calls = []
    real = ref_mod._torch_grouped_mm

    def spy(a, b, offs):
        calls.append(a.shape)
        return real(a, b, offs=offs)

    x, dy = _rand(GMM_T, 16, seed=1, dtype=torch.float32), _rand(GMM_T, 16, seed=2, dtype=torch.float32)
    ws = [_rand(16, 16, seed=3 + e, dtype=torch.float32, grad=True) for e in range(GMM_E)]
    with mock.patch.object(ref_mod, "_torch_grouped_mm", spy):
        y, res = fd.grouped_linear_fwd(x, ws, list(GMM_SPLITS), use_grouped_tensor=path)
        dx, dws, _ = fd.grouped_linear_bwd(res, dy)
    assert res.path == ("grouped" if path else "split")
    assert len(calls) == (3 if path else 0)  # fprop, dgrad, wgrad
    torch.testing.assert_close(y, ref_grouped(x, ws, GMM_SPLITS), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        dx, torch.cat([d @ w for d, w in zip(dy.split(list(GMM_SPLITS)), ws)]), rtol=1e-5, atol=1e-5
    )


def test_torch_kernels_name_themselves():
    assert repr(TorchKernels()) == "TorchKernels()" and TorchKernels.name == "torch"


def test_grouped_path_fallback_warning_says_why(monkeypatch):
    monkeypatch.setattr(ref_mod, "_PATH_VERDICTS", {})  # a verdict cached by an earlier test would hide the message
    x, ws = _rand(GMM_T, 0, dtype=torch.float32), [_rand(GMM_N, 0, dtype=torch.float32) for _ in range(GMM_E)]
    with pytest.warns(
        UserWarning,
        match=r"^grouped_linear: use_grouped_tensor=True but grouped_mm takes no zero-size "
        r"features; running the split path$",
    ):
        y = fd.grouped_linear(x, ws, list(GMM_SPLITS), use_grouped_tensor=True)
    assert torch.equal(y, torch.zeros(GMM_T, GMM_N))


WARN_SPLITS = [2, 0, 3, 1]
WARN_E, WARN_T, WARN_N = len(WARN_SPLITS), sum(WARN_SPLITS), 8


def test_fallback_warning_points_at_the_callers_line():
    x = torch.randn(WARN_T, 3)  # 3 fp32 features: 12-byte rows, the grouped path cannot run
    ws = [torch.randn(WARN_N, 3, requires_grad=True) for _ in range(WARN_E)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fd.grouped_linear(x, ws, WARN_SPLITS, use_grouped_tensor=True)  # <- this line
        line = __import__("inspect").currentframe().f_lineno - 1
    (w,) = [c for c in caught if "use_grouped_tensor=True" in str(c.message)]
    assert w.filename == __file__ and w.lineno == line
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fd.nn.GroupedLinear(WARN_E, 3, WARN_N, use_grouped_tensor=True)(x, WARN_SPLITS)  # <- this line
        line = __import__("inspect").currentframe().f_lineno - 1
    (w,) = [c for c in caught if "use_grouped_tensor=True" in str(c.message)]
    assert w.filename == __file__ and w.lineno == line


def test_route_serves_the_activation_kernels():
    """``plan.route(..., reference=)``, the MLP's activation kernels: the fused ones on plain
    operands, the reference under forward-mode AD, on functorch's wrappers and where autograd
    would record the step (stricter than the GEMMs, whose kernels stay under forward-mode AD
    without wrappers); ``grouped`` passes through."""
    from functional_dw.plan import route

    fused, ref, gemms = types.SimpleNamespace(name="triton"), types.SimpleNamespace(name="torch"), object()
    x, tracked = torch.ones(2), torch.ones(2, requires_grad=True)
    assert route(fused, True, x, reference=ref) == (fused, True)
    assert route(ref, False, x, reference=ref)[0] is ref
    with torch.autograd.forward_ad.dual_level():
        assert route(fused, False, x, reference=ref)[0] is ref
        assert route(gemms, True, x) == (gemms, True)
    assert route(fused, False, x, tracked, reference=ref)[0] is ref
    with torch.no_grad():
        assert route(fused, False, tracked, reference=ref)[0] is fused
    seen = []
    torch.func.vmap(lambda t: seen.append(route(fused, False, t, reference=ref)[0]) or t)(torch.ones(3, 2))
    assert seen == [ref]


# --- linear's plan, the options in every key, grouped_linear's seam ------------------------------

lin = importlib.import_module("functional_dw.linear")  # (fd.linear is the function)


def test_linear_makes_one_plan_per_signature_and_skips_no_check():
    """linear plans as grouped_linear does: x's leading dims are data (one plan for a training
    loop), anything the plan reads makes a new one, and a call its checks refuse is refused
    after a cached call too."""
    lin.PLANS.clear()
    w = torch.randn(N, K, requires_grad=True)
    b = torch.randn(N, requires_grad=True)
    for lead in ((4,), (2, 7), (16,)):
        x = torch.randn(*lead, K, requires_grad=True)
        y = fd.linear(x, w, b)
        y.sum().backward()
        torch.testing.assert_close(y, x @ w.T + b)
    assert len(lin.PLANS) == 1
    fd.linear(torch.randn(3, K, dtype=torch.float64), w.detach().double())  # another dtype, no bias
    assert len(lin.PLANS) == 2
    with pytest.raises(ValueError, match=r"bias must have shape \(48,\), got \(47,\)"):
        fd.linear(torch.randn(3, K), w, torch.randn(N - 1))
    with pytest.raises(ValueError, match="x has 31 features but weight is"):
        fd.linear(torch.randn(3, K - 1), w)
    assert len(lin.PLANS) == 2
    lin.PLANS.clear()


@pytest.mark.parametrize("layer", ["linear", "grouped_linear"])
def test_an_option_is_keyed_by_its_type_too(layer):
    """``0 == False`` (and their hashes agree), but only a bool passes the flag's check: a key of
    values alone would hand a cached plan to a call its check refuses (plan.options_key)."""
    w = torch.randn(N, K)
    if layer == "linear":
        call = lambda fuse: fd.linear_fwd(torch.randn(4, K), w, fuse_wgrad_accumulation=fuse)
    else:
        call = lambda fuse: fd.grouped_linear_fwd(torch.randn(T, K), [w] * E, SPLITS, fuse_wgrad_accumulation=fuse)
    call(False)  # planned and cached
    with pytest.raises(TypeError, match="fuse_wgrad_accumulation must be a bool, got int"):
        call(0)
    lin.PLANS.clear()


def test_a_call_prepared_from_a_stand_in_runs_on_the_x_it_is_given():
    """grouped_linear's seam (NOTE: [The layer's seam]): a call prepared from a stand-in with x's
    shape holds no input; fprop and forward compute on the x they are given, and the residuals
    save that x as given (grouped_mlp's fc2 runs so on h)."""
    x = torch.randn(T, 2 * K)[:, ::2]  # not contiguous: the GEMMs read a dense copy
    ws = [torch.randn(N, K) for _ in range(E)]
    opts = Options()
    c = gl.prepare(torch.zeros(T, K), ws, gl.HostSplits(SPLITS), None, opts, stand_in=True)
    assert c.x_TK is None
    want, _ = fd.grouped_linear_fwd(x, ws, SPLITS)
    torch.testing.assert_close(want, ref_grouped(x, ws, list(SPLITS)))
    y, res = gl.forward(c, x, keep_x=True)
    assert torch.equal(y, want) and res.x_TK is x
    assert torch.equal(gl.fprop(c, x), want)


# --- the planned run (NOTE: [The plan's runner] in custom_vjp.py, NOTE: [The layer's planned run]) --

bp = importlib.import_module("functional_dw._bridge_planned")


def _planned(y: torch.Tensor) -> bool:
    """Whether y's node is a planned one (else the bridge's)."""
    return issubclass(type(y.grad_fn)._forward_cls, bp._PlannedRun)


def _step(x, ws, bias, dy, create_graph=False):
    y = fd.grouped_linear(x, ws, [5, 0, 7], bias, backend="torch")
    leaves = [
        x,
        *(ws if isinstance(ws, list) else [ws]),
        *(bias if isinstance(bias, list) else [bias] * (bias is not None)),
    ]
    return y, torch.autograd.grad(y, leaves, dy, create_graph=create_graph)


@pytest.mark.parametrize("layout", ["stacked", "list", "one_buffer"])
@pytest.mark.parametrize("bias_form", [None, "list", "stacked"])
def test_the_second_call_runs_planned_and_bitwise_the_bridge(layout, bias_form):
    """The first call (no plan yet) takes the bridge, the second the planned node: the same y
    and grads, bit for bit, named as the pair's node."""
    ws = _weights(layout, torch.float64)
    g = torch.Generator().manual_seed(0)
    bias = None
    if bias_form is not None:
        b = torch.randn(E, N, generator=g, dtype=torch.float64)
        bias = b.requires_grad_() if bias_form == "stacked" else [t.clone().requires_grad_() for t in b]
    x = torch.randn(12, K, generator=g, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(12, N, generator=g, dtype=torch.float64)
    y1, g1 = _step(x, ws, bias, dy)
    y2, g2 = _step(x, ws, bias, dy)
    assert not _planned(y1) and _planned(y2)
    assert type(y2.grad_fn).__name__ == "CustomVJP_grouped_linearBackward"
    assert torch.equal(y1, y2) and all(torch.equal(a, b) for a, b in zip(g1, g2, strict=True))


def test_planned_node_keeps_weights_out_of_the_hooks_and_runs_backward_twice():
    """Saved-tensor hooks see x alone (the weights ride by reference); an offloading unpack
    (a fresh copy) gives the same grads; retain_graph runs backward twice alike."""
    ws = _weights("stacked", torch.float64)
    x = torch.randn(12, K, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(12, N, dtype=torch.float64)
    _step(x, ws, None, dy)  # (the plan)
    packed_ = []

    def pack(t):
        packed_.append(t)
        return t.clone()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = fd.grouped_linear(x, ws, [5, 0, 7], backend="torch")
    assert _planned(y) and len(packed_) == 1 and packed_[0] is x
    first = torch.autograd.grad(y, [x, ws], dy, retain_graph=True)
    second = torch.autograd.grad(y, [x, ws], dy)
    want = _step(x, ws, None, dy)[1]
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(first, second, want))


def test_planned_node_refuses_inputs_changed_before_backward():
    ws = _weights("list", torch.float64)
    x = torch.randn(12, K, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(12, N, dtype=torch.float64)
    _step(x, ws, None, dy)
    y = fd.grouped_linear(x, ws, [5, 0, 7], backend="torch")
    assert _planned(y)
    with torch.no_grad():
        ws[1].mul_(2)
    with pytest.raises(RuntimeError, match="weights"):
        y.backward(dy)
    h = x.detach().clone().requires_grad_() * 1
    y = fd.grouped_linear(h, ws, [5, 0, 7], backend="torch")
    with torch.no_grad():
        h.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward(dy)


def test_planned_node_gives_only_the_wanted_grads_and_second_order_terms():
    """x alone or the weights alone requiring grad; and a gradient of a gradient (create_graph)
    through the planned node equals the bridge's."""
    ws = _weights("stacked", torch.float64)
    x = torch.randn(12, K, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(12, N, dtype=torch.float64)
    ref = _step(x, ws, None, dy, create_graph=True)[1]  # the bridge (first call)
    dx, dw = _step(x, ws, None, dy, create_graph=True)[1]  # planned
    hx, hw = torch.autograd.grad((dx**2).sum() + (dw**2).sum(), [x, ws])
    rx, rw = torch.autograd.grad((ref[0] ** 2).sum() + (ref[1] ** 2).sum(), [x, ws])
    assert torch.equal(hx, rx) and torch.equal(hw, rw)
    frozen = ws.detach()
    y = fd.grouped_linear(x, frozen, [5, 0, 7], backend="torch")
    y = fd.grouped_linear(x, frozen, [5, 0, 7], backend="torch")
    assert _planned(y)
    y.backward(dy)
    assert frozen.grad is None and x.grad is not None
    x0 = x.detach()
    y = fd.grouped_linear(x0, ws, [5, 0, 7], backend="torch")
    assert _planned(y)
    (dw_only,) = torch.autograd.grad(y, [ws], dy)
    assert torch.equal(dw_only, dw.detach())


def test_grouped_mlp_runs_planned_and_bitwise_the_bridge():
    """grouped_mlp's planned node (from the first call: its checks all run in its forward)
    against its bridge (run_planned made to decline): the same y and grads, bit for bit."""
    g = torch.Generator().manual_seed(1)
    w1 = torch.randn(E, 2 * 8, K, generator=g, dtype=torch.float64, requires_grad=True)
    w2 = torch.randn(E, K, 8, generator=g, dtype=torch.float64, requires_grad=True)
    x = torch.randn(12, K, generator=g, dtype=torch.float64, requires_grad=True)
    probs = torch.rand(12, generator=g, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(12, K, generator=g, dtype=torch.float64)
    y = fd.grouped_mlp(x, w1, w2, [5, 0, 7], probs=probs, backend="torch")
    assert _planned(y)
    got = [y, *torch.autograd.grad(y, [x, w1, w2, probs], dy)]
    gm = importlib.import_module("functional_dw.grouped_mlp")
    with mock.patch.object(gm, "run_planned", lambda *a, **k: None):
        yb = fd.grouped_mlp(x, w1, w2, [5, 0, 7], probs=probs, backend="torch")
    assert not _planned(yb) and type(yb.grad_fn).__name__ == type(y.grad_fn).__name__
    want = [yb, *torch.autograd.grad(yb, [x, w1, w2, probs], dy)]
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_planned_node_refuses_a_sparse_dy_and_hands_autograd_only_the_wanted_grads():
    """A sparse dy (autograd matched its shape, not its layout) gets the bridge's TypeError;
    with one expert frozen, the node's hook sees None for it, as from the bridge (wgrad makes
    every expert's dW, so the node masks what autograd did not ask for: anomaly mode's NaN
    check would otherwise read a frozen expert's)."""
    ws = _weights("list", torch.float64)
    x = torch.randn(12, K, dtype=torch.float64, requires_grad=True)
    _step(x, ws, None, torch.randn(12, N, dtype=torch.float64))
    y = fd.grouped_linear(x, ws, [5, 0, 7], backend="torch")
    assert _planned(y)
    with pytest.raises(TypeError, match="dense"):
        y.backward(torch.randn(12, N, dtype=torch.float64).to_sparse())
    ws[1].requires_grad_(False)
    y = fd.grouped_linear(x, ws, [5, 0, 7], backend="torch")
    assert _planned(y)
    seen = []
    y.grad_fn.register_hook(lambda grad_inputs, grad_outputs: seen.append([g is not None for g in grad_inputs]))
    y.backward(torch.randn(12, N, dtype=torch.float64))
    assert seen == [[True, True, False, True]]


def test_a_list_subclass_of_weights_is_a_list():
    """A list subclass (a pytree leaf, not a list node) is taken as a list: every weight gets
    its gradient (before, none did, silently)."""

    class Weights(list):
        pass

    ws = Weights(_weights("list", torch.float64))
    x = torch.randn(12, K, dtype=torch.float64)
    for _ in range(2):  # the bridge, then the planned node
        fd.grouped_linear(x, ws, [5, 0, 7], backend="torch").sum().backward()
    assert all(w.grad is not None and w.grad.abs().sum() > 0 for w in ws if w is not ws[1])
