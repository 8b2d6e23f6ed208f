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
* FP8: ``quantize`` / ``grouped_quantize`` give TE storages (``te_fp8.TEQ`` / ``TEQGroup``); each
  GEMM method given them runs the FP8 call of ``te_fp8`` instead (the first lines of each method).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence

import torch
import transformer_engine.pytorch  # noqa: F401  (loads libtransformer_engine before the extension)
import transformer_engine_torch as tex
from transformer_engine.pytorch.cpp_extensions import gemm as te_gemm
from transformer_engine.pytorch.cpp_extensions.gemm import (
    general_gemm,
    general_grouped_gemm,
    general_grouped_gemm_for_grouped_tensor,
    get_cublas_workspace,
)
from transformer_engine.pytorch.module.base import _2X_ACC_DGRAD, _2X_ACC_FPROP, _2X_ACC_WGRAD
from transformer_engine.pytorch.tensor.storage.grouped_tensor_storage import GroupedTensorStorage
from transformer_engine.pytorch.utils import _empty_tensor

from .packing import Weights, out_in, packed, stacked
from .splits import Splits
from .te_fp8_checks import env_of, grouped_path_problem
from .torch_ref import expert_sums, _row_expert, _write

try:  # TE's Triton kernel for per-expert bias grads (what GroupedLinear's grouped path uses)
    from transformer_engine.pytorch.triton.grouped_dbias_dscales import compute_grouped_dbias
except Exception:  # no Triton: fall back to the reference's device-side index_add_
    compute_grouped_dbias = None

__all__ = ["TE", "TEKernels"]

# NOTE: [64 tensors per kernel]
#   The grouped kernel takes list operands (per-expert weights, per-expert wgrad outputs) for at
#   most 64 experts (``kMaxGroups``); a single GroupedTensor operand has no limit. Up to 64 we
#   pass lists exactly as te.GroupedLinear does (bitwise parity). Beyond 64 we pass one uniform
#   [E, N, K] GroupedTensor instead: a zero-copy view when the tensors are consecutive slices of
#   one buffer (nn.GroupedLinear's parameters, Megatron's contiguous main_grad buffer: NOTE: [One
#   buffer]), else a stacked copy (weights) or a scratch output that is then added/copied into
#   the caller's tensors (scattered main_grads). (Calls on chunks of <= 64 experts with sliced device offsets would
#   also avoid a sync, but rely on offsets not starting at 0, which TE does not promise.)
_MAX_LIST = 64


def _dense_list(w_ENK: Weights) -> list[torch.Tensor]:
    """E contiguous ``[N, K]`` tensors (TE's C++ reads a pointer and a shape, not strides)."""
    if isinstance(w_ENK, torch.Tensor):
        return list(w_ENK.contiguous())
    return [w.contiguous() for w in w_ENK]


def _dense_out(out: torch.Tensor, accumulate: bool) -> torch.Tensor:
    """A contiguous stand-in for a strided output (e.g. a transposed main_grad view): its
    values when accumulating, else fresh. The caller copies it back (:func:`_copy_back`)."""
    if out.is_contiguous():
        return out
    return out.contiguous() if accumulate else torch.empty(out.shape, dtype=out.dtype, device=out.device)


def _copy_back(outs: Sequence[torch.Tensor], dense: Sequence[torch.Tensor]) -> None:
    for o, d in zip(outs, dense):
        if d is not o:
            o.copy_(d)


def _stacked(w_ENK: Weights) -> torch.Tensor:
    return w_ENK.contiguous() if isinstance(w_ENK, torch.Tensor) else stacked(w_ENK)


def _uniform(data: torch.Tensor, E: int, shape: tuple[int, int]) -> GroupedTensorStorage:
    """E same-shape members packed in ``data`` (contiguous; wrapped, not copied)."""
    rows, cols = shape
    return GroupedTensorStorage(
        shape=(E * rows, cols),
        dtype=data.dtype,
        num_tensors=E,
        shapes=[tuple(shape)] * E,
        quantizer=None,
        data=data.reshape(-1),
    )


def _rows(data_TC: torch.Tensor, sizes_E: torch.Tensor, offs_E1: torch.Tensor) -> GroupedTensorStorage:
    """Token rows split by expert: what ``_GroupedLinear._make_grouped_tensor`` builds."""
    return GroupedTensorStorage(
        shape=tuple(data_TC.shape),
        dtype=data_TC.dtype,
        num_tensors=sizes_E.shape[0],
        quantizer=None,
        data=data_TC.reshape(-1),
        first_dims=sizes_E,
        tensor_offsets=offs_E1,
    )


def _offsets(splits: Splits, K: int, N: int) -> tuple[torch.Tensor, ...]:
    """(sizes_E, rows_E1, elems_K_E1, elems_N_E1): int64, on the device, one kernel, no sync;
    cached on the Splits record so forward and backward compute them once."""

    def make() -> tuple[torch.Tensor, ...]:
        sizes_E, offs = tex.splits_to_offsets_multi(
            splits.on_device().contiguous(),
            splits.device,
            strides=[1, K, N],
            include_leading_zero=[True, True, True],
            dtypes=[torch.int64] * 3,
            bulk_allocate=True,
        )
        return (sizes_E, *offs)

    return splits.cached(("te_offsets", K, N), make)


def _host_sizes(splits: Splits) -> list[int]:
    return [0] * splits.num_experts if splits.num_tokens == 0 else list(splits.sizes())


def _grouped_dbias(dy_TN: torch.Tensor, splits: Splits, rows_E1: torch.Tensor) -> torch.Tensor:
    """db_EN in dy's dtype, accumulated in fp32 on the device (no sync)."""
    # NOTE: TE's Triton kernel (te.GroupedLinear's choice) adds partial sums with fp32 atomics,
    # so its last bits can vary run to run; under NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 TE refuses
    # it, and we take the reference's index_add_ instead.
    if compute_grouped_dbias is not None and bool(int(os.getenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "1"))):
        return compute_grouped_dbias(dy_TN, rows_E1, splits.num_experts).to(dy_TN.dtype)
    return expert_sums(dy_TN, splits)


def _check_out(out) -> None:
    """TE's GEMMs write float32, bfloat16 or float16: refuse another main_grad dtype up front."""
    dt = (out if isinstance(out, torch.Tensor) else out[0]).dtype
    if dt not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(
            f"main_grad is {dt}, but backend='te' writes float32/bfloat16/float16 weight grads: "
            "use a float32 main_grad, or backend='torch' (which accumulates in main_grad's dtype)"
        )


def _wrapped(*operands) -> bool:
    """True if an operand is a functorch wrapper (vmap's batched or jvp/grad's tracking tensor)."""
    if torch._C._functorch.peek_interpreter_stack() is None:
        return False  # no transform active: the common, fast case
    leaves = [t for o in operands for t in (o if isinstance(o, (list, tuple)) else [o])]
    return any(isinstance(t, torch.Tensor) and torch._C._functorch.is_functorch_wrapped_tensor(t) for t in leaves)


def _in_create_graph_backward() -> bool:
    """Inside a backward pass that records a graph (create_graph=True)."""
    return torch.is_grad_enabled() and torch._C._current_graph_task_id() != -1


def _requires_grad(*operands) -> bool:
    leaves = [t for o in operands for t in (o if isinstance(o, (list, tuple)) else [o])]
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in leaves)


def _unbatched(method):
    """TE's C++ kernels read raw pointers, so they cannot take functorch's wrapper tensors: the
    layers route such products to the reference kernels (``plan.route``, NOTE: [Transforms
    without a rule]); one reaching TE is a bug, refused here rather than computed wrong. Also
    refuses a backward that records a graph through TE's GEMMs."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        if _wrapped(*args, *kwargs.values()):
            raise RuntimeError(
                f"functional_dw internal error: a torch.func wrapper reached TE's {method.__name__}; "
                "the layer should have routed it to the reference kernels (plan.route)"
            )
        if _in_create_graph_backward() and _requires_grad(*args, *kwargs.values()):
            raise RuntimeError(
                "functional_dw: differentiating through TE's GEMMs (a backward with create_graph=True, "
                "grad of grad) is not supported: TE's kernels have no derivative of their own, so the "
                "higher-order gradient would be silently missing. Use backend='torch' for it."
            )
        return method(self, *args, **kwargs)

    return run


# Facts of the machine, read once at import: plain constants to dynamo (which cannot call the
# pybind version query) and to the per-call path check.
_CUBLASLT = tex.get_cublasLt_version()
_CAPABILITY = [torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())]


def _te_env(device_index: int) -> tuple[tuple[int, int], int]:
    """(compute capability, cuBLASLt version)."""
    return _CAPABILITY[device_index], _CUBLASLT


class TEKernels:
    name = "te"

    def __init__(self) -> None:
        self._prepared: set[tuple] = set()

    def __repr__(self) -> str:
        return "TEKernels()"

    # NOTE: [Workspaces before CUDA graph capture]
    #   TE caches its cuBLAS workspaces, the grouped GEMM's setup workspace and its alpha/beta
    #   scalars (torch.ones/zeros) on first use. Made inside a capture, the scalars would be
    #   filled only on replay, so ``prepare`` makes them eagerly and refuses to run in a capture.
    def prepare(self, device: torch.device | str | int, num_experts: int | None = None, grouped: bool = False) -> None:
        """Allocate TE's cached workspaces on ``device``: the single GEMM's; with ``num_experts``
        the split path's, or with ``grouped=True`` the grouped path's. Runs on first use."""
        device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        idx = torch.cuda.current_device() if device.index is None else device.index
        key = (idx, num_experts, grouped)
        if key in self._prepared:
            return
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "functional_dw's TE kernels were first used inside CUDA graph capture: run one eager "
                f"step first, or call functional_dw.kernels.te.TE.prepare({device}, num_experts={num_experts}, "
                f"grouped={grouped}) before capturing"
            )
        with torch.cuda.device(idx):
            get_cublas_workspace(idx, False, False)
            if num_experts is not None and not grouped:
                get_cublas_workspace(idx, False, True)  # one per internal stream
                _empty_tensor()
            if num_experts is not None and grouped:
                for layout in ("TN", "NN", "NT"):
                    te_gemm._get_grouped_cublas_workspace(idx, layout)
                te_gemm._get_grouped_gemm_setup_workspace(idx, num_experts)
                n = num_experts if torch.cuda.get_device_capability(idx) >= (10, 0) else 1
                te_gemm._get_fp32_ones_tensor(n, torch.device("cuda", idx))
                te_gemm._get_fp32_zeros_tensor(n, torch.device("cuda", idx))
        self._prepared.add(key)

    # --- FP8 (te_fp8): TE's quantization; GEMM methods given its storages run te_fp8's calls ---
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

    # --- one GEMM (te.Linear) -------------------------------------------------------------
    @_unbatched
    def fprop(
        self, x_TK: torch.Tensor, w_NK: torch.Tensor, b_N: torch.Tensor | None, *, split_accumulator: bool = False
    ) -> torch.Tensor:
        if te_fp8.is_fp8(x_TK) or te_fp8.is_fp8(w_NK):
            te_fp8.check_operands("fprop", x_TK, w_NK)
            return te_fp8.fprop(self, x_TK, w_NK, b_N, split_accumulator)
        self.prepare(x_TK.device)
        b_N = None if b_N is None else b_N.contiguous()
        y_TN, *_ = general_gemm(
            w_NK.contiguous(), x_TK, out_dtype=x_TK.dtype, bias=b_N, use_split_accumulator=_2X_ACC_FPROP
        )
        return y_TN

    @_unbatched
    def dgrad(self, dy_TN: torch.Tensor, w_NK: torch.Tensor, *, split_accumulator: bool = False) -> torch.Tensor:
        if te_fp8.is_fp8(dy_TN) or te_fp8.is_fp8(w_NK):
            te_fp8.check_operands("dgrad", dy_TN, w_NK)
            return te_fp8.dgrad(self, dy_TN, w_NK, split_accumulator)
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

    @_unbatched
    def wgrad(self, x_TK, dy_TN, *, out=None, accumulate=False, with_dbias=False, split_accumulator=False):
        if te_fp8.is_fp8(x_TK) or te_fp8.is_fp8(dy_TN):
            te_fp8.check_operands("wgrad", x_TK, dy_TN)
            return te_fp8.wgrad(self, x_TK, dy_TN, out, accumulate, with_dbias, split_accumulator)
        if out is not None:
            _check_out(out)
        self.prepare(x_TK.device)
        # NOTE: with grad=True the bias tensor's values are ignored; passing one switches on the
        # fused bias grad (BGRADB epilogue), in the GEMM's output dtype (fp32 into main_grad).
        accumulate = accumulate and out is not None
        dense = None if out is None else _dense_out(out, accumulate)  # a strided main_grad: via a copy
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
            _copy_back([out], [dense])
            dw_NK = out
        return dw_NK, (db_N.to(dy_TN.dtype) if with_dbias else None)

    # --- a group (te.GroupedLinear) -------------------------------------------------------
    def grouped_path_unsupported(self, x_TK: torch.Tensor, w_ENK: Weights, recipe=None) -> str | None:
        """The checks of TE's ``is_module_grouped_tensor_path_supported`` (BF16, or FP8 ``recipe``),
        plus alignment: each expert's rows must start 16-byte aligned."""
        dt = x_TK.dtype
        if dt not in (torch.bfloat16, torch.float16):
            return f"TE's grouped GEMM takes bfloat16 or float16 activations, got {dt}"
        cc, have = _te_env(x_TK.device.index if x_TK.device.index is not None else torch.cuda.current_device())
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
        E = w_ENK.shape[0] if isinstance(w_ENK, torch.Tensor) else len(w_ENK)
        return None if recipe is None else grouped_path_problem(recipe, env_of(cc, have), E)

    @_unbatched
    def grouped_fprop(self, x_TK, w_ENK, b_EN, splits, grouped, *, split_accumulator=False):
        if te_fp8.is_fp8(x_TK) or te_fp8.is_fp8(w_ENK):  # the path is the one x was quantized for
            te_fp8.check_operands("grouped_fprop", x_TK, w_ENK)
            return te_fp8.grouped_fprop(self, x_TK, w_ENK, b_EN, splits, split_accumulator)
        E, (N, K) = splits.num_experts, out_in(w_ENK)
        y_TN = x_TK.new_empty(x_TK.shape[0], N)
        if grouped and splits.num_tokens:
            self.prepare(x_TK.device, E, grouped=True)
            sizes_E, _, offs_K, offs_N = _offsets(splits, K, N)
            # NOTE: the grouped kernel has no bias epilogue: TE adds the bias after the GEMM
            # (nvte_grouped_bias_add, output already rounded), as te.GroupedLinear does. That
            # add takes at most 64 groups, so beyond 64 we add it the same way ourselves
            # (y + b in fp32, rounded once): a row->expert gather on the device, no sync.
            te_bias = b_EN is not None and E <= _MAX_LIST
            general_grouped_gemm_for_grouped_tensor(
                self._weights(w_ENK),
                _rows(x_TK, sizes_E, offs_K),
                _rows(y_TN, sizes_E, offs_N),
                layout="TN",
                bias=_uniform(_stacked(b_EN), E, (1, N)) if te_bias else None,
                use_split_accumulator=_2X_ACC_FPROP,
            )
            if b_EN is not None and not te_bias:
                y_TN.add_(_stacked(b_EN)[_row_expert(splits)])
            return y_TN
        self.prepare(x_TK.device, E)
        sizes = _host_sizes(splits)
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

    @_unbatched
    def grouped_dgrad(self, dy_TN, w_ENK, splits, grouped, *, split_accumulator=False):
        if te_fp8.is_fp8(dy_TN) or te_fp8.is_fp8(w_ENK):
            te_fp8.check_operands("grouped_dgrad", dy_TN, w_ENK)
            return te_fp8.grouped_dgrad(self, dy_TN, w_ENK, splits, split_accumulator)
        E, (N, K) = splits.num_experts, out_in(w_ENK)
        dx_TK = dy_TN.new_empty(dy_TN.shape[0], K)
        if grouped and splits.num_tokens:
            self.prepare(dy_TN.device, E, grouped=True)
            sizes_E, _, offs_K, offs_N = _offsets(splits, K, N)
            general_grouped_gemm_for_grouped_tensor(
                self._weights(w_ENK),
                _rows(dy_TN, sizes_E, offs_N),
                _rows(dx_TK, sizes_E, offs_K),
                layout="NN",
                use_split_accumulator=_2X_ACC_DGRAD,
            )
            return dx_TK
        self.prepare(dy_TN.device, E)
        sizes = _host_sizes(splits)
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

    @_unbatched
    def grouped_wgrad(
        self, x_TK, dy_TN, splits, grouped, *, out=None, accumulate=False, with_dbias=False, split_accumulator=False
    ):
        if te_fp8.is_fp8(x_TK) or te_fp8.is_fp8(dy_TN):
            te_fp8.check_operands("grouped_wgrad", x_TK, dy_TN)
            return te_fp8.grouped_wgrad(self, x_TK, dy_TN, splits, out, accumulate, with_dbias, split_accumulator)
        E, K, N = splits.num_experts, x_TK.shape[1], dy_TN.shape[1]
        if out is not None:
            _check_out(out)
        grouped = grouped and splits.num_tokens > 0
        accumulate = accumulate and out is not None
        # NOTE: torch.empty, as te.GroupedLinear: both paths write zeros for a zero-token expert
        # (TE's split path zero-fills it; the grouped GEMM computes its K=0 product as zeros,
        # measured on the H200 with benchmarks/probe_zero_experts.py; tested in test_te_gpu.py).
        dw = out if out is not None else x_TK.new_empty(E, N, K)
        if isinstance(dw, torch.Tensor):  # a strided [E, N, K] main_grad: through a dense copy
            dense = _dense_out(dw, accumulate)
            db = self._grouped_wgrad(
                x_TK, dy_TN, splits, grouped, dense, accumulate, with_dbias, stacked=out is not None
            )
            _copy_back([dw], [dense])
            return dw, db
        dense = [_dense_out(t, accumulate) for t in dw]  # strided main_grads: through dense copies
        db = self._grouped_wgrad(x_TK, dy_TN, splits, grouped, dense, accumulate, with_dbias, stacked=False)
        _copy_back(dw, dense)
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
            sizes = _host_sizes(splits)
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
        sizes_E, rows_E1, offs_K, offs_N = _offsets(splits, K, N)
        db_EN = _grouped_dbias(dy_TN, splits, rows_E1) if with_dbias else None
        D, scratch = self._wgrad_out(dw, targets, stacked=stacked)
        # NOTE: fp32 main_grad from bf16/fp16 inputs is supported by the grouped kernel (outputs
        # may be bf16, fp16 or fp32); accumulate=True makes TE pass beta = 1 (D += dy^T x).
        general_grouped_gemm_for_grouped_tensor(
            _rows(x_TK, sizes_E, offs_K),
            _rows(dy_TN, sizes_E, offs_N),
            D,
            layout="NT",
            accumulate=accumulate and scratch is None,
            use_split_accumulator=_2X_ACC_WGRAD,
        )
        if scratch is not None:
            for t, s in zip(targets, scratch):
                _write(t, s, accumulate)
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
                return _uniform(one, one.shape[0], tuple(one.shape[1:]))
        if not isinstance(w_ENK, torch.Tensor) and len(w_ENK) <= _MAX_LIST:
            return [w.contiguous() for w in w_ENK]
        w = _stacked(w_ENK)
        return _uniform(w, w.shape[0], tuple(w.shape[1:]))

    def _wgrad_out(self, dw, targets: list[torch.Tensor], stacked: bool) -> tuple[object, torch.Tensor | None]:
        """(D operand, scratch). A stacked [E, N, K] output, or outputs that are consecutive
        slices of one buffer (a fresh dw's views too): one uniform GroupedTensor over it.
        Otherwise, up to 64 experts, the list itself (discrete_out, as te.GroupedLinear); beyond,
        one over a zeroed scratch buffer, which the caller then adds (or copies) into ``targets``."""
        if stacked and dw.is_contiguous():
            return _uniform(dw, dw.shape[0], tuple(dw.shape[1:])), None
        E, (N, K) = len(targets), targets[0].shape
        one = packed(targets)
        if one is not None:  # one buffer (also a fresh dw's views): uniform, as for the weights
            return _uniform(one, E, (N, K)), None
        if E <= _MAX_LIST and self._discrete_out_ok():
            return targets, None
        scratch = targets[0].new_zeros(E, N, K)
        return _uniform(scratch, E, (N, K)), scratch

    def _discrete_out_ok(self) -> bool:
        # NOTE: TE upstream refuses list outputs on cuBLAS 13.7.0 - 13.8.0 (a data-corruption bug).
        return not 130700 <= _CUBLASLT < 130801


TE = TEKernels()

from . import te_fp8  # noqa: E402  (after TE: te_fp8 uses this module's helpers)
