"""Emulated quantization, checked against a scalar re-implementation of TE's kernel rules.

The reference below works element by element in Python: fp32 arithmetic through numpy's
float32 (IEEE), FP8 rounding written out (round half to even on the format's grid, saturation
at the largest finite value), block tiles walked by explicit loops.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.utils._pytree as pytree

from functional_dw.fp8 import (
    FLT_MAX,
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    QParams,
    QTensor,
    TensorSpec,
    amax_of,
    compute_scale_from_amax,
    from_te_scale_inv,
    quantize,
    quantize_groups,
    te_scale_inv,
    tensor_spec,
)
from helpers import randn

F32 = np.float32
E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
FMT = {E4: (3, -6, 448.0), E5: (2, -14, 57344.0)}  # mantissa bits, min normal exponent, max finite


# ---- the scalar reference -------------------------------------------------------------------


def ref_scale(amax: float, fp8_max: float, pow2: bool = False, eps: float = 0.0, inf_value: float = FLT_MAX) -> float:
    a = F32(amax)
    if a < F32(eps):
        a = F32(eps)
    if math.isinf(a) or a == 0 or math.isnan(a):
        return 1.0
    with np.errstate(over="ignore"):
        s = F32(fp8_max) / a
    if math.isinf(s):
        s = F32(inf_value)
    if pow2:
        s = F32(2.0 ** (math.frexp(float(s))[1] - 1))  # the largest power of two <= s
    return float(s)


def ref_fp8(v: float, fp8_dtype: torch.dtype) -> float:
    """``v`` rounded to the FP8 grid, half to even, saturating (CUDA's __NV_SATFINITE)."""
    mbits, emin, vmax = FMT[fp8_dtype]
    if math.isnan(v):
        return v
    a = abs(v)
    if a >= vmax:
        return math.copysign(vmax, v)
    e = max(math.frexp(a)[1] - 1, emin) if a > 0 else emin
    step = 2.0 ** (e - mbits)
    return math.copysign(round(a / step) * step, v)


def ref_cast(x: float, s: float, fp8_dtype: torch.dtype) -> float:
    return ref_fp8(float(F32(x) * F32(s)), fp8_dtype)


def ref_amax(values) -> float:
    vals = [abs(float(v)) for v in values if not math.isnan(float(v))]
    return max(vals, default=0.0)


def as_floats(t: torch.Tensor) -> list[float]:
    return t.to(torch.float64).flatten().tolist()


def same(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all((math.isnan(p) and math.isnan(q)) or p == q for p, q in zip(a, b))


def spec(scaling: str, fp8_dtype=E4, block=None, pow2=False, eps=0.0) -> TensorSpec:
    return TensorSpec("input", scaling, fp8_dtype, block=block, power_2_scale=pow2, amax_epsilon=eps)


# ---- scales ---------------------------------------------------------------------------------

AMAXES = [0.0, 1e-45, 1e-39, 1e-36, 1e-30, 3e-3, 0.3, 1.0, 448.0, 1000.0, 1e30, FLT_MAX, float("inf"), float("nan")]


@pytest.mark.parametrize("fp8_max", [448.0, 57344.0])
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("eps", [0.0, 1e-3])
@pytest.mark.parametrize("inf_value", [FLT_MAX, float(torch.finfo(torch.bfloat16).max), 65504.0])
def test_compute_scale_from_amax(fp8_max, pow2, eps, inf_value):
    got = compute_scale_from_amax(
        torch.tensor(AMAXES), fp8_max, power_2_scale=pow2, epsilon=eps, value_for_inf=inf_value
    )
    want = [ref_scale(a, fp8_max, pow2, eps, inf_value) for a in AMAXES]
    assert got.dtype == torch.float32 and same(as_floats(got), want)


def test_scale_special_cases():
    s = compute_scale_from_amax(torch.tensor([0.0, float("inf"), float("nan"), 1e-39]), 448.0)
    assert s.tolist()[:3] == [1.0, 1.0, 1.0] and s[3].item() == FLT_MAX  # scale overflow -> FLT_MAX
    p = compute_scale_from_amax(torch.tensor([1e-39, 3.0]), 448.0, power_2_scale=True)
    assert p.tolist() == [2.0**127, 128.0]  # 448/3 = 149.3 -> 128
    assert compute_scale_from_amax(torch.tensor([1e-5]), 448.0, epsilon=1.0).item() == 448.0  # amax floored


# ---- per-tensor scaling ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fp8_dtype", [E4, E5])
@pytest.mark.parametrize("pow2", [False, True])
def test_current_scaling_exact(dtype, fp8_dtype, pow2):
    x = randn(7, 33, dtype=dtype, seed=1, scale=3.0)
    q = quantize(x, spec("current", fp8_dtype, pow2=pow2), columnwise=True)
    amax = ref_amax(as_floats(x))
    s = ref_scale(amax, FMT[fp8_dtype][2], pow2)
    assert q.amax.tolist() == [amax]
    assert same(as_floats(q.rowwise_data), [ref_cast(v, s, fp8_dtype) for v in as_floats(x)])
    assert q.rowwise_scale_inv.tolist() == [float(F32(1) / F32(s))]
    assert torch.equal(q.columnwise_data.view(torch.uint8), q.rowwise_data.t().contiguous().view(torch.uint8))
    assert q.columnwise_scale_inv is q.rowwise_scale_inv
    assert q.rowwise_data.dtype == fp8_dtype and q.shape == (7, 33) and q.dtype == dtype and q.block is None


def test_current_scaling_epsilon():
    x = torch.full((4, 4), 1e-6)
    q = quantize(x, spec("current", eps=0.5))
    assert q.rowwise_scale_inv.item() == float(F32(1) / F32(ref_scale(1e-6, 448.0, eps=0.5)))
    assert q.amax.item() == float(F32(1e-6))  # the recorded amax is the tensor's, before the floor


@pytest.mark.parametrize("fp8_dtype", [E4, E5])
def test_delayed_saturates(fp8_dtype):
    vmax = FMT[fp8_dtype][2]
    x = torch.tensor([0.5, -0.25, 1e5, -1e6, float("inf"), float("-inf"), float("nan"), 1e-9])
    q = quantize(x, spec("delayed", fp8_dtype), scale=torch.tensor(4.0))
    want = [ref_cast(v, 4.0, fp8_dtype) for v in as_floats(x)]
    assert same(as_floats(q.rowwise_data), want)
    assert want[2:6] == [vmax, -vmax, vmax, -vmax] and math.isnan(want[6])
    assert q.amax.item() == float("inf") and q.rowwise_scale_inv.item() == 0.25
    if fp8_dtype == E5:  # torch's own E5M2 cast does not saturate
        assert not math.isfinite((x * 4.0).to(fp8_dtype)[3].item())


def test_nan_is_skipped_by_amax():
    x = torch.tensor([[1.0, float("nan"), -3.0]])
    q = quantize(x, spec("current"))
    assert q.amax.item() == 3.0 and q.rowwise_scale_inv.item() == float(F32(1) / (F32(448) / F32(3)))
    assert math.isnan(q.dequantize()[0, 1].item())


@pytest.mark.parametrize("fp8_dtype", [E4, E5])
@pytest.mark.parametrize("mode", ["current", "block1", "block2"])
def test_roundtrip_error_bound(fp8_dtype, mode):
    """|dequantize(quantize(x)) - x| <= half an FP8 step of x * s, over s (plus fp32 slack)."""
    mbits, emin, _ = FMT[fp8_dtype]
    x = randn(130, 260, seed=2) * torch.logspace(-3, 3, 260)
    sp = {
        "current": spec("current", fp8_dtype),
        "block1": spec("block", fp8_dtype, (1, 128)),
        "block2": spec("block", fp8_dtype, (128, 128)),
    }[mode]
    q = quantize(x, sp, columnwise=True)
    for col in (False, True):
        s_inv = q.columnwise_scale_inv if col else q.rowwise_scale_inv
        per_elem = s_inv if sp.block is None else _expand(s_inv, sp.block, (260, 130) if col else (130, 260))
        per_elem = per_elem.t() if col and sp.block is not None else per_elem
        bound = (x.abs() * 2.0 ** -(mbits + 1) + 2.0 ** (emin - mbits - 1) * per_elem) * (1 + 2.0**-20)
        assert ((q.dequantize(columnwise=col) - x).abs() <= bound).all()


def _expand(s: torch.Tensor, block, shape) -> torch.Tensor:
    return s.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[: shape[0], : shape[1]]


@pytest.mark.parametrize("make", ["current", "block1", "block2"])
def test_pow2_scales_are_powers_of_two(make):
    x = randn(200, 300, seed=3) * torch.logspace(-4, 4, 300)
    sp = {
        "current": spec("current", pow2=True),
        "block1": spec("block", block=(1, 128), pow2=True),
        "block2": spec("block", block=(128, 128), pow2=True),
    }[make]
    q = quantize(x, sp, columnwise=True)
    for s in (q.rowwise_scale_inv, q.columnwise_scale_inv):
        assert all(math.frexp(v)[0] == 0.5 for v in as_floats(s))


# ---- block scaling against explicit tile loops ------------------------------------------------


def ref_block(x2d: torch.Tensor, block, fp8_dtype, pow2, eps, inf_value):
    """Tile by tile: (data as floats, compact scale_inv as floats)."""
    R, C = x2d.shape
    br, bc = block
    rows = [[0.0] * C for _ in range(R)]
    nR, nC = -(-R // br), -(-C // bc)
    sinv = [[0.0] * nC for _ in range(nR)]
    vals = x2d.to(torch.float64).tolist()
    for i in range(nR):
        for j in range(nC):
            cells = [(r, c) for r in range(i * br, min(R, i * br + br)) for c in range(j * bc, min(C, j * bc + bc))]
            s = ref_scale(ref_amax(vals[r][c] for r, c in cells), FMT[fp8_dtype][2], pow2, eps, inf_value)
            sinv[i][j] = float(F32(1.0 / np.float64(s))) if br == 1 else float(F32(1) / F32(s))
            for r, c in cells:
                rows[r][c] = ref_cast(vals[r][c], s, fp8_dtype)
    return [v for row in rows for v in row], [v for row in sinv for v in row]


@pytest.mark.parametrize("shape", [(5, 300), (3, 4, 130), (256, 128), (2, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pow2", [True, False])
def test_block_1x128_rowwise_and_columnwise(shape, dtype, pow2):
    x = randn(*shape, dtype=dtype, seed=4) * torch.logspace(-2, 2, shape[-1]).to(dtype)
    x.view(-1)[-1] = float("nan")
    q = quantize(x, spec("block", E4, (1, 128), pow2=pow2, eps=1e-4), rowwise=True, columnwise=True)
    x2d = x.reshape(-1, shape[-1])
    inf_value = torch.finfo(dtype).max
    data, sinv = ref_block(x2d, (1, 128), E4, pow2, 1e-4, inf_value)
    assert same(as_floats(q.rowwise_data), data) and as_floats(q.rowwise_scale_inv) == sinv
    assert q.rowwise_scale_inv.shape == (x2d.shape[0], -(-shape[-1] // 128))
    data_t, sinv_t = ref_block(x2d.t(), (1, 128), E4, pow2, 1e-4, inf_value)  # tiles along M
    assert q.columnwise_data.shape == (shape[-1], *shape[:-1])
    assert same(as_floats(q.columnwise_data), data_t) and as_floats(q.columnwise_scale_inv) == sinv_t


@pytest.mark.parametrize("shape", [(130, 260), (128, 128), (3, 5)])
@pytest.mark.parametrize("pow2", [True, False])
def test_block_128x128(shape, pow2):
    x = randn(*shape, seed=5) * torch.logspace(-3, 3, shape[0])[:, None]
    q = quantize(x, spec("block", E5, (128, 128), pow2=pow2), rowwise=True, columnwise=True)
    data, sinv = ref_block(x, (128, 128), E5, pow2, 0.0, FLT_MAX)
    assert same(as_floats(q.rowwise_data), data) and as_floats(q.rowwise_scale_inv) == sinv
    # the transpose's tiles are the tiles transposed: same payload, transposed, same scales
    assert torch.equal(q.columnwise_data.view(torch.uint8), q.rowwise_data.t().contiguous().view(torch.uint8))
    assert torch.equal(q.columnwise_scale_inv, q.rowwise_scale_inv.t())


def test_block_scale_overflow_takes_the_input_dtypes_max():
    """compute_scale_from_types<IType, OType>: a scale that overflows fp32 becomes IType's max."""
    x = torch.full((1, 128), 1e-38, dtype=torch.bfloat16)  # 448 / 1e-38 overflows fp32
    q = quantize(x, spec("block", block=(1, 128)))
    assert q.rowwise_scale_inv.item() == float(F32(1.0 / np.float64(torch.finfo(torch.bfloat16).max)))
    cur = quantize(x, spec("current"))  # per-tensor current scaling uses FLT_MAX
    assert cur.rowwise_scale_inv.item() == float(F32(1) / F32(FLT_MAX))


@pytest.mark.parametrize(
    "sp",
    [
        spec("current"),
        spec("block", block=(1, 128)),
        spec("block", block=(128, 128)),
        spec("current", pow2=True, eps=0.1),
    ],
)
def test_zeros(sp):
    q = quantize(torch.zeros(3, 200), sp, columnwise=True)
    for d, s in ((q.rowwise_data, q.rowwise_scale_inv), (q.columnwise_data, q.columnwise_scale_inv)):
        assert not d.to(torch.float32).any()
        assert (s == (1.0 if sp.amax_epsilon == 0 else 1 / ref_scale(0.1, 448.0, True))).all()
    assert not q.dequantize().any()


@pytest.mark.parametrize("sp", [spec("current"), spec("block", block=(1, 128)), spec("block", block=(128, 128))])
def test_empty(sp):
    q = quantize(torch.zeros(0, 300), sp, columnwise=True)
    assert q.rowwise_data.shape == (0, 300) and q.columnwise_data.shape == (300, 0)
    assert q.dequantize().shape == (0, 300)
    if sp.block is None:
        assert q.amax.item() == 0.0 and q.rowwise_scale_inv.item() == 1.0


# ---- the record ---------------------------------------------------------------------------


def test_dequantize_shapes_dtypes_and_usage():
    x = randn(2, 3, 140, dtype=torch.bfloat16, seed=6)
    q = quantize(x, spec("block", block=(1, 128)), rowwise=True, columnwise=True)
    assert q.dequantize().shape == (2, 3, 140) and q.dequantize().dtype == torch.float32
    assert q.dequantize(torch.bfloat16).dtype == torch.bfloat16
    col = q.with_usage(rowwise=False, columnwise=True)
    assert col.rowwise_data is None and col.amax is None
    assert torch.equal(col.dequantize(), q.dequantize(columnwise=True))
    with pytest.raises(ValueError, match="no rowwise data"):
        col.dequantize(columnwise=False)
    with pytest.raises(ValueError, match="no rowwise data"):
        col.with_usage(rowwise=True, columnwise=True)
    assert "1x128 blocks" in repr(q) and "rowwise+columnwise" in repr(q)


def test_pytree_leaves_are_the_tensors_held():
    q = quantize(randn(4, 8), spec("current"), rowwise=False, columnwise=True)
    leaves, treedef = pytree.tree_flatten(q)
    assert len(leaves) == 3 and all(isinstance(t, torch.Tensor) for t in leaves)  # data, scale_inv, amax
    back = pytree.tree_unflatten([t.clone() for t in leaves], treedef)
    assert isinstance(back, QTensor) and back.rowwise_data is None and torch.equal(back.dequantize(), q.dequantize())
    paths = [pytree.keystr(p) for p, _ in pytree.tree_flatten_with_path(q)[0]]
    assert paths == [".columnwise_data", ".columnwise_scale_inv", ".amax"]
    assert pytree.tree_map(lambda t: t, q.with_usage(rowwise=False, columnwise=True)).amax is None


def test_te_scale_inv_layout():
    """TE's GEMM-ready shapes, as Float8BlockQuantizer.get_scale_shape computes them."""

    def te_shape(M, K, dim, columnwise):
        up4 = lambda n: -(-n // 4) * 4  # noqa: E731
        if dim == 2:
            return (-(-K // 128), up4(-(-M // 128))) if columnwise else (-(-M // 128), up4(-(-K // 128)))
        return (-(-M // 128), up4(K)) if columnwise else (-(-K // 128), up4(M))

    M, K = 259, 130
    x = randn(M, K, seed=7)
    for dim, block in ((1, (1, 128)), (2, (128, 128))):
        q = quantize(x, spec("block", block=block), rowwise=True, columnwise=True)
        for col, (rows, cols) in ((False, (M, K)), (True, (K, M))):
            te = te_scale_inv(q, columnwise=col)
            assert te.shape == te_shape(M, K, dim, col)
            back = from_te_scale_inv(te, rows, cols, block)
            assert torch.equal(back, q.columnwise_scale_inv if col else q.rowwise_scale_inv)
    q = quantize(x, spec("current"))
    assert te_scale_inv(q) is q.rowwise_scale_inv and from_te_scale_inv(q.rowwise_scale_inv, M, K, None).shape == (1,)


# ---- per expert ---------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", [Float8CurrentScaling(), Float8BlockScaling(), DelayedScaling()])
def test_quantize_groups_is_quantize_per_expert(recipe):
    x = randn(300, 136, seed=8) * torch.tensor([1.0] * 100 + [50.0] * 150 + [0.01] * 50)[:, None]
    sizes = [100, 0, 150, 50]
    sp = tensor_spec(recipe, "input")
    scales = torch.tensor([1.0, 2.0, 4.0, 8.0]) if sp.scaling == "delayed" else None
    qs = quantize_groups(x, sizes, sp, scales=scales, columnwise=True)
    starts = [0, 100, 100, 250]
    for e, (q, n, s0) in enumerate(zip(qs, sizes, starts)):
        one = quantize(x[s0 : s0 + n], sp, scale=None if scales is None else scales[e], columnwise=True)
        for name in ("rowwise_data", "columnwise_data"):
            assert torch.equal(getattr(q, name).view(torch.uint8), getattr(one, name).view(torch.uint8))
        assert torch.equal(q.columnwise_scale_inv, one.columnwise_scale_inv)
    assert qs[1].shape == (0, 136)
    if sp.scaling == "delayed":
        assert qs[1].amax.item() == 0.0 and qs[3].rowwise_scale_inv.item() == 0.125
    if sp.block == (1, 128):  # columnwise tiles start at each expert's first row, not every 128 rows of x
        whole = quantize(x, sp, rowwise=False, columnwise=True)
        assert (whole.columnwise_scale_inv[:, 0] > qs[0].columnwise_scale_inv[:, 0]).all()  # rows 100..127 are x50


def test_quantize_groups_specs_per_expert_and_tensor_sizes():
    x = randn(6, 16, seed=9)
    sps = [spec("current"), spec("current", E5)]
    qs = quantize_groups(x, torch.tensor([2, 4]), sps)
    assert [q.fp8_dtype for q in qs] == [E4, E5]


@pytest.mark.parametrize(
    "sizes,match",
    [
        ([2, 3], "sum to 5 but x has 6 rows"),
        ([7, -1], r"sizes\[1\] must be an int >= 0"),
        ([2.0, 4], r"sizes\[0\]"),
        (torch.tensor([[6]]), "1-D integer CPU tensor"),
        ("6", "sequence of ints"),
    ],
)
def test_quantize_groups_bad_sizes(sizes, match):
    with pytest.raises((ValueError, TypeError), match=match):
        quantize_groups(randn(6, 16), sizes, spec("current"))


def test_quantize_groups_bad_specs_and_scales():
    x = randn(6, 16)
    with pytest.raises(ValueError, match="one per expert"):
        quantize_groups(x, [3, 3], [spec("current")] * 3)
    with pytest.raises(ValueError, match="scales must have 2 entries"):
        quantize_groups(x, [3, 3], spec("delayed"), scales=[1.0])
    with pytest.raises(ValueError, match="must be 2-D"):
        quantize_groups(randn(2, 3, 16), [2], spec("current"))


def test_quantize_errors():
    x = randn(4, 8)
    with pytest.raises(ValueError, match="pass scale="):
        quantize(x, spec("delayed"))
    with pytest.raises(ValueError, match="delayed scaling only"):
        quantize(x, spec("current"), scale=1.0)
    with pytest.raises(ValueError, match="rowwise=True or columnwise=True"):
        quantize(x, spec("current"), rowwise=False)
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        quantize(x.double(), spec("current"))
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        quantize(x.int(), spec("current"))
    with pytest.raises(ValueError, match="0-d"):
        quantize(torch.tensor(1.0), spec("current"))
    with pytest.raises(TypeError, match="TensorSpec"):
        quantize(x, Float8CurrentScaling())


def test_quantize_does_not_track_grad():
    x = randn(4, 8).requires_grad_()
    q = quantize(x, spec("current"), columnwise=True)
    assert not any(t.requires_grad for t in pytree.tree_leaves(q))


def test_recipe_roles_end_to_end():
    """Each recipe's three roles quantize and come back within their format's bound."""
    x = randn(64, 256, seed=10)
    for recipe in (
        Float8CurrentScaling(fp8_quant_bwd_grad=QParams(True, 0.0)),
        Float8BlockScaling(fp8_format=Format.HYBRID),
    ):
        for role in ("input", "weight", "grad_output"):
            sp = tensor_spec(recipe, role)
            q = quantize(x, sp, rowwise=True, columnwise=True)
            rel = 2.0 ** -(FMT[sp.fp8_dtype][0] + 1)
            assert ((q.dequantize() - x).abs() <= x.abs() * rel * 1.0001 + 1e-2).all()
    assert amax_of(torch.tensor([-2.0, float("nan")])).item() == 2.0


def test_power_of_2_rounding_under_transforms_is_the_bit_clearing():
    """The frexp form (used under torch.func transforms, where some torch releases cannot vmap
    a dtype view) gives the bits of clearing the mantissa, over the whole range scales take."""
    from functional_dw.fp8.quantize import _round_down_to_power_of_2

    g = torch.Generator().manual_seed(0)
    s = torch.cat(
        [
            torch.exp2(torch.empty(100_000).uniform_(-126, 127.99, generator=g)),
            torch.tensor([448 / torch.finfo(torch.float32).max, torch.finfo(torch.float32).max, 1.0, 1.5, 0.75, 3.0]),
        ]
    )
    plain = _round_down_to_power_of_2(s)
    batched = torch.func.vmap(_round_down_to_power_of_2)(s.view(-1, 2)).view(-1)
    assert torch.equal(plain.view(torch.int32), batched.view(torch.int32))
    assert torch.equal(plain[-3:], torch.tensor([1.0, 0.5, 2.0]))
