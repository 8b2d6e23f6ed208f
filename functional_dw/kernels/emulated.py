"""TE's FP8 recipes emulated in plain PyTorch (CPU and any CUDA device): the FP8 kernels of the
TE family (DelayedScaling, Float8CurrentScaling, Float8BlockScaling) on ``backend="torch"``
(NOTE: [FP8 kernels by family] in ``fp8_plan.py``).

The quantization and the products: NOTE: [FP8 emulation].
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..fp8 import QTensor, quantize as fp8_quantize, quantize_groups
from .packing import Weights
from .splits import Splits, row_expert, write
from .torch_ref import TORCH, gmm

__all__ = ["EMULATED", "EmulatedKernels", "no_dbias", "record_amax"]

# NOTE: [FP8 emulation] ``quantize``/``grouped_quantize`` are ``functional_dw.fp8``'s emulated
# quantization (TE's formulas) into :class:`~functional_dw.fp8.QTensor` (a group: a list of E, one
# per expert); a GEMM given QTensor operands dequantizes both to fp32, multiplies in fp32 (bias
# added in fp32, as cuBLASLt's epilogue adds it to the fp32 accumulator) and rounds once to the
# activations' dtype (an fp32 ``main_grad`` gets the fp32 product). Split accumulation is a
# cuBLASLt mode; the fp32 reference has nothing to split (the keyword is read and ignored). The
# per-expert and grouped products are :mod:`.torch_ref`'s, on the fp32 operands.


def _rows(q: QTensor) -> torch.Tensor:
    """The rowwise copy, dequantized to fp32 (fprop's x and W, dgrad's dy)."""
    return q.dequantize(torch.float32, columnwise=False)


def _cols(q: QTensor) -> torch.Tensor:
    """The columnwise copy, dequantized to fp32, in the source's shape (dgrad's W, wgrad's x and dy)."""
    return q.dequantize(torch.float32, columnwise=True)


def _cat(qs: Sequence[QTensor], columnwise: bool) -> torch.Tensor:
    """A group's ``[T, C]`` rows (one QTensor per expert), dequantized to fp32."""
    return torch.cat([q.dequantize(torch.float32, columnwise=columnwise) for q in qs])


def _stack32(qs: Sequence[QTensor], columnwise: bool) -> torch.Tensor:
    return torch.stack([q.dequantize(torch.float32, columnwise=columnwise) for q in qs])


def _bias_add(y32: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return y32 if b is None else y32 + b.to(torch.float32)


def no_dbias(with_dbias: bool) -> None:
    """ValueError for ``with_dbias=True`` with FP8 operands (the layer sums the bias grad itself)."""
    if with_dbias:
        raise ValueError(
            "with_dbias=True needs dy in high precision; with FP8 operands the layer sums the bias "
            "grad from its high-precision dy itself"
        )


def record_amax(amax: torch.Tensor, value: torch.Tensor) -> None:
    """``amax = max(amax, value)`` in place (TE's atomicMaxFloat into the state's history).

    Under ``torch.func`` a backward's dy (so its amax) is a functorch wrapper, which may not
    write into the state (a captured tensor). An amax is data, not differentiated: the plain
    value under the wrappers is recorded; a vmapped one (a batch of amaxes) as its max over the
    batch, what one call per element would leave in the state."""
    func = torch._C._functorch
    if func.peek_interpreter_stack() is None:
        amax.copy_(torch.maximum(amax, value.reshape(amax.shape).to(amax.device)))
        return
    while func.is_functorch_wrapped_tensor(value):
        bdim = func.maybe_get_bdim(value)
        value = func.get_unwrapped(value)
        if bdim >= 0:
            value = value.amax(dim=bdim)
    with torch._C._DisableFuncTorch():  # a plain write (a transform would refuse to mutate the state)
        amax.copy_(torch.maximum(amax, value.reshape(amax.shape).to(amax.device)))


class EmulatedKernels:
    """TE's recipes' FP8 kernels on plain PyTorch (NOTE: [FP8 emulation]): QTensor operands only
    (a group's: a list of E). ``name`` is its backend's, which ``plan.route`` reads."""

    name = "torch"
    fp8_only = True  # FP8 operands only: a bf16 call through them is refused (resolve.refuse_fp8_only)

    def __repr__(self) -> str:
        return "EmulatedKernels()"

    # --- quantization ------------------------------------------------------------------------
    def quantize(self, t: torch.Tensor, spec, *, scale=None, amax=None, rowwise=True, columnwise=False) -> QTensor:
        """``functional_dw.fp8.quantize``; with ``amax`` (a view into a delayed-scaling state) the
        tensor's amax is maxed into it, as TE's cast kernel's atomic max does."""
        q = fp8_quantize(t, spec, scale=scale, rowwise=rowwise, columnwise=columnwise)
        if amax is not None:
            record_amax(amax, q.amax)
        return q

    def grouped_quantize(
        self,
        x_TK: torch.Tensor,
        splits: Splits,
        spec,
        *,
        scales=None,
        amaxes=None,
        rowwise=True,
        columnwise=False,
        grouped=False,
    ) -> list[QTensor]:
        """Each expert's rows on their own (``quantize_groups``; host sizes, a sync for device
        splits); ``amaxes`` (E views, or one strided ``[E]`` view) get the experts' amaxes."""
        qs = quantize_groups(x_TK, splits.sizes(), spec, scales=scales, rowwise=rowwise, columnwise=columnwise)
        if amaxes is not None:
            if isinstance(amaxes, torch.Tensor):
                record_amax(amaxes, torch.cat([q.amax for q in qs]))
            else:
                for a, q in zip(amaxes, qs):
                    record_amax(a, q.amax)
        return qs

    # --- one GEMM ----------------------------------------------------------------------------
    def fprop(self, x_TK: QTensor, w_NK: QTensor, b_N: torch.Tensor | None, *, split_accumulator: bool = False):
        return _bias_add(_rows(x_TK) @ _rows(w_NK).t(), b_N).to(x_TK.dtype)

    def dgrad(self, dy_TN: QTensor, w_NK: QTensor, *, split_accumulator: bool = False) -> torch.Tensor:
        return (_rows(dy_TN) @ _cols(w_NK)).to(dy_TN.dtype)

    def wgrad(self, x_TK, dy_TN, *, out=None, accumulate=False, with_dbias=False, split_accumulator=False):
        no_dbias(with_dbias)
        dw = _cols(dy_TN).t() @ _cols(x_TK)
        return (dw.to(x_TK.dtype) if out is None else write(out, dw.to(out.dtype), accumulate)), None

    # --- a group -----------------------------------------------------------------------------
    def grouped_path_unsupported(self, x_TK: torch.Tensor, w_ENK: Weights, recipe: Any = None) -> str | None:
        """torch's verdict (``TorchKernels.grouped_path_unsupported``); on CUDA, never: the
        emulation multiplies in fp32."""
        if recipe is not None and x_TK.is_cuda:
            return "the reference FP8 emulation multiplies in fp32, which torch's CUDA grouped_mm does not take"
        return TORCH.grouped_path_unsupported(x_TK, w_ENK)

    def grouped_fprop(self, x_TK, w_ENK, b_EN, splits, grouped, *, split_accumulator=False):
        x32, w32 = _cat(x_TK, False), _stack32(w_ENK, False)
        if grouped:
            y_TN = gmm(x32, w32.transpose(-2, -1), splits.ends(torch.int32))
        else:
            y_TN = TORCH.split_fprop(x32, w32, None, splits)
        b32 = None if b_EN is None else b_EN.to(torch.float32)[row_expert(splits)]
        return _bias_add(y_TN, b32).to(x_TK[0].dtype)

    def grouped_dgrad(self, dy_TN, w_ENK, splits, grouped, *, split_accumulator=False):
        dy32, w32 = _cat(dy_TN, False), _stack32(w_ENK, True)
        if grouped:
            return gmm(dy32, w32, splits.ends(torch.int32)).to(dy_TN[0].dtype)
        return TORCH.split_dgrad(dy32, w32, splits).to(dy_TN[0].dtype)

    def grouped_wgrad(
        self, x_TK, dy_TN, splits, grouped, *, out=None, accumulate=False, with_dbias=False, split_accumulator=False
    ):
        no_dbias(with_dbias)
        x32, dy32 = _cat(x_TK, True), _cat(dy_TN, True)
        if grouped:
            dw32 = gmm(dy32.t(), x32, splits.ends(torch.int32))
        else:
            dw32 = TORCH.split_wgrad(x32, dy32, splits)
        if out is None:
            return dw32.to(x_TK[0].dtype), None
        for e in range(splits.num_experts):
            write(out[e], dw32[e].to(out[e].dtype), accumulate)
        return out, None


EMULATED = EmulatedKernels()
