"""grouped_mlp's ``rows`` (issue 41): the experts' input is ``x[rows]``, an MoE's dispatch rows,
sorted by expert, while the record keeps x (``[T, H]``) and the rows' record, not the rows.

``rows`` is one of two records (a plain index tensor is wrapped into the first), and the record
alone decides both ends: :meth:`index` (the gather index) and :meth:`sum_rows` (the rows' grads
summed into their tokens):

* an ``[R]`` index tensor (:class:`IndexRows`): ``grouped_mlp(x.index_select(0, rows), ...)``
  through autograd, bit for bit; dx is ``index_select``'s backward (zeros, then ``index_add``),
  whose sum order over a token's rows is not fixed on CUDA (atomics: not bitwise reproducible);
* :class:`TopkRows` ``(order, top_k)``, a top-k dispatch: the rows are ``x[order // top_k]``
  and dx sums each token's ``k`` rows in choice order (``moe_ep.token_sum``), bit for bit what
  :func:`functional_dw.moe.dispatch`'s backward gives: deterministic.

Forward gathers the rows where fc1 reads them (bf16: once, for fc1's GEMM; RowwiseScaling's FP8:
inside fc1's input quantization, through the index, so the gathered bf16 rows are never
written), backward gathers them again for fc1's wgrad (exact: the same bits).

With ``combine=True`` the experts' output rows are summed back into the tokens by the same
record (:meth:`sum_rows`: an MoE's combine, ``y [T, H_out]``), so fc2's dy is ``dy[rows]``:
gathered in backward, or with RowwiseScaling quantized through the index as x is (the gathered
bf16 dy rows are never written either).
"""

from __future__ import annotations

from typing import Any

import torch

from . import _checks
from .custom_vjp import custom_vjp
from .grouped_linear import GroupedCall, check_dy, forward, fprop, quantize_dy_rows
from .moe_ep import check_permutation, token_sum, tokens
from .residuals import residuals, saved

# NOTE: [Rows gathered first] Where a path cannot take rows as they are, ``grouped_mlp`` gathers
#   ``x[rows]`` first (the record's :meth:`gather`: differentiable, its backward the record's
#   sum) and runs the call without rows (correct, just not fused, and the record keeps the
#   gathered rows): under ``torch.autocast`` (the reference casts the gathered rows, and their
#   grads are summed in x's dtype), while compiling, and with a DistributedWeight; with ``combine``
#   y's rows are then summed after the call (the record's :meth:`sum_rows`, torch ops: their
#   backward gathers dy's rows, the same bits as the combine's backward). The planned runner,
#   forward mode (jvp) and a backward that is differentiated again take rows as they are (the gather
#   and the sum are torch ops on the saved x, so second order is exact).

__all__ = ["IndexRows", "TopkRows", "check", "check_combine", "fc1", "fc2_dy", "gather", "index_of", "like", "record"]


@residuals
class IndexRows:
    """``rows`` as an ``[R]`` index into x's T rows: the gather is ``x.index_select(0, rows)``,
    the sum back ``index_add`` (on CUDA atomic: a token's rows summed in no fixed order)."""

    rows: torch.Tensor = saved()  # [R] int64/int32

    def index(self) -> torch.Tensor:
        return self.rows

    def sum_rows(self, d_rows: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """``[T, H]``: as ``index_select``'s backward sums (zeros, then ``index_add``: the same bits)."""
        return d_rows.new_zeros((num_tokens, d_rows.shape[1])).index_add(0, self.rows, d_rows)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        return gather(x, self.rows)


@residuals
class TopkRows:
    """A top-k dispatch as grouped_mlp's ``rows``: ``order`` ``[T * k]`` int64 (or int32) is the
    permutation of the (token, choice) pairs ``t * k + j`` sorted by expert
    (:func:`functional_dw.moe.dispatch_fwd`'s ``order``), ``top_k`` is ``k``. The experts' rows
    are ``x[order // k]``; x's grad sums each token's ``k`` rows in choice order, bit for bit
    what ``moe.dispatch``'s backward gives (deterministic, also on CUDA)."""

    order: torch.Tensor = saved()  # [T * k]: each sorted row's flat (token * k + choice) index
    top_k: int

    def index(self) -> torch.Tensor:
        """``order // top_k``: each row's token (computed where it is read, not kept)."""
        return tokens(self.order, self.top_k)

    def sum_rows(self, d_rows: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """``[T, H]``: each token's ``k`` row grads summed in choice order (``moe.dispatch``'s backward)."""
        return token_sum(d_rows, self.order, self.top_k)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """``x[order // k]``, differentiable, with :meth:`sum_rows` as its backward."""
        return _gather_topk(x, self)


def index_of(rows: IndexRows | TopkRows) -> torch.Tensor:
    """The tensor the record keeps: an IndexRows' index, a TopkRows' order."""
    return rows.order if isinstance(rows, TopkRows) else rows.rows


def _rows_repr(self: Any) -> str:
    extra = f", top_k={self.top_k}" if isinstance(self, TopkRows) else ""
    t = index_of(self)
    return f"{type(self).__name__}([{t.shape[0]}] {str(t.dtype).removeprefix('torch.')}{extra})"


IndexRows.__repr__ = TopkRows.__repr__ = _rows_repr  # type: ignore[method-assign]


@residuals
class _TopkGatherResiduals:
    rows: TopkRows = saved()
    num_tokens: int


def _gather_topk_fwd(x: torch.Tensor, rows: TopkRows) -> tuple:
    return gather(x, rows.index()), _TopkGatherResiduals(rows, x.shape[0])


def _gather_topk_bwd(res: _TopkGatherResiduals, d_rows: torch.Tensor) -> tuple:
    return res.rows.sum_rows(d_rows, res.num_tokens), None


def _gather_topk_jvp(res: _TopkGatherResiduals, tangents: tuple) -> torch.Tensor | None:
    """Forward mode (a TopkRows call gathered first, then jvp'd): the rows' tangent is x's, gathered."""
    tx = tangents[0]
    return None if tx is None else tx.index_select(0, res.rows.index())


_gather_topk = custom_vjp(_gather_topk_fwd, _gather_topk_bwd, jvp=_gather_topk_jvp, name="grouped_mlp_rows")


def record(x: Any, rows: Any, splits: Any) -> IndexRows | TopkRows:
    """``rows`` checked (:func:`check`) as its record: a TopkRows as given, an index tensor wrapped."""
    check(x, rows, splits)
    return rows if isinstance(rows, (IndexRows, TopkRows)) else IndexRows(rows)


def check(x: Any, rows: Any, splits: Any) -> None:
    """``rows`` is a dense 1-D int64/int32 tensor on x's device, and ``R`` is the splits' total
    where that is known without a sync (host counts, a CPU tensor outside a compile); else
    TypeError/ValueError naming rows. Its values are read only by the gather (on the CPU an
    out-of-range one is an IndexError naming rows; on CUDA it is not checked: a sync)."""
    _checks.tensor("x", x, ndim=2)
    if isinstance(rows, TopkRows):
        return _check_topk(x, rows, splits)
    if isinstance(rows, IndexRows):
        rows = rows.rows
    _check_index(x, rows, "rows")
    if rows.shape[0] and x.shape[0] == 0:
        raise IndexError(f"grouped_mlp: rows holds {rows.shape[0]} indices into an x of no rows")
    _check_total(rows.shape[0], splits)


def _check_topk(x: torch.Tensor, rows: TopkRows, splits: Any) -> None:
    """TopkRows: ``order`` a dense 1-D int64/int32 tensor on x's device, ``top_k`` a positive int,
    ``order.numel() == T * top_k`` (shapes: no sync), and a permutation where that is free (a CPU
    tensor in eager code, as ``moe.combine`` checks it): else x's grad would sum the wrong rows."""
    order, k = rows.order, rows.top_k
    if type(k) is not int or k < 1:
        raise ValueError(f"grouped_mlp: rows (TopkRows) top_k must be a positive int, got {k!r}")
    _check_index(x, order, "rows (TopkRows) order")
    if order.shape[0] != x.shape[0] * k:
        raise ValueError(
            f"grouped_mlp: rows (TopkRows) order holds {order.shape[0]} rows but x's {x.shape[0]} tokens times "
            f"top_k={k} make {x.shape[0] * k}: order is the dispatch's permutation of the T * k (token, choice) pairs"
        )
    check_permutation(
        order,
        "grouped_mlp: rows (TopkRows) order must be a permutation of the T * k (token, choice) pairs (the "
        "dispatch's order): a repeated or missing pair would sum the wrong rows' grads into x's",
    )
    _check_total(order.shape[0], splits)


def _check_index(x: torch.Tensor, t: Any, name: str) -> None:
    """``t``, an index record's tensor (``name`` in the errors), is a dense 1-D int64/int32
    tensor on x's device; else TypeError/ValueError naming it."""
    if not isinstance(t, torch.Tensor) or t.dtype not in (torch.int64, torch.int32):
        got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
        hint = ", not a bool mask: pass the indices it selects, mask.nonzero().squeeze(1)" if got == torch.bool else ""
        raise TypeError(f"grouped_mlp: {name} must be an int64 (or int32) tensor of indices{hint}, got {got}")
    if t.layout != torch.strided or t.dim() != 1:
        raise ValueError(
            f"grouped_mlp: {name} must be a dense 1-D tensor, got shape {tuple(t.shape)}, layout {t.layout}"
        )
    if t.device != x.device:
        raise ValueError(f"grouped_mlp: {name} is on {t.device} but x on {x.device}: move it to x's device")


def _check_total(R: int, splits: Any) -> None:
    total = _known_total(splits)
    if total is not None and total != R:
        raise ValueError(
            f"grouped_mlp: rows holds {R} indices but splits count {total} rows: with rows the "
            "experts' input is x[rows], so splits count its R rows (sum(splits) == rows' R)"
        )


def _known_total(splits: Any) -> int | None:
    """The splits' total where it is known for free, else None (the layer's checks see the rest)."""
    if isinstance(splits, torch.Tensor):
        if not _checks.values_free(splits) or splits.dim() != 1:
            return None  # (a fake tensor holds no counts: as_splits names it)
        return int(splits.sum()) if not splits.is_floating_point() else None
    if isinstance(splits, (list, tuple)) and all(type(s) is int for s in splits):
        return sum(splits)
    return None


def like(x: torch.Tensor, rows: IndexRows | TopkRows) -> torch.Tensor:
    """A stand-in with ``x[rows]``'s shape, dtype and device (its values are not the rows'): fc1
    is prepared on it before anything is gathered."""
    R = index_of(rows).shape[0]
    base = x.detach()
    return base[:1].expand(R, x.shape[1]) if base.shape[0] else base


def gather(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``x.index_select(0, rows)`` (differentiable), whose out-of-range index is an IndexError
    naming rows (on the CPU)."""
    try:
        return x.index_select(0, rows)
    except IndexError as e:
        raise IndexError(f"grouped_mlp: rows has an index outside [0, {x.shape[0]}) (x's rows): {e}") from e


def check_combine(combine: Any, rows: Any) -> None:
    """grouped_mlp's ``combine``: a bool, True only with rows (TypeError/ValueError naming it)."""
    if type(combine) is not bool:
        raise TypeError(f"grouped_mlp: combine must be a bool, got {type(combine).__name__}")
    if combine and rows is None:
        raise ValueError(
            "grouped_mlp: combine=True sums y's rows into x's tokens, so it needs rows (an index into x, "
            "or TopkRows(order, top_k)); without rows y is already one row per token: drop combine"
        )


def fc2_dy(rows: IndexRows | TopkRows, num_tokens: int, r2: Any, dy: torch.Tensor, quantize: bool) -> tuple:
    """(fc2's dy, its FP8 copies or None) where y's rows were summed into x's tokens (``combine``):
    dy ``[T, H_out]`` checked, and fc2's is ``dy[rows]`` (moe.combine's backward): quantized
    through the index where ``quantize`` allows it, fc2 runs FP8 and its plan can
    (``quantize_dy_rows``: fc2's dy is then a stand-in of its shape and the gathered rows are
    never written), else gathered (a torch op: second order sees it)."""
    dy = check_dy(r2, dy, num_tokens=num_tokens)
    index = rows.index()
    dyq = quantize_dy_rows(r2, dy, index) if quantize else None
    return (like(dy, rows), dyq) if dyq is not None else (gather(dy, index), None)


def fc1(c1: GroupedCall, x: torch.Tensor, rows: IndexRows | TopkRows | None, keep: bool, keep_x: bool) -> tuple:
    """fc1's output and, with ``keep``, its record. With ``rows`` (a record), its input is ``x[rows.index()]``:
    quantized through the index where fc1 runs FP8 and its plan can (``quantize_rows``: the
    gathered rows are never written), else gathered (differentiable: second order sees it)."""
    xq = x_in = None
    if rows is None:
        x_in = x
    else:
        index = rows.index()
        if c1.fp8 is not None:
            grouped, spec = c1.path == "grouped", c1.fp8.x
            xq = c1.fp8.quantize_rows(
                c1.kernels, spec, x, index, c1.split, grouped, rowwise=True, columnwise=keep and keep_x
            )
        if xq is None:
            x_in = gather(x, index)
    if keep:
        return forward(c1, x_in, keep_x=keep_x, xq=xq)
    return fprop(c1, x_in, xq=xq), None
