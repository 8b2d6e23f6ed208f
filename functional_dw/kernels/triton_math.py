"""The expert MLP's activation math as Triton device functions, shared by the activation
kernels (``triton_activation.py``) and RowwiseScaling's quantization kernels, which run the
activation as their load (``triton_rowwise.py``: h's FP8 copies straight from fc1's output).

Each is the fp32 expression of ``activation.py``'s contract in the reference's order, with
libdevice's ``expf``/``erff`` (torch's CUDA ``exp``/``erf``) and IEEE division ``div_rn``; the
kernels launch with ``enable_fp_fusion=False`` (no contraction into FMAs), so on a GPU they
give the reference's bits. ``INTERP``: Triton's CPU interpreter (no libdevice: numpy's).
``ACT``: the activation's record's ``triton`` code (``functional_dw/activations.py``: 0 swiglu,
1 gelu, 2 silu; -1 none, in ``triton_rowwise.py``), which :func:`act` and :func:`act_grad`
switch on, the one place the kernels tell activations apart; ``GATED``: its record's ``gated``
(``h = act(gate) * up``, the up half ``F`` columns on). A new code's branch goes in those two.
"""

from __future__ import annotations

import os

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # CPU-only torch builds ship no Triton
    triton = None

# NOTE: [erf] GELU's erf is libdevice's ``erff``, which ``enable_fp_fusion=False`` compiles
# without contracting its own multiply-adds; torch's CUDA ``erf`` is the same routine compiled by
# nvcc with contraction. On the H200 the two differ by one fp32 ulp for some inputs, so GELU's
# h and dfc1_out are not the reference's bits: in GELU's tail, where ``1 + erf`` cancels, that
# ulp is a large relative difference of a small value (absolutely at most ``|z| * 2^-24`` in h).
# Neither is more accurate. SwiGLU's and SiLU's (expf, division) are bitwise the reference's.

__all__ = ["interpreting", "act", "act_grad", "h_tile"]


def interpreting() -> bool:
    """Whether Triton runs the kernels in its CPU interpreter (NOTE: [Saturating casts])."""
    return os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "yes", "on")


if triton is not None:

    @triton.jit
    def _exp(v, INTERP: tl.constexpr):
        """expf: libdevice's (torch's CUDA ``exp``; ``tl.exp`` is ``ex2.approx``), numpy's in the
        CPU interpreter (which has no libdevice)."""
        if INTERP:
            return tl.exp(v)
        return libdevice.exp(v)

    @triton.jit
    def _erf(v, INTERP: tl.constexpr):
        if INTERP:
            return tl.math.erf(v)
        return libdevice.erf(v)

    @triton.jit
    def sigmoid(g, INTERP: tl.constexpr):
        """torch.sigmoid in fp32: ``1 / (1 + exp(-g))``."""
        return tl.math.div_rn(1.0, 1.0 + _exp(-g, INTERP))

    @triton.jit
    def silu(g, INTERP: tl.constexpr):
        """F.silu in fp32: ``g / (1 + exp(-g))``."""
        return tl.math.div_rn(g, 1.0 + _exp(-g, INTERP))

    @triton.jit
    def silu_grad(g, INTERP: tl.constexpr):
        s = sigmoid(g, INTERP)
        return s * (1.0 + g * (1.0 - s))

    @triton.jit
    def gelu(z, INTERP: tl.constexpr):
        """F.gelu (exact) in fp32: ``z * 0.5 * (1 + erf(z * M_SQRT1_2))``."""
        return z * 0.5 * (1.0 + _erf(z * 0.7071067811865476, INTERP))

    @triton.jit
    def gelu_grad(z, INTERP: tl.constexpr):
        return 0.5 * (1.0 + _erf(z * 0.7071067811865476, INTERP)) + z * _exp(-0.5 * z * z, INTERP) * 0.3989422804014327

    @triton.jit
    def act(z, ACT: tl.constexpr, INTERP: tl.constexpr):
        """The activation (a gated one's: of the gate) in fp32, by its ``triton`` code."""
        if ACT == 0:  # swiglu's gate
            a = silu(z, INTERP)
        elif ACT == 1:
            a = gelu(z, INTERP)
        elif ACT == 2:
            a = silu(z, INTERP)
        else:
            tl.static_assert(False, "no Triton branch for this ACT code")
        return a

    @triton.jit
    def act_grad(z, ACT: tl.constexpr, INTERP: tl.constexpr):
        """:func:`act`'s derivative in fp32, by the same code."""
        if ACT == 0:
            d = silu_grad(z, INTERP)
        elif ACT == 1:
            d = gelu_grad(z, INTERP)
        elif ACT == 2:
            d = silu_grad(z, INTERP)
        else:
            tl.static_assert(False, "no Triton branch for this ACT code")
        return d

    @triton.jit
    def h_tile(
        z_ptr,
        stride_z,
        rows,
        rmask,
        cols,
        cmask,
        p_ptr,
        F,
        ACT: tl.constexpr,
        GATED: tl.constexpr,
        HAS_P: tl.constexpr,
        INTERP: tl.constexpr,
    ):
        """``act(fc1_out) * probs`` in fp32 for a tile of h's ``rows`` x ``cols`` (0 outside
        the masks), from fc1_out's columns ``cols`` (SwiGLU: the gate; the up half at ``+ F``)."""
        m = rmask[:, None] & cmask[None, :]
        z_at = z_ptr + rows[:, None].to(tl.int64) * stride_z + cols[None, :]
        z = tl.load(z_at, mask=m, other=0.0).to(tl.float32)
        a = act(z, ACT, INTERP)
        if GATED:
            a = a * tl.load(z_at + F, mask=m, other=0.0).to(tl.float32)
        if HAS_P:
            a = a * tl.load(p_ptr + rows, mask=rmask, other=0.0).to(tl.float32)[:, None]
        return a

else:  # no Triton: nothing launches the kernels that call these (the importers' names still resolve)
    sigmoid = silu = silu_grad = gelu = gelu_grad = act = act_grad = h_tile = None
