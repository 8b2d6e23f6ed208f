"""Shared test fixtures: a fake DistributedWeight, a path recorder, a copy counter, saved-tensor
hooks, and the tolerance rule with its float64 reference. (Seeded inputs, module builders and
the plain-PyTorch per-expert reference ``ref_grouped``: tests/helpers.py.)"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import pytest
import torch

FWD_SCALE, BWD_SCALE = 2.0, 4.0
STALE = 1000.0  # what a FakeDW's grad_buffer() holds before the wgrad GEMM writes it


class FakeDW(torch.nn.Parameter):
    """A DistributedWeight in TE's protocol, as TE's own tests build one: an ``nn.Parameter``
    subclass holding this rank's *shard* (the first ``N // 2`` rows of a full ``[N, K]``
    weight). The leader of a group gathers every member's full weight, scaled by a different
    factor in forward (x2) and backward (x4) so a test can tell which one a GEMM used.
    ``finalize_group_grads`` keeps the shard rows of each full gradient; when fused it adds
    them into ``main_grad``, sets ``grad_added_to_main_grad`` and returns zero dummies."""

    is_distributed_weight = True

    def __new__(cls, full: torch.Tensor, requires_grad: bool = True):
        shard = full[: full.shape[0] // 2].detach().clone()
        self = super().__new__(cls, shard, requires_grad)
        self.full = full.detach().clone()
        self.group: list[FakeDW] = [self]
        self.calls = {"forward": 0, "backward": 0, "finalize": 0}
        self.materialized: list[torch.Tensor] = []
        self.fused = False
        return self

    @classmethod
    def group_of(cls, fulls: Sequence[torch.Tensor], fused: bool = False) -> list["FakeDW"]:
        members = [cls(f) for f in fulls]
        for m in members:
            m.group = members
            m.fused = fused
            if fused:
                m.main_grad = torch.zeros(m.shape, dtype=torch.float32, device=m.device)
                m.buffer = torch.full(m.full.shape, STALE, dtype=torch.float32, device=m.device)
                m.grad_added_to_main_grad = False
        return members

    def _gather(self, scale: float) -> list[torch.Tensor]:
        out = [m.full * scale for m in self.group]
        self.materialized += out
        return out if len(out) > 1 else out[0]  # TE's fakes return a bare tensor for one

    def materialize_group_for_forward(self):
        self.calls["forward"] += 1
        return self._gather(FWD_SCALE)

    def materialize_group_for_backward(self, **kwargs):
        self.calls["backward"] += 1
        return self._gather(BWD_SCALE)

    def grad_buffer(self) -> torch.Tensor:
        return self.buffer

    def finalize_group_grads(self, wgrads):
        self.calls["finalize"] += 1
        wgrads = wgrads if isinstance(wgrads, list) else [wgrads]
        shards = [g[: m.shape[0]] for m, g in zip(self.group, wgrads)]
        if not self.fused:
            return [s.to(m.dtype) for m, s in zip(self.group, shards)]
        for m, s in zip(self.group, shards):
            m.main_grad += s
            m.buffer.fill_(STALE)  # stale again, as a real gather buffer would be: the fused wgrad
            m.grad_added_to_main_grad = True  # GEMM must overwrite it (TE: accumulate=False for a DW)
        return [torch.zeros_like(m) for m in self.group]

    def __repr__(self) -> str:
        return f"FakeDW(shard={tuple(self.shape)}, full={tuple(self.full.shape)})"


# --- the path that ran -------------------------------------------------------------------


from functional_dw.kernels.torch_ref import TorchKernels  # noqa: E402


class PathRecorder(TorchKernels):
    """The reference kernels (pass as ``backend=``), recording which grouped path each GEMM
    took, so a test that names a path can assert it ran: ``rec.check(path, x, w)``."""

    def __init__(self):
        self.paths: list[tuple[str, bool]] = []

    def grouped_fprop(self, x_TK, w_ENK, b_EN, splits, grouped):
        self.paths.append(("fprop", grouped))
        return super().grouped_fprop(x_TK, w_ENK, b_EN, splits, grouped)

    def grouped_dgrad(self, dy_TN, w_ENK, splits, grouped):
        self.paths.append(("dgrad", grouped))
        return super().grouped_dgrad(dy_TN, w_ENK, splits, grouped)

    def grouped_wgrad(self, x_TK, dy_TN, splits, grouped, **kw):
        self.paths.append(("wgrad", grouped))
        return super().grouped_wgrad(x_TK, dy_TN, splits, grouped, **kw)

    def dgrad(self, dy_TN, w_NK):
        self.paths.append(("linear dgrad", False))
        return super().dgrad(dy_TN, w_NK)

    def wgrad(self, x_TK, dy_TN, **kw):
        self.paths.append(("linear wgrad", False))
        return super().wgrad(x_TK, dy_TN, **kw)

    def gemms(self) -> list[str]:
        """The backward GEMMs that ran, in order."""
        return [name for name, _ in self.paths if name != "fprop"]

    def check(self, use_grouped_tensor, x, w) -> None:
        """Every GEMM took the path ``use_grouped_tensor`` asks for where grouped_mm can run."""
        possible = self.grouped_path_unsupported(x, w) is None
        want = use_grouped_tensor is not False and possible
        assert self.paths and all(g == want for _, g in self.paths), (use_grouped_tensor, possible, self.paths)


class CountingKernels(TorchKernels):
    """The reference kernels (pass as ``backend=``), counting the forward GEMM calls (Linear's
    and the grouped one's) in ``calls``: a vmap that folds its batch into one call makes one."""

    def __init__(self):
        self.calls = 0

    def fprop(self, *args):
        self.calls += 1
        return super().fprop(*args)

    def grouped_fprop(self, *args):
        self.calls += 1
        return super().grouped_fprop(*args)


# --- copies ------------------------------------------------------------------------------------


from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

COPY_OPS = ("stack", "cat", "copy_", "clone", "_to_copy", "as_strided_copy")


class CopyCounter(TorchDispatchMode):
    """Records every aten op that runs inside it (autograd's engine included) as
    ``(name, output shape)``, without keeping a reference to any tensor (that would stop
    autograd from stealing a fresh gradient). ``copies(numel)``: the copy-like ops (stack, cat,
    copy_, clone, casts) whose output has at least ``numel`` elements; ``weight_copies(N, K)``:
    those shaped like a weight."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        first = out[0] if isinstance(out, (list, tuple)) and out else out
        shape = tuple(first.shape) if isinstance(first, torch.Tensor) else ()
        self.ops.append((func.overloadpacket.__name__, shape))
        return out

    def named(self, name: str) -> list[tuple[int, ...]]:
        return [shape for op, shape in self.ops if op == name]

    def copies(self, numel: int) -> list[tuple[str, tuple[int, ...]]]:
        return [(op, s) for op, s in self.ops if op in COPY_OPS and math.prod(s) >= numel]

    def weight_copies(self, N: int, K: int) -> list[tuple[str, tuple[int, ...]]]:
        """The copy-like ops whose output is shaped like weights: ``[..., N, K]`` or ``[..., K, N]``."""
        return [(op, s) for op, s in self.ops if op in COPY_OPS and s[-2:] in ((N, K), (K, N))]


# --- saved-tensor hooks --------------------------------------------------------------------


class Recorder:
    """Wraps a pack/unpack pair and records what the pack hook saw."""

    def __init__(self, pack: Callable, unpack: Callable):
        self.packed: list[torch.Tensor] = []
        self.unpacks = 0
        self._pack, self._unpack = pack, unpack

    def pack(self, t):
        self.packed.append(t)
        return self._pack(t)

    def unpack(self, p):
        self.unpacks += 1
        return self._unpack(p)

    def __enter__(self) -> "Recorder":
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._ctx.__exit__(*exc)

    def __call__(self) -> "Recorder":  # `with rec():` reads as well as `with rec:`
        return self


class MegatronStyleOffload:
    """Megatron-Core fine-grained offloading, in miniature: tensors of at least ``min_numel``
    elements are copied into fresh host buffers (the pack keeps no reference to the original,
    so its storage is freed once the caller drops it); small ones are kept as they are; each
    saved tensor is handed back exactly once."""

    def __init__(self, min_numel: int = 64):
        self.min_numel, self.stash, self.next_id = min_numel, {}, 0

    def pack(self, t: torch.Tensor):
        if t.numel() < self.min_numel:
            return ("kept", t)
        host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.is_cuda)
        host.copy_(t)
        self.next_id += 1
        self.stash[self.next_id] = (host, t.device)
        return ("offloaded", self.next_id)

    def unpack(self, packed):
        kind, value = packed
        if kind == "kept":
            return value
        host, device = self.stash.pop(value)  # KeyError on a second read: handed back once
        return host.to(device, non_blocking=True)


def _identity(t):
    return t


HOOKS: dict[str, Callable[[], Recorder]] = {
    "identity": lambda: Recorder(_identity, _identity),
    "clone": lambda: Recorder(lambda t: t.clone(), _identity),
    "save_on_cpu": lambda: _save_on_cpu_recorder(),
    "megatron_offload": lambda: _offload_recorder(),
}


def _offload_recorder() -> Recorder:
    off = MegatronStyleOffload()
    return Recorder(off.pack, off.unpack)


def _save_on_cpu_recorder() -> Recorder:
    s = torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available())
    return Recorder(s.pack_hook, s.unpack_hook)


@pytest.fixture(params=list(HOOKS))
def hook_name(request) -> str:
    return request.param


# --- references ----------------------------------------------------------------------------


def assert_same(a, b, what=""):
    """Bitwise equality for tensors, lists of tensors and None."""
    if isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), what
        for i, (u, v) in enumerate(zip(a, b)):
            assert_same(u, v, f"{what}[{i}]")
        return
    if a is None or b is None:
        assert a is None and b is None, what
        return
    assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    assert torch.equal(a, b), f"{what}: max diff {(a.double() - b.double()).abs().max().item()}"


# NOTE: [The tolerance rule] Every numerics test compares with a float64 reference computed
# from the same (already rounded) inputs, elementwise, with a bound from what the result was
# accumulated in and what it was rounded to, not from the inputs' dtype:
#
#     |actual - expected| <= u(out) * |expected| + (rounds - 1) * u(out) * mag + n * u(acc) * mag
#                            + rounds * eta(out)
#
# u(d) is the unit roundoff of d (the largest relative error of one rounding to d); out is
# the result's dtype; ``rounds`` how many times the value was rounded to it (1 for a GEMM or a
# sum; 2 for a GEMM output rounded before a bias is added: that first rounding errs relative to
# the product, which ``mag`` bounds); ``acc`` the accumulator: float32 for fp32/bf16/fp16
# inputs, float64 only when inputs and result are float64; ``n`` a bound on the number of
# terms summed; ``mag`` the same computation on absolute values (e.g. |dy|^T |x|), which bounds
# the accumulation error even where the terms cancel; by default the reference's largest
# magnitude; eta(d) half the spacing of d's subnormals (a rounding below the normal range errs
# absolutely: fp16's start at 6e-5). So an fp32 main_grad or an fp32-accumulated bias grad is held to fp32 accuracy,
# and a bf16 result to half a bf16 ulp of its own value plus fp32-level accumulation error:
# a bf16 product cast up to fp32, or a bias grad summed in bf16, fails
# (tests/support/planted_bugs.py shows it).
UNIT = {torch.float64: 2.0**-53, torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
TOL = UNIT  # (old name)


def tolerance(
    actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, *, mag=None, n: int = 256, rounds: int = 1
) -> torch.Tensor:
    """The elementwise bound of NOTE: [The tolerance rule]; ``dtype`` is the inputs' dtype."""
    acc = torch.float64 if dtype == torch.float64 and actual.dtype == torch.float64 else torch.float32
    exp = expected.double()
    if mag is None:
        mag = exp.abs().max() if exp.numel() else exp.new_zeros(())
    mag = mag.double() if isinstance(mag, torch.Tensor) else torch.tensor(float(mag), dtype=torch.float64)
    mag = mag.to(exp.device)
    eta = torch.finfo(actual.dtype).smallest_normal * torch.finfo(actual.dtype).eps / 2
    return UNIT[actual.dtype] * (exp.abs() + (rounds - 1) * mag) + n * UNIT[acc] * mag + rounds * eta


def reference(fn, inputs, dy):
    """(out, grads) of ``fn`` in float64 from the same inputs, and the same on absolute values
    (``mag`` for NOTE: [The tolerance rule]): for a bilinear layer, running it on |inputs| with
    cotangent |dy| gives |x| |W|^T + |b| for the output and |dy| |W|, |dy|^T |x|, sum |dy| for
    the grads, the magnitudes each reduction summed."""
    out = []
    for f in (lambda t: t.detach().double(), lambda t: t.detach().double().abs()):
        d = [f(t).requires_grad_() for t in inputs]
        y = fn(*d)
        grads = torch.autograd.grad(y, d, f(dy), allow_unused=True)
        out.append((y.detach(), list(grads)))
    return out


def assert_close(actual, expected, dtype, what="", *, mag=None, n: int = 256, rounds: int = 1):
    """``actual`` against the float64 ``expected`` by NOTE: [The tolerance rule]."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} vs {tuple(expected.shape)}"
    if not actual.numel():
        return
    err = (actual.double() - expected.double().to(actual.device)).abs()
    bound = tolerance(actual, expected.to(actual.device), dtype, mag=mag, n=n, rounds=rounds)
    bad = err > bound
    if bad.any():
        i = int((err - bound).flatten().argmax())
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {err.numel()} elements outside the bound; worst at flat index {i}: "
            f"got {actual.flatten()[i].item()!r}, expected {expected.flatten()[i].item()!r}, error "
            f"{err.flatten()[i].item():.3g} > bound {bound.flatten()[i].item():.3g} ({actual.dtype} from {dtype} inputs)"
        )
