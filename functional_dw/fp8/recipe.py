"""FP8 recipes, named and defaulted as Transformer Engine names them.

``Format``, ``MMParams``, ``QParams``, ``DelayedScaling``, ``Float8CurrentScaling`` and
``Float8BlockScaling`` mirror ``transformer_engine/common/recipe/__init__.py`` (TE 2.20) field
by field, as frozen dataclasses that check their fields (a ``ValueError`` names the field).
:func:`as_recipe` also takes TE's own recipe objects, without importing TE.

Only the recipes TE runs on Hopper (sm_90) are here. ``MXFP8BlockScaling`` and
``NVFP4BlockScaling`` need compute capability 10.0+; :func:`as_recipe` refuses them by name.

Some defaults come from TE's ``NVTE_*`` environment variables, read at import (NOTE: [Defaults
read from the environment]); ``fp8_quant_*`` are fields with TE's defaults (NOTE: [fp8_quant_* are
fields here, class attributes in TE]).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from enum import Enum
from typing import Any, NamedTuple, Optional, Union

__all__ = [
    "Format",
    "MMParams",
    "QParams",
    "DelayedScaling",
    "Float8CurrentScaling",
    "Float8BlockScaling",
    "RowwiseScaling",
    "Recipe",
    "FormatHelper",
    "as_recipe",
    "HOPPER_RECIPES",
    "RECIPES",
]


# NOTE: [Defaults read from the environment]
#   TE computes some defaults from environment variables when its recipe module is imported,
#   and so does this module, with the same variables and the same rules:
#   ``NVTE_BACKWARD_OVERRIDE`` (every recipe's ``backward_override``),
#   ``NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES=1`` (``Float8CurrentScaling.use_power_2_scales`` and
#   its ``fp8_quant_*`` ``power_2_scale``), ``NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1``
#   (``Float8BlockScaling.use_f32_scales``; its ``fp8_quant_*`` get ``power_2_scale=False``).

# NOTE: [fp8_quant_* are fields here, class attributes in TE]
#   In TE, ``fp8_quant_fwd_inp``/``fp8_quant_fwd_weight``/``fp8_quant_bwd_grad`` of
#   ``Float8CurrentScaling`` and ``Float8BlockScaling`` carry no annotation, so they are class
#   attributes computed once from the environment, not constructor arguments (TE users override
#   them by assignment). Here they are ordinary fields with the same defaults. As in TE, they are
#   *not* derived from ``use_power_2_scales``/``use_f32_scales`` per instance: TE's Linear and
#   GroupedLinear configure their input, weight and grad-output quantizers from ``fp8_quant_*``
#   (``module/linear.py: _customize_quantizers_float8_current_scaling``), so
#   ``Float8CurrentScaling(use_power_2_scales=True)`` alone changes nothing for them.

_BACKWARD_OVERRIDES = (None, "high_precision", "dequantized")
_ENV_BACKWARD_OVERRIDE = os.getenv("NVTE_BACKWARD_OVERRIDE", None)
_ENV_CS_POW2 = os.getenv("NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES", "0") == "1"
_ENV_BLOCK_F32 = os.getenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "0") == "1"


class FormatHelper(NamedTuple):
    """The largest finite value of the forward and backward formats (TE's ``_FormatHelper``, which
    ``fp8/extra_state.py`` reads and writes as this class)."""

    max_fwd: float
    max_bwd: float


class Format(Enum):
    """FP8 formats: ``E4M3`` everywhere, ``E5M2`` everywhere, or ``HYBRID`` (E4M3 forward,
    E5M2 for gradients). ``E2M1`` is TE's FP4 format, listed so TE's values map one to one;
    no recipe here accepts it. The values (and so the pickled form) are TE's."""

    E2M1 = FormatHelper(max_fwd=6, max_bwd=6)
    E4M3 = FormatHelper(max_fwd=448, max_bwd=448)
    E5M2 = FormatHelper(max_fwd=57344, max_bwd=57344)
    HYBRID = FormatHelper(max_fwd=448, max_bwd=57344)


def _fail(owner: str, field: str, want: str, value: Any) -> ValueError:
    return ValueError(f"{owner}.{field} must be {want}, got {value!r} ({type(value).__name__})")


def _bool(owner: str, field: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise _fail(owner, field, "a bool", value)


def _int(owner: str, field: str, value: Any, minimum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or (minimum is not None and value < minimum):
        raise _fail(owner, field, "an int" + ("" if minimum is None else f" >= {minimum}"), value)


def _typed(owner: str, field: str, value: Any, cls: type) -> None:
    if not isinstance(value, cls):
        raise _fail(owner, field, f"a {cls.__name__}", value)


def _fp8_format(owner: str, value: Any) -> None:
    _typed(owner, "fp8_format", value, Format)
    if value in (Format.E5M2, Format.E2M1):
        raise ValueError(
            f"{owner}.fp8_format must be Format.E4M3 or Format.HYBRID, got {value} "
            "(TE: pure E5M2 training is not supported; E2M1 is FP4)"
        )


def _backward_override(owner: str, value: Any, only_none: bool = False) -> None:
    allowed = (None,) if only_none else _BACKWARD_OVERRIDES
    if value not in allowed or not (value is None or isinstance(value, str)):
        raise _fail(
            owner,
            "backward_override",
            " or ".join(repr(a) for a in allowed) + " (default from NVTE_BACKWARD_OVERRIDE)",
            value,
        )


def _frozen(cls: type) -> type:
    return dataclasses.dataclass(frozen=True)(cls)


@_frozen
class MMParams:
    """GEMM options. ``use_split_accumulator``: cuBLASLt's FP8 split (non fast) accumulation."""

    use_split_accumulator: bool = True

    def __post_init__(self) -> None:
        _bool("MMParams", "use_split_accumulator", self.use_split_accumulator)


@_frozen
class QParams:
    """Quantization options of one tensor role: ``power_2_scale`` rounds each scale down to a
    power of two; ``amax_epsilon`` floors the amax a scale is computed from. The last three are
    NVFP4 options (TE's fields); FP8 quantization ignores them, as TE does."""

    power_2_scale: bool = False
    amax_epsilon: float = 0.0
    random_hadamard_transform: bool = False
    stochastic_rounding: bool = False
    fp4_2d_quantization: bool = False

    def __post_init__(self) -> None:
        _bool("QParams", "power_2_scale", self.power_2_scale)
        eps = self.amax_epsilon
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
            raise _fail("QParams", "amax_epsilon", "a finite float >= 0", eps)
        for name in ("random_hadamard_transform", "stochastic_rounding", "fp4_2d_quantization"):
            _bool("QParams", name, getattr(self, name))


@_frozen
class DelayedScaling:
    """Per-tensor scales from an amax history (TE's ``DelayedScaling``): a tensor is quantized
    with the scale computed at the last update, and its amax goes into the history.
    ``scale = (fp8_max / amax) / 2**margin`` at each update (see :mod:`.state`).

    ``amax_compute_algo``: ``"max"`` (over the history window), ``"most_recent"``, or a callable
    ``amax_history [H, n] -> amax [n]``. ``scaling_factor_compute_algo``: None or a callable
    ``(amax, scale, fp8_max, recipe) -> scale``. Callables run TE's unfused Python update.
    ``reduce_amax``: TE all-reduces (max) the amaxes over the autocast's group before an update;
    here that is the caller's (``update_state(..., group=)``)."""

    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: Union[str, Callable] = "max"
    scaling_factor_compute_algo: Optional[Callable] = None
    reduce_amax: bool = True
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: Optional[str] = _ENV_BACKWARD_OVERRIDE

    def __post_init__(self) -> None:
        me = "DelayedScaling"
        _int(me, "margin", self.margin)
        _fp8_format(me, self.fp8_format)
        _int(me, "amax_history_len", self.amax_history_len, minimum=1)
        algo = self.amax_compute_algo
        if not (callable(algo) or algo in ("max", "most_recent")):
            raise _fail(me, "amax_compute_algo", "'max', 'most_recent' or a callable", algo)
        sf = self.scaling_factor_compute_algo
        if not (sf is None or callable(sf)):
            raise _fail(me, "scaling_factor_compute_algo", "None or a callable", sf)
        for name in ("reduce_amax", "fp8_dpa", "fp8_mha"):
            _bool(me, name, getattr(self, name))
        _backward_override(me, self.backward_override, only_none=True)  # TE: delayed scaling only supports None


@_frozen
class Float8CurrentScaling:
    """Per-tensor scales from each tensor's own amax, computed when it is quantized (TE's
    ``Float8CurrentScaling``). See the module NOTE on ``fp8_quant_*``."""

    use_power_2_scales: bool = _ENV_CS_POW2
    fp8_format: Format = Format.HYBRID
    fp8_quant_fwd_inp: QParams = QParams(power_2_scale=_ENV_CS_POW2, amax_epsilon=0.0)
    fp8_quant_fwd_weight: QParams = QParams(power_2_scale=_ENV_CS_POW2, amax_epsilon=0.0)
    fp8_quant_bwd_grad: QParams = QParams(power_2_scale=_ENV_CS_POW2, amax_epsilon=0.0)
    fp8_gemm_fprop: MMParams = MMParams(use_split_accumulator=False)
    fp8_gemm_dgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_gemm_wgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: Optional[str] = _ENV_BACKWARD_OVERRIDE

    def __post_init__(self) -> None:
        _check_common(self, "Float8CurrentScaling")
        _bool("Float8CurrentScaling", "use_power_2_scales", self.use_power_2_scales)


@_frozen
class Float8BlockScaling:
    """Block scales (TE's ``Float8BlockScaling``): ``*_block_scaling_dim`` 1 means 1x128 tiles
    (128 consecutive elements of a row), 2 means 128x128 tiles; default 1x128 for inputs and
    grads, 128x128 for weights, power-of-two scales (unless ``NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1``).
    TE requires split accumulation in all three GEMMs and CUDA >= 12.9 on Hopper."""

    use_f32_scales: bool = _ENV_BLOCK_F32
    fp8_format: Format = Format.E4M3
    fp8_quant_fwd_inp: QParams = QParams(power_2_scale=not _ENV_BLOCK_F32, amax_epsilon=0.0)
    fp8_quant_fwd_weight: QParams = QParams(power_2_scale=not _ENV_BLOCK_F32, amax_epsilon=0.0)
    fp8_quant_bwd_grad: QParams = QParams(power_2_scale=not _ENV_BLOCK_F32, amax_epsilon=0.0)
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1
    fp8_gemm_fprop: MMParams = MMParams(use_split_accumulator=True)
    fp8_gemm_dgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_gemm_wgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: Optional[str] = _ENV_BACKWARD_OVERRIDE

    def __post_init__(self) -> None:
        me = "Float8BlockScaling"
        _check_common(self, me)
        _bool(me, "use_f32_scales", self.use_f32_scales)
        dims = ("x_block_scaling_dim", "w_block_scaling_dim", "grad_block_scaling_dim")
        for name in dims:
            value = getattr(self, name)
            if isinstance(value, bool) or value not in (1, 2):
                raise _fail(me, name, "1 (1x128 tiles) or 2 (128x128 tiles)", value)
        for a, b in ((0, 1), (0, 2), (1, 2)):  # TE: "2D by 2D block gemm not supported"
            if getattr(self, dims[a]) == 2 and getattr(self, dims[b]) == 2:
                raise ValueError(
                    f"{me}.{dims[a]} and {me}.{dims[b]} are both 2: a GEMM of two "
                    "128x128-tiled operands is not supported (TE)"
                )
        for gemm in ("fprop", "dgrad", "wgrad"):
            if not getattr(self, f"fp8_gemm_{gemm}").use_split_accumulator:
                raise ValueError(
                    f"{me}.fp8_gemm_{gemm}.use_split_accumulator must be True "
                    "(TE: split accumulator required for block scaling)"
                )
        for name in ("fp8_dpa", "fp8_mha"):
            if getattr(self, name):
                raise ValueError(
                    f"{me}.{name} must be False (TE: FP8 attention is not supported with Float8BlockScaling)"
                )


@_frozen
class RowwiseScaling:
    """functional_dw's own recipe for MoE experts: every scale covers one row or one column of
    a GEMM operand, along the dimension the GEMM sums over, so the GEMM applies it in its
    epilogue (``torch._scaled_grouped_mm``, CUTLASS, on Hopper). Not a TE recipe: TE's modules
    cannot run it; a layer runs it on torch's scaled grouped GEMM (``backend`` None, "auto" or
    "torch"; the CPU emulates it exactly, see ``functional_dw/fp8/rowwise.py``).

    =========  ===================================  ======================================
    GEMM       operands                             one scale per
    =========  ===================================  ======================================
    fprop      ``y = x W^T``                        token of x; output feature of W
    dgrad      ``dx = dy W``                        token of dy; input feature of W
    wgrad      ``dW_e = dy_e^T x_e``                (expert, feature) of dy and of x: over
                                                    that expert's tokens
    =========  ===================================  ======================================

    ``fp8_format``: E4M3 only (the scaled grouped GEMM takes E4M3 operands on Hopper; dy's range
    is kept by its per-token scales). ``power_2_scale``: scales rounded down to powers of two,
    so scaling and unscaling are exact. ``amax_epsilon``: amaxes floored at it. ``fp8_gemm_*``:
    ``use_split_accumulator`` False runs the GEMM's fast accumulation (measured on the H200:
    split accumulation makes the grouped FP8 GEMM 2.5-3x slower, slower than bf16).

    Each expert's tokens need not be a multiple of 16: wgrad's operands are padded per expert
    on the device (zeros), with no host round trip.

    ``bf16_below``: a GEMM of ``T x K x N`` below it runs in bf16 (the layer's bf16 plan, the
    same call with no recipe; ``res.fp8`` is None then), where FP8 cannot pay for its
    quantization passes (NOTE: [FP8 where it pays] in ``fp8_rowwise_plan.py``). None: the measured
    rule, on CUDA ``T x K x N >= FP8_PAYS_FROM`` and ``K x N / (K + N) >= FP8_INTENSITY_FROM``
    (``fp8_rowwise_plan.fp8_pays``), elsewhere always FP8; a number replaces the rule by that size
    threshold alone: 0 forces FP8, ``math.inf`` bf16 (an FP8 family's kernels object as
    ``backend=`` multiplies FP8 operands only: FP8 runs whatever this says)."""

    fp8_format: Format = Format.E4M3
    power_2_scale: bool = True
    amax_epsilon: float = 0.0
    fp8_gemm_fprop: MMParams = MMParams(use_split_accumulator=False)
    fp8_gemm_dgrad: MMParams = MMParams(use_split_accumulator=False)
    fp8_gemm_wgrad: MMParams = MMParams(use_split_accumulator=False)
    backward_override: Optional[str] = None
    bf16_below: Optional[float] = None

    def __post_init__(self) -> None:
        me = "RowwiseScaling"
        b = self.bf16_below
        if b is not None and (
            isinstance(b, bool) or not isinstance(b, (int, float)) or b != b or b < 0
        ):  # (b != b: NaN)
            raise _fail(me, "bf16_below", "None or a number >= 0 (math.inf: always bf16)", b)
        _typed(me, "fp8_format", self.fp8_format, Format)
        if self.fp8_format != Format.E4M3:
            raise ValueError(
                f"{me}.fp8_format must be Format.E4M3, got {self.fp8_format} (torch's scaled grouped "
                "GEMM takes E4M3 operands only on Hopper)"
            )
        _bool(me, "power_2_scale", self.power_2_scale)
        eps = self.amax_epsilon
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
            raise _fail(me, "amax_epsilon", "a finite float >= 0", eps)
        for name in ("fp8_gemm_fprop", "fp8_gemm_dgrad", "fp8_gemm_wgrad"):
            _typed(me, name, getattr(self, name), MMParams)
        _backward_override(me, self.backward_override, only_none=True)


def _check_common(r: Any, me: str) -> None:
    _fp8_format(me, r.fp8_format)
    for name in ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad"):
        _typed(me, name, getattr(r, name), QParams)
    for name in ("fp8_gemm_fprop", "fp8_gemm_dgrad", "fp8_gemm_wgrad"):
        _typed(me, name, getattr(r, name), MMParams)
    for name in ("fp8_dpa", "fp8_mha"):
        _bool(me, name, getattr(r, name))
    _backward_override(me, r.backward_override)


Recipe = Union[DelayedScaling, Float8CurrentScaling, Float8BlockScaling, RowwiseScaling]
HOPPER_RECIPES = (DelayedScaling, Float8CurrentScaling, Float8BlockScaling)  # TE's, on sm_90
RECIPES = (*HOPPER_RECIPES, RowwiseScaling)
_OURS = {c.__name__: c for c in HOPPER_RECIPES}
_TE_MODULE = "transformer_engine.common.recipe"
_NOT_ON_HOPPER = ("MXFP8BlockScaling", "NVFP4BlockScaling")
_SUPPORTED = (
    "functional_dw.fp8 runs the recipes TE runs on Hopper (sm_90): DelayedScaling, "
    "Float8CurrentScaling, Float8BlockScaling"
)


def _te_class(obj: Any) -> type | None:
    """The TE recipe class ``obj`` is an instance of (its own or a base), by module and name."""
    for cls in type(obj).__mro__:
        if getattr(cls, "__module__", "").startswith(_TE_MODULE):
            return cls
    return None


def as_recipe(obj: Any) -> Recipe | None:
    """This package's recipe for ``obj``: None for None, ``obj`` itself for one of ours, and a
    field-by-field copy of one of TE's (``transformer_engine.common.recipe``, recognized by module
    and class name, TE is never imported). MXFP8/NVFP4/custom recipes raise ``ValueError``
    saying what runs on Hopper; anything else raises ``TypeError``."""
    if obj is None or isinstance(obj, RECIPES):
        return obj
    if isinstance(obj, type) and (
        issubclass(obj, RECIPES) or any(getattr(c, "__module__", "").startswith(_TE_MODULE) for c in obj.__mro__)
    ):
        raise TypeError(f"recipe must be a recipe instance, got the class {obj.__name__}: pass {obj.__name__}()")
    te_cls = _te_class(obj)
    if te_cls is None:
        raise TypeError(
            f"expected an FP8 recipe ({', '.join(_OURS)}; ours or Transformer Engine's; or "
            f"functional_dw's RowwiseScaling) or None, got {type(obj).__module__}."
            f"{type(obj).__qualname__}: {obj!r:.200}"
        )
    name = te_cls.__name__
    if name in _NOT_ON_HOPPER:
        raise ValueError(
            f"{name} is not supported: {_SUPPORTED}. MXFP8BlockScaling and "
            "NVFP4BlockScaling need compute capability 10.0 or higher (Blackwell)."
        )
    if name not in _OURS:
        what = "a custom recipe (quantizer factories)" if name == "CustomRecipe" else f"TE's {name}"
        raise ValueError(f"{what} is not supported: {_SUPPORTED}.")
    return _convert(_OURS[name], obj)


def _convert(cls: type, te: Any) -> Recipe:
    """Copy TE's recipe ``te`` into ``cls``, field by field; a field ``te`` lacks keeps our
    default (e.g. an older TE's checkpoint); attributes we do not know are ignored."""
    values = {}
    for f in dataclasses.fields(cls):
        value = getattr(te, f.name, dataclasses.MISSING)
        if value is dataclasses.MISSING:
            continue
        if f.name == "fp8_format":
            value = _format(value)
        elif f.name.startswith("fp8_quant_"):
            value = _params(QParams, value)
        elif f.name.startswith("fp8_gemm_"):
            value = _params(MMParams, value)
        values[f.name] = value
    return cls(**values)


def _format(value: Any) -> Any:
    if isinstance(value, Format):
        return value
    name = getattr(value, "name", None)  # TE's Format member
    return Format[name] if isinstance(name, str) and name in Format.__members__ else value


def _params(cls: type, value: Any) -> Any:
    if isinstance(value, cls):
        return value
    if _te_class(value) is None:
        return value  # the recipe's own check names the field
    return cls(**{f.name: getattr(value, f.name) for f in dataclasses.fields(cls) if hasattr(value, f.name)})
