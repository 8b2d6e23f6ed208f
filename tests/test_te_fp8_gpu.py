"""FP8 on the TE backend, on a GPU, against TE 2.20's own modules under
``te.autocast(enabled=True, recipe=...)``. Skips cleanly without CUDA or TE.

(a) kernel level: ``kernels/te_fp8``'s quantize and GEMM calls, driven by hand the way the FP8
    contract's layer drives them (``/work/fp8-seam.md``), give ``te.GroupedLinear``'s and
    ``te.Linear``'s y, dx, dW (or main_grad) and dbias bitwise, for DelayedScaling,
    Float8CurrentScaling and Float8BlockScaling, on both grouped paths, with and without fused
    wgrad accumulation; delayed scaling over 3 steps, comparing the amax histories and scales
    of our ``DelayedScalingState`` (updated by ``fp8.update_state_``) with TE's ``fp8_meta``.
(b) layer level (needs the layers' ``recipe=``/``fp8_state=`` keywords; skipped before): the same
    parity through ``fd.linear`` / ``fd.grouped_linear`` with a DistributedWeight under
    ``save_on_cpu(pin_memory=True)``; and ``backend="torch"`` (the FP8 emulation) against TE
    within the tolerance of NOTE: [Emulation vs TE's FP8 GEMMs].
(c) ``fp8.quantize`` (the emulation) against TE's quantized bits.

Every comparison of a test is printed (``-s``), and a failure lists all mismatches: which
tensor, how many elements differ, the largest difference, the first differing element.

    python3 -m pytest tests/test_te_fp8_gpu.py -q -x -p no:cacheprovider [-s]
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
from collections import Counter

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
te = pytest.importorskip("transformer_engine.pytorch", reason="needs Transformer Engine for PyTorch")

import functional_dw as fd  # noqa: E402
from functional_dw import fp8  # noqa: E402
from functional_dw.kernels import Splits  # noqa: E402
from functional_dw.kernels.te_fp8_gemm import TE_FP8 as TE  # noqa: E402  (TE's FP8 kernels)
from helpers import randn  # noqa: E402
from transformer_engine.common import recipe as te_recipes  # noqa: E402
from transformer_engine.pytorch.quantization import FP8GlobalStateManager  # noqa: E402

BF16, DEV = torch.bfloat16, "cuda"
K = N = 256
NAMES = ["delayed", "current", "block"]
# a zero-token expert in each; multiples of 16 (the FP8 wgrad's leading dimension), of 128 for
# block scaling (TE's grouped block-scaling quantize needs them; the split path uses the same)
SIZES = {
    ("16", 4): [32, 0, 96, 128],
    ("16", 8): [16, 48, 0, 80, 32, 0, 64, 16],
    ("128", 4): [128, 0, 256, 128],
    ("128", 8): [128, 0, 128, 256, 0, 128, 128, 128],
}


def sizes_for(name: str, E: int) -> list[int]:
    return SIZES[("128" if name == "block" else "16", E)]


def te_recipe(name: str):
    return {
        "delayed": te_recipes.DelayedScaling,
        "current": te_recipes.Float8CurrentScaling,
        "block": te_recipes.Float8BlockScaling,
    }[name]()


def autocast(recipe):
    if hasattr(te, "autocast"):
        return te.autocast(enabled=True, recipe=recipe)
    return te.fp8_autocast(enabled=True, fp8_recipe=recipe)  # TE < 2.10's name


@pytest.fixture(autouse=True)
def fresh_te_state():
    FP8GlobalStateManager.reset()  # no module of an earlier test in TE's global amax buffers
    yield
    FP8GlobalStateManager.reset()


def needs_recipe(name: str) -> None:
    from transformer_engine.pytorch.quantization import check_fp8_block_scaling_support, check_fp8_support

    ok, why = check_fp8_block_scaling_support() if name == "block" else check_fp8_support()
    if not ok:
        pytest.skip(f"TE cannot run {name} scaling here: {why}")


def needs_grouped(recipe) -> None:
    """Skip unless TE's FP8 grouped-tensor path runs here; FDW_EXPECT_GROUPED=1: fail instead."""
    x, w = torch.empty(16, K, dtype=BF16, device=DEV), [torch.empty(N, K, dtype=BF16, device=DEV)]
    why = TE.grouped_path_unsupported(x, w, recipe=recipe)
    if why is not None and os.environ.get("FDW_EXPECT_GROUPED") == "1":
        pytest.fail(f"FDW_EXPECT_GROUPED=1 but TE's grouped-tensor path cannot run {type(recipe).__name__}: {why}")
    if why is not None:
        pytest.skip(f"TE grouped-tensor path unavailable: {why}")


randn = functools.partial(randn, dtype=BF16, device=DEV)


def splits_arg(sizes, grouped: bool):
    return torch.tensor(sizes, dtype=torch.int64, device=DEV) if grouped else list(sizes)


def splits_record(sizes, grouped: bool) -> Splits:
    """What the layer builds: host counts on the split path, a CUDA tensor on the grouped one."""
    return Splits(
        host=None if grouped else tuple(sizes),
        tensor=torch.tensor(sizes, dtype=torch.int64, device=DEV) if grouped else None,
        device=torch.device(DEV),
        num_tokens=sum(sizes),
        num_experts=len(sizes),
    )


class Check:
    """Collects a test's comparisons, prints them all (pytest -s), fails listing every mismatch."""

    def __init__(self, title: str):
        self.title, self.lines, self.bad = title, [], []

    def _add(self, ok: bool, text: str) -> None:
        self.lines.append(("   ok  " if ok else "  DIFF ") + text)
        if not ok:
            self.bad.append(text)

    def equal(self, got, want, what: str) -> None:
        if got is None or want is None:
            kind = lambda t: "None" if t is None else "a tensor"  # noqa: E731
            return self._add(got is None and want is None, f"{what}: got {kind(got)}, want {kind(want)}")
        if got.dtype != want.dtype or got.shape != want.shape:
            return self._add(False, f"{what}: {got.dtype}{tuple(got.shape)} vs {want.dtype}{tuple(want.shape)}")
        if torch.equal(got, want):
            return self._add(True, f"{what}: bitwise equal {tuple(got.shape)}")
        diff = (got.double() - want.double()).abs().nan_to_num(float("inf"))
        ne = (got != want) & ~(got.isnan() & want.isnan())
        i = int(ne.flatten().nonzero()[0]) if ne.any() else 0
        self._add(
            False,
            f"{what}: {int(ne.sum())} of {got.numel()} differ, max |diff| {diff.max().item():.4g} "
            f"(|want| max {want.double().abs().max().item():.4g}); first at {i}: "
            f"got {got.flatten()[i].item()!r}, want {want.flatten()[i].item()!r}",
        )

    def within(self, got, want, bound, what: str) -> None:
        """|got - want| <= bound, elementwise (bound: a tensor like want, or a number)."""
        err = (got.double() - want.double()).abs()
        bound = torch.as_tensor(bound, dtype=torch.float64, device=err.device).expand_as(err)
        over = err > bound
        ratio = (err / bound.clamp_min(1e-300)).max().item() if err.numel() else 0.0
        text = f"{what}: max |diff| {err.max().item() if err.numel() else 0:.4g}, max diff/bound {ratio:.3g}"
        if over.any():
            i = int((err - bound).flatten().argmax())
            text += (
                f"; {int(over.sum())} of {err.numel()} outside, worst at {i}: got {got.flatten()[i].item()!r}, "
                f"want {want.flatten()[i].item()!r}, bound {bound.flatten()[i].item():.3g}"
            )
        self._add(not over.any(), text)

    def done(self) -> None:
        print(f"\n{self.title}\n" + "\n".join(self.lines))
        if self.bad:
            pytest.fail(f"{self.title}: {len(self.bad)} mismatch(es):\n  " + "\n  ".join(self.bad), pytrace=False)


def te_state(m) -> list[torch.Tensor]:
    f, b = m.fp8_meta["scaling_fwd"], m.fp8_meta["scaling_bwd"]
    return [f.amax_history, f.scale, b.amax_history, b.scale]


def check_state(c: Check, ours: fp8.DelayedScalingState, m, step: int) -> None:
    names = ("amax_history_fwd", "scale_fwd", "amax_history_bwd", "scale_bwd")
    for name, want in zip(names, te_state(m)):
        c.equal(getattr(ours, name), want, f"step {step} {name}")


# --- (a) kernel level: te_fp8 driven by hand --------------------------------------------------


def amax_view(state, role: str, e: int | None = None) -> torch.Tensor:
    """Row 0 of the amax history at GEMM e's ``role`` (a 0-d view), or all E of them (strided)."""
    side, col = fp8.slot(role, 0 if e is None else e, state.num_gemms)
    row = getattr(state, f"amax_history_{side}")[0]
    return (
        row[col] if e is not None else row[col :: fp8.state.FWD_PER_GEMM if side == "fwd" else fp8.state.BWD_PER_GEMM]
    )


def q_args(state, role: str, e: int | None = None, *, record: bool = True) -> dict:
    """Delayed scaling's scale (and amax) views for quantize (e given) or grouped_quantize."""
    if state is None:
        return {}
    if e is None:
        return {"scales": fp8.group_scales(state, role), "amaxes": amax_view(state, role) if record else None}
    return {"scale": fp8.scale_for(state, role, e), "amax": amax_view(state, role, e) if record else None}


def kernels_grouped_step(recipe, state, x, ws, b_EN, sizes, dy, grouped, main_grads):
    """One forward+backward of a GroupedLinear through te_fp8, as the contract's layer does it."""
    sx, sw, sdy = (fp8.tensor_spec(recipe, role) for role in fp8.ROLES)
    acc = fp8.split_accumulator(recipe)
    splits = splits_record(sizes, grouped)
    xq = TE.grouped_quantize(x, splits, sx, rowwise=True, columnwise=True, grouped=grouped, **q_args(state, "input"))
    wq = [TE.quantize(w, sw, rowwise=True, columnwise=False, **q_args(state, "weight", e)) for e, w in enumerate(ws)]
    y = TE.grouped_fprop(xq, wq, b_EN, splits, grouped, split_accumulator=acc.fprop)
    saved = xq.with_usage(rowwise=False, columnwise=True)  # the residual
    del xq, wq
    w_scales = None if state is None else fp8.group_scales(state, "weight").clone()  # forward's, for backward
    if state is not None:
        fp8.update_state_(state, recipe, which="fwd")  # TE: at autocast exit
    dyq = TE.grouped_quantize(
        dy, splits, sdy, rowwise=True, columnwise=True, grouped=grouped, with_dbias=True, **q_args(state, "grad_output")
    )
    wb = [
        TE.quantize(
            w,
            sw,
            rowwise=False,
            columnwise=True,  # re-quantized, nothing recorded
            **({} if state is None else {"scale": w_scales[e]}),
        )
        for e, w in enumerate(ws)
    ]
    dx = TE.grouped_dgrad(dyq, wb, splits, grouped, split_accumulator=acc.dgrad)
    dw, db = TE.grouped_wgrad(
        saved,
        dyq,
        splits,
        grouped,
        out=main_grads,
        accumulate=main_grads is not None,
        with_dbias=True,
        split_accumulator=acc.wgrad,
    )
    if state is not None:
        fp8.update_state_(state, recipe, which="bwd")  # TE: after the first module's backward
    return {"y": y, "dx": dx, "dw": list(dw), "db": list(db)}


def te_grouped_module(E, grouped, fused, dtype=BF16, seed=0):
    m = te.GroupedLinear(
        E, K, N, bias=True, params_dtype=dtype, device=DEV, use_grouped_tensor=grouped, fuse_wgrad_accumulation=fused
    )
    with torch.no_grad():
        for e in range(E):
            getattr(m, f"weight{e}").copy_(randn(N, K, dtype=dtype, scale=0.05, seed=seed + e))
            getattr(m, f"bias{e}").copy_(randn(N, dtype=dtype, seed=1000 + seed + e))
    if fused:
        for e in range(E):
            getattr(m, f"weight{e}").main_grad = torch.zeros(N, K, dtype=torch.float32, device=DEV)
    return m


def params(m, name):
    return [getattr(m, f"{name}{e}") for e in range(m.num_gemms)]


def te_grouped_step(m, recipe, x, sizes, dy, grouped, fused):
    xt = x.clone().requires_grad_()
    with autocast(recipe):
        y = m(xt, splits_arg(sizes, grouped))
    y.backward(dy)
    ws, bs = params(m, "weight"), params(m, "bias")
    out = {
        "y": y.detach(),
        "dx": xt.grad,
        "dw": [(w.main_grad if fused else w.grad).clone() for w in ws],
        "db": [b.grad.clone() for b in bs],
    }
    for p in ws + bs:
        p.grad = None
    return out


def compare_grouped(c: Check, got, want, sizes, grouped, fused, step, atomic_db: bool):
    c.equal(got["y"], want["y"], f"step {step} y")
    c.equal(got["dx"], want["dx"], f"step {step} dx")
    for e, (a, b) in enumerate(zip(got["dw"], want["dw"])):
        if grouped and not fused and sizes[e] == 0:  # TE's own is torch.empty there if the GEMM skips K=0
            c._add(
                bool(torch.count_nonzero(a) == 0),
                f"step {step} dw[{e}] (0 tokens): ours all zeros "
                f"({int(torch.count_nonzero(a))} nonzero); TE's has {int(torch.count_nonzero(b))} nonzero",
            )
        else:
            c.equal(a, b, f"step {step} {'main_grad' if fused else 'dw'}[{e}]")
    for e, (a, b) in enumerate(zip(got["db"], want["db"])):
        if atomic_db:  # TE's grouped dbias: a Triton kernel adding fp32 partial sums atomically
            c.within(a, b, 2.0**-7 * b.double().abs() + 1e-6, f"step {step} db[{e}] (fp32 atomics: within a bf16 ulp)")
        else:
            c.equal(a, b, f"step {step} db[{e}]")


@pytest.mark.parametrize("E", [4, 8])
@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
@pytest.mark.parametrize("grouped", [False, True], ids=["split", "grouped"])
@pytest.mark.parametrize("name", NAMES)
def test_kernels_match_te_grouped_linear(name, grouped, fused, E):
    if grouped and name == "delayed":
        pytest.skip("TE runs DelayedScaling on the split path only (its grouped path has no delayed kernels)")
    needs_recipe(name)
    tr = te_recipe(name)
    recipe = fp8.as_recipe(tr)
    if grouped:
        needs_grouped(recipe)
    sizes, T = sizes_for(name, E), sum(sizes_for(name, E))
    m = te_grouped_module(E, grouped, fused)
    ws = [w.detach().clone() for w in params(m, "weight")]
    b_EN = torch.stack([b.detach().clone() for b in params(m, "bias")])
    main_grads = [torch.zeros(N, K, dtype=torch.float32, device=DEV) for _ in range(E)] if fused else None
    state = fp8.init_state(recipe, E, device=DEV) if name == "delayed" else None
    c = Check(
        f"kernels vs te.GroupedLinear: {name}, {'grouped' if grouped else 'split'}, "
        f"{'fused main_grad' if fused else 'plain'}, E={E}, splits={sizes}"
    )
    for step in range(3 if state is not None else 1):
        x, dy = randn(T, K, seed=10 + step), randn(T, N, seed=20 + step)
        want = te_grouped_step(m, tr, x, sizes, dy, grouped, fused)
        got = kernels_grouped_step(recipe, state, x, ws, b_EN, sizes, dy, grouped, main_grads)
        if fused:
            got["dw"] = [g.clone() for g in main_grads]
        compare_grouped(c, got, want, sizes, grouped, fused, step, atomic_db=grouped and name == "current")
        if state is not None:
            check_state(c, state, m, step)
    c.done()


@pytest.mark.parametrize("grouped", [False, True], ids=["split", "grouped"])
@pytest.mark.parametrize("name", ["current", "block"])
def test_saved_fp8_x_survives_a_trip_through_host_memory(name, grouped):
    """The residual x (TEQGroup / grouped TEQ) is a pytree of its storage's tensors: copied to the
    host and back leaf by leaf (what save_on_cpu does) and rebuilt, wgrad is unchanged."""
    import torch.utils._pytree as pytree

    needs_recipe(name)
    recipe = fp8.as_recipe(te_recipe(name))
    if grouped:
        needs_grouped(recipe)
    sizes = sizes_for(name, 4)
    splits, T = splits_record(sizes, grouped), sum(sizes)
    sx, sdy = fp8.tensor_spec(recipe, "input"), fp8.tensor_spec(recipe, "grad_output")
    xq = TE.grouped_quantize(randn(T, K, seed=1), splits, sx, rowwise=True, columnwise=True, grouped=grouped)
    saved = xq.with_usage(rowwise=False, columnwise=True)
    leaves, spec = pytree.tree_flatten(saved)
    back = pytree.tree_unflatten([t.cpu().to(DEV) for t in leaves], spec)
    dyq = TE.grouped_quantize(randn(T, N, seed=2), splits, sdy, rowwise=True, columnwise=True, grouped=grouped)
    c = Check(
        f"FP8 residual through host memory: {name}, {'grouped' if grouped else 'split'}: {len(leaves)} leaves "
        f"{sorted({str(t.dtype) for t in leaves})}, {sum(t.numel() * t.element_size() for t in leaves)} bytes"
    )
    acc = fp8.split_accumulator(recipe).wgrad  # block scaling: cuBLAS has no fast-accumulation kernel
    dw_a, _ = TE.grouped_wgrad(saved, dyq, splits, grouped, split_accumulator=acc)
    dw_b, _ = TE.grouped_wgrad(back, dyq, splits, grouped, split_accumulator=acc)
    for e in range(4):
        if sizes[e]:
            c.equal(dw_b[e], dw_a[e], f"dw[{e}]")
    kinds = (torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2, torch.float32, torch.int64)
    c._add(
        all(t.dtype in kinds for t in leaves), "leaves are FP8 bytes, fp32 scales (and amaxes), int64 splits/offsets"
    )
    with pytest.raises(ValueError, match="holds no rowwise data"):
        saved.with_usage(rowwise=True, columnwise=True)
    c.done()


def kernels_linear_step(recipe, state, x, w, b, dy, main_grad):
    sx, sw, sdy = (fp8.tensor_spec(recipe, role) for role in fp8.ROLES)
    acc = fp8.split_accumulator(recipe)
    xq = TE.quantize(x, sx, rowwise=True, columnwise=True, **q_args(state, "input", 0))
    wq = TE.quantize(w, sw, rowwise=True, columnwise=False, **q_args(state, "weight", 0))
    y = TE.fprop(xq, wq, b, split_accumulator=acc.fprop)
    saved = xq.with_usage(rowwise=False, columnwise=True)
    w_scale = None if state is None else fp8.scale_for(state, "weight").clone()
    if state is not None:
        fp8.update_state_(state, recipe, which="fwd")
    dyq = TE.quantize(dy, sdy, rowwise=True, columnwise=True, with_dbias=True, **q_args(state, "grad_output", 0))
    wb = TE.quantize(w, sw, rowwise=False, columnwise=True, **({} if state is None else {"scale": w_scale}))
    dx = TE.dgrad(dyq, wb, split_accumulator=acc.dgrad)
    dw, db = TE.wgrad(
        saved, dyq, out=main_grad, accumulate=main_grad is not None, with_dbias=True, split_accumulator=acc.wgrad
    )
    if state is not None:
        fp8.update_state_(state, recipe, which="bwd")
    return {"y": y, "dx": dx, "dw": dw.clone(), "db": db}


def te_linear_module(fused, dtype=BF16):
    lin = te.Linear(K, N, bias=True, params_dtype=dtype, device=DEV, fuse_wgrad_accumulation=fused)
    with torch.no_grad():
        lin.weight.copy_(randn(N, K, dtype=dtype, scale=0.05, seed=1))
        lin.bias.copy_(randn(N, dtype=dtype, seed=2))
    if fused:
        lin.weight.main_grad = torch.zeros(N, K, dtype=torch.float32, device=DEV)
    return lin


def te_linear_step(lin, recipe, x, dy, fused):
    xt = x.clone().requires_grad_()
    with autocast(recipe):
        y = lin(xt)
    y.backward(dy)
    out = {
        "y": y.detach(),
        "dx": xt.grad,
        "dw": (lin.weight.main_grad if fused else lin.weight.grad).clone(),
        "db": lin.bias.grad.clone(),
    }
    lin.weight.grad = lin.bias.grad = None
    return out


@pytest.mark.parametrize("dtype", [BF16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
@pytest.mark.parametrize("name", NAMES)
def test_kernels_match_te_linear(name, fused, dtype):
    """fp32 activations too: TE accepts them under FP8 (output in fp32, bias cast to bf16)."""
    needs_recipe(name)
    tr = te_recipe(name)
    recipe = fp8.as_recipe(tr)
    lin = te_linear_module(fused, dtype)
    w, b = lin.weight.detach().clone(), lin.bias.detach().clone()
    main_grad = torch.zeros(N, K, dtype=torch.float32, device=DEV) if fused else None
    state = fp8.init_state(recipe, 1, device=DEV) if name == "delayed" else None
    c = Check(f"kernels vs te.Linear: {name}, {'fused main_grad' if fused else 'plain'}, {dtype}")
    for step in range(3 if state is not None else 1):
        x, dy = randn(128, K, dtype=dtype, seed=30 + step), randn(128, N, dtype=dtype, seed=40 + step)
        want = te_linear_step(lin, tr, x, dy, fused)
        got = kernels_linear_step(recipe, state, x, w, b, dy, main_grad)
        for key in ("y", "dx", "dw", "db"):
            c.equal(got[key], want[key], f"step {step} {'main_grad' if key == 'dw' and fused else key}")
        if state is not None:
            check_state(c, state, lin, step)
    c.done()


# --- (c) the emulation's quantization vs TE's bits --------------------------------------------


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype != torch.uint8 else t


@pytest.mark.parametrize("role", fp8.ROLES)
@pytest.mark.parametrize("name", NAMES)
def test_emulated_quantization_matches_te_bits(name, role):
    """fp8.quantize (pure torch, used by backend='torch') gives TE's FP8 bytes and inverse scales:
    then the emulation and TE differ only in GEMM accumulation (NOTE: [Emulation vs TE's FP8 GEMMs])."""
    needs_recipe(name)
    spec = fp8.tensor_spec(fp8.as_recipe(te_recipe(name)), role)
    x = randn(192, K, seed=50) * 3  # 192 rows: a partial 128-row tile
    x[3, 5] = 0.0
    x[7, :] *= 1000.0  # saturates under a delayed scale
    scale = torch.tensor(7.5, device=DEV) if name == "delayed" else None
    amax = torch.zeros((), device=DEV)
    q = TE.quantize(x, spec, scale=scale, amax=amax if scale is not None else None, rowwise=True, columnwise=True)
    r = fp8.quantize(x, spec, scale=scale, rowwise=True, columnwise=True)
    c = Check(f"fp8.quantize vs TE: {name} {role}, {tuple(x.shape)}")
    st = q.storage
    if spec.scaling == "block":
        rows, cols = x.shape
        c.equal(_bits(r.rowwise_data), _bits(st._rowwise_data), "rowwise data")
        c.equal(_bits(r.columnwise_data), _bits(st._columnwise_data), "columnwise data")
        c.equal(
            r.rowwise_scale_inv,
            fp8.from_te_scale_inv(st._rowwise_scale_inv, rows, cols, spec.block),
            "rowwise scale_inv",
        )
        c.equal(
            r.columnwise_scale_inv,
            fp8.from_te_scale_inv(st._columnwise_scale_inv, cols, rows, spec.block),
            "columnwise scale_inv",
        )
    else:
        c.equal(_bits(r.rowwise_data), _bits(st._data), "data")
        c.equal(_bits(r.columnwise_data), _bits(st._transpose), "transpose")
        c.equal(r.rowwise_scale_inv.reshape(1), st._scale_inv.reshape(1), "scale_inv")
        if scale is not None:
            c.equal(amax.reshape(1), r.amax, "amax recorded by TE's cast vs the emulation's")
    c.done()


# --- (b) layer level (fp8int's layers: recipe= / fp8_state=) ----------------------------------


def _layers_take_fp8() -> bool:
    return all(
        "recipe" in inspect.signature(f).parameters and "fp8_state" in inspect.signature(f).parameters
        for f in (fd.linear, fd.grouped_linear)
    )


layers = pytest.mark.skipif(not _layers_take_fp8(), reason="the layers do not take recipe=/fp8_state= yet")


class FullDW(torch.nn.Parameter):
    """A DistributedWeight whose shard is the full weight: materialize returns the group's
    weights as they are; fused, it takes the wgrad GEMM's output in ``grad_buffer()`` and adds it
    into ``main_grad`` in ``finalize_group_grads`` (zero dummies returned), as Megatron's does."""

    is_distributed_weight = True

    def __new__(cls, data, fused=False):
        self = super().__new__(cls, data.detach().clone(), True)
        self.group, self.calls, self.fused = [self], Counter(), fused
        if fused:
            self.main_grad = torch.zeros(self.shape, dtype=torch.float32, device=self.device)
            self.buffer = torch.full(self.shape, 1000.0, dtype=torch.float32, device=self.device)  # stale
            self.grad_added_to_main_grad = False
        return self

    @classmethod
    def group_of(cls, tensors, fused=False):
        members = [cls(t, fused) for t in tensors]
        for m in members:
            m.group = members
        return members

    def _gather(self, phase):
        self.calls[phase] += 1
        full = [m.detach() for m in self.group]
        return full if len(full) > 1 else full[0]

    def materialize_group_for_forward(self):
        return self._gather("forward")

    def materialize_group_for_backward(self, **kwargs):
        return self._gather("backward")

    def grad_buffer(self):
        return self.buffer

    def finalize_group_grads(self, wgrads):
        self.calls["finalize"] += 1
        wgrads = wgrads if isinstance(wgrads, list) else [wgrads]
        if not self.fused:
            return wgrads
        for m, g in zip(self.group, wgrads):
            m.main_grad += g
            m.buffer.fill_(1000.0)
            m.grad_added_to_main_grad = True
        return [torch.zeros_like(m) for m in self.group]


def layer_grouped_step(recipe, state, x, ws, bs, sizes, dy, grouped, fused, backend, hooks=True):
    xx = x.clone().requires_grad_()
    ctx = torch.autograd.graph.save_on_cpu(pin_memory=True) if hooks else contextlib.nullcontext()
    with ctx:
        y = fd.grouped_linear(
            xx,
            ws,
            splits_arg(sizes, grouped),
            bs,
            recipe=recipe,
            fp8_state=state,
            backend=backend,
            use_grouped_tensor=grouped,
            fuse_wgrad_accumulation=fused,
        )
    if state is not None:
        fp8.update_state_(state, recipe, which="fwd")
    y.backward(dy)
    if state is not None:
        fp8.update_state_(state, recipe, which="bwd")
    out = {
        "y": y.detach(),
        "dx": xx.grad,
        "dw": [(w.main_grad if fused else w.grad).clone() for w in ws],
        "db": [b.grad.clone() for b in bs],
    }
    for p in (*ws, *bs):
        p.grad = None
    return out


def check_path(recipe, x, ws, bs, sizes, grouped, backend):
    """The path the layer takes (under no_grad, with a throwaway state: forward records amaxes)."""
    state = fp8.init_state(recipe, len(ws), device=DEV) if isinstance(recipe, fp8.DelayedScaling) else None
    with torch.no_grad():
        _, res = fd.grouped_linear_fwd(
            x,
            ws,
            splits_arg(sizes, grouped),
            bs,
            recipe=recipe,
            fp8_state=state,
            backend=backend,
            use_grouped_tensor=grouped,
        )
    assert res.path == ("grouped" if grouped else "split"), (res.path, grouped)


@layers
@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
@pytest.mark.parametrize("grouped", [False, True], ids=["split", "grouped"])
@pytest.mark.parametrize("name", NAMES)
def test_grouped_linear_with_distributed_weight_under_save_on_cpu_equals_te(name, grouped, fused):
    if grouped and name == "delayed":
        pytest.skip("TE runs DelayedScaling on the split path only")
    needs_recipe(name)
    tr = te_recipe(name)
    recipe = fp8.as_recipe(tr)
    if grouped:
        needs_grouped(recipe)
    E = 4
    sizes, T = sizes_for(name, E), sum(sizes_for(name, E))
    m = te_grouped_module(E, grouped, fused)
    ws = FullDW.group_of([w.detach() for w in params(m, "weight")], fused)
    bs = [torch.nn.Parameter(b.detach().clone()) for b in params(m, "bias")]
    check_path(recipe, randn(T, K, seed=9), [w.detach().clone() for w in ws], bs, sizes, grouped, "te")
    state = fp8.init_state(recipe, E, device=DEV) if name == "delayed" else None
    c = Check(
        f"fd.grouped_linear(DW, save_on_cpu) vs te.GroupedLinear: {name}, "
        f"{'grouped' if grouped else 'split'}, {'fused' if fused else 'plain'}, splits={sizes}"
    )
    for step in range(3 if state is not None else 1):
        x, dy = randn(T, K, seed=60 + step), randn(T, N, seed=70 + step)
        want = te_grouped_step(m, tr, x, sizes, dy, grouped, fused)
        got = layer_grouped_step(recipe, state, x, ws, bs, sizes, dy, grouped, fused, "te")
        compare_grouped(c, got, want, sizes, grouped, fused, step, atomic_db=grouped and name == "current")
        if state is not None:
            check_state(c, state, m, step)
    steps = 3 if state is not None else 1
    c._add(
        ws[0].calls == Counter(forward=steps, backward=steps, finalize=steps),
        f"DW calls {dict(ws[0].calls)} over {steps} step(s) (a gather per forward and per backward, a finalize)",
    )
    c.done()


@layers
@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
@pytest.mark.parametrize("name", NAMES)
def test_linear_with_distributed_weight_under_save_on_cpu_equals_te(name, fused):
    needs_recipe(name)
    tr = te_recipe(name)
    recipe = fp8.as_recipe(tr)
    lin = te_linear_module(fused)
    (w,) = FullDW.group_of([lin.weight.detach()], fused)
    b = torch.nn.Parameter(lin.bias.detach().clone())
    state = fp8.init_state(recipe, 1, device=DEV) if name == "delayed" else None
    c = Check(f"fd.linear(DW, save_on_cpu) vs te.Linear: {name}, {'fused' if fused else 'plain'}")
    for step in range(3 if state is not None else 1):
        x, dy = randn(128, K, seed=80 + step), randn(128, N, seed=90 + step)
        want = te_linear_step(lin, tr, x, dy, fused)
        xx = x.clone().requires_grad_()
        with torch.autograd.graph.save_on_cpu(pin_memory=True):
            y = fd.linear(xx, w, b, recipe=recipe, fp8_state=state, backend="te", fuse_wgrad_accumulation=fused)
        if state is not None:
            fp8.update_state_(state, recipe, which="fwd")
        y.backward(dy)
        if state is not None:
            fp8.update_state_(state, recipe, which="bwd")
        got = {"y": y.detach(), "dx": xx.grad, "dw": (w.main_grad if fused else w.grad).clone(), "db": b.grad.clone()}
        w.grad = b.grad = None
        for key in ("y", "dx", "dw", "db"):
            c.equal(got[key], want[key], f"step {step} {'main_grad' if key == 'dw' and fused else key}")
        if state is not None:
            check_state(c, state, lin, step)
    c.done()


# NOTE: [Emulation vs TE's FP8 GEMMs]
#   backend='torch' quantizes as TE does (bit for bit: test_emulated_quantization_matches_te_bits),
#   then dequantizes both operands to fp32 and multiplies in fp32. TE's cuBLASLt FP8 GEMM sums the
#   same FP8 products in the tensor cores' accumulator, which keeps about 14 significant bits
#   (DeepSeek-V3 report, sec. 3.3.2), and applies the scales after. With split accumulation
#   (use_split_accumulator=True: dgrad, wgrad, every block-scaled GEMM) partial sums of one
#   k-block (32 products) are promoted to fp32: error ~ sqrt(32) 2^-14 ~ 2^-11.5 of sum|a b|;
#   with fast accumulation (fprop of delayed/current scaling) the whole K = 256 sum stays there:
#   ~ sqrt(256) 2^-14 = 2^-10 typically, 2^-6 worst case. The bound per element is
#       |te - emulation| <= rounds * ulp(out, |want|) + delta * mag,   mag = sum_k |a_k b_k|
#   with delta = 2^-10 (split) or 2^-7 (fast), mag from the high-precision operands times 1.25
#   (an E4M3/E5M2 rounding moves a value by at most 2^-4 / 2^-3), ulp(bf16) = 2^-7 |want|
#   (fp32 main_grad: 2^-22 |want|), rounds = 2 on the grouped path's y (TE adds the bias after
#   rounding). Bias grads: both sum the high-precision dy in fp32: 2^-7 |want| + 2^-16 sum |dy|.
#   The largest diff/bound ratio is printed, so the bound can be tightened from the H200's numbers.


def _ulp(dtype) -> float:
    return 2.0**-7 if dtype == BF16 else 2.0**-22


@layers
@pytest.mark.parametrize("grouped", [False, True], ids=["split", "grouped"])
@pytest.mark.parametrize("name", NAMES)
def test_emulation_is_close_to_te(name, grouped):
    if grouped and name == "delayed":
        pytest.skip("TE runs DelayedScaling on the split path only")
    needs_recipe(name)
    tr = te_recipe(name)
    recipe = fp8.as_recipe(tr)
    if grouped:
        needs_grouped(recipe)
    E, fused = 4, True
    sizes, T = sizes_for(name, E), sum(sizes_for(name, E))
    m = te_grouped_module(E, grouped, fused)
    ws = [torch.nn.Parameter(w.detach().clone()) for w in params(m, "weight")]
    for w in ws:
        w.main_grad = torch.zeros(N, K, dtype=torch.float32, device=DEV)
    bs = [torch.nn.Parameter(b.detach().clone()) for b in params(m, "bias")]
    state = fp8.init_state(recipe, E, device=DEV) if name == "delayed" else None
    acc = fp8.split_accumulator(recipe)
    delta = {True: 2.0**-10, False: 2.0**-7}
    c = Check(f"backend='torch' (emulation) vs te.GroupedLinear: {name}, {'grouped' if grouped else 'split'}")
    for step in range(3 if state is not None else 1):
        x, dy = randn(T, K, seed=100 + step), randn(T, N, seed=110 + step)
        want = te_grouped_step(m, tr, x, sizes, dy, grouped, fused)
        got = layer_grouped_step(recipe, state, x, ws, bs, sizes, dy, grouped, fused, "torch", hooks=False)
        xs, dys = x.double().abs().split(sizes), dy.double().abs().split(sizes)
        wa = [w.detach().double().abs() for w in ws]
        mag_y = torch.cat([xe @ w.t() for xe, w in zip(xs, wa)]) * 1.25
        mag_dx = torch.cat([de @ w for de, w in zip(dys, wa)]) * 1.25
        rounds_y = 2 if grouped else 1
        c.within(
            got["y"],
            want["y"],
            rounds_y * _ulp(BF16) * want["y"].double().abs() + delta[acc.fprop] * mag_y,
            f"step {step} y",
        )
        c.within(
            got["dx"], want["dx"], _ulp(BF16) * want["dx"].double().abs() + delta[acc.dgrad] * mag_dx, f"step {step} dx"
        )
        for e in range(E):
            mag_dw = dys[e].t() @ xs[e] * 1.25
            c.within(
                got["dw"][e],
                want["dw"][e],
                _ulp(torch.float32) * want["dw"][e].double().abs() + delta[acc.wgrad] * mag_dw,
                f"step {step} main_grad[{e}] (cumulative)",
            )
            c.within(
                got["db"][e],
                want["db"][e],
                _ulp(BF16) * want["db"][e].double().abs() + 2.0**-16 * dys[e].sum(0),
                f"step {step} db[{e}]",
            )
        if state is not None:
            check_state(c, state, m, step)
    c.done()
