"""The GEMM seam: every matrix product of ``linear`` and ``grouped_linear`` goes through one
of these methods, and nothing else in the package calls a GEMM.

Shape legend (torchtitan style): ``T`` tokens, ``K`` in-features, ``N`` out-features,
``E`` experts. ``w_NK`` is one weight; ``w_ENK`` is a group, either a sequence of E ``[N, K]``
tensors or one ``[E, N, K]`` tensor (both index as ``w_ENK[e]``).

=============  ======================  =======================================
method         math                    notes
=============  ======================  =======================================
fprop          y_TN = x_TK w_NK^T + b
dgrad          dx_TK = dy_TN w_NK
wgrad          dw_NK = dy_TN^T x_TK    ``out``/``accumulate`` write into main_grad;
                                       ``db_N = sum_T dy`` when ``with_dbias``
grouped_*      the same per expert     rows of x/dy split by ``splits``;
                                       ``grouped=True`` asks for the one-kernel path
=============  ======================  =======================================

``grouped_wgrad`` returns ``(dw, db_EN)``: ``dw`` is ``out`` when given (filled in place),
else a fresh ``[E, N, K]`` tensor.

NOTE: [One buffer] E weights that are consecutive slices of one buffer (``nn.GroupedLinear``'s
parameters, ``list(w_ENK)``, Megatron's contiguous ``main_grad`` buffer) are read, and written,
in place as one ``[E, N, K]`` tensor: :func:`packed` recognises them, :func:`stacked` falls back
to one copy (``torch.stack``) for separately made tensors.

NOTE: [FP8 operands] (the layers' side: ``functional_dw/_fp8.py``; README, FP8)
  ``quantize(t, spec, *, scale, amax, rowwise, columnwise) -> Q`` and
  ``grouped_quantize(x_TK, splits, spec, *, scales, amaxes, rowwise, columnwise, grouped) -> QGroup``
  quantize as a ``functional_dw.fp8.TensorSpec`` says. For delayed scaling ``scale``/``amax``
  are views into the caller's ``DelayedScalingState`` (0-d for one GEMM; for a group, one
  strided ``[E]`` view each, indexable per expert): quantize with ``scale`` and max the tensor's
  amax into ``amax`` in place (None: record nothing). ``Q`` offers ``with_usage(rowwise=,
  columnwise=)``, ``dtype`` (the source's) and ``shape``, and is a pytree node whose leaves are
  its tensors (it rides in a residuals record and through saved-tensor hooks). A ``QGroup`` is
  opaque to the layer: a list of E ``Q`` (split path), or the backend's grouped object.
  Optional: ``quantize_each(ts, spec, *, scales, amaxes, rowwise, columnwise) -> list[Q]``,
  ``quantize`` of each of E tensors of one shape (a group's weights) with one check (the
  layers fall back to ``quantize`` per tensor).
  Every GEMM method takes ``Q`` operands (both, or neither) in place of tensors, reading
  fprop's x and W rowwise, dgrad's dy rowwise and W columnwise, wgrad's x and dy columnwise,
  and a keyword ``split_accumulator`` (read only with ``Q`` operands); outputs are in the
  activations' dtype, ``out``/``accumulate`` work as without FP8, and ``with_dbias`` is False
  (the layer sums the bias grad from its high-precision dy).
"""

from __future__ import annotations

import array
import dataclasses
import itertools
import operator
from collections.abc import Iterable, Sequence
from typing import Any, Protocol, Union

import torch
from torch._subclasses.fake_tensor import FakeTensor

from .._checks import PLAIN_TYPES

__all__ = ["Kernels", "Splits", "as_one_buffer", "check_sizes", "get_kernels", "te_available", "out_in", "packed", "stacked"]

Weights = Union[Sequence[torch.Tensor], torch.Tensor]


def out_in(w_ENK: Weights) -> tuple[int, int]:
    """(N, K) of a group's weights (no ``w_ENK[0]`` view of a stacked tensor: that is an op)."""
    N, K = (w_ENK if isinstance(w_ENK, torch.Tensor) else w_ENK[0]).shape[-2:]
    return N, K


_REQUIRES_GRAD, _DTYPE = operator.attrgetter("requires_grad"), operator.attrgetter("dtype")


def per_expert(scales: Any, amaxes: Any, n: int) -> Iterable[tuple[Any, Any]]:
    """(scale, amax) of each of ``n`` tensors (NOTE: [FP8 operands]): delayed scaling's
    ``scales``/``amaxes`` as strided ``[E]`` views or sequences of 0-d views, or ``(None, None)``
    each without them (``amaxes`` None: no amax recorded)."""
    if scales is None:
        return itertools.repeat((None, None), n)
    flat = lambda v: v.reshape(-1) if isinstance(v, torch.Tensor) else v  # noqa: E731  (a 0-d one for E=1)
    return zip(flat(scales), flat(amaxes) if amaxes is not None else itertools.repeat(None))


def packed(ts: Sequence[torch.Tensor], layout_only: bool = False) -> torch.Tensor | None:
    """One ``[E, ...]`` view over ``ts`` (no copy) when they are contiguous tensors at
    consecutive addresses of one buffer (NOTE: [One buffer]); else None. ``ts`` share shape,
    dtype and device (the layers check that first; the dtype is checked again). Also None where
    addresses are unknown (while tracing for ``torch.compile``, fake tensors, tensor
    subclasses at any position, functorch's wrappers), and where autograd would have to record the view (grad
    mode on and a tensor requires grad: every expert's gradient would flow to ``ts[0]``);
    :func:`stacked` then copies, differentiably. Costs about 0.4 us per tensor on the host."""
    if torch.compiler.is_compiling() or not ts:
        return None
    t0 = ts[0]
    if not set(map(type, ts)) <= PLAIN_TYPES or not t0.numel() or t0.layout != torch.strided:
        return None  # (every expert's type: a subclass anywhere keeps its semantics, as at ts[0])
    if not layout_only and torch.is_grad_enabled() and any(map(_REQUIRES_GRAD, ts)):
        return None  # (``layout_only``: the layout alone, for a plan; the caller decides per call)
    if torch._C._functorch.peek_interpreter_stack() is not None and any(
            torch._C._functorch.is_functorch_wrapped_tensor(t) for t in ts):
        return None
    step, dtype = t0.numel() * t0.element_size(), t0.dtype
    try:
        ptrs = list(map(torch.Tensor.data_ptr, ts))  # (meta: offsets from 0; C loops: E experts)
    except (RuntimeError, TypeError):  # a tensor without storage (TypeError: not a tensor)
        return None
    if ptrs != list(range(ptrs[0], ptrs[0] + len(ts) * step, step)):
        return None
    if not all(map(torch.Tensor.is_contiguous, ts)) or set(map(_DTYPE, ts)) != {dtype}:
        return None
    if t0.untyped_storage().nbytes() < (t0.storage_offset() + len(ts) * t0.numel()) * t0.element_size():
        return None  # the addresses run past t0's storage: not one buffer (inside it: one device)
    return t0.detach().as_strided((len(ts), *t0.shape), (t0.numel(), *t0.stride()))  # (no reference to ts[0])


def as_one_buffer(ts: Sequence[torch.Tensor]) -> torch.Tensor:
    """The ``[E, ...]`` view over ``ts`` that :func:`packed` finds, without its checks: for a
    caller whose plan found ``ts`` one buffer (same identities and addresses since: NOTE: [Plan
    once, run lean]) and whose autograd records no view (no grad mode, or no tensor requiring
    grad)."""
    t0 = ts[0]
    return t0.detach().as_strided((len(ts), *t0.shape), (t0.numel(), *t0.stride()))


def stacked(ts: Sequence[torch.Tensor]) -> torch.Tensor:
    """``ts`` as one ``[E, ...]`` tensor: the :func:`packed` view, else a copy (``torch.stack``)."""
    view = packed(ts)
    return view if view is not None else torch.stack(list(ts))


@dataclasses.dataclass(frozen=True, eq=False, init=False)
class Splits:
    """Token counts per expert, as the user gave them.

    ``host`` is a tuple of ints when the counts are known on the host (a list, or a CPU
    tensor); the split path needs it. ``tensor`` is the user's splits tensor, if any. The
    grouped path reads only :meth:`on_device`, so a CUDA splits tensor never syncs there.
    Derived tensors (device counts, offsets) are cached on the record, so forward and
    backward build them once.

    NOTE: [Splits under torch.compile]
      A compiled step must not depend on the routing: dynamo would guard on host counts (a
      graph per routing, until its recompile limit) and cannot trace host sizes read from a
      splits tensor (a data-dependent error under ``fullgraph=True``). So while compiling the
      counts are data: a list becomes a CPU int64 tensor, ``host`` is None, and no path reads
      them on the host at trace time. The grouped path reads them on the device (clamped: see
      NOTE: [Device splits are clamped]); the split path, which needs host sizes, runs inside
      opaque custom ops (``torch_ops.py``, ``te_ops.py``) whose real implementations read the
      sizes at run time (:meth:`in_op`) and validate them as eager does, and whose fake ones
      give the output shapes from x and the weights alone. Measured on the CPU over 10 random
      routings (with 0- and 1-token experts): a splits tensor compiles one graph; so does a
      list with ``dynamic=True``. A list's ints are still inputs dynamo sees: with
      ``dynamic=None`` the first graph bakes them in and the second makes the changed ones
      symbolic; dynamo decides that per element, so a count that is equal in the first two
      steps costs one more graph when it first changes.
    """

    host: tuple[int, ...] | None
    tensor: torch.Tensor | None
    device: torch.device
    num_tokens: int
    num_experts: int
    _cache: dict = dataclasses.field(default_factory=dict, repr=False)

    def __init__(self, host: tuple[int, ...] | None, tensor: torch.Tensor | None, device: torch.device,
                 num_tokens: int, num_experts: int, _cache: dict | None = None) -> None:
        # one dict update: a frozen dataclass's own __init__ sets each field through object.__setattr__
        # (``_cache`` as dataclasses.replace passes it: the record's, shared as before)
        fields = dict(host=host, tensor=tensor, device=device, num_tokens=num_tokens, num_experts=num_experts,
                      _cache={} if _cache is None else _cache)
        if torch.compiler.is_compiling():  # torch 2.11's dynamo cannot trace a __dict__ write (2.13's can)
            for name, value in fields.items():
                object.__setattr__(self, name, value)
            return
        self.__dict__.update(fields)

    def sizes(self) -> tuple[int, ...]:
        """Host split sizes; a device-only splits tensor is copied to the host once (a sync)."""
        if self.host is not None:
            return self.host
        if self.tensor.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(CAPTURE_DEVICE_SPLITS)
        return self.cached("host", lambda: tuple(int(s) for s in self.tensor.tolist()))

    def on_device(self) -> torch.Tensor:
        """int64 ``[E]`` counts on the activations' device, made memory-safe (see :meth:`ends`)."""
        def make() -> torch.Tensor:
            if self.host is not None:
                return _to_device(self.host, torch.int64, self.device)
            fused = self._fused()
            if fused is not None:
                return fused[0]
            # ends minus starts (each expert starts where the clamped running sum before it ends)
            sizes = self.tensor.to(self.device, torch.int64, non_blocking=True).clamp(0, self.num_tokens)
            return self.ends(torch.int64) - (sizes.cumsum(0) - sizes).clamp(max=self.num_tokens)

        return self.cached("device", make)

    def ends(self, dtype: torch.dtype = torch.int32) -> torch.Tensor:
        """``[E]`` end offsets ``[s0, s0+s1, ...]`` on the activations' device, no sync.

        NOTE: [Device splits are clamped] Counts known only on the device cannot be validated
        without a sync, so they are made memory-safe instead: negatives count as 0, each count
        is capped at T before the running sum (which so cannot overflow), the running sum
        stops at T, and the last expert ends at T (it takes any rows the counts
        leave over), so no kernel reads or writes past x and every row of y and dx is computed
        (the caller's bad splits give wrong rows, never a crash, garbage or NaN: torch's
        grouped GEMM would hit a device-side assert, which ends the process, or leave rows
        unwritten). On CUDA one Triton launch does it (``triton_splits``); else
        four or five torch launches (widen, clamp, a two-kernel scan, a capping cast). Host
        counts are copied once."""
        def make() -> torch.Tensor:
            if self.host is not None:
                return _to_device(itertools.accumulate(self.host), dtype, self.device)
            fused = self._fused() if dtype == torch.int32 else None
            if fused is not None:
                return fused[1]
            sizes = self.tensor.to(self.device, torch.int64, non_blocking=True).clamp(0, self.num_tokens)
            running = sizes.cumsum(0)  # int64 of counts <= T: no overflow (huge counts would wrap)
            if dtype == torch.int64 or torch.compiler.is_compiling():  # a compiler fuses these
                # (a where, not running[-1:] = T: torch 2.11's inductor miscompiles that fill
                # next to the clamp by the same T into C++ that does not build)
                last = torch.arange(self.num_experts, device=running.device) == self.num_experts - 1
                return torch.where(last, self.num_tokens, running.clamp(max=self.num_tokens)).to(dtype)
            running[-1:] = self.num_tokens  # the last expert ends at T (no row left unwritten)
            cap = torch.tensor(self.num_tokens)  # a CPU scalar: minimum caps and casts in one kernel
            return torch.minimum(running, cap, out=torch.empty_like(running, dtype=dtype))

        return self.cached(("ends", dtype), make)

    def _fused(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(counts int64, ends int32) of device-only splits in one Triton launch, or None."""
        if self.device.type != "cuda" or torch.compiler.is_compiling():
            return None
        from .triton_splits import clamp_splits

        return self.cached("fused", lambda: clamp_splits(self.tensor.to(self.device, non_blocking=True), self.num_tokens))

    @classmethod
    def in_op(cls, sizes: torch.Tensor, x: torch.Tensor, num_experts: int, grouped: bool) -> "Splits":
        """The record a custom op's real implementation rebuilds from its splits tensor (see
        NOTE: [Splits under torch.compile]). The split path reads the sizes on the host here, at
        run time (a sync for a device tensor, as in eager), and validates them as eager does;
        the grouped path reads them only on the device (clamped)."""
        host = None
        if not grouped:
            host = tuple(sizes.tolist())
            check_sizes(host, x.shape[0])
        return cls(host=host, tensor=sizes, device=x.device, num_tokens=x.shape[0], num_experts=num_experts)

    def cached(self, key: Any, make: Any) -> Any:
        value = self._cache.get(key)
        if value is None:
            value = make()
            if not torch.compiler.is_compiling():  # a traced backward may not mutate forward's
                self._cache[key] = value  # objects; the compiler dedupes the recomputation anyway
        return value


def check_sizes(sizes: Sequence[int], T: int) -> None:
    """Host split sizes are non-negative and sum to the tokens (ValueError otherwise)."""
    if sizes and min(sizes) < 0:
        raise ValueError(f"splits must be non-negative, got {list(sizes)}")
    if sum(sizes) != T:
        raise ValueError(f"splits sum to {sum(sizes)} but x has {T} rows (tokens): they must sum to x.shape[0]")


_ARRAY_CODES = {torch.int32: "i", torch.int64: "q"}


def _to_device(values: Iterable[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host ints as a tensor on ``device`` without a host sync: a CUDA copy goes through pinned
    memory, asynchronously (``torch.tensor(..., device="cuda")`` waits for the stream). Eagerly,
    with no dispatch mode active, the CPU tensor wraps a fresh ``array`` (about 3 us less than
    ``torch.tensor`` of a list); while tracing or under a mode (fake tensors), ``torch.tensor``."""
    code = _ARRAY_CODES.get(dtype)
    if code is not None and not torch.compiler.is_compiling() and not torch._C._len_torch_dispatch_stack():
        cpu = torch.frombuffer(array.array(code, values), dtype=dtype)
        if device.type == "cpu":
            return cpu
    else:
        cpu = torch.tensor(list(values), dtype=dtype)
    if device.type != "cuda" or torch.compiler.is_compiling() or isinstance(cpu, FakeTensor):
        return cpu.to(device)
    if torch.cuda.is_current_stream_capturing():  # a pageable copy syncs; a pinned one would be
        raise RuntimeError(CAPTURE_HOST_SPLITS)  # replayed from a freed (reused) host buffer
    return cpu.pin_memory().to(device, non_blocking=True)


# NOTE: [Splits under CUDA graph capture] (README "CUDA graphs") A captured graph replays
# device work only. Host split sizes are Python ints: the split path bakes them into the graph
# (a replay reuses the routing of the capture), and a copy of them to the device cannot be
# captured. A CUDA splits tensor is read on the device by the grouped path at every replay, but
# reading it on the host (the split path) is a sync, which capture forbids. Both cases raise
# these instead of CUDA's "operation not permitted when stream is capturing".
CAPTURE_DEVICE_SPLITS = (
    "functional_dw: the split path (one GEMM per expert) needs the split sizes on the host, and reading a CUDA "
    "splits tensor there is a device-to-host sync, which CUDA graph capture forbids. Under a CUDA graph use the "
    "grouped path (use_grouped_tensor=None or True, with a backend and dtype that run it: backend='auto' or 'te' "
    "in bfloat16; for fuse_wgrad_accumulation=True, TE), or give the splits as a list (then the graph replays "
    "the routing of the capture)"
)
CAPTURE_HOST_SPLITS = (
    "functional_dw: splits given on the host (a list or a CPU tensor) must be copied to the GPU here (the "
    "grouped path's offsets, or per-expert bias sums), and that copy cannot be captured in a CUDA graph. Pass "
    "the splits as a CUDA int tensor (one static buffer you copy each step's routing into): the grouped path "
    "reads it on the device at every replay, without a sync"
)


class Kernels(Protocol):
    """The backend interface. Implementations: ``torch_ref.TorchKernels``, ``te.TEKernels``."""

    name: str

    def fprop(self, x_TK: torch.Tensor, w_NK: torch.Tensor, b_N: torch.Tensor | None, *,
              split_accumulator: bool = False) -> torch.Tensor: ...
    def dgrad(self, dy_TN: torch.Tensor, w_NK: torch.Tensor, *, split_accumulator: bool = False) -> torch.Tensor: ...
    def wgrad(
        self, x_TK: torch.Tensor, dy_TN: torch.Tensor, *, out: torch.Tensor | None = None,
        accumulate: bool = False, with_dbias: bool = False, split_accumulator: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def grouped_path_unsupported(self, x_TK: torch.Tensor, w_ENK: Weights, recipe=None) -> str | None:
        """Why the one-kernel grouped path cannot run these operands (with FP8: quantized by
        ``recipe``, an ``fp8`` recipe), or None if it can."""
        ...

    def grouped_fprop(
        self, x_TK: torch.Tensor, w_ENK: Weights, b_EN: torch.Tensor | None, splits: Splits, grouped: bool, *,
        split_accumulator: bool = False,
    ) -> torch.Tensor: ...
    def grouped_dgrad(self, dy_TN: torch.Tensor, w_ENK: Weights, splits: Splits, grouped: bool, *,
                      split_accumulator: bool = False) -> torch.Tensor: ...
    def grouped_wgrad(
        self, x_TK: torch.Tensor, dy_TN: torch.Tensor, splits: Splits, grouped: bool, *,
        out: Weights | None = None, accumulate: bool = False, with_dbias: bool = False,
        split_accumulator: bool = False,
    ) -> tuple[Weights, torch.Tensor | None]: ...

    # FP8 (NOTE: [FP8 operands]); a backend without them runs no FP8 layer
    def quantize(self, t: torch.Tensor, spec: Any, *, scale: torch.Tensor | None = None,
                 amax: torch.Tensor | None = None, rowwise: bool = True, columnwise: bool = False) -> Any: ...
    def grouped_quantize(self, x_TK: torch.Tensor, splits: Splits, spec: Any, *, scales: Any = None,
                         amaxes: Any = None, rowwise: bool = True, columnwise: bool = False,
                         grouped: bool = False) -> Any: ...


_TE_AVAILABLE: list[bool] = []  # filled once; a plain global read under torch.compile


def te_available() -> bool:
    """True when Transformer Engine's PyTorch extension imports (checked once)."""
    if not _TE_AVAILABLE:
        try:
            import transformer_engine.pytorch  # noqa: F401

            _TE_AVAILABLE.append(True)
        except Exception:
            _TE_AVAILABLE.append(False)
    return _TE_AVAILABLE[0]


_TE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_TE_INSTALL = (
    "backend='te' needs Transformer Engine for PyTorch: `pip install "
    "'functional_dw[te]'` (or `pip install 'transformer-engine[pytorch]>=2.20'`) on a machine "
    "with CUDA; use backend='torch' for the plain-PyTorch reference"
)


def get_kernels(backend: str | Kernels | None, x: torch.Tensor, w_ENK: Weights | None = None) -> Kernels:
    """Resolve ``backend``: None picks TE when ``x`` is on CUDA and TE imports, else torch.

    ``"auto"`` picks the fastest measured (benchmarks/results): for a group on CUDA, torch's
    grouped GEMM wherever it can run these operands. On the H200 it beat both of TE's paths up
    to 32k tokens and tied them above, where TE's split path was 2-4% ahead only at large
    tokens-per-expert x ffn and needs host splits. Otherwise auto picks what None picks (one
    GEMM: the same cuBLAS)."""
    if backend == "auto":
        if w_ENK is not None and x.is_cuda and _torch().grouped_path_unsupported(x, w_ENK) is None:
            return _torch()
        backend = None
    if backend is None:  # TE's GEMMs take fp32 (as TF32), bf16 and fp16; float64 stays on torch
        backend = "te" if x.is_cuda and x.dtype in _TE_DTYPES and te_available() else "torch"
    if not isinstance(backend, str):
        if all(callable(getattr(backend, m, None)) for m in ("fprop", "dgrad", "wgrad", "grouped_fprop")):
            return backend
        raise ValueError(f"backend must be None, 'auto', 'torch', 'te' or a Kernels object; got {backend!r}")
    if backend == "torch":
        return _torch()
    if backend == "te":
        if not te_available():
            raise ValueError(_TE_INSTALL)
        if not x.is_cuda:
            raise ValueError(f"backend='te' runs on CUDA tensors; x is on {x.device}. Use backend='torch'")
        if x.dtype not in _TE_DTYPES:
            raise TypeError(f"backend='te' takes float32, bfloat16 or float16; x is {x.dtype}. Use backend='torch'")
        # the same kernels as custom ops dynamo can trace; and their fake rules give the shapes
        # for fake tensors (FakeTensorMode), on which TE's C++ cannot run
        if torch.compiler.is_compiling() or isinstance(x, FakeTensor):
            from .te_ops import TRACED_TE

            return TRACED_TE
        from .te import TE

        return TE
    raise ValueError(f"backend must be None, 'auto', 'torch', 'te' or a Kernels object; got {backend!r}")


_EAGER_TORCH: list[Kernels] = []  # filled on first use (torch_ref imports this module)


def _torch() -> Kernels:
    """The reference kernels; while compiling, the same with the split path as custom ops."""
    if torch.compiler.is_compiling():
        from .torch_ops import TRACED_TORCH

        return TRACED_TORCH
    if not _EAGER_TORCH:
        from .torch_ref import TORCH

        _EAGER_TORCH.append(TORCH)
    return _EAGER_TORCH[0]
