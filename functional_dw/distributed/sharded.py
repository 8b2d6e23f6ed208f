"""ShardedWeight: this rank's rows of a weight (ZeRO-3 / FSDP style), a DistributedWeight that
gathers its group's full weights for the GEMMs and reduce-scatters their grads, one collective
per group, with prefetch along the layers' order and an optional async reduce-scatter.

Layout. An ``[N, K]`` (``[out, in]``) weight is sharded along dim 0 (out features) in blocks
of ``R = ceil(N / W)`` rows (``W`` ranks): rank ``r`` holds rows ``[r*R, min((r+1)*R, N))``, so
the last ranks may hold fewer rows, or none (N=5, W=4: 2, 2, 1, 0 rows). A group of E experts
talks through one flat rank-major buffer ``[W, E, R, K]`` (zero rows pad each shard to R), so
rank r's part is the contiguous slab ``[r]`` and ONE collective serves the whole group (NOTE:
[One collective per group])::

    materialize (forward, backward)  all_gather     [E, R, K] -> [W, E, R, K] -> E x [N, K]
    finalize_group_grads             reduce_scatter [W, E, R, K] (SUM) -> [E, R, K] -> E shard grads
"""

from __future__ import annotations

import threading
import warnings
import weakref
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any, Callable

import torch
import torch.distributed as dist

__all__ = [
    "ShardedWeight",
    "shard_grouped_weights",
    "shard_weight",
    "set_prefetch_order",
    "prefetch_for_backward",
    "prefetch_on_grad",
    "wait_for_grads",
]


def _collective(new: str, old: str) -> Callable:
    # NOTE: torch 2.13 deprecates all_gather_into_tensor / reduce_scatter_tensor in favour of
    # the *_single names (which older torch lacks). Looked up per call so tests can count them.
    return getattr(dist, new, None) or getattr(dist, old)


# NOTE: [One collective per group] A group's all-gather and reduce-scatter are one collective
# each on a rank-major [W, E, R, K] buffer, so rank r's part is one contiguous slab. One
# collective per expert, coalesced (one NCCL launch, and no pack, unpack or transpose copies),
# was measured and dropped: each expert's op costs the host 16-20 us to issue (H200, torch 2.11:
# a group's coalesced all-gather 0.21 ms at E=8, 2.0 ms at E=128, against one all-gather of the
# same bytes 0.07 / 0.66 ms), and the steps at these shapes are bound by the host. The copies
# are device work instead: the pack (one cat) before the all-gather, the unpack after it on a
# side stream (CUDA), off the compute stream (NOTE: [Prefetch order]), and the reduce-scatter's
# transpose (one copy).
_SIDE: dict[torch.device, Any] = {}


def _side_stream(device: torch.device) -> Any:
    if device not in _SIDE:
        _SIDE[device] = torch.cuda.Stream(device)
    return _SIDE[device]


class _Gathered:
    """An all-gather started for a group: what to wait on, the gathered weights ``[E, W*R, K]``
    (written by the side stream's unpack on CUDA, or after the wait elsewhere), the members'
    versions it read, and what must live until it is waited on. ``kept``: held from a forward
    for its backward (reshard_after_forward=False)."""

    def __init__(self, g: _Group):
        m0 = g.members[0].detach()
        if g.E == 1 and g.rows == g.R and m0.is_contiguous():
            slab = m0.view(1, g.R, g.K)  # Linear, even split: no copy
        else:
            slab = _stacked_rows(g.members, g.R)
        out = slab.new_empty(g.world, g.E, g.R, g.K)
        g.stats["all_gather"] += 1
        self.versions, self.kept, self.event = g.versions(), False, None
        self.chain: tuple | None = None  # (chain, n): issued by set_prefetch_order at that materialize
        self.work = _collective("all_gather_single", "all_gather_into_tensor")(
            out.view(-1), slab.view(-1), group=g.pg, async_op=True
        )  # 1-D: what every backend takes
        self.slab, self.out, self.full = slab, out, None
        if out.is_cuda and g.E > 1 and not torch.cuda.is_current_stream_capturing():
            # unpack on the side stream as soon as the gather lands (in a CUDA graph capture:
            # at the first use, on the capturing stream, which the graph then orders itself)
            side, here = _side_stream(out.device), torch.cuda.current_stream(out.device)
            side.wait_stream(here)  # out and full's memory is the compute stream's until here
            with torch.cuda.stream(side):
                self.work.wait()
                self.full = _unpack(out)
                self.event = side.record_event()
            out.record_stream(side)  # freed unwaited (a stale prefetch): not reused before the copy ends

    def weights(self, N: int) -> list[torch.Tensor]:
        if self.event is not None:
            here = torch.cuda.current_stream(self.full.device)
            here.wait_event(self.event)
            self.full.record_stream(here)
        else:
            self.work.wait()  # NCCL: the current stream waits on the collective's stream (an event)
            if self.full is None:
                self.full = _unpack(self.out)
        self.slab = self.out = None
        return list((self.full if self.full.shape[1] == N else self.full[:, :N]).unbind(0))


def _stacked_rows(ts: Sequence[torch.Tensor], rows: int) -> torch.Tensor:
    """E ``[n, K]`` tensors as one ``[E, rows, K]`` block, zero rows after n (the collectives'
    padding; one stack, and one pad where n < rows)."""
    with torch.no_grad():  # (parameters stacked as they are: no E detaches on the host)
        t = torch.stack(list(ts))
    return t if t.shape[1] == rows else torch.nn.functional.pad(t, (0, 0, 0, rows - t.shape[1]))


def _unpack(out_WERK: torch.Tensor) -> torch.Tensor:
    # [W, E, R, K] -> [E, W*R, K]: a view for E == 1, one copy for a group (each expert's full
    # weight must be one contiguous [N, K] block for the GEMMs)
    W, E, R, K = out_WERK.shape
    return out_WERK.transpose(0, 1).reshape(E, W * R, K)


class _Group:
    """What a group of ShardedWeights shares: the process group, the layout, the collectives
    in flight, and the fused-wgrad buffer while a backward runs."""

    def __init__(self, fulls: list[torch.Tensor], pg: Any, async_grads: bool, reshard_after_forward: bool):
        self.pg, self.async_grads, self.reshard_after_forward = pg, async_grads, reshard_after_forward
        self.world, self.rank = dist.get_world_size(pg), dist.get_rank(pg)
        self.E, (self.N, self.K) = len(fulls), fulls[0].shape
        self.R = -(-self.N // self.world)
        self.rows = max(0, min(self.R, self.N - self.rank * self.R))
        self.members: list[ShardedWeight] = []
        self.ready: _Gathered | None = None  # an all-gather started early (prefetch) or kept from forward
        self.prefetch_next: dict[str, _Group] = {}  # "forward"/"backward" -> the group to prefetch then
        self.grad_buf: torch.Tensor | None = None  # [E, W*R, K] fp32, from grad_buffer() to finalize
        self.pending: list[tuple] = []  # async reduce-scatters: (task, work, out, fused, targets, inputs)
        self.stats: Counter = Counter()  # collectives issued: all_gather, reduce_scatter

    def versions(self) -> tuple[int, ...]:
        return tuple(m._version for m in self.members)

    def gather(self) -> _Gathered:
        """Start the group's all-gather (async; NOTE: [One collective per group])."""
        return _Gathered(self)

    def prefetch(self) -> None:
        """Start the all-gather now unless one of the current shards is already under way."""
        if self.ready is None or self.ready.versions != self.versions():
            self.ready = self.gather()

    def materialize(self, phase: str) -> list[torch.Tensor]:
        # NOTE: [Prefetch order] This group's own all-gather is issued (or was, by a prefetch)
        # before the next group's, and both before this layer's GEMMs are queued: on the
        # communication stream the next layer's gather then runs while this layer computes.
        # A gather waits for the compute stream as it was when it was issued, so it must be
        # issued early; issued at the next layer's own materialize it would queue behind these
        # GEMMs and hide nothing (what ShardedWeight did before set_prefetch_order).
        # No gather may outlive a step: an update that bumps no version (.data, fused AdamW)
        # would go unseen. So a prefetch of set_prefetch_order serves only the very next
        # materialize of its chain (this thread, this backward or none), else it is dropped;
        # weights kept from a forward, and prefetch_for_backward's gathers, serve only this
        # group's backward (a forward drops them); a forward recomputed inside a backward
        # prefetches nothing. Each decision depends on this rank's own order
        # of calls only, never on timing, so every rank issues the same collectives.
        chain, n = _chain_step()
        task = chain[1]
        if phase == "forward" and task == -1:  # (not a forward recomputed inside a backward, maybe nested)
            self.drop_pending(lambda t: t != -1)  # left by a backward that raised: never delivered
            # this thread's backward chains are over (on the CPU backward runs on the caller's
            # thread; a failed one's end callback never ran)
            _forget_chains(lambda c: c[0] == chain[0] and c[1] != -1)
        r = self.ready  # a forward takes only its chain's prefetch; a backward also kept and explicit ones
        if r is not None and (
            r.chain != (chain, n - 1) if phase == "forward" else r.chain not in (None, (chain, n - 1))
        ):
            self.ready = None
        self.prefetch()
        ready, self.ready = self.ready, None
        nxt = self.prefetch_next.get(phase)
        if nxt is not None and nxt is not self and (phase == "backward" or task == -1):
            if not (phase == "backward" and nxt.ready is not None and nxt.ready.kept):
                nxt.ready = nxt.gather()
                nxt.ready.chain = (chain, n)
        _at_end_of_backward(task)  # (any materialize inside a backward: its chain is forgotten at its end)
        weights = ready.weights(self.N)
        if phase == "forward" and not self.reshard_after_forward:
            ready.kept, ready.chain, self.ready = True, None, ready  # for this group's backward
        return weights

    def reduce_scatter(self, flat_EPK: torch.Tensor, fused: bool) -> list | None:
        """Reduce-scatter a padded ``[E, W*R, K]`` grad and hand each member its rows."""
        flat = flat_EPK.view(self.E, self.world, self.R, self.K).transpose(0, 1).contiguous()
        out = flat.new_empty(self.E, self.R, self.K)
        self.stats["reduce_scatter"] += 1
        work = _collective("reduce_scatter_single", "reduce_scatter_tensor")(
            out.view(-1), flat.view(-1), op=dist.ReduceOp.SUM, group=self.pg, async_op=True
        )
        if not self.async_grads:
            work.wait()
            return self.deliver(out, fused)
        task = torch._C._current_graph_task_id()
        _deliver(task)  # an earlier group's reduce-scatter in this backward (issued before this one)
        # (fused: main_grad of every member that requires grad, as TE's fused GEMM writes it)
        self.pending.append((task, work, out, fused, None if fused else self.targets(task), flat))
        _PENDING.setdefault(task, []).append(weakref.ref(self))
        _at_end_of_backward(task)
        return None  # the protocol's "async": delivered into .grad / main_grad, not returned

    def targets(self, task: int) -> list[bool]:
        """Which members take this backward's grads: those that require grad and whose grad
        the engine accumulates (not under ``torch.autograd.grad`` or ``backward(inputs=...)``
        that leave them out)."""
        if task == -1:  # finalize called outside a backward
            return [m.requires_grad for m in self.members]
        from torch.autograd.graph import get_gradient_edge

        def accumulated(m: torch.Tensor) -> bool:
            try:
                return torch._C._will_engine_execute_node(get_gradient_edge(m).node)
            except RuntimeError:  # torch.autograd.grad(loss, [m]) captures m's grad: it returns None
                return False

        return [m.requires_grad and accumulated(m) for m in self.members]

    def deliver(self, out: torch.Tensor, fused: bool, targets: list[bool] | None = None) -> list | None:
        """Hand each member its rows of the reduced grads: returned (autograd accumulates them),
        or, with ``targets`` (async, unfused), accumulated into ``.grad`` of the members it
        names; fused, added into the ``main_grad`` of members that require grad (TE's rule)."""
        shards = (out if self.rows == self.R else out[:, : self.rows]).unbind(0)
        if not fused:
            if targets is None:
                dtype = self.members[0].dtype
                return list(shards) if out.dtype == dtype else [s.to(dtype) for s in shards]
            for m, s, t in zip(self.members, shards, targets):  # async: accumulate as autograd would have
                if t:
                    m.grad = s.to(m.dtype) if m.grad is None else m.grad.add_(s.to(m.dtype))
            return None
        for m, s in zip(self.members, shards):
            if not m.requires_grad:
                continue
            if getattr(m, "main_grad", None) is None:
                m.main_grad = torch.zeros(m.shape, dtype=torch.float32, device=m.device)
            m.main_grad.add_(s)
            if hasattr(m, "grad_added_to_main_grad"):
                m.grad_added_to_main_grad = True
        # TE's rule: a zero dummy keeps DDP hooks firing where grad_added_to_main_grad exists
        return [torch.zeros_like(m) if hasattr(m, "grad_added_to_main_grad") else None for m in self.members]

    def deliver_pending(self, task: int) -> None:
        mine = [p for p in self.pending if p[0] == task]
        self.pending = [p for p in self.pending if p[0] != task]
        for _task, work, out, fused, targets, _inputs in mine:
            work.wait()
            self.deliver(out, fused, targets)

    def drop_pending(self, which: Callable[[int], bool]) -> None:
        for p in [p for p in self.pending if which(p[0])]:
            warnings.warn(
                f"functional_dw.distributed: a reduce-scatter of an earlier backward of {self.members[0]!r}'s "
                "group was never delivered (that backward raised, or runs in another thread, which "
                "async_grad_reduce does not support): its grads are dropped",
                RuntimeWarning,
                stacklevel=3,
            )
            p[1].wait()  # (its buffers are freed after the collective)
            refs = [r for r in _PENDING.get(p[0], []) if r() is not None and r() is not self]
            if refs:
                _PENDING[p[0]] = refs
            else:
                _PENDING.pop(p[0], None)
        self.pending = [p for p in self.pending if not which(p[0])]


# NOTE: [Async reduce-scatter] With async_grad_reduce, a group's reduce-scatter runs on the
# communication stream while the earlier layers' backward computes. Its grads are delivered
# (the compute stream waits on its event, then adds) when the next group's reduce-scatter in
# the same backward has been issued, and the last ones when that backward ends (an autograd
# engine callback, as FSDP's): at most two full-size grad buffers per backward are alive, and
# .grad / main_grad are complete when backward() returns. Pending work is kept per backward
# (the engine's graph task), so a nested backward (reentrant checkpointing) delivers its own,
# and a backward that raised delivers nothing: its leftovers are dropped, with a warning, at
# the group's next forward. wait_for_grads() delivers what finalize left outside a backward.
_PENDING: dict[int, list[weakref.ref]] = {}  # graph task id (-1: none) -> groups with pending reduce-scatters
_CHAINS: dict[tuple[int, int], int] = {}  # (thread, graph task) -> materialize calls so far (NOTE: [Prefetch order])


def _chain_step() -> tuple[tuple[int, int], int]:
    chain = (threading.get_ident(), torch._C._current_graph_task_id())
    n = _CHAINS[chain] = _CHAINS.get(chain, 0) + 1
    return chain, n


def _forget_chains(over: Callable[[tuple[int, int]], bool]) -> None:
    for chain in [c for c in _CHAINS if over(c)]:
        del _CHAINS[chain]


def _deliver(task: int) -> None:
    for ref in dict.fromkeys(_PENDING.pop(task, [])):
        if (g := ref()) is not None:
            g.deliver_pending(task)


def _at_end_of_backward(task: int) -> None:
    # one callback per call (per layer and backward): the first delivers, the rest find nothing;
    # no record of queued callbacks to leak when a backward raises before they run
    if task == -1:
        return

    def end() -> None:
        _deliver(task)
        _forget_chains(lambda c: c[1] == task)

    torch.autograd.Variable._execution_engine.queue_callback(end)


class ShardedWeight(torch.nn.Parameter):
    """This rank's shard ``[rows, K]`` of a full ``[N, K]`` weight (see the module docstring
    for the layout). The first member of a group (``weights[0]``) acts for the group; any
    member's method acts on the whole group."""

    is_distributed_weight = True
    _dw: _Group
    _dw_index: int

    def __new__(cls, shard: torch.Tensor, group: _Group, index: int, requires_grad: bool = True):
        self = super().__new__(cls, shard, requires_grad)
        self._dw, self._dw_index = group, index
        return self

    def __repr__(self) -> str:
        g = self._dw
        start = min(g.rank * g.R, g.N)
        return (
            f"ShardedWeight(expert {self._dw_index} of {g.E}, rank {g.rank}/{g.world}, "
            f"rows {start}:{start + g.rows} of [{g.N}, {g.K}], {self.dtype})"
        )

    def materialize_group_for_forward(self) -> list[torch.Tensor]:
        return self._dw.materialize("forward")

    def materialize_group_for_backward(self, **kwargs: Any) -> list[torch.Tensor]:
        return self._dw.materialize("backward")

    def prefetch_for_backward(self) -> None:
        """Start the group's all-gather now (async): this layer's next backward waits for it
        instead of gathering then, if the shards did not change since (else they are gathered
        again). A forward before that backward drops it (no gather outlives a step)."""
        self._dw.prefetch()

    def grad_buffer(self) -> torch.Tensor:
        g = self._dw
        if g.grad_buf is None:  # one zeroed fp32 buffer for the group, freed in finalize
            g.grad_buf = torch.zeros(g.E, g.world * g.R, g.K, dtype=torch.float32, device=self.device)
        return g.grad_buf[self._dw_index, : g.N]

    def finalize_group_grads(self, wgrads: Any) -> list | None:
        """Reduce-scatter the full weight grads: returns the shard grads; fused (after
        ``grad_buffer()``), adds them into each fp32 ``main_grad`` instead; with
        ``async_grad_reduce`` returns None and delivers them later (NOTE: [Async reduce-scatter])."""
        g = self._dw
        wgrads = list(wgrads) if isinstance(wgrads, (list, tuple)) else [wgrads]
        if len(wgrads) != g.E:
            raise ValueError(f"finalize_group_grads: got {len(wgrads)} grads for a group of {g.E}")
        w0 = wgrads[0]
        try:  # (one set, not E checks, on the host when all is well)
            ok = {(w.shape, w.dtype, w.device) for w in wgrads} == {((g.N, g.K), w0.dtype, w0.device)}
        except AttributeError:
            ok = False
        if not ok:
            for e, w in enumerate(wgrads):
                if not (
                    isinstance(w, torch.Tensor)
                    and w.shape == (g.N, g.K)
                    and w.dtype == w0.dtype
                    and w.device == w0.device
                ):
                    got = (
                        f"a {w.dtype} {tuple(w.shape)} tensor on {w.device}"
                        if isinstance(w, torch.Tensor)
                        else type(w).__name__
                    )
                    raise ValueError(
                        f"finalize_group_grads: grads[{e}] is {got}; each must be the full weight's grad, "
                        f"[{g.N}, {g.K}], all of one dtype and device as grads[0]"
                    )
        # NOTE: fused is recognised by grad_buffer() having been called since the last finalize
        # (the layer calls it only with fuse_wgrad_accumulation); the fp32 buffer is reduced in
        # fp32. Unfused grads are reduced in their own dtype (bf16 stays bf16, as in TE/FSDP).
        fused, buf = g.grad_buf is not None, g.grad_buf
        g.grad_buf = None
        if fused:
            for e, w in enumerate(wgrads):  # the GEMM wrote into the buffer; copy if it did not
                if w.data_ptr() != buf[e].data_ptr():
                    buf[e, : g.N].copy_(w)
        elif g.E == 1 and g.N == g.world * g.R:
            buf = wgrads[0].contiguous().view(1, g.N, g.K)  # Linear, even split: no copy
        else:
            buf = _stacked_rows(wgrads, g.world * g.R)
        return g.reduce_scatter(buf, fused)


def shard_grouped_weights(
    weights: Sequence[torch.Tensor] | torch.Tensor,
    group: Any = None,
    *,
    requires_grad: bool = True,
    async_grad_reduce: bool = False,
    reshard_after_forward: bool = True,
) -> list[ShardedWeight]:
    """This rank's shards of E full ``[N, K]`` weights (a list, or one ``[E, N, K]`` tensor):
    pass the result as grouped_linear's ``weights``; ``weights[0]`` leads the group.

    Every rank must pass the same full weights (e.g. made from the same seed). ``group`` is
    the process group (default: the world). Overlap (see docs/distributed.md, "Overlap"):

    - ``async_grad_reduce``: the reduce-scatter runs while the earlier layers' backward
      computes; the grads land in ``.grad`` (or ``main_grad``) by the time backward returns
      (NOTE: [Async reduce-scatter]), not through autograd: ``torch.autograd.grad(loss,
      weights)`` returns None for them, and members the engine does not accumulate (frozen,
      or left out by ``inputs=``) get nothing.
    - ``reshard_after_forward=False``: keep the forward's gathered weights for this layer's
      backward (one all-gather fewer per step; the full weights stay alive until then, or
      until the next forward after a forward under no_grad): FSDP2's choice for the last
      layer, whose backward starts right after its forward.
    - :func:`set_prefetch_order`: each layer's all-gather runs during the previous layer's
      GEMMs.
    """
    fulls = list(weights.unbind(0)) if isinstance(weights, torch.Tensor) else list(weights)
    if not fulls or any(not isinstance(w, torch.Tensor) or w.dim() != 2 for w in fulls):
        raise ValueError("weights: give one or more [out, in] tensors, or one [E, out, in] tensor")
    for e, w in enumerate(fulls):
        if w.shape != fulls[0].shape or w.dtype != fulls[0].dtype or w.device != fulls[0].device:
            raise ValueError(
                f"weights[{e}] is {w.dtype}{tuple(w.shape)} on {w.device}; every expert must match "
                f"weights[0] ({fulls[0].dtype}{tuple(fulls[0].shape)} on {fulls[0].device})"
            )
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "shard_grouped_weights needs a process group: call "
            "torch.distributed.init_process_group first (or use functional_dw.distributed.launch)"
        )
    # NOTE: out features that do not divide by the world size are padded (zero rows in the
    # collective buffers only); the parameters hold exactly this rank's rows, maybe none.
    g = _Group(fulls, group, async_grad_reduce, reshard_after_forward)
    start = g.rank * g.R
    g.members = [
        ShardedWeight(w.detach()[start : start + g.rows].clone(), g, e, requires_grad) for e, w in enumerate(fulls)
    ]
    return list(g.members)


def shard_weight(weight: torch.Tensor, group: Any = None, **kwargs: Any) -> ShardedWeight:
    """This rank's shard of one full ``[N, K]`` weight, for :func:`linear`."""
    return shard_grouped_weights([weight], group, **kwargs)[0]


def _groups(params: Iterable[torch.Tensor]) -> list[_Group]:
    out: dict[int, _Group] = {}
    for p in params:
        if isinstance(p, ShardedWeight):
            out.setdefault(id(p._dw), p._dw)
    return list(out.values())


def prefetch_for_backward(params: Iterable[torch.Tensor]) -> None:
    """Start the backward all-gather of each group among ``params`` (any members) now."""
    for g in _groups(params):
        g.members[0].prefetch_for_backward()


def set_prefetch_order(params: Iterable[torch.Tensor]) -> None:
    """Prefetch along the order the sharded layers run in. ``params``: their weights in forward
    order (``[*w1, *w2]``; ``model.parameters()`` where registration order is the run's order;
    other parameters are skipped). Each group's forward then starts the next group's
    all-gather before queuing its own GEMMs, and each group's backward the previous group's
    (NOTE: [Prefetch order]): at most two groups' gathered weights are alive at once, plus those
    kept by ``reshard_after_forward=False``. Such a prefetch serves only the next sharded layer
    to run in the same thread and backward, else it is dropped, so a wrong order costs memory
    and bandwidth, never correctness. Every rank must set the same order and run the layers in
    the same order. The listed groups' earlier order is replaced (one group: none). Threads
    that step models concurrently each need their own groups (and process groups)."""
    groups = _groups(params)
    for g in groups:
        g.prefetch_next = {}
    for a, b in zip(groups, groups[1:]):
        a.prefetch_next["forward"], b.prefetch_next["backward"] = b, a


def prefetch_on_grad(tensor: torch.Tensor, params: Iterable[torch.Tensor]) -> torch.Tensor:
    """When backward reaches ``tensor`` (e.g. the output of the layer after ``params``'s),
    start the all-gather for ``params``'s backward, so it runs while that later layer's
    backward computes: FSDP's backward prefetch. Returns ``tensor``."""
    params = list(params)
    tensor.register_hook(lambda grad: prefetch_for_backward(params))
    return tensor


def wait_for_grads(params: Iterable[torch.Tensor]) -> None:
    """Deliver the async reduce-scatters still pending for the groups among ``params`` (e.g.
    ``model.parameters()``): into ``main_grad`` (fused) or ``.grad``. A backward delivers its
    own as it ends, so this is needed only where ``finalize_group_grads`` ran outside one; what
    a backward that raised left behind is dropped (with a warning), not delivered."""
    for g in _groups(params):
        g.deliver_pending(-1)
        g.drop_pending(lambda t: t != -1)
