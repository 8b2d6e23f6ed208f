"""Linear as a pure fwd/bwd pair: ``y = x W^T + b``.

Legend: ``T`` tokens (x's leading dims flattened), ``K`` in-features, ``N`` out-features.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import torch

from . import _amp, _checks, _fp8, _steps, distributed_weight as dwp
from .custom_vjp import custom_vjp
from ._checks import PLAIN_TYPES
from .plan import Options, PlanCache, eager_plain, options_key, route, tensor_key
from .kernels import Kernels, get_kernels, refuse_fp8_only
from .kernels.torch_ref import column_sums
from .residuals import needed, residuals, saved

__all__ = ["LinearResiduals", "linear", "linear_fwd", "linear_bwd", "linear_bwd_dgrad", "linear_bwd_wgrad"]


@residuals
class LinearResiduals:
    x: Any = saved()  # the input as given (see grouped_linear's NOTE: [Saved x]): all that is saved; with
    # FP8 its quantized columnwise copy ([T, K], what wgrad reads; x itself is not kept)
    x_version: _checks.Stamp  # x's version at forward: the pure API checks it in backward (None with FP8)
    weight: torch.Tensor  # the parameter itself (plain or DistributedWeight), by reference
    weight_version: tuple[int | None, ...]
    distributed: bool
    x_shape: tuple[int, ...]
    out_features: int
    has_bias: bool
    fuse_wgrad_accumulation: bool
    kernels: Kernels
    fp8: _fp8.Plan | None  # None without FP8; else how forward quantized (see grouped_linear's field)
    amp: torch.dtype | None  # under autocast, the dtype the weight is cast to where it is materialized
    # (NOTE: [Autocast] in ``_amp.py``); else None
    needs: Any = needed()  # which gradients bwd computes (None: all); see NOTE: [Which gradients]


def _wanted(res: LinearResiduals) -> tuple[bool, bool, bool]:
    """(dx, dW, dbias): the gradients backward computes."""
    if res.needs is None:
        return True, True, True
    return tuple(bool(n) for n in res.needs[:3])  # type: ignore[return-value]


@dataclasses.dataclass(frozen=True, eq=False)
class LinearPlan:
    """What a linear call decides from metadata (NOTE: [Plan once, run lean] in ``plan.py``),
    as grouped_linear's :class:`GroupedPlan`: made by :func:`make_plan`, cached per call
    signature, read by the run path."""

    kernels: Kernels
    distributed: bool  # the weight is a DistributedWeight (never cached: its materialized weight is data)
    out_features: int
    in_features: int
    fuse_wgrad_accumulation: bool
    fp8: _fp8.Plan | None  # None: no FP8
    amp: torch.dtype | None  # the autocast dtype the weight is cast to where it is materialized, or None


PLANS = PlanCache()  # linear's plans, by :func:`plan_key`


def make_plan(x: torch.Tensor, w_NK: torch.Tensor, distributed: bool, bias: Any, opts: Options) -> LinearPlan:
    """Every decision of a call that metadata settles: the checks, the kernels and (with a
    recipe) the FP8 plan. ``w_NK``: the materialized weight. (One GEMM per product: no path to
    choose.)"""
    _checks.tensor("weight (materialized)", w_NK, ndim=2)
    N, K = w_NK.shape
    if x.shape[-1] != K:
        what = " (as materialize_group_for_forward() of the DistributedWeight returned it)" if distributed else ""
        raise ValueError(f"x has {x.shape[-1]} features but weight is [{N}, {K}]{what}: x must be [..., {K}]")
    _checks.like("weight", w_NK, x)
    if bias is not None:
        _checks.tensor("bias", bias, ndim=1)
        _checks.shape("bias", bias, (N,))
        _checks.like("bias", bias, x)
    kernels = get_kernels(opts.backend, x)
    recipe, fp8_state = _fp8.unpack_args(opts.fp8)
    fp8_plan = None
    if recipe is not None or fp8_state is not None:
        fp8_plan = _fp8.plan(recipe, fp8_state, 1, x, kernels, grouped=False)
        kernels = fp8_plan.kernels  # (the family's: NOTE: [FP8 kernels by family])
    else:
        refuse_fp8_only(kernels)
    return LinearPlan(kernels, distributed, N, K, opts.fuse_wgrad_accumulation, fp8_plan, opts.amp)


def plan_key(x: Any, weight: Any, bias: Any, opts: Options) -> Any:
    """The cache key of a plain eager call (NOTE: [Plan once, run lean]): what :func:`make_plan`
    reads of each argument (x's features, dtype and device: its leading dims are data, its rank
    checked here) and every option (:func:`plan.options_key`). None: plan afresh."""
    if type(x) not in PLAIN_TYPES or x.is_nested or x.layout != torch.strided or not eager_plain():
        return None
    if not 1 <= x.dim() <= 8:  # (planned afresh: its check names what is wrong)
        return None
    wk = tensor_key(weight) if isinstance(weight, torch.Tensor) else None
    if wk is None or getattr(weight, "is_distributed_weight", False):
        return None
    bk = tensor_key(bias) if isinstance(bias, torch.Tensor) else None
    fk = _fp8.plan_key(opts.fp8)
    if (bias is not None and bk is None) or (opts.fp8 is not None and fk is None):
        return None
    return x.shape[-1], x.dtype, x.device, wk, bk, options_key(opts, fk)


class LinearCall(NamedTuple):
    """A checked call: its plan and what forward computes with."""

    plan: LinearPlan
    weight: torch.Tensor  # the parameter (plain or DistributedWeight), by reference
    w_NK: torch.Tensor  # the materialized weight the GEMM reads
    x: torch.Tensor  # dense
    bias: torch.Tensor | None
    kernels: Kernels  # the plan's, or the reference under a transform (NOTE: [Transforms without a rule])
    fp8: _fp8.Plan | None  # the plan's, bound to this call's state (NOTE: [The state is bound per call])


def prepare(x, weight, bias, opts: Options) -> LinearCall:
    """The call's plan (cached, as grouped_linear's: NOTE: [Plan once, run lean]), then what
    depends on data: the weight (gathered for a DistributedWeight, cast under autocast), x's
    tokens (FP8: a multiple of 8), x dense, the kernels routed on the operands."""
    key = plan_key(x, weight, bias, opts)
    plan = PLANS.get(key) if key is not None else None
    if plan is None:
        _checks.tensor("x", x, ndim=tuple(range(1, 9)))
        _checks.tensor("weight", weight, ndim=2)
        _checks.flag("fuse_wgrad_accumulation", opts.fuse_wgrad_accumulation)
        distributed = dwp.is_distributed_weight(weight)
        w_NK = dwp.materialize([weight], distributed, for_backward=False, like=x, name="weight", amp=opts.amp)[0]
        plan = make_plan(x, w_NK, distributed, bias, opts)
        if key is not None:
            PLANS.put(key, plan)
    elif plan.amp is not None:  # (a plain weight: cast as materialize casts it)
        w_NK = dwp.materialize([weight], False, for_backward=False, like=x, name="weight", amp=plan.amp)[0]
    else:
        w_NK = weight
    fp8 = None
    if plan.fp8 is not None:
        fp8 = plan.fp8.bind(opts.fp8.state)  # NOTE: [The state is bound per call]
        _fp8.check_dims(plan.in_features, plan.out_features, tokens=_tokens(x.shape))
    x = _checks.dense(x)
    return LinearCall(plan, weight, w_NK, x, bias, route(plan.kernels, False, x, w_NK)[0], fp8)


def fprop(c: LinearCall) -> torch.Tensor:
    """y of a checked call, no residuals."""
    if c.fp8 is not None:
        return _fprop_fp8(c, keep_x=False, keep_w=False)[0]
    K, N = c.x.shape[-1], c.w_NK.shape[0]
    return c.kernels.fprop(_checks.dense(c.x, (_tokens(c.x.shape), K)), c.w_NK, c.bias).view(*c.x.shape[:-1], N)


def _fprop_fp8(c: LinearCall, keep_x: bool, keep_w: bool) -> tuple[torch.Tensor, Any, _fp8.Plan]:
    """FP8 forward: x and the weight quantized, the FP8 GEMM; with ``keep_x``, also x's
    columnwise copy for wgrad; with ``keep_w``, the weight's for dgrad (on the plan). Returns
    (y, x's copy or None, the call's plan for backward)."""
    K, N = c.x.shape[-1], c.w_NK.shape[0]
    xq = c.fp8.quantize_x(c.kernels, _checks.dense(c.x, (_tokens(c.x.shape), K)), keep=keep_x)
    (wq,), plan = c.fp8.quantize_weights(c.kernels, [c.w_NK], keep=keep_w and not c.plan.distributed)
    y = c.kernels.fprop(xq, wq, c.bias, split_accumulator=plan.acc.fprop).view(*c.x.shape[:-1], N)
    return y, (xq.with_usage(rowwise=False, columnwise=True) if keep_x else None), plan


def linear_fwd(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    fuse_wgrad_accumulation: bool = False,
    backend: str | Kernels | None = None,
    recipe: Any = None,
    fp8_state: Any = None,
) -> tuple[torch.Tensor, LinearResiduals]:
    """``y = x @ W^T + b`` and the residuals its backward needs. x ``[..., K]``, weight ``[N, K]``;
    ``recipe``/``fp8_state`` as for :func:`linear`. In the dtypes given, also under
    ``torch.autocast`` (NOTE: [Autocast] in ``_amp.py``)."""
    fp8_args = None if recipe is None and fp8_state is None else _fp8.Args(recipe, fp8_state)
    with _amp.off(x):
        return forward(prepare(x, weight, bias, Options(fuse_wgrad_accumulation, None, backend, fp8_args)), x, True)


def forward(c: LinearCall, x: torch.Tensor, keep_x: bool):
    """y and the residuals of a checked call, which save ``x`` as given (NOTE: [Saved x]);
    ``keep_x`` False (FP8, a frozen weight): no FP8 copy of x is made or saved (wgrad, its only
    reader, never runs)."""
    if c.fp8 is None:
        y, x_saved, plan = fprop(c), x, None
    else:
        y, x_saved, plan = _fprop_fp8(c, keep_x=keep_x, keep_w=True)
    res = LinearResiduals(
        x=x_saved,
        x_version=_checks.stamp(x) if plan is None else None,
        weight=c.weight,
        weight_version=dwp.versions([c.weight]),
        distributed=c.plan.distributed,
        x_shape=tuple(c.x.shape),
        out_features=c.plan.out_features,
        has_bias=c.bias is not None,
        fuse_wgrad_accumulation=c.plan.fuse_wgrad_accumulation,
        kernels=c.kernels,
        fp8=plan,
        amp=c.plan.amp,
    )
    return y, res


def _check_res(res: Any, fn: str) -> LinearResiduals:
    _steps.check_record(fn, res, LinearResiduals, "linear_fwd", "x")
    return res


def _like(res: LinearResiduals) -> Any:
    """What has x's dtype and device: x, or with FP8 the plan (x is not kept)."""
    return res.x if res.fp8 is None else res.fp8


def _dy_TN(res: LinearResiduals, dy: torch.Tensor) -> torch.Tensor:
    _checks.cotangent("dy", dy, (*res.x_shape[:-1], res.out_features), _like(res))
    return _checks.dense(dy, (_tokens(dy.shape), dy.shape[-1]))


def _tokens(shape: tuple[int, ...]) -> int:
    return math.prod(shape[:-1])  # not view(-1, K): ambiguous when K == 0


def _x_TK(res: LinearResiduals) -> torch.Tensor:
    return _checks.dense(res.x, (_tokens(res.x_shape), res.x_shape[-1]))


def _checked(res: Any, dy: Any, fn: str) -> tuple[torch.Tensor, Kernels]:
    """The record, x's and the weight's versions and dy checked once; dy as ``[T, N]``, dense;
    and the kernels backward's products run on (NOTE: [Transforms without a rule])."""
    dy_TN = _dy_TN(_check_res(res, fn), dy)
    dwp.check_versions([res.weight], res.weight_version, "weight")
    return dy_TN, route(res.kernels, False, dy_TN, res.x, res.weight)[0]


def linear_bwd_dgrad(res: LinearResiduals, dy: torch.Tensor) -> torch.Tensor:
    """dx = dy @ W, with W materialized again (never kept from forward); None when x needs no
    gradient."""
    with _amp.off(dy):
        dy_TN, k = _checked(res, dy, "linear_bwd_dgrad")
        return _dgrad(res, dy_TN, _dy_fp8(res, dy_TN, k, dgrad=True, wgrad=False), k)


def linear_bwd_wgrad(res: LinearResiduals, dy: torch.Tensor) -> tuple[Any, torch.Tensor | None]:
    """(dweight, dbias); dweight is what autograd gets for the parameter (see finalize)."""
    with _amp.off(dy):
        dy_TN, k = _checked(res, dy, "linear_bwd_wgrad")
        return _wgrad(res, dy_TN, _dy_fp8(res, dy_TN, k, dgrad=False, wgrad=True), k)


def linear_bwd(res: LinearResiduals, dy: torch.Tensor) -> tuple[torch.Tensor, Any, torch.Tensor | None]:
    """(dx, dweight, dbias): :func:`linear_bwd_dgrad` then :func:`linear_bwd_wgrad`, on one
    checked (and densified) dy (with FP8, quantized once for both). With autocast off, as
    every pure function (NOTE: [Autocast] in ``_amp.py``)."""
    with _amp.off(dy):
        dy_TN, k = _checked(res, dy, "linear_bwd")
        dyq = _dy_fp8(res, dy_TN, k, dgrad=True, wgrad=True)
        return (_dgrad(res, dy_TN, dyq, k), *_wgrad(res, dy_TN, dyq, k))


def _frozen(res: LinearResiduals) -> bool:
    return _steps.frozen(_wanted(res)[1], res.fuse_wgrad_accumulation, [res.weight])


def _dy_fp8(res: LinearResiduals, dy_TN: torch.Tensor, k: Kernels, dgrad: bool, wgrad: bool) -> Any:
    return _steps.quantize_dy(
        res.fp8,
        "linear",
        dy_TN,
        [res.weight],
        k,
        dgrad=dgrad and _wanted(res)[0],
        wgrad=wgrad and not _frozen(res),
        saved=res.x,
    )


def _dgrad(res: LinearResiduals, dy_TN: torch.Tensor, dyq: Any, k: Kernels) -> torch.Tensor | None:
    want_dx, shape = _wanted(res)[0], (res.out_features, res.x_shape[-1])
    (w_NK,) = _steps.dgrad_weights([res.weight], res.distributed, _like(res), [shape], "weight", res.amp, want_dx)
    if not want_dx:
        return None
    if res.fp8 is not None:  # dy and the weight (quantized again) in FP8
        (wq,) = res.fp8.requantize_weights(k, [w_NK])
        return k.dgrad(dyq, wq, split_accumulator=res.fp8.acc.dgrad).view(res.x_shape)
    return k.dgrad(dy_TN, w_NK).view(res.x_shape)


def _wgrad(res: LinearResiduals, dy_TN: torch.Tensor, dyq: Any, k: Kernels) -> tuple[Any, torch.Tensor | None]:
    """(dweight, dbias): the wgrad GEMM through the epilogue both layers share
    (:func:`dwp.weight_grads`); the bias grad from the high-precision dy."""
    with_dbias = res.has_bias and _wanted(res)[2]
    db = None

    def gemm(out: list | None, accumulate: bool) -> list:
        nonlocal db
        out = None if out is None else out[0]
        if res.fp8 is not None:  # the saved FP8 x and dy
            return [k.wgrad(res.x, dyq, out=out, accumulate=accumulate, split_accumulator=res.fp8.acc.wgrad)[0]]
        dw, db = k.wgrad(_x_TK(res), dy_TN, out=out, accumulate=accumulate, with_dbias=with_dbias)
        return [dw]

    shape = (res.out_features, res.x_shape[-1])
    fused, frozen = res.fuse_wgrad_accumulation, _frozen(res)
    dw = dwp.weight_grads([res.weight], res.distributed, fused, [shape], frozen, dy_TN, gemm, "weight", res.amp)[0]
    return dw, _steps.bias_grad(db, with_dbias, dy_TN, column_sums)


def _bwd(res: LinearResiduals, dy: torch.Tensor) -> tuple:
    """Cotangents of (x, weight, bias); the options are nondiff (NOTE: [nondiff_argnums])."""
    dx, dw, db = linear_bwd(res, dy)
    if res.fp8 is not None:  # (db sums the unquantized dy: differentiable as it is)
        dx, dw = _steps.refused_later("linear", _fp8.NOT_TWICE, (dx, dw), (dy, res.weight, res.x))
    return dx, dw, db


def _fwd(x, weight, bias, opts: Options):  # positional form for custom_vjp
    return forward(prepare(x, weight, bias, opts), x, keep_x=opts.fp8 is None or opts.fp8.keep_x)


def _primal(x, weight, bias, opts: Options) -> torch.Tensor:
    """Forward alone, when no gradient can be taken: checks and the GEMM, no residuals."""
    return fprop(prepare(x, weight, bias, opts))


def _jvp(res: LinearResiduals, tangents: tuple) -> torch.Tensor:
    """Forward mode: the layer is bilinear, so ``dy = dx W^T + x dW^T + db``."""
    _fp8.no_jvp(res.fp8, "linear")
    tx, tw, tb = tangents[:3]
    if tw is not None and res.distributed:
        raise ValueError(
            "forward-mode (jvp) tangents for a DistributedWeight are not supported: "
            "take the tangent with respect to x or bias, or use a plain weight"
        )
    if tw is not None and res.amp is not None:  # cast as forward cast the weight
        tw = _amp.cast(tw, res.amp)
    K, N = res.x_shape[-1], res.out_features
    k = route(res.kernels, False, *(t for t in (tx, tw, tb) if t is not None))[0]
    dy = None
    if tx is not None or tb is not None:
        w_NK = dwp.materialize([res.weight], res.distributed, for_backward=False, amp=res.amp)[0]
        T = _tokens(res.x_shape)
        tx_TK = _checks.dense(tx, (T, K)) if tx is not None else res.x.new_zeros(T, K)
        dy = k.fprop(tx_TK, w_NK, tb)
    if tw is not None:
        part = k.fprop(_x_TK(res), tw, None)
        dy = part if dy is None else dy + part
    if dy is None:
        return res.x.new_zeros(*res.x_shape[:-1], N)
    return dy.view(*res.x_shape[:-1], -1)


def _vmap(batch_size: int, in_dims: tuple, x, weight, bias, opts: Options):
    """A batch of x with shared weights is just more leading dims: one GEMM for the batch (not
    with FP8: a folded call would take x's amax over the whole batch, not per element)."""
    if in_dims[0] is None or in_dims[1] is not None or in_dims[2] is not None or opts.fp8 is not None:
        return None  # batched weights or bias (an ensemble), or FP8: one call per element
    return (x.movedim(in_dims[0], 0), weight, bias, opts), lambda y: (y, 0)


_linear = custom_vjp(_fwd, _bwd, nondiff_argnums=(3,), primal=_primal, jvp=_jvp, vmap=_vmap, name="linear")
_linear_eager = torch.compiler.disable(_linear, reason=dwp.NO_COMPILE)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    fuse_wgrad_accumulation: bool = False,
    backend: str | Kernels | None = None,
    recipe: Any = None,
    fp8_state: Any = None,
) -> torch.Tensor:
    """Differentiable ``y = x @ weight^T + bias`` (TE ``Linear`` semantics).

    ``weight`` may be a DistributedWeight: it is materialized for forward and again for
    backward, and its grads go through ``finalize_group_grads``. Saved-tensor hooks see only
    ``x``. ``fuse_wgrad_accumulation`` accumulates dW into ``weight.main_grad``.

    ``recipe`` (None: no FP8) is an FP8 recipe, ``functional_dw.fp8``'s or TE's
    (``DelayedScaling``, ``Float8CurrentScaling``, ``Float8BlockScaling``): x, the weight and dy
    are quantized and the three GEMMs run in FP8 (emulated on the reference backend); only x's
    FP8 copy is saved. K and N must be multiples of 16, the tokens of 8. ``fp8_state``:
    ``DelayedScaling``'s state (``fp8.init_state(recipe, num_gemms=1, device=...)``), whose scales
    forward and backward read and whose amax histories they record into; the caller updates it
    between steps (``fp8.update_state_(state, recipe)``).

    Under ``torch.autocast`` it computes what ``F.linear`` computes under it: x, the weight and
    the bias in the autocast dtype, the grads in their inputs' dtypes (NOTE: [Autocast] in
    ``_amp.py``).
    """
    fp8_args = None
    if recipe is not None or fp8_state is not None:
        _fp8.refuse_compile()
        fp8_args = _fp8.Args(recipe, fp8_state, keep_x=_fp8.wgrad_possible(weight))
    opts = Options(_checks.fuse_flag(fuse_wgrad_accumulation), None, backend, fp8_args, _amp.dtype(x))
    run = _linear
    if torch.compiler.is_compiling() and dwp.any_distributed([weight]):  # NOTE: [DistributedWeight under torch.compile]
        run = _linear_eager
    if opts.amp is None:
        return run(x, weight, bias, opts)
    with _amp.off(x):  # NOTE: [Autocast] in _amp.py: x and bias cast here, the weight where it is materialized
        return run(_amp.cast(x, opts.amp), weight, _amp.cast(bias, opts.amp), opts)
