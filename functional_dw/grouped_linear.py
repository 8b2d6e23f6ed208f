"""GroupedLinear as a pure fwd/bwd pair: expert ``e`` computes ``y_e = x_e W_e^T + b_e`` on
its own rows of ``x``.

Legend: ``T`` tokens, ``K`` in-features, ``N`` out-features, ``E`` experts.
``splits_E`` token counts per expert (rows of x in expert order).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any, NamedTuple, Union

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import is_fake

from . import _checks, _fp8, distributed_weight as dwp, fp8
from .custom_vjp import custom_vjp
from .kernels import Kernels, Splits, check_sizes, get_kernels, packed, stacked
from .kernels.torch_ref import expert_sums
from .residuals import any_needed, needed, residuals, saved

__all__ = [
    "GroupedLinearResiduals", "grouped_linear", "grouped_linear_fwd", "grouped_linear_bwd",
    "grouped_linear_bwd_dgrad", "grouped_linear_bwd_wgrad",
]

WeightsArg = Union[Sequence[torch.Tensor], torch.Tensor]
_SIG = operator.attrgetter("shape", "dtype", "device", "layout")


class _HostSplits(tuple):
    """Host split sizes as ONE pytree leaf (a tuple subclass is not a registered pytree node),
    so the autograd bridge does not flatten E ints on every call."""

SplitsArg = Union[Sequence[int], torch.Tensor]


@residuals
class GroupedLinearResiduals:
    x_TK: Any = saved()  # all that is saved for backward: x as given (NOTE: [Saved x]); with FP8, its
    # quantized columnwise copy per expert (what wgrad reads; x itself is not kept)
    x_version: _checks.Stamp  # x_TK's version at forward: the pure API checks it in backward (None with FP8)
    weights: tuple[torch.Tensor, ...]  # the parameters by reference: E x [N, K], or one [E, N, K]
    stacked: bool  # weights is one [E, N, K] tensor
    weight_version: tuple[int, ...]
    distributed: bool  # weights[0] is a DistributedWeight leader acting for the group
    weight_shapes: tuple[tuple[int, ...], ...]  # of the materialized weights, checked in backward
    splits: Splits
    bias: str | None  # None, "list" (E x [N]) or "stacked" ([E, N])
    out_features: int
    path: str  # the GEMM path that ran: "split" (per-expert GEMMs) or "grouped" (one kernel)
    fuse_wgrad_accumulation: bool
    kernels: Kernels
    fp8: _fp8.Plan | None  # None without FP8; else how forward quantized (recipe, specs, the state by
    # reference, forward's weight scales): backward quantizes dy and the weights by it
    needs: Any = needed()  # which gradients bwd computes (None: all); see NOTE: [Which gradients]


def _wanted(res: GroupedLinearResiduals) -> tuple[bool, bool, bool]:
    """(dx, any dW, dbias): the gradients backward computes."""
    if res.needs is None:
        return True, True, True
    x, w, _, b = res.needs[:4]
    return bool(x), any_needed(w), any_needed(b)


def _as_params(weights: WeightsArg) -> tuple[tuple[torch.Tensor, ...], bool]:
    """The parameters autograd sees, and whether they are one stacked ``[E, N, K]`` tensor."""
    if isinstance(weights, torch.Tensor):
        _checks.tensor("weights", weights, ndim=3)
        return (weights,), True
    ws = _checks.sequence(weights)
    if not ws:
        raise TypeError(
            "weights must be a non-empty sequence of [out, in] tensors or one [E, out, in] tensor, "
            f"got {type(weights).__name__}{' (empty)' if ws == [] else ''}"
        )
    for e, w in enumerate(ws):
        if not isinstance(w, torch.Tensor):
            _checks.tensor(f"weights[{e}]", w)  # raises, naming it; the rest is checked once
    return tuple(ws), False  # materialized (_check_weights)


def _check_weights(ws: Sequence[torch.Tensor], ndim: int, x: torch.Tensor) -> None:
    """One cheap pass over the experts' weights; the slow path names the first bad one."""
    if ndim == 2 and not torch.compiler.is_compiling() and set(map(type, ws)) <= _checks.PLAIN_TYPES:
        # (C loops over E experts)
        try:
            sigs = set(map(_SIG, ws))
        except RuntimeError:  # a (strided) nested tensor has no .shape: the slow path names it
            sigs = ()
        if len(sigs) == 1:
            shape, dtype, device, layout = next(iter(sigs))
            if len(shape) == 2 and dtype == x.dtype and device == x.device and layout == torch.strided:
                return
    w0 = ws[0]
    ok = isinstance(w0, torch.Tensor) and not w0.is_nested and w0.dim() == ndim
    if ok:
        shape, dtype, device = w0.shape[-2:], x.dtype, x.device
        ok = all(isinstance(w, torch.Tensor) and not w.is_nested and w.dim() == ndim and w.shape[-2:] == shape
                 and w.dtype == dtype and w.device == device and w.layout == torch.strided for w in ws)
    if ok:
        return
    for e, w in enumerate(ws):
        name = "weights" if ndim == 3 else f"weights[{e}]"
        _checks.tensor(name, w, ndim=ndim)
        if w.shape[-2:] != ws[0].shape[-2:]:
            N, K = ws[0].shape[-2:]
            raise ValueError(f"{name} is {tuple(w.shape)}; every expert's weight must be [{N}, {K}] like weights[0]")
        _checks.like(name, w, x)


def _as_splits(splits: SplitsArg, num_experts: int, x: torch.Tensor) -> Splits:
    T = x.shape[0]
    if isinstance(splits, torch.Tensor):
        if splits.dtype not in (torch.int32, torch.int64) or splits.dim() != 1:
            raise TypeError(f"splits tensor must be 1-D int32 or int64, got {splits.dtype} of shape {tuple(splits.shape)}")
        if splits.layout != torch.strided:
            raise TypeError(f"splits must be a dense tensor (or a list of ints), got layout {splits.layout}")
        if splits.device.type == "meta":
            raise ValueError("splits is a tensor on the meta device, which holds no counts: give the splits as "
                             "a list of ints (shape inference needs their values) or a tensor on a real device")
        if torch.compiler.is_compiling():  # a copy: the caller may reuse its routing buffer before
            host, tensor = None, splits.clone()  # backward, which reads the counts again
        else:
            if is_fake(splits):
                raise ValueError("splits is a fake tensor (FakeTensorMode), which holds no counts: give the "
                                 "splits as a list of ints for shape inference")
            host, tensor = (None if splits.is_cuda else tuple(splits.tolist())), splits
    else:
        items = None if isinstance(splits, (str, bytes)) else _checks.sequence(splits)
        if items is None:
            raise TypeError(f"splits must be a list/tuple of ints or a 1-D integer tensor, got {type(splits).__name__}")
        host, tensor = _checks.counts("splits", items), None
    n = len(host) if host is not None else splits.shape[0]
    if n != num_experts:
        raise ValueError(f"splits has {n} entries but there are {num_experts} experts (weights): give one count per expert")
    if torch.compiler.is_compiling():  # NOTE: [Splits under torch.compile]: data, never guarded on
        if tensor is None:
            tensor = torch.tensor(host, dtype=torch.int64)  # on the CPU: the split path reads it there
        return Splits(host=None, tensor=tensor, device=x.device, num_tokens=T, num_experts=num_experts)
    if host is not None:
        check_sizes(host, T)
    return Splits(host=host, tensor=tensor, device=x.device, num_tokens=T, num_experts=num_experts)


def _as_bias(bias: Any, E: int, N: int, x: torch.Tensor) -> tuple[torch.Tensor | None, str | None]:
    if bias is None:
        return None, None
    if isinstance(bias, torch.Tensor):
        _checks.tensor("bias", bias, ndim=2)
        _checks.shape("bias", bias, (E, N))
        _checks.like("bias", bias, x)
        return bias, "stacked"
    bs = _checks.sequence(bias)
    if bs is None or len(bs) != E:
        got = f"{len(bs)} items" if bs is not None else type(bias).__name__
        raise ValueError(f"bias must be None, a sequence of {E} [{N}] tensors or one [{E}, {N}] tensor; got {got}")
    for e, b in enumerate(bs):
        _checks.tensor(f"bias[{e}]", b, ndim=1)
        _checks.shape(f"bias[{e}]", b, (N,))
        _checks.like(f"bias[{e}]", b, x)
    return stacked(bs), "list"  # slices of one buffer (nn.GroupedLinear's): a view, no copy


def _one_buffer(w_ENK: WeightsArg) -> WeightsArg:
    """E weights that are consecutive slices of one buffer as that ``[E, N, K]`` view (found
    once here, not again by every kernel call; NOTE: [One buffer]); anything else unchanged."""
    if isinstance(w_ENK, torch.Tensor):
        return w_ENK
    one = packed(w_ENK)
    return w_ENK if one is None else one


def _weight_shapes(w_ENK: WeightsArg, stacked: bool) -> list[tuple[int, ...]]:
    return [tuple(w_ENK.shape)] if stacked else [tuple(w.shape) for w in w_ENK]


def _choose_path(kernels: Kernels, x_TK: torch.Tensor, w_ENK: WeightsArg, use_grouped_tensor: bool | None,
                 recipe: Any = None) -> str:
    """``None``: the grouped path where it can run (these operands, and with a ``recipe`` its FP8
    kernels: TE has no grouped delayed scaling, for one); ``True``: grouped, or split with a
    warning where it cannot (at the caller's line; Python's default filter shows it once per
    reason); ``False``: split. The path taken is recorded on the residuals."""
    if use_grouped_tensor is False:
        return "split"
    why_not = (kernels.grouped_path_unsupported(x_TK, w_ENK) if recipe is None
               else kernels.grouped_path_unsupported(x_TK, w_ENK, recipe=recipe))
    if why_not is None:
        return "grouped"
    if use_grouped_tensor:
        _checks.warn(f"grouped_linear: use_grouped_tensor=True but {why_not}; running the split path")
    return "split"


class _Call(NamedTuple):
    """A checked call: what forward computes with, and what its residuals record."""

    params: tuple[torch.Tensor, ...]
    stacked: bool
    distributed: bool
    w_ENK: WeightsArg  # the materialized weights the GEMMs read
    shapes: tuple[tuple[int, ...], ...]
    split: Splits
    b_EN: torch.Tensor | None
    bias_form: str | None
    x_TK: torch.Tensor
    kernels: Kernels
    path: str
    fp8: _fp8.Plan | None  # None: no FP8


def _prepare(x, weights, splits, bias, fuse_wgrad_accumulation, use_grouped_tensor, backend,
             recipe=None, fp8_state=None) -> _Call:
    """Check every argument, materialize the weights, pick the kernels, the GEMM path and (with a
    recipe) the FP8 plan."""
    _checks.tensor("x", x, ndim=2)
    _checks.flag("fuse_wgrad_accumulation", fuse_wgrad_accumulation)
    if use_grouped_tensor is not None:
        _checks.flag("use_grouped_tensor", use_grouped_tensor)
    params, stacked = _as_params(weights)
    distributed = dwp.is_distributed_weight(params[0])
    full = dwp.materialize(params, distributed, for_backward=False, like=x)
    w_ENK = full[0] if stacked else full
    _check_weights([w_ENK] if stacked else w_ENK, 3 if stacked else 2, x)
    shapes = _weight_shapes(w_ENK, stacked)
    w_ENK = _one_buffer(w_ENK)
    E = shapes[0][0] if stacked else len(shapes)
    N, K = shapes[0][-2:]
    if x.shape[1] != K:
        what = " (as materialize_group_for_forward() of the DistributedWeight returned them)" if distributed else ""
        raise ValueError(f"x has {x.shape[1]} features but the weights are [{N}, {K}]{what}: x must be [T, {K}]")
    split = _as_splits(splits, E, x)
    b_EN, bias_form = _as_bias(bias, E, N, x)
    rowwise = isinstance(recipe, fp8.RowwiseScaling)  # functional_dw's recipe: torch's scaled grouped GEMM
    if rowwise:
        if backend in (None, "auto"):
            backend = "torch"
        if use_grouped_tensor is False:
            raise ValueError("RowwiseScaling runs one grouped GEMM per product (there is no per-expert path): pass "
                             "use_grouped_tensor=None or True")
    elif backend == "auto" and (fuse_wgrad_accumulation or recipe is not None):  # torch's CUDA grouped
        backend = None  # GEMM cannot write an fp32 main_grad (it writes bf16; TE's can, without a
        # sync), and FP8 on torch is the CPU emulation: auto is TE's kernels there
    kernels = get_kernels(backend, x, w_ENK if use_grouped_tensor is not False else None)
    x_TK = _checks.dense(x)
    path = "grouped" if rowwise else _choose_path(kernels, x_TK, w_ENK, use_grouped_tensor, recipe)
    if path == "split" and split.host is None and not torch.compiler.is_compiling():
        check_sizes(split.sizes(), x.shape[0])  # the split path syncs for host sizes anyway
    plan = None
    if recipe is not None or fp8_state is not None:
        plan = _fp8.plan(recipe, fp8_state, E, x, kernels)
        if path == "grouped" and not torch.compiler.is_compiling():
            why_not = _fp8.grouped_sizes_problem(plan, split)
            if why_not is not None:
                if use_grouped_tensor:
                    _checks.warn(f"grouped_linear: use_grouped_tensor=True but {why_not}; running the split path")
                path = "split"
        known = split.host if split.host is not None or path == "grouped" else split.sizes()
        _fp8.check_dims(K, N, splits=None if rowwise else known)  # device-only counts: not checked (a sync);
        # RowwiseScaling takes any counts (NOTE: [Padded token columns])
    return _Call(params, stacked, distributed, w_ENK, tuple(shapes), split, b_EN, bias_form, x_TK, kernels, path, plan)


def _fprop(c: _Call) -> torch.Tensor:
    if c.fp8 is not None:
        return _fprop_fp8(c, keep_x=False, keep_w=False)[0]
    return c.kernels.grouped_fprop(c.x_TK, c.w_ENK, c.b_EN, c.split, c.path == "grouped")


def _fprop_fp8(c: _Call, keep_x: bool, keep_w: bool) -> tuple[torch.Tensor, Any, _fp8.Plan]:
    """FP8 forward: x per expert and each weight quantized, the FP8 grouped GEMM; with
    ``keep_x``, also x's columnwise copy for wgrad; with ``keep_w``, the weights' for dgrad (on
    the plan). Returns (y, x's copy or None, the plan with forward's weight scales)."""
    grouped = c.path == "grouped"
    xq = c.fp8.quantize_x(c.kernels, c.x_TK, c.split, grouped, keep=keep_x)
    wq, plan = c.fp8.quantize_weights(c.kernels, c.w_ENK, keep=keep_w and not c.distributed,
                                      params=None if c.distributed else c.params)
    y = c.kernels.grouped_fprop(xq, wq, c.b_EN, c.split, grouped, split_accumulator=plan.acc.fprop)
    return y, (_fp8.with_usage(xq, rowwise=False, columnwise=True) if keep_x else None), plan


def grouped_linear_fwd(
    x: torch.Tensor, weights: WeightsArg, splits: SplitsArg, bias: Any = None, *,
    fuse_wgrad_accumulation: bool = False, use_grouped_tensor: bool | None = None,
    backend: str | Kernels | None = None, recipe: Any = None, fp8_state: Any = None,
) -> tuple[torch.Tensor, GroupedLinearResiduals]:
    """``y`` ``[T, N]`` and the residuals. x ``[T, K]``; weights E ``[N, K]`` or ``[E, N, K]``;
    ``recipe``/``fp8_state`` as for :func:`grouped_linear`."""
    c = _prepare(x, weights, splits, bias, fuse_wgrad_accumulation, use_grouped_tensor, backend, recipe, fp8_state)
    return _forward(c, x, fuse_wgrad_accumulation, keep_x=True)


def _forward(c: _Call, x: torch.Tensor, fuse_wgrad_accumulation: bool, keep_x: bool):
    """y and the residuals of a checked call; ``keep_x`` False (FP8, every weight frozen): no
    FP8 copy of x is made or saved (wgrad, its only reader, never runs)."""
    if c.fp8 is None:
        y, x_saved, plan = _fprop(c), x, None
    else:
        y, x_saved, plan = _fprop_fp8(c, keep_x=keep_x, keep_w=True)
    res = GroupedLinearResiduals(
        x_TK=x_saved, x_version=_checks.stamp(x) if plan is None else None, weights=c.params, stacked=c.stacked,
        weight_version=dwp.versions(c.params), distributed=c.distributed, weight_shapes=c.shapes, splits=c.split,
        bias=c.bias_form, out_features=c.shapes[0][-2], path=c.path,
        fuse_wgrad_accumulation=fuse_wgrad_accumulation, kernels=c.kernels, fp8=plan,
    )
    return y, res


def _check_res(res: Any, fn: str) -> GroupedLinearResiduals:
    _checks.record(fn, res, GroupedLinearResiduals, "grouped_linear_fwd")
    _checks.check_stamp("x", res.x_TK, res.x_version)
    return res


def _like(res: GroupedLinearResiduals) -> Any:
    """What has x's dtype and device: x, or with FP8 the plan (x is not kept)."""
    return res.x_TK if res.fp8 is None else res.fp8


def _dy_TN(res: GroupedLinearResiduals, dy: torch.Tensor) -> torch.Tensor:
    return _checks.dense(_checks.cotangent("dy", dy, (res.splits.num_tokens, res.out_features), _like(res)))


def _x_TK(res: GroupedLinearResiduals) -> torch.Tensor:
    """The saved x, dense.

    NOTE: [Saved x] The residuals keep x as the caller gave it, not forward's dense copy:
    a copy made inside the autograd Function has no graph link to x, so a second-order
    gradient through wgrad (create_graph=True, jacrev of jacrev) would silently lose its x
    term. Backward makes it dense again (also after an unpack hook that changed strides);
    for a contiguous x (the usual case) both are no-ops."""
    return _checks.dense(res.x_TK)


def _checked(res: Any, dy: Any, fn: str) -> torch.Tensor:
    """The record, x's and the weights' versions and dy checked once; dy as ``[T, N]``, dense."""
    dy_TN = _dy_TN(_check_res(res, fn), dy)
    dwp.check_versions(res.weights, res.weight_version, "weights")
    return dy_TN


def grouped_linear_bwd_dgrad(res: GroupedLinearResiduals, dy: torch.Tensor) -> torch.Tensor:
    """dx ``[T, K]``, with the weights materialized again (never kept from forward); None when
    x needs no gradient (a DistributedWeight is still gathered: its collectives match across ranks)."""
    dy_TN = _checked(res, dy, "grouped_linear_bwd_dgrad")
    return _dgrad(res, dy_TN, _dy_fp8(res, dy_TN, dgrad=True, wgrad=False))


def grouped_linear_bwd_wgrad(res: GroupedLinearResiduals, dy: torch.Tensor) -> tuple[Any, Any]:
    """(dweights, dbiases) shaped like the weights and bias arguments (see finalize)."""
    dy_TN = _checked(res, dy, "grouped_linear_bwd_wgrad")
    return _wgrad(res, dy_TN, _dy_fp8(res, dy_TN, dgrad=False, wgrad=True))


def grouped_linear_bwd(res: GroupedLinearResiduals, dy: torch.Tensor) -> tuple[torch.Tensor, Any, Any]:
    """(dx, dweights, dbiases): dgrad then wgrad, on one checked (and densified) dy (with FP8,
    quantized once for both)."""
    dy_TN = _checked(res, dy, "grouped_linear_bwd")
    dyq = _dy_fp8(res, dy_TN, dgrad=True, wgrad=True)
    return (_dgrad(res, dy_TN, dyq), *_wgrad(res, dy_TN, dyq))


def _frozen(res: GroupedLinearResiduals) -> bool:
    """No wgrad GEMM: no weight grad wanted, or fused and every weight frozen (main_grad untouched)."""
    return not _wanted(res)[1] or (res.fuse_wgrad_accumulation and not any(p.requires_grad for p in res.weights))


def _dy_fp8(res: GroupedLinearResiduals, dy_TN: torch.Tensor, dgrad: bool, wgrad: bool) -> Any:
    """With FP8, dy quantized for the GEMMs that run (None without FP8 or without GEMMs)."""
    if res.fp8 is None:
        return None
    _fp8.check_first_order("grouped_linear", dy_TN, res.weights)
    return res.fp8.quantize_dy(res.kernels, dy_TN, res.splits, res.path == "grouped",
                               dgrad=dgrad and _wanted(res)[0], wgrad=wgrad and not _frozen(res))


def _dgrad(res: GroupedLinearResiduals, dy_TN: torch.Tensor, dyq: Any) -> torch.Tensor | None:
    full = dwp.materialize(res.weights, res.distributed, for_backward=True, like=_like(res))
    dwp.check_materialized(full, res.weight_shapes, "materialize_group_for_backward()")
    if not _wanted(res)[0]:
        return None
    w_ENK = full[0] if res.stacked else _one_buffer(full)
    grouped = res.path == "grouped"
    if res.fp8 is not None:  # dy and the weights (quantized again) in FP8
        wq = res.fp8.requantize_weights(res.kernels, w_ENK)
        return res.kernels.grouped_dgrad(dyq, wq, res.splits, grouped, split_accumulator=res.fp8.acc.dgrad)
    return res.kernels.grouped_dgrad(dy_TN, w_ENK, res.splits, grouped)


def _wgrad(res: GroupedLinearResiduals, dy_TN: torch.Tensor, dyq: Any) -> tuple[Any, Any]:
    fused = res.fuse_wgrad_accumulation
    want_b = _wanted(res)[2]
    if _frozen(res):  # no wgrad GEMM; a DistributedWeight still finalizes (zeros), once, as every rank does
        db_EN = expert_sums(dy_TN, res.splits) if res.bias is not None and want_b else None
        if res.distributed:
            zeros = dwp.frozen_wgrads(res.weights, res.weight_shapes, fused, dy_TN, "weights")
            wgrads = dwp.finalize(res.weights, True, fused, zeros)
            return (wgrads[0] if res.stacked else wgrads), _bias_grads(res, db_EN)
        return (None if res.stacked else [None] * len(res.weights)), _bias_grads(res, db_EN)
    out = None
    if fused:
        targets = dwp.grad_targets(res.weights, res.distributed, res.weight_shapes, "weights")
        out = targets[0] if res.stacked else targets
    accumulate, with_dbias = fused and dwp.accumulates(res.weights, res.distributed), res.bias is not None and want_b
    if res.fp8 is not None:  # the saved FP8 x and dy; the bias grad from the high-precision dy
        dw = res.kernels.grouped_wgrad(res.x_TK, dyq, res.splits, res.path == "grouped", out=out, accumulate=accumulate,
                                       split_accumulator=res.fp8.acc.wgrad)[0]
        db_EN = expert_sums(dy_TN, res.splits) if with_dbias else None
    else:
        dw, db_EN = res.kernels.grouped_wgrad(_x_TK(res), dy_TN, res.splits, res.path == "grouped", out=out,
                                              accumulate=accumulate, with_dbias=with_dbias)
    wgrads = dwp.finalize(res.weights, res.distributed, fused, [dw] if res.stacked else list(dw))
    dweights = wgrads[0] if res.stacked else wgrads
    return dweights, _bias_grads(res, db_EN)


def _bias_grads(res: GroupedLinearResiduals, db_EN: torch.Tensor | None) -> Any:
    if res.bias == "list":
        return list(db_EN.unbind(0)) if db_EN is not None else [None] * res.splits.num_experts
    return db_EN


def _fwd(x, weights, splits, bias, fuse_wgrad_accumulation, use_grouped_tensor, backend, fp8_args):
    c = _prepare(x, weights, splits, bias, fuse_wgrad_accumulation, use_grouped_tensor, backend,
                 **_fp8.unpack(fp8_args))
    return _forward(c, x, fuse_wgrad_accumulation, keep_x=fp8_args is None or fp8_args.keep_x)


def _primal(*args) -> torch.Tensor:
    """Forward alone, when no gradient can be taken: checks and GEMMs, no residuals."""
    return _fprop(_prepare(*args[:-1], **_fp8.unpack(args[-1])))


def _bwd(res: GroupedLinearResiduals, dy: torch.Tensor) -> tuple:
    dx, dweights, dbias = grouped_linear_bwd(res, dy)
    return dx, dweights, None, dbias, None, None, None, None


def _jvp(res: GroupedLinearResiduals, tangents: tuple) -> torch.Tensor:
    """Forward mode, per expert ``dy_e = dx_e W_e^T + x_e dW_e^T + db_e``."""
    _fp8.no_jvp(res.fp8, "grouped_linear")
    tx, tw, _, tb = tangents[:4]
    grouped = res.path == "grouped"
    if isinstance(tw, (list, tuple)) and all(t is None for t in tw):
        tw = None
    if tw is not None and res.distributed:
        raise ValueError("forward-mode (jvp) tangents for a DistributedWeight are not supported: "
                         "take the tangent with respect to x or bias, or use plain weights")
    b_EN = None
    if tb is not None:
        zeros = res.x_TK.new_zeros(res.out_features)
        b_EN = tb if isinstance(tb, torch.Tensor) else torch.stack([zeros if b is None else b for b in tb])
    dy = res.x_TK.new_zeros(res.x_TK.shape[0], res.out_features)
    if tx is not None or b_EN is not None:  # dx W^T + db, with the weights gathered again
        full = dwp.materialize(res.weights, res.distributed, for_backward=False)
        tx = _checks.dense(tx) if tx is not None else res.x_TK.new_zeros(res.x_TK.shape)
        dy = res.kernels.grouped_fprop(tx, full[0] if res.stacked else full, b_EN, res.splits, grouped)
    if tw is not None:  # + x dW^T
        if not isinstance(tw, torch.Tensor):
            tw = [torch.zeros_like(w) if t is None else t for t, w in zip(tw, res.weights)]
        tw = _checks.dense(tw) if isinstance(tw, torch.Tensor) else [_checks.dense(t) for t in tw]
        dy = dy + res.kernels.grouped_fprop(_x_TK(res), tw, None, res.splits, grouped)
    return dy


def _vmap(batch_size: int, in_dims: tuple, x, weights, splits, bias, fuse, use_grouped_tensor, backend, fp8_args):
    """Fold a batch of x (shared weights, host splits) into the token dimension: sort the B*T
    rows by (expert, batch), run one grouped GEMM with splits*B, and unsort the output. Not with
    FP8: a folded call would take each expert's amax over the whole batch, not per element."""
    x_dim, *rest = pytree.tree_leaves(in_dims, is_leaf=lambda d: d is None)
    if x_dim is None or any(d is not None for d in rest) or not isinstance(splits, tuple) or fp8_args is not None:
        return None  # batched weights/bias/splits, device splits, or FP8: one call per element
    xb = x.movedim(x_dim, 0)
    B, T, K = xb.shape
    E = len(splits)
    expert_T = torch.repeat_interleave(torch.arange(E, device=x.device), torch.tensor(splits, device=x.device), output_size=T)
    keys_BT = expert_T[None, :] * B + torch.arange(B, device=x.device)[:, None]
    order = torch.argsort(keys_BT.flatten(), stable=True)
    new_args = (xb.reshape(B * T, K)[order], weights, _HostSplits(s * B for s in splits), bias, fuse, use_grouped_tensor,
                backend, None)
    return new_args, lambda y: (y[torch.argsort(order)].view(B, T, -1), 0)


_grouped_linear = custom_vjp(_fwd, _bwd, primal=_primal, jvp=_jvp, vmap=_vmap, name="grouped_linear")
_grouped_linear_eager = torch.compiler.disable(_grouped_linear, reason=dwp.NO_COMPILE)


def grouped_linear(
    x: torch.Tensor, weights: WeightsArg, splits: SplitsArg, bias: Any = None, *,
    fuse_wgrad_accumulation: bool = False, use_grouped_tensor: bool | None = None,
    backend: str | Kernels | None = None, recipe: Any = None, fp8_state: Any = None,
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
        backend: None (TE on CUDA when installed, else torch), "te", "torch", or "auto" (the
            fastest measured: torch's grouped GEMM on CUDA where it can run, else as None).
        recipe: None (no FP8), or an FP8 recipe (``functional_dw.fp8``'s or TE's
            ``DelayedScaling``, ``Float8CurrentScaling``, ``Float8BlockScaling``): x, the weights
            and dy are quantized per expert and every GEMM runs in FP8 (emulated on the reference
            backend). K, N and each expert's tokens must be multiples of 16.
        fp8_state: ``DelayedScaling``'s state, ``fp8.init_state(recipe, num_gemms=E, device=...)``:
            forward reads its scales and records amaxes into it, backward records dy's; the
            caller updates it between steps (``fp8.update_state_(state, recipe)``).
    """
    if not isinstance(weights, torch.Tensor):  # a list, tuple or nn.ParameterList: a pytree list
        weights = _checks.sequence(weights) or weights
    if bias is not None and not isinstance(bias, torch.Tensor):
        bias = _checks.sequence(bias) or bias
    if not isinstance(splits, (torch.Tensor, str, bytes)):
        items = _checks.sequence(splits)
        splits = _HostSplits(items) if items is not None else splits
    fuse = _checks.fuse_flag(fuse_wgrad_accumulation)  # (under torch.func: refused here, where it is visible)
    fp8_args = None
    if recipe is not None or fp8_state is not None:
        _fp8.refuse_compile(recipe)
        fp8_args = _fp8.Args(recipe, fp8_state, keep_x=_fp8.wgrad_possible(weights))
    if torch.compiler.is_compiling() and dwp.any_distributed(weights):  # NOTE: [DistributedWeight under torch.compile]
        return _grouped_linear_eager(x, weights, splits, bias, fuse, use_grouped_tensor, backend, fp8_args)
    return _grouped_linear(x, weights, splits, bias, fuse, use_grouped_tensor, backend, fp8_args)
