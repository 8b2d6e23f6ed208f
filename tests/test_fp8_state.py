"""Delayed scaling state: TE's layout, amax recording, and the update rule over several steps,
checked against a per-slot, per-step loop that follows TE's kernel line by line."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.utils._pytree as pytree

from functional_dw.fp8 import FLT_MAX, DelayedScaling, Float8CurrentScaling, Format, quantize, tensor_spec
from helpers import HANG_S

from functional_dw.fp8.state import (
    DelayedScalingState,
    adjust_history_len,
    group_scales,
    init_state,
    record_amax,
    record_amax_,
    scale_for,
    slot,
    update_state,
    update_state_,
)

F32 = np.float32


def fmaxf(a: float, b: float) -> float:
    if math.isnan(b):
        return a
    if math.isnan(a):
        return b
    return max(a, b)


def ref_fused(col: list[float], scale: float, algo: str, fp8_max: float, margin: int) -> tuple[list[float], float]:
    """delayed_scaling.cu: kernel_bulk for one slot, written as a loop."""
    H, last = len(col), col[0]
    amax = 0.0
    if last != 0.0:
        new = [0.0] * H
        for i in range(H):
            a = col[i + 1] if i < H - 1 else last
            amax = fmaxf(amax, a)
            new[i] = a if i > 0 else 0.0
        col = new
    if algo == "most_recent":
        amax = last
    scaled_max = F32(fp8_max) * F32(2.0) ** F32(-margin)
    s = float(F32(scaled_max) / F32(amax)) if (math.isfinite(amax) and amax > 0) else scale
    return col, (FLT_MAX if math.isinf(s) else s)


def ref_unfused(col: list[float], scale: float, algo: str, fp8_max: float, margin: int) -> tuple[list[float], float]:
    """quantization.py: _default_get_amax_and_update_history + _default_sf_compute, for one slot."""
    amax = (float("nan") if any(math.isnan(v) for v in col) else max(col)) if algo == "max" else col[0]
    new = col[1:] + col[:1] if len(col) > 1 else list(col)
    new[0] = 0.0
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        sf = float(F32(F32(fp8_max) / F32(amax)) / F32(2.0**margin))
    if not amax > 0 or not math.isfinite(amax):
        sf = scale
    return new, (FLT_MAX if math.isinf(sf) else sf)


def columns(h: torch.Tensor) -> list[list[float]]:
    return h.t().tolist()


# ---- layout ---------------------------------------------------------------------------------


@pytest.mark.parametrize("E", [1, 3])
def test_init_state_layout(E):
    s = init_state(DelayedScaling(amax_history_len=7), num_gemms=E)
    assert s.amax_history_fwd.shape == (7, 3 * E) and s.scale_fwd.shape == (3 * E,)
    assert s.amax_history_bwd.shape == (7, 2 * E) and s.scale_bwd.shape == (2 * E,)
    assert not s.amax_history_fwd.any() and (s.scale_fwd == 1).all() and (s.scale_bwd == 1).all()
    assert all(t.dtype == torch.float32 for t in pytree.tree_leaves(s)) and s.history_len == 7
    assert "num_gemms=" + str(E) in repr(s)


def test_slots_are_tes_indices():
    # GroupedLinear: _offsets input 0, weight 1, output 2, grad_output 0, grad_input 1; 3 fwd / 2 bwd per GEMM
    assert [slot(r, 2) for r in ("input", "weight", "output")] == [("fwd", 6), ("fwd", 7), ("fwd", 8)]
    assert [slot(r, 2) for r in ("grad_output", "grad_input")] == [("bwd", 4), ("bwd", 5)]
    s = init_state(DelayedScaling(amax_history_len=2), 4)
    s.scale_fwd.copy_(torch.arange(12.0))
    s.scale_bwd.copy_(torch.arange(8.0))
    assert group_scales(s, "input").tolist() == [0, 3, 6, 9] and group_scales(s, "weight").tolist() == [1, 4, 7, 10]
    assert group_scales(s, "grad_output").tolist() == [0, 2, 4, 6]
    assert scale_for(s, "weight", 2).item() == 7 and scale_for(s, "grad_output", 3).item() == 6
    assert scale_for(s, "input", 1).data_ptr() == s.scale_fwd[3].data_ptr()  # a view: sees updates in place
    with pytest.raises(ValueError, match=r"gemm must be an int in \[0, 4\)"):
        scale_for(s, "input", 4)
    with pytest.raises(ValueError, match="role must be one of"):
        slot("bias")


def test_state_checks_shapes():
    with pytest.raises(ValueError, match="scale_fwd must be float32 of shape"):
        DelayedScalingState(torch.zeros(4, 3), torch.ones(4), torch.zeros(4, 2), torch.ones(2), num_gemms=1)
    with pytest.raises(ValueError, match="num_gemms must be an int >= 1"):
        init_state(DelayedScaling(), 0)
    with pytest.raises(ValueError, match="needs a DelayedScaling recipe"):
        init_state(Float8CurrentScaling())


def test_pytree():
    s = init_state(DelayedScaling(amax_history_len=3), 2)
    leaves, spec = pytree.tree_flatten(s)
    assert len(leaves) == 4
    back = pytree.tree_unflatten([t + 1 for t in leaves], spec)
    assert isinstance(back, DelayedScalingState) and back.num_gemms == 2 and (back.scale_bwd == 2).all()


# ---- recording ------------------------------------------------------------------------------


def test_record_amax_maxes_into_row_0():
    s0 = init_state(DelayedScaling(amax_history_len=3), 2)
    s1 = record_amax(s0, "weight", torch.tensor([2.0]), gemm=1)
    s2 = record_amax(s1, "weight", 1.0, gemm=1)  # a smaller amax later in the step does not lower it
    s3 = record_amax(s2, "grad_output", torch.tensor([5.0, 7.0]))  # one per GEMM
    assert not s0.amax_history_fwd.any()  # pure
    assert s3.amax_history_fwd[0].tolist() == [0, 0, 0, 0, 2, 0] and s3.amax_history_bwd[0].tolist() == [5, 0, 7, 0]
    assert not s3.amax_history_fwd[1:].any()
    same = record_amax_(s0, "input", torch.tensor([3.0, 4.0]))
    assert same is s0 and s0.amax_history_fwd[0].tolist() == [3, 0, 0, 4, 0, 0]
    with pytest.raises(ValueError, match="amax must have 2 value"):
        record_amax(s0, "input", torch.tensor([1.0]))


def test_quantize_then_record():
    r = DelayedScaling(amax_history_len=4)
    s = init_state(r, 1)
    x = torch.tensor([[1.0, -6.0], [2.0, 0.5]])
    q = quantize(x, tensor_spec(r, "input"), scale=scale_for(s, "input"))
    s = record_amax(s, "input", q.amax)
    assert s.amax_history_fwd[0, 0].item() == 6.0


# ---- the update rule, step by step ----------------------------------------------------------


def run_steps(recipe: DelayedScaling, steps: list[tuple[list[float], list[float]]], E: int, fused):
    """Record each step's amaxes (fwd slots, bwd slots), update; compare with the loop reference."""
    state = init_state(recipe, E)
    ref = {
        side: (
            [list(c) for c in columns(getattr(state, f"amax_history_{side}"))],
            getattr(state, f"scale_{side}").tolist(),
        )
        for side in ("fwd", "bwd")
    }
    rule = ref_fused if fused in (None, True) else ref_unfused
    for fwd_amax, bwd_amax in steps:
        for side, amaxes in (("fwd", fwd_amax), ("bwd", bwd_amax)):
            for j, a in enumerate(amaxes):
                cols = ref[side][0]
                cols[j][0] = fmaxf(cols[j][0], float(F32(a)))  # atomicMaxFloat into row 0
        state = record_amax(state, "input", torch.tensor(fwd_amax[0::3]))
        state = record_amax(state, "weight", torch.tensor(fwd_amax[1::3]))
        state = record_amax(state, "grad_output", torch.tensor(bwd_amax[0::2]))
        state = update_state(state, recipe, fused=fused)
        for side in ("fwd", "bwd"):
            fp8_max = recipe.fp8_format.value.max_fwd if side == "fwd" else recipe.fp8_format.value.max_bwd
            cols, scales = ref[side]
            for j in range(len(cols)):
                cols[j], scales[j] = rule(cols[j], scales[j], recipe.amax_compute_algo, fp8_max, recipe.margin)
            got_h = columns(getattr(state, f"amax_history_{side}"))
            got_s = getattr(state, f"scale_{side}").tolist()
            assert all(_same(g, w) for g, w in zip(got_h, cols)), side
            assert _same(got_s, [float(F32(v)) for v in scales]), side
    return state


def _same(a, b):
    return all((math.isnan(p) and math.isnan(q)) or p == q for p, q in zip(a, b)) and len(a) == len(b)


def random_steps(E: int, n: int, seed: int, zero_p: float = 0.3):
    g = np.random.default_rng(seed)
    steps = []
    for _ in range(n):
        fwd = [0.0 if (j % 3 == 2 or g.random() < zero_p) else float(g.lognormal(0, 4)) for j in range(3 * E)]
        bwd = [0.0 if (j % 2 == 1 or g.random() < zero_p) else float(g.lognormal(-5, 4)) for j in range(2 * E)]
        steps.append((fwd, bwd))
    return steps


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0, 1, 3, -2])
@pytest.mark.parametrize("H", [1, 4])
@pytest.mark.parametrize("fmt", [Format.HYBRID, Format.E4M3])
def test_update_matches_te_kernel_loop(algo, margin, H, fmt):
    recipe = DelayedScaling(margin=margin, amax_history_len=H, amax_compute_algo=algo, fp8_format=fmt)
    run_steps(recipe, random_steps(E=2, n=9, seed=H * 10 + margin), E=2, fused=None)


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0, 2])
def test_unfused_update_matches_python_loop(algo, margin):
    recipe = DelayedScaling(margin=margin, amax_history_len=3, amax_compute_algo=algo)
    run_steps(recipe, random_steps(E=1, n=7, seed=margin), E=1, fused=False)


def test_zero_amax_does_not_roll_in_the_kernel_but_does_in_python():
    r = DelayedScaling(amax_history_len=3)
    s = record_amax(init_state(r, 1), "input", 8.0, gemm=0)
    s = update_state(s, r)  # rolls: 8 goes to the last row
    assert s.amax_history_fwd[:, 0].tolist() == [0, 0, 8] and s.scale_fwd[0].item() == 448 / 8
    kernel = update_state(s, r)  # a step that recorded nothing: no roll, scale kept
    assert kernel.amax_history_fwd[:, 0].tolist() == [0, 0, 8] and kernel.scale_fwd[0].item() == 56.0
    python = update_state(s, r, fused=False)  # TE's unfused path rolls anyway
    assert python.amax_history_fwd[:, 0].tolist() == [0, 8, 0] and python.scale_fwd[0].item() == 56.0


def test_special_amaxes():
    r = DelayedScaling(amax_history_len=2, amax_compute_algo="most_recent")
    s = init_state(r, 1)
    s.scale_fwd.fill_(3.0)
    s = record_amax(s, "input", float("inf"), gemm=0)
    s = record_amax(s, "weight", 1e-39, gemm=0)  # 448 / 1e-39 overflows
    s = update_state(s, r, which="fwd")
    assert s.scale_fwd.tolist() == [3.0, FLT_MAX, 3.0]  # inf amax keeps the scale; output slot untouched
    assert (s.scale_bwd == 1).all() and not s.amax_history_bwd.any()  # which="fwd"
    nan = record_amax(init_state(DelayedScaling(amax_history_len=2), 1), "input", float("nan"), gemm=0)
    with torch.no_grad():  # a NaN recorded by hand: the kernel skips it in "max"
        nan.amax_history_fwd[1, 0] = 5.0
    out = update_state(nan, DelayedScaling(amax_history_len=2), which="fwd")
    assert out.scale_fwd[0].item() == float(F32(448) / F32(5)) and math.isnan(out.amax_history_fwd[1, 0].item())


def test_update_in_place_equals_pure():
    r = DelayedScaling(amax_history_len=5, margin=1)
    s = record_amax(init_state(r, 3), "input", torch.tensor([1.0, 2.0, 3.0]))
    s = record_amax(s, "grad_output", torch.tensor([4.0, 0.0, 6.0]))
    pure = update_state(s, r)
    ptrs = [t.data_ptr() for t in pytree.tree_leaves(s)]
    assert update_state_(s, r) is s and [t.data_ptr() for t in pytree.tree_leaves(s)] == ptrs
    assert all(torch.equal(a, b) for a, b in zip(pytree.tree_leaves(s), pytree.tree_leaves(pure)))


def test_callable_algorithms_use_the_python_path():
    seen = {}

    def amax_algo(h):
        seen["h"] = h.clone()
        return h.sum(0)

    def sf_algo(amax, scale, fp8_max, recipe):
        seen["args"] = (fp8_max, recipe.margin)
        return scale * 0 + fp8_max / (amax + 1)

    r = DelayedScaling(amax_history_len=2, margin=2, amax_compute_algo=amax_algo, scaling_factor_compute_algo=sf_algo)
    s = record_amax(init_state(r, 1), "grad_output", 3.0, gemm=0)
    out = update_state(s, r, which="bwd")
    assert seen["args"] == (57344, 2) and seen["h"][0, 0].item() == 3.0
    assert out.scale_bwd[0].item() == 57344 / 4 and out.amax_history_bwd[:, 0].tolist() == [0, 3]
    with pytest.raises(ValueError, match="fused=True runs TE's kernel"):
        update_state(s, r, fused=True)


def test_env_selects_the_python_path(monkeypatch):
    r = DelayedScaling(amax_history_len=3)
    s = update_state(record_amax(init_state(r, 1), "input", 8.0, gemm=0), r)
    monkeypatch.setenv("NVTE_UNFUSED_FP8_UPDATE", "1")
    assert update_state(s, r).amax_history_fwd[:, 0].tolist() == [0, 8, 0]  # rolled though nothing was recorded


def test_history_length_mismatch_and_adjust():
    r = DelayedScaling(amax_history_len=4)
    s = record_amax(init_state(DelayedScaling(amax_history_len=2), 1), "input", 2.0, gemm=0)
    with pytest.raises(ValueError, match="amax_history_len is 4.*adjust_history_len"):
        update_state(s, r)
    longer = adjust_history_len(s, 4)
    assert longer.amax_history_fwd[:, 0].tolist() == [2, 0, 0, 0] and longer.history_len == 4
    assert adjust_history_len(longer, 1).amax_history_fwd[:, 0].tolist() == [2]
    update_state(longer, r)
    with pytest.raises(ValueError, match="which must be"):
        update_state(longer, r, which="forward")


def test_group_without_distributed_is_local():
    r = DelayedScaling(amax_history_len=2)
    s = record_amax(init_state(r, 1), "input", 4.0, gemm=0)
    assert torch.equal(update_state(s, r, group="unused").scale_fwd, update_state(s, r).scale_fwd)


def _reduce_job() -> list:
    import torch.distributed as dist

    r = DelayedScaling(amax_history_len=2)
    rank = dist.get_rank()
    s = record_amax(init_state(r, 2), "input", torch.tensor([1.0 + rank, 10.0 - rank]))
    reduced = update_state(s, r, group=dist.group.WORLD, which="fwd")
    local = update_state(s, DelayedScaling(amax_history_len=2, reduce_amax=False), group=dist.group.WORLD, which="fwd")
    return [reduced.amax_history_fwd.tolist(), reduced.scale_fwd.tolist(), local.scale_fwd.tolist()]


def test_group_reduces_the_step_amax_across_ranks():
    from functional_dw import distributed as fdd

    out = fdd.launch(_reduce_job, 2, backend="gloo", timeout=HANG_S, deadline=HANG_S)
    for rank, (hist, scale, local) in enumerate(out):
        assert [row[0] for row in hist] == [0.0, 2.0] and [row[3] for row in hist] == [0.0, 10.0]  # max over ranks
        assert scale[0] == float(F32(448) / F32(2)) and scale[3] == float(F32(448) / F32(10))
        assert local[0] == float(F32(448) / F32(1 + rank))  # reduce_amax=False: each rank its own


@pytest.mark.parametrize("E", [1, 3])
def test_a_layer_step_as_the_package_docstring_sketches(E):
    """Quantize x, W, dy per GEMM with the state's scales, record, update: the next step's
    scales are the fp8 max over the amaxes seen (margin 0, 'max', one step of history)."""
    from functional_dw import fp8

    r = DelayedScaling(amax_history_len=2)
    state = init_state(r, E)
    sx, sw, sdy = (fp8.tensor_spec(r, role) for role in fp8.ROLES)
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(16, 32, generator=g) * (e + 1) for e in range(E)]
    ws = [torch.randn(8, 32, generator=g) / (e + 1) for e in range(E)]
    qxs = fp8.quantize_groups(torch.cat(xs), [16] * E, sx, scales=fp8.group_scales(state, "input"), columnwise=True)
    fp8.record_amax_(state, "input", torch.cat([q.amax for q in qxs]))
    for e, w in enumerate(ws):
        qw = fp8.quantize(w, sw, scale=fp8.scale_for(state, "weight", e), rowwise=True, columnwise=True)
        fp8.record_amax_(state, "weight", qw.amax, gemm=e)
        y = qxs[e].dequantize() @ qw.dequantize().t()  # fprop on the rowwise copies
        assert torch.allclose(y, xs[e] @ w.t(), rtol=0.2, atol=0.5 * (e + 1))
        dy = torch.ones_like(y) * (e + 2)
        qdy = fp8.quantize(dy, sdy, scale=fp8.scale_for(state, "grad_output", e), columnwise=True)
        fp8.record_amax_(state, "grad_output", qdy.amax, gemm=e)
        assert torch.equal(qdy.dequantize(columnwise=True), dy)  # wgrad's copy
    fp8.update_state_(state, r, which="fwd")
    fp8.update_state_(state, r, which="bwd")
    want_x = [float(F32(448) / F32(x.abs().max().item())) for x in xs]
    want_w = [float(F32(448) / F32(w.abs().max().item())) for w in ws]
    assert fp8.group_scales(state, "input").tolist() == want_x and fp8.group_scales(state, "weight").tolist() == want_w
    assert fp8.group_scales(state, "grad_output").tolist() == [float(F32(57344) / F32(e + 2)) for e in range(E)]
