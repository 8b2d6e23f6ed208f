"""Triton launches through the compiled kernel (``kernels/triton_launch.py``, NOTE: [Compiled
launches]): the cache key is at least as fine as Triton's specialization (CPU), and every
Triton kernel of ours gives the same bits launched either way (GPU)."""

from __future__ import annotations

import pytest
import torch

from functional_dw.kernels import triton_launch


def test_the_key_tells_apart_what_triton_specializes_on():
    spec = triton_launch._spec
    buf = torch.zeros(64, dtype=torch.float32)
    assert spec(buf) != spec(buf[1:])  # 16-byte alignment of a pointer
    assert spec(buf) != spec(buf.to(torch.bfloat16))  # dtype
    assert len({spec(1), spec(2), spec(16), spec(2**31), spec(2**63), spec(-(2**31) - 1)}) == 6  # ==1, %16, widths
    assert spec(True) != spec(1) and spec(1.0) != spec(1)
    assert spec(32) == spec(48) and spec(3) == spec(5)  # values Triton does not specialize on share a kernel


def test_only_an_empty_chain_of_tritons_own_is_no_hook():
    """Triton's launcher calls any launch hook that is not None, so only Triton's own empty
    ``HookChain`` (what Triton >= 3.6 always holds) lets the compiled path run; a user's object
    that happens to keep a ``calls`` list is a hook."""

    class Recorder:  # a plausible user hook: it logs into self.calls
        def __init__(self):
            self.calls = []

        def __call__(self, metadata):
            self.calls.append(metadata)

    active = triton_launch._active
    assert not active(None)
    assert active(print) and active(Recorder())


def test_tritons_hook_chain_counts_as_a_hook_once_it_holds_one():
    knobs = pytest.importorskip("triton.knobs")
    if not hasattr(knobs, "HookChain"):
        pytest.skip("a Triton before 3.6: no HookChain")

    class Loud(knobs.HookChain):  # a subclass may do work in __call__: a hook
        pass

    chain = knobs.HookChain()
    assert not triton_launch._active(chain)
    chain.add(print)
    assert triton_launch._active(chain) and triton_launch._active(Loud())


gpu = pytest.mark.gpu
needs_triton = pytest.mark.skipif(
    not torch.cuda.is_available() or triton_launch.triton is None, reason="needs CUDA and Triton"
)


@gpu
@needs_triton
def test_compiled_launches_give_tritons_bits(monkeypatch):
    from functional_dw.fp8 import rowwise as rw
    from functional_dw.fp8.spec import TensorSpec
    from functional_dw.kernels import triton_activation, triton_rowwise, triton_splits

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1000, 256, device="cuda", dtype=torch.bfloat16, generator=g)
    z = torch.randn(1000, 2 * 96, device="cuda", dtype=torch.bfloat16, generator=g)
    p = torch.rand(1000, device="cuda", dtype=torch.bfloat16, generator=g)
    dh = torch.randn(1000, 96, device="cuda", dtype=torch.bfloat16, generator=g)
    counts = torch.tensor([300, 0, 500, 200], device="cuda")
    sizes = torch.tensor([303, 0, 496, 200])  # x[1:]'s 999 rows
    ends = sizes.cumsum(0).to("cuda", torch.int32)
    pends = rw.padded_ends(sizes).to("cuda", torch.int32)
    spec = TensorSpec("x", "rowwise", torch.float8_e4m3fn)

    def run_all():
        q = triton_rowwise.quantize_activation(x[1:], ends, pends, spec, rowwise=True, columnwise=True)
        w = triton_rowwise.quantize_weight(x.view(4, 250, 256)[:, :240].contiguous(), spec)
        return [
            *(
                t.view(torch.uint8) if t.element_size() == 1 else t
                for t in (q.rowwise_data, q.rowwise_scale_inv, q.columnwise_data, q.columnwise_scale_inv)
            ),
            *(
                t.view(torch.uint8) if t.element_size() == 1 else t
                for t in (w.rowwise_data, w.rowwise_scale_inv, w.columnwise_data, w.columnwise_scale_inv)
            ),
            *triton_splits.clamp_splits(counts, 1000),
            triton_activation.act_fwd(z, p, "swiglu"),
            *triton_activation.act_bwd(z, p, dh, "swiglu"),
        ]

    monkeypatch.setattr(triton_launch, "_FAST", [False])
    want = run_all()
    monkeypatch.setattr(triton_launch, "_FAST", [True])
    monkeypatch.setattr(triton_launch, "_COMPILED", {})
    first, again = run_all(), run_all()  # the first call of each key compiles through Triton; then ours
    assert triton_launch._FAST[0], "the compiled kernels refused our launch: Triton's path ran"
    assert len(triton_launch._COMPILED) >= 6
    for a, b, c in zip(want, first, again):
        assert torch.equal(a, b) and torch.equal(a, c)
