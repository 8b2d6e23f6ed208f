"""grouped_mlp's arguments: its own checks, before any GEMM (fc1's and fc2's are the layer's, their
errors prefixed by :func:`in_layer`): the options, the experts and shapes of w1 and w2 against x
and the activation, probs, each error naming the argument and the fix; and the call's static
options (:class:`MLPOptions`, each layer's ``plan.Options`` inside) from its arguments."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from . import _checks, _fp8, distributed_weight as dwp
from .activations import ACTIVATIONS, glu_width
from .activations import get as get_activation
from .grouped_plan import normalize_args
from .plan import Options

__all__ = ["MLPOptions", "POLICIES", "check_args", "check_call", "check_options", "in_layer", "keep_x_args", "options"]

POLICIES = ("default", "h", "x_only")  # grouped_mlp's save= policies


def _experts(name: str, w: Any) -> int | None:
    """The number of experts of a weights argument (None where the layer's own checks will say
    what is wrong with it)."""
    if isinstance(w, torch.Tensor):
        if w.dim() != 3:
            raise ValueError(
                f"{name} must be E [out, in] tensors or one [E, out, in] tensor, got one tensor of "
                f"shape {tuple(w.shape)}"
            )
        return w.shape[0]
    ws = _checks.sequence(w)
    return None if not ws else len(ws)


def _shape(w: Any) -> tuple[int, int] | None:
    """(out, in) of a plain group's first weight (None: a DistributedWeight, whose shard is not
    the shape the GEMMs see, or something the layer's checks will name)."""
    w0 = w if isinstance(w, torch.Tensor) else (_checks.sequence(w) or [None])[0]
    if not isinstance(w0, torch.Tensor) or w0.dim() < 2 or dwp.is_distributed_weight(w0):
        return None
    N, K = w0.shape[-2:]
    return N, K


def check_options(activation: Any, save: Any) -> None:
    """ValueError unless ``activation`` is a registered activation (:data:`ACTIVATIONS`) and
    ``save`` one of :data:`POLICIES` (also for the modules' constructors)."""
    get_activation(activation)  # (ValueError naming the registered ones)
    if not isinstance(save, str) or save not in POLICIES:
        raise ValueError(
            f"save must be one of {', '.join(map(repr, POLICIES))} (what forward keeps for backward), got {save!r}"
        )


def check_call(x: Any, w1: Any, w2: Any, probs: Any, activation: Any, save: Any, fp8: bool, rows: bool = False) -> None:
    """A grouped_mlp call's own checks, in order: the options, the arguments, and the policy
    against FP8 (``fp8``: the call has a recipe or a state; ``rows``: x is x[rows]'s stand-in)."""
    check_options(activation, save)
    check_args(x, w1, w2, probs, activation, rows)
    if save == "x_only" and fp8:
        raise ValueError(
            "save='x_only' recomputes fc1's output from x, but with FP8 fc1 keeps only x's FP8 copy: "
            "use save='default' or 'h' with recipe="
        )


def check_args(x: Any, w1: Any, w2: Any, probs: Any, activation: str, rows: bool = False) -> None:
    """The MLP's own checks, before any GEMM: each names the argument and the fix (``rows``: x
    stands in for x[rows], whose R rows probs weigh)."""
    _checks.tensor("x", x, ndim=2)
    E1, E2 = _experts("w1", w1), _experts("w2", w2)
    if E1 is not None and E2 is not None and E1 != E2:
        raise ValueError(
            f"w1 has {E1} experts but w2 has {E2}: fc1 and fc2 need one weight per expert each "
            f"(w1: E x [{glu_width(activation)}F, H], w2: E x [H, F])"
        )
    s1, s2 = _shape(w1), _shape(w2)
    if s1 is not None and s2 is not None:
        (N1, K1), (_, F) = s1, s2
        if x.shape[1] != K1:
            raise ValueError(
                f"x has {x.shape[1]} features but w1 is [{N1}, {K1}] per expert: x must be [T, {K1}], "
                f"or w1 [{N1}, {x.shape[1]}]"
            )
        want = glu_width(activation) * F
        if N1 != want:
            gated = " or ".join(repr(a.name) for a in ACTIVATIONS.values() if a.gated)
            if glu_width(activation) == 2:
                plain = " or ".join(repr(a.name) for a in ACTIVATIONS.values() if not a.gated)
                raise ValueError(
                    f"w1 is [{N1}, {K1}] per expert but activation={activation!r} needs 2 * F = {want} out-features "
                    f"(the gate half, then the up half; F = {F} is w2's in-features): make w1 [{want}, {K1}], or "
                    f"use activation={plain} with w1 [{F}, {K1}]"
                )
            hint = f" (a [{2 * F}, {K1}] w1 is for activation={gated})" if N1 == 2 * F else ""
            raise ValueError(
                f"w1 is [{N1}, {K1}] per expert but activation={activation!r} needs F = {F} "
                f"out-features (w2's in-features): make w1 [{F}, {K1}]{hint}"
            )
    if probs is not None:
        _checks.tensor("probs", probs)
        T = x.shape[0]
        if probs.dim() != 1 or probs.shape[0] != T:
            fix = " (probs.reshape(-1))" if probs.numel() == T else ""
            per = f"[R] = [{T}], one router weight per row of x[rows] (R, not x's tokens)" if rows else ""
            raise ValueError(
                f"probs must be {per or f'[T] = [{T}], one router weight per row of x'}, got shape "
                f"{tuple(probs.shape)}: pass a 1-D tensor of {T} values{fix}"
            )
        if probs.device != x.device:
            raise ValueError(f"probs is on {probs.device} but x is on {x.device}; move them to one device")


def in_layer(layer: str, fn: Any, *args: Any) -> Any:
    """``fn(*args)`` for fc1 or fc2, its argument errors prefixed with the layer and what its
    arguments are called here."""
    try:
        return fn(*args)
    except (ValueError, TypeError) as e:
        names = ("x", "w1", "bias1") if layer == "fc1" else ("h = act(fc1_out) * probs", "w2", "bias2")
        raise type(e)(
            f"grouped_mlp's {layer} (its x is {names[0]}, its weights {names[1]}, its bias {names[2]}): {e}"
        ) from e


# --- the call's options ----------------------------------------------------------------------------


class MLPOptions(NamedTuple):
    """A grouped_mlp call's static options: one nondiff argument of the bridge (NOTE:
    [nondiff_argnums]); each layer's own ``plan.Options`` inside. (No tensors: ``_fdw_static``.)"""

    _fdw_static = True

    activation: str
    save: str
    fc1: Options
    fc2: Options
    combine: bool = False  # with rows: y's rows summed into x's tokens (mlp_rows.py)


def options(
    w1,
    w2,
    splits,
    bias1,
    bias2,
    activation,
    save,
    recipe,
    fp8_state,
    backend,
    fuse,
    use_grouped_tensor,
    keep_x: tuple[bool, bool],
    amp: torch.dtype | None = None,
) -> tuple[MLPOptions, tuple]:
    """The call's options (each layer's ``plan.Options``) and its arguments normalized as the
    layers normalize theirs."""
    w1, splits, bias1 = normalize_args(w1, splits, bias1)
    w2, _, bias2 = normalize_args(w2, splits, bias2)
    args1 = args2 = None
    if recipe is not None or fp8_state is not None:
        if fp8_state is None:
            s1 = s2 = None
        elif isinstance(fp8_state, (list, tuple)) and len(fp8_state) == 2:
            s1, s2 = fp8_state
        else:
            raise TypeError(
                "fp8_state must be None or a pair (fc1's state, fc2's state), each "
                "fp8.init_state(recipe, num_gemms=E, device=...), got "
                f"{type(fp8_state).__name__}"
            )
        args1 = _fp8.Args(recipe, s1, keep_x=keep_x[0])
        args2 = _fp8.Args(recipe, s2, keep_x=keep_x[1])
    opts = MLPOptions(
        activation,
        save,
        Options(fuse, use_grouped_tensor, backend, args1, amp),
        Options(fuse, use_grouped_tensor, backend, args2, amp),
    )
    return opts, (w1, w2, splits, bias1, bias2)


def keep_x_args(w1: Any, w2: Any, recipe: Any, fp8_state: Any) -> tuple[bool, bool]:
    """Whether fc1 and fc2 keep their x's FP8 copy (only where a weight may get a grad); FP8
    refused while compiling, as the layers refuse it."""
    if recipe is None and fp8_state is None:
        return True, True
    _fp8.refuse_compile(recipe)
    return _fp8.wgrad_possible(w1), _fp8.wgrad_possible(w2)
