"""Probe 22: a hostile user's findings on probe 21's fixes (98bda31, 86a0bfc: set_prefetch_order
chains keyed by (thread, graph task), a failed backward's leftovers dropped at the group's next
forward, weak pending records). Each case asserts the right behaviour (the in-line run's, where
one exists); every case failed on 86a0bfc (each docstring says why) and passes since the fixes
that followed: leftovers dropped only at a forward outside any backward, prefetch_for_backward's
gathers serve only a backward, a frozen rank finalizes the fused fp32 buffer, chains pruned at a
forward outside a backward, DistributedWeight layers run eagerly under torch.compile.

CPU, gloo, 2 ranks, one launch for every case (each case's collectives run on every rank, the
failures are collected per case so the ranks stay in step). A case that would otherwise abort a
rank (a collective mismatch) checks the mismatch before the collective runs, and turns any
other exception into an AssertionError, so one case cannot take the launch down."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from support.rank_cases import E, F, assert_steps_equal, data as _data, gl as _gl, make_rank_case_tests, rnd as _rnd
from functional_dw import distributed as fdd

gelu = torch.nn.functional.gelu


def _nested_checkpoint_async_loses_outer_grads():
    """A group used inside a nested checkpoint (reentrant outside, either kind inside) and again
    after it, async_grad_reduce. Backward: the later use's reduce-scatter is pending in the
    outer graph task T1; the outer (reentrant) checkpoint's nested backward T2 recomputes the
    inner region, so the group's forward runs with task T2 and materialize's
    drop_pending(t != T2) drops T1's pending reduce-scatter (RuntimeWarning "never delivered"):
    the later use's grads are lost, on every rank. Probe 21's fix covers one level only.
    Fix: drop only at a forward outside any backward (task == -1), or keep the stack of live
    graph tasks and never drop an ancestor's pending work."""
    fs = [_rnd(F, F, seed=50 + e) for e in range(E)]
    _, _, sp, _, _ = _data()
    xx = _rnd(sum(sp), F, seed=5 + dist.get_rank())
    grads = {}
    for async_ in (False, True):
        w = fdd.shard_grouped_weights(fs, async_grad_reduce=async_)
        inner = lambda t: gelu(_gl(t, w, sp))
        outer = lambda t: checkpoint(inner, t, use_reentrant=False) * 1.0
        h = checkpoint(outer, xx.clone().requires_grad_(), use_reentrant=True)
        y = _gl(h, w, sp)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            y.backward(_rnd(*y.shape, seed=3))
        grads[async_] = [m.grad for m in w]
    for e, (a, b) in enumerate(zip(grads[False], grads[True])):
        assert torch.equal(a, b), f"expert {e}: async grads differ from in-line (the outer use's reduce-scatter was dropped)"


def _prefetch_on_grad_outlives_step():
    """prefetch_on_grad(h1, w0) (FSDP's backward prefetch), then a backward that fires the hook
    but never reaches layer 0 (torch.autograd.grad(loss, h0): an input-grad penalty, a probe)
    after the full backward. The gather stays in layer 0's `ready` with chain None, survives
    fused AdamW's step (no version bump) and serves the next forward: stale weights (no
    set_prefetch_order, no async needed). prefetch_for_backward() alike. Fix: stamp these
    gathers with the chain too (serve only a backward-phase materialize of the graph task that
    issued them, or the next backward when issued outside one), or drop an unconsumed chainless
    prefetch at the group's next forward-phase materialize."""
    f1, f2, sp, x0, dy = _data()
    f1b = [_rnd(F, F, seed=60 + e) for e in range(E)]
    outs = {}
    for hook in (False, True):
        w0, w1, w2 = fdd.shard_grouped_weights(f1), fdd.shard_grouped_weights(f1b), fdd.shard_grouped_weights(f2)
        opt = torch.optim.AdamW([*w0, *w1, *w2], lr=0.1, fused=True)
        ys = []
        for _ in range(2):
            h0 = gelu(_gl(x0.clone().requires_grad_(), w0, sp))
            h1 = gelu(_gl(h0, w1, sp))
            if hook:
                fdd.prefetch_on_grad(h1, w0)
            y = _gl(h1, w2, sp)
            loss = (y * dy).sum()
            loss.backward(retain_graph=True)
            torch.autograd.grad(loss, h0)  # fires the hook; layer 0's backward does not run
            ys.append(y.detach())
            opt.step()
            opt.zero_grad()
        outs[hook] = ys
    assert_steps_equal(outs, "with prefetch_on_grad (a stale gather was used)")


def _frozen_on_one_rank_fused_mismatched_reduce_scatter():
    """fuse_wgrad_accumulation, every member of a group frozen on rank 1 only (a per-rank
    freeze, x still needs grad): rank 0 reduce-scatters its fp32 grad buffer, rank 1 takes
    _wgrad's frozen path and reduce-scatters zeros in dy's dtype (float64 here, bf16 in
    training): gloo aborts the process ("Received data size doesn't match expected size"),
    NCCL reads mismatched bytes. In-line and async alike (here checked before the collective
    runs). Fix: in the frozen path of a DistributedWeight with fuse_wgrad_accumulation, finalize
    fp32 zeros through grad_buffer() (fused=True) so the collective's dtype depends on the call
    only; or state that requires_grad must match across ranks and check it."""
    f1, _, sp, x0, _ = _data()
    names = ("reduce_scatter_single", "reduce_scatter_tensor")
    real = {n: getattr(dist, n) for n in names if hasattr(dist, n)}
    seen = []

    class _Done:
        def wait(self):
            return True

    def checked(name):
        def rs(out, inp, *args, **kwargs):
            mine = (str(inp.dtype), inp.numel())
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, mine)
            seen.append(every)
            if len(set(every)) > 1:
                return _Done()  # skip the mismatched collective (it would abort the rank)
            return real[name](out, inp, *args, **kwargs)
        return rs

    try:
        for n in real:
            setattr(dist, n, checked(n))
        w = fdd.shard_grouped_weights(f1)
        if dist.get_rank() == 1:
            for m in w:
                m.requires_grad_(False)
        y = _gl(x0.clone().requires_grad_(), w, sp, fuse_wgrad_accumulation=True)
        y.backward(torch.ones_like(y))
    finally:
        for n, f in real.items():
            setattr(dist, n, f)
    bad = [every for every in seen if len(set(every)) > 1]
    assert not bad, f"reduce-scatter (dtype, numel) per rank: {bad}"


def _chains_grow_per_failed_or_unreached_backward():
    """_CHAINS keys for a graph task are removed only by an end-of-backward callback queued at a
    backward-phase materialize or an async reduce-scatter. A backward that raises (the callback
    never runs), or a backward whose only sharded work is a checkpoint's recomputed forward
    (non-reentrant region holding a sharded layer, backward through a non-sharded output only)
    leaves its key forever: one per such step. Fix: queue the callback at any materialize
    inside a backward (task != -1), and prune keys of other tasks of this thread at a forward
    outside a backward (task == -1), where none of them can still be running."""
    f1, f2, sp, x0, dy = _data()
    w1, w2 = fdd.shard_grouped_weights(f1), fdd.shard_grouped_weights(f2)
    fdd.set_prefetch_order([*w1, *w2])
    sizes = []
    for _ in range(3):
        h = gelu(_gl(x0.clone().requires_grad_(), w1, sp))
        h.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("boom")))  # every rank raises here
        try:
            _gl(h, w2, sp).backward(dy)
        except RuntimeError:
            pass
        a, b = checkpoint(lambda t: (_gl(t, w1, sp), torch.tanh(2.0 * t)), x0.clone().requires_grad_(),
                          use_reentrant=False)
        b.sum().backward()  # recomputes layer 1's forward inside this backward; its backward never runs
        sizes.append(len(fdd._CHAINS))
    assert sizes[0] == sizes[-1], f"len(_CHAINS) after each step: {sizes}"


def _compile_around_sharded_weight():
    """torch.compile around a function calling grouped_linear with ShardedWeight (any
    DistributedWeight: functional_dw.demo.LocalGroupWeight alike, one process) raises
    torch._dynamo's InternalTorchDynamoError ("AutogradFunctionVariable() is not a constant",
    from custom_vjp's fast apply); plain weights compile. Neither the README nor a test says
    what compile does with a DistributedWeight. Expected: it runs (graph breaks are fine)
    and equals eager, or a clear error from functional_dw. Fix: under is_compiling(), hand a
    DistributedWeight call to eager (torch._dynamo.disable around the materialize/Function,
    or a graph break), or raise a clear NotImplementedError; add a test."""
    f1, _, sp, x0, _ = _data()
    torch._dynamo.reset()
    got = {}
    for compiled in (False, True):
        w = fdd.shard_grouped_weights(f1)
        x = x0.clone().requires_grad_()
        f = (lambda x: _gl(x, w, sp))
        try:
            y = (torch.compile(f, backend="eager") if compiled else f)(x)
            y.backward(torch.ones_like(y))
        except Exception as err:  # noqa: BLE001 (reported as the case's failure)
            raise AssertionError(f"compiled: {type(err).__name__}: {str(err).splitlines()[0][:200]}") from None
        got[compiled] = [y.detach(), x.grad, *(m.grad for m in w)]
    for i, (a, b) in enumerate(zip(got[False], got[True])):
        assert torch.equal(a, b), f"tensor {i}: compiled differs from eager"


CASES = {
    "nested-checkpoint-async": _nested_checkpoint_async_loses_outer_grads,
    "prefetch-on-grad-stale": _prefetch_on_grad_outlives_step,
    "frozen-one-rank-fused": _frozen_on_one_rank_fused_mismatched_reduce_scatter,
    "chains-leak": _chains_grow_per_failed_or_unreached_backward,
    "compile-sharded-weight": _compile_around_sharded_weight,
}

results, test_probe22 = make_rank_case_tests(CASES)
