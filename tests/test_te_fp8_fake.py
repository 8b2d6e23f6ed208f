"""te_fp8's plumbing on the CPU, over a fake TE (tests/support/fake_te: TE's names and signatures, fp8's
emulation for quantization, GEMMs that read only the copy TE's TN-only GEMM reads): every recipe,
Linear and both grouped paths, usages, pytree round trips, dbias at quantization or recomputed,
amaxes recorded into the state. In a subprocess, so the fake never meets a real TE or the rest
of the suite. TE's numerics are tests/test_te_fp8_gpu.py's business.

Below it, single checks over the same fake, each in a subprocess of its own: quantize_each and
grouped_quantize with per-expert scales and amaxes, the quantizers handed out, and TE's fused
delayed-scaling update on a state that is not contiguous."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

HERE = Path(__file__).parent
SCRIPT = HERE / "support" / "fake_te" / "run_te_fp8.py"


def test_te_fp8_plumbing_on_a_fake_te():
    run = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout[-3000:] + run.stderr[-3000:]


# --- single checks over the fake TE, each in a subprocess --------------------------------------

PRELUDE = f"""
import sys
sys.path[:0] = [{str(HERE / "support" / "fake_te")!r}, {str(HERE.parent)!r}]
import torch
from functional_dw import fp8
from functional_dw.kernels import Splits
from functional_dw.kernels import te as te_mod
from functional_dw.kernels import te_fp8, te_fp8_gemm
TE = te_fp8_gemm.TE_FP8
te_mod.prepare = te_fp8_gemm.prepare = lambda *a, **k: None
te_fp8._env = lambda t: ((9, 0), 131000, (12, 9))
te_mod.te_env = te_fp8_gemm.te_env = lambda i: ((9, 0), 131000)
torch.manual_seed(0)
"""


def _run(body: str) -> None:
    code = PRELUDE + textwrap.dedent(body) + "\nprint('ok')\n"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout[-3000:] + run.stderr[-3000:]


def test_quantize_each_refuses_scales_of_another_count():
    # zip() silently dropped the tensors past the last scale: 4 weights in, 3 FP8 weights out
    _run("""
    R = fp8.DelayedScaling()
    sw = fp8.tensor_spec(R, "weight")
    st = fp8.init_state(R, 4)
    ws = [torch.randn(32, 32, dtype=torch.bfloat16) for _ in range(4)]
    scales, amaxes = fp8.group_scales(st, "weight"), st.amax_history_fwd[0, 1::3]
    for kw in (dict(scales=scales[:3]), dict(scales=scales, amaxes=amaxes[:3])):
        try:
            out = TE.quantize_each(ws, sw, **kw)
        except ValueError as e:
            assert "4 entries" in str(e), e
        else:
            raise AssertionError(f"{len(out)} FP8 tensors for 4 weights")
    assert len(TE.quantize_each(ws, sw, scales=scales, amaxes=amaxes)) == 4
    one = TE.quantize_each(ws[:1], sw, scales=fp8.scale_for(st, "weight"))  # E=1: a 0-d scale
    assert len(one) == 1
    """)


def test_grouped_quantize_and_quantize_each_take_per_expert_lists_of_views():
    # the protocol's scales/amaxes are "indexable per expert"; check_quantize counts lists, the
    # torch backend takes them, and TE took them before (scales[e]): `.unbind(0)` broke that
    _run("""
    R = fp8.DelayedScaling()
    sx, sw = fp8.tensor_spec(R, "input"), fp8.tensor_spec(R, "weight")
    E, x = 2, torch.randn(32, 32, dtype=torch.bfloat16)
    sp = Splits(host=(16, 16), tensor=None, device=x.device, num_tokens=32, num_experts=E)
    st = fp8.init_state(R, E)
    scales = [fp8.scale_for(st, "input", e) for e in range(E)]
    amaxes = [st.amax_history_fwd[0, 3 * e] for e in range(E)]
    TE.grouped_quantize(x, sp, sx, scales=scales, amaxes=amaxes)
    want = torch.stack([p.float().abs().max() for p in x.split(16)])
    assert torch.equal(st.amax_history_fwd[0, 0::3], want), st.amax_history_fwd[0]
    ws = list(torch.randn(E, 32, 32, dtype=torch.bfloat16))
    TE.quantize_each(ws, sw, scales=[fp8.scale_for(st, "weight", e) for e in range(E)],
                     amaxes=[st.amax_history_fwd[0, 3 * e + 1] for e in range(E)])
    assert torch.equal(st.amax_history_fwd[0, 1::3], torch.stack([w.float().abs().max() for w in ws]))
    """)


@pytest.mark.parametrize("recipe", ["current", "block"])
def test_a_quantizer_handed_out_is_not_the_cached_one(recipe):
    # te_fp8.quantizer() is public; it returned the cached quantizer every quantize() reuses, so a
    # caller configuring "their" quantizer changed every later quantization of that spec
    _run(f"""
    R = fp8.Float8CurrentScaling() if {recipe!r} == "current" else fp8.Float8BlockScaling()
    sx = fp8.tensor_spec(R, "input")
    x = torch.randn(32, 128, dtype=torch.bfloat16) * 3
    before = TE.quantize(x, sx).storage
    q = te_fp8.quantizer(sx, x.device)
    q.set_usage(rowwise=True, columnwise=True)
    q.amax_epsilon = 1e3  # a caller's own settings
    after = TE.quantize(x, sx).storage
    for name in ("_data", "_rowwise_data"):
        if hasattr(before, name):
            assert torch.equal(getattr(before, name), getattr(after, name)), "the numbers changed"
    for name in ("_transpose", "_columnwise_data"):
        if hasattr(after, name):
            assert getattr(after, name) is None, "a copy nobody asked for"
    """)


def test_te_update_leaves_a_non_contiguous_state_to_the_torch_path():
    # TE's kernel_bulk reads a history by its data pointer with stride shape[1] (and a scale
    # densely); a state over column slices of one buffer (several layers' histories in one
    # [H, L*3E] tensor, reduced with one all-reduce) was updated in the wrong places. The
    # CUDA-looking tensors stand in for a CUDA state; the fake kernel reads memory as TE's does.
    _run("""
    import transformer_engine_torch as tex
    from functional_dw.fp8 import state as S

    class Cuda(torch.Tensor):
        @property
        def device(self):
            return torch.device("cuda", 0)

    def kernel_bulk(buf, hists, scales, algo, dtype, margin):  # TE's memory access, fd's rule
        for h, s in zip(hists, scales):
            H, C = h.shape
            raw_h = h.as_subclass(torch.Tensor).as_strided((H, C), (C, 1))
            raw_s = s.as_subclass(torch.Tensor).as_strided((C,), (1,))
            last = torch.where(buf.as_subclass(torch.Tensor) != 0, buf.as_subclass(torch.Tensor), raw_h[0])
            nh, ns = S._fused_update(torch.cat([last[None], raw_h[1:]]), raw_s.clone(), algo,
                                     448.0 if dtype == tex.DType.kFloat8E4M3 else 57344.0, margin)
            raw_h.copy_(nh)
            raw_s.copy_(ns)

    tex.fused_amax_and_scale_update_after_reduction = kernel_bulk
    R = fp8.DelayedScaling(amax_history_len=3)
    E, L = 2, 2

    def states():
        g = torch.Generator().manual_seed(5)
        big_f, big_b = torch.rand(3, L * 3 * E, generator=g), torch.rand(3, L * 2 * E, generator=g)
        sf, sb = torch.rand(L * 3 * E, generator=g) + 1, torch.rand(L * 2 * E, generator=g) + 1
        return big_f, big_b, sf, sb

    plain = [S.DelayedScalingState(f[:, :3 * E], s[:3 * E], b[:, :2 * E], t[:2 * E], E)
             for f, b, s, t in [states()]][0]
    want = S.update_state(plain, R, fused=True)
    big_f, big_b, sf, sb = (t.as_subclass(Cuda) for t in states())
    st = S.DelayedScalingState(big_f[:, :3 * E], sf[:3 * E], big_b[:, :2 * E], sb[:2 * E], E)
    assert not st.amax_history_fwd.is_contiguous()
    untouched = [t.as_subclass(torch.Tensor).clone() for t in (big_f, big_b, sf, sb)]
    done = S._te_update_(st, R)
    if done:  # TE's kernel ran: it must have done what the torch path does, and nothing else
        for n in S._TENSORS:
            assert torch.equal(getattr(st, n).as_subclass(torch.Tensor), getattr(want, n)), n
    else:  # left to the torch path: nothing written
        for t, u in zip((big_f, big_b, sf, sb), untouched):
            assert torch.equal(t.as_subclass(torch.Tensor), u)
    # a contiguous CUDA state still takes TE's kernel, with the torch path's result
    c = S.DelayedScalingState(*(t.clone().as_subclass(Cuda) for t in
                                (plain.amax_history_fwd, plain.scale_fwd, plain.amax_history_bwd, plain.scale_bwd)), E)
    assert S._te_update_(c, R)
    for n in S._TENSORS:
        assert torch.equal(getattr(c, n).as_subclass(torch.Tensor), getattr(want, n)), n
    """)
