"""FP8 properties that hold on every backend: run on the CPU (reference kernels) and, with
``-m gpu`` on a CUDA machine, on the backend ``backend=None`` picks there (TE's FP8 kernels when
TE is installed, else the reference kernels on CUDA).

What the saved-tensor hooks see and move, results under offloading hooks, retain_graph, the
delayed-scaling state's slots, DistributedWeight hooks, the size checks, and the distance to the
emulation written out (``test_fp8_layers.direct``): bitwise on the CPU, within a stated bound on
CUDA (NOTE: [FP8 on the GPU vs the emulation]).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.utils._pytree as pytree

from conftest import HOOKS, FakeDW, Recorder, assert_same
from functional_dw import fp8
from test_fp8_layers import (
    BF16,
    E,
    K,
    LAYER_IDS,
    LAYERS,
    N,
    RECIPES,
    SPLITS,
    T,
    _call,
    _inputs,
    _run,
    _scales,
    _state,
    direct,
)

DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
    ),
]


def _to(device, *ts):
    return [None if t is None else [u.to(device) for u in t] if isinstance(t, list) else t.to(device) for t in ts]


BIG_SPLITS = [128, 0, 256]  # whole 1x128 tiles per expert


@pytest.mark.parametrize("layer", ["linear", "grouped"])
@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("device", DEVICES)
def test_hooks_move_about_half_the_bytes_of_bf16_x_and_no_weight(device, name, layer):
    recipe = RECIPES[name]
    Tb = sum(BIG_SPLITS)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(Tb, K, generator=g).to(device, BF16).requires_grad_()
    ws = [
        (torch.randn(N, K, generator=g) * 0.1).to(device, BF16).requires_grad_()
        for _ in range(1 if layer == "linear" else E)
    ]
    with Recorder(lambda t: t, lambda t: t) as rec:
        y = _call(layer, None, x, ws, None, recipe, _state(recipe, layer, device), splits=BIG_SPLITS)
    nbytes = sum(t.numel() * t.element_size() for t in rec.packed)
    assert x.numel() <= nbytes <= 0.55 * x.numel() * 2, nbytes
    assert not any(t.dtype == BF16 for t in rec.packed), "no high-precision tensor: no x, no weight"
    ptrs = {w.untyped_storage().data_ptr() for w in ws}
    assert not any(t.untyped_storage().data_ptr() in ptrs for t in rec.packed if t.numel())
    y.backward(torch.ones_like(y))
    assert rec.unpacks == len(rec.packed) and all(w.grad is not None for w in ws)


@pytest.mark.parametrize("hook", ["save_on_cpu", "megatron_offload"])
@pytest.mark.parametrize("layer,path", LAYERS, ids=LAYER_IDS)
@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("device", DEVICES)
def test_offloading_hooks_bitwise(device, name, layer, path, hook):
    recipe = RECIPES[name]
    x, ws, bs, dy = _to(device, *_inputs(layer))
    out = []
    for ctx in (contextlib.nullcontext(), HOOKS[hook]()):
        state = _state(recipe, layer, device)
        with ctx:
            out.append((_run(layer, path, recipe, state, x, ws, bs, dy), state))
    (a, sa), (b, sb) = out
    for what, u, v in zip(("y", "dx", "dW"), a[:3], b[:3]):
        assert_same(u, v, what)
    if device == "cpu":
        assert_same(a[3], b[3], "db")
    else:  # the per-expert bias sums use atomics on CUDA
        for u, v in zip(a[3], b[3]):
            torch.testing.assert_close(u, v)
    if sa is not None:
        assert_same(pytree.tree_leaves(sa), pytree.tree_leaves(sb), "state")


@pytest.mark.parametrize("layer,path", LAYERS, ids=LAYER_IDS)
@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("device", DEVICES)
def test_retain_graph_twice(device, name, layer, path):
    """Two backwards: dx and the fused fp32 main_grad double exactly; delayed scaling's state is
    what the first backward left."""
    recipe = RECIPES[name]
    x, ws, _, dy = _to(device, *_inputs(layer, bias=False))
    state = _state(recipe, layer, device)
    xr = x.clone().requires_grad_()
    params = [w.clone().requires_grad_() for w in ws]
    for p in params:
        p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=device)
    y = _call(layer, path, xr, params, None, recipe, state, fuse_wgrad_accumulation=True)
    y.backward(dy, retain_graph=True)
    once, main_once = xr.grad.clone(), [p.main_grad.clone() for p in params]
    after_one = None if state is None else [t.clone() for t in pytree.tree_leaves(state)]
    y.backward(dy)
    assert_same(xr.grad, 2 * once, "dx")
    assert_same([p.main_grad for p in params], [2 * m for m in main_once], "main_grad")
    assert any(m.any() for m in main_once)
    if state is not None:
        assert_same(pytree.tree_leaves(state), after_one, "state")


@pytest.mark.parametrize("layer,path", LAYERS, ids=LAYER_IDS)
@pytest.mark.parametrize("device", DEVICES)
def test_delayed_state_slots(device, layer, path):
    """Forward records each GEMM's input and weight amax at slot(role, gemm=e), backward dy's;
    the output/grad_input slots stay 0; two steps with fp8.update_state_ between."""
    recipe = fp8.DelayedScaling(amax_history_len=4)
    experts = 1 if layer == "linear" else E
    state = fp8.init_state(recipe, num_gemms=experts, device=device)
    rows = [T] if layer == "linear" else SPLITS
    for step in range(2):
        x, ws, bs, dy = _to(device, *_inputs(layer, seed=10 * step))
        _run(layer, path, recipe, state, x, ws, bs, dy)
        for e, (xe, dye) in enumerate(zip(x.reshape(T, K).split(rows), dy.reshape(T, N).split(rows))):
            for role, t in (("input", xe), ("weight", ws[e]), ("grad_output", dye)):
                side, col = fp8.slot(role, e, experts)
                got = float(getattr(state, f"amax_history_{side}")[0, col])
                assert got == float(fp8.amax_of(t)), (step, role, e)
        assert not state.amax_history_fwd[0, 2::3].any() and not state.amax_history_bwd[0, 1::2].any()
        fp8.update_state_(state, recipe)
    assert float(state.scale_fwd[0]) != 1.0 and float(state.scale_bwd[0]) != 1.0


@pytest.mark.parametrize("layer,path", LAYERS, ids=LAYER_IDS)
@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("device", DEVICES)
def test_distributed_weight_hooks_fire_as_without_fp8(device, name, layer, path):
    recipe = RECIPES[name]
    x, _, _, dy = _to(device, *_inputs(layer))
    g = torch.Generator().manual_seed(5)
    fulls = [(torch.randn(N, K, generator=g) * 0.1).to(device, BF16) for _ in range(1 if layer == "linear" else E)]
    group = FakeDW.group_of(fulls)
    xr = x.clone().requires_grad_()
    with HOOKS["megatron_offload"]() as rec:
        y = _call(layer, path, xr, group, None, recipe, _state(recipe, layer, device))
    y.backward(dy)
    assert group[0].calls == {"forward": 1, "backward": 1, "finalize": 1}
    assert all(m.calls == {"forward": 0, "backward": 0, "finalize": 0} for m in group[1:])
    assert not any(t.dtype == BF16 for t in rec.packed)
    assert all(m.grad is not None and m.grad.shape == (N // 2, K) and m.grad.isfinite().all() for m in group)


@pytest.mark.parametrize("layer", ["linear", "grouped"])
@pytest.mark.parametrize("device", DEVICES)
def test_sizes_and_dtypes_refused_before_any_kernel(device, layer):
    x, ws, _, _ = _to(device, *_inputs(layer, bias=False))
    r = RECIPES["current"]
    with pytest.raises(ValueError, match=r"in_features .* multiple of 16, got 40"):
        _call(layer, None, x[..., :40], [w[:, :40] for w in ws], None, r, None)
    with pytest.raises(ValueError, match=r"out_features .* multiple of 16, got 40"):
        _call(layer, None, x, [w[:40] for w in ws], None, r, None)
    with pytest.raises(TypeError, match="x is torch.float64"):
        _call(layer, None, x.double(), [w.double() for w in ws], None, r, None)
    if layer == "grouped":
        with pytest.raises(ValueError, match=r"splits\[2\] is 40"):
            _call(layer, None, x[:72], ws, None, r, None, splits=[32, 0, 40])


# NOTE: [FP8 on the GPU vs the emulation] On the CPU the layers compute the emulation itself
# (bitwise). On CUDA the operands are quantized by the backend (TE's kernels follow the same
# formulas, so the FP8 operands should be the same bits) and multiplied by FP8 tensor-core GEMMs,
# which accumulate with limited precision where split accumulation is off (fprop, by default: about
# 14 significant bits). Bound used, elementwise: 2^-7 |ref| + n 2^-13 (|A||B|)_ij, where ref is
# the emulation, n the inner dimension and |A||B| the product of the dequantized operands'
# magnitudes: two bf16 roundings' worth relative, and a 13-bit accumulator's worth per term.
@pytest.mark.parametrize("layer,path", LAYERS, ids=LAYER_IDS)
@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("device", DEVICES)
def test_close_to_the_emulation(device, name, layer, path):
    recipe = RECIPES[name]
    x, ws, bs, dy = _inputs(layer)
    state = _state(recipe, layer, device)
    scales = [tuple(None if s is None else s.cpu() for s in _scales(state, e)) for e in range(len(ws))]
    y, dx, dws, _ = _run(layer, path, recipe, state, *_to(device, x, ws, bs, dy))
    want_y, want_dx, want_dws = direct(layer, recipe, scales, x, ws, bs, dy)
    if device == "cpu":
        assert_same([y, dx, *dws], [want_y, want_dx, *want_dws])
        return
    rows = [T] if layer == "linear" else SPLITS
    mags = []  # magnitudes of the unquantized products bound those of the quantized ones within 2^-4
    for e, (xe, dye) in enumerate(zip(x.reshape(T, K).split(rows), dy.reshape(T, N).split(rows))):
        w = ws[e].double().abs()
        mags.append((xe.double().abs() @ w.t(), dye.double().abs() @ w, dye.double().abs().t() @ xe.double().abs()))
    mag_y, mag_dx = torch.cat([m[0] for m in mags]), torch.cat([m[1] for m in mags])
    for what, got, want, mag, n in (("y", y, want_y, mag_y, K), ("dx", dx, want_dx, mag_dx, N)):
        got, want = got.cpu().double().reshape(mag.shape), want.double().reshape(mag.shape)
        bound = 2.0**-7 * want.abs() + n * 2.0**-13 * 1.2 * mag
        assert ((got - want).abs() <= bound).all(), f"{what}: worst excess {((got - want).abs() - bound).max():.3g}"
    for e, (got, want) in enumerate(zip(dws, want_dws)):
        n = rows[e]
        bound = 2.0**-7 * want.double().abs() + n * 2.0**-13 * 1.2 * mags[e][2]
        assert ((got.cpu().double() - want.double()).abs() <= bound).all(), f"dW[{e}]"
