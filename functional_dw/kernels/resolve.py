"""Backend resolution: :func:`get_kernels` turns a layer's ``backend=`` (None, ``"auto"``,
``"torch"``, ``"te"`` or a Kernels object) into the kernels that run it, importing Transformer
Engine's only when they are asked for (:func:`te_available`).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch._subclasses.fake_tensor import FakeTensor

from .packing import Weights
from .protocol import Kernels

__all__ = ["builtin_backend", "get_kernels", "te_available", "te_update_delayed"]


# NOTE: [The default backend] What a user gets without ``backend=`` is the fastest measured
#   (benchmarks/results/moe_layer, moe_mlp, H200): for a group on CUDA, torch's grouped GEMM wherever it
#   can run these operands (bf16, 16-byte rows, compute capability >= 8.0). It beat both of TE's paths
#   up to 32k tokens and tied them above (TE's split path was 2-4% ahead only at large tokens-per-expert
#   x ffn, and needs host splits), and it costs the host less per call. Everything else (one GEMM, fp32
#   or fp16 groups, per-expert GEMMs asked with use_grouped_tensor=False, fp32 main_grad accumulation,
#   TE's FP8 recipes) runs on TE's kernels where TE imports and x is on CUDA, else on the reference.
#   ``"auto"`` is the same rule, by name. ``backend="te"`` is how TE's own numbers are reproduced bit
#   for bit; the residuals record which kernels ran (``res.kernels``, ``res.path``).


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


def te_update_delayed() -> Callable[..., None] | None:
    """TE's fused delayed-scaling update (``te_fp8.update_delayed_``) where TE imports, else
    None: the provider ``kernels/__init__.py`` registers with ``fp8.state`` (NOTE: [The fused
    kernel comes from the kernels])."""
    if not te_available():
        return None
    from .te_fp8 import update_delayed_

    return update_delayed_


_TE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_TE_INSTALL = (
    "backend='te' needs Transformer Engine for PyTorch: `pip install "
    "'functional_dw[te]'` (or `pip install 'transformer-engine[pytorch]>=2.20'`) on a machine "
    "with CUDA; use backend='torch' for the plain-PyTorch reference"
)


def get_kernels(backend: str | Kernels | None, x: torch.Tensor, w_ENK: Weights | None = None) -> Kernels:
    """Resolve ``backend``: None and ``"auto"`` pick the fastest measured (NOTE: [The default
    backend]); ``"te"`` and ``"torch"`` name theirs; a Kernels object runs as given.

    ``w_ENK``: the group's weights where the caller may run torch's grouped GEMM (None: one
    GEMM, or a call only TE's or the reference kernels can run)."""
    if backend is None or backend == "auto":
        if w_ENK is not None and x.is_cuda and _torch().grouped_path_unsupported(x, w_ENK) is None:
            return _torch()
        # TE's GEMMs take fp32 (as TF32), bf16 and fp16; float64 stays on torch
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


_EAGER_TORCH: list[Kernels] = []  # filled on first use (this module imports no backend itself)


def _torch() -> Kernels:
    """The reference kernels; while compiling, the same with the split path as custom ops."""
    if torch.compiler.is_compiling():
        from .torch_ops import TRACED_TORCH

        return TRACED_TORCH
    if not _EAGER_TORCH:
        from .torch_ref import TORCH

        _EAGER_TORCH.append(TORCH)
    return _EAGER_TORCH[0]


# functional_dw's own bf16 kernels, by class: an FP8 family maps these to its kernels on the
# same backend (NOTE: [FP8 kernels by family]); TracedTEKernels is not one (its quantize
# refuses FP8 under torch.compile, as it always did)
_BUILTIN = {
    ("functional_dw.kernels.torch_ref", "TorchKernels"),
    ("functional_dw.kernels.torch_ops", "TracedTorchKernels"),
    ("functional_dw.kernels.te", "TEKernels"),
}


def builtin_backend(kernels: object) -> str | None:
    """The backend name (``"torch"``, ``"te"``) of functional_dw's own bf16 kernels, None for
    any other object (a user's Kernels or a subclass, kernels an FP8 family already chose)."""
    cls = type(kernels)
    return getattr(kernels, "name", None) if (cls.__module__, cls.__qualname__) in _BUILTIN else None


def refuse_fp8_only(kernels: object) -> None:
    """TypeError where a call without a recipe got an FP8 family's kernels as ``backend=``
    (``EMULATED``, ``ROWWISE``, ``TE_FP8``: they multiply FP8 operands only)."""
    if getattr(kernels, "fp8_only", False):
        raise TypeError(
            f"backend {type(kernels).__name__} multiplies FP8 operands only (an FP8 recipe family's kernels): "
            "pass a recipe= with it, or backend='torch' or 'te' for a call without FP8"
        )
