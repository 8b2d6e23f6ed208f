"""Expert parallelism: the dispatch's rows to the ranks that own their experts and back, as
pure pairs over ``torch.distributed`` (``all_to_all_single``).

Legend: ``P`` ranks in the expert-parallel group, ``E`` experts in all, ``E_l = E / P`` on each
rank (rank ``p`` owns experts ``[p * E_l, (p + 1) * E_l)``), ``R`` rows this rank's dispatch
made (its tokens times top-k), ``R_l`` rows its experts receive.

:func:`to_experts` takes the dispatch's output (rows sorted by global expert, so each
destination rank's rows are one contiguous block) and returns the rows this rank's experts
run, sorted by local expert, stably: within an expert, by source rank, then as the source's
dispatch had them (token order). That is the order one rank holding every token (the ranks'
tokens concatenated) and every expert would give, so the experts see the same rows in the same
order: the exchange itself is exact, and the layer's output, x's gradient and each expert's
weight gradient are bitwise those of one rank wherever the router's GEMM gives a token's logits
the same bits in a batch of T rows as in one of P * T (a BLAS kernel chosen by the row count may
round differently; on the CPU at 1-3 rows it does, by an ulp). :func:`from_experts` sends the experts' output rows back, in the dispatch's
order, for :func:`functional_dw.moe.combine`. Each backward is the other direction's exchange.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ._checks import values_free
from .custom_vjp import custom_vjp
from .kernels import triton_tokens
from .residuals import residuals, saved

__all__ = [
    "ExchangeResiduals",
    "check_local_experts",
    "local_experts",
    "to_experts",
    "to_experts_fwd",
    "to_experts_bwd",
]
__all__ += ["from_experts", "from_experts_fwd", "from_experts_bwd"]


# NOTE: [The exchange reads the counts on the host] ``all_to_all_single`` with uneven blocks
#   needs each block's size on the host. The per-expert counts are exchanged on the device
#   (one ``all_to_all_single`` of ``E`` int64s), then read once per layer call (one sync on
#   CUDA, as Megatron's dropless all-to-all dispatcher does): the sizes of the row exchange in
#   both directions, forward and backward, come from that one read. A sync-free exchange needs
#   a fixed capacity per rank (padded blocks, overflow dropped or refused); not built.


@residuals
class ExchangeResiduals:
    """The route of one exchange: the local sort on the device, the block sizes on the host."""

    perm: torch.Tensor = saved()  # [R_l] int64: the received row each of the experts' rows is
    send_sizes: list  # rows this rank's dispatch sends to each rank (host ints)
    recv_sizes: list  # rows its experts receive from each rank (host ints)
    group: Any  # the expert-parallel process group (by reference)


def local_experts(num_experts: int, group: Any) -> int:
    """``E_l``: the experts each rank of ``group`` owns (``num_experts`` must divide evenly)."""
    P = dist.get_world_size(group)
    if type(num_experts) is not int or num_experts < 1 or num_experts % P:
        raise ValueError(
            f"expert parallelism: num_experts ({num_experts!r}) must be a positive multiple of the group's {P} ranks"
        )
    return num_experts // P


def check_local_experts(w1: Any, num_experts: int, group: Any) -> None:
    """ValueError unless ``w1`` (a list or one stacked tensor) holds this rank's ``E / P`` experts
    (without a ``group``: all ``E``, one per row of the router's weight)."""
    E_l = num_experts if group is None else local_experts(num_experts, group)
    have = len(w1) if isinstance(w1, (list, tuple)) else w1.shape[0] if isinstance(w1, torch.Tensor) else None
    if have is not None and have != E_l:
        where = (
            ""
            if group is None
            else f"; with an expert-parallel group of {dist.get_world_size(group)} ranks each rank holds {E_l} "
            f"(rank p: experts p * {E_l} on)"
        )
        raise ValueError(
            f"moe_layer: the router's weight [E, H] routes to E = {num_experts} experts{where}, so w1 must hold "
            f"{E_l} experts; it holds {have}"
        )


def _exchange(t: torch.Tensor, out_sizes: list, in_sizes: list, group: Any) -> torch.Tensor:
    """``t``'s row blocks (``in_sizes``, one per rank) to the ranks; the blocks received (``out_sizes``)."""
    out = t.new_empty((sum(out_sizes), *t.shape[1:]))
    dist.all_to_all_single(out, t.contiguous(), out_sizes, in_sizes, group=group)
    return out


def inverse(perm: torch.Tensor) -> torch.Tensor:
    """``inv`` with ``inv[perm[i]] = i``: where each row went (zeros where ``perm`` is not a
    permutation: wrong rows, never a read of memory nothing wrote). The dispatch's ``order`` and
    the exchange's ``perm`` are undone by it."""
    return torch.zeros_like(perm).scatter_(0, perm, torch.arange(perm.numel(), device=perm.device, dtype=perm.dtype))


def tokens(order: torch.Tensor, top_k: int) -> torch.Tensor:
    """``order // top_k``: the token of each of the dispatch's sorted rows (``order`` holds the
    flat ``token * k + choice`` pairs); ``t.index_select(0, tokens(order, k))`` gathers the
    rows, :func:`token_sum` sums them back."""
    return torch.div(order, top_k, rounding_mode="floor")


def token_sum(rows: torch.Tensor, order: torch.Tensor, top_k: int) -> torch.Tensor:
    """``[T, ...]``: each token's ``k`` rows (sorted by the dispatch's ``order``) summed in choice
    order, the adds in float32 (float64 stays float64) and rounded once to rows' dtype: the
    deterministic sum the dispatch's backward, the combine and grouped_mlp's ``TopkRows`` take.
    On CUDA, where nothing records it (``triton_tokens.available``), one Triton launch reads the
    rows through the order and adds in the same order (no ``[T * k, H]`` copy in token order);
    elsewhere torch ops: the same bits."""
    # (the kernel reads by these: checked on the host)
    if type(top_k) is not int or top_k < 1:
        raise ValueError(f"token_sum: top_k must be a positive int (each token's choices), got {top_k!r}")
    if order.shape != rows.shape[:1] or rows.shape[0] % top_k:
        raise ValueError(
            f"token_sum: order {tuple(order.shape)} must hold one entry per row of rows {tuple(rows.shape)}, "
            f"whose count top_k={top_k} divides"
        )
    if order.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"token_sum: order must be int64 or int32 (the dispatch's), got {order.dtype}")
    if order.device != rows.device:
        raise ValueError(f"token_sum: order is on {order.device} and rows on {rows.device}: move order to rows' device")
    pos = inverse(order)
    if triton_tokens.available(rows):
        return triton_tokens.token_sum(rows, pos, top_k)
    per = rows.index_select(0, pos).unflatten(0, (-1, top_k))
    acc = per[:, 0].to(torch.promote_types(rows.dtype, torch.float32))
    for j in range(1, top_k):
        acc = acc + per[:, j]
    return acc.to(rows.dtype)


def check_permutation(perm: torch.Tensor, message: str) -> None:
    """``ValueError(message)`` unless ``perm`` is a permutation of its positions, where that is
    free to check: a CPU tensor in eager code (on CUDA a sync; on meta, fake or while compiling no values)."""
    if not values_free(perm) or not perm.numel():
        return
    if not torch.equal(perm.sort().values, torch.arange(perm.numel())):
        raise ValueError(message)


def _back(res: ExchangeResiduals, t: torch.Tensor) -> torch.Tensor:
    """Rows in this rank's experts' order to their source ranks, in the sources' dispatch order."""
    return _exchange(t.index_select(0, inverse(res.perm)), res.send_sizes, res.recv_sizes, res.group)


def _forth(res: ExchangeResiduals, t: torch.Tensor) -> torch.Tensor:
    """Rows in the dispatch's order to the experts' ranks, in the experts' order."""
    return _exchange(t, res.recv_sizes, res.send_sizes, res.group).index_select(0, res.perm)


# NOTE: [A backward through the exchange differentiates again] Each direction's backward is the
#   other direction, run as an autograd op (:func:`_moved`: ``_back_op``/``_forth_op``, each the
#   other's backward), so under ``create_graph=True`` (a gradient penalty, grad of grad) the
#   exchange in backward is recorded and a second-order gradient reaches every rank's tokens and
#   experts. Without a gradient to take it runs the plain exchange.
def _back_fwd(t: torch.Tensor, perm: torch.Tensor, send: list, recv: list, group: Any):
    res = ExchangeResiduals(perm, send, recv, group)
    return _back(res, t), res


def _forth_fwd(t: torch.Tensor, perm: torch.Tensor, send: list, recv: list, group: Any):
    res = ExchangeResiduals(perm, send, recv, group)
    return _forth(res, t), res


def _back_bwd(res: ExchangeResiduals, d: torch.Tensor) -> tuple:
    return _moved(d, res, back=False), None


def _forth_bwd(res: ExchangeResiduals, d: torch.Tensor) -> tuple:
    return _moved(d, res, back=True), None


_back_op = custom_vjp(_back_fwd, _back_bwd, nondiff_argnums=(2, 3, 4), name="moe_exchange_back")
_forth_op = custom_vjp(_forth_fwd, _forth_bwd, nondiff_argnums=(2, 3, 4), name="moe_exchange_forth")


def _moved(t: Any, res: ExchangeResiduals, back: bool) -> Any:
    """:func:`_back` (``back``) or :func:`_forth` of ``t`` along ``res``'s route (None: None),
    differentiable (NOTE: [A backward through the exchange differentiates again])."""
    op = _back_op if back else _forth_op
    return None if t is None else op(t, res.perm, res.send_sizes, res.recv_sizes, res.group)


def _route(splits: torch.Tensor, rows: int, group: Any) -> tuple[ExchangeResiduals, torch.Tensor]:
    """The route of the dispatch's ``splits [E]`` over ``group``, and this rank's ``splits_l [E_l]``."""
    if not isinstance(splits, torch.Tensor) or splits.dim() != 1 or splits.dtype != torch.int64:
        raise TypeError("to_experts: splits must be the dispatch's [E] int64 splits tensor")
    P = dist.get_world_size(group)
    E_l = local_experts(splits.shape[0], group)
    recv_splits = torch.empty_like(splits)  # from rank q, for local expert j: at q * E_l + j
    dist.all_to_all_single(recv_splits, splits.contiguous(), group=group)
    # NOTE: [The exchange reads the counts on the host]
    counts = torch.cat([splits.view(P, E_l).sum(1), recv_splits]).tolist()
    send_sizes, per_expert = counts[:P], counts[P:]
    if sum(send_sizes) != rows:
        raise ValueError(
            f"to_experts: splits count {sum(send_sizes)} rows but rows has {rows}: give the dispatch's rows and splits"
        )
    recv_sizes = [sum(per_expert[q * E_l : (q + 1) * E_l]) for q in range(P)]
    expert = torch.arange(E_l, device=splits.device).repeat(P)
    key = torch.repeat_interleave(expert, recv_splits, output_size=sum(recv_sizes))
    perm = torch.argsort(key, stable=True)  # the received (source, expert) order -> (expert, source)
    return ExchangeResiduals(perm, send_sizes, recv_sizes, group), recv_splits.view(P, E_l).sum(0)


def to_experts_fwd(rows: torch.Tensor, probs_r: torch.Tensor | None, splits: torch.Tensor, group: Any):
    """``((rows_l [R_l, H], probs_l [R_l] (with probs), splits_l [E_l], perm [R_l], sizes [2, P]),
    residuals)``: this rank's dispatch output (rows sorted by global expert, ``splits [E]``)
    exchanged so that each rank holds its own experts' rows, sorted by local expert. ``perm``
    and ``sizes`` (int64; sizes on the CPU: rows sent to, received from each rank) are the
    route :func:`from_experts` takes back."""
    if not isinstance(rows, torch.Tensor) or rows.dim() != 2:
        raise TypeError(f"to_experts: rows must be the dispatch's [R, H] rows, got {type(rows).__name__}")
    if probs_r is not None and (not isinstance(probs_r, torch.Tensor) or probs_r.shape != rows.shape[:1]):
        raise ValueError(f"to_experts: probs_r must be None or the dispatch's [{rows.shape[0]}] probs")
    res, splits_l = _route(splits, rows.shape[0], group)
    sizes = torch.tensor([res.send_sizes, res.recv_sizes], dtype=torch.int64)
    rows_l = _forth(res, rows)
    if probs_r is None:
        return (rows_l, splits_l, res.perm, sizes), res
    return (rows_l, _forth(res, probs_r), splits_l, res.perm, sizes), res


def to_experts_bwd(res: ExchangeResiduals, d_out: tuple) -> tuple:
    """(d_rows, d_probs_r, None for the splits): the gradients sent back to their rows' ranks."""
    d_rows, d_probs = d_out[0], (d_out[1] if len(d_out) == 5 else None)
    return _moved(d_rows, res, back=True), _moved(d_probs, res, back=True), None


def from_experts_fwd(out_l: torch.Tensor, perm: torch.Tensor, sizes: torch.Tensor, group: Any):
    """The experts' output rows back to their tokens' ranks, in the dispatch's order."""
    if not isinstance(sizes, torch.Tensor) or sizes.device.type != "cpu" or sizes.dim() != 2 or sizes.shape[0] != 2:
        raise ValueError("from_experts: perm and sizes must be to_experts' route outputs (sizes: [2, P] on the CPU)")
    if not isinstance(perm, torch.Tensor) or perm.dtype != torch.int64 or perm.dim() != 1:
        raise ValueError("from_experts: perm must be to_experts' [R_l] int64 perm")
    send, recv = sizes.tolist()
    if (
        len(send) != dist.get_world_size(group)
        or min(send + recv) < 0
        or out_l.shape[0] != perm.shape[0]
        or sum(recv) != perm.shape[0]
    ):
        raise ValueError(
            f"from_experts: {out_l.shape[0]} rows for a route of {perm.shape[0]} rows, sizes {send} / {recv}: "
            "give the rows of this rank's experts, in to_experts' order, with its perm and sizes"
        )
    check_permutation(perm, "from_experts: perm must be a permutation (to_experts' fourth output)")
    res = ExchangeResiduals(perm, send, recv, group)
    return _back(res, out_l), res


def from_experts_bwd(res: ExchangeResiduals, dy: torch.Tensor) -> tuple:
    """(d_out_l, None, None): dy sent to the experts' ranks, in the experts' order."""
    return _moved(dy, res, back=False), None, None


_to_experts = custom_vjp(to_experts_fwd, to_experts_bwd, nondiff_argnums=(3,), name="to_experts")
_from_experts = custom_vjp(from_experts_fwd, from_experts_bwd, nondiff_argnums=(3,), name="from_experts")


_NO_COMPILE = "expert parallelism reads the exchanged counts on the host and runs collectives of data-dependent sizes"


@torch.compiler.disable(reason=_NO_COMPILE)
def to_experts(rows: torch.Tensor, probs_r: torch.Tensor | None, splits: torch.Tensor, group: Any) -> tuple:
    """``(rows_l, probs_l or None, splits_l, perm, sizes)``: :func:`functional_dw.moe.dispatch`'s
    rows, probs and splits exchanged over the expert-parallel ``group`` so that this rank holds
    the rows of its own ``E / P`` experts, sorted by local expert (feed ``rows_l``, ``splits_l``
    and ``probs_l`` to this rank's experts); ``perm`` and ``sizes`` feed :func:`from_experts`.
    Differentiable in rows and probs, twice (a backward through it can be differentiated). One
    host read of the exchanged counts per call (NOTE: [The exchange reads the counts on the
    host]); under torch.compile it runs eagerly (a graph break). Every rank of the group calls
    it, in the same order, and so do their backwards."""
    out = _to_experts(rows, probs_r, splits, group)
    return out if probs_r is not None else (out[0], None, *out[1:])


@torch.compiler.disable(reason=_NO_COMPILE)
def from_experts(out_l: torch.Tensor, perm: torch.Tensor, sizes: torch.Tensor, group: Any) -> torch.Tensor:
    """The experts' output rows (``[R_l, H]``, in :func:`to_experts`' order) back to the ranks
    their tokens came from: ``[R, H]`` in the dispatch's order, for :func:`functional_dw.moe.combine`.
    Differentiable in ``out_l``."""
    return _from_experts(out_l, perm, sizes, group)
