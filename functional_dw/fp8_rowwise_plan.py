"""RowwiseScaling's family (``fp8_plan.py`` says what a family is): functional_dw's expert recipe on
torch's scaled grouped GEMM (``fp8/rowwise.py``, ``kernels/rowwise.py``). The group is quantized
at once (its scales span experts' rows and columns); the products have one path, the grouped
GEMM; any token counts; it compiles; a Linear cannot run it."""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from . import _checks, fp8
from .fp8_plan import Plan, register_family
from .fp8.rowwise import OPTIMIZER_STEPS, WEIGHT_CACHE, install_optimizer_hook
from .kernels.rowwise import ROWWISE

__all__ = ["FP8_INTENSITY_FROM", "FP8_PAYS_FROM", "RowwisePlan", "fp8_pays"]


# NOTE: [FP8 where it pays]
#   An FP8 step pays for quantization passes (reads and writes of each activation: ~6 bytes per
#   element of x [T, K] and of dy [T, N], a dozen launches) with GEMMs up to twice as fast. The
#   GEMMs' time grows as T x K x N, the passes' as T x (K + N): FP8 pays where the GEMM does enough
#   work per quantized element, K x N / (K + N) >= ``FP8_INTENSITY_FROM``, and where the call is
#   large enough that the passes' launches and host time do not dominate, T x K x N >=
#   ``FP8_PAYS_FROM`` (T the call's tokens: data, decided per call). Measured on the H100 (eager,
#   4-step bursts, FP8 forced over bf16 on one weight, time ratio, benchmarks/results/moe_layer;
#   K x N / (K + N) in brackets): 2.58x at (E8, 2048, 2048, 8k) [1024], 1.68x at (E128, 2048, 768,
#   32k) [558], 1.04x and 0.98x at (E32 / E128, 4096, 1536, 32k / 64k) [1117], 0.87x at (E32, 7168,
#   2048, 32k) [1593], 0.71x at (E8, 4096, 4096, 64k) [2048]; and in the whole MoE block
#   (benchmarks/results/moe_block) at Qwen3-30B-A3B with 32k tokens (fc1 T x K x N = 8.2e11
#   [878], fc2 4.1e11 [558]) FP8 took 1.16x bf16's time: the size alone does not decide. A call
#   that fails either test runs the layer's bf16 plan, the same call planned without a recipe
#   (``GroupedPlan.bf16``; the record's ``fp8`` is None, its ``kernels`` the bf16 ones). The rule
#   is for CUDA, where it was measured; elsewhere FP8 always runs (the CPU emulation is a
#   reference, not a speed). ``RowwiseScaling(bf16_below=...)`` replaces the rule by a size
#   threshold alone: 0 forces FP8, ``math.inf`` bf16. Only a stateless family falls back (a
#   delayed-scaling state would miss the amaxes of a bf16 call). In grouped_mlp each linear
#   decides for its own GEMM. Compiled with a dynamic T, a call whose decision flips with T
#   recompiles once (a guard on T); where the shape alone says bf16, T is not guarded.
FP8_PAYS_FROM = 3e11
FP8_INTENSITY_FROM = 1200


def fp8_pays(T: int, K: int, N: int) -> bool:
    """The measured rule on CUDA for a GEMM ``[T, K] x [K, N]`` (NOTE: [FP8 where it pays]).
    The shape's test comes first: where it fails, T is never read, so a compiled call with a
    dynamic T gets no guard on T (no recompile where the answer is bf16 at every T)."""
    return K * N >= FP8_INTENSITY_FROM * (K + N) and T * K * N >= FP8_PAYS_FROM


class RowwisePlan(Plan):
    """RowwiseScaling: ``kernels.quantize_group`` for the weights, cached per weight version."""

    KERNELS = {"torch": lambda: ROWWISE}  # (kernels/rowwise.py: Triton on an sm_90 GPU, else torch)

    one_path = True
    compiles = True
    grouped_only = True
    falls_back = True
    not_for_linear = (
        "recipe=RowwiseScaling() is functional_dw's grouped (expert) recipe; a Linear runs TE's "
        "recipes (Float8CurrentScaling, Float8BlockScaling, DelayedScaling)"
    )

    @classmethod
    def backend(cls, asked: Any) -> Any:
        """torch's kernels for None and "auto" (TE has no kernels for it)."""
        return "torch" if asked in (None, "auto") else asked

    @classmethod
    def fixed_path(cls, use_grouped_tensor: bool | None) -> tuple[str, str]:
        if use_grouped_tensor is False:
            raise ValueError(
                "RowwiseScaling runs one grouped GEMM per product (there is no per-expert path): pass "
                "use_grouped_tensor=None or True"
            )
        return "grouped", "RowwiseScaling runs one grouped GEMM per product"

    @classmethod
    def check_kernels(cls, kernels: Any) -> None:
        if not callable(getattr(kernels, "quantize_group", None)):
            raise ValueError(
                f"RowwiseScaling runs on its own kernels (torch's scaled grouped GEMM), which backend "
                f"{type(kernels).__name__} (name {getattr(kernels, 'name', None)!r}) does not have (no "
                "quantize_group): pass backend=None, 'auto' or 'torch'"
            )
        super().check_kernels(kernels)

    @classmethod
    def check_x(cls, x: torch.Tensor) -> None:
        from .kernels.rowwise import check_device

        check_device(x)

    def check_counts(self, K: int, N: int, splits: Sequence[int] | None) -> None:
        """Any counts: wgrad's operands are padded per expert on the device."""

    def pays(self, T: int, K: int, N: int) -> bool:
        """NOTE: [FP8 where it pays]."""
        below = self.recipe.bf16_below
        if below is not None:
            return T * K * N >= below
        return self.device.type != "cuda" or fp8_pays(T, K, N)

    def quantize_activated(
        self,
        kernels: Any,
        act: Any,
        fc1_out: torch.Tensor,
        probs: Any,
        activation: str,
        splits: Any,
        *,
        rowwise: bool,
        columnwise: bool,
    ) -> Any:
        """See :meth:`Plan.quantize_activated`: with the Triton activation kernels (whose h it
        reproduces bit for bit) and kernels that fuse (``quantize_activated``)."""
        fused = getattr(kernels, "quantize_activated", None)
        if getattr(act, "name", None) != "triton" or fused is None:
            return None
        return fused(fc1_out, probs, activation, splits, self.x, rowwise=rowwise, columnwise=columnwise)

    def quantize_rows(
        self,
        kernels: Any,
        spec: fp8.TensorSpec,
        t: torch.Tensor,
        rows: torch.Tensor,
        splits: Any,
        grouped: bool,
        *,
        rowwise: bool,
        columnwise: bool,
    ) -> Any:
        """See :meth:`Plan.quantize_rows`: on RowwiseScaling's own kernels, which gather in the
        quantization's loads (NOTE: [The gather as the load] in ``kernels/triton_rowwise.py``)."""
        if type(kernels) is not type(ROWWISE):
            return None
        return kernels.grouped_quantize(
            t, splits, spec, rowwise=rowwise, columnwise=columnwise, grouped=grouped, rows=rows
        )

    def quantize_weights(
        self, kernels: Any, w_ENK: Any, *, keep: bool = False, params: Sequence[torch.Tensor] | None = None
    ) -> tuple[Any, Plan]:
        """See :meth:`Plan.quantize_weights`: the group at once, both copies when ``keep``, and
        with ``params`` at most once per weight version (NOTE: [FP8 weights per version] in
        ``fp8/rowwise.py``)."""
        keep = keep and not torch.compiler.is_compiling()  # NOTE: [RowwiseScaling under torch.compile]
        qw = _rowwise_weights(kernels, w_ENK, self.w, keep, params)
        return qw, (dataclasses.replace(self, w_dgrad=qw.with_usage(rowwise=False, columnwise=True)) if keep else self)

    def requantize_weights(self, kernels: Any, w_ENK: Any) -> Any:
        """See :meth:`Plan.requantize_weights` (no scales to reuse: RowwiseScaling has no state)."""
        if self.w_dgrad is not None:
            return self.w_dgrad
        return kernels.quantize_group(w_ENK, self.w, rowwise=False, columnwise=True)


def _rowwise_weights(kernels: Any, w_ENK: Any, spec: fp8.TensorSpec, keep: bool, params: Any) -> Any:
    """The group's quantized weights, from the cache when current (NOTE: [FP8 weights per
    version] in ``fp8/rowwise.py``)."""
    if (
        params is None
        or torch.compiler.is_compiling()
        or torch._C._functorch.peek_interpreter_stack() is not None
        or not set(map(type, params)) <= _checks.PLAIN_TYPES
        or any(p.is_inference() for p in params)
    ):
        return kernels.quantize_group(w_ENK, spec, rowwise=True, columnwise=keep)
    install_optimizer_hook()  # (once: NOTE: [The optimizer hook] in fp8/rowwise.py)
    # (layouts too: ``p.data = p.data.t()`` of a square weight keeps the address and the version)
    key = (
        tuple(p._version for p in params),
        tuple(p.data_ptr() for p in params),
        tuple((p.shape, p.stride(), p.dtype) for p in params),
        (w_ENK if isinstance(w_ENK, torch.Tensor) else w_ENK[0]).dtype,  # what was quantized: autocast's cast
        spec,
        OPTIMIZER_STEPS[0],
    )
    # (the parameters themselves: the entry's weak references, one per parameter, each the very tensor)
    hit = WEIGHT_CACHE.get(params[0])
    if (
        hit is not None
        and hit[0] == key
        and all(r() is p for r, p in zip(hit[1], params))
        and (hit[2].columnwise_data is not None or not keep)
    ):
        return hit[2]
    qw = kernels.quantize_group(w_ENK, spec, rowwise=True, columnwise=True)  # both: dgrad reads the other
    WEIGHT_CACHE[params[0]] = (key, tuple(map(weakref.ref, params)), qw)
    return qw


register_family(fp8.RowwiseScaling, RowwisePlan)
