"""GroupedLinear as a pure fwd/bwd pair: expert ``e`` computes ``y_e = x_e W_e^T + b_e`` on
its own rows of ``x``.

Legend: ``T`` tokens, ``K`` in-features, ``N`` out-features, ``E`` experts.
``splits_E`` token counts per expert (rows of x in expert order).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.utils._pytree as pytree

from . import _amp, _checks, _fp8, _steps, distributed_weight as dwp
from ._bridge_planned import run_planned
from .custom_vjp import custom_vjp
from .grouped_plan import PLANS, GroupedPlan, HostSplits, SplitsArg, WeightsArg, as_params, make_plan
from .grouped_plan import as_splits, normalize_args, plan_key
from .kernels import Kernels, Splits, as_one_buffer, check_sizes, packed as packed_view, stacked
from .plan import Options, route, wgrad_grouped
from .kernels.torch_ref import expert_sums
from .residuals import any_needed, needed, residuals, saved

__all__ = [
    "GroupedLinearResiduals",
    "grouped_linear",
    "grouped_linear_fwd",
    "grouped_linear_bwd",
    "grouped_linear_bwd_dgrad",
    "grouped_linear_bwd_wgrad",
]

# NOTE: [The layer's seam] Besides the pure pair, the layer's steps are public names that its
# own bridge (``_fwd``, ``_primal``, the jvp rule) and ``grouped_mlp`` (fc1 and fc2) both run:
# :func:`prepare` (a checked call, :class:`GroupedCall`, from x or from a stand-in with x's
# shape), :func:`fprop` and :func:`forward` (from x, or from x's ready FP8 copies), and for
# backward :func:`check_dy`, :func:`quantize_dy_rows` (dy's FP8 copies read through an index),
# :func:`saved_x`, :func:`one_buffer` and the jvp rule :func:`jvp`.
# The per-call-signature plan lives in ``grouped_plan.py``. Nothing else of this module is
# read from outside it.

_REQUIRES_GRAD = operator.attrgetter("requires_grad")


@residuals
class GroupedLinearResiduals:
    x_TK: Any = saved()  # all that is saved for backward: x as given (NOTE: [Saved x]); with FP8, its
    # quantized columnwise copy per expert (what wgrad reads; x itself is not kept)
    x_version: _checks.Stamp  # x_TK's version at forward: the pure API checks it in backward (None with FP8)
    weights: tuple[torch.Tensor, ...]  # the parameters by reference: E x [N, K], or one [E, N, K]
    weight_version: tuple[int, ...]
    splits: Splits
    path: str  # forward's GEMM path: "split" (per-expert GEMMs) or "grouped" (one kernel per product)
    kernels: (
        Kernels  # forward's kernels (the plan's, or the reference under a transform: NOTE: [Transforms without a rule])
    )
    plan: GroupedPlan  # the call's decisions (kernels, layout, options): by reference, shared by every call alike
    fp8: _fp8.Plan | None  # None without FP8; else how forward quantized (recipe, specs, the state by
    # reference, forward's scales): backward quantizes dy and the weights by it
    needs: Any = needed()  # which gradients bwd computes (None: all); see NOTE: [Which gradients]

    # the plan's fields a backward reads, by their old names
    stacked = property(lambda self: self.plan.stacked)  # weights is one [E, N, K] tensor
    distributed = property(lambda self: self.plan.distributed)  # weights[0] is a DistributedWeight leader
    weight_shapes = property(lambda self: self.plan.shapes)  # of the materialized weights, checked in backward
    bias = property(lambda self: self.plan.bias_form)  # None, "list" (E x [N]) or "stacked" ([E, N])
    out_features = property(lambda self: self.plan.out_features)
    fuse_wgrad_accumulation = property(lambda self: self.plan.fuse_wgrad_accumulation)


def _wanted(res: GroupedLinearResiduals) -> tuple[bool, bool, bool]:
    """(dx, any dW, dbias): the gradients backward computes."""
    if res.needs is None:
        return True, True, True
    x, w, _, b = res.needs[:4]
    return bool(x), any_needed(w), any_needed(b)


def one_buffer(ws: Sequence[torch.Tensor], plan: GroupedPlan) -> WeightsArg:
    """Backward's weights as one ``[E, N, K]`` view where forward found them one buffer (NOTE:
    [One buffer]) and they still are, else unchanged. Checked again (:func:`packed`, C loops
    over E): rebinding an expert's ``.data`` between forward and backward changes no version
    counter, and a view built on the plan's word would read past the rebound expert."""
    if not plan.packed:
        return ws
    one = packed_view(ws)
    return ws if one is None else one


class GroupedCall(NamedTuple):
    """A checked call (NOTE: [The layer's seam]): its plan and what forward computes with."""

    plan: GroupedPlan
    params: tuple[torch.Tensor, ...]
    w_ENK: WeightsArg  # the materialized weights the GEMMs read (one [E, N, K] view when packed)
    split: Splits
    b_EN: torch.Tensor | None
    x_TK: torch.Tensor | None  # x, dense; None for a call prepared from a stand-in (fprop/forward take x)
    kernels: Kernels  # the plan's, or the reference under a transform (NOTE: [Transforms without a rule])
    path: str  # the plan's; split where the FP8 recipe cannot quantize these counts grouped, or routed so
    fp8: _fp8.Plan | None


def prepare(
    x, weights, splits, bias, opts: Options, stand_in: bool = False, cached: GroupedPlan | None = None
) -> GroupedCall:
    """The call's plan (cached: NOTE: [Plan once, run lean]), then what depends on data: the
    weights (gathered for a DistributedWeight), the split counts, the bias operand.
    ``stand_in``: x has the shape, dtype and device of the input but not its values (grouped_mlp's
    fc2 before h exists): the call holds no input; :func:`fprop`/:func:`forward` are given it (or
    its FP8 copy). ``cached``: the plan the cache holds for this call's key, already looked up."""
    key = True if cached is not None else plan_key(x, weights, splits, bias, opts)
    plan = cached if cached is not None else PLANS.get(key) if key is not None else None
    if plan is None:
        _checks.tensor("x", x, ndim=2)
        params, one_tensor = as_params(weights)
        distributed = dwp.is_distributed_weight(params[0])
        full = dwp.materialize(params, distributed, for_backward=False, like=x, amp=opts.amp)
        w_ENK = full[0] if one_tensor else full
        plan = make_plan(x, w_ENK, one_tensor, distributed, bias, opts)
        if key is not None:
            PLANS.put(key, plan)
    else:
        params = (weights,) if plan.stacked else tuple(weights)
        w_ENK = weights if plan.stacked else list(params)  # (a list, as materialize gives: the kernels see one form)
        if plan.amp is not None:  # (plain weights: cast as materialize casts them)
            w_ENK = dwp.materialize(params, False, for_backward=False, amp=plan.amp)
            w_ENK = w_ENK[0] if plan.stacked else w_ENK
    plan = plan.for_tokens(x.shape[0])  # (FP8 where it pays: data, per call)
    if plan.warn is not None:
        _checks.warn(plan.warn)
    w_ENK = _weights_view(plan, params, w_ENK, cached=key is not None)
    split = as_splits(splits, plan.num_experts, x)
    b_EN = None if bias is None else (bias if plan.bias_form == "stacked" else stacked(bias))
    path = _path_for_counts(plan, split, x.shape[0], opts)
    x_TK = None if stand_in else _checks.dense(x)
    kernels, grouped = route(
        plan.kernels, path == "grouped", x if stand_in else x_TK, w_ENK, one_path=_one_path(plan.fp8)
    )
    fp8 = None if plan.fp8 is None else plan.fp8.bind(opts.fp8.state)  # NOTE: [The state is bound per call]
    return GroupedCall(plan, params, w_ENK, split, b_EN, x_TK, kernels, "grouped" if grouped else "split", fp8)


def _weights_view(plan: GroupedPlan, params: tuple, w_ENK: WeightsArg, cached: bool) -> WeightsArg:
    """The weights the GEMMs read: one ``[E, N, K]`` view where the plan found one buffer (NOTE:
    [One buffer]), unless autograd would have to record it."""
    if not plan.packed:
        return w_ENK
    if not cached or plan.amp is not None:  # (cast weights are a buffer of this call's: found again)
        one = packed_view(w_ENK)
        return w_ENK if one is None else one
    if not (torch.is_grad_enabled() and any(map(_REQUIRES_GRAD, params))):
        return as_one_buffer(params)
    return w_ENK


def _path_for_counts(plan: GroupedPlan, split: Splits, T: int, opts: Options) -> str:
    """The plan's path, checked against the split counts (data): the split path's host sizes;
    with FP8, split where the recipe cannot quantize these counts grouped, and the counts'
    multiples (device-only counts: not checked, a sync)."""
    path = plan.path
    if path == "split" and split.host is None and not torch.compiler.is_compiling():
        check_sizes(split.sizes(), T)  # the split path syncs for host sizes anyway
    if plan.fp8 is not None:
        if path == "grouped" and not torch.compiler.is_compiling():
            why_not = plan.fp8.grouped_problem(split)  # data: the counts
            if why_not is not None:
                if opts.use_grouped_tensor:
                    _checks.warn(f"grouped_linear: use_grouped_tensor=True but {why_not}; running the split path")
                path = "split"
        known = split.host if split.host is not None or path == "grouped" else split.sizes()
        plan.fp8.check_counts(*plan.shapes[0][-2:][::-1], known)
    return path


def _input(c: GroupedCall, x: torch.Tensor | None) -> torch.Tensor | None:
    """The dense input the GEMMs read: the call's, or (prepared from a stand-in) x. The seam does
    not check that x is the call's (or, from a stand-in, of its shape, dtype and device): its
    callers pass what they prepared (NOTE: [The layer's seam])."""
    return c.x_TK if c.x_TK is not None or x is None else _checks.dense(x)


def fprop(c: GroupedCall, x: torch.Tensor | None = None, xq: Any = None) -> torch.Tensor:
    """y of a checked call, no residuals. ``x``: the input, for a call prepared from a
    stand-in; ``xq``: with FP8, x already quantized (grouped_mlp's fused h)."""
    if c.fp8 is not None:
        return _fprop_fp8(c, _input(c, x), keep_x=False, keep_w=False, xq=xq)[0]
    return c.kernels.grouped_fprop(_input(c, x), c.w_ENK, c.b_EN, c.split, c.path == "grouped")


def _fprop_fp8(
    c: GroupedCall, x_TK: torch.Tensor | None, keep_x: bool, keep_w: bool, xq: Any = None
) -> tuple[torch.Tensor, Any, _fp8.Plan]:
    """FP8 forward: x per expert and each weight quantized, the FP8 grouped GEMM; with
    ``keep_x``, also x's columnwise copy for wgrad; with ``keep_w``, the weights' for dgrad (on
    the plan). ``xq``: x already quantized so. Returns (y, x's copy or None, the call's plan for
    backward)."""
    grouped, kernels, distributed = c.path == "grouped", c.kernels, c.plan.distributed
    if xq is None:
        xq = c.fp8.quantize_x(kernels, x_TK, c.split, grouped, keep=keep_x)
    wq, plan = c.fp8.quantize_weights(
        kernels, c.w_ENK, keep=keep_w and not distributed, params=None if distributed else c.params
    )
    y = kernels.grouped_fprop(xq, wq, c.b_EN, c.split, grouped, split_accumulator=plan.acc.fprop)
    return y, (_fp8.with_usage(xq, rowwise=False, columnwise=True) if keep_x else None), plan


def grouped_linear_fwd(
    x: torch.Tensor,
    weights: WeightsArg,
    splits: SplitsArg,
    bias: Any = None,
    *,
    fuse_wgrad_accumulation: bool = False,
    use_grouped_tensor: bool | None = None,
    backend: str | Kernels | None = None,
    recipe: Any = None,
    fp8_state: Any = None,
) -> tuple[torch.Tensor, GroupedLinearResiduals]:
    """``y`` ``[T, N]`` and the residuals. x ``[T, K]``; weights E ``[N, K]`` or ``[E, N, K]``;
    ``recipe``/``fp8_state`` as for :func:`grouped_linear`."""
    weights, splits, bias = normalize_args(weights, splits, bias)
    fp8_args = None if recipe is None and fp8_state is None else _fp8.Args(recipe, fp8_state)
    opts = Options(fuse_wgrad_accumulation, use_grouped_tensor, backend, fp8_args)
    with _amp.off(x):  # (in the dtypes given: NOTE: [Autocast] in _amp.py)
        return forward(prepare(x, weights, splits, bias, opts), x, keep_x=True)


def forward(c: GroupedCall, x: torch.Tensor | None, keep_x: bool, xq: Any = None):
    """y and the residuals of a checked call, which save ``x`` as given (NOTE: [Saved x]; the
    GEMMs read the call's dense x, or x where the call was prepared from a stand-in).
    ``keep_x`` False (FP8, every weight frozen): no FP8 copy of x is made or saved (wgrad, its
    only reader, never runs). ``xq``: with FP8, x already quantized (both copies with
    ``keep_x``; x itself may then be None)."""
    if c.fp8 is None:
        y, x_saved, plan = fprop(c, x), x, None
    else:
        y, x_saved, plan = _fprop_fp8(c, _input(c, x), keep_x=keep_x, keep_w=True, xq=xq)
    res = GroupedLinearResiduals(
        x_TK=x_saved,
        x_version=_checks.stamp(x) if plan is None else None,
        weights=c.params,
        weight_version=dwp.versions(c.params),
        splits=c.split,
        path=c.path,
        kernels=c.kernels,
        plan=c.plan,
        fp8=plan,
    )
    return y, res


def _check_res(res: Any, fn: str) -> GroupedLinearResiduals:
    _steps.check_record(fn, res, GroupedLinearResiduals, "grouped_linear_fwd", "x_TK")
    return res


def _like(res: GroupedLinearResiduals) -> Any:
    """What has x's dtype and device: x, or with FP8 the plan (x is not kept)."""
    return res.x_TK if res.fp8 is None else res.fp8


def check_dy(
    res: GroupedLinearResiduals, dy: torch.Tensor, num_tokens: int | None = None, dense: bool = True
) -> torch.Tensor:
    """dy checked against the record (``[T, N]``, x's dtype and device; ``num_tokens`` rows where
    given, else the record's T), dense unless ``dense`` is False (a stand-in: never densified)."""
    T = res.splits.num_tokens if num_tokens is None else num_tokens
    dy = _checks.cotangent("dy", dy, (T, res.out_features), _like(res))
    return _checks.dense(dy) if dense else dy


# NOTE: [Saved x] The residuals keep x as the caller gave it, not forward's dense copy:
# a copy made inside the autograd Function has no graph link to x, so a second-order
# gradient through wgrad (create_graph=True, jacrev of jacrev) would silently lose its x
# term. Backward makes it dense again (also after an unpack hook that changed strides);
# for a contiguous x (the usual case) both are no-ops.
def saved_x(res: GroupedLinearResiduals) -> torch.Tensor:
    """The saved x, dense."""
    return _checks.dense(res.x_TK)


class _Route(NamedTuple):
    """The kernels and path backward's products run (NOTE: [Transforms without a rule])."""

    kernels: Kernels
    grouped: bool


def _checked(res: Any, dy: Any, fn: str, dense: bool = True) -> tuple[torch.Tensor, _Route]:
    """The record, x's and the weights' versions and dy checked once; dy as ``[T, N]``, dense
    (unless ``dense`` is False: a stand-in beside an FP8 copy); and where backward's products run."""
    dy_TN = check_dy(_check_res(res, fn), dy, dense=dense)
    dwp.check_versions(res.weights, res.weight_version, "weights")
    return dy_TN, _Route(
        *route(res.kernels, res.path == "grouped", dy_TN, res.x_TK, res.weights, one_path=_one_path(res.fp8))
    )


def _one_path(p: _fp8.Plan | None) -> bool:
    """Whether the products have one path (the family's ``one_path``: RowwiseScaling's grouped GEMM)."""
    return p is not None and p.one_path


def grouped_linear_bwd_dgrad(res: GroupedLinearResiduals, dy: torch.Tensor) -> torch.Tensor:
    """dx ``[T, K]``, with the weights materialized again (never kept from forward); None when
    x needs no gradient (a DistributedWeight is still gathered: its collectives match across ranks)."""
    with _amp.off(dy):
        dy_TN, k = _checked(res, dy, "grouped_linear_bwd_dgrad")
        return _dgrad(res, dy_TN, _dy_fp8(res, dy_TN, k, dgrad=True, wgrad=False), k)


def grouped_linear_bwd_wgrad(res: GroupedLinearResiduals, dy: torch.Tensor) -> tuple[Any, Any]:
    """(dweights, dbiases) shaped like the weights and bias arguments (see finalize)."""
    with _amp.off(dy):
        dy_TN, k = _checked(res, dy, "grouped_linear_bwd_wgrad")
        return _wgrad(res, dy_TN, _dy_fp8(res, dy_TN, k, dgrad=False, wgrad=True), k)


def grouped_linear_bwd(res: GroupedLinearResiduals, dy: torch.Tensor, dyq: Any = None) -> tuple[torch.Tensor, Any, Any]:
    """(dx, dweights, dbiases): dgrad then wgrad, on one checked (and densified) dy (with FP8,
    quantized once for both). With autocast off, as every pure function (NOTE: [Autocast] in
    ``_amp.py``). ``dyq``: with FP8, dy already quantized (:func:`quantize_dy_rows`; dy itself
    may then be a stand-in of its shape, read only for dtype and device)."""
    with _amp.off(dy):
        dy_TN, k = _checked(res, dy, "grouped_linear_bwd", dense=dyq is None)
        if dyq is None:
            dyq = _dy_fp8(res, dy_TN, k, dgrad=True, wgrad=True)
        return (_dgrad(res, dy_TN, dyq, k), *_wgrad(res, dy_TN, dyq, k))


def quantize_dy_rows(res: GroupedLinearResiduals, dy: torch.Tensor, rows: torch.Tensor) -> Any:
    """``dy[rows]`` quantized for the GEMMs :func:`grouped_linear_bwd` runs on ``res`` (its
    ``dyq``), read through the index where the plan can (``Plan.quantize_rows``: the gathered
    rows are never written); None without FP8, without GEMMs to feed, or where the plan cannot
    (then the caller gathers ``dy[rows]``). A backward that would be differentiated is refused
    first, as :func:`grouped_linear_bwd` refuses it."""
    dgrad, wgrad = bool(_wanted(res)[0]), not _frozen(res)
    if res.fp8 is None or not (dgrad or wgrad) or (res.bias is not None and _wanted(res)[2]):
        return None  # (a bias grad sums dy's rows in high precision: they are gathered)
    _fp8.check_first_order("grouped_linear", dy, res.weights, res.x_TK)
    return res.fp8.quantize_rows(
        res.kernels, res.fp8.dy, dy, rows, res.splits, res.path == "grouped", rowwise=dgrad, columnwise=wgrad
    )


def _frozen(res: GroupedLinearResiduals) -> bool:
    return _steps.frozen(_wanted(res)[1], res.fuse_wgrad_accumulation, res.weights)


def _dy_fp8(res: GroupedLinearResiduals, dy_TN: torch.Tensor, k: _Route, dgrad: bool, wgrad: bool) -> Any:
    return _steps.quantize_dy(
        res.fp8,
        "grouped_linear",
        dy_TN,
        res.weights,
        k.kernels,
        splits=res.splits,
        grouped=k.grouped,
        dgrad=dgrad and _wanted(res)[0],
        wgrad=wgrad and not _frozen(res),
        saved=res.x_TK,
    )


def _dgrad(res: GroupedLinearResiduals, dy_TN: torch.Tensor, dyq: Any, k: _Route) -> torch.Tensor | None:
    full = _steps.dgrad_weights(
        res.weights, res.distributed, _like(res), res.weight_shapes, "weights", res.plan.amp, _wanted(res)[0]
    )
    if not _wanted(res)[0]:
        return None
    w_ENK = full[0] if res.stacked else one_buffer(full, res.plan)
    if res.fp8 is not None:  # dy and the weights (quantized again) in FP8
        wq = res.fp8.requantize_weights(k.kernels, w_ENK)
        return k.kernels.grouped_dgrad(dyq, wq, res.splits, k.grouped, split_accumulator=res.fp8.acc.dgrad)
    return k.kernels.grouped_dgrad(dy_TN, w_ENK, res.splits, k.grouped)


def _wgrad(res: GroupedLinearResiduals, dy_TN: torch.Tensor, dyq: Any, k: _Route) -> tuple[Any, Any]:
    """(dweights, dbiases): the wgrad GEMM (one [E, N, K] product, or per expert) through the
    epilogue both layers share (:func:`dwp.weight_grads`); the bias grad from the high-precision dy."""
    with_dbias = res.bias is not None and _wanted(res)[2]
    db_EN = None

    def gemm(out: list | None, accumulate: bool) -> list:
        nonlocal db_EN
        out = None if out is None else out[0] if res.stacked else out
        grouped = k.grouped and wgrad_grouped(k.kernels, dy_TN, out)
        if res.fp8 is not None:  # the saved FP8 x and dy
            dw = k.kernels.grouped_wgrad(
                res.x_TK, dyq, res.splits, grouped, out=out, accumulate=accumulate, split_accumulator=res.fp8.acc.wgrad
            )[0]
        else:
            dw, db_EN = k.kernels.grouped_wgrad(
                saved_x(res), dy_TN, res.splits, grouped, out=out, accumulate=accumulate, with_dbias=with_dbias
            )
        return [dw] if res.stacked else list(dw)

    wgrads = dwp.weight_grads(
        res.weights,
        res.distributed,
        res.fuse_wgrad_accumulation,
        res.weight_shapes,
        _frozen(res),
        dy_TN,
        gemm,
        "weights",
        res.plan.amp,
    )
    db_EN = _steps.bias_grad(db_EN, with_dbias, dy_TN, lambda dy: expert_sums(dy, res.splits))
    return (wgrads[0] if res.stacked else wgrads), _bias_grads(res, db_EN)


def _bias_grads(res: GroupedLinearResiduals, db_EN: torch.Tensor | None) -> Any:
    if res.bias == "list":
        return list(db_EN.unbind(0)) if db_EN is not None else [None] * res.splits.num_experts
    return db_EN


def _fwd(x, weights, splits, bias, opts: Options):
    c = prepare(x, weights, splits, bias, opts)
    return forward(c, x, keep_x=opts.fp8 is None or opts.fp8.keep_x)


def _primal(x, weights, splits, bias, opts: Options) -> torch.Tensor:
    """Forward alone, when no gradient can be taken: checks and GEMMs, no residuals."""
    return fprop(prepare(x, weights, splits, bias, opts))


def _bwd(res: GroupedLinearResiduals, dy: torch.Tensor) -> tuple:
    """Cotangents of (x, weights, splits, bias); the options are nondiff (NOTE: [nondiff_argnums])."""
    dx, dweights, dbias = grouped_linear_bwd(res, dy)
    if res.fp8 is not None:  # (dbias sums the unquantized dy: differentiable as it is)
        sources = (dy, *res.weights, res.x_TK)
        dx, dweights = _steps.refused_later("grouped_linear", _fp8.NOT_TWICE, (dx, dweights), sources)
    return dx, dweights, None, dbias


def jvp(res: GroupedLinearResiduals, tangents: tuple) -> torch.Tensor:
    """The jvp rule (the bridge's, and grouped_mlp's for fc1 and fc2): forward mode, per expert
    ``dy_e = dx_e W_e^T + x_e dW_e^T + db_e``."""
    _fp8.no_jvp(res.fp8, "grouped_linear")
    tx, tw, _, tb = tangents[:4]
    kernels, grouped = route(res.kernels, res.path == "grouped", tx, tw, tb, res.x_TK)
    if isinstance(tw, (list, tuple)) and all(t is None for t in tw):
        tw = None
    if tw is not None and res.distributed:
        raise ValueError(
            "forward-mode (jvp) tangents for a DistributedWeight are not supported: "
            "take the tangent with respect to x or bias, or use plain weights"
        )
    b_EN = None
    if tb is not None:
        zeros = res.x_TK.new_zeros(res.out_features)
        b_EN = tb if isinstance(tb, torch.Tensor) else torch.stack([zeros if b is None else b for b in tb])
    dy = res.x_TK.new_zeros(res.x_TK.shape[0], res.out_features)
    if tx is not None or b_EN is not None:  # dx W^T + db, with the weights gathered (and cast) again
        full = dwp.materialize(res.weights, res.distributed, for_backward=False, amp=res.plan.amp)
        tx = _checks.dense(tx) if tx is not None else res.x_TK.new_zeros(res.x_TK.shape)
        dy = kernels.grouped_fprop(tx, full[0] if res.stacked else full, b_EN, res.splits, grouped)
    if tw is not None:  # + x dW^T
        if not isinstance(tw, torch.Tensor):
            tw = [torch.zeros_like(w) if t is None else t for t, w in zip(tw, res.weights)]
        tw = _checks.dense(tw) if isinstance(tw, torch.Tensor) else [_checks.dense(t) for t in tw]
        if res.plan.amp is not None:  # as forward cast the weights
            tw = _amp.cast(tw, res.plan.amp)
        dy = dy + kernels.grouped_fprop(saved_x(res), tw, None, res.splits, grouped)
    return dy


def _vmap(batch_size: int, in_dims: tuple, x, weights, splits, bias, opts: Options):
    """Fold a batch of x (shared weights, host splits) into the token dimension: sort the B*T
    rows by (expert, batch), run one grouped GEMM with splits*B, and unsort the output. Not with
    FP8: a folded call would take each expert's amax over the whole batch, not per element."""
    x_dim, *rest = pytree.tree_leaves(in_dims[:4], is_leaf=lambda d: d is None)
    if x_dim is None or any(d is not None for d in rest) or not isinstance(splits, tuple) or opts.fp8 is not None:
        return None  # batched weights/bias/splits, device splits, or FP8: one call per element
    xb = x.movedim(x_dim, 0)
    B, T, K = xb.shape
    E = len(splits)
    expert_T = torch.repeat_interleave(
        torch.arange(E, device=x.device), torch.tensor(splits, device=x.device), output_size=T
    )
    keys_BT = expert_T[None, :] * B + torch.arange(B, device=x.device)[:, None]
    order = torch.argsort(keys_BT.flatten(), stable=True)
    new_args = (xb.reshape(B * T, K)[order], weights, HostSplits(s * B for s in splits), bias, opts)
    return new_args, lambda y: (y[torch.argsort(order)].view(B, T, -1), 0)


# NOTE: [The layer's planned run] A plain eager call whose plan is cached, in the arguments'
# own dtypes (no autocast) and without FP8, runs as one planned node (NOTE: [The plan's
# runner] in ``_bridge_planned.py``): this pair's ``forward`` on the cached plan, and in backward
# ``_dgrad``/``_wgrad`` less what the plan and autograd have already checked: the record is
# the one forward made, and dy comes from autograd, which has matched it to y's shape, dtype
# and device. Still checked per call: the weights' versions (x's is autograd's), dy (a sparse
# grad is refused, as everywhere), and where the products run (:func:`route`).
def _planned(x, weights, splits, bias, opts: Options) -> torch.Tensor | None:
    """y from the planned run, or None where the call takes the bridge (NOTE: [The layer's planned run])."""
    key = plan_key(x, weights, splits, bias, opts)
    plan = PLANS.get(key) if key is not None else None
    if plan is None:
        return None

    def fwd(x, weights, splits, bias):
        return forward(prepare(x, weights, splits, bias, opts, cached=plan), x, keep_x=True)

    return run_planned("grouped_linear", fwd, _planned_bwd, (x, weights, None, bias), static=((2, splits),))


def _planned_bwd(res: GroupedLinearResiduals, dy: torch.Tensor) -> tuple:
    """The cotangents of (x, weights, splits, bias) for a planned node's record (NOTE: [The
    layer's planned run])."""
    with _amp.off(dy):
        dy_TN = check_dy(res, dy)  # (autograd matched its shape, dtype and device, not its layout)
        dwp.check_versions(res.weights, res.weight_version, "weights")
        k = _Route(*route(res.kernels, res.path == "grouped", dy_TN, res.x_TK))
        dx, (dw, db) = _dgrad(res, dy_TN, None, k), _wgrad(res, dy_TN, None, k)
    return dx, dw, None, db


_grouped_linear = custom_vjp(
    _fwd, _bwd, nondiff_argnums=(4,), primal=_primal, jvp=jvp, vmap=_vmap, name="grouped_linear"
)
_grouped_linear_eager = torch.compiler.disable(_grouped_linear, reason=dwp.NO_COMPILE)


def grouped_linear(
    x: torch.Tensor,
    weights: WeightsArg,
    splits: SplitsArg,
    bias: Any = None,
    *,
    fuse_wgrad_accumulation: bool = False,
    use_grouped_tensor: bool | None = None,
    backend: str | Kernels | None = None,
    recipe: Any = None,
    fp8_state: Any = None,
) -> torch.Tensor:
    """Differentiable GroupedLinear (TE ``GroupedLinear`` semantics).

    Args:
        x: ``[T, K]`` tokens, sorted by expert.
        weights: E ``[N, K]`` tensors (``weights[0]`` may be a DistributedWeight leader of the
            group) or one ``[E, N, K]`` tensor. Where a kernel needs the group as one ``[E, N, K]``
            operand (torch's grouped GEMM, TE's beyond 64 experts), E tensors that are
            consecutive slices of one buffer (``nn.GroupedLinear``'s parameters, ``list(w_ENK)``)
            are read in place; separately made tensors are copied into one (``torch.stack``),
            once per forward and once per backward. Weight grads come as views of one
            ``[E, N, K]`` buffer.
        splits: E non-negative token counts summing to T: a list/tuple of ints or a 1-D
            integer tensor on any device (a CUDA tensor never syncs on the grouped path).
        bias: None, E ``[N]`` tensors (slices of one buffer are read in place, others stacked),
            or one ``[E, N]`` tensor.
        fuse_wgrad_accumulation: accumulate weight grads into each weight's fp32 ``main_grad``.
        use_grouped_tensor: True for the one-kernel grouped path, False for per-expert GEMMs,
            None to take the grouped path wherever the backend can run it.
        backend: None or "auto" (the fastest measured: torch's grouped GEMM on CUDA where it
            runs these operands, else TE's kernels on CUDA when installed, else torch's; NOTE:
            [The default backend] in ``kernels/resolve.py``), "te" (TE's kernels: TE's numbers bit
            for bit), "torch", or a Kernels object. ``res.kernels`` says which ran.
        recipe: None (no FP8), or an FP8 recipe (``functional_dw.fp8``'s or TE's
            ``DelayedScaling``, ``Float8CurrentScaling``, ``Float8BlockScaling``): x, the weights
            and dy are quantized per expert and every GEMM runs in FP8 (emulated on the reference
            backend). K, N and each expert's tokens must be multiples of 16.
        fp8_state: ``DelayedScaling``'s state, ``fp8.init_state(recipe, num_gemms=E, device=...)``:
            forward reads its scales and records amaxes into it, backward records dy's; the
            caller updates it between steps (``fp8.update_state_(state, recipe)``).

    Under ``torch.autocast`` it computes what ``F.linear`` per expert computes under it: x, the
    weights and the biases in the autocast dtype, the grads in their inputs' dtypes (NOTE:
    [Autocast] in ``_amp.py``).
    """
    weights, splits, bias = normalize_args(weights, splits, bias)
    fuse = _checks.fuse_flag(fuse_wgrad_accumulation)  # (under torch.func: refused here, where it is visible)
    fp8_args = None
    if recipe is not None or fp8_state is not None:
        _fp8.refuse_compile(recipe)
        fp8_args = _fp8.Args(recipe, fp8_state, keep_x=_fp8.wgrad_possible(weights))
    opts = Options(fuse, use_grouped_tensor, backend, fp8_args, _amp.dtype(x))
    if opts.amp is None and fp8_args is None and not torch.compiler.is_compiling():
        y = _planned(x, weights, splits, bias, opts)
        if y is not None:
            return y
    run = _grouped_linear
    if torch.compiler.is_compiling() and dwp.any_distributed(weights):  # NOTE: [DistributedWeight under torch.compile]
        run = _grouped_linear_eager
    if opts.amp is None:
        return run(x, weights, splits, bias, opts)
    with _amp.off(x):  # NOTE: [Autocast] in _amp.py: x and the biases cast here, the weights where materialized
        return run(_amp.cast(x, opts.amp), weights, splits, _amp.cast(bias, opts.amp), opts)
