"""Transformer Engine 2.20 kernels: the GEMMs ``te.Linear`` and ``te.GroupedLinear`` run, called
with the same arguments (bitwise equal results, except the atomics-based grouped bias grad).

Legend: ``T`` tokens, ``K`` in-features, ``N`` out-features, ``E`` experts; a suffix names a
tensor's dims (``x_TK`` is ``[T, K]``, ``offs_E1`` is ``[E + 1]``). ``w_ENK`` is E ``[N, K]``
tensors or one ``[E, N, K]`` tensor.

* ``fprop`` / ``dgrad`` / ``wgrad``: ``general_gemm`` TN / NN / NT; bias in the fprop epilogue,
  bias grad fused into the wgrad GEMM, ``out=main_grad`` for fused accumulation.
* ``grouped_*`` split path: ``general_grouped_gemm``, one cuBLASLt call per expert on host sizes.
* ``grouped_*`` grouped path: ``general_grouped_gemm_for_grouped_tensor``, one kernel; the split
  sizes and every offset stay on the device (no sync, CUDA-graph safe).
* The operands are float32/bfloat16/float16 tensors; FP8 operands go to TE's FP8 kernels
  (``te_fp8_gemm.py``; NOTE: [FP8 kernels by family] in ``fp8_plan.py``). What both share (the
  workspaces, the grouped operands, the guard): ``te_shared.py``.
"""

from __future__ import annotations

import torch
import transformer_engine.pytorch  # noqa: F401  (loads libtransformer_engine before the extension)
from transformer_engine.pytorch.cpp_extensions.gemm import (
    general_gemm,
    general_grouped_gemm,
    general_grouped_gemm_for_grouped_tensor,
)
from transformer_engine.pytorch.module.base import _2X_ACC_DGRAD, _2X_ACC_FPROP, _2X_ACC_WGRAD
from transformer_engine.pytorch.tensor.storage.grouped_tensor_storage import GroupedTensorStorage

from .packing import Weights, out_in, packed
from .splits import row_expert, write
from .te_shared import (
    MAX_LIST,
    check_out,
    copy_back,
    dense_out,
    grouped_dbias,
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

__all__ = ["TE", "TEKernels"]


def _dense_list(w_ENK: Weights) -> list[torch.Tensor]:
    """E contiguous ``[N, K]`` tensors (TE's C++ reads a pointer and a shape, not strides)."""
    if isinstance(w_ENK, torch.Tensor):
        return list(w_ENK.contiguous())
    return [w.contiguous() for w in w_ENK]


class TEKernels:
    """TE's bf16 kernels: float32/bfloat16/float16 tensor operands (FP8: ``te_fp8_gemm.TEFP8Kernels``)."""

    name = "te"

    def __repr__(self) -> str:
        return "TEKernels()"

    def prepare(self, device: torch.device | str | int, num_experts: int | None = None, grouped: bool = False) -> None:
        """Allocate TE's cached workspaces on ``device`` (``te_shared.prepare``; NOTE: [Workspaces
        before CUDA graph capture]): the single GEMM's; with ``num_experts`` the split path's, or
        with ``grouped=True`` the grouped path's. Runs on first use."""
        prepare(device, num_experts, grouped)

    # --- one GEMM (te.Linear) -------------------------------------------------------------
    @unbatched
    def fprop(
        self, x_TK: torch.Tensor, w_NK: torch.Tensor, b_N: torch.Tensor | None, *, split_accumulator: bool = False
    ) -> torch.Tensor:
        self.prepare(x_TK.device)
        b_N = None if b_N is None else b_N.contiguous()
        y_TN, *_ = general_gemm(
            w_NK.contiguous(), x_TK, out_dtype=x_TK.dtype, bias=b_N, use_split_accumulator=_2X_ACC_FPROP
        )
        return y_TN

    @unbatched
    def dgrad(self, dy_TN: torch.Tensor, w_NK: torch.Tensor, *, split_accumulator: bool = False) -> torch.Tensor:
        self.prepare(dy_TN.device)
        dx_TK, *_ = general_gemm(
            w_NK.contiguous(),
            dy_TN,
            out_dtype=dy_TN.dtype,
            layout="NN",
            grad=True,
            use_split_accumulator=_2X_ACC_DGRAD,
        )
        return dx_TK

    @unbatched
    def wgrad(self, x_TK, dy_TN, *, out=None, accumulate=False, with_dbias=False, split_accumulator=False):
        if out is not None:
            check_out(out)
        self.prepare(x_TK.device)
        # NOTE: with grad=True the bias tensor's values are ignored; passing one switches on the
        # fused bias grad (BGRADB epilogue), in the GEMM's output dtype (fp32 into main_grad).
        accumulate = accumulate and out is not None
        dense = None if out is None else dense_out(out, accumulate)  # a strided main_grad: via a copy
        dw_NK, db_N, *_ = general_gemm(
            x_TK,
            dy_TN,
            out_dtype=x_TK.dtype if out is None else out.dtype,
            layout="NT",
            grad=True,
            out=dense,
            accumulate=accumulate,
            bias=dy_TN.new_empty(dy_TN.shape[-1]) if with_dbias else None,
            use_split_accumulator=_2X_ACC_WGRAD,
        )
        if out is not None:
            copy_back([out], [dense])
            dw_NK = out
        return dw_NK, (db_N.to(dy_TN.dtype) if with_dbias else None)

    # --- a group (te.GroupedLinear) -------------------------------------------------------
    def grouped_path_unsupported(self, x_TK: torch.Tensor, w_ENK: Weights) -> str | None:
        """The checks of TE's ``is_module_grouped_tensor_path_supported`` for BF16 (FP8's:
        ``te_fp8_gemm.py``), plus alignment: each expert's rows must start 16-byte aligned."""
        dt = x_TK.dtype
        if dt not in (torch.bfloat16, torch.float16):
            return f"TE's grouped GEMM takes bfloat16 or float16 activations, got {dt}"
        cc, have = te_env(x_TK.device.index if x_TK.device.index is not None else torch.cuda.current_device())
        if not (9, 0) <= cc <= (11, 0):
            return f"TE's grouped GEMM needs compute capability 9.0 to 11.0 (Hopper, Blackwell); this GPU is {cc[0]}.{cc[1]}"
        need = 130400 if cc < (10, 0) else 130300
        if have < need:
            ver = lambda v: f"{v // 10000}.{v // 100 % 100}.{v % 100}"  # noqa: E731
            return (
                f"cuBLASLt {ver(have)} is too old for TE's grouped GEMM, which needs cuBLAS >= {ver(need)} "
                f"on {'Hopper' if cc < (10, 0) else 'this GPU'}: install a newer cuBLAS (CUDA 13 toolkit or "
                "the nvidia-cublas wheel) and make sure it is the one loaded (LD_LIBRARY_PATH or LD_PRELOAD)"
            )
        N, K = out_in(w_ENK)
        if not N or not K or K % 8 or N % 8:
            return f"TE's grouped GEMM needs in/out features that are multiples of 8 (16-byte aligned rows); got in={K}, out={N}"
        return None

    @unbatched
    def grouped_fprop(self, x_TK, w_ENK, b_EN, splits, grouped, *, split_accumulator=False):
        E, (N, K) = splits.num_experts, out_in(w_ENK)
        y_TN = x_TK.new_empty(x_TK.shape[0], N)
        if grouped and splits.num_tokens:
            self.prepare(x_TK.device, E, grouped=True)
            sizes_E, _, offs_K, offs_N = offsets(splits, K, N)
            # NOTE: the grouped kernel has no bias epilogue: TE adds the bias after the GEMM
            # (nvte_grouped_bias_add, output already rounded), as te.GroupedLinear does. That
            # add takes at most 64 groups, so beyond 64 we add it the same way ourselves
            # (y + b in fp32, rounded once): a row->expert gather on the device, no sync.
            te_bias = b_EN is not None and E <= MAX_LIST
            general_grouped_gemm_for_grouped_tensor(
                self._weights(w_ENK),
                token_rows(x_TK, sizes_E, offs_K),
                token_rows(y_TN, sizes_E, offs_N),
                layout="TN",
                bias=uniform(stacked_dense(b_EN), E, (1, N)) if te_bias else None,
                use_split_accumulator=_2X_ACC_FPROP,
            )
            if b_EN is not None and not te_bias:
                y_TN.add_(stacked_dense(b_EN)[row_expert(splits)])
            return y_TN
        self.prepare(x_TK.device, E)
        sizes = host_sizes(splits)
        general_grouped_gemm(
            _dense_list(w_ENK),
            list(x_TK.split(sizes)),
            [y_TN],
            [None] * E,
            x_TK.dtype,
            single_output=True,
            m_splits=sizes,
            bias=None if b_EN is None else list(b_EN.contiguous()),
            use_bias=b_EN is not None,
            use_split_accumulator=_2X_ACC_FPROP,
        )
        return y_TN

    @unbatched
    def grouped_dgrad(self, dy_TN, w_ENK, splits, grouped, *, split_accumulator=False):
        E, (N, K) = splits.num_experts, out_in(w_ENK)
        dx_TK = dy_TN.new_empty(dy_TN.shape[0], K)
        if grouped and splits.num_tokens:
            self.prepare(dy_TN.device, E, grouped=True)
            sizes_E, _, offs_K, offs_N = offsets(splits, K, N)
            general_grouped_gemm_for_grouped_tensor(
                self._weights(w_ENK),
                token_rows(dy_TN, sizes_E, offs_N),
                token_rows(dx_TK, sizes_E, offs_K),
                layout="NN",
                use_split_accumulator=_2X_ACC_DGRAD,
            )
            return dx_TK
        self.prepare(dy_TN.device, E)
        sizes = host_sizes(splits)
        general_grouped_gemm(
            _dense_list(w_ENK),
            list(dy_TN.split(sizes)),
            [dx_TK],
            [None] * E,
            dy_TN.dtype,
            single_output=True,
            layout="NN",
            m_splits=sizes,
            grad=True,
            use_split_accumulator=_2X_ACC_DGRAD,
        )
        return dx_TK

    @unbatched
    def grouped_wgrad(
        self, x_TK, dy_TN, splits, grouped, *, out=None, accumulate=False, with_dbias=False, split_accumulator=False
    ):
        E, K, N = splits.num_experts, x_TK.shape[1], dy_TN.shape[1]
        if out is not None:
            check_out(out)
        grouped = grouped and splits.num_tokens > 0
        accumulate = accumulate and out is not None
        # NOTE: torch.empty, as te.GroupedLinear: both paths write zeros for a zero-token expert
        # (TE's split path zero-fills it; the grouped GEMM computes its K=0 product as zeros,
        # measured on the H200 with benchmarks/probe_zero_experts.py; tested in test_te_gpu.py).
        dw = out if out is not None else x_TK.new_empty(E, N, K)
        if isinstance(dw, torch.Tensor):  # a strided [E, N, K] main_grad: through a dense copy
            dense = dense_out(dw, accumulate)
            db = self._grouped_wgrad(
                x_TK, dy_TN, splits, grouped, dense, accumulate, with_dbias, stacked=out is not None
            )
            copy_back([dw], [dense])
            return dw, db
        dense = [dense_out(t, accumulate) for t in dw]  # strided main_grads: through dense copies
        db = self._grouped_wgrad(x_TK, dy_TN, splits, grouped, dense, accumulate, with_dbias, stacked=False)
        copy_back(dw, dense)
        return dw, db

    def _grouped_wgrad(self, x_TK, dy_TN, splits, grouped, dw, accumulate, with_dbias, stacked):
        """:meth:`grouped_wgrad` into ``dw`` (contiguous: one [E, N, K] or E [N, K]); db_EN."""
        E, K, N = splits.num_experts, x_TK.shape[1], dy_TN.shape[1]
        if grouped and isinstance(dw, torch.Tensor) and dw.is_contiguous():  # one [E, N, K]: one uniform operand
            stacked, targets = True, None
        else:
            targets = list(dw)  # E [N, K] tensors (views of dw, or the caller's), written in place
        if not grouped:
            self.prepare(x_TK.device, E)
            sizes = host_sizes(splits)
            _, db_E, _ = general_grouped_gemm(
                list(x_TK.split(sizes)),
                list(dy_TN.split(sizes)),
                targets,
                [None] * E,
                x_TK.dtype,
                layout="NT",
                grad=True,
                m_splits=sizes,
                use_bias=with_dbias,
                accumulate=accumulate,
                use_split_accumulator=_2X_ACC_WGRAD,
            )  # bias grads come in the output dtype (fp32 into main_grad); empty experts get zeros
            return torch.stack(db_E).to(dy_TN.dtype) if with_dbias else None
        self.prepare(x_TK.device, E, grouped=True)
        sizes_E, rows_E1, offs_K, offs_N = offsets(splits, K, N)
        db_EN = grouped_dbias(dy_TN, splits, rows_E1) if with_dbias else None
        D, scratch = wgrad_out(dw, targets, stacked=stacked)
        # NOTE: fp32 main_grad from bf16/fp16 inputs is supported by the grouped kernel (outputs
        # may be bf16, fp16 or fp32); accumulate=True makes TE pass beta = 1 (D += dy^T x).
        general_grouped_gemm_for_grouped_tensor(
            token_rows(x_TK, sizes_E, offs_K),
            token_rows(dy_TN, sizes_E, offs_N),
            D,
            layout="NT",
            accumulate=accumulate and scratch is None,
            use_split_accumulator=_2X_ACC_WGRAD,
        )
        if scratch is not None:
            for t, s in zip(targets, scratch):
                write(t, s, accumulate)
        return db_EN

    # --- grouped-path operands ------------------------------------------------------------
    def _weights(self, w_ENK: Weights) -> list[torch.Tensor] | GroupedTensorStorage:
        """One uniform GroupedTensor over one buffer (a stacked [E, N, K], or E weights that are
        its consecutive slices: nn.GroupedLinear's, NOTE: [One buffer]) or beyond 64 experts (one
        stack); else the list (discrete_in, as te.GroupedLinear). Measured on the H200: the list
        form ran the module layout up to 1.3x slower than the uniform one at E=32."""
        if not isinstance(w_ENK, torch.Tensor):
            one = packed(w_ENK)
            if one is not None:
                return uniform(one, one.shape[0], tuple(one.shape[1:]))
        if not isinstance(w_ENK, torch.Tensor) and len(w_ENK) <= MAX_LIST:
            return [w.contiguous() for w in w_ENK]
        w = stacked_dense(w_ENK)
        return uniform(w, w.shape[0], tuple(w.shape[1:]))


TE = TEKernels()
