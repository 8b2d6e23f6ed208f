"""The ``Splits`` record: token counts per expert as the user gave them, on the host and/or the
device, with the derived device tensors (counts, end offsets) cached, device-only counts
clamped to be memory-safe, and the clear errors for splits a CUDA graph cannot capture.
"""

from __future__ import annotations

import array
import dataclasses
import itertools
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

__all__ = ["CAPTURE_DEVICE_SPLITS", "CAPTURE_HOST_SPLITS", "Splits", "check_sizes", "row_expert", "to_device", "write"]


# NOTE: [Splits under torch.compile]
#   A compiled step must not depend on the routing: dynamo would guard on host counts (a
#   graph per routing, until its recompile limit) and cannot trace host sizes read from a
#   splits tensor (a data-dependent error under ``fullgraph=True``). So while compiling the
#   counts are data: a list becomes a CPU int64 tensor, ``host`` is None, and no path reads
#   them on the host at trace time. The grouped path reads them on the device (clamped: see
#   NOTE: [Device splits are clamped]); the split path, which needs host sizes, runs inside
#   opaque custom ops (``torch_ops.py``, ``te_ops.py``) whose real implementations read the
#   sizes at run time (:meth:`in_op`) and validate them as eager does, and whose fake ones
#   give the output shapes from x and the weights alone. Measured on the CPU over 10 random
#   routings (with 0- and 1-token experts): a splits tensor compiles one graph; so does a
#   list with ``dynamic=True``. A list's ints are still inputs dynamo sees: with
#   ``dynamic=None`` the first graph bakes them in and the second makes the changed ones
#   symbolic; dynamo decides that per element, so a count that is equal in the first two
#   steps costs one more graph when it first changes.
@dataclasses.dataclass(frozen=True, eq=False, init=False)
class Splits:
    """Token counts per expert, as the user gave them.

    ``host`` is a tuple of ints when the counts are known on the host (a list, or a CPU
    tensor); the split path needs it. ``tensor`` is the user's splits tensor, if any. The
    grouped path reads only :meth:`on_device`, so a CUDA splits tensor never syncs there.
    Derived tensors (device counts, offsets) are cached on the record, so forward and
    backward build them once.

    While compiling, the counts are data: a compiled step does not depend on the routing
    (NOTE: [Splits under torch.compile]).
    """

    host: tuple[int, ...] | None
    tensor: torch.Tensor | None
    device: torch.device
    num_tokens: int
    num_experts: int
    _cache: dict = dataclasses.field(default_factory=dict, repr=False)

    def __init__(
        self,
        host: tuple[int, ...] | None,
        tensor: torch.Tensor | None,
        device: torch.device,
        num_tokens: int,
        num_experts: int,
        _cache: dict | None = None,
    ) -> None:
        # one dict update: a frozen dataclass's own __init__ sets each field through object.__setattr__
        # (``_cache`` as dataclasses.replace passes it: the record's, shared as before)
        fields = dict(
            host=host,
            tensor=tensor,
            device=device,
            num_tokens=num_tokens,
            num_experts=num_experts,
            _cache={} if _cache is None else _cache,
        )
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
                return to_device(self.host, torch.int64, self.device)
            fused = self._fused()
            if fused is not None:
                return fused[0]
            # ends minus starts (each expert starts where the clamped running sum before it ends)
            sizes = self.tensor.to(self.device, torch.int64, non_blocking=True).clamp(0, self.num_tokens)
            return self.ends(torch.int64) - (sizes.cumsum(0) - sizes).clamp(max=self.num_tokens)

        return self.cached("device", make)

    # NOTE: [Device splits are clamped] Counts known only on the device cannot be validated without
    # a sync, so they are made memory-safe instead: negatives count as 0, each count is capped at T
    # before the running sum (which so cannot overflow), the running sum stops at T, and the last
    # expert ends at T (it takes any rows the counts leave over), so no kernel reads or writes past
    # x and every row of y and dx is computed (the caller's bad splits give wrong rows, never a
    # crash, garbage or NaN: torch's grouped GEMM would hit a device-side assert, which ends the
    # process, or leave rows unwritten). On CUDA one Triton launch does it (``triton_splits``); else
    # four or five torch launches (widen, clamp, a two-kernel scan, a capping cast).
    def ends(self, dtype: torch.dtype = torch.int32) -> torch.Tensor:
        """``[E]`` end offsets ``[s0, s0+s1, ...]`` on the activations' device, no sync.

        Counts known only on the device are clamped to be memory-safe: bad splits give wrong rows,
        never a crash (NOTE: [Device splits are clamped]). Host counts are copied once."""

        def make() -> torch.Tensor:
            if self.host is not None:
                return to_device(itertools.accumulate(self.host), dtype, self.device)
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

        return self.cached(
            "fused", lambda: clamp_splits(self.tensor.to(self.device, non_blocking=True), self.num_tokens)
        )

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


def row_expert(splits: Splits) -> torch.Tensor:
    """For each token row, its expert index (device-side, no sync; cached on the record, so
    forward's bias add and backward's bias sums read the same one)."""
    E, T = splits.num_experts, splits.num_tokens

    def make() -> torch.Tensor:
        experts = torch.arange(E, device=splits.device)
        return torch.repeat_interleave(experts, splits.on_device(), output_size=T)

    return splits.cached("ref_rows", make)


def write(out: torch.Tensor, value: torch.Tensor, accumulate: bool) -> torch.Tensor:
    """``out += value`` when ``accumulate``, else ``out = value``, in place (a main_grad is only
    written elementwise: NOTE: [main_grad is written elementwise]); returns ``out``."""
    return out.add_(value) if accumulate else out.copy_(value)


def check_sizes(sizes: Sequence[int], T: int) -> None:
    """Host split sizes are non-negative and sum to the tokens (ValueError otherwise)."""
    if sizes and min(sizes) < 0:
        raise ValueError(f"splits must be non-negative, got {list(sizes)}")
    if sum(sizes) != T:
        raise ValueError(f"splits sum to {sum(sizes)} but x has {T} rows (tokens): they must sum to x.shape[0]")


_ARRAY_CODES = {torch.int32: "i", torch.int64: "q"}


def to_device(values: Iterable[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
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


# NOTE: [Splits under CUDA graph capture] (docs/cuda-graphs.md) A captured graph replays
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
