"""RowwiseScaling's quantization and GEMMs (``functional_dw/fp8/rowwise.py`` defines the recipe).

On an sm_90 GPU: the Triton kernels of ``triton_rowwise.py`` quantize, and every GEMM is one
``torch._scaled_grouped_mm`` (CUTLASS, scales applied in its epilogue, bf16 out). Elsewhere
(the CPU): ``fp8.rowwise``'s torch ops quantize, and the GEMMs are emulated: both operands
dequantized to fp32 (exact: power-of-two scales times FP8 values), multiplied in fp32, rounded
once to the activations' dtype. The two agree up to the GEMM's accumulation order and the
bf16 rounding of its output (the GPU tests bound the difference).

``splits`` gives the token groups (clamped device ends, no sync: NOTE: [Device splits are
clamped]); wgrad's groups are the padded ones (NOTE: [Padded token columns]).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from ..fp8 import rowwise as ref
from ..fp8.rowwise import RowwiseActivation, RowwiseWeight
from . import Splits, Weights, packed
from . import triton_rowwise

__all__ = ["fast", "check_device", "quantize_activation", "quantize_weight", "fprop", "dgrad", "wgrad"]


@functools.lru_cache(maxsize=None)
def _sm90(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) == (9, 0)


def fast(t: torch.Tensor) -> bool:
    """Whether the CUDA kernels run on ``t``: an sm_90 GPU with Triton and torch's scaled grouped GEMM."""
    return t.is_cuda and triton_rowwise.available(t) and hasattr(torch, "_scaled_grouped_mm") and _sm90(t.device)


def check_device(x: torch.Tensor) -> None:
    """RowwiseScaling runs on the CPU (emulated) or on an sm_90 GPU in bfloat16; else ValueError/TypeError."""
    if not x.is_cuda:
        return
    if not fast(x):
        raise ValueError(f"RowwiseScaling on CUDA runs torch's rowwise-scaled grouped GEMM and Triton kernels, which "
                         f"need an sm_90 (Hopper) GPU, Triton and torch._scaled_grouped_mm; x is on {x.device}. Use "
                         "TE's recipes (Float8CurrentScaling, Float8BlockScaling), or the CPU emulation")
    if x.dtype != torch.bfloat16:
        raise TypeError(f"RowwiseScaling on CUDA takes bfloat16 activations (torch's scaled grouped GEMM writes "
                        f"bfloat16), x is {x.dtype}: cast x and the weights to bfloat16")


def _ends(splits: Splits) -> tuple[torch.Tensor, torch.Tensor]:
    """(int32 ends, int32 padded ends) of the token groups, on the device, cached on the record."""
    ends = splits.ends(torch.int32)
    return ends, splits.cached("rowwise_pends", lambda: ref.padded_ends(splits.on_device()))


def quantize_activation(t_TD: torch.Tensor, splits: Splits, spec: Any, *, rowwise: bool,
                        columnwise: bool) -> RowwiseActivation:
    """x or dy ``[T, D]`` per the recipe: the copies asked for."""
    ends, pends = _ends(splits)
    impl = triton_rowwise if fast(t_TD) else ref
    return impl.quantize_activation(t_TD, ends, pends, spec, rowwise=rowwise, columnwise=columnwise)


def quantize_weight(w_ENK: Weights, spec: Any, *, rowwise: bool, columnwise: bool) -> RowwiseWeight:
    """A group's weights (E ``[N, K]`` slices of one buffer are read in place, others stacked)."""
    if not isinstance(w_ENK, torch.Tensor):
        one = packed(w_ENK)
        w_ENK = one if one is not None else torch.stack(list(w_ENK))
    impl = triton_rowwise if fast(w_ENK) else ref
    return impl.quantize_weight(w_ENK.detach(), spec, rowwise=rowwise, columnwise=columnwise)


def _gmm(a, b, scale_a, scale_b, offs, split_accumulator: bool) -> torch.Tensor:
    return torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs=offs, out_dtype=torch.bfloat16,
                                    use_fast_accum=not split_accumulator)


def _per_expert(a32: torch.Tensor, b32_E: torch.Tensor, splits: Splits, transpose: bool) -> torch.Tensor:
    """fp32 ``a_e @ b_e^T`` (or ``a_e @ b_e``) per expert's rows (the emulation: host sizes)."""
    parts = a32.split(splits.sizes())
    return torch.cat([p @ (b32_E[e].t() if transpose else b32_E[e]) for e, p in enumerate(parts)]) if parts else a32


def _row_bias(b_EN: torch.Tensor, splits: Splits) -> torch.Tensor:
    counts = splits.on_device()
    experts = torch.arange(splits.num_experts, device=b_EN.device)
    return b_EN[torch.repeat_interleave(experts, counts, output_size=splits.num_tokens)]


def fprop(xq: RowwiseActivation, wq: RowwiseWeight, b_EN: torch.Tensor | None, splits: Splits, *,
          split_accumulator: bool) -> torch.Tensor:
    """``y_e = x_e W_e^T + b_e`` from x's and W's rowwise copies."""
    x, w = xq.rowwise_data, wq.rowwise_data
    if fast(x):
        y = _gmm(x, w.transpose(-2, -1), xq.rowwise_scale_inv, wq.rowwise_scale_inv, splits.ends(torch.int32),
                 split_accumulator)
        return y if b_EN is None else y.add_(_row_bias(b_EN, splits))
    y32 = _per_expert(x.float() * xq.rowwise_scale_inv[:, None], w.float() * wq.rowwise_scale_inv[..., None], splits,
                      transpose=True)
    if b_EN is not None:
        y32 = y32 + _row_bias(b_EN.float(), splits)
    return y32.to(xq.dtype)


def dgrad(dyq: RowwiseActivation, wq: RowwiseWeight, splits: Splits, *, split_accumulator: bool) -> torch.Tensor:
    """``dx_e = dy_e W_e`` from dy's rowwise and W's columnwise copies."""
    dy, wt = dyq.rowwise_data, wq.columnwise_data  # wt: [E, K, N]
    if fast(dy):
        return _gmm(dy, wt.transpose(-2, -1), dyq.rowwise_scale_inv, wq.columnwise_scale_inv,
                    splits.ends(torch.int32), split_accumulator)
    dx32 = _per_expert(dy.float() * dyq.rowwise_scale_inv[:, None], wt.float() * wq.columnwise_scale_inv[..., None],
                       splits, transpose=True)
    return dx32.to(dyq.dtype)


def wgrad(xq: RowwiseActivation, dyq: RowwiseActivation, splits: Splits, *, out: Weights | None, accumulate: bool,
          split_accumulator: bool) -> Weights:
    """``dW_e = dy_e^T x_e`` from both columnwise copies: a fresh ``[E, N, K]`` in the
    activations' dtype, or written (added when ``accumulate``) into ``out``."""
    ends, pends = _ends(splits)
    if fast(xq.columnwise_data):
        dw = _gmm(dyq.columnwise_data, xq.columnwise_data.t(), dyq.columnwise_scale_inv.reshape(-1),
                  xq.columnwise_scale_inv.reshape(-1), pends, split_accumulator)
    else:
        x32 = ref.dequantize_columns(xq, ends, pends)
        dy32 = ref.dequantize_columns(dyq, ends, pends)
        sizes = splits.sizes()
        dw = torch.stack([d.t() @ x for d, x in zip(dy32.split(sizes), x32.split(sizes))])
        if out is None:
            dw = dw.to(xq.dtype)
    if out is None:
        return dw
    target = out if isinstance(out, torch.Tensor) else packed(out)
    pairs = [(target, dw)] if target is not None else list(zip(out, dw))
    for t, d in pairs:
        t.add_(d) if accumulate else t.copy_(d)
    return out
