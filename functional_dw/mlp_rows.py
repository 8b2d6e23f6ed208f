"""grouped_mlp's ``rows`` (issue 41): the experts' input is ``x[rows]``, an MoE's dispatch rows,
sorted by expert, while the record keeps x (``[T, H]``) and the index (``[R]``), not the rows.

The semantics are ``grouped_mlp(x.index_select(0, rows), ...)`` with autograd through the
``index_select``, bit for bit: forward gathers the rows where fc1 reads them (bf16: once, for
fc1's GEMM; RowwiseScaling's FP8: inside fc1's input quantization, through the index, so the
gathered bf16 rows are never written), backward gathers them again for fc1's wgrad (exact: the
same bits) and sums the rows' grads into their tokens as ``index_select``'s backward does
(:func:`scatter`: zeros, then ``index_add``).
"""

from __future__ import annotations

from typing import Any

import torch

from . import _checks
from .grouped_linear import GroupedCall, forward, fprop

# NOTE: [Rows gathered first] Where a path cannot take rows as they are, ``grouped_mlp`` gathers
#   ``x[rows]`` first and runs the call without rows (correct, just not fused, and the record keeps
#   the gathered rows): under ``torch.autocast`` (the reference casts the gathered rows, and their
#   grads are summed in x's dtype), while compiling, and with a DistributedWeight. The planned runner,
#   forward mode (jvp) and a backward that is differentiated again take rows as they are (the gather
#   and the sum are torch ops on the saved x, so second order is exact).

__all__ = ["check", "fc1", "gather", "gather_first", "like", "scatter"]


def check(x: Any, rows: Any, splits: Any) -> None:
    """``rows`` is a dense 1-D int64/int32 tensor on x's device, and ``R`` is the splits' total
    where that is known without a sync (host counts, a CPU tensor outside a compile); else
    TypeError/ValueError naming rows. Its values are read only by the gather (on the CPU an
    out-of-range one is an IndexError naming rows; on CUDA it is not checked: a sync)."""
    _checks.tensor("x", x, ndim=2)
    if not isinstance(rows, torch.Tensor) or rows.dtype not in (torch.int64, torch.int32):
        got = rows.dtype if isinstance(rows, torch.Tensor) else type(rows).__name__
        hint = ", not a bool mask: pass rows.nonzero().squeeze(1)" if got == torch.bool else ""
        raise TypeError(f"grouped_mlp: rows must be an int64 (or int32) tensor of x's row indices{hint}, got {got}")
    if rows.layout != torch.strided or rows.dim() != 1:
        raise ValueError(
            f"grouped_mlp: rows must be a dense 1-D [R] tensor of indices into x's {x.shape[0]} rows, got "
            f"shape {tuple(rows.shape)}, layout {rows.layout}"
        )
    if rows.device != x.device:
        raise ValueError(f"grouped_mlp: rows is on {rows.device} but x on {x.device}: move rows to x's device")
    if rows.shape[0] and x.shape[0] == 0:
        raise IndexError(f"grouped_mlp: rows holds {rows.shape[0]} indices into an x of no rows")
    total = _known_total(splits)
    if total is not None and total != rows.shape[0]:
        raise ValueError(
            f"grouped_mlp: rows holds {rows.shape[0]} indices but splits count {total} rows: with rows the "
            "experts' input is x[rows], so splits count its R rows (sum(splits) == rows.shape[0])"
        )


def _known_total(splits: Any) -> int | None:
    """The splits' total where it is known for free, else None (the layer's checks see the rest)."""
    if isinstance(splits, torch.Tensor):
        if splits.device.type != "cpu" or torch.compiler.is_compiling() or splits.dim() != 1:
            return None
        return int(splits.sum()) if not splits.is_floating_point() else None
    if isinstance(splits, (list, tuple)) and all(type(s) is int for s in splits):
        return sum(splits)
    return None


def like(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """A stand-in with ``x[rows]``'s shape, dtype and device (its values are not the rows'): fc1
    is prepared on it before anything is gathered."""
    R = rows.shape[0]
    base = x.detach()
    return base[:1].expand(R, x.shape[1]) if base.shape[0] else base


def gather(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``x.index_select(0, rows)`` (differentiable), whose out-of-range index is an IndexError
    naming rows (on the CPU)."""
    try:
        return x.index_select(0, rows)
    except IndexError as e:
        raise IndexError(f"grouped_mlp: rows has an index outside [0, {x.shape[0]}) (x's rows): {e}") from e


def gather_first(x: torch.Tensor, rows: Any, splits: Any) -> tuple[torch.Tensor, None]:
    """``(x[rows], None)``, rows checked: the call without rows (NOTE: [Rows gathered first])."""
    check(x, rows, splits)
    return gather(x, rows), None


def fc1(c1: GroupedCall, x: torch.Tensor, rows: Any, keep: bool, keep_x: bool) -> tuple:
    """fc1's output and, with ``keep``, its record. With ``rows``, its input is ``x[rows]``:
    quantized through the index where fc1 runs FP8 and its plan can (``quantize_x_rows``: the
    gathered rows are never written), else gathered (differentiable: second order sees it)."""
    xq = x_in = None
    if rows is None:
        x_in = x
    else:
        if c1.fp8 is not None:
            xq = c1.fp8.quantize_x_rows(c1.kernels, x, rows, c1.split, c1.path == "grouped", keep=keep and keep_x)
        if xq is None:
            x_in = gather(x, rows)
    if keep:
        return forward(c1, x_in, keep_x=keep_x, xq=xq)
    return fprop(c1, x_in, xq=xq), None


def scatter(dx_R: torch.Tensor, rows: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """``[T, H]``: each gathered row's grad summed into its token, as ``index_select``'s backward
    sums them (zeros, then ``index_add``: the same bits)."""
    return dx_R.new_zeros((num_tokens, dx_R.shape[1])).index_add(0, rows, dx_R)
