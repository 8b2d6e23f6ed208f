"""``RowwiseScaling``: functional_dw's FP8 recipe for experts, as data and as reference math.

Every scale covers a row or a column of a GEMM operand along the dimension the GEMM sums
over, so the GEMM applies it in its epilogue (``torch._scaled_grouped_mm`` on Hopper). Legend:
``T`` tokens (rows of x and dy, sorted by expert), ``K`` in-features, ``N`` out-features, ``E``
experts, ``P`` padded token columns (below).

==========  ===============================  ====================  ===========================
tensor      copy (GEMM that reads it)        data                  inverse scales
==========  ===============================  ====================  ===========================
x  [T, K]   rowwise (fprop)                  ``[T, K]``            ``[T]``: one per token
            columnwise (wgrad)               ``[K, P]``            ``[E, K]``: per expert and
                                                                   feature, over its tokens
dy [T, N]   rowwise (dgrad)                  ``[T, N]``            ``[T]``
            columnwise (wgrad)               ``[N, P]``            ``[E, N]``
W  [E,N,K]  rowwise (fprop)                  ``[E, N, K]``         ``[E, N]``: over K
            columnwise (dgrad)               ``[E, K, N]``         ``[E, K]``: over N
==========  ===============================  ====================  ===========================

wgrad's columnwise copies pad each expert's tokens with zeros to a multiple of 16 columns,
``P = round_up(T + 15 E, 16)`` in all, known on the host (NOTE: [Padded token columns]).

Scales: ``scale = fp8_max / amax`` (an amax of 0, inf or NaN gives 1; ``amax_epsilon`` floors
the amax), rounded down to a power of two with ``power_2_scale``; data ``fp8(x * scale)``
saturated, NaN kept; inverse scale ``1 / scale`` (exact for a power of two). Amaxes skip NaN
(TE's formulas: :func:`.quantize.compute_scale_from_amax`).

The functions here are the recipe's definition in plain torch ops, on any device and without a
host sync: the reference backend runs them, and the CUDA kernels
(``functional_dw/kernels/triton_rowwise.py``) are tested against them bit for bit.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
import torch.utils._pytree as pytree
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.weak import WeakIdKeyDictionary

from .quantize import amax_of, compute_scale_from_amax
from .spec import TensorSpec

__all__ = [
    "PAD",
    "RowwiseActivation",
    "RowwiseWeight",
    "WEIGHT_CACHE",
    "OPTIMIZER_STEPS",
    "check_rows",
    "clear_weight_cache",
    "gather_rows",
    "install_optimizer_hook",
    "remove_optimizer_hook",
    "padded_columns",
    "padded_ends",
    "quantize_activation",
    "quantize_weight",
    "scale_of",
]


# NOTE: [Padded token columns] wgrad's grouped GEMM sums over each expert's tokens, and torch's
# scaled grouped GEMM needs each such group to be a multiple of 16 columns (else a device-side
# assert). So a columnwise copy puts expert ``e``'s tokens at columns ``pstart[e] ...`` where
# ``pstart`` is the running sum of the counts rounded up to 16, and fills the gap with zeros;
# ``P = round_up(T + 15 E, 16)`` bounds it on the host, so nothing is read back from the device
# (the counts may live only there). fprop and dgrad group along the GEMM's rows, which take any
# counts.

PAD = 16  # wgrad's token groups: multiples of 16 columns (torch's scaled grouped GEMM)


def padded_columns(num_tokens: int, num_experts: int) -> int:
    """``P``: the columns of a columnwise copy, enough for any counts (see the module NOTE)."""
    return -(-(num_tokens + (PAD - 1) * num_experts) // PAD) * PAD


def padded_ends(counts_E: torch.Tensor) -> torch.Tensor:
    """int32 ``[E]`` ends of the padded token groups: the running sum of counts rounded up to 16."""
    return ((counts_E.to(torch.int64) + PAD - 1) // PAD * PAD).cumsum(0).to(torch.int32)


def scale_of(amax: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    """The fp32 scales of fp32 amaxes, elementwise (the module docstring's rule)."""
    return compute_scale_from_amax(amax, spec.fp8_max, power_2_scale=spec.power_2_scale, epsilon=spec.amax_epsilon)


def _cast(v: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    return v.clamp(-spec.fp8_max, spec.fp8_max).to(spec.fp8_dtype)  # saturating; NaN stays NaN


def _rows(t: torch.Tensor, spec: TensorSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """``t [..., D]`` with one scale per row: (FP8 data, inverse scales ``[...]``)."""
    v = t.detach().to(torch.float32)
    s = scale_of(amax_of(v, dim=-1) if v.shape[-1] else v.new_zeros(v.shape[:-1]), spec)
    return _cast(v * s[..., None], spec), torch.reciprocal(s)


@dataclasses.dataclass(frozen=True, eq=False)
class RowwiseActivation:
    """x or dy of a group, quantized (see the module table): rowwise ``[T, D]`` + ``[T]``,
    columnwise ``[D, P]`` + ``[E, D]``; either may be None. ``shape``/``dtype``: the source's."""

    rowwise_data: Optional[torch.Tensor]
    rowwise_scale_inv: Optional[torch.Tensor]
    columnwise_data: Optional[torch.Tensor]
    columnwise_scale_inv: Optional[torch.Tensor]
    shape: tuple[int, int]
    dtype: torch.dtype

    def with_usage(self, *, rowwise: bool, columnwise: bool) -> "RowwiseActivation":
        """This tensor with only the copies asked for (a copy it lacks cannot be made)."""
        return _with_usage(self, rowwise, columnwise)


@dataclasses.dataclass(frozen=True, eq=False)
class RowwiseWeight:
    """A group's weights ``[E, N, K]``, quantized: rowwise ``[E, N, K]`` + ``[E, N]`` (fprop),
    columnwise ``[E, K, N]`` + ``[E, K]`` (dgrad); either may be None."""

    rowwise_data: Optional[torch.Tensor]
    rowwise_scale_inv: Optional[torch.Tensor]
    columnwise_data: Optional[torch.Tensor]
    columnwise_scale_inv: Optional[torch.Tensor]
    shape: tuple[int, int, int]
    dtype: torch.dtype

    def with_usage(self, *, rowwise: bool, columnwise: bool) -> "RowwiseWeight":
        """This tensor with only the copies asked for (a copy it lacks cannot be made)."""
        return _with_usage(self, rowwise, columnwise)


def _with_usage(q: Any, rowwise: bool, columnwise: bool) -> Any:
    for name, want in (("rowwise", rowwise), ("columnwise", columnwise)):
        if want and getattr(q, f"{name}_data") is None:
            raise ValueError(f"this {type(q).__name__} holds no {name} data; quantize with {name}=True")
    return dataclasses.replace(
        q,
        rowwise_data=q.rowwise_data if rowwise else None,
        rowwise_scale_inv=q.rowwise_scale_inv if rowwise else None,
        columnwise_data=q.columnwise_data if columnwise else None,
        columnwise_scale_inv=q.columnwise_scale_inv if columnwise else None,
    )


_TENSORS = ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv")


def _register(cls: type) -> None:
    """A pytree node whose leaves are the tensors it holds (no None leaves)."""

    def flatten(q):
        present = tuple(n for n in _TENSORS if getattr(q, n) is not None)
        return [getattr(q, n) for n in present], (present, q.shape, q.dtype)

    def unflatten(values, context):
        present, shape, dtype = context
        tensors = dict.fromkeys(_TENSORS)
        tensors.update(zip(present, values))
        return cls(**tensors, shape=shape, dtype=dtype)

    def flatten_with_keys(q):
        leaves, context = flatten(q)
        return [(pytree.GetAttrKey(n), t) for n, t in zip(context[0], leaves)], context

    pytree.register_pytree_node(cls, flatten, unflatten, flatten_with_keys_fn=flatten_with_keys)


_register(RowwiseActivation)
_register(RowwiseWeight)


def check_rows(rows: Any, t: torch.Tensor) -> None:
    """``rows``, the source rows of a gathered quantization, is a dense int64 (or int32) ``[R]`` on
    ``t``'s device; else TypeError/ValueError (IndexError: R indices into a ``t`` of no rows). Its
    values are not read (no sync): on the CPU an out-of-range one is an IndexError
    (:func:`gather_rows`), on CUDA it is not checked (NOTE: [The gather as the load] in
    ``kernels/triton_rowwise.py``)."""
    tensor = isinstance(rows, torch.Tensor)
    if tensor and rows.dtype == torch.bool:
        raise TypeError(
            "rows: expected int64 (or int32) source row indices, got a bool mask: pass the indices it "
            "selects, rows.nonzero().squeeze(1)"
        )
    if not tensor or rows.dtype not in (torch.int64, torch.int32):
        fix = "rows.long()" if tensor else "torch.as_tensor(rows, dtype=torch.int64, device=t.device)"
        raise TypeError(
            f"rows: expected an int64 (or int32) tensor of source row indices, got "
            f"{rows.dtype if tensor else type(rows).__name__}: pass {fix}"
        )
    if rows.layout != torch.strided:
        raise TypeError(f"rows: expected a dense tensor of indices, got layout {rows.layout}: pass rows.to_dense()")
    if rows.dim() != 1:
        raise ValueError(
            f"rows: expected a 1-D tensor [R] of indices into t's rows, got shape {tuple(rows.shape)}: "
            "flatten it (rows.reshape(-1))"
        )
    if rows.device != t.device:
        raise ValueError(f"rows is on {rows.device} and t on {t.device}: move rows to t's device (rows.to(t.device))")
    if rows.shape[0] and t.dim() and t.shape[0] == 0:  # every index out of range (CUDA would read outside t)
        raise IndexError(f"rows: {rows.shape[0]} indices into a t of no rows: pass rows of t's rows, or no rows")


def gather_rows(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``t[rows]`` (detached), whose out-of-range (or negative) index is an IndexError naming
    ``rows`` (on the CPU: a CUDA tensor's is a device-side assert)."""
    try:
        return t.detach().index_select(0, rows)
    except IndexError as e:
        raise IndexError(
            f"rows: an index lies outside [0, {t.shape[0]}) (t's rows; negative ones are not taken): {e}"
        ) from e


def quantize_activation(
    t_TD: torch.Tensor,
    ends_E: torch.Tensor,
    pends_E: torch.Tensor,
    spec: TensorSpec,
    *,
    rowwise: bool,
    columnwise: bool,
    rows: Optional[torch.Tensor] = None,
) -> RowwiseActivation:
    """x or dy ``[T, D]`` of a group whose expert ``e`` holds rows ``ends[e-1]:ends[e]`` (int
    ``[E]``, on t's device, ending at T) into a :class:`RowwiseActivation`; ``pends``: the padded
    ends (:func:`padded_ends`). No host sync. ``rows`` (int64 or int32 ``[R]``, values in
    ``[0, T)``: :func:`check_rows`): the tensor quantized is ``t[rows]`` ``[R, D]``, whose groups
    ``ends``/``pends`` describe (an MoE's sorted dispatch rows; the CUDA kernels read t through the
    index: NOTE: [The gather as the load] in ``kernels/triton_rowwise.py``)."""
    if rows is not None:
        check_rows(rows, t_TD)
        t_TD = gather_rows(t_TD, rows)
    T, D = t_TD.shape
    E = ends_E.shape[0]
    row_data = row_sinv = col_data = col_sinv = None
    if rowwise:
        row_data, row_sinv = _rows(t_TD, spec)
    if columnwise:
        v = t_TD.detach().to(torch.float32)
        expert_T, column_T = _token_columns(ends_E, pends_E, T)
        a = v.abs()
        a = torch.where(torch.isnan(a), torch.zeros_like(a), a)
        amax_ED = a.new_zeros(E, D).scatter_reduce_(0, expert_T[:, None].expand(T, D), a, "amax")  # 0: no rows
        s_ED = scale_of(amax_ED, spec)
        # scaled values placed in their padded columns, then cast (zeros cast to zeros): out of
        # place and with no dtype view, so vmap(grad) runs (no FP8 index_copy, no view rule needed)
        col = v.new_zeros(D, padded_columns(T, E)).index_copy(1, column_T, (v * s_ED[expert_T]).t())
        col_data, col_sinv = _cast(col, spec), torch.reciprocal(s_ED)
    return RowwiseActivation(row_data, row_sinv, col_data, col_sinv, (T, D), t_TD.dtype)


def quantize_weight(
    w_ENK: torch.Tensor, spec: TensorSpec, *, rowwise: bool = True, columnwise: bool = True
) -> RowwiseWeight:
    """A group's weights ``[E, N, K]`` into a :class:`RowwiseWeight` (see the module table)."""
    row_data = row_sinv = col_data = col_sinv = None
    if rowwise:
        row_data, row_sinv = _rows(w_ENK, spec)
    if columnwise:
        col_data, col_sinv = _rows(w_ENK.transpose(-2, -1), spec)
        col_data = col_data.contiguous()
    return RowwiseWeight(row_data, row_sinv, col_data, col_sinv, tuple(w_ENK.shape), w_ENK.dtype)


def _token_columns(ends_E: torch.Tensor, pends_E: torch.Tensor, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's expert and its column in a columnwise copy (NOTE: [Padded token columns])."""
    ends = ends_E.to(torch.int64)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    expert_T = torch.searchsorted(ends, torch.arange(T, device=ends.device), right=True)
    pstarts = pends_E.to(torch.int64) - (counts + PAD - 1) // PAD * PAD
    return expert_T, pstarts[expert_T] + torch.arange(T, device=ends.device) - (ends - counts)[expert_T]


def dequantize_columns(q: RowwiseActivation, ends_E: torch.Tensor, pends_E: torch.Tensor) -> torch.Tensor:
    """fp32 ``[T, D]`` from the columnwise copy (its padding dropped): what wgrad multiplies."""
    expert_T, column_T = _token_columns(ends_E, pends_E, q.shape[0])
    return q.columnwise_data[:, column_T].to(torch.float32).t() * q.columnwise_scale_inv[expert_T]


# NOTE: [FP8 weights per version] An optimizer step changes a weight in place, which bumps its
# version counter (``Tensor._version``), or, in torch's fused optimizers (``fused=True``) and
# ones that write through their own kernels (Apex's/TE's multi_tensor_applier), leaves it as it
# was; nothing else between steps should change a weight. So RowwiseScaling's quantized weights
# are cached per group of parameters, keyed on the parameters (held weakly: an id reused by a
# new tensor misses), their versions, addresses and layouts (``param.data = ...`` changes one),
# the dtype they were quantized from (under ``torch.autocast``, its: NOTE: [Autocast] in ``_amp.py``),
# and the count of optimizer steps taken (a global ``torch.optim`` post-step hook counts them,
# so a step that bumps no version misses too: NOTE: [The optimizer hook]); the entry hangs weakly off the first parameter
# and dies with it, and a changed weight misses and replaces it. Gradient accumulation's
# micro-batches and every backward then read one quantized copy per step. Writes that neither
# an optimizer step nor a version sees (``param.data.copy_(...)``, numpy views, custom kernels
# outside a torch optimizer's ``step``) must be followed by :func:`clear_weight_cache`. Not
# cached: DistributedWeights (quantized once per materialize, which gathers anew), inference
# tensors (no version counter), tensors a transform wraps, and anything while compiling. The
# cache holds one FP8 copy of each weight both ways (as many bytes as the bf16 weight). The
# layers' side: ``fp8_rowwise_plan._rowwise_weights``.
WEIGHT_CACHE = WeakIdKeyDictionary()  # (tensors compare elementwise: keyed by identity)
OPTIMIZER_STEPS = [0]  # steps of any torch.optim optimizer while the hook is installed (a key part: NOTE above)

# NOTE: [The optimizer hook] Importing functional_dw changes nothing global: the post-step hook
# that counts optimizer steps (``torch.optim.optimizer.register_optimizer_step_post_hook``,
# every optimizer's steps) is installed by the weight cache's first use
# (:func:`install_optimizer_hook`, from ``fp8_rowwise_plan._rowwise_weights``), before the cache
# holds anything, so every step after an entry was made is counted. :func:`remove_optimizer_hook`
# takes it away and empties the cache (an entry kept without the count could outlive a fused
# step); the cache's next use installs it again.
_OPTIMIZER_HOOK: list[Any] = []  # the hook's RemovableHandle, while installed


def _count_optimizer_step(*_: Any) -> None:
    OPTIMIZER_STEPS[0] += 1


def install_optimizer_hook() -> None:
    """Install the post-step hook that counts optimizer steps (NOTE: [The optimizer hook]), once;
    the weight cache's first use calls it."""
    if not _OPTIMIZER_HOOK:
        _OPTIMIZER_HOOK.append(register_optimizer_step_post_hook(_count_optimizer_step))


def remove_optimizer_hook() -> None:
    """Remove the optimizer hook, if installed, and drop every cached quantized weight (NOTE:
    [The optimizer hook]); the next RowwiseScaling step that caches its weights installs it again."""
    while _OPTIMIZER_HOOK:
        _OPTIMIZER_HOOK.pop().remove()
    clear_weight_cache()


def clear_weight_cache() -> None:
    """Drop every cached quantized weight (NOTE: [FP8 weights per version]); call it after
    changing weights in a way neither their versions nor an optimizer step shows."""
    WEIGHT_CACHE.clear()
