"""What Transformer Engine's kernels share (the bf16 ones, ``te.py``, and the FP8 ones,
``te_fp8.py`` / ``te_fp8_gemm.py``): TE's workspaces (:func:`prepare`), its grouped operands
(:func:`uniform`, :func:`token_rows`, :func:`offsets`), the outputs' handling (:func:`dense_out`,
:func:`copy_back`, :func:`wgrad_out`, :func:`check_out`), the per-expert bias grad, and the guard
every GEMM method runs under (:func:`unbatched`). Imports TE: loaded with those modules only.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence

import torch
import transformer_engine.pytorch  # noqa: F401  (loads libtransformer_engine before the extension)
import transformer_engine_torch as tex
from transformer_engine.pytorch.cpp_extensions import gemm as te_gemm
from transformer_engine.pytorch.cpp_extensions.gemm import get_cublas_workspace
from transformer_engine.pytorch.tensor.storage.grouped_tensor_storage import GroupedTensorStorage
from transformer_engine.pytorch.utils import _empty_tensor

from .packing import Weights, packed, stacked
from .splits import Splits
from .torch_ref import expert_sums

try:  # TE's Triton kernel for per-expert bias grads (what GroupedLinear's grouped path uses)
    from transformer_engine.pytorch.triton.grouped_dbias_dscales import compute_grouped_dbias
except Exception:  # no Triton: fall back to the reference's device-side index_add_
    compute_grouped_dbias = None

__all__ = [
    "MAX_LIST",
    "check_out",
    "copy_back",
    "dense_out",
    "grouped_dbias",
    "host_sizes",
    "offsets",
    "prepare",
    "stacked_dense",
    "te_env",
    "token_rows",
    "unbatched",
    "uniform",
    "wgrad_out",
]

# NOTE: [64 tensors per kernel]
#   The grouped kernel takes list operands (per-expert weights, per-expert wgrad outputs) for at
#   most 64 experts (``kMaxGroups``); a single GroupedTensor operand has no limit. Up to 64 we
#   pass lists exactly as te.GroupedLinear does (bitwise parity). Beyond 64 we pass one uniform
#   [E, N, K] GroupedTensor instead: a zero-copy view when the tensors are consecutive slices of
#   one buffer (nn.GroupedLinear's parameters, Megatron's contiguous main_grad buffer: NOTE: [One
#   buffer]), else a stacked copy (weights) or a scratch output that is then added/copied into
#   the caller's tensors (scattered main_grads). (Calls on chunks of <= 64 experts with sliced device offsets would
#   also avoid a sync, but rely on offsets not starting at 0, which TE does not promise.)
MAX_LIST = 64


def dense_out(out: torch.Tensor, accumulate: bool) -> torch.Tensor:
    """A contiguous stand-in for a strided output (e.g. a transposed main_grad view): its
    values when accumulating, else fresh. The caller copies it back (:func:`copy_back`)."""
    if out.is_contiguous():
        return out
    return out.contiguous() if accumulate else torch.empty(out.shape, dtype=out.dtype, device=out.device)


def copy_back(outs: Sequence[torch.Tensor], dense: Sequence[torch.Tensor]) -> None:
    for o, d in zip(outs, dense):
        if d is not o:
            o.copy_(d)


def stacked_dense(w_ENK: Weights) -> torch.Tensor:
    return w_ENK.contiguous() if isinstance(w_ENK, torch.Tensor) else stacked(w_ENK)


def uniform(data: torch.Tensor, E: int, shape: tuple[int, int]) -> GroupedTensorStorage:
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


def token_rows(data_TC: torch.Tensor, sizes_E: torch.Tensor, offs_E1: torch.Tensor) -> GroupedTensorStorage:
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


def offsets(splits: Splits, K: int, N: int) -> tuple[torch.Tensor, ...]:
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


def host_sizes(splits: Splits) -> list[int]:
    return [0] * splits.num_experts if splits.num_tokens == 0 else list(splits.sizes())


def grouped_dbias(dy_TN: torch.Tensor, splits: Splits, rows_E1: torch.Tensor) -> torch.Tensor:
    """db_EN in dy's dtype, accumulated in fp32 on the device (no sync)."""
    # NOTE: TE's Triton kernel (te.GroupedLinear's choice) adds partial sums with fp32 atomics,
    # so its last bits can vary run to run; under NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 TE refuses
    # it, and we take the reference's index_add_ instead.
    if compute_grouped_dbias is not None and bool(int(os.getenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "1"))):
        return compute_grouped_dbias(dy_TN, rows_E1, splits.num_experts).to(dy_TN.dtype)
    return expert_sums(dy_TN, splits)


def check_out(out) -> None:
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


def unbatched(method):
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


def te_env(device_index: int) -> tuple[tuple[int, int], int]:
    """(compute capability, cuBLASLt version)."""
    return _CAPABILITY[device_index], _CUBLASLT


_PREPARED: set[tuple] = set()  # the (device, experts, path) whose workspaces exist


# NOTE: [Workspaces before CUDA graph capture]
#   TE caches its cuBLAS workspaces, the grouped GEMM's setup workspace and its alpha/beta
#   scalars (torch.ones/zeros) on first use. Made inside a capture, the scalars would be
#   filled only on replay, so ``prepare`` makes them eagerly and refuses to run in a capture.
def prepare(device: torch.device | str | int, num_experts: int | None = None, grouped: bool = False) -> None:
    """Allocate TE's cached workspaces on ``device``: the single GEMM's; with ``num_experts``
    the split path's, or with ``grouped=True`` the grouped path's. Runs on first use."""
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    idx = torch.cuda.current_device() if device.index is None else device.index
    key = (idx, num_experts, grouped)
    if key in _PREPARED:
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
    _PREPARED.add(key)


def wgrad_out(dw, targets: list[torch.Tensor], stacked: bool) -> tuple[object, torch.Tensor | None]:
    """(D operand, scratch). A stacked [E, N, K] output, or outputs that are consecutive
    slices of one buffer (a fresh dw's views too): one uniform GroupedTensor over it.
    Otherwise, up to 64 experts, the list itself (discrete_out, as te.GroupedLinear); beyond,
    one over a zeroed scratch buffer, which the caller then adds (or copies) into ``targets``."""
    if stacked and dw.is_contiguous():
        return uniform(dw, dw.shape[0], tuple(dw.shape[1:])), None
    E, (N, K) = len(targets), targets[0].shape
    one = packed(targets)
    if one is not None:  # one buffer (also a fresh dw's views): uniform, as for the weights
        return uniform(one, E, (N, K)), None
    if E <= MAX_LIST and _discrete_out_ok():
        return targets, None
    scratch = targets[0].new_zeros(E, N, K)
    return uniform(scratch, E, (N, K)), scratch


def _discrete_out_ok() -> bool:
    # NOTE: TE upstream refuses list outputs on cuBLAS 13.7.0 - 13.8.0 (a data-corruption bug).
    return not 130700 <= _CUBLASLT < 130801
