"""An MoE layer's token routing as pure pairs: the dispatch and the combine (issue 41, first part).

Legend: ``T`` tokens, ``H`` hidden, ``k`` experts per token (top-k), ``E`` experts, ``R = T * k``
routed rows.

The dispatch sorts the ``R`` (token, choice) pairs by expert, stably (within an expert, rows keep
token order, then choice order: what ``torch.argsort(stable=True)`` gives), and gathers::

    rows[r] = x[order[r] // k]        probs_r[r] = probs.flatten()[order[r]]

with ``splits[e]`` the rows of expert ``e``, counted on the device (no host sync).
:func:`sort_by_expert` is the dispatch without the rows (``probs_r``, ``splits``, ``order``: the
same code), for experts that read x through ``TopkRows(order, k)`` (and, with grouped_mlp's
``combine=True``, sum their rows back themselves: the same sum). The combine
puts each token's ``k`` rows back and sums them: ``y[t] = sum_j rows[pos(t, j)]``, with
``pos`` the inverse of ``order``. Weighting by the router's probs happens between the two, in
the experts (``grouped_mlp(..., probs=probs_r)``: Megatron's weighted activation), so neither
record keeps an activation: both keep ``order`` only, and both backwards are gathers (a
deterministic sum over a token's ``k`` rows, never an atomic ``index_add``).

Expert indices: see the note below on why they are not checked on CUDA.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from . import _amp
from .custom_vjp import custom_vjp
from .grouped_mlp import grouped_mlp, grouped_mlp_bwd, grouped_mlp_fwd
from .linear import linear, linear_bwd, linear_fwd
from .mlp_rows import TopkRows
from .moe_ep import check_local_experts, check_permutation, from_experts, from_experts_bwd, from_experts_fwd, inverse
from .moe_ep import to_experts, to_experts_bwd, to_experts_fwd, token_sum, tokens
from ._checks import values_free
from ._steps import differentiated, refused_later
from .residuals import residuals, saved

__all__ = ["DispatchResiduals", "CombineResiduals", "dispatch", "dispatch_fwd", "dispatch_bwd"]
__all__ += ["sort_by_expert", "sort_by_expert_fwd", "sort_by_expert_bwd"]
__all__ += [
    "combine",
    "combine_fwd",
    "combine_bwd",
    "check_indices",
    "check_router",
    "topk_router",
    "load_balancing_loss",
    "moe_layer",
    "layer_parts",
]


# NOTE: [Expert indices are not checked on CUDA]
#   A check that every index lies in ``[0, E)`` reads the indices on the host: a sync. On the
#   CPU (free) a bad index is a ValueError; on CUDA indices are trusted, as ``torch.topk``'s
#   always are, and an out-of-range one counts toward the nearest valid expert (clamped): wrong
#   rows, never a crash. :func:`check_indices` checks them (a sync).


@residuals
class DispatchResiduals:
    order: torch.Tensor = saved()  # [R] int64: each sorted row's flat (token * k + choice) index
    num_tokens: int
    top_k: int
    has_probs: bool  # (sort_by_expert's record: always True)


@residuals
class CombineResiduals:
    order: torch.Tensor = saved()  # [R] int64, as the dispatch made it
    top_k: int


def _check(x: Any, indices: Any, probs: Any, num_experts: Any) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or not x.is_floating_point():
        raise TypeError(f"dispatch: x must be a floating [T, H] tensor, got {_what(x)}")
    _check_routing("dispatch", indices, probs, num_experts, x)


def _check_routing(who: str, indices: Any, probs: Any, num_experts: Any, x: Any = None, x_name: str = "x's") -> None:
    """The routing's checks in the dispatch, sort_by_expert and load_balancing_loss (``x``: the
    tensor whose rows the indices route, ``x_name``: its possessive in the messages)."""
    if not isinstance(indices, torch.Tensor) or indices.dim() != 2 or indices.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{who}: indices must be a [T, k] int32/int64 tensor (torch.topk's), got {_what(indices)}")
    if x is not None and (indices.shape[0] != x.shape[0] or indices.device != x.device):
        raise ValueError(
            f"{who}: indices {tuple(indices.shape)} on {indices.device} must have {x_name} {x.shape[0]} rows and "
            f"device {x.device}"
        )
    if probs is not None and (
        not isinstance(probs, torch.Tensor)
        or probs.shape != indices.shape
        or not probs.is_floating_point()
        or probs.device != indices.device
    ):
        where = f" on {probs.device}" if isinstance(probs, torch.Tensor) else ""
        raise ValueError(
            f"{who}: probs must be {'None or ' if x is not None else ''}a float tensor shaped like indices "
            f"{tuple(indices.shape)} on their device {indices.device}, got {_what(probs)}{where}"
        )
    if type(num_experts) is not int or num_experts < 1:
        raise ValueError(f"{who}: num_experts must be a positive int, got {num_experts!r}")
    if values_free(indices) and indices.numel():  # NOTE: [Expert indices are not checked on CUDA]
        check_indices(indices, num_experts)


def _what(v: Any) -> str:
    return f"{type(v).__name__} {tuple(v.shape)} {v.dtype}" if isinstance(v, torch.Tensor) else type(v).__name__


def check_indices(indices: torch.Tensor, num_experts: int) -> None:
    """ValueError unless every expert index lies in ``[0, num_experts)`` (a sync on CUDA)."""
    lo, hi = int(indices.min()), int(indices.max())
    if lo < 0 or hi >= num_experts:
        raise ValueError(f"expert indices must lie in [0, {num_experts}); got values from {lo} to {hi}")


def _sort(probs: torch.Tensor | None, indices: torch.Tensor, num_experts: int) -> tuple:
    """``(probs_r [R] or None, splits [E], order [R])``: the (token, choice) pairs sorted stably
    by expert, their probs in that order, each expert's count (on the device). The one sort of
    the dispatch and of sort_by_expert."""
    flat = indices.reshape(-1).to(torch.int64).clamp(0, num_experts - 1)
    order = torch.argsort(flat, stable=True)
    probs_r = None if probs is None else probs.reshape(-1).index_select(0, order)
    splits = torch.zeros(num_experts, dtype=torch.int64, device=indices.device)
    return probs_r, splits.index_add_(0, flat, torch.ones_like(flat)), order


def _probs_grad(res: DispatchResiduals, d_probs_r: torch.Tensor | None) -> torch.Tensor | None:
    """``dprobs [T, k]``: each sorted prob's grad back at its (token, choice) place."""
    if d_probs_r is None:
        return None
    return d_probs_r.index_select(0, inverse(res.order)).view(res.num_tokens, res.top_k)


def dispatch_fwd(x: torch.Tensor, probs: torch.Tensor | None, indices: torch.Tensor, num_experts: int):
    """``((rows [R, H], probs_r [R], splits [E] int64, order [R] int64), residuals)``; without
    probs, ``(rows, splits, order)`` (an autograd output is a tensor, never None)."""
    _check(x, indices, probs, num_experts)
    T, k = indices.shape
    probs_r, splits, order = _sort(probs, indices, num_experts)
    rows = x.index_select(0, tokens(order, k))
    out = (rows, splits, order) if probs_r is None else (rows, probs_r, splits, order)
    return out, DispatchResiduals(order, T, k, probs is not None)


def dispatch_bwd(res: DispatchResiduals, d_out: tuple) -> tuple:
    """(dx, dprobs, None for the indices): each token's ``k`` row grads summed, choice by choice."""
    d_rows = d_out[0]
    dx = None if d_rows is None else token_sum(d_rows, res.order, res.top_k)
    return dx, _probs_grad(res, d_out[1] if res.has_probs else None), None


def sort_by_expert_fwd(probs: torch.Tensor, indices: torch.Tensor, num_experts: int):
    """``((probs_r [R], splits [E] int64, order [R] int64), residuals)``: :func:`dispatch_fwd`
    without the rows (the same sort, the same record)."""
    if not isinstance(probs, torch.Tensor):
        raise TypeError(f"sort_by_expert: probs must be the router's [T, k] float tensor, got {_what(probs)}")
    _check_routing("sort_by_expert", indices, probs, num_experts)
    T, k = indices.shape
    out = _sort(probs, indices, num_experts)
    return out, DispatchResiduals(out[2], T, k, True)


def sort_by_expert_bwd(res: DispatchResiduals, d_out: tuple) -> tuple:
    """(dprobs, None for the indices): :func:`dispatch_bwd`'s dprobs (the same code)."""
    return _probs_grad(res, d_out[0]), None


def combine_fwd(rows: torch.Tensor, order: torch.Tensor, top_k: int):
    """``y [T, H]``: each token's ``k`` rows summed (in choice order), and the residuals."""
    if not isinstance(rows, torch.Tensor) or rows.dim() != 2:
        raise TypeError(f"combine: rows must be an [R, H] tensor, got {_what(rows)}")
    if not isinstance(order, torch.Tensor) or order.dtype != torch.int64 or order.shape != rows.shape[:1]:
        raise ValueError(
            f"combine: order must be the dispatch's [R] int64 order for rows {tuple(rows.shape)}, got {_what(order)}"
        )
    if type(top_k) is not int or top_k < 1 or rows.shape[0] % top_k:
        raise ValueError(f"combine: top_k must be a positive int dividing the {rows.shape[0]} rows, got {top_k!r}")
    check_permutation(order, "combine: order must be a permutation of the rows (the dispatch's fourth output)")
    return token_sum(rows, order, top_k), CombineResiduals(order, top_k)


def combine_bwd(res: CombineResiduals, dy: torch.Tensor) -> tuple:
    """(d_rows, None for the order): each row gets its token's dy."""
    return dy.index_select(0, tokens(res.order, res.top_k)), None


_dispatch = custom_vjp(dispatch_fwd, dispatch_bwd, nondiff_argnums=(3,), name="dispatch")
_combine = custom_vjp(combine_fwd, combine_bwd, nondiff_argnums=(2,), name="combine")
_sort_by_expert = custom_vjp(sort_by_expert_fwd, sort_by_expert_bwd, nondiff_argnums=(2,), name="sort_by_expert")


def dispatch(x: torch.Tensor, probs: torch.Tensor | None, indices: torch.Tensor, num_experts: int) -> tuple:
    """Sort tokens by expert: ``(rows [T*k, H], probs_r [T*k] or None, splits [E], order [T*k])``.

    ``indices`` ``[T, k]`` are the experts each token goes to (``torch.topk``'s), ``probs``
    ``[T, k]`` their weights (None: unweighted). ``splits`` (int64, on x's device, never read on
    the host) and ``probs_r`` feed :func:`functional_dw.grouped_mlp`; ``order`` feeds
    :func:`combine`. Differentiable in x and probs."""
    out = _dispatch(x, probs, indices, num_experts)
    return out if probs is not None else (out[0], None, *out[1:])


def sort_by_expert(probs: torch.Tensor, indices: torch.Tensor, num_experts: int) -> tuple:
    """The dispatch without the rows: ``(probs_r [T*k], splits [E], order [T*k])``, each what
    :func:`dispatch` gives (the same sort), for experts that read x through the order
    (``grouped_mlp(x, ..., rows=TopkRows(order, k))``) instead of gathered rows.
    Differentiable in probs: its grad is the dispatch's, bit for bit (the same code)."""
    return _sort_by_expert(probs, indices, num_experts)


def combine(rows: torch.Tensor, order: torch.Tensor, top_k: int) -> torch.Tensor:
    """``y [T, H]``: the sum of each token's ``top_k`` rows (the experts' outputs, in the
    dispatch's order). Differentiable in rows. ``order`` and ``top_k`` must be the dispatch's:
    only their shapes (and, on the CPU, that ``order`` is a permutation) can be checked."""
    return _combine(rows, order, top_k)


def check_logits(logits: Any, who: str) -> None:
    """TypeError/ValueError unless ``logits`` is a ``[T, E]`` floating-point tensor."""
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        raise TypeError(f"{who}: logits must be a floating-point tensor [T, E], got {_what(logits)}")
    if logits.dim() != 2:
        raise ValueError(
            f"{who}: logits must be [T, E] (one row of expert logits per token), got shape {tuple(logits.shape)}: "
            "flatten the tokens first (logits.reshape(-1, E))"
        )


def check_router(top_k: Any, score: Any, num_experts: int, who: str) -> None:
    """ValueError unless ``top_k`` is an int in ``[1, num_experts]`` and ``score`` is known."""
    if num_experts < 1:
        raise ValueError(f"{who}: there must be at least one expert, got {num_experts}")
    if score not in ("softmax", "sigmoid"):
        raise ValueError(f"{who}: score must be 'softmax' or 'sigmoid', got {score!r}")
    if type(top_k) is not int or not 1 <= top_k <= num_experts:
        raise ValueError(f"{who}: top_k must be an int in [1, {num_experts}] (the experts), got {top_k!r}")


@residuals
class TopkResiduals:
    probs: torch.Tensor = saved()  # [T, k] the weights given out (float32, or float64)
    scores: Any = saved()  # sigmoid: the chosen [T, k] sigmoid scores; softmax: None
    indices: torch.Tensor = saved()  # [T, k] the chosen experts
    num_experts: int
    score: str
    logits_dtype: torch.dtype


def topk_router_fwd(logits: torch.Tensor, expert_bias: torch.Tensor | None, top_k: int, score: str = "softmax"):
    """``((probs [T, k], indices [T, k]), residuals)``: :func:`topk_router`'s math."""
    check_logits(logits, "topk_router")
    check_router(top_k, score, logits.shape[-1], "topk_router")
    if expert_bias is not None and score != "sigmoid":
        raise ValueError("topk_router: expert_bias (DeepSeek-V3's selection bias) goes with score='sigmoid'")
    wide = torch.promote_types(logits.dtype, torch.float32)
    s = None
    if score == "softmax":
        values, indices = torch.topk(logits, top_k, dim=-1)
        probs = torch.softmax(values.to(wide), dim=-1)
    else:
        scores = torch.sigmoid(logits.to(wide))
        if expert_bias is None:
            s, indices = torch.topk(scores, top_k, dim=-1)
        else:
            indices = torch.topk(scores + expert_bias.to(wide), top_k, dim=-1).indices
            s = scores.gather(1, indices)
        probs = s / (s.sum(-1, keepdim=True) + 1e-20) if top_k > 1 else s
    return (probs, indices), TopkResiduals(probs, s, indices, logits.shape[-1], score, logits.dtype)


def topk_router_bwd(res: TopkResiduals, d_out: tuple) -> tuple:
    """(d_logits [T, E], None for the expert bias): the chosen logits' grads, zeros elsewhere."""
    dp, p = d_out[0], res.probs
    if dp is None:
        return None, None
    if res.score == "softmax":
        dv = p * (dp - (dp * p).sum(-1, keepdim=True))
    else:
        s = res.scores
        ds = dp if s.shape[-1] == 1 else (dp - (dp * p).sum(-1, keepdim=True)) / (s.sum(-1, keepdim=True) + 1e-20)
        dv = ds * s * (1 - s)
    d_logits = dv.new_zeros(p.shape[0], res.num_experts).scatter(1, res.indices, dv)
    return d_logits.to(res.logits_dtype), None


_topk_router = custom_vjp(topk_router_fwd, topk_router_bwd, nondiff_argnums=(2, 3), name="topk_router")


def topk_router(
    logits: torch.Tensor, top_k: int, score: str = "softmax", *, expert_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(probs ``[T, k]``, indices ``[T, k]``) from router logits ``[T, E]``, as Megatron's
    ``topk_routing_with_score_function`` computes them (ties broken as ``torch.topk`` does):

    * ``score="softmax"``: the top-k logits, then the softmax over those k (Mixtral's and
      Qwen3's normalized top-k; with ``top_k=1`` the prob is 1 and the router gets no gradient
      through it: a load-balancing loss is what trains it then);
    * ``score="sigmoid"`` (DeepSeek-V3's): sigmoid scores, the top-k of ``scores + expert_bias``
      (``[E]``, selection only: the aux-loss-free balancing bias), normalized to sum 1 when
      ``top_k > 1``.

    The probs are float32 (float64 for float64 logits): Megatron computes them so, then casts
    them to the logits' dtype; ours go to the experts as they are. Differentiable in the logits."""
    probs, indices = _topk_router(logits, expert_bias, top_k, score)
    return probs, indices


def load_balancing_loss(
    logits: torch.Tensor, indices: torch.Tensor, score: str = "softmax", coeff: float = 1.0
) -> torch.Tensor:
    """The Switch Transformer's load-balancing loss as Megatron computes it on one rank
    (``switch_load_balancing_loss_func`` on ``compute_routing_scores_for_aux_loss``'s scores):
    ``coeff * E * sum_e f_e * P_e``, with ``f_e`` the fraction of the ``T * k`` routed rows
    that go to expert ``e`` (counted, no gradient) and ``P_e`` the mean over tokens of the
    router's full score for ``e`` (softmax over all experts; for ``"sigmoid"``, the sigmoid
    scores normalized over all experts). Differentiable in the logits."""
    check_logits(logits, "load_balancing_loss")
    T, E = logits.shape
    _check_routing("load_balancing_loss", indices, None, E, logits, "the logits'")
    check_router(indices.shape[-1], score, E, "load_balancing_loss")
    if score == "softmax":
        scores = torch.softmax(logits, dim=-1, dtype=torch.promote_types(logits.dtype, torch.float32))
    else:
        scores = torch.sigmoid(logits.to(torch.promote_types(logits.dtype, torch.float32)))
        scores = scores / (scores.sum(-1, keepdim=True) + 1e-20)
    flat = indices.reshape(-1).to(torch.int64)
    counts = torch.zeros(E, dtype=scores.dtype, device=logits.device).index_add_(
        0, flat, torch.ones_like(flat, dtype=scores.dtype)
    )
    if T == 0:  # no tokens, no imbalance (a graph kept to the logits, as for any T)
        return scores.sum() * 0.0
    return (scores.sum(0) * counts).sum() * (E * coeff / (indices.shape[-1] * T * T))


@residuals
class MoEResiduals:
    router: Any = saved()  # the router GEMM's LinearResiduals (saves x)
    topk: Any = saved()  # TopkResiduals (the probs, indices: [T, k] each)
    dispatch: Any = saved()  # DispatchResiduals (the order)
    experts: Any = saved()  # GroupedMLPResiduals (the sorted rows, fc1's output)
    combine: Any = saved()  # CombineResiduals (the order again, the same tensor)
    to_experts: Any = saved()  # with expert parallelism, the exchange's ExchangeResiduals (else None)
    from_experts: Any = saved()  # and the way back's
    rows_from_x: bool = False  # fc1's rows are not kept: gathered again from the router's x (NOTE: [Rows from x])


def moe_layer_fwd(
    x,
    router_weight,
    w1,
    w2,
    top_k: int,
    score: str = "softmax",
    activation: str = "swiglu",
    save="default",
    backend=None,
    group=None,
):
    """``(y [T, H], residuals)``: router GEMM, :func:`topk_router`, :func:`dispatch`, (with an
    expert-parallel ``group``: :func:`functional_dw.moe_ep.to_experts`), the experts
    (:func:`functional_dw.grouped_mlp` weighted by the sorted probs), (``from_experts``),
    :func:`combine`, each by its own pure ``*_fwd``; the record nests theirs."""
    check_local_experts(w1, router_weight.shape[0], group)
    logits, r_router = linear_fwd(x, router_weight, backend=backend)
    (probs, indices), r_topk = topk_router_fwd(logits, None, top_k, score)
    (rows, probs_r, splits, order), r_dispatch = dispatch_fwd(x, probs, indices, router_weight.shape[0])
    r_to = r_from = None
    if group is not None:
        (rows, probs_r, splits, perm, sizes), r_to = to_experts_fwd(rows, probs_r, splits, group)
    h, r_experts = grouped_mlp_fwd(
        rows, w1, w2, splits, probs=probs_r, activation=activation, save=save, backend=backend
    )
    if group is not None:
        h, r_from = from_experts_fwd(h, perm, sizes, group)
    y, r_combine = combine_fwd(h, order, top_k)
    rows_from_x = group is None and r_experts.fc1.x_TK is rows  # NOTE: [Rows from x]
    if rows_from_x:
        r_experts = dataclasses.replace(r_experts, fc1=dataclasses.replace(r_experts.fc1, x_TK=None, x_version=None))
    return y, MoEResiduals(r_router, r_topk, r_dispatch, r_experts, r_combine, r_to, r_from, rows_from_x)


# NOTE: [Rows from x] The experts' fc1 keeps its input for its wgrad: the dispatch's rows, k
#   gathered copies of x, which the router's GEMM also keeps. The one node keeps x alone and
#   gathers the rows again in backward (``x[order // k]``: exact, so the same bits), saving
#   ``k * H`` elements per token. Not with expert parallelism (the rows came from other ranks)
#   nor with FP8 (fc1 keeps its FP8 copy, not the rows).
def _experts_record(res: MoEResiduals) -> Any:
    """The experts' record as backward reads it: with fc1's rows gathered again (NOTE: [Rows from x])."""
    if not res.rows_from_x:
        return res.experts
    rows = res.router.x.index_select(0, tokens(res.dispatch.order, res.dispatch.top_k))
    return dataclasses.replace(res.experts, fc1=dataclasses.replace(res.experts.fc1, x_TK=rows))


def _inputs(res: MoEResiduals) -> tuple:
    """The layer's inputs its saved intermediates were computed from (x, the router's and the
    experts' weights): with a graph back to none of them, a backward differentiated in any of
    them would miss terms."""
    e = res.experts
    return (res.router.x, res.router.weight, *e.fc1.weights, *e.fc2.weights)


def moe_layer_bwd(res: MoEResiduals, dy: torch.Tensor) -> tuple:
    """(dx, d_router_weight, dw1, dw2): each part's ``*_bwd`` in reverse, x's two grads summed."""
    if differentiated(dy, _inputs(res), below=False):
        raise NotImplementedError(
            "moe_layer: " + _NOT_TWICE.format(how=" (create_graph=True, grad of grad, jacrev of jacrev)")
        )
    d_h, _ = combine_bwd(res.combine, dy)
    if res.from_experts is not None:
        d_h = from_experts_bwd(res.from_experts, d_h)[0]
    g = grouped_mlp_bwd(_experts_record(res), d_h)
    d_rows, d_probs_r = g.dx, g.dprobs
    if res.to_experts is not None:
        d_rows, d_probs_r, _ = to_experts_bwd(res.to_experts, (d_rows, d_probs_r, None, None, None))
    dx_rows, d_probs, _ = dispatch_bwd(res.dispatch, (d_rows, d_probs_r))
    d_logits, _ = topk_router_bwd(res.topk, (d_probs, None))
    dx_router, d_wr, _ = linear_bwd(res.router, d_logits)
    return refused_later("moe_layer", _NOT_TWICE, (dx_rows + dx_router, d_wr, g.dw1, g.dw2), (dy, *_inputs(res)))


_NOT_TWICE = (  # ({how}: what differentiates it)
    "a backward through the one-node layer cannot be differentiated again{how}: the rows it saved carry no "
    "graph back to x and the router, so second-order terms would be silently missing. Run the parts as "
    "separate ops (fd.nn.MoE, or moe.topk_router, moe.dispatch, fd.grouped_mlp and moe.combine), which "
    "differentiate twice"
)


_moe_layer = custom_vjp(moe_layer_fwd, moe_layer_bwd, nondiff_argnums=(4, 5, 6, 7, 8, 9), name="moe_layer")


def moe_layer(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    w1: Any,
    w2: Any,
    top_k: int,
    *,
    score: str = "softmax",
    activation: str = "swiglu",
    save: str = "default",
    backend: Any = None,
    group: Any = None,
) -> torch.Tensor:
    """One MoE layer, router to combine: ``y_t = sum_j p_tj * MLP_{e_tj}(x_t)`` for ``x [T, H]``,
    as one autograd node (:func:`moe_layer_fwd`, :func:`moe_layer_bwd`).

    ``group``: an expert-parallel process group of ``P`` ranks (None: every expert here). Each
    rank then holds ``E / P`` experts (``w1``/``w2``: rank ``p``'s are experts ``p * E / P`` on)
    and its own tokens; the router weight is every rank's the same ``[E, H]``. The result is
    bitwise what one rank holding every rank's tokens and every expert computes, wherever the
    router's GEMM rounds a token's logits alike at both batch sizes (``functional_dw/moe_ep.py``).
    Its backward cannot be differentiated again (refused); the parts' ops (:class:`nn.MoE`) can.
    Under ``torch.autocast`` and ``torch.compile`` it runs as those parts (NOTE: [The MoE layer
    as its parts]).

    ``router_weight [E, H]`` (its GEMM by :func:`functional_dw.linear`'s pair: the weight stays
    out of saved-tensor hooks), ``w1``/``w2`` the experts' weights as for
    :func:`functional_dw.grouped_mlp`, ``score``/``top_k`` as for :func:`topk_router`. No host
    sync on CUDA: the splits stay on the device."""
    check_local_experts(w1, router_weight.shape[0], group)  # (before the branch: dynamo reruns a frame that raised)
    if torch.compiler.is_compiling() or _amp.dtype(x) is not None:  # NOTE: [The MoE layer as its parts]

        def experts(x, splits, probs_r, rows=None, combine=False):
            return grouped_mlp(
                x,
                w1,
                w2,
                splits,
                probs=probs_r,
                activation=activation,
                save=save,
                backend=backend,
                rows=rows,
                combine=combine,
            )

        logits = linear(x, router_weight, backend=backend)
        return layer_parts(x, logits, experts, top_k, score, router_weight.shape[0], group)
    return _moe_layer(x, router_weight, w1, w2, top_k, score, activation, save, backend, group)


def layer_parts(
    x: torch.Tensor, logits: torch.Tensor, experts: Any, top_k: int, score: str, num_experts: int, group: Any = None
) -> torch.Tensor:
    """The layer after the router's GEMM as its parts' own autograd ops (what :class:`nn.MoE`
    and a compiled :func:`moe_layer` run): :func:`topk_router`, the routing, the experts,
    :func:`combine`. Without a ``group`` :func:`sort_by_expert` (no rows gathered) and the experts
    read x through its order and combine their rows themselves:
    ``experts(x, splits, probs_r, rows=TopkRows(order, top_k), combine=True) -> y [T, H]``
    (grouped_mlp's rows and combine: bitwise the dispatch and the combine around the experts;
    fc1 keeps x, not the rows, and with RowwiseScaling x's and dy's FP8 copies are read through
    the order); with an expert-parallel ``group``, :func:`dispatch`, ``moe_ep.to_experts``,
    ``experts(rows, splits, probs_r)`` on the exchanged rows, ``from_experts``."""
    probs, indices = topk_router(logits, top_k, score)
    if group is None:
        probs_r, splits, order = sort_by_expert(probs, indices, num_experts)
        return experts(x, splits, probs_r, rows=TopkRows(order, top_k), combine=True)
    rows, probs_r, splits, order = dispatch(x, probs, indices, num_experts)
    rows, probs_r, splits, perm, sizes = to_experts(rows, probs_r, splits, group)
    return combine(from_experts(experts(rows, splits, probs_r), perm, sizes, group), order, top_k)


# NOTE: [The MoE layer as its parts]
#   Dynamo (2.11 and 2.13) fails inside the one Function of the whole layer ("Placeholder node
#   not found in env"), while each part's own Function traces. So a compiled call runs the
#   parts as five autograd ops (the router GEMM, topk_router, the routing, the experts, the
#   combine: :func:`layer_parts`): the same pure functions, hence the same numbers; eagerly the
#   layer is one node (its host cost is one bridge, not five). Under ``torch.autocast`` the
#   parts run too, eagerly as compiled: each differentiable part casts as every layer does
#   (NOTE: [Autocast] in ``_amp.py``: the router's GEMM and the experts in the autocast dtype),
#   where the one node's pure functions compute in the dtypes given.
