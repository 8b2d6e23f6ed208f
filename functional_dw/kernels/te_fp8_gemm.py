"""Transformer Engine's FP8 kernels: the GEMMs ``te.Linear`` / ``te.GroupedLinear`` run under
``te.autocast(recipe=...)``, call for call, on operands ``te_fp8.py`` quantized (TE's storages:
``TEQ``, ``TEQGroup``). The FP8 kernels of the TE family (DelayedScaling, Float8CurrentScaling,
Float8BlockScaling) on ``backend="te"`` (NOTE: [FP8 kernels by family] in ``fp8_plan.py``).
"""

from __future__ import annotations

from typing import Any

import torch
from transformer_engine.pytorch.cpp_extensions.gemm import (
    general_gemm,
    general_grouped_gemm,
    general_grouped_gemm_for_grouped_tensor,
)

from . import te_fp8
from .emulated import EMULATED
from .packing import Weights
from .splits import write
from .te import TE
from .te_fp8 import TEQ, TEQGroup, TEQuantized
from .te_fp8_checks import MAX_LIST, env_of, grouped_path_problem
from .te_shared import (
    check_out,
    copy_back,
    dense_out,
    host_sizes,
    offsets,
    prepare,
    stacked_dense,
    te_env,
    token_rows,
    unbatched,
    uniform,
    wgrad_out,
)

__all__ = ["TE_FP8", "TEFP8Kernels", "check_operands", "is_fp8"]


def is_fp8(operand: Any) -> bool:
    """An FP8 operand: a TEQ, a TEQGroup, or a sequence of TEQ (per-expert weights)."""
    if isinstance(operand, TEQuantized):
        return True
    return isinstance(operand, (list, tuple)) and len(operand) > 0 and isinstance(operand[0], TEQ)


def check_operands(method: str, a: Any, b: Any) -> None:
    """FP8 GEMMs take two operands TE quantized for one path; anything else is refused here."""
    if not (is_fp8(a) and is_fp8(b)):
        kinds = ", ".join("FP8" if is_fp8(o) else type(o).__name__ for o in (a, b))
        raise TypeError(
            f"{method}: both operands must be quantized by backend='te' (its quantize/grouped_quantize); got {kinds}"
        )
    if method == "grouped_wgrad" and getattr(a, "is_grouped", False) != getattr(b, "is_grouped", False):
        raise TypeError(f"{method}: x was quantized for the {'grouped' if a.is_grouped else 'split'} path, dy not")


def _group(q: Any) -> TEQuantized:
    """A group's rows: a TEQGroup or grouped TEQ as given; E TEQ (the split path's list) wrapped."""
    if isinstance(q, TEQuantized):
        return q
    parts = list(q)
    return TEQGroup(parts, (sum(p.shape[0] for p in parts), parts[0].shape[1]), parts[0].dtype)


def _weights(ws: Any, grouped: bool) -> tuple[list, int, int]:
    """(storages, N, K) of per-expert FP8 weights: a sequence of TEQ, or a split-path TEQGroup."""
    ws = ws.parts if isinstance(ws, TEQGroup) else list(ws)
    if not all(isinstance(w, TEQ) and not w.is_grouped for w in ws):
        raise TypeError("FP8 weights must be E per-expert TEQ (one quantize per expert's weight)")
    if grouped and len(ws) > MAX_LIST:
        raise ValueError(
            f"TE's FP8 grouped GEMM takes at most {MAX_LIST} per-expert weights, got {len(ws)}: "
            "run the split path (use_grouped_tensor=False)"
        )
    return [w.storage for w in ws], *ws[0].shape


def _bias(b: torch.Tensor | None, dtype: torch.dtype):
    """cuBLASLt's FP8 GEMMs take no fp32 bias: TE casts it to bf16 with fp32 activations."""
    return None if b is None else b.to(torch.bfloat16 if dtype == torch.float32 else dtype).contiguous()


def _fprop(x: TEQ, w: TEQ, b, split_accumulator: bool) -> torch.Tensor:
    """te.Linear's forward GEMM (TN, bias in the epilogue)."""
    prepare(x.storage.device)
    y, *_ = general_gemm(
        w.storage, x.storage, out_dtype=x.dtype, bias=_bias(b, x.dtype), use_split_accumulator=split_accumulator
    )
    return y


def _dgrad(dy: TEQ, w: TEQ, split_accumulator: bool) -> torch.Tensor:
    """te.Linear's dgrad (NN, grad=True): dy rowwise, W columnwise."""
    prepare(dy.storage.device)
    dx, *_ = general_gemm(
        w.storage, dy.storage, out_dtype=dy.dtype, layout="NN", grad=True, use_split_accumulator=split_accumulator
    )
    return dx


def _wgrad(x: TEQ, dy: TEQ, out, accumulate: bool, with_dbias: bool, split_accumulator: bool):
    """te.Linear's wgrad (NT, grad=True, no fused bias grad under FP8), into ``out`` (main_grad)."""
    if out is not None:
        check_out(out)
    prepare(x.storage.device)
    accumulate = accumulate and out is not None
    dense = None if out is None else dense_out(out, accumulate)
    dw, *_ = general_gemm(
        x.storage,
        dy.storage,
        out_dtype=x.dtype if out is None else out.dtype,
        layout="NT",
        grad=True,
        out=dense,
        accumulate=accumulate,
        use_split_accumulator=split_accumulator,
    )
    if out is not None:
        copy_back([out], [dense])
        dw = out
    return dw, (dy.bias_grad() if with_dbias else None)


def _grouped_fprop(x: TEQuantized, ws, b_EN, splits, split_accumulator: bool) -> torch.Tensor:
    """te.GroupedLinear's forward: the grouped GEMM (bias added after it, by TE) or one GEMM per expert."""
    x = _group(x)
    E, (w, N, K) = splits.num_experts, _weights(ws, x.is_grouped)
    y = torch.empty(splits.num_tokens, N, dtype=x.dtype, device=splits.device)
    if x.is_grouped:
        prepare(y.device, E, grouped=True)
        sizes_E, _, _, offs_N = offsets(splits, K, N)
        bias = None if b_EN is None else uniform(stacked_dense(b_EN).to(x.dtype), E, (1, N))
        general_grouped_gemm_for_grouped_tensor(
            w,
            x.storage,
            token_rows(y, sizes_E, offs_N),
            layout="TN",
            bias=bias,
            use_split_accumulator=split_accumulator,
        )
        return y
    prepare(y.device, E)
    bias = None if b_EN is None else list(_bias(b_EN, x.dtype))
    general_grouped_gemm(
        w,
        [p.storage for p in x.parts],
        [y],
        [None] * E,
        x.dtype,
        single_output=True,
        m_splits=host_sizes(splits),
        bias=bias,
        use_bias=b_EN is not None,
        use_split_accumulator=split_accumulator,
    )
    return y


def _grouped_dgrad(dy: TEQuantized, ws, splits, split_accumulator: bool) -> torch.Tensor:
    dy = _group(dy)
    E, (w, N, K) = splits.num_experts, _weights(ws, dy.is_grouped)
    dx = torch.empty(splits.num_tokens, K, dtype=dy.dtype, device=splits.device)
    if dy.is_grouped:
        prepare(dx.device, E, grouped=True)
        sizes_E, _, offs_K, _ = offsets(splits, K, N)
        general_grouped_gemm_for_grouped_tensor(
            w, dy.storage, token_rows(dx, sizes_E, offs_K), layout="NN", use_split_accumulator=split_accumulator
        )
        return dx
    prepare(dx.device, E)
    general_grouped_gemm(
        w,
        [p.storage for p in dy.parts],
        [dx],
        [None] * E,
        dy.dtype,
        single_output=True,
        layout="NN",
        m_splits=host_sizes(splits),
        grad=True,
        use_split_accumulator=split_accumulator,
    )
    return dx


def _grouped_wgrad(
    x: TEQuantized, dy: TEQuantized, splits, out, accumulate: bool, with_dbias: bool, split_accumulator: bool
):
    """As ``TEKernels.grouped_wgrad`` (fresh [E, N, K], or into main_grads; strided ones via dense copies)."""
    x, dy = _group(x), _group(dy)
    E, K, N = splits.num_experts, x.shape[1], dy.shape[1]
    if out is not None:
        check_out(out)
    accumulate = accumulate and out is not None
    dw = out if out is not None else torch.empty(E, N, K, dtype=x.dtype, device=splits.device)
    stacked = isinstance(dw, torch.Tensor)
    dense = dense_out(dw, accumulate) if stacked else [dense_out(t, accumulate) for t in dw]
    targets = list(dense)  # E [N, K], written in place (te.GroupedLinear: wgrad_packed[i] or main_grads)
    if x.is_grouped:
        prepare(splits.device, E, grouped=True)
        D, scratch = wgrad_out(dense, targets, stacked=stacked)
        general_grouped_gemm_for_grouped_tensor(
            x.storage,
            dy.storage,
            D,
            layout="NT",
            accumulate=accumulate and scratch is None,
            use_split_accumulator=split_accumulator,
        )
        for t, s in zip(targets, [] if scratch is None else scratch):
            write(t, s, accumulate)
    else:  # an expert without tokens gets zeros (main_grad untouched when accumulating), as in TE
        prepare(splits.device, E)
        general_grouped_gemm(
            [p.storage for p in x.parts],
            [p.storage for p in dy.parts],
            targets,
            [None] * E,
            x.dtype,
            layout="NT",
            grad=True,
            m_splits=host_sizes(splits),
            accumulate=accumulate,
            use_split_accumulator=split_accumulator,
        )
    copy_back([dw] if stacked else dw, [dense] if stacked else dense)
    return dw, (dy.bias_grad() if with_dbias else None)


class TEFP8Kernels:
    """TE's FP8 kernels: ``quantize``/``quantize_each``/``grouped_quantize`` (``te_fp8.py``) and
    the GEMMs on their storages (both operands quantized by them, for one path). ``name`` is
    its backend's; under a transform the layers run ``reference`` (``plan.route``, NOTE:
    [Transforms without a rule]): the emulation, since TE's C++ reads raw pointers."""

    name = "te"
    fp8_only = True  # FP8 operands only: a bf16 call through them is refused (resolve.refuse_fp8_only)
    reference = EMULATED

    def __repr__(self) -> str:
        return "TEFP8Kernels()"

    def prepare(self, device: torch.device | str | int, num_experts: int | None = None, grouped: bool = False) -> None:
        """TE's workspaces (``te_shared.prepare``), as ``TEKernels.prepare``."""
        prepare(device, num_experts, grouped)

    # --- quantization (te_fp8) -----------------------------------------------------------------
    def quantize(self, t, spec, *, scale=None, amax=None, rowwise=True, columnwise=False, with_dbias=False):
        return te_fp8.quantize(
            t, spec, scale=scale, amax=amax, rowwise=rowwise, columnwise=columnwise, with_dbias=with_dbias
        )

    def quantize_each(self, ts, spec, *, scales=None, amaxes=None, rowwise=True, columnwise=False):
        return te_fp8.quantize_each(ts, spec, scales=scales, amaxes=amaxes, rowwise=rowwise, columnwise=columnwise)

    def grouped_quantize(
        self,
        x_TK,
        splits,
        spec,
        *,
        scales=None,
        amaxes=None,
        rowwise=True,
        columnwise=False,
        grouped=False,
        with_dbias=False,
    ):
        return te_fp8.grouped_quantize(
            x_TK,
            splits,
            spec,
            scales=scales,
            amaxes=amaxes,
            rowwise=rowwise,
            columnwise=columnwise,
            grouped=grouped,
            with_dbias=with_dbias,
        )

    # --- one GEMM (te.Linear) ----------------------------------------------------------------
    @unbatched
    def fprop(self, x_TK, w_NK, b_N, *, split_accumulator: bool = False) -> torch.Tensor:
        check_operands("fprop", x_TK, w_NK)
        return _fprop(x_TK, w_NK, b_N, split_accumulator)

    @unbatched
    def dgrad(self, dy_TN, w_NK, *, split_accumulator: bool = False) -> torch.Tensor:
        check_operands("dgrad", dy_TN, w_NK)
        return _dgrad(dy_TN, w_NK, split_accumulator)

    @unbatched
    def wgrad(self, x_TK, dy_TN, *, out=None, accumulate=False, with_dbias=False, split_accumulator=False):
        check_operands("wgrad", x_TK, dy_TN)
        return _wgrad(x_TK, dy_TN, out, accumulate, with_dbias, split_accumulator)

    # --- a group (te.GroupedLinear) ------------------------------------------------------------
    def grouped_path_unsupported(self, x_TK: torch.Tensor, w_ENK: Weights, recipe: Any = None) -> str | None:
        """TE's bf16 checks (``TEKernels.grouped_path_unsupported``), then
        ``is_module_grouped_tensor_path_supported``'s for the FP8 ``recipe`` (``te_fp8_checks``)."""
        why = TE.grouped_path_unsupported(x_TK, w_ENK)
        if why is not None or recipe is None:
            return why
        cc, have = te_env(x_TK.device.index if x_TK.device.index is not None else torch.cuda.current_device())
        E = w_ENK.shape[0] if isinstance(w_ENK, torch.Tensor) else len(w_ENK)
        return grouped_path_problem(recipe, env_of(cc, have), E)

    @unbatched
    def grouped_fprop(self, x_TK, w_ENK, b_EN, splits, grouped, *, split_accumulator=False):
        check_operands("grouped_fprop", x_TK, w_ENK)  # (the path is the one x was quantized for)
        return _grouped_fprop(x_TK, w_ENK, b_EN, splits, split_accumulator)

    @unbatched
    def grouped_dgrad(self, dy_TN, w_ENK, splits, grouped, *, split_accumulator=False):
        check_operands("grouped_dgrad", dy_TN, w_ENK)
        return _grouped_dgrad(dy_TN, w_ENK, splits, split_accumulator)

    @unbatched
    def grouped_wgrad(
        self, x_TK, dy_TN, splits, grouped, *, out=None, accumulate=False, with_dbias=False, split_accumulator=False
    ):
        check_operands("grouped_wgrad", x_TK, dy_TN)
        return _grouped_wgrad(x_TK, dy_TN, splits, out, accumulate, with_dbias, split_accumulator)


TE_FP8 = TEFP8Kernels()
