"""Plain-PyTorch reference kernels (CPU and any CUDA device).

Split path: a per-expert loop of GEMMs. Grouped path: ``torch.nn.functional.grouped_mm``
(``torch._grouped_mm`` on older builds) with offsets computed on the device: no per-expert
host loop and no host sync. Bias add and bias gradients use a device-side row->expert index.

The operands are float32/bfloat16/float16 (or float64) tensors; FP8 operands are multiplied by
their recipe family's kernels (``emulated.py``, ``rowwise.py``: NOTE: [FP8 kernels by family]).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor

from .packing import Weights, out_in, packed, stacked
from .splits import Splits, row_expert, write

_torch_grouped_mm = getattr(torch, "_grouped_mm", None) or getattr(F, "grouped_mm", None)  # (F.grouped_mm is
# a Python wrapper that calls torch._grouped_mm: the op itself saves ~1 us a call)


# NOTE: [Double backward through grouped_mm] With ``create_graph=True`` our backward's
# grouped GEMMs are themselves differentiated, and the gradient reaching them is often an
# expanded (zero-stride) tensor, e.g. from ``dx.sum()``; torch's grouped_mm backward rejects
# such strides ("Invalid strides/sizes"). Only then (an output that requires grad) is this
# identity put after the GEMM.
class _DenseGrad(torch.autograd.Function):
    """Identity whose backward hands on a dense gradient."""

    generate_vmap_rule = True

    @staticmethod
    def forward(t: torch.Tensor) -> torch.Tensor:
        return t.view_as(t)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        pass

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        return g.contiguous()


def _plain(*operands) -> bool:
    """No transform reaches these operands: grouped_mm has no forward-AD formula and no
    functorch rules, so under ``jvp``/``hessian``/functorch wrappers the split path runs.
    (A compiled graph holds no transform's wrappers: dynamo cannot ask, nor needs to.)"""
    if torch.compiler.is_compiling():
        return True
    if torch.autograd.forward_ad._current_level >= 0:
        return False
    if torch._C._functorch.peek_interpreter_stack() is None:
        return True
    return not any(torch._C._functorch.is_functorch_wrapped_tensor(t) for t in operands if isinstance(t, torch.Tensor))


@functools.lru_cache(maxsize=None)
def _capability(device: torch.device) -> tuple[int, int]:
    """Compute capability, read once per device (the per-call query costs microseconds)."""
    return torch.cuda.get_device_capability(device)


_PATH_VERDICTS: dict[tuple, str | None] = {}  # TorchKernels.grouped_path_unsupported's, eager


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _list(w_ENK: Weights) -> Sequence[torch.Tensor]:
    return (w_ENK,) if isinstance(w_ENK, torch.Tensor) else w_ENK


def _stack(w_ENK: Weights) -> torch.Tensor:
    """One ``[E, N, K]`` operand: a stacked weight as it is, consecutive slices of one buffer
    as a view of it, separate tensors copied (NOTE: [One buffer])."""
    return _mm_ready(w_ENK if isinstance(w_ENK, torch.Tensor) else stacked(w_ENK))


# NOTE: [Layouts] Callers and saved-tensor hooks may hand over any strides (a slice of a
# wider buffer, a transposed copy, a size-1 dim with an odd stride, which ``is_contiguous``
# ignores); a fresh row-major copy always fits, since the path check has made in/out
# features 16-byte multiples.
def _mm_ready(t: torch.Tensor) -> torch.Tensor:
    """``t`` in a layout grouped_mm takes, copied only when it does not: the last two dims
    row- or column-major with a 16-byte multiple leading stride (and, on CUDA, a 16-byte
    aligned start and batch stride)."""
    if t.is_contiguous() and t.shape[-2] > 1 and not t.is_cuda:
        return t  # the common case on the CPU
    if torch.compiler.is_compiling():  # dynamo cannot trace storage_offset(); a traced graph's
        return t.contiguous()  # dense tensors are what the compiler's own buffers give
    n0, n1 = t.shape[-2:]
    a = 16 // t.element_size()
    if n0 > 1 and t.is_contiguous() and t.storage_offset() % a == 0:
        return t  # the common case on CUDA
    s0, s1 = t.stride()[-2:]
    ok = (s1 == 1 and s0 >= max(1, n1) and s0 % a == 0) or (s0 == 1 and s1 >= max(1, n0) and s1 % a == 0)
    if ok and t.is_cuda:
        ok = t.storage_offset() % a == 0 and (t.dim() == 2 or t.stride(0) % a == 0)
    return t if ok else t.clone(memory_format=torch.contiguous_format)


def _no_data(t: torch.Tensor) -> bool:
    """A meta tensor, or a fake one outside a trace: shapes only, no kernel runs."""
    if t.is_meta:
        return True
    if not isinstance(t, FakeTensor) or torch.compiler.is_compiling():
        return False
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    return get_proxy_mode() is None


# NOTE: [Shapes only] grouped_mm's meta (fake) rule mirrors CUDA and takes bfloat16 only,
# while the CPU kernel also takes float32 and float16: on meta or fake tensors those get an
# empty result of the right shape.
def gmm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """grouped_mm on the groups' int32 end offsets ``offs`` (:meth:`Splits.ends`; operands
    through :func:`_mm_ready`); on meta or fake tensors of another dtype than bfloat16, an
    empty result of the right shape (NOTE: [Shapes only]). An output that requires grad
    (create_graph) gets :class:`_DenseGrad` after it."""
    if a.dtype != torch.bfloat16 and _no_data(a):
        E = offs.shape[0]
        shape = (E, a.shape[0], b.shape[1]) if b.dim() == 2 else (a.shape[0], b.shape[-1])
        return a.new_empty(shape)
    out = _torch_grouped_mm(a, b, offs=offs)
    return _DenseGrad.apply(out) if out.requires_grad else out


def column_sums(dy_TN: torch.Tensor) -> torch.Tensor:
    """db_N: column sums of dy, accumulated in fp32 (or fp64)."""
    return dy_TN.sum(0, dtype=_acc_dtype(dy_TN.dtype)).to(dy_TN.dtype)


def expert_sums(dy_TN: torch.Tensor, splits: Splits) -> torch.Tensor:
    """db_EN: per-expert column sums of dy, accumulated in fp32 (or fp64)."""
    db = torch.zeros(splits.num_experts, dy_TN.shape[1], dtype=_acc_dtype(dy_TN.dtype), device=dy_TN.device)
    return db.index_add(0, row_expert(splits), dy_TN.to(db.dtype)).to(dy_TN.dtype)  # out of place: vmap-safe


def _recorded(*operands: torch.Tensor) -> bool:
    """A transform or autograd records ops on these operands (create_graph, jvp, vmap): no
    ``out=`` products then (torch differentiates no ``out=`` op)."""
    return not _plain(*operands) or (torch.is_grad_enabled() and any(t.requires_grad for t in operands))


class TorchKernels:
    """The plain-PyTorch kernels: float32/bfloat16/float16/float64 tensor operands (FP8 operands
    go to their family's kernels: NOTE: [FP8 kernels by family] in ``fp8_plan.py``)."""

    name = "torch"

    def __repr__(self) -> str:
        return "TorchKernels()"

    # --- one GEMM -------------------------------------------------------------------------
    def fprop(
        self, x_TK: torch.Tensor, w_NK: torch.Tensor, b_N: torch.Tensor | None, *, split_accumulator: bool = False
    ) -> torch.Tensor:
        return F.linear(x_TK, w_NK, b_N)

    def dgrad(self, dy_TN: torch.Tensor, w_NK: torch.Tensor, *, split_accumulator: bool = False) -> torch.Tensor:
        return dy_TN @ w_NK

    def wgrad(self, x_TK, dy_TN, *, out=None, accumulate=False, with_dbias=False, split_accumulator=False):
        db_N = column_sums(dy_TN) if with_dbias else None
        if out is None:
            return dy_TN.t() @ x_TK, db_N
        dw = dy_TN.t().to(out.dtype) @ x_TK.to(out.dtype)
        return write(out, dw, accumulate), db_N

    # --- a group --------------------------------------------------------------------------
    def grouped_path_unsupported(self, x_TK: torch.Tensor, w_ENK: Weights) -> str | None:
        """(Eager plain tensors: the verdict is cached per (dtype, device, N, K); it reads nothing else.)"""
        if type(x_TK) is torch.Tensor and not torch.compiler.is_compiling():
            key = (x_TK.dtype, x_TK.device, *out_in(w_ENK))
            if key not in _PATH_VERDICTS:
                _PATH_VERDICTS[key] = self._grouped_path_unsupported(x_TK, w_ENK)
            return _PATH_VERDICTS[key]
        return self._grouped_path_unsupported(x_TK, w_ENK)

    def _grouped_path_unsupported(self, x_TK: torch.Tensor, w_ENK: Weights) -> str | None:
        if _torch_grouped_mm is None:
            return f"torch {torch.__version__} has no grouped_mm"
        dt = x_TK.dtype
        if torch.compiler.is_compiling() and dt != torch.bfloat16:
            return f"under torch.compile, grouped_mm's shape rule takes bfloat16 only, got {dt}"
        if x_TK.is_cuda:
            if dt != torch.bfloat16:
                return f"torch's CUDA grouped_mm takes bfloat16 only, got {dt}"
            if not isinstance(x_TK, FakeTensor) and _capability(x_TK.device) < (8, 0):  # (a fake has no GPU to ask)
                return "torch's CUDA grouped_mm needs compute capability >= 8.0"
        elif dt not in (torch.float32, torch.bfloat16, torch.float16):
            return f"torch's grouped_mm takes float32/bfloat16/float16, got {dt}"
        N, K = out_in(w_ENK)
        if not N or not K:
            return "grouped_mm takes no zero-size features"
        if (K * x_TK.element_size()) % 16 or (N * x_TK.element_size()) % 16:
            return f"grouped_mm needs rows of 16-byte multiples; in={K}, out={N} in {dt} are not"
        return None

    def grouped_fprop(self, x_TK, w_ENK, b_EN, splits, grouped, *, split_accumulator=False):
        if not grouped:  # (the layer's route: NOTE: [Transforms without a rule])
            return self.split_fprop(x_TK, w_ENK, b_EN, splits)
        y_TN = self.weights_gmm(_mm_ready(x_TK), w_ENK, splits.ends(torch.int32), transpose=True)
        if b_EN is not None:
            y_TN = y_TN + b_EN[row_expert(splits)]
        return y_TN

    def grouped_dgrad(self, dy_TN, w_ENK, splits, grouped, *, split_accumulator=False):
        if not grouped:
            return self.split_dgrad(dy_TN, w_ENK, splits)
        return self.weights_gmm(_mm_ready(dy_TN), w_ENK, splits.ends(torch.int32), transpose=False)

    def weights_gmm(self, a_TX: torch.Tensor, w_ENK: Weights, offs: torch.Tensor, transpose: bool) -> torch.Tensor:
        """grouped_mm of token rows with the weights (``W^T`` when ``transpose``), read in place
        where they are one buffer (NOTE: [One buffer])."""
        w = _stack(w_ENK)
        return gmm(a_TX, w.transpose(-2, -1) if transpose else w, offs)

    def grouped_wgrad(
        self, x_TK, dy_TN, splits, grouped, *, out=None, accumulate=False, with_dbias=False, split_accumulator=False
    ):
        db_EN = expert_sums(dy_TN, splits) if with_dbias else None
        dt = x_TK.dtype if out is None else out[0].dtype
        if not grouped:  # (the layer's route, and plan.wgrad_grouped for a main_grad grouped_mm cannot write)
            if dt != x_TK.dtype:  # fp32 main_grad: the product in its dtype
                x_TK, dy_TN = x_TK.to(dt), dy_TN.to(dt)
            return self.split_wgrad(x_TK, dy_TN, splits, out=out, accumulate=accumulate), db_EN
        dy_T, x = _mm_ready(dy_TN).t(), _mm_ready(x_TK)
        if dt != x_TK.dtype:  # (the CPU's grouped_mm takes fp32: the product in main_grad's dtype)
            dy_T, x = dy_T.to(dt), x.to(dt)
        dw_ENK = gmm(dy_T, x, splits.ends(torch.int32))  # one [E, N, K] buffer (grouped_mm has no out=)
        if out is None:
            return dw_ENK, db_EN
        target = out if isinstance(out, torch.Tensor) else packed(out)  # main_grads in one buffer: one write
        if target is not None:
            write(target, dw_ENK, accumulate)
        else:
            for t, dw in zip(out, dw_ENK):
                write(t, dw, accumulate)
        return out, db_EN

    # --- the split path: one GEMM per expert on host sizes (custom ops under torch.compile) --
    def split_fprop(self, x_TK, w_ENK, b_EN, splits):
        xs = x_TK.split(splits.sizes())
        return torch.cat([F.linear(x, w_ENK[e], None if b_EN is None else b_EN[e]) for e, x in enumerate(xs)])

    def split_dgrad(self, dy_TN, w_ENK, splits):
        return torch.cat([dy @ w_ENK[e] for e, dy in enumerate(dy_TN.split(splits.sizes()))])

    # NOTE: [main_grad is written elementwise] ``out`` (a caller's main_grad or grad buffer, any
    # strides) is only written elementwise: each product is made dense, then copied or added, as on
    # the grouped path. A GEMM writing into it (``addmm_``, ``mm(out=)``) would take its fp32
    # summation order from the buffer's strides (the BLAS runs a column-major output as the
    # transposed product, and ``addmm_`` adds main_grad inside the sum): other bits for another
    # layout of the same main_grad. The fresh buffer gets each product in place, unless autograd or
    # a transform records the products (then they are stacked, as ordinary ops).
    def split_wgrad(self, x_TK, dy_TN, splits, *, out=None, accumulate=False):
        """E ``[N, K]`` products written into ``out`` (E ``[N, K]`` or ``[E, N, K]``; added when
        ``accumulate``), else into one fresh ``[E, N, K]`` tensor; returns it.

        ``out`` is only written elementwise (NOTE: [main_grad is written elementwise])."""
        sizes = splits.sizes()
        pairs = list(zip(x_TK.split(sizes), dy_TN.split(sizes)))
        if out is not None:
            for t, (x, dy) in zip(out, pairs):
                write(t, dy.t() @ x, accumulate)
            return out
        if _recorded(x_TK, dy_TN):
            return torch.stack([dy.t() @ x for x, dy in pairs])
        dw = x_TK.new_empty(splits.num_experts, dy_TN.shape[1], x_TK.shape[1])
        for e, (x, dy) in enumerate(pairs):
            torch.mm(dy.t(), x, out=dw[e])
        return dw


TORCH = TorchKernels()
