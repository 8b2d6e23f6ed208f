"""FP8 on Transformer Engine 2.20's kernels: what ``te.Linear`` / ``te.GroupedLinear`` do under
``te.autocast(recipe=...)``, call for call, with quantizers built from ``fp8.TensorSpec``.

* :func:`quantizer`: TE's quantizer for a spec, set up as TE's modules set theirs up
  (``quantization.py: *RecipeState.make_quantizers``, the modules' ``_get_quantizers`` and
  ``_customize_quantizers_float8_current_scaling``).
* :class:`TEQ`: a TE storage (one tensor, or on the grouped path the ``GroupedTensorStorage`` of
  ``tex.group_quantize``); :class:`TEQGroup`: E ``TEQ`` (split path). Both are pytree nodes whose
  leaves are the storages' tensors, so they go through ``save_for_backward`` and its hooks.
* :func:`quantize`, :func:`quantize_each`, :func:`grouped_quantize`; the GEMMs on these operands are
  ``te_fp8_gemm.TEFP8Kernels``'.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.utils._pytree as pytree
import transformer_engine.pytorch  # noqa: F401  (loads libtransformer_engine before the extension)
import transformer_engine_torch as tex
from transformer_engine.pytorch.tensor import Float8BlockQuantizer, Float8CurrentScalingQuantizer, Float8Quantizer
from transformer_engine.pytorch.tensor.storage.float8_blockwise_tensor_storage import Float8BlockwiseQTensorStorage
from transformer_engine.pytorch.tensor.storage.float8_tensor_storage import Float8TensorStorage
from transformer_engine.pytorch.tensor.storage.grouped_tensor_storage import GroupedTensorStorage

from .. import fp8
from .packing import per_expert
from .te_shared import grouped_dbias, host_sizes, te_env
from .te_fp8_checks import check_per_expert, check_quantize, env_of

__all__ = [
    "TEQ",
    "TEQGroup",
    "TEQuantized",
    "quantizer",
    "quantize",
    "quantize_each",
    "grouped_quantize",
    "update_delayed_",
]


# NOTE: [dbias under FP8] TE takes the bias grad from the high-precision dy while quantizing it:
# ``tex.bgrad_quantize`` (delayed scaling: a fused cast+transpose+dbias kernel, used when dy is cast
# both ways, which TE's dy quantizers always are; current scaling: ``at::sum_out``), a torch sum for
# block scaling (``_split_quantize``, ``grad_output_preprocess``), and on the grouped path
# ``tex.bgrad_group_quantize`` (block scaling with rowwise dy) or the Triton ``compute_grouped_dbias``.
# ``with_dbias=True`` at quantization does that. A wgrad asked ``with_dbias`` for a dy quantized
# without it recomputes it the same way from dy (one more quantization, nothing recorded).

_TE_FP8 = {torch.float8_e4m3fn: tex.DType.kFloat8E4M3, torch.float8_e5m2: tex.DType.kFloat8E5M2}
# (rowwise names, columnwise names) of each storage's get_metadata() (= its constructor's kwargs)
_USAGE = {
    Float8TensorStorage: (("data",), ("data_transpose",)),
    Float8BlockwiseQTensorStorage: (("rowwise_data", "rowwise_scale_inv"), ("columnwise_data", "columnwise_scale_inv")),
    GroupedTensorStorage: (("data", "scale_inv"), ("columnwise_data", "columnwise_scale_inv")),
}
# The per-expert storages' instance attributes: (rowwise ones, columnwise ones, shared tensors).
# NOTE: [Storages by attribute] Per expert and per step, rebuilding a storage through its
# constructor (get_metadata, **kwargs, a quantizer copy) cost more host time than the GEMM
# launches at E=32; these two classes are plain attribute bags (no __slots__, no __init__), so
# a copy of the instance dict with some tensors set to None is the same storage, built in a
# microsecond. (The grouped storage, one per call, keeps the constructor.)
_ATTRS = {
    Float8TensorStorage: (("_data",), ("_transpose",), ("_scale_inv",)),
    Float8BlockwiseQTensorStorage: (
        ("_rowwise_data", "_rowwise_scale_inv"),
        ("_columnwise_data", "_columnwise_scale_inv"),
        (),
    ),
}


def _fields(st: Any) -> dict:
    """``st``'s instance dict, a stale FP8 transpose (``_transpose_invalid``) dropped."""
    d = dict(st.__dict__)
    if d.get("_transpose_invalid"):
        d["_transpose"] = None
    return d


def _rebuilt(cls: type, d: dict) -> Any:
    st = object.__new__(cls)
    st.__dict__.update(d)
    if cls is Float8TensorStorage:
        st._transpose_invalid = st._transpose is None
    return st


def _meta(st: Any) -> dict:
    """Constructor kwargs that rebuild ``st`` (its tensors and everything else)."""
    if isinstance(st, GroupedTensorStorage):  # what GroupedTensorStorage.copy() passes
        names = (
            "num_tensors",
            "quantizer",
            "columnwise_data",
            "scale_inv",
            "columnwise_scale_inv",
            "amax",
            "columnwise_amax",
            "scale",
            "first_dims",
            "last_dims",
            "tensor_offsets",
            "offsets",
            "scale_inv_offsets",
            "columnwise_scale_inv_offsets",
            "row_scaled_nvfp4",
            "nvfp4_use_4over6",
            "nvfp4_e4m3_max",
        )
        return dict(
            shape=st.logical_shape,
            dtype=st.fake_dtype,
            shapes=st.tensor_shapes,
            data=st.rowwise_data,
            with_gemm_swizzled_scales=st._with_gemm_swizzled_scales,
            **{n: getattr(st, n) for n in names},
        )
    meta = st.get_metadata()
    if isinstance(st, Float8TensorStorage) and st._transpose_invalid:
        meta["data_transpose"] = None  # a stale transpose is no columnwise copy
    return meta


def _with_usage(st: Any, rowwise: bool, columnwise: bool) -> Any:
    """A new storage over the same tensors, holding only the copies asked for."""
    attrs = _ATTRS.get(type(st))
    d = _fields(st) if attrs is not None else _meta(st)
    names = attrs[:2] if attrs is not None else _USAGE[type(st)]
    for want, ns, what in zip((rowwise, columnwise), names, ("rowwise", "columnwise")):
        if want and d[ns[0]] is None:
            raise ValueError(f"this FP8 tensor holds no {what} data; quantize it with {what}=True")
        if not want:
            d.update(dict.fromkeys(ns))
    return _rebuilt(type(st), d) if attrs is not None else type(st)(**d)


def _split_meta(st: Any) -> tuple[list, tuple]:
    attrs = _ATTRS.get(type(st))
    if attrs is not None:  # NOTE: [Storages by attribute]
        d = _fields(st)
        names = tuple(n for group in attrs for n in group if d[n] is not None)
        tensors = [d.pop(n) for n in names]
        return tensors, (type(st), names, tuple(d.items()))
    meta = _meta(st)
    names = tuple(k for k, v in meta.items() if isinstance(v, torch.Tensor))
    return [meta[k] for k in names], (type(st), names, tuple((k, v) for k, v in meta.items() if k not in names))


def _join_meta(tensors: list, ctx: tuple) -> Any:
    cls, names, others = ctx
    if cls in _ATTRS:
        return _rebuilt(cls, {**dict(others), **dict(zip(names, tensors))})
    return cls(**dict(others), **dict(zip(names, tensors)))


class TEQuantized:
    """What both wrappers share: the source's ``shape``/``dtype``, and for dy its bias grad
    (``dbias``, or ``redo`` to recompute it; see the module NOTE)."""

    def bias_grad(self) -> torch.Tensor:
        if self.dbias is not None:
            return self.dbias
        if self._redo is None:
            raise ValueError(
                "with_dbias=True needs dy's bias grad, but this FP8 tensor was not quantized from a "
                "'grad_output' spec: quantize dy with with_dbias=True"
            )
        return self._redo().dbias


class TEQ(TEQuantized):
    """A tensor quantized by TE. ``storage``: ``Float8TensorStorage`` (delayed, current scaling),
    ``Float8BlockwiseQTensorStorage`` (block), or on the grouped-tensor path the
    ``GroupedTensorStorage`` of ``tex.group_quantize`` (a whole group's rows: :attr:`is_grouped`)."""

    def __init__(self, storage: Any, shape: tuple, dtype: torch.dtype, dbias=None, redo=None) -> None:
        self.storage, self.shape, self.dtype, self.dbias, self._redo = storage, tuple(shape), dtype, dbias, redo

    @property
    def is_grouped(self) -> bool:
        return isinstance(self.storage, GroupedTensorStorage)

    def with_usage(self, *, rowwise: bool, columnwise: bool) -> "TEQ":
        """This tensor with only the copies asked for (no data is copied; ``self`` is unchanged).
        A grouped storage drops data and scales as te.GroupedLinear does after forward."""
        return TEQ(_with_usage(self.storage, rowwise, columnwise), self.shape, self.dtype, self.dbias, self._redo)

    def __repr__(self) -> str:
        return f"TEQ({type(self.storage).__name__}, {list(self.shape)}, {self.dtype})"


class TEQGroup(TEQuantized):
    """A group's rows on the split path: ``parts``, one :class:`TEQ` per expert (also as a sequence)."""

    def __init__(self, parts: list, shape: tuple, dtype: torch.dtype, dbias=None, redo=None) -> None:
        self.parts, self.shape, self.dtype, self.dbias, self._redo = list(parts), tuple(shape), dtype, dbias, redo

    is_grouped = False

    def __len__(self) -> int:
        return len(self.parts)

    def __getitem__(self, e: int) -> TEQ:
        return self.parts[e]

    def with_usage(self, *, rowwise: bool, columnwise: bool) -> "TEQGroup":
        parts = [p.with_usage(rowwise=rowwise, columnwise=columnwise) for p in self.parts]
        return TEQGroup(parts, self.shape, self.dtype, self.dbias, self._redo)

    def __repr__(self) -> str:
        return f"TEQGroup({len(self.parts)} experts, {list(self.shape)}, {self.dtype})"


def _flatten(q: TEQuantized):
    """Leaves: the storage's tensors (a TEQGroup: its parts), then dbias if any."""
    children, ctx = _split_meta(q.storage) if isinstance(q, TEQ) else (list(q.parts), None)
    return children + ([q.dbias] if q.dbias is not None else []), (
        ctx,
        len(children),
        q.shape,
        q.dtype,
        q.dbias is not None,
        q._redo,
    )


def _unflatten(cls: type):
    def unflatten(children, context) -> TEQuantized:
        ctx, n, shape, dtype, has_db, redo = context
        children = list(children)
        first = _join_meta(children[:n], ctx) if cls is TEQ else children[:n]
        return cls(first, shape, dtype, children[n] if has_db else None, redo)

    return unflatten


pytree.register_pytree_node(TEQ, _flatten, _unflatten(TEQ))
pytree.register_pytree_node(TEQGroup, _flatten, _unflatten(TEQGroup))


# --- quantizers and quantization -----------------------------------------------------------


def quantizer(
    spec: fp8.TensorSpec,
    device: torch.device,
    *,
    scale: torch.Tensor | None = None,
    amax: torch.Tensor | None = None,
    rowwise: bool = True,
    columnwise: bool = False,
) -> Any:
    """TE's quantizer for ``spec``, as TE's modules build and configure it. Delayed scaling:
    ``Float8Quantizer(scale, amax.reshape(1), dtype)`` over views into the caller's state
    (``DelayedScalingRecipeState.make_quantizers``); ``amax=None`` records into a scratch.
    A new quantizer on every call: the caller may configure it (``set_usage``, its settings)
    without changing what this module's own quantizations do (they reuse cached ones)."""
    if spec.scaling != "delayed":
        return _settings_quantizer.__wrapped__(spec, device, rowwise, columnwise)
    return _delayed_quantizer(spec, device, scale, amax, rowwise, columnwise)


def _quantizer(
    spec: fp8.TensorSpec,
    device: torch.device,
    *,
    scale: torch.Tensor | None = None,
    amax: torch.Tensor | None = None,
    rowwise: bool = True,
    columnwise: bool = False,
) -> Any:
    """:func:`quantizer` for this module's quantizations, reused as a TE module reuses its
    quantizers: current and block scaling's made once per (spec, device, usage) (they hold
    settings only; each storage made copies it); delayed scaling's once per pair of state slots
    (NOTE: [Delayed quantizers by address]). Never handed out: a caller's change to a shared
    one would change every later quantization."""
    if spec.scaling != "delayed":
        return _settings_quantizer(spec, device, rowwise, columnwise)
    if not (
        isinstance(scale, torch.Tensor) and isinstance(amax, torch.Tensor) and scale.numel() == 1 and amax.numel() == 1
    ):  # (backward's re-quantization: forward's scale snapshot, no amax)
        return _delayed_quantizer(spec, device, scale, amax, rowwise, columnwise)
    # NOTE: [Delayed quantizers by address] Made once per (spec, usage, scale and amax slots)
    # and reused, as TE's module keeps its quantizers: the key is the slots' addresses, and
    # the cached quantizer holds views of them, so their memory stays allocated (no other
    # tensor can take the address) while the entry lives; the values are read on the device
    # at each cast, so in-place state updates are seen. A state replaced by new tensors has
    # new addresses, hence new quantizers.
    key = (spec, rowwise, columnwise, device, scale.data_ptr(), amax.data_ptr())
    q = _DELAYED.get(key)
    if q is None:
        if len(_DELAYED) >= _DELAYED_MAX:
            _DELAYED.pop(next(iter(_DELAYED)))
        q = _DELAYED[key] = _delayed_quantizer(spec, device, scale, amax, rowwise, columnwise)
    return q


_DELAYED: dict = {}
_DELAYED_MAX = 8192  # quantizers (a few hundred bytes each): E per role and usage per layer


def _delayed_quantizer(spec, device, scale, amax, rowwise: bool, columnwise: bool) -> Any:
    amax = (
        torch.zeros(1, dtype=torch.float32, device=device)
        if amax is None
        else (amax if amax.dim() == 1 else amax.reshape(1))
    )
    return _configured(Float8Quantizer(scale, amax, _TE_FP8[spec.fp8_dtype]), spec, rowwise, columnwise)


@functools.lru_cache(maxsize=256)
def _settings_quantizer(spec: fp8.TensorSpec, device: torch.device, rowwise: bool, columnwise: bool) -> Any:
    dt = _TE_FP8[spec.fp8_dtype]
    if spec.scaling == "current":  # with the module's _customize_quantizers_float8_current_scaling
        q = Float8CurrentScalingQuantizer(
            dt, device=device, force_pow_2_scales=spec.power_2_scale, amax_epsilon=spec.amax_epsilon
        )
    else:  # Float8BlockScalingRecipeState._make
        q = Float8BlockQuantizer(
            fp8_dtype=dt,
            rowwise=True,
            columnwise=True,
            amax_epsilon=spec.amax_epsilon,
            force_pow_2_scales=spec.power_2_scale,
            block_scaling_dim=1 if spec.block[0] == 1 else 2,
        )
    return _configured(q, spec, rowwise, columnwise)


def _configured(q: Any, spec: fp8.TensorSpec, rowwise: bool, columnwise: bool) -> Any:
    q.set_usage(rowwise=rowwise, columnwise=columnwise)
    q.internal = True  # storages, not QuantizedTensor subclasses (TE's _get_quantizers)
    q.optimize_for_gemm = spec.role != "weight"  # inputs and grads; weights: _enable_weight_preswizzle -> False
    return q


def _env(t: Any) -> tuple:
    """The device facts :func:`check_quantize` reads (after refusing a non-CUDA tensor)."""
    if not isinstance(t, torch.Tensor):
        return (0, 0), 0, (0, 0)  # check_quantize refuses it first
    if t.device.type != "cuda":
        raise ValueError(f"backend='te' quantizes CUDA tensors; got one on {t.device}. Use backend='torch'")
    return _device_env(t.device.index if t.device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _device_env(index: int) -> tuple:
    return env_of(*te_env(index))


def _made_usage(spec, rowwise: bool, columnwise: bool, with_dbias: bool) -> tuple[bool, bool]:
    """Per-tensor FP8 has no columnwise-only cast on Hopper (``check_per_tensor_fp8_quantize_output``),
    and dy with a bias grad is cast both ways (TE's dy quantizers; the fused dbias kernel needs both)."""
    if spec.scaling == "block":
        return rowwise, columnwise
    return True, columnwise or with_dbias


def quantize(
    t: torch.Tensor,
    spec: fp8.TensorSpec,
    *,
    scale=None,
    amax=None,
    rowwise: bool = True,
    columnwise: bool = False,
    with_dbias: bool = False,
) -> TEQ:
    """``t [rows, cols]`` quantized as ``te.Linear`` quantizes x, its weight and dy."""
    check_quantize(t, spec, scale, amax, rowwise, columnwise, _env(t), None)
    x = t.detach().contiguous()
    row, col = _made_usage(spec, rowwise, columnwise, with_dbias)
    q = _quantizer(spec, x.device, scale=scale, amax=amax, rowwise=row, columnwise=col)
    dbias = None
    if with_dbias and spec.scaling != "block":
        dbias, st = tex.bgrad_quantize(x.reshape(-1, x.shape[-1]), q)
    else:  # block: grad_output_preprocess sums dy in torch, then quantizes
        dbias = x.reshape(-1, x.shape[-1]).sum(dim=0) if with_dbias else None
        st = tex.quantize(x, q)  # what q(x) runs, without its Python frames (an internal quantizer)
    redo = (
        None
        if with_dbias or spec.role != "grad_output"
        else functools.partial(quantize, x, spec, scale=scale, rowwise=rowwise, columnwise=columnwise, with_dbias=True)
    )
    out = TEQ(st, x.shape, x.dtype, dbias, redo)
    return out if (row, col) == (rowwise, columnwise) else out.with_usage(rowwise=rowwise, columnwise=columnwise)


def quantize_each(
    ts: Any, spec: fp8.TensorSpec, *, scales=None, amaxes=None, rowwise: bool = True, columnwise: bool = False
) -> list[TEQ]:
    """:func:`quantize` of each of E tensors of one shape, dtype and device (a group's weights),
    with delayed scaling's per-tensor ``scales``/``amaxes`` (strided ``[E]`` views, or None):
    checked once, then one TE quantize call each (the per-expert loop is the host's hot path
    of an FP8 group)."""
    ts = list(ts)
    if not ts:
        return []
    t0 = ts[0]
    check_quantize(t0, spec, scales, amaxes, rowwise, columnwise, _env(t0), None)
    if not all(
        isinstance(t, torch.Tensor) and t.shape == t0.shape and t.dtype == t0.dtype and t.device == t0.device
        for t in ts
    ):
        raise ValueError(
            f"quantize_each takes tensors of one shape, dtype and device (like the first, "
            f"{tuple(t0.shape)} {t0.dtype} on {t0.device}); quantize others one by one"
        )
    if scales is not None:  # (check_quantize counts them only for a group of rows)
        check_per_expert(scales, len(ts), "scales")
        if amaxes is not None:
            check_per_expert(amaxes, len(ts), "amaxes")
    per = per_expert(scales, amaxes, len(ts))
    row, col = _made_usage(spec, rowwise, columnwise, False)
    trim = (row, col) != (rowwise, columnwise)
    out, device = [], t0.device
    shared = None if spec.scaling == "delayed" else _quantizer(spec, device, rowwise=row, columnwise=col)
    for t, (scale, amax) in zip(ts, per):
        q = (
            shared
            if shared is not None
            else _quantizer(spec, device, scale=scale, amax=amax, rowwise=row, columnwise=col)
        )
        x = t.detach().contiguous()
        tq = TEQ(tex.quantize(x, q), x.shape, x.dtype)  # q(x) without its Python frames
        out.append(tq.with_usage(rowwise=rowwise, columnwise=columnwise) if trim else tq)
    return out


def _offsets1(splits, C: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sizes_E, rows_E1, elems_E1) for rows of C columns, int64 on the device, no sync."""

    def make():
        sizes_E, offs = tex.splits_to_offsets_multi(
            splits.on_device().contiguous(),
            splits.device,
            strides=[1, C],
            include_leading_zero=[True, True],
            dtypes=[torch.int64] * 2,
            bulk_allocate=True,
        )
        return (sizes_E, *offs)

    return splits.cached(("te_fp8_offsets", C), make)


def _group_quantize(x: torch.Tensor, splits, spec: fp8.TensorSpec, rowwise: bool, columnwise: bool, with_dbias: bool):
    """(storage, dbias) of the grouped path: ``tex.group_quantize`` of the whole group (with the
    fused block-scaling bias grad where it applies: it needs rowwise)."""
    sizes_E, rows_E1, offs = _offsets1(splits, x.shape[1])
    q = _quantizer(spec, x.device, rowwise=rowwise, columnwise=columnwise)
    if with_dbias and spec.scaling == "block" and rowwise:
        return tex.bgrad_group_quantize(x, q, splits.num_experts, sizes_E, tensor_offsets=offs)
    st = tex.group_quantize(x, q, splits.num_experts, sizes_E, tensor_offsets=offs)
    return st, (grouped_dbias(x, splits, rows_E1) if with_dbias else None)


def grouped_quantize(
    x: torch.Tensor,
    splits,
    spec: fp8.TensorSpec,
    *,
    scales=None,
    amaxes=None,
    rowwise: bool = True,
    columnwise: bool = False,
    grouped: bool = False,
    with_dbias: bool = False,
) -> TEQGroup | TEQ:
    """Each expert's rows of ``x [T, C]``: ``tex.split_quantize`` with one quantizer per expert
    (split path, ``_split_quantize``) or ``tex.group_quantize`` (grouped path, current and block
    scaling only, as ``_forward_grouped_tensor`` / ``_backward_grouped_tensor``)."""
    check_quantize(x, spec, scales, amaxes, rowwise, columnwise, _env(x), (splits, grouped))
    E, x = splits.num_experts, x.detach().contiguous()
    again = dict(scales=scales, rowwise=rowwise, columnwise=columnwise, grouped=grouped, with_dbias=True)
    later = (
        None
        if with_dbias or spec.role != "grad_output"
        else functools.partial(grouped_quantize, x, splits, spec, **again)
    )
    if grouped and splits.num_tokens:
        st, dbias = _group_quantize(x, splits, spec, rowwise, columnwise, with_dbias)
        return TEQ(st, x.shape, x.dtype, dbias, later)
    sizes = host_sizes(splits)
    row, col = _made_usage(spec, rowwise, columnwise, with_dbias)
    qs = [
        _quantizer(spec, x.device, scale=scale, amax=amax, rowwise=row, columnwise=col)
        for scale, amax in per_expert(scales, amaxes, E)
    ]
    dbias = None
    if with_dbias and spec.scaling != "block":  # _split_quantize: one bgrad_quantize per expert
        pairs = [tex.bgrad_quantize(part, q) for part, q in zip(torch.split(x, sizes), qs)]
        dbias, sts = torch.stack([p[0] for p in pairs]), [p[1] for p in pairs]
    else:
        dbias = torch.stack([p.sum(dim=0) for p in torch.split(x, sizes)]) if with_dbias else None
        sts = tex.split_quantize(x, sizes, qs)
    parts = [TEQ(st, (n, x.shape[1]), x.dtype) for st, n in zip(sts, sizes)]
    g = TEQGroup(parts, x.shape, x.dtype, dbias, later)
    return g if (row, col) == (rowwise, columnwise) else g.with_usage(rowwise=rowwise, columnwise=columnwise)


def update_delayed_(
    last: torch.Tensor, hist: torch.Tensor, scale: torch.Tensor, algo: str, fp8_dtype: torch.dtype, margin: float
) -> None:
    """Delayed scaling's amax-and-scale update in place, by TE's kernel (``kernel_bulk``, what
    ``te.autocast`` runs): ``last`` this step's amaxes (after any reduction), ``hist`` ``[H, C]``
    and ``scale`` ``[C]`` (``fp8.state``, NOTE: [The update rule])."""
    tex.fused_amax_and_scale_update_after_reduction(last, [hist], [scale], algo, _TE_FP8[fp8_dtype], float(margin))
