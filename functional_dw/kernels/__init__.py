"""The GEMM seam: every matrix product of ``linear`` and ``grouped_linear`` goes through a
``Kernels`` object, and nothing else in the package calls a GEMM.

The modules, in the order a layer meets them:

- :mod:`.resolve`: :func:`get_kernels` (a layer's ``backend=`` to its kernels), :func:`te_available`.
- :mod:`.protocol`: the :class:`Kernels` interface (the method table, NOTE: [FP8 operands]).
- :mod:`.splits`: the :class:`Splits` record (token counts per expert, host and device),
  :func:`check_sizes`.
- :mod:`.packing`: a group's tensors as one buffer (:func:`packed`, :func:`as_one_buffer`,
  :func:`stacked`; NOTE: [One buffer]), :func:`out_in`, :func:`per_expert`.
- The backends: :mod:`.torch_ref` (plain PyTorch, any device) with :mod:`.rowwise` (RowwiseScaling)
  and :mod:`.torch_ops` (its split path as custom ops, for ``torch.compile``); :mod:`.te`
  (Transformer Engine) with :mod:`.te_fp8`, :mod:`.te_fp8_checks` and :mod:`.te_ops`; the
  Triton kernels :mod:`.triton_splits` and :mod:`.triton_rowwise`.
- The expert MLP's elementwise steps: :mod:`.activation` (the seam, ``select``), the reference
  :mod:`.torch_activation` (each activation's math from its record in ``functional_dw/activations.py``),
  the Triton kernels :mod:`.triton_activation`, and :mod:`.triton_math` (the activation's math,
  shared with :mod:`.triton_rowwise`, which can run it as its load).

This module re-exports the names the layers, tests and benchmarks import from
``functional_dw.kernels``, and gives ``fp8.update_state_`` TE's fused kernel (``functional_dw.fp8``
imports nothing from here: NOTE: [The fused kernel comes from the kernels] in ``fp8/state.py``).
"""

from __future__ import annotations

from ..fp8 import state as _fp8_state
from .packing import Weights, as_one_buffer, out_in, packed, per_expert, stacked
from .protocol import Kernels
from .resolve import get_kernels, refuse_fp8_only, te_available, te_update_delayed
from .splits import Splits, check_sizes, to_device

_fp8_state.set_fused_kernel(te_update_delayed)

__all__ = [
    "Kernels",
    "Splits",
    "Weights",
    "as_one_buffer",
    "check_sizes",
    "get_kernels",
    "refuse_fp8_only",
    "out_in",
    "packed",
    "per_expert",
    "stacked",
    "te_available",
    "te_update_delayed",
    "to_device",
]
