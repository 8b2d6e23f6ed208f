"""grouped_linear's per-call-signature plan (NOTE: [Plan once, run lean] in ``plan.py``): the
arguments normalized, every check that metadata settles, the kernels, the GEMM path and (with a
recipe) the FP8 plan, made once by :func:`make_plan` and cached in :data:`PLANS` under
:func:`plan_key`. ``grouped_linear.prepare`` reads it; ``grouped_mlp`` plans fc1 and fc2 through it.

Legend: ``T`` tokens, ``K`` in-features, ``N`` out-features, ``E`` experts.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence
from typing import Any, Union

import torch
from torch._subclasses.fake_tensor import is_fake

from . import _checks, _fp8
from ._checks import PLAIN_TYPES
from .kernels import Kernels, Splits, check_sizes, get_kernels, packed as packed_view, refuse_fp8_only
from .plan import Options, PlanCache, choose_path, eager_plain, options_key, tensor_key, weights_key

__all__ = [
    "GroupedPlan",
    "HostSplits",
    "PLANS",
    "SplitsArg",
    "WeightsArg",
    "as_params",
    "as_splits",
    "check_bias",
    "make_plan",
    "normalize_args",
    "plan_key",
]

WeightsArg = Union[Sequence[torch.Tensor], torch.Tensor]
SplitsArg = Union[Sequence[int], torch.Tensor]
_SIG = operator.attrgetter("shape", "dtype", "device", "layout")


class HostSplits(tuple):
    """Host split sizes as ONE pytree leaf (a tuple subclass is not a registered pytree node),
    so the autograd bridge does not flatten E ints on every call."""


def normalize_args(weights: Any, splits: Any, bias: Any) -> tuple[Any, Any, Any]:
    """Sequences as lists (a tuple, an ``nn.ParameterList``: one pytree list), host split counts
    as ONE leaf (:class:`HostSplits`)."""
    if not isinstance(weights, torch.Tensor) and type(weights) is not list:  # a tuple, an nn.ParameterList,
        weights = _checks.sequence(weights) or weights  # a list subclass (a pytree leaf): a plain list
    if bias is not None and not isinstance(bias, torch.Tensor) and type(bias) is not list:
        bias = _checks.sequence(bias) or bias
    if not isinstance(splits, (torch.Tensor, str, bytes, HostSplits)):
        items = _checks.sequence(splits)
        splits = HostSplits(items) if items is not None else splits
    return weights, splits, bias


def as_params(weights: WeightsArg) -> tuple[tuple[torch.Tensor, ...], bool]:
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
        ok = all(
            isinstance(w, torch.Tensor)
            and not w.is_nested
            and w.dim() == ndim
            and w.shape[-2:] == shape
            and w.dtype == dtype
            and w.device == device
            and w.layout == torch.strided
            for w in ws
        )
    if ok:
        return
    for e, w in enumerate(ws):
        name = "weights" if ndim == 3 else f"weights[{e}]"
        _checks.tensor(name, w, ndim=ndim)
        if w.shape[-2:] != ws[0].shape[-2:]:
            N, K = ws[0].shape[-2:]
            raise ValueError(f"{name} is {tuple(w.shape)}; every expert's weight must be [{N}, {K}] like weights[0]")
        _checks.like(name, w, x)


def check_bias(bias: Any, E: int, N: int, x: torch.Tensor) -> str | None:
    """The bias's form: None, "stacked" (one ``[E, N]`` tensor) or "list" (E ``[N]`` tensors)."""
    if bias is None:
        return None
    if isinstance(bias, torch.Tensor):
        _checks.tensor("bias", bias, ndim=2)
        _checks.shape("bias", bias, (E, N))
        _checks.like("bias", bias, x)
        return "stacked"
    bs = _checks.sequence(bias)
    if bs is None or len(bs) != E:
        got = f"{len(bs)} items" if bs is not None else type(bias).__name__
        raise ValueError(f"bias must be None, a sequence of {E} [{N}] tensors or one [{E}, {N}] tensor; got {got}")
    for e, b in enumerate(bs):
        _checks.tensor(f"bias[{e}]", b, ndim=1)
        _checks.shape(f"bias[{e}]", b, (N,))
        _checks.like(f"bias[{e}]", b, x)
    return "list"  # stacked per call: slices of one buffer (nn.GroupedLinear's) as a view, no copy


def _weight_shapes(w_ENK: WeightsArg, stacked: bool) -> list[tuple[int, ...]]:
    return [tuple(w_ENK.shape)] if stacked else [tuple(w.shape) for w in w_ENK]


@dataclasses.dataclass(frozen=True, eq=False)
class GroupedPlan:
    """What a grouped_linear call decides from metadata (NOTE: [Plan once, run lean] in
    ``plan.py``): made by :func:`make_plan`, cached per call signature, read by the run path."""

    kernels: Kernels
    path: str  # "grouped" (one kernel per product) or "split" (one GEMM per expert): what every product runs
    why: str  # the reason for the path
    warn: str | None  # use_grouped_tensor=True could not be honoured (warned at every call, as Python filters)
    stacked: bool  # the weights are one [E, N, K] tensor
    packed: bool  # E weights at consecutive addresses of one buffer: read as one [E, N, K] view (NOTE: [One buffer])
    distributed: bool
    shapes: tuple[tuple[int, ...], ...]  # the materialized weights'
    num_experts: int
    out_features: int
    bias_form: str | None  # None, "list" (E x [N]) or "stacked" ([E, N])
    fuse_wgrad_accumulation: bool
    fp8: _fp8.Plan | None  # None: no FP8
    amp: torch.dtype | None  # under autocast, the dtype the weights are cast to where they are
    # materialized (NOTE: [Autocast] in ``_amp.py``); else None
    bf16: GroupedPlan | None = None  # with FP8 that falls back: the same call without a recipe, which a
    # call runs where FP8 does not pay (NOTE: [FP8 where it pays] in ``fp8_rowwise_plan.py``)

    def for_tokens(self, T: int) -> GroupedPlan:
        """The plan a call of ``T`` tokens runs: this one, or its bf16 plan where FP8 does not pay."""
        if self.bf16 is None or self.fp8.pays(T, self.shapes[0][-1], self.out_features):
            return self
        return self.bf16


PLANS = PlanCache()  # grouped_linear's plans (grouped_mlp's fc1 and fc2 included), by :func:`plan_key`


def make_plan(
    x: torch.Tensor, w_ENK: WeightsArg, stacked: bool, distributed: bool, bias: Any, opts: Options
) -> GroupedPlan:
    """Every decision of a call that metadata settles: the checks, the kernels, the GEMM path
    and (with a recipe) the FP8 plan. ``w_ENK``: the materialized weights."""
    shapes, E, N, K = _check_call(x, w_ENK, stacked, distributed, opts)
    bias_form = check_bias(bias, E, N, x)
    kernels, fp8_plan, path, why = _kernels_and_path(x, w_ENK, E, N, K, opts)
    warn = (
        f"grouped_linear: use_grouped_tensor=True but {why}; running the split path"
        if opts.use_grouped_tensor and path == "split"
        else None
    )
    packed = not stacked and packed_view(w_ENK, layout_only=True) is not None  # (autograd: per call, prepare)
    bf16 = None
    if fp8_plan is not None and fp8_plan.falls_back and not getattr(opts.backend, "fp8_only", False):
        bf16 = make_plan(x, w_ENK, stacked, distributed, bias, opts._replace(fp8=None))  # (an FP8 family's
        # kernels as backend= multiply FP8 only: such a call always runs FP8, as docs/fp8.md says)
    return GroupedPlan(
        kernels,
        path,
        why,
        warn,
        stacked,
        packed,
        distributed,
        tuple(shapes),
        E,
        N,
        bias_form,
        opts.fuse_wgrad_accumulation,
        fp8_plan,
        opts.amp,
        bf16,
    )


def _check_call(
    x: torch.Tensor, w_ENK: WeightsArg, stacked: bool, distributed: bool, opts: Options
) -> tuple[list[tuple[int, ...]], int, int, int]:
    """x, the flags and the materialized weights checked: (the weights' shapes, E, N, K)."""
    _checks.tensor("x", x, ndim=2)
    _checks.flag("fuse_wgrad_accumulation", opts.fuse_wgrad_accumulation)
    if opts.use_grouped_tensor is not None:
        _checks.flag("use_grouped_tensor", opts.use_grouped_tensor)
    _check_weights([w_ENK] if stacked else w_ENK, 3 if stacked else 2, x)
    shapes = _weight_shapes(w_ENK, stacked)
    E = shapes[0][0] if stacked else len(shapes)
    N, K = shapes[0][-2:]
    if E == 0:  # (a list cannot be empty: as_params)
        raise ValueError(
            f"weights is one [0, {N}, {K}] tensor: a group needs at least one expert, [E, {N}, {K}] with E >= 1"
        )
    if x.shape[1] != K:
        what = " (as materialize_group_for_forward() of the DistributedWeight returned them)" if distributed else ""
        raise ValueError(f"x has {x.shape[1]} features but the weights are [{N}, {K}]{what}: x must be [T, {K}]")
    return shapes, E, N, K


def _kernels_and_path(
    x: torch.Tensor, w_ENK: WeightsArg, E: int, N: int, K: int, opts: Options
) -> tuple[Kernels, Any, str, str]:
    """(kernels, FP8 plan, path, why): the backend's kernels (with FP8, its family's for the
    backend: NOTE: [FP8 kernels by family]), the FP8 plan (None without a recipe or a state) and
    the GEMM path every product runs, with the reason."""
    use_grouped_tensor, backend, (recipe, fp8_state) = opts.use_grouped_tensor, opts.backend, _fp8.unpack_args(opts.fp8)
    fixed = None  # (path, why) where the recipe's family fixes the path (RowwiseScaling: its grouped GEMM)
    group = use_grouped_tensor is not False  # may the default run torch's grouped GEMM (NOTE: [The default backend])
    if recipe is not None:  # the family's backend (TE's recipes: TE's kernels) and path rules
        ops = _fp8.family(recipe)
        backend, fixed, group = ops.backend(backend), ops.fixed_path(use_grouped_tensor), False
    elif opts.fuse_wgrad_accumulation:  # torch's CUDA grouped GEMM cannot write an fp32 main_grad
        group = False  # (it writes bf16; TE's can, without a sync): the default is TE's kernels there
    kernels = get_kernels(backend, x, w_ENK if group else None)
    fp8_plan = None
    if recipe is not None or fp8_state is not None:
        fp8_plan = _fp8.plan(recipe, fp8_state, E, x, kernels)
        _fp8.check_dims(K, N)
        kernels = fp8_plan.kernels
    else:
        refuse_fp8_only(kernels)
    if fixed is not None:
        return kernels, fp8_plan, *fixed
    why_not = (
        kernels.grouped_path_unsupported(x, w_ENK)
        if recipe is None
        else kernels.grouped_path_unsupported(x, w_ENK, recipe=recipe)
    )
    return kernels, fp8_plan, *choose_path(why_not, use_grouped_tensor)


def plan_key(x: Any, weights: Any, splits: Any, bias: Any, opts: Options) -> Any:
    """The cache key of a plain eager call (NOTE: [Plan once, run lean]): what :func:`make_plan`
    reads of each argument, and every option (:func:`plan.options_key`). None: plan afresh."""
    if type(x) not in PLAIN_TYPES or x.is_nested or x.layout != torch.strided or not eager_plain():
        return None  # (T is data: x's key is its other dims)
    wk = _group_key(weights)
    w0 = weights if isinstance(weights, torch.Tensor) else weights[0] if wk is not None else None
    if wk is None or getattr(w0, "is_distributed_weight", False):
        return None
    bk = None if bias is None else _group_key(bias)
    if isinstance(splits, torch.Tensor):
        sk = tensor_key(splits)
    elif isinstance(splits, tuple):  # host ints (HostSplits): checked per call
        sk = "host"
    else:
        return None
    fk = _fp8.plan_key(opts.fp8)
    if (bias is not None and bk is None) or sk is None or (opts.fp8 is not None and fk is None):
        return None
    return x.shape[1:], x.dtype, x.device, wk, bk, sk, options_key(opts, fk)


def _group_key(ts: Any) -> Any:
    """The key of one ``[E, ...]`` tensor or of a non-empty list/tuple of E tensors; None: none."""
    if isinstance(ts, torch.Tensor):
        return tensor_key(ts)
    if isinstance(ts, (list, tuple)) and ts:
        return weights_key(ts)
    return None


def as_splits(splits: SplitsArg, num_experts: int, x: torch.Tensor) -> Splits:
    """The call's split counts as a :class:`Splits`: host ints (checked to sum to T), or a device
    tensor (never read on the host; a CPU one is read, free), one count per expert. Under
    torch.compile, a tensor only (``kernels/splits.py`` says why)."""
    T = x.shape[0]
    if isinstance(splits, torch.Tensor):
        if splits.dtype not in (torch.int32, torch.int64) or splits.dim() != 1:
            raise TypeError(
                f"splits tensor must be 1-D int32 or int64, got {splits.dtype} of shape {tuple(splits.shape)}"
            )
        if splits.layout != torch.strided:
            raise TypeError(f"splits must be a dense tensor (or a list of ints), got layout {splits.layout}")
        if splits.device.type == "meta":
            raise ValueError(
                "splits is a tensor on the meta device, which holds no counts: give the splits as "
                "a list of ints (shape inference needs their values) or a tensor on a real device"
            )
        if torch.compiler.is_compiling():  # a copy: the caller may reuse its routing buffer before
            host, tensor = None, splits.clone()  # backward, which reads the counts again
        else:
            if is_fake(splits):
                raise ValueError(
                    "splits is a fake tensor (FakeTensorMode), which holds no counts: give the "
                    "splits as a list of ints for shape inference"
                )
            host, tensor = (None if splits.is_cuda else tuple(splits.tolist())), splits
    else:
        items = None if isinstance(splits, (str, bytes)) else _checks.sequence(splits)
        if items is None:
            raise TypeError(f"splits must be a list/tuple of ints or a 1-D integer tensor, got {type(splits).__name__}")
        host, tensor = _checks.counts("splits", items), None
    n = len(host) if host is not None else splits.shape[0]
    if n != num_experts:
        raise ValueError(
            f"splits has {n} entries but there are {num_experts} experts (weights): give one count per expert"
        )
    if torch.compiler.is_compiling():  # NOTE: [Splits under torch.compile]: data, never guarded on
        if tensor is None:
            tensor = torch.tensor(host, dtype=torch.int64)  # on the CPU: the split path reads it there
        return Splits(host=None, tensor=tensor, device=x.device, num_tokens=T, num_experts=num_experts)
    if host is not None:
        check_sizes(host, T)
    return Splits(host=host, tensor=tensor, device=x.device, num_tokens=T, num_experts=num_experts)
