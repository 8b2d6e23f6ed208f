"""Plain-PyTorch reference kernels (CPU and any CUDA device).

Split path: a per-expert loop of GEMMs. Grouped path: ``torch.nn.functional.grouped_mm``
(``torch._grouped_mm`` on older builds) with offsets computed on the device: no per-expert
host loop and no host sync. Bias add and bias gradients use a device-side row->expert index.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from . import Splits, Weights, out_in

_grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


@functools.lru_cache(maxsize=None)
def _capability(device: torch.device) -> tuple[int, int]:
    """Compute capability, read once per device (the per-call query costs microseconds)."""
    return torch.cuda.get_device_capability(device)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _stack(w_ENK: Weights) -> torch.Tensor:
    return w_ENK if isinstance(w_ENK, torch.Tensor) else torch.stack(list(w_ENK))


def _row_expert(splits: Splits) -> torch.Tensor:
    """For each token row, its expert index (device-side, no sync)."""
    E, T = splits.num_experts, splits.num_tokens

    def make() -> torch.Tensor:
        experts = torch.arange(E, device=splits.device)
        return torch.repeat_interleave(experts, splits.on_device(), output_size=T)

    return splits.cached("ref_rows", make)


def column_sums(dy_TN: torch.Tensor) -> torch.Tensor:
    """db_N: column sums of dy, accumulated in fp32 (or fp64)."""
    return dy_TN.sum(0, dtype=_acc_dtype(dy_TN.dtype)).to(dy_TN.dtype)


def expert_sums(dy_TN: torch.Tensor, splits: Splits) -> torch.Tensor:
    """db_EN: per-expert column sums of dy, accumulated in fp32 (or fp64)."""
    db = torch.zeros(splits.num_experts, dy_TN.shape[1], dtype=_acc_dtype(dy_TN.dtype), device=dy_TN.device)
    return db.index_add(0, _row_expert(splits), dy_TN.to(db.dtype)).to(dy_TN.dtype)  # out of place: vmap-safe


def _write(out: torch.Tensor, value: torch.Tensor, accumulate: bool) -> torch.Tensor:
    return out.add_(value) if accumulate else out.copy_(value)


class TorchKernels:
    name = "torch"

    def __repr__(self) -> str:
        return "TorchKernels()"

    # --- one GEMM -------------------------------------------------------------------------
    def fprop(self, x_TK: torch.Tensor, w_NK: torch.Tensor, b_N: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x_TK, w_NK, b_N)

    def dgrad(self, dy_TN: torch.Tensor, w_NK: torch.Tensor) -> torch.Tensor:
        return dy_TN @ w_NK

    def wgrad(self, x_TK, dy_TN, *, out=None, accumulate=False, with_dbias=False):
        db_N = column_sums(dy_TN) if with_dbias else None
        if out is None:
            return dy_TN.t() @ x_TK, db_N
        dw = dy_TN.t().to(out.dtype) @ x_TK.to(out.dtype)
        return _write(out, dw, accumulate), db_N

    # --- a group --------------------------------------------------------------------------
    def grouped_path_unsupported(self, x_TK: torch.Tensor, w_ENK: Weights) -> str | None:
        if _grouped_mm is None:
            return f"torch {torch.__version__} has no grouped_mm"
        dt = x_TK.dtype
        if torch.compiler.is_compiling() and dt != torch.bfloat16:
            return f"under torch.compile, grouped_mm's shape rule takes bfloat16 only, got {dt}"
        if x_TK.is_cuda:
            if dt != torch.bfloat16:
                return f"torch's CUDA grouped_mm takes bfloat16 only, got {dt}"
            if _capability(x_TK.device) < (8, 0):
                return "torch's CUDA grouped_mm needs compute capability >= 8.0"
        elif dt not in (torch.float32, torch.bfloat16, torch.float16):
            return f"torch's grouped_mm takes float32/bfloat16/float16, got {dt}"
        N, K = out_in(w_ENK)
        if not N or not K:
            return "grouped_mm takes no zero-size features"
        if (K * x_TK.element_size()) % 16 or (N * x_TK.element_size()) % 16:
            return f"grouped_mm needs rows of 16-byte multiples; in={K}, out={N} in {dt} are not"
        return None

    def grouped_fprop(self, x_TK, w_ENK, b_EN, splits, grouped):
        if not grouped:
            return self.split_fprop(x_TK, w_ENK, b_EN, splits)
        y_TN = _grouped_mm(x_TK, _stack(w_ENK).transpose(-2, -1), offs=splits.ends(torch.int32))
        if b_EN is not None:
            y_TN = y_TN + b_EN[_row_expert(splits)]
        return y_TN

    def grouped_dgrad(self, dy_TN, w_ENK, splits, grouped):
        if not grouped:
            return self.split_dgrad(dy_TN, w_ENK, splits)
        return _grouped_mm(dy_TN, _stack(w_ENK), offs=splits.ends(torch.int32))

    def grouped_wgrad(self, x_TK, dy_TN, splits, grouped, *, out=None, accumulate=False, with_dbias=False):
        db_EN = expert_sums(dy_TN, splits) if with_dbias else None
        dt = x_TK.dtype if out is None else out[0].dtype
        if grouped:
            dy_T, x = dy_TN.t(), x_TK
            if dt != x_TK.dtype and not x_TK.is_cuda:  # output dtype follows the inputs;
                # CUDA grouped_mm is bf16-only, so there the fp32 main_grad gets a bf16 dw
                dy_T, x = dy_T.to(dt), x.to(dt)
            dw_ENK: Sequence[torch.Tensor] = _grouped_mm(dy_T, x, offs=splits.ends(torch.int32))
        else:
            if dt != x_TK.dtype:  # fp32 main_grad: the product in its dtype
                x_TK, dy_TN = x_TK.to(dt), dy_TN.to(dt)
            dw_ENK = self.split_wgrad(x_TK, dy_TN, splits, stack=out is None)
        if out is None:
            return dw_ENK, db_EN
        for e in range(splits.num_experts):
            _write(out[e], dw_ENK[e], accumulate)
        return out, db_EN

    # --- the split path: one GEMM per expert on host sizes (custom ops under torch.compile) --
    def split_fprop(self, x_TK, w_ENK, b_EN, splits):
        xs = x_TK.split(splits.sizes())
        return torch.cat([F.linear(x, w_ENK[e], None if b_EN is None else b_EN[e]) for e, x in enumerate(xs)])

    def split_dgrad(self, dy_TN, w_ENK, splits):
        return torch.cat([dy @ w_ENK[e] for e, dy in enumerate(dy_TN.split(splits.sizes()))])

    def split_wgrad(self, x_TK, dy_TN, splits, stack):
        """E ``[N, K]`` products, as one ``[E, N, K]`` tensor when ``stack``."""
        sizes = splits.sizes()
        dw_ENK = [dy.t() @ x for x, dy in zip(x_TK.split(sizes), dy_TN.split(sizes))]
        return torch.stack(dw_ENK) if stack else dw_ENK


TORCH = TorchKernels()
