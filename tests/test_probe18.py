"""Probe 18: a hostile user's findings on fp8.RowwiseScaling (the recipe, its CPU reference, the
Triton kernels under TRITON_INTERPRET=1, and the weight cache of NOTE: [FP8 weights per
version]). Each test asserts the right behaviour."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import functional_dw as fd
from functional_dw import fp8
from functional_dw.fp8 import rowwise as rw

R = fp8.RowwiseScaling()
E, K, N = 4, 64, 32
SIZES = [5, 0, 40, 19]  # expert 1 has no tokens: a stale weight must sit on a used expert (2)
T = sum(SIZES)


def _fresh(x, ws, sizes=SIZES):
    """The output with the weights quantized now (no cached copy)."""
    rw.clear_weight_cache()
    return fd.grouped_linear(x, ws, sizes, recipe=R)


@pytest.fixture(autouse=True)
def _empty_cache():
    rw.clear_weight_cache()
    yield
    rw.clear_weight_cache()


# --- the weight cache -----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["fused", "foreach", "for-loop"])
def test_every_torch_optimizer_step_refreshes_the_cached_fp8_weights(kind):
    # torch's fused optimizers (Adam/AdamW/SGD/Adagrad(fused=True), the recommended ones on
    # CUDA) update the parameters without bumping their version counters, so the cache keyed
    # on versions and addresses kept serving the FP8 copy of the step-0 weights: every later
    # forward (and dgrad) silently ran the first weights, i.e. the model never trained.
    torch.manual_seed(0)
    m = fd.nn.GroupedLinear(E, K, N, recipe=R)
    x = torch.randn(T, K)
    opt = torch.optim.Adam(m.parameters(), lr=0.1, **{"fused": {"fused": True}, "foreach": {"foreach": True},
                                                     "for-loop": {"foreach": False}}[kind])
    for _ in range(2):
        m(x, SIZES).square().sum().backward()
        opt.step()
        opt.zero_grad()
        cached = m(x, SIZES)
        rw.clear_weight_cache()
        assert torch.equal(cached, m(x, SIZES)), "a stale FP8 weight was used after an optimizer step"


def test_a_new_tensor_that_reuses_a_dead_weights_id_and_address_is_not_served_its_fp8_copy():
    # The entry was held weakly by the first weight only; a later weight that died and was
    # replaced by a new tensor with the same id(), address and version (0) hit the entry and
    # got the dead weight's FP8 copy (e.g. re-initializing one expert from a numpy buffer).
    import numpy as np

    torch.manual_seed(0)
    x = torch.randn(T, K)
    w0, w1, w3 = (torch.randn(N, K) / 8 for _ in range(3))
    arr = (np.random.default_rng(0).standard_normal((N, K)) / 8).astype(np.float32)
    for _ in range(200):
        rw.clear_weight_cache()
        w2 = torch.from_numpy(arr)
        fd.grouped_linear(x, [w0, w1, w2, w3], SIZES, recipe=R)
        old_id, old_ptr = id(w2), w2.data_ptr()
        del w2
        arr *= -3.0  # the expert re-initialized in its buffer, no tensor alive to see it
        new = torch.from_numpy(arr)
        if id(new) == old_id and new.data_ptr() == old_ptr:
            break
    else:
        pytest.skip("CPython did not reuse the id in 200 tries")
    ws = [w0, w1, new, w3]
    got = fd.grouped_linear(x, ws, SIZES, recipe=R)
    assert torch.equal(got, _fresh(x, ws)), "the dead weight's cached FP8 copy was used"


def test_inference_tensors_as_weights_run():
    # A model built or loaded under torch.inference_mode (serving) has inference tensors, which
    # have no version counter: the cache's key read p._version and every forward raised
    # "RuntimeError: Inference tensors do not track version counter".
    with torch.inference_mode():
        m = fd.nn.GroupedLinear(E, K, N, recipe=R)
        x = torch.randn(T, K)
        a = m(x, SIZES)
        for p in m.parameters():
            p.mul_(2)  # in place, not tracked: must not be served from a cache
        b = m(x, SIZES)
    assert a.shape == (T, N)
    with torch.inference_mode():
        rw.clear_weight_cache()
        assert torch.equal(b, m(x, SIZES))
    ws = [w.clone() for w in m.weights()]  # inference tensors outside inference_mode
    assert fd.grouped_linear(torch.randn(T, K), ws, SIZES, recipe=R).shape == (T, N)


@pytest.mark.xfail(strict=True, reason="writes that bump no version counter (param.data.mul_, numpy views, "
                   "custom kernels outside a torch optimizer's step) cannot be seen without reading the weight; "
                   "the NOTE asks for fp8 clear_weight_cache() after them. Fixing it needs an explicit cache "
                   "API (TE's is_first_microbatch) or no implicit cache")
@pytest.mark.parametrize("write", ["data", "numpy", "data-transpose"])
def test_writes_through_data_are_not_served_a_stale_fp8_weight(write):
    torch.manual_seed(0)
    Kw = K if write != "data-transpose" else N  # a square weight for the transpose
    x = torch.randn(T, Kw)
    ws = [torch.nn.Parameter(torch.randn(N, Kw) / 8) for _ in SIZES]
    fd.grouped_linear(x, ws, SIZES, recipe=R)
    if write == "data":
        ws[2].data.mul_(3)  # e.g. old-style SGD `p.data -= lr * p.grad`, EMA, Megatron's .data copies
    elif write == "numpy":
        ws[2].detach().numpy()[:] *= 3
    else:
        ws[2].data = ws[2].data.t()  # same address, same version, other values at each index
    got = fd.grouped_linear(x, ws, SIZES, recipe=R)
    assert torch.equal(got, _fresh(x, ws))


# --- torch.func / autograd transforms -------------------------------------------------------------


def test_vmap_of_grad_matches_a_loop():
    # Per-sample gradients: backward quantized a batched dy into an unbatched buffer in place
    # (col[:, column_T] = ...), and vmap raised "index_put_ ... is not possible because there
    # exists a Tensor `other` ... being vmapped over but `self` not". Other recipes ran.
    torch.manual_seed(0)
    ws = [torch.randn(N, K) / 8 for _ in SIZES]
    xb = torch.randn(3, T, K)

    def loss(v, w):
        return fd.grouped_linear(v, w, SIZES, recipe=R).square().sum()

    got = torch.func.vmap(torch.func.grad(loss, argnums=(0, 1)), in_dims=(0, None))(xb, ws)
    want = [torch.func.grad(loss, argnums=(0, 1))(v, ws) for v in xb]
    torch.testing.assert_close(got[0], torch.stack([w[0] for w in want]), rtol=1e-6, atol=1e-6)
    for e in range(E):
        torch.testing.assert_close(got[1][e], torch.stack([w[1][e] for w in want]), rtol=1e-6, atol=1e-6)
    _, vjp = torch.func.vjp(lambda v: fd.grouped_linear(v, ws, SIZES, recipe=R), xb[0])
    dys = torch.randn(3, T, N)
    torch.testing.assert_close(torch.func.vmap(vjp)(dys)[0], torch.stack([vjp(d)[0] for d in dys]))


@pytest.mark.parametrize("recipe", [R, fp8.Float8CurrentScaling()], ids=["rowwise", "current"])
def test_batched_cotangents_are_refused_with_the_way_out(recipe):
    # autograd.grad(..., is_grads_batched=True) and autograd.functional.jacobian(vectorize=True)
    # use autograd's legacy vmap; every FP8 recipe died inside the quantization with
    # "Batching rule not implemented for aten::detach; the fallback path doesn't work on out=
    # or view ops".
    sizes = [16, 0, 32, 16]
    x = torch.randn(sum(sizes), K, requires_grad=True)
    ws = [(torch.randn(N, K) / 8).requires_grad_() for _ in sizes]
    y = fd.grouped_linear(x, ws, sizes, recipe=recipe)
    with pytest.raises(NotImplementedError, match="is_grads_batched.*torch.func.vmap over torch.func.vjp"):
        torch.autograd.grad(y, [x, *ws], torch.randn(3, *y.shape), is_grads_batched=True)


# --- error messages --------------------------------------------------------------------------------


def test_a_recipe_class_instead_of_an_instance_says_to_call_it():
    # It said "expected an FP8 recipe (DelayedScaling, Float8CurrentScaling, Float8BlockScaling;
    # ...), got builtins.type: <class ...RowwiseScaling>": RowwiseScaling not even listed.
    x, ws = torch.randn(T, K), [torch.randn(N, K) for _ in SIZES]
    with pytest.raises(TypeError, match=r"got the class RowwiseScaling: pass RowwiseScaling\(\)"):
        fd.grouped_linear(x, ws, SIZES, recipe=fp8.RowwiseScaling)
    with pytest.raises(TypeError, match="RowwiseScaling"):
        fd.grouped_linear(x, ws, SIZES, recipe="rowwise")


@pytest.mark.parametrize("eps", [-1.0, float("nan"), float("inf")])
def test_a_bad_amax_epsilon_names_the_recipe(eps):
    # It named "QParams.amax_epsilon", a class the user never touched.
    with pytest.raises(ValueError, match="RowwiseScaling.amax_epsilon must be a finite float >= 0"):
        fp8.RowwiseScaling(amax_epsilon=eps)


def test_float64_activations_say_what_to_do():
    x, ws = torch.randn(T, K, dtype=torch.float64), [torch.randn(N, K, dtype=torch.float64) for _ in SIZES]
    with pytest.raises(TypeError, match=r"x is torch.float64: cast x and the weights .*recipe=None"):
        fd.grouped_linear(x, ws, SIZES, recipe=R)


# --- the Triton kernels on the CPU (TRITON_INTERPRET=1) ----------------------------------------------

_INTERPRET_PRELUDE = """
import contextlib, os
os.environ["TRITON_INTERPRET"] = "1"
import torch
torch.cuda.device = lambda d: contextlib.nullcontext()
from functional_dw.kernels import triton_rowwise as tr
from functional_dw.fp8 import rowwise as rw
from functional_dw import fp8
SPEC = fp8.tensor_spec(fp8.RowwiseScaling(), "input")
"""


def _interpret(body: str) -> str:
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                           os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", _INTERPRET_PRELUDE + textwrap.dedent(body)], env=env,
                         capture_output=True, text=True, timeout=600)
    if "only 0-dimensional arrays can be converted to Python scalars" in out.stderr:
        # (Triton 3.6's interpreter under numpy 2.4 turns a run-time loop bound into int() of a
        # one-element array; on a GPU test_fp8_rowwise's gpu tests compare the compiled kernels
        # with the reference bit for bit)
        import numpy
        import triton
        pytest.skip(f"Triton {triton.__version__}'s interpreter cannot run a loop with a run-time bound under "
                    f"numpy {numpy.__version__}")
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_triton_kernels_give_scale_one_for_rows_of_no_features():
    # K = 0 passes check_dims (0 is a multiple of 16); with rows but no columns the kernels'
    # wrapper launched nothing and returned the rowwise inverse scales as torch.empty: garbage
    # (NaN/inf here) that the scaled GEMM's epilogue multiplies into the output. The reference
    # gives 1.
    out = _interpret("""
        real_empty = torch.empty
        def poisoned(*a, **k):  # uninitialized memory, made visible
            t = real_empty(*a, **k)
            return t.fill_(float("nan")) if t.is_floating_point() else t
        tr.torch.empty = poisoned
        sizes = [5, 0, 11]
        x = torch.ones(16, 0, dtype=torch.bfloat16)
        ends = torch.tensor(sizes).cumsum(0).to(torch.int32)
        pends = rw.padded_ends(torch.tensor(sizes))
        got = tr.quantize_activation(x, ends, pends, SPEC, rowwise=True, columnwise=True)
        want = rw.quantize_activation(x, ends, pends, SPEC, rowwise=True, columnwise=True)
        print(torch.equal(got.rowwise_scale_inv, want.rowwise_scale_inv))
        w = torch.ones(3, 16, 0, dtype=torch.bfloat16)
        print(torch.equal(tr.quantize_weight(w, SPEC).rowwise_scale_inv, rw.quantize_weight(w, SPEC).rowwise_scale_inv))
    """)
    assert out.split() == ["True", "True"], out


def test_triton_kernels_match_the_reference_up_to_the_interpreters_fp8_cast():
    # Triton 3.9's interpreter casts fp32 -> float8e4nv wrongly (ties away from even, 124 -> 64,
    # no saturation), so the kernels' FP8 bytes are compared with the reference's saturated
    # fp32 values cast by the interpreter; the scales bit for bit. Boundaries inside a tile,
    # empty experts, NaN/inf, strided rows.
    out = _interpret("""
        import triton, triton.language as tl
        from functional_dw.fp8.quantize import amax_of
        @triton.jit
        def _k(x, y, n, BLOCK: tl.constexpr):
            i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            tl.store(y + i, tl.load(x + i, mask=i < n).to(tl.float8e4nv), mask=i < n)
        def icast(t):
            t = t.contiguous().float(); out = torch.empty(t.shape, dtype=torch.float8_e4m3fn)
            if t.numel(): _k[(triton.cdiv(t.numel(), 1024),)](t, out, t.numel(), BLOCK=1024)
            return out
        def same(a, b):
            a, b = a.float(), b.float()
            return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
        def sat(v):
            return v.clamp(-448, 448).where(~v.isnan(), v)
        g = torch.Generator().manual_seed(0)
        for sizes, D in (([5, 0, 40, 19], 48), ([1] * 17 + [90], 130), ([0, 0, 7], 32)):
            T, E = sum(sizes), len(sizes)
            x = (torch.randn(T, 2 * D, generator=g) * torch.logspace(-4, 4, 2 * D)).to(torch.bfloat16)[:, :D]
            x[3, 5], x[4, 6], x[1] = float("nan"), float("inf"), 0.0
            ends = torch.tensor(sizes).cumsum(0)
            pends = rw.padded_ends(torch.tensor(sizes))
            got = tr.quantize_activation(x, ends.to(torch.int32), pends, SPEC, rowwise=True, columnwise=True)
            want = rw.quantize_activation(x, ends, pends, SPEC, rowwise=True, columnwise=True)
            v = x.float()
            row = icast(sat(v * rw.scale_of(amax_of(v, dim=-1), SPEC)[:, None]))
            expert = torch.searchsorted(ends, torch.arange(T), right=True)
            col = icast(sat(v * torch.reciprocal(want.columnwise_scale_inv)[expert]))
            counts = torch.tensor(sizes)
            column = (pends.long() - (counts + 15) // 16 * 16)[expert] + torch.arange(T) - (ends - counts)[expert]
            print(torch.equal(got.rowwise_scale_inv, want.rowwise_scale_inv),
                  torch.equal(got.columnwise_scale_inv, want.columnwise_scale_inv),
                  same(got.rowwise_data, row), same(got.columnwise_data[:, column], col.t()),
                  not got.columnwise_data[:, :int(pends[-1])].float().nan_to_num().abs().sum(0)[
                      [c for c in range(int(pends[-1])) if c not in set(column.tolist())]].any())
    """)
    assert out.split() == ["True"] * 15, out
