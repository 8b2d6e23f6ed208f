"""What TE 2.20's FP8 kernels cannot take, said before any CUDA call (pure torch; no TE import,
so the rules are tested on the CPU). ``env`` is ``(compute capability, cuBLASLt version, CUDA
version)`` of the tensor's device, e.g. ``((9, 0), 131000, (12, 9))``.

In short: in- and out-features multiples of 16, every expert's tokens a multiple of 16 for
wgrad, rows a multiple of 8, and every expert's rows a multiple of 128 for grouped block
scaling (NOTE: [FP8 sizes]).
"""

from __future__ import annotations

from typing import Any, Optional

import functools

import torch

from .. import fp8

__all__ = ["device_problem", "grouped_path_problem", "check_per_expert", "check_quantize", "env_of", "MAX_LIST"]


# NOTE: [FP8 sizes] Hopper runs FP8 GEMMs as TN only, on the rowwise copy of one operand and the
# columnwise (transposed) copy of the other, and cuBLASLt wants every FP8 leading dimension to be a
# multiple of 16 (TE: ``CanonicalizeGemmInput``, "Leading dimension requirement ... Caller must
# pad"). So: in-features (K) and out-features (N) multiples of 16 (fprop reads ``[*, K]`` rows,
# dgrad the weight's ``[K, N]`` transpose and dy's ``[*, N]`` rows); the token count of every
# columnwise copy (x and dy for wgrad: ``[K, T_e]``, ``[N, T_e]``) a multiple of 16 per expert;
# otherwise rows a multiple of 8 (TE's ``assert_dim_for_fp8_exec`` for Linear; block scaling's
# outer-dimension rule). TE's grouped FP8 block-scaling quantize needs every expert's rows to be a
# multiple of 128 (a device-side error otherwise), so on that path host-known splits are checked;
# a CUDA splits tensor is not read on the host there (no sync) and is the caller's to keep aligned.

MAX_LIST = 64  # TE's grouped GEMM takes at most 64 list operands (per-expert FP8 weights)
_ACTIVATIONS = (torch.float32, torch.bfloat16, torch.float16)
_WHAT = {
    "input": ("x", "in-features", "tokens"),
    "weight": ("the weight", "in-features", "out-features"),
    "grad_output": ("dy", "out-features", "tokens"),
}


def _ver(v: int) -> str:
    return f"{v // 10000}.{v // 100 % 100}.{v % 100}"


@functools.lru_cache(maxsize=64)  # per (scaling, device): on every quantize call
def device_problem(scaling: str, env: tuple) -> Optional[str]:
    """Why this device cannot run ``scaling`` ("delayed", "current", "block") on TE, or None
    (TE ``quantization.py: _compute_fp8_support``, ``_compute_fp8_block_scaling_support``)."""
    cc, cublaslt, cuda = env
    here = f"this GPU is compute capability {cc[0]}.{cc[1]}"
    if cc < (8, 9):
        return f"FP8 needs compute capability 8.9 or higher (Ada, Hopper, Blackwell); {here}"
    if cc < (9, 0) and (cublaslt < 120103 or cuda < (12, 1)):
        return f"FP8 on Ada needs cuBLASLt >= 12.1.3 and CUDA >= 12.1; have cuBLASLt {_ver(cublaslt)}, CUDA {cuda}"
    if scaling == "block" and (cc < (9, 0) or cuda < (12, 9)):
        return (
            f"Float8BlockScaling needs compute capability 9.0 or higher and CUDA >= 12.9 (TE's FP8 "
            f"block-scaled GEMM); {here}, torch built with CUDA {'.'.join(map(str, cuda))}"
        )
    return None


def grouped_path_problem(recipe: Any, env: tuple, num_experts: int) -> Optional[str]:
    """Why TE's grouped-tensor path cannot run ``recipe`` (after the bf16 checks), or None: TE's
    own predicate (``grouped_linear.py: is_module_grouped_tensor_path_supported``), plus the 64
    list operands per-expert FP8 weights become."""
    r = fp8.as_recipe(recipe)
    if r is None:
        return None
    cc, cublaslt, _ = env
    name = type(r).__name__
    if r.backward_override is not None:
        return f"TE runs {name} with backward_override={r.backward_override!r} on the split path only"
    if isinstance(r, fp8.DelayedScaling):
        return "TE's grouped-tensor path has no delayed-scaling kernels (te.GroupedLinear runs DelayedScaling on the split path)"
    if isinstance(r, fp8.Float8CurrentScaling) and cc < (10, 0) and cublaslt < 130500:
        return f"TE's grouped GEMM needs cuBLASLt >= 13.5.0 for Float8CurrentScaling on Hopper; have {_ver(cublaslt)}"
    if isinstance(r, fp8.Float8BlockScaling):
        if cc >= (10, 0):
            return "TE's grouped-tensor path runs Float8BlockScaling on Hopper only (Blackwell: the split path emulates it)"
        if cublaslt < 130600:
            return f"TE's grouped GEMM needs cuBLASLt >= 13.6.0 for Float8BlockScaling on Hopper; have {_ver(cublaslt)}"
    if num_experts > MAX_LIST:
        return (
            f"TE's FP8 grouped GEMM takes per-expert weights as a list of at most {MAX_LIST}; got {num_experts} experts"
        )
    return None


def check_per_expert(values: Any, E: int, name: str) -> None:
    """ValueError unless ``values`` (a tensor or a sequence) has one entry per expert (``E``)."""
    n = values.numel() if isinstance(values, torch.Tensor) else len(values)
    if n != E:
        raise ValueError(f"{name} must have {E} entries (one per expert), got {n}")


def _counts(sizes: Any, mult: int, why: str, spec: fp8.TensorSpec) -> None:
    bad = [(e, n) for e, n in enumerate(sizes) if n % mult]
    if bad:
        e, n = bad[0]
        raise ValueError(
            f"{_WHAT[spec.role][0]}: splits[{e}] is {n}, but {why} needs every expert's token count "
            f"to be a multiple of {mult}: pad each expert's tokens (or use recipe=None)"
        )


def check_quantize(
    t: Any, spec: Any, scale: Any, amax: Any, rowwise: bool, columnwise: bool, env: tuple, group: Optional[tuple] = None
) -> None:
    """Raise ``TypeError``/``ValueError`` for what TE's FP8 quantization and GEMMs would refuse
    (the device is the caller's: ``env`` describes it). ``group``: ``(splits, grouped)`` for
    ``grouped_quantize``; ``scale``/``amax`` are then the per-expert ``scales``/``amaxes``."""
    if not isinstance(spec, fp8.TensorSpec):
        raise TypeError(f"spec must be an fp8.TensorSpec (fp8.tensor_spec(recipe, role)), got {type(spec).__name__}")
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"the tensor to quantize must be a torch.Tensor, got {type(t).__name__}")
    who, cols_are, rows_are = _WHAT.get(spec.role, ("the tensor", "columns", "rows"))
    if t.dtype not in _ACTIVATIONS:
        raise TypeError(f"TE quantizes float32, bfloat16 or float16; {who} is {t.dtype}")
    if t.dim() != 2:
        raise ValueError(f"{who} must be 2-D to quantize, got shape {tuple(t.shape)}")
    if not (rowwise or columnwise):
        raise ValueError("quantize needs rowwise=True or columnwise=True (or both)")
    delayed = spec.scaling == "delayed"
    if delayed and scale is None:
        raise ValueError(
            "delayed scaling quantizes with the state's scale: pass scale(s)= (fp8.scale_for / fp8.group_scales)"
        )
    if not delayed and (scale is not None or amax is not None):
        raise ValueError(f"scale/amax are for delayed scaling only; {spec.scaling} scaling computes its own")
    why = device_problem(spec.scaling, env)
    if why is not None:
        raise ValueError(f"{why}. Use recipe=None (bf16), or backend='torch' for the FP8 emulation")
    rows, cols = t.shape
    if cols % 16:
        raise ValueError(
            f"FP8 GEMMs need {who}'s {cols_are} to be a multiple of 16 (cuBLASLt's FP8 leading-"
            f"dimension rule), got {cols}: pad the features, or use recipe=None"
        )
    if group is None:
        mult = 16 if columnwise else 8
        if rows % mult:
            raise ValueError(
                f"FP8 GEMMs need {who}'s {rows_are} to be a multiple of {mult}"
                f"{' (its transposed copy feeds a GEMM)' if columnwise else ''}, got {rows}: "
                "pad them, or use recipe=None"
            )
        return
    _check_group(t, spec, scale, amax, columnwise, group, who)


def _check_group(t: Any, spec: Any, scale: Any, amax: Any, columnwise: bool, group: tuple, who: str) -> None:
    """:func:`check_quantize`'s rules for a group's rows (``group``: ``(splits, grouped)``)."""
    delayed = spec.scaling == "delayed"
    splits, grouped = group
    E = splits.num_experts
    if delayed:
        check_per_expert(scale, E, "scales")
        if amax is not None:
            check_per_expert(amax, E, "amaxes")
    if grouped and splits.num_tokens:
        if delayed:
            raise ValueError(
                "TE's grouped-tensor path has no delayed-scaling kernels: ask "
                "grouped_path_unsupported(x, w, recipe=...) and run the split path"
            )
        if t.dtype not in (torch.bfloat16, torch.float16):
            raise TypeError(f"TE's grouped GEMM takes bfloat16 or float16; {who} is {t.dtype}: run the split path")
        sizes = splits.host  # a device splits tensor is not read on the host here (see the NOTE)
    else:
        sizes = splits.sizes() if splits.num_tokens else [0] * E
    if sizes is None:
        return
    if grouped and spec.scaling == "block":
        _counts(sizes, 128, "TE's grouped FP8 block-scaling quantize", spec)
    if columnwise:
        _counts(sizes, 16, "an FP8 wgrad (cuBLASLt's leading-dimension rule)", spec)
    elif spec.scaling == "block":
        _counts(sizes, 8, "an FP8 block-scaled GEMM (outer-dimension rule)", spec)


def env_of(capability: Any, cublaslt: int) -> tuple:
    """``env`` for the checks: TE's facts of a device and the CUDA version torch was built with."""
    cuda = tuple(int(p) for p in (torch.version.cuda or "0.0").split(".")[:2])
    return tuple(capability), cublaslt, cuda
