"""Emulated FP8 quantization: TE's kernels' formulas in plain torch (any device).

Sources (TE 2.20): ``common/recipe/recipe_common.cuh: compute_scale_from_amax`` (scale from an
amax), ``common/recipe/current_scaling.cu`` (per-tensor amax, then scale), ``common/cast/fp8/
quantize_fp8.cuh`` (per-tensor cast: ``fp8(x * scale)``, amax atomically maxed, ``scale_inv =
__frcp_rn(scale)``), ``common/transpose/quantize_transpose_vector_blockwise.cu`` (1x128 tiles,
``scale_inv = 1.0 / scale`` in double) and ``quantize_transpose_square_blockwise.cu`` (128x128
tiles, ``scale_inv = 1.0f / scale``).

Casts round to nearest even and saturate at the format's largest finite value, keeping NaN, as
CUDA's do; amaxes skip NaN (NOTE: [Rounding, saturation, NaN]).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Union

import torch
import torch.nn.functional as F

from .qtensor import QTensor
from .spec import TensorSpec

__all__ = ["FLT_MAX", "compute_scale_from_amax", "amax_of", "quantize", "quantize_groups"]


# NOTE: [Rounding, saturation, NaN]
#   Every kernel computes ``float(x) * scale`` in fp32 and converts with CUDA's saturating
#   conversion (``__NV_SATFINITE``): round to nearest even, anything beyond the largest finite
#   value (inf included) becomes +-448 (E4M3) / +-57344 (E5M2), NaN stays NaN. torch's casts do
#   not all saturate (E5M2 overflows to inf), so values are clamped to +-max first; as clamping is
#   monotone and max is representable, clamp-then-round equals round-then-saturate.
#   Amaxes are ``fmaxf`` reductions starting from 0, which skip NaN: a NaN element does not make
#   the amax NaN here either.

FLT_MAX = torch.finfo(torch.float32).max
_INPUTS = (torch.float32, torch.bfloat16, torch.float16)  # TE's TRANSFORMER_ENGINE_TYPE_SWITCH_INPUT
_EXPONENT_BITS = -8388608  # 0xFF800000 as int32: sign and exponent of an fp32


def compute_scale_from_amax(
    amax: torch.Tensor,
    fp8_max: float,
    *,
    power_2_scale: bool = False,
    epsilon: float = 0.0,
    value_for_inf: float = FLT_MAX,
) -> torch.Tensor:
    """TE's ``compute_scale_from_amax``, elementwise in fp32.

    ``amax`` is floored at ``epsilon``; an amax that is 0, inf or NaN gives scale 1; else
    ``fp8_max / amax`` (IEEE division), which, if it overflows to inf, becomes
    ``value_for_inf`` (FLT_MAX for per-tensor current scaling; the *input dtype's* largest
    finite value for block scaling: ``compute_scale_from_types<IType, OType>``). With
    ``power_2_scale`` the mantissa bits are cleared: the scale rounds down to a power of two.
    """
    a = amax.to(torch.float32)
    eps = torch.tensor(epsilon, dtype=torch.float32, device=a.device)  # the kernel's float epsilon
    a = torch.where(a < eps, eps, a)  # NaN < eps is false: NaN stays NaN
    special = torch.isinf(a) | (a == 0) | torch.isnan(a)
    scale = torch.full_like(a, fp8_max) / a
    scale = torch.where(torch.isinf(scale), torch.tensor(value_for_inf, dtype=torch.float32, device=a.device), scale)
    if power_2_scale:
        scale = _round_down_to_power_of_2(scale)
    return torch.where(special, torch.ones_like(scale), scale)


def _round_down_to_power_of_2(s: torch.Tensor) -> torch.Tensor:
    """Positive normal fp32 ``s`` with its mantissa bits cleared (the caller replaces 0, inf
    and NaN scales, which the two forms below map differently). Under a
    torch.func transform: ``s / (2 m)`` for ``s = m 2^e`` (``frexp``, m in [0.5, 1)), the same
    bits (2m is exact and the quotient, 2^(e-1), representable), because some torch releases
    (2.11) have no vmap rule for ``view(dtype)``. Scales here are never subnormal: they are
    at least fp8_max / FLT_MAX."""
    if torch._C._functorch.is_functorch_wrapped_tensor(s):
        return s / (torch.frexp(s).mantissa * 2)
    return (s.view(torch.int32) & _EXPONENT_BITS).view(torch.float32)


def amax_of(t: torch.Tensor, dim: Any = None) -> torch.Tensor:
    """``max |t|`` in fp32 (over ``dim``, or all), NaNs skipped, 0 for no elements (TE's amax)."""
    a = t.detach().abs().to(torch.float32)
    a = torch.where(torch.isnan(a), torch.zeros_like(a), a)
    if dim is None:
        return a.amax() if a.numel() else a.new_zeros(())
    return a.amax(dim=dim)


def _cast(v: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    """fp32 -> FP8 with saturation (see the module NOTE)."""
    return v.clamp(-spec.fp8_max, spec.fp8_max).to(spec.fp8_dtype)


def _block_quantize(x: torch.Tensor, spec: TensorSpec, value_for_inf: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A 2-D fp32 matrix in tiles of ``spec.block``: (FP8 data, compact inverse scales)."""
    R, C = x.shape
    br, bc = spec.block  # type: ignore[misc]
    nR, nC = -(-R // br), -(-C // bc)
    tiles = F.pad(x, (0, nC * bc - C, 0, nR * br - R)).view(nR, br, nC, bc)  # zero padding: amax unchanged
    scale = compute_scale_from_amax(
        amax_of(tiles, dim=(1, 3)),
        spec.fp8_max,
        power_2_scale=spec.power_2_scale,
        epsilon=spec.amax_epsilon,
        value_for_inf=value_for_inf,
    )
    data = _cast(tiles * scale.view(nR, 1, nC, 1), spec).view(nR * br, nC * bc)[:R, :C].contiguous()
    if br == 1:  # 1x128 kernel: `CType scale_inv = 1.0 / scale;` divides in double
        scale_inv = (1.0 / scale.to(torch.float64)).to(torch.float32)
    else:  # 128x128 kernel: `1.0f / block_tile_scale`
        scale_inv = torch.reciprocal(scale)
    return data, scale_inv


def _check_input(t: Any, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _INPUTS:
        raise TypeError(f"{name} must be float32, bfloat16 or float16 (what TE quantizes), got {t.dtype}")
    if t.dim() < 1:
        raise ValueError(f"{name} must have at least 1 dimension, got a 0-d tensor")
    return t


def _check_quantize(t: Any, spec: Any, scale: Any, rowwise: bool, columnwise: bool) -> None:
    """:func:`quantize`'s argument checks (TypeError/ValueError naming the argument)."""
    _check_input(t, "t")
    if not isinstance(spec, TensorSpec):
        raise TypeError(f"spec must be a TensorSpec (see tensor_spec), got {type(spec).__name__}")
    if not (rowwise or columnwise):
        raise ValueError("quantize needs rowwise=True or columnwise=True (or both)")
    if spec.scaling == "rowwise":
        raise ValueError(
            "RowwiseScaling quantizes a whole group (its columnwise scales span each expert's tokens): "
            "use functional_dw.fp8.rowwise.quantize_activation / quantize_weight"
        )
    if (spec.scaling == "delayed") != (scale is not None):
        raise ValueError(
            "delayed scaling quantizes with the state's scale: pass scale="
            if scale is None
            else f"scale= is for delayed scaling only; {spec.scaling} scaling computes its own"
        )


def _quantize_blocks(t: torch.Tensor, x: torch.Tensor, spec: TensorSpec, rowwise: bool, columnwise: bool) -> QTensor:
    """Block scaling: one scale per tile of ``spec.block`` (``x``: ``t`` as fp32 ``[rows, K]``);
    the columnwise copy tiled over the transpose."""
    shape = tuple(t.shape)
    col_shape = (shape[-1], *shape[:-1])
    row = _block_quantize(x, spec, torch.finfo(t.dtype).max) if rowwise else (None, None)
    col = _block_quantize(x.t(), spec, torch.finfo(t.dtype).max) if columnwise else (None, None)
    return QTensor(
        row[0] if row[0] is None else row[0].reshape(shape),
        row[1],
        col[0] if col[0] is None else col[0].reshape(col_shape),
        col[1],
        None,
        shape,
        t.dtype,
        spec.fp8_dtype,
        spec.block,
    )


def quantize(
    t: torch.Tensor,
    spec: TensorSpec,
    *,
    scale: Union[torch.Tensor, float, None] = None,
    rowwise: bool = True,
    columnwise: bool = False,
) -> QTensor:
    """Quantize ``t`` as ``spec`` says, into a :class:`QTensor` with the copies asked for.

    - ``"delayed"``: with the given per-tensor ``scale`` (the state's, see
      :func:`.state.scale_for`); the result's ``amax`` is what the state records.
    - ``"current"``: the scale comes from ``t``'s amax (``scale`` must be None).
    - ``"block"``: one scale per tile of ``spec.block``; the columnwise copy is tiled over the
      transpose (see :mod:`.qtensor`).

    ``t`` is float32, bfloat16 or float16 of any shape ``[*lead, K]``; it is not differentiated
    through. A tensor with no elements gets scale 1 (TE leaves its scale unwritten).
    """
    _check_quantize(t, spec, scale, rowwise, columnwise)
    shape = tuple(t.shape)
    x = t.detach().reshape(math.prod(shape[:-1]), shape[-1]).to(torch.float32)
    col_shape = (shape[-1], *shape[:-1])
    if spec.scaling == "block":
        return _quantize_blocks(t, x, spec, rowwise, columnwise)
    amax = amax_of(x).reshape(1)
    if spec.scaling == "current":
        s = compute_scale_from_amax(amax, spec.fp8_max, power_2_scale=spec.power_2_scale, epsilon=spec.amax_epsilon)
    else:
        s = torch.as_tensor(scale, dtype=torch.float32, device=t.device).reshape(1)
    data = _cast(x * s, spec)
    scale_inv = torch.reciprocal(s)  # __frcp_rn
    return QTensor(
        data.reshape(shape) if rowwise else None,
        scale_inv if rowwise else None,
        data.t().contiguous().reshape(col_shape) if columnwise else None,
        scale_inv if columnwise else None,
        amax,
        shape,
        t.dtype,
        spec.fp8_dtype,
        None,
    )


def _sizes(sizes: Any, total: int) -> list[int]:
    if isinstance(sizes, torch.Tensor):
        if sizes.dim() != 1 or sizes.is_floating_point() or sizes.is_complex() or sizes.device.type != "cpu":
            raise ValueError(
                f"sizes must be host split sizes: a list of ints or a 1-D integer CPU tensor, got "
                f"a {sizes.dim()}-D {sizes.dtype} tensor on {sizes.device}"
            )
        sizes = sizes.tolist()
    if not isinstance(sizes, Sequence) or isinstance(sizes, (str, bytes)):
        raise TypeError(f"sizes must be a sequence of ints, got {type(sizes).__name__}")
    out = []
    for i, n in enumerate(sizes):
        if isinstance(n, bool) or not hasattr(n, "__index__") or int(n) < 0:
            raise ValueError(f"sizes[{i}] must be an int >= 0, got {n!r}")
        out.append(int(n))
    if sum(out) != total:
        raise ValueError(f"sizes sum to {sum(out)} but x has {total} rows")
    return out


def quantize_groups(
    x: torch.Tensor,
    sizes: Any,
    spec: Union[TensorSpec, Sequence[TensorSpec]],
    *,
    scales: Union[torch.Tensor, Sequence[Any], None] = None,
    rowwise: bool = True,
    columnwise: bool = False,
) -> list[QTensor]:
    """Quantize each expert's rows of ``x [T, K]`` on its own, as TE's ``split_quantize`` does
    with one quantizer per expert (each its own amax and scale; 1x128 columnwise tiles start at
    the expert's first row).

    ``sizes``: the experts' row counts on the host (ints, or a 1-D integer CPU tensor), summing
    to T. ``spec``: one :class:`TensorSpec` for all, or one per expert. ``scales`` (delayed
    scaling): E scales, e.g. :func:`.state.group_scales`. Returns E QTensors (an expert with no
    rows gets an empty one whose amax is 0, which leaves a delayed state's slot unchanged).
    """
    _check_input(x, "x")
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [T, K], got shape {tuple(x.shape)}")
    counts = _sizes(sizes, x.shape[0])
    E = len(counts)
    specs = [spec] * E if isinstance(spec, TensorSpec) else list(spec)
    if len(specs) != E:
        raise ValueError(f"spec must be one TensorSpec or {E} (one per expert), got {len(specs)}")
    if scales is None:
        per = [None] * E
    else:
        per = list(scales.reshape(-1)) if isinstance(scales, torch.Tensor) else list(scales)
        if len(per) != E:
            raise ValueError(f"scales must have {E} entries (one per expert), got {len(per)}")
    out, start = [], 0
    for n, s, sc in zip(counts, specs, per):
        out.append(quantize(x[start : start + n], s, scale=sc, rowwise=rowwise, columnwise=columnwise))
        start += n
    return out
