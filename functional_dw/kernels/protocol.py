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

FP8: a recipe family's kernels (``emulated.py``, ``te_fp8_gemm.py``, ``rowwise.py``; chosen by
the family per backend: NOTE: [FP8 kernels by family] in ``fp8_plan.py``) add ``quantize``/
``grouped_quantize``, which make quantized operands, and their GEMM methods take those in place
of tensors (NOTE: [FP8 operands]). ``tests/test_kernels_conformance.py`` runs every backend.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from .packing import Weights
from .splits import Splits

__all__ = ["Kernels"]


# NOTE: [FP8 operands] (the layers' side: ``functional_dw/_fp8.py``; docs/fp8.md)
#   ``quantize(t, spec, *, scale, amax, rowwise, columnwise) -> Q`` and
#   ``grouped_quantize(x_TK, splits, spec, *, scales, amaxes, rowwise, columnwise, grouped) -> QGroup``
#   quantize as a ``functional_dw.fp8.TensorSpec`` says. For delayed scaling ``scale``/``amax``
#   are views into the caller's ``DelayedScalingState`` (0-d for one GEMM; for a group, one
#   strided ``[E]`` view each, indexable per expert): quantize with ``scale`` and max the tensor's
#   amax into ``amax`` in place (None: record nothing). ``Q`` offers ``with_usage(rowwise=,
#   columnwise=)``, ``dtype`` (the source's) and ``shape``, and is a pytree node whose leaves are
#   its tensors (it rides in a residuals record and through saved-tensor hooks). A ``QGroup`` is
#   opaque to the layer: a list of E ``Q`` (split path), or the backend's grouped object.
#   Optional: ``quantize_each(ts, spec, *, scales, amaxes, rowwise, columnwise) -> list[Q]``,
#   ``quantize`` of each of E tensors of one shape (a group's weights) with one check (the
#   layers fall back to ``quantize`` per tensor).
#   An FP8 family's kernels' GEMM methods take ``Q`` operands (both) in place of tensors, reading
#   fprop's x and W rowwise, dgrad's dy rowwise and W columnwise, wgrad's x and dy columnwise,
#   and a keyword ``split_accumulator`` (read only with ``Q`` operands); outputs are in the
#   activations' dtype, ``out``/``accumulate`` work as without FP8, and ``with_dbias`` is False
#   (the layer sums the bias grad from its high-precision dy).


class Kernels(Protocol):
    """The backend interface. Implementations: ``torch_ref.TorchKernels``, ``te.TEKernels`` (bf16,
    fp16, fp32); FP8, per recipe family: ``emulated.EmulatedKernels``, ``te_fp8_gemm.TEFP8Kernels``,
    ``rowwise.RowwiseKernels``."""

    name: str

    def fprop(
        self, x_TK: torch.Tensor, w_NK: torch.Tensor, b_N: torch.Tensor | None, *, split_accumulator: bool = False
    ) -> torch.Tensor: ...
    def dgrad(self, dy_TN: torch.Tensor, w_NK: torch.Tensor, *, split_accumulator: bool = False) -> torch.Tensor: ...
    def wgrad(
        self,
        x_TK: torch.Tensor,
        dy_TN: torch.Tensor,
        *,
        out: torch.Tensor | None = None,
        accumulate: bool = False,
        with_dbias: bool = False,
        split_accumulator: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def grouped_path_unsupported(self, x_TK: torch.Tensor, w_ENK: Weights, recipe=None) -> str | None:
        """Why the one-kernel grouped path cannot run these operands (with FP8: quantized by
        ``recipe``, an ``fp8`` recipe), or None if it can."""
        ...

    def grouped_fprop(
        self,
        x_TK: torch.Tensor,
        w_ENK: Weights,
        b_EN: torch.Tensor | None,
        splits: Splits,
        grouped: bool,
        *,
        split_accumulator: bool = False,
    ) -> torch.Tensor: ...
    def grouped_dgrad(
        self, dy_TN: torch.Tensor, w_ENK: Weights, splits: Splits, grouped: bool, *, split_accumulator: bool = False
    ) -> torch.Tensor: ...
    def grouped_wgrad(
        self,
        x_TK: torch.Tensor,
        dy_TN: torch.Tensor,
        splits: Splits,
        grouped: bool,
        *,
        out: Weights | None = None,
        accumulate: bool = False,
        with_dbias: bool = False,
        split_accumulator: bool = False,
    ) -> tuple[Weights, torch.Tensor | None]: ...

    # FP8 (NOTE: [FP8 operands]); a backend without them runs no FP8 layer
    def quantize(
        self,
        t: torch.Tensor,
        spec: Any,
        *,
        scale: torch.Tensor | None = None,
        amax: torch.Tensor | None = None,
        rowwise: bool = True,
        columnwise: bool = False,
    ) -> Any: ...
    def grouped_quantize(
        self,
        x_TK: torch.Tensor,
        splits: Splits,
        spec: Any,
        *,
        scales: Any = None,
        amaxes: Any = None,
        rowwise: bool = True,
        columnwise: bool = False,
        grouped: bool = False,
    ) -> Any: ...
