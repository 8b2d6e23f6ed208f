"""Plain-PyTorch reference kernels (CPU and any CUDA device).

Split path: a per-expert loop of GEMMs. Grouped path: ``torch.nn.functional.grouped_mm``
(``torch._grouped_mm`` on older builds) with offsets computed on the device: no per-expert
host loop and no host sync. Bias add and bias gradients use a device-side row->expert index.

FP8: TE's quantization emulated, and GEMMs that multiply the dequantized operands in fp32 and
round once to the activations' dtype (NOTE: [FP8 emulation]).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor

from ..fp8 import QTensor, RowwiseScaling, quantize as fp8_quantize, quantize_groups
from ..fp8.rowwise import RowwiseActivation
from .packing import Weights, out_in, packed, stacked
from .splits import Splits
from . import rowwise as rowwise_ops

# NOTE: [FP8 emulation] ``quantize``/``grouped_quantize`` are ``functional_dw.fp8``'s
# emulated quantization (TE's formulas) into :class:`~functional_dw.fp8.QTensor` (a group: a list
# of E, one per expert); a GEMM given QTensor operands dequantizes both to fp32, multiplies in
# fp32 (bias added in fp32, as cuBLASLt's epilogue adds it to the fp32 accumulator) and rounds
# once to the activations' dtype (an fp32 ``main_grad`` gets the fp32 product). Split
# accumulation is a cuBLASLt mode; the fp32 reference has nothing to split (the keyword is read
# and ignored).

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
def _gmm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
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


def _recorded(*operands: torch.Tensor) -> bool:
    """A transform or autograd records ops on these operands (create_graph, jvp, vmap): no
    ``out=`` products then (torch differentiates no ``out=`` op)."""
    return not _plain(*operands) or (torch.is_grad_enabled() and any(t.requires_grad for t in operands))


# --- FP8 operands (NOTE: [FP8 emulation] in the module docstring) -------------------------------


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


def _no_dbias(with_dbias: bool) -> None:
    if with_dbias:
        raise ValueError(
            "with_dbias=True needs dy in high precision; with FP8 operands the layer sums the bias "
            "grad from its high-precision dy itself"
        )


def _record_amax(amax: torch.Tensor, value: torch.Tensor) -> None:
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


class TorchKernels:
    name = "torch"

    def __repr__(self) -> str:
        return "TorchKernels()"

    # --- one GEMM -------------------------------------------------------------------------
    def fprop(
        self, x_TK: torch.Tensor, w_NK: torch.Tensor, b_N: torch.Tensor | None, *, split_accumulator: bool = False
    ) -> torch.Tensor:
        if isinstance(x_TK, QTensor):
            return _bias_add(_rows(x_TK) @ _rows(w_NK).t(), b_N).to(x_TK.dtype)
        return F.linear(x_TK, w_NK, b_N)

    def dgrad(self, dy_TN: torch.Tensor, w_NK: torch.Tensor, *, split_accumulator: bool = False) -> torch.Tensor:
        if isinstance(dy_TN, QTensor):
            return (_rows(dy_TN) @ _cols(w_NK)).to(dy_TN.dtype)
        return dy_TN @ w_NK

    def wgrad(self, x_TK, dy_TN, *, out=None, accumulate=False, with_dbias=False, split_accumulator=False):
        if isinstance(x_TK, QTensor):
            _no_dbias(with_dbias)
            dw = _cols(dy_TN).t() @ _cols(x_TK)
            return (dw.to(x_TK.dtype) if out is None else _write(out, dw.to(out.dtype), accumulate)), None
        db_N = column_sums(dy_TN) if with_dbias else None
        if out is None:
            return dy_TN.t() @ x_TK, db_N
        dw = dy_TN.t().to(out.dtype) @ x_TK.to(out.dtype)
        return _write(out, dw, accumulate), db_N

    # --- a group --------------------------------------------------------------------------
    def grouped_path_unsupported(self, x_TK: torch.Tensor, w_ENK: Weights, recipe=None) -> str | None:
        """(Eager plain tensors: the verdict is cached per (dtype, device, N, K); it reads nothing else.)"""
        if recipe is not None and not isinstance(recipe, RowwiseScaling) and x_TK.is_cuda:
            return "the reference FP8 emulation multiplies in fp32, which torch's CUDA grouped_mm does not take"
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
        if isinstance(x_TK, RowwiseActivation):  # FP8, RowwiseScaling: one grouped GEMM
            return rowwise_ops.fprop(x_TK, w_ENK, b_EN, splits, split_accumulator=split_accumulator)
        if not isinstance(x_TK, torch.Tensor):  # FP8: E QTensors per operand
            y_TN = self._q_fprop(_cat(x_TK, False), _stack32(w_ENK, False), splits, grouped)
            b32 = None if b_EN is None else b_EN.to(torch.float32)[_row_expert(splits)]
            return _bias_add(y_TN, b32).to(x_TK[0].dtype)
        if not grouped:  # (the layer's route: NOTE: [Transforms without a rule])
            return self.split_fprop(x_TK, w_ENK, b_EN, splits)
        y_TN = self.weights_gmm(_mm_ready(x_TK), w_ENK, splits.ends(torch.int32), transpose=True)
        if b_EN is not None:
            y_TN = y_TN + b_EN[_row_expert(splits)]
        return y_TN

    def grouped_dgrad(self, dy_TN, w_ENK, splits, grouped, *, split_accumulator=False):
        if isinstance(dy_TN, RowwiseActivation):
            return rowwise_ops.dgrad(dy_TN, w_ENK, splits, split_accumulator=split_accumulator)
        if not isinstance(dy_TN, torch.Tensor):  # FP8
            dy32, w32 = _cat(dy_TN, False), _stack32(w_ENK, True)
            if grouped:
                return _gmm(dy32, w32, splits.ends(torch.int32)).to(dy_TN[0].dtype)
            return self.split_dgrad(dy32, w32, splits).to(dy_TN[0].dtype)
        if not grouped:
            return self.split_dgrad(dy_TN, w_ENK, splits)
        return self.weights_gmm(_mm_ready(dy_TN), w_ENK, splits.ends(torch.int32), transpose=False)

    def weights_gmm(self, a_TX: torch.Tensor, w_ENK: Weights, offs: torch.Tensor, transpose: bool) -> torch.Tensor:
        """grouped_mm of token rows with the weights (``W^T`` when ``transpose``), read in place
        where they are one buffer (NOTE: [One buffer])."""
        w = _stack(w_ENK)
        return _gmm(a_TX, w.transpose(-2, -1) if transpose else w, offs)

    def grouped_wgrad(
        self, x_TK, dy_TN, splits, grouped, *, out=None, accumulate=False, with_dbias=False, split_accumulator=False
    ):
        if isinstance(x_TK, RowwiseActivation):
            _no_dbias(with_dbias)
            return rowwise_ops.wgrad(
                x_TK, dy_TN, splits, out=out, accumulate=accumulate, split_accumulator=split_accumulator
            ), None
        if not isinstance(x_TK, torch.Tensor):  # FP8
            _no_dbias(with_dbias)
            x32, dy32 = _cat(x_TK, True), _cat(dy_TN, True)
            if grouped:
                dw32 = _gmm(dy32.t(), x32, splits.ends(torch.int32))
            else:
                dw32 = self.split_wgrad(x32, dy32, splits)
            if out is None:
                return dw32.to(x_TK[0].dtype), None
            for e in range(splits.num_experts):
                _write(out[e], dw32[e].to(out[e].dtype), accumulate)
            return out, None
        db_EN = expert_sums(dy_TN, splits) if with_dbias else None
        dt = x_TK.dtype if out is None else out[0].dtype
        if not grouped:  # (the layer's route, and plan.wgrad_grouped for a main_grad grouped_mm cannot write)
            if dt != x_TK.dtype:  # fp32 main_grad: the product in its dtype
                x_TK, dy_TN = x_TK.to(dt), dy_TN.to(dt)
            return self.split_wgrad(x_TK, dy_TN, splits, out=out, accumulate=accumulate), db_EN
        dy_T, x = _mm_ready(dy_TN).t(), _mm_ready(x_TK)
        if dt != x_TK.dtype:  # (the CPU's grouped_mm takes fp32: the product in main_grad's dtype)
            dy_T, x = dy_T.to(dt), x.to(dt)
        dw_ENK = _gmm(dy_T, x, splits.ends(torch.int32))  # one [E, N, K] buffer (grouped_mm has no out=)
        if out is None:
            return dw_ENK, db_EN
        target = out if isinstance(out, torch.Tensor) else packed(out)  # main_grads in one buffer: one write
        if target is not None:
            _write(target, dw_ENK, accumulate)
        else:
            for t, dw in zip(out, dw_ENK):
                _write(t, dw, accumulate)
        return out, db_EN

    def _q_fprop(self, x32: torch.Tensor, w32: torch.Tensor, splits: Splits, grouped: bool) -> torch.Tensor:
        if grouped:
            return _gmm(x32, w32.transpose(-2, -1), splits.ends(torch.int32))
        return self.split_fprop(x32, w32, None, splits)

    # --- FP8 quantization (NOTE: [FP8 emulation]) ------------------------------------------
    def quantize(self, t: torch.Tensor, spec, *, scale=None, amax=None, rowwise=True, columnwise=False) -> QTensor:
        """``functional_dw.fp8.quantize``; with ``amax`` (a view into a delayed-scaling state) the
        tensor's amax is maxed into it, as TE's cast kernel's atomic max does."""
        q = fp8_quantize(t, spec, scale=scale, rowwise=rowwise, columnwise=columnwise)
        if amax is not None:
            _record_amax(amax, q.amax)
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
    ) -> list[QTensor] | RowwiseActivation:
        """Each expert's rows on their own (``quantize_groups``; host sizes, a sync for device
        splits); ``amaxes`` (E views, or one strided ``[E]`` view) get the experts' amaxes.
        RowwiseScaling: the whole group at once (``kernels/rowwise.py``, no sync)."""
        if spec.scaling == "rowwise":
            return rowwise_ops.quantize_activation(x_TK, splits, spec, rowwise=rowwise, columnwise=columnwise)
        qs = quantize_groups(x_TK, splits.sizes(), spec, scales=scales, rowwise=rowwise, columnwise=columnwise)
        if amaxes is not None:
            if isinstance(amaxes, torch.Tensor):
                _record_amax(amaxes, torch.cat([q.amax for q in qs]))
            else:
                for a, q in zip(amaxes, qs):
                    _record_amax(a, q.amax)
        return qs

    def quantize_activated(self, fc1_out, probs, activation, splits, spec, *, rowwise: bool, columnwise: bool):
        """(Optional in the protocol.) grouped_mlp's h quantized from fc1's output in the
        quantization's own pass (RowwiseScaling on CUDA: ``kernels/rowwise.py``); None where
        this backend cannot: the caller writes h and quantizes it."""
        if spec.scaling != "rowwise":
            return None
        return rowwise_ops.quantize_activated(
            fc1_out, probs, activation, splits, spec, rowwise=rowwise, columnwise=columnwise
        )

    def quantize_group(self, w_ENK: Weights, spec, *, rowwise: bool, columnwise: bool):
        """A group's weights quantized together (RowwiseScaling, ``kernels/rowwise.py``)."""
        return rowwise_ops.quantize_weight(w_ENK, spec, rowwise=rowwise, columnwise=columnwise)

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
                _write(t, dy.t() @ x, accumulate)
            return out
        if _recorded(x_TK, dy_TN):
            return torch.stack([dy.t() @ x for x, dy in pairs])
        dw = x_TK.new_empty(splits.num_experts, dy_TN.shape[1], x_TK.shape[1])
        for e, (x, dy) in enumerate(pairs):
            torch.mm(dy.t(), x, out=dw[e])
        return dw


TORCH = TorchKernels()
