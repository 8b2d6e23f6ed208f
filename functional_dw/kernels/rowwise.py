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
import itertools
from typing import Any

import torch

from ..fp8 import rowwise as ref
from ..fp8.rowwise import RowwiseActivation, RowwiseWeight
from .packing import Weights, packed
from .splits import Splits, row_expert, to_device
from . import triton_rowwise

__all__ = [
    "ROWWISE",
    "RowwiseKernels",
    "fast",
    "check_device",
    "quantize_activation",
    "quantize_activated",
    "quantize_weight",
    "fprop",
    "dgrad",
    "wgrad",
]


@functools.lru_cache(maxsize=None)
def _sm90(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) == (9, 0)


def fast(t: torch.Tensor) -> bool:
    """Whether the CUDA kernels run on ``t``: an sm_90 GPU with Triton and torch's scaled grouped
    GEMM, and a plain tensor (a torch.func transform's wrapper has no memory Triton can read: the
    emulation runs under transforms)."""
    return (
        t.is_cuda
        and triton_rowwise.available(t)
        and hasattr(torch, "_scaled_grouped_mm")
        and _sm90(t.device)
        and not torch._C._functorch.is_functorch_wrapped_tensor(t)
    )


def check_device(x: torch.Tensor) -> None:
    """RowwiseScaling runs on the CPU (emulated) or on an sm_90 GPU in bfloat16; else ValueError/TypeError."""
    if not x.is_cuda or torch.compiler.is_compiling():  # (compiled: the ops' own checks at run time)
        return
    if not fast(x):
        raise ValueError(
            f"RowwiseScaling on CUDA runs torch's rowwise-scaled grouped GEMM and Triton kernels, which "
            f"need an sm_90 (Hopper) GPU, Triton and torch._scaled_grouped_mm; x is on {x.device}. Use "
            "TE's recipes (Float8CurrentScaling, Float8BlockScaling), or the CPU emulation"
        )
    if x.dtype != torch.bfloat16:
        raise TypeError(
            f"RowwiseScaling on CUDA takes bfloat16 activations (torch's scaled grouped GEMM writes "
            f"bfloat16), x is {x.dtype}: cast x and the weights to bfloat16"
        )


def _ends(splits: Splits) -> tuple[torch.Tensor, torch.Tensor]:
    """(int32 ends, int32 padded ends) of the token groups, on the device, cached on the record
    (host counts: summed on the host, one copy; device counts: on the device, no sync)."""

    def padded() -> torch.Tensor:
        if splits.host is not None:
            return to_device(
                itertools.accumulate(-(-s // ref.PAD) * ref.PAD for s in splits.host), torch.int32, splits.device
            )
        return ref.padded_ends(splits.on_device())

    return splits.ends(torch.int32), splits.cached("rowwise_pends", padded)


def quantize_activation(
    t_TD: torch.Tensor, splits: Splits, spec: Any, *, rowwise: bool, columnwise: bool, rows: torch.Tensor | None = None
) -> RowwiseActivation:
    """x or dy ``[T, D]`` per the recipe: the copies asked for. ``rows`` (int64 or int32 ``[R]``
    on t's device, values in ``[0, T)``, not checked on CUDA): the copies of ``t[rows]`` ``[R,
    D]``, whose groups ``splits`` gives (summing to R); eagerly on an sm_90 GPU the kernels read t
    through the index and ``t[rows]`` is never written (NOTE: [The gather as the load] in
    ``triton_rowwise.py``); compiled, under torch.func transforms and on the CPU ``t[rows]`` is
    gathered first."""
    if rows is not None:
        ref.check_rows(rows, t_TD)
        _check_rows_splits(rows, splits)
    ends, pends = _ends(splits)
    if torch.compiler.is_compiling():
        if rows is not None:  # compiled, the op quantizes the gathered rows: the gather is not fused there
            t_TD = t_TD.detach().index_select(0, rows)
        tensors = rowwise_quantize(t_TD, ends, pends, spec.power_2_scale, spec.amax_epsilon, rowwise, columnwise)
        return RowwiseActivation(*_present(tensors, rowwise, columnwise), tuple(t_TD.shape), t_TD.dtype)
    return _quantize_activation(t_TD, ends, pends, spec, rowwise, columnwise, rows)


def _check_rows_splits(rows: torch.Tensor, splits: Splits) -> None:
    """``splits`` count the ``R`` gathered rows (host facts only, no sync), as they count x's rows
    without ``rows`` (``check_sizes``); else ValueError. (On CUDA, groups ending past R would
    read past the index and write past the R-row outputs.)"""
    R = rows.shape[0]
    counted = splits.num_tokens if splits.host is None else sum(splits.host)
    if splits.num_tokens != R or counted != R:
        raise ValueError(
            f"rows holds {R} indices but splits count {counted} rows (num_tokens {splits.num_tokens}): "
            "with rows the groups are those of x[rows], so splits must sum to rows.shape[0]"
        )


def quantize_activated(
    fc1_out: torch.Tensor,
    probs: torch.Tensor | None,
    activation: str,
    splits: Splits,
    spec: Any,
    *,
    rowwise: bool,
    columnwise: bool,
) -> RowwiseActivation | None:
    """grouped_mlp's ``h = act(fc1_out) * probs`` quantized from fc1's output, the activation
    computed by the quantization's first kernel (NOTE: [The activation as the load] in
    ``triton_rowwise.py``), where the Triton kernels run (eager, on an sm_90 GPU); None
    elsewhere: the caller writes h with the activation kernel and quantizes it."""
    if not fast(fc1_out) or torch.compiler.is_compiling():
        return None
    ends, pends = _ends(splits)
    return triton_rowwise.quantize_activation(
        fc1_out, ends, pends, spec, rowwise=rowwise, columnwise=columnwise, act=(activation, probs)
    )


def _quantize_activation(t_TD, ends, pends, spec, rowwise, columnwise, rows=None) -> RowwiseActivation:
    # (vmap over rows alone leaves t plain: rows is then the transform's wrapper, which Triton cannot read)
    impl = triton_rowwise if fast(t_TD) and (rows is None or fast(rows)) else ref
    return impl.quantize_activation(t_TD, ends, pends, spec, rowwise=rowwise, columnwise=columnwise, rows=rows)


def quantize_weight(w_ENK: Weights, spec: Any, *, rowwise: bool, columnwise: bool) -> RowwiseWeight:
    """A group's weights (E ``[N, K]`` slices of one buffer are read in place, others stacked)."""
    if not isinstance(w_ENK, torch.Tensor):
        one = packed(w_ENK)
        w_ENK = one if one is not None else torch.stack(list(w_ENK))
    if torch.compiler.is_compiling():
        tensors = rowwise_quantize_weight(w_ENK, spec.power_2_scale, spec.amax_epsilon, rowwise, columnwise)
        return RowwiseWeight(*_present(tensors, rowwise, columnwise), tuple(w_ENK.shape), w_ENK.dtype)
    impl = triton_rowwise if fast(w_ENK) else ref
    return impl.quantize_weight(w_ENK.detach(), spec, rowwise=rowwise, columnwise=columnwise)


def _gmm(a, b, scale_a, scale_b, offs, split_accumulator: bool) -> torch.Tensor:
    return torch._scaled_grouped_mm(
        a, b, scale_a, scale_b, offs=offs, out_dtype=torch.bfloat16, use_fast_accum=not split_accumulator
    )


def _per_expert(a32: torch.Tensor, b32_E: torch.Tensor, splits: Splits, transpose: bool) -> torch.Tensor:
    """fp32 ``a_e @ b_e^T`` (or ``a_e @ b_e``) per expert's rows (the emulation: host sizes)."""
    parts = a32.split(splits.sizes())
    return torch.cat([p @ (b32_E[e].t() if transpose else b32_E[e]) for e, p in enumerate(parts)]) if parts else a32


def _row_bias(b_EN: torch.Tensor, splits: Splits) -> torch.Tensor:
    """Each token row's expert's bias (the reference's row -> expert index, cached on the record:
    backward's bias sums read the same one)."""
    return b_EN[row_expert(splits)]


def fprop(
    xq: RowwiseActivation, wq: RowwiseWeight, b_EN: torch.Tensor | None, splits: Splits, *, split_accumulator: bool
) -> torch.Tensor:
    """``y_e = x_e W_e^T + b_e`` from x's and W's rowwise copies."""
    if torch.compiler.is_compiling():
        # the bias goes into the op: it is added where eager adds it (to the fp32 product on
        # the emulation, rounded once), not to the op's rounded output
        return rowwise_gemm(
            "fprop",
            xq.rowwise_data,
            xq.rowwise_scale_inv,
            wq.rowwise_data,
            wq.rowwise_scale_inv,
            splits.tensor,
            splits.num_tokens,
            xq.dtype,
            split_accumulator,
            b_EN,
        )
    x, w = xq.rowwise_data, wq.rowwise_data
    if fast(x):
        y = _gmm(
            x,
            w.transpose(-2, -1),
            xq.rowwise_scale_inv,
            wq.rowwise_scale_inv,
            splits.ends(torch.int32),
            split_accumulator,
        )
        return y if b_EN is None else y.add_(_row_bias(b_EN, splits))
    y32 = _per_expert(
        x.float() * xq.rowwise_scale_inv[:, None], w.float() * wq.rowwise_scale_inv[..., None], splits, transpose=True
    )
    if b_EN is not None:
        y32 = y32 + _row_bias(b_EN.float(), splits)
    return y32.to(xq.dtype)


def dgrad(dyq: RowwiseActivation, wq: RowwiseWeight, splits: Splits, *, split_accumulator: bool) -> torch.Tensor:
    """``dx_e = dy_e W_e`` from dy's rowwise and W's columnwise copies."""
    if torch.compiler.is_compiling():
        return rowwise_gemm(
            "dgrad",
            dyq.rowwise_data,
            dyq.rowwise_scale_inv,
            wq.columnwise_data,
            wq.columnwise_scale_inv,
            splits.tensor,
            splits.num_tokens,
            dyq.dtype,
            split_accumulator,
        )
    dy, wt = dyq.rowwise_data, wq.columnwise_data  # wt: [E, K, N]
    if fast(dy):
        return _gmm(
            dy,
            wt.transpose(-2, -1),
            dyq.rowwise_scale_inv,
            wq.columnwise_scale_inv,
            splits.ends(torch.int32),
            split_accumulator,
        )
    dx32 = _per_expert(
        dy.float() * dyq.rowwise_scale_inv[:, None],
        wt.float() * wq.columnwise_scale_inv[..., None],
        splits,
        transpose=True,
    )
    return dx32.to(dyq.dtype)


def wgrad(
    xq: RowwiseActivation,
    dyq: RowwiseActivation,
    splits: Splits,
    *,
    out: Weights | None,
    accumulate: bool,
    split_accumulator: bool,
) -> Weights:
    """``dW_e = dy_e^T x_e`` from both columnwise copies: a fresh ``[E, N, K]`` in the
    activations' dtype, or written (added when ``accumulate``) into ``out``."""
    if torch.compiler.is_compiling():
        dw = rowwise_gemm(
            "wgrad",
            xq.columnwise_data,
            xq.columnwise_scale_inv,
            dyq.columnwise_data,
            dyq.columnwise_scale_inv,
            splits.tensor,
            splits.num_tokens,
            xq.dtype,
            split_accumulator,
        )
        return _written(dw, out, accumulate)
    ends, pends = _ends(splits)
    if fast(xq.columnwise_data):
        dw = _gmm(
            dyq.columnwise_data,
            xq.columnwise_data.t(),
            dyq.columnwise_scale_inv.reshape(-1),
            xq.columnwise_scale_inv.reshape(-1),
            pends,
            split_accumulator,
        )
    else:
        x32 = ref.dequantize_columns(xq, ends, pends)
        dy32 = ref.dequantize_columns(dyq, ends, pends)
        sizes = splits.sizes()
        dw = torch.stack([d.t() @ x for d, x in zip(dy32.split(sizes), x32.split(sizes))])
        if out is None:
            dw = dw.to(xq.dtype)
    return _written(dw, out, accumulate)


class RowwiseKernels:
    """RowwiseScaling's FP8 kernels (NOTE: [FP8 kernels by family] in ``fp8_plan.py``): the group
    quantized at once (:func:`quantize_activation`, :func:`quantize_weight`) and one grouped GEMM
    per product (:func:`fprop`, :func:`dgrad`, :func:`wgrad`; Triton and torch's scaled grouped
    GEMM on an sm_90 GPU, the emulation elsewhere). A grouped (expert) recipe: there is no one-GEMM
    product and no per-expert path, and ``grouped`` is not read. ``name`` is its backend's, which
    ``plan.route`` reads."""

    name = "torch"
    fp8_only = True  # FP8 operands only: a bf16 call through them is refused (resolve.refuse_fp8_only)

    def __repr__(self) -> str:
        return "RowwiseKernels()"

    def grouped_path_unsupported(self, x_TK: torch.Tensor, w_ENK: Weights, recipe: Any = None) -> str | None:
        """Never: the products have one grouped path (the family fixes it)."""
        return None

    def quantize(self, t: torch.Tensor, spec: Any, **kwargs: Any) -> Any:
        raise ValueError(_NO_ONE_GEMM)

    def grouped_quantize(
        self, x_TK, splits, spec, *, scales=None, amaxes=None, rowwise=True, columnwise=False, grouped=True, rows=None
    ) -> RowwiseActivation:
        """The whole group at once (no sync); RowwiseScaling has no state (no scales, no amaxes).
        ``rows``: the group is ``x_TK[rows]`` (``splits`` its groups), gathered by the
        quantization's loads where the Triton kernels run eagerly (:func:`quantize_activation`)."""
        return quantize_activation(x_TK, splits, spec, rowwise=rowwise, columnwise=columnwise, rows=rows)

    def quantize_activated(self, fc1_out, probs, activation, splits, spec, *, rowwise: bool, columnwise: bool):
        """grouped_mlp's h quantized from fc1's output in the quantization's own pass (on CUDA:
        :func:`quantize_activated`); None where this cannot: the caller writes h and quantizes it."""
        return quantize_activated(fc1_out, probs, activation, splits, spec, rowwise=rowwise, columnwise=columnwise)

    def quantize_group(self, w_ENK: Weights, spec: Any, *, rowwise: bool, columnwise: bool) -> RowwiseWeight:
        """A group's weights quantized together (:func:`quantize_weight`)."""
        return quantize_weight(w_ENK, spec, rowwise=rowwise, columnwise=columnwise)

    def fprop(self, x_TK, w_NK, b_N, *, split_accumulator: bool = False):
        raise ValueError(_NO_ONE_GEMM)

    def dgrad(self, dy_TN, w_NK, *, split_accumulator: bool = False):
        raise ValueError(_NO_ONE_GEMM)

    def wgrad(self, x_TK, dy_TN, **kwargs: Any):
        raise ValueError(_NO_ONE_GEMM)

    def grouped_fprop(self, x_TK, w_ENK, b_EN, splits, grouped=True, *, split_accumulator=False):
        return fprop(x_TK, w_ENK, b_EN, splits, split_accumulator=split_accumulator)

    def grouped_dgrad(self, dy_TN, w_ENK, splits, grouped=True, *, split_accumulator=False):
        return dgrad(dy_TN, w_ENK, splits, split_accumulator=split_accumulator)

    def grouped_wgrad(
        self,
        x_TK,
        dy_TN,
        splits,
        grouped=True,
        *,
        out=None,
        accumulate=False,
        with_dbias=False,
        split_accumulator=False,
    ):
        if with_dbias:
            raise ValueError(
                "with_dbias=True needs dy in high precision; with FP8 operands the layer sums the bias "
                "grad from its high-precision dy itself"
            )
        return wgrad(x_TK, dy_TN, splits, out=out, accumulate=accumulate, split_accumulator=split_accumulator), None


_NO_ONE_GEMM = (
    "RowwiseScaling is a grouped (expert) recipe: its kernels multiply a group (grouped_fprop, "
    "grouped_dgrad, grouped_wgrad), not one GEMM"
)


ROWWISE = RowwiseKernels()


def _written(dw: torch.Tensor, out: Weights | None, accumulate: bool) -> Weights:
    if out is None:
        return dw
    target = out if isinstance(out, torch.Tensor) else packed(out)
    pairs = [(target, dw)] if target is not None else list(zip(out, dw))
    for t, d in pairs:
        t.add_(d) if accumulate else t.copy_(d)
    return out


# NOTE: [RowwiseScaling under torch.compile] While compiling, the quantization and the three
# GEMMs are the opaque custom ops below: their real implementations are the eager functions
# above (Triton and torch's scaled grouped GEMM on an sm_90 GPU, the emulation elsewhere, which
# reads host sizes at run time), their fake ones give the shapes. So one graph serves every
# routing (the counts are data: NOTE: [Splits under torch.compile]), and nothing of Triton or
# of the host sizes is traced. Compiled, forward keeps no FP8 weight for backward (backward
# quantizes the weights again) and the weight cache is not used (NOTE: [FP8 weights per version]).


@torch.library.custom_op("functional_dw::rowwise_quantize", mutates_args=())
def rowwise_quantize(
    t: torch.Tensor,
    ends: torch.Tensor,
    pends: torch.Tensor,
    power_2_scale: bool,
    amax_epsilon: float,
    rowwise: bool,
    columnwise: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rowwise data, its inverse scales, columnwise data, its inverse scales); a copy not asked
    for is an empty tensor."""
    spec = _spec(power_2_scale, amax_epsilon)
    return _as_tensors(_quantize_activation(t, ends, pends, spec, rowwise, columnwise), t)


@rowwise_quantize.register_fake
def _(t, ends, pends, power_2_scale, amax_epsilon, rowwise, columnwise):
    T, D = t.shape
    E = ends.shape[0]
    return _empties(t, ((T, D), (T,), (D, ref.padded_columns(T, E)), (E, D)), rowwise, columnwise)


_DTYPES = (torch.float8_e4m3fn, torch.float32, torch.float8_e4m3fn, torch.float32)  # data, scales, data, scales


def _as_tensors(q: Any, like: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A quantized record's four tensors as a custom op returns them: a copy it lacks as an empty tensor."""
    held = (q.rowwise_data, q.rowwise_scale_inv, q.columnwise_data, q.columnwise_scale_inv)
    return tuple(t if t is not None else like.new_empty(0, dtype=d) for t, d in zip(held, _DTYPES))


def _empties(like: torch.Tensor, shapes: Any, rowwise: bool, columnwise: bool) -> tuple[torch.Tensor, ...]:
    """The fake outputs: the four tensors' shapes, an empty one for a copy not asked for."""
    return tuple(
        like.new_empty(shape if keep else (0,), dtype=d)
        for shape, keep, d in zip(shapes, (rowwise, rowwise, columnwise, columnwise), _DTYPES)
    )


def _present(tensors: Any, rowwise: bool, columnwise: bool) -> tuple[Any, ...]:
    """The four tensors of :func:`_as_tensors` back as a record's fields (None for a copy not asked for)."""
    return tuple(t if keep else None for t, keep in zip(tensors, (rowwise, rowwise, columnwise, columnwise)))


@torch.library.custom_op("functional_dw::rowwise_quantize_weight", mutates_args=())
def rowwise_quantize_weight(
    w: torch.Tensor, power_2_scale: bool, amax_epsilon: float, rowwise: bool, columnwise: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`quantize_weight` of ``[E, N, K]`` as tensors (a copy not asked for: empty)."""
    return _as_tensors(
        quantize_weight(w, _spec(power_2_scale, amax_epsilon), rowwise=rowwise, columnwise=columnwise), w
    )


@rowwise_quantize_weight.register_fake
def _(w, power_2_scale, amax_epsilon, rowwise, columnwise):
    E, N, K = w.shape
    return _empties(w, ((E, N, K), (E, N), (E, K, N), (E, K)), rowwise, columnwise)


def _spec(power_2_scale: bool, amax_epsilon: float) -> Any:
    from ..fp8.spec import TensorSpec

    return TensorSpec("input", "rowwise", torch.float8_e4m3fn, power_2_scale=power_2_scale, amax_epsilon=amax_epsilon)


@torch.library.custom_op("functional_dw::rowwise_gemm", mutates_args=())
def rowwise_gemm(
    kind: str,
    a: torch.Tensor,
    a_sinv: torch.Tensor,
    b: torch.Tensor,
    b_sinv: torch.Tensor,
    splits: torch.Tensor,
    num_tokens: int,
    dtype: torch.dtype,
    split_accumulator: bool,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """One of the three products on the copies :func:`fprop`, :func:`dgrad`, :func:`wgrad` read
    (``a``, ``b``: x/W, dy/W, x/dy), the splits as a tensor (read at run time); ``bias`` [E, N]
    for fprop only."""
    E = splits.shape[0]
    sp = Splits(host=None, tensor=splits, device=a.device, num_tokens=num_tokens, num_experts=E)
    if kind == "wgrad":
        shape = (num_tokens, a.shape[0])
        xq = RowwiseActivation(None, None, a, a_sinv, shape, dtype)
        dyq = RowwiseActivation(None, None, b, b_sinv, (num_tokens, b.shape[0]), dtype)
        return wgrad(xq, dyq, sp, out=None, accumulate=False, split_accumulator=split_accumulator)
    q = RowwiseActivation(a, a_sinv, None, None, tuple(a.shape), dtype)
    if kind == "fprop":
        return fprop(
            q,
            RowwiseWeight(b, b_sinv, None, None, tuple(b.shape), dtype),
            bias,
            sp,
            split_accumulator=split_accumulator,
        )
    w = RowwiseWeight(None, None, b, b_sinv, (b.shape[0], b.shape[2], b.shape[1]), dtype)
    return dgrad(q, w, sp, split_accumulator=split_accumulator)


@rowwise_gemm.register_fake
def _(kind, a, a_sinv, b, b_sinv, splits, num_tokens, dtype, split_accumulator, bias=None):
    if kind == "wgrad":
        return a.new_empty((a_sinv.shape[0], b.shape[0], a.shape[0]), dtype=dtype)  # [E, N, K]
    return a.new_empty((num_tokens, b.shape[1]), dtype=dtype)  # fprop: [T, N] (b [E, N, K]); dgrad: [T, K]
