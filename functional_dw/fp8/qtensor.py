"""``QTensor``: a quantized tensor as data (an FP8 payload and fp32 inverse scales).

A ``QTensor`` holds TE's rowwise copy of a tensor, its columnwise (transposed) copy, or both,
each with its own inverse scales (NOTE: [Rowwise and columnwise]).

A ``QTensor`` is a frozen record and a pytree node whose leaves are the tensors it holds (no
None leaves), so it can sit in a residuals record and go through ``save_for_backward``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree

__all__ = ["QTensor", "te_scale_inv", "from_te_scale_inv"]


# NOTE: [Rowwise and columnwise]
#   TE keeps up to two FP8 copies of a tensor ``t`` of shape ``[*lead, K]``, seen as the 2-D
#   matrix ``[M, K]`` (``M = prod(lead)``): *rowwise* data of ``t``'s shape, and *columnwise* data,
#   the transpose, of shape ``[K, *lead]`` (TE's ``get_columnwise_shape``). A GEMM picks the one
#   its layout needs (see :mod:`.spec`); after forward only x's columnwise copy is needed (wgrad).
#   A ``QTensor`` holds either or both, like TE's ``Float8TensorStorage`` /
#   ``Float8BlockwiseQTensorStorage``. Each copy has its own ``*_scale_inv``:
#
#   - per-tensor scaling (delayed, current): one fp32 value, shape ``[1]``; the columnwise data
#     is exactly the transpose of the rowwise data and shares its scale (the same tensor).
#   - block scaling: one fp32 value per tile of the *stored* 2-D matrix (``[M, K]`` rowwise,
#     ``[K, M]`` columnwise), ``block`` = the tile, ``(1, 128)`` or ``(128, 128)``, in compact
#     layout ``[ceil(rows / block[0]), ceil(cols / block[1])]``. With 1x128 tiles the columnwise
#     copy is quantized on its own (tiles run along M), so it is not the rowwise data transposed;
#     with 128x128 tiles it is, and its scales are the rowwise ones transposed. Partial tiles at
#     the edges are scaled by the amax of the elements they hold.
#
#   TE stores block scales in a GEMM-ready layout instead (1x128: transposed; both: the last dim
#   padded to a multiple of 4, padding left unwritten): :func:`te_scale_inv` /
#   :func:`from_te_scale_inv` convert.

_TENSORS = ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv", "amax")


@dataclasses.dataclass(frozen=True, eq=False)
class QTensor:
    """A quantized tensor. ``shape``/``dtype``: the source's; ``fp8_dtype``: the payload's;
    ``block``: None for a per-tensor scale, else the tile (see the module NOTE). ``amax``
    (per-tensor scaling only): the source's amax, ``[1]`` fp32, as TE's cast kernel computes it
    (NaNs ignored): what delayed scaling records in its history."""

    rowwise_data: Optional[torch.Tensor]
    rowwise_scale_inv: Optional[torch.Tensor]
    columnwise_data: Optional[torch.Tensor]
    columnwise_scale_inv: Optional[torch.Tensor]
    amax: Optional[torch.Tensor]
    shape: tuple[int, ...]
    dtype: torch.dtype
    fp8_dtype: torch.dtype
    block: Optional[tuple[int, int]] = None

    @property
    def has_rowwise(self) -> bool:
        return self.rowwise_data is not None

    @property
    def has_columnwise(self) -> bool:
        return self.columnwise_data is not None

    @property
    def columnwise_shape(self) -> tuple[int, ...]:
        return (self.shape[-1], *self.shape[:-1])

    def with_usage(self, *, rowwise: bool, columnwise: bool) -> "QTensor":
        """This tensor with only the copies asked for (and no ``amax``), e.g. x after forward:
        ``q.with_usage(rowwise=False, columnwise=True)``. A copy it lacks cannot be made."""
        for name, want, have in (
            ("rowwise", rowwise, self.has_rowwise),
            ("columnwise", columnwise, self.has_columnwise),
        ):
            if want and not have:
                raise ValueError(f"this QTensor holds no {name} data; quantize with {name}=True")
        return dataclasses.replace(
            self,
            rowwise_data=self.rowwise_data if rowwise else None,
            rowwise_scale_inv=self.rowwise_scale_inv if rowwise else None,
            columnwise_data=self.columnwise_data if columnwise else None,
            columnwise_scale_inv=self.columnwise_scale_inv if columnwise else None,
            amax=None,
        )

    def dequantize(self, dtype: torch.dtype = torch.float32, *, columnwise: Optional[bool] = None) -> torch.Tensor:
        """The tensor back in ``dtype`` (default fp32), of the source's shape: payload times
        inverse scale, in fp32, per element (TE's dequantize). From the rowwise copy unless
        ``columnwise=True`` or there is none."""
        use_col = (not self.has_rowwise) if columnwise is None else columnwise
        data, scale_inv = (
            (self.columnwise_data, self.columnwise_scale_inv)
            if use_col
            else (self.rowwise_data, self.rowwise_scale_inv)
        )
        if data is None:
            raise ValueError(f"this QTensor holds no {'columnwise' if use_col else 'rowwise'} data")
        M = math.prod(self.shape[:-1])
        K = self.shape[-1]
        rows, cols = (K, M) if use_col else (M, K)
        out = apply_scale_inv(data.reshape(rows, cols), scale_inv, self.block)
        out = out.t().reshape(self.shape) if use_col else out.reshape(self.shape)
        return out.to(dtype)

    def __repr__(self) -> str:
        kind = "per-tensor" if self.block is None else f"{self.block[0]}x{self.block[1]} blocks"
        parts = [n for n in ("rowwise", "columnwise") if getattr(self, f"{n}_data") is not None]
        fp8 = str(self.fp8_dtype).removeprefix("torch.")
        return (
            f"QTensor({list(self.shape)}, {str(self.dtype).removeprefix('torch.')} -> {fp8}, {kind}, {'+'.join(parts)})"
        )


def apply_scale_inv(data: torch.Tensor, scale_inv: torch.Tensor, block: Optional[tuple[int, int]]) -> torch.Tensor:
    """``data`` (2-D, FP8) times its inverse scales, in fp32 (one scale, or one per tile)."""
    d = data.to(torch.float32)
    if block is None:
        return d * scale_inv
    R, C = d.shape
    br, bc = block
    nR, nC = -(-R // br), -(-C // bc)
    tiles = F.pad(d, (0, nC * bc - C, 0, nR * br - R)).view(nR, br, nC, bc)
    return (tiles * scale_inv.view(nR, 1, nC, 1)).view(nR * br, nC * bc)[:R, :C]


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def te_scale_inv(q: QTensor, *, columnwise: bool = False) -> torch.Tensor:
    """``q``'s inverse scales in TE's GEMM-ready layout (``Float8BlockQuantizer.get_scale_shape``):
    per-tensor ``[1]`` as is; 1x128 tiles: ``[ceil(cols/128), round_up(rows, 4)]`` (transposed);
    128x128 tiles: ``[ceil(rows/128), round_up(ceil(cols/128), 4)]``; rows/cols of the stored
    orientation. TE leaves the padding unwritten; here it is 0. Compare only the unpadded part."""
    s = q.columnwise_scale_inv if columnwise else q.rowwise_scale_inv
    if s is None:
        raise ValueError(f"this QTensor holds no {'columnwise' if columnwise else 'rowwise'} data")
    if q.block is None:
        return s
    if q.block[0] == 1:
        s = s.t()
    return F.pad(s, (0, _round_up(s.shape[1], 4) - s.shape[1])).contiguous()


def from_te_scale_inv(te: torch.Tensor, rows: int, cols: int, block: Optional[tuple[int, int]]) -> torch.Tensor:
    """The compact layout of TE's inverse scales ``te`` for a stored ``[rows, cols]`` matrix
    (the inverse of :func:`te_scale_inv`; TE's padding is dropped)."""
    if block is None:
        return te.reshape(1)
    if block[0] == 1:
        return te[:, :rows].t().contiguous()
    return te[:, : -(-cols // block[1])].contiguous()


def _flatten(q: QTensor) -> tuple[list, tuple]:
    present = tuple(n for n in _TENSORS if getattr(q, n) is not None)
    return [getattr(q, n) for n in present], (present, q.shape, q.dtype, q.fp8_dtype, q.block)


def _flatten_with_keys(q: QTensor) -> tuple[list, tuple]:
    leaves, context = _flatten(q)
    return [(pytree.GetAttrKey(n), t) for n, t in zip(context[0], leaves)], context


def _unflatten(values: Any, context: tuple) -> QTensor:
    present, shape, dtype, fp8_dtype, block = context
    tensors = dict.fromkeys(_TENSORS)
    tensors.update(zip(present, values))
    return QTensor(**tensors, shape=shape, dtype=dtype, fp8_dtype=fp8_dtype, block=block)


pytree.register_pytree_node(QTensor, _flatten, _unflatten, flatten_with_keys_fn=_flatten_with_keys)
