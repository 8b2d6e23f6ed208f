"""What ``functional_dw.megatron.GroupedMLP`` reads of Megatron's config before it runs, and
how it runs inside Megatron's fine-grained offloading: the activation, the settings it refuses,
the offloading hooks, the padded probs. Pure functions of their arguments (megatron-core is
imported only where offloading runs)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from .activations import ACTIVATIONS, from_megatron

__all__ = ["check_linears", "mlp_activation", "pad_probs", "refuse_unsupported_mlp", "route_to_megatron"]


def _func_name(func: Any) -> str:
    """How a message names an ``activation_func``: ``F.silu`` for torch.nn.functional's."""
    import torch.nn.functional as F

    short = getattr(func, "__name__", None) or repr(func)
    if getattr(F, short, None) is func:
        return f"F.{short}"
    return f"{getattr(func, '__module__', None) or '?'}.{short}"


def mlp_activation(config: Any) -> str:
    """grouped_mlp's activation for Megatron's (``gated_linear_unit``, ``activation_func``): the
    record that maps it (``activations.from_megatron``), or NotImplementedError naming what is set."""
    func, gated = config.activation_func, bool(config.gated_linear_unit)
    record = from_megatron(func, gated)
    if record is None:
        runs = [
            f"{a.name!r} (gated_linear_unit={a.gated}, activation_func={_func_name(a.megatron)})"
            for a in ACTIVATIONS.values()
            if a.megatron is not None
        ]
        raise NotImplementedError(
            f"config.activation_func={_func_name(func)} with gated_linear_unit={gated}: functional_dw.megatron."
            f"GroupedMLP runs {', '.join(runs[:-1])} or {runs[-1]}; use TEGroupedMLP for this activation"
        )
    activation = record.name
    if gated:
        for flag, default in (("glu_linear_offset", 0.0), ("activation_func_clamp_value", None)):
            if getattr(config, flag, default) != default:
                raise NotImplementedError(
                    f"config.{flag}={getattr(config, flag)!r}: functional_dw.megatron.GroupedMLP's {activation!r} "
                    f"is act(gate) * up; set config.{flag}={default!r} or use TEGroupedMLP"
                )
        if getattr(config, "moe_mlp_glu_interleave_size", None) is not None:
            raise NotImplementedError(
                f"config.moe_mlp_glu_interleave_size={config.moe_mlp_glu_interleave_size!r}: "
                "functional_dw.megatron.GroupedMLP reads fc1's output as the gate half, then the up half; "
                "set it to None or use TEGroupedMLP"
            )
    return activation


def check_linears(mlp: torch.nn.Module, base: type, wants: tuple[type, type]) -> None:
    """TypeError unless the experts' ``linear_fc1`` and ``linear_fc2`` are ``base`` instances
    (our GroupedLinears: the fused MLP reads their parameters); ``wants`` names the classes to use."""
    for attr, want in zip(("linear_fc1", "linear_fc2"), wants):
        if not isinstance(getattr(mlp, attr), base):
            raise TypeError(
                f"functional_dw.megatron.GroupedMLP: submodules.{attr} built a "
                f"{type(getattr(mlp, attr)).__name__}; the fused MLP reads its parameters, so it must be "
                f"functional_dw.megatron.{want.__name__} (or a subclass, or None for it)"
            )


def refuse_unsupported_mlp(config: Any, submodules: Any) -> None:
    """NotImplementedError for the TEGroupedMLP settings the fused experts do not implement."""
    if getattr(config, "use_transformer_engine_op_fuser", False):
        raise NotImplementedError(
            "config.use_transformer_engine_op_fuser=True: that is TE's own fused expert MLP; "
            "functional_dw.megatron.GroupedMLP is the fused one here: set it to False"
        )
    if getattr(config, "use_te_activation_func", False) and getattr(submodules, "activation_func", None) is not None:
        raise NotImplementedError(
            "config.use_te_activation_func=True with an activation_func submodule: functional_dw.megatron.GroupedMLP "
            "runs its activation inside the fused pair (from config.activation_func); set use_te_activation_func=False"
        )
    if getattr(config, "activation_func_fp8_input_store", False):
        raise NotImplementedError(
            "config.activation_func_fp8_input_store=True: Megatron keeps the activation's input in FP8; "
            "functional_dw.megatron.GroupedMLP keeps fc1's output as its save= policy says (save='x_only' "
            "keeps the least): set it to False"
        )
    offload = [n for n in ("expert_fc1", "moe_act") if _offloads(config, n)]
    if getattr(config, "fp8", None) and len(offload) == 1:
        raise NotImplementedError(
            f"config.fp8 with only {offload[0]!r} of 'expert_fc1'/'moe_act' in config.offload_modules: under FP8 "
            "the fused MLP's record keeps x's FP8 copy, which its hooks cannot tell from fc1's output; offload "
            "both (or neither) or run without FP8"
        )


def _offloads(config: Any, name: str) -> bool:
    return bool(config.fine_grained_activation_offloading) and name in (config.offload_modules or [])


def _is(t: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether the saved tensor ``t`` is ``x`` (the same object, or the same memory and layout)."""
    if t is x:
        return True
    try:
        return (
            t.device == x.device
            and t.dtype == x.dtype
            and t.shape == x.shape
            and t.stride() == x.stride()
            and t.data_ptr() == x.data_ptr()
        )
    except (RuntimeError, NotImplementedError):  # (a wrapper subclass without storage)
        return False


@contextlib.contextmanager
def route_to_megatron(x: torch.Tensor, fc1: bool, act: bool) -> Iterator[None]:
    """Inside Megatron's offloading context (its saved-tensor hooks entered): hooks that hand
    Megatron's manager x (fc1's input) when ``fc1`` ('expert_fc1' offloaded) and every other saved
    activation (fc1's output, probs, h when kept) when ``act`` ('moe_act' offloaded); the rest
    stays in autograd's record as it is. The fused node's record holds the weights by reference:
    they never reach a hook."""
    from megatron.core.pipeline_parallel.fine_grained_activation_offload import PipelineOffloadManager

    mgr = PipelineOffloadManager.get_instance()
    if not getattr(mgr, "inside_context", False):  # (Megatron offloads nothing in this chunk)
        yield
        return

    def pack(t: torch.Tensor) -> Any:
        return mgr.on_save_for_backward(t) if (fc1 if _is(t, x) else act) else t

    def unpack(saved: Any) -> torch.Tensor:
        return saved if isinstance(saved, torch.Tensor) else mgr.on_get_saved_tensor(saved)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


def pad_probs(pad: Any, probs: torch.Tensor, splits: list[int]) -> torch.Tensor:
    """``probs`` padded as Megatron's ``quantization_padding`` (``pad``) pads the tokens."""
    return pad(probs.unsqueeze(-1), splits)[0].squeeze(-1)
