"""Probe 21: a hostile user's findings on probe 20's fixes (6003492-7f89e14: async
reduce-scatters pending per graph task, an end-of-backward callback that delivered them and
dropped unused gathers, targets() through torch._C._will_engine_execute_node, no forward
prefetch inside a backward). Each case asserts the right behaviour (the in-line run's, where one
exists); each failed before the fixes that followed (prefetch chains: a set_prefetch_order
gather serves only the next materialize of its thread and backward; a failed backward's
leftovers dropped at the group's next forward, not at another task's reduce-scatter; weak
references; fused main_grad by requires_grad in both modes; a captured leaf is not accumulated).

CPU, gloo, 2 ranks, one launch for every case (each case's collectives run on every rank, the
failures are collected per case so the ranks stay in step)."""

from __future__ import annotations

import gc
import threading
import warnings
import weakref

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from support.rank_cases import E, F, H, assert_steps_equal, data as _data, gl as _gl, make_rank_case_tests, mlp_weights, rnd as _rnd
from functional_dw import distributed as fdd

gelu = torch.nn.functional.gelu


def _boom(t):
    t.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("boom")))  # every rank raises here


def _raise_in_backward(w1, w2, sp, x0, dy):
    """A step whose backward raises (a hook on layer 1's output) after layer 2's backward ran."""
    h = gelu(_gl(x0.clone().requires_grad_(), w1, sp))
    _boom(h)
    try:
        _gl(h, w2, sp).backward(dy)
    except RuntimeError:
        pass


def _reentrant_same_group_outside_and_inside():
    """One group used inside a reentrant checkpoint and again after it. Backward reduce-scatters
    the outer use first (outer graph task, pending), then the checkpoint's nested backward (a
    different task) reduce-scatters the group again: drop_pending(t != task) takes the outer
    task's pending reduce-scatter for a failed backward's leftovers and drops it (RuntimeWarning),
    so the outer use's grads are lost. Fix: drop only tasks that are no longer running (e.g. keep
    a set of live tasks, the ones whose end callback is queued and whose backward has not raised)."""
    fs = [_rnd(H, H, seed=50 + e) for e in range(E)]
    _, _, sp, x0, dy = _data()
    grads = {}
    for async_ in (False, True):
        w = fdd.shard_grouped_weights(fs, async_grad_reduce=async_)
        h = checkpoint(lambda t: gelu(_gl(t, w, sp)), x0.clone().requires_grad_(), use_reentrant=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            _gl(h, w, sp).backward(dy)
        grads[async_] = [m.grad for m in w]
    for e, (a, b) in enumerate(zip(grads[False], grads[True])):
        assert torch.equal(a, b), f"expert {e}: async grads differ from in-line (the outer use's reduce-scatter was dropped)"


def _train_with(between):
    """Two steps of a 2-layer MLP with fused AdamW (CPU: bumps no version), ``between(...)``
    after each backward and before the step; in-line against set_prefetch_order."""
    f1, f2, sp, x0, dy = _data()
    outs = {}
    for overlap in (False, True):
        w1, w2 = mlp_weights(f1, f2, overlap)
        opt = torch.optim.AdamW([*w1, *w2], lr=0.1, fused=True)
        ys = []
        for _ in range(2):
            y = _gl(gelu(_gl(x0.clone().requires_grad_(), w1, sp)), w2, sp)
            y.backward(dy)
            ys.append(y.detach())
            between(w1, w2, sp, x0, dy)
            opt.step()
            opt.zero_grad()
        outs[overlap] = ys
    assert_steps_equal(outs, "from in-line (a stale prefetch was used)")


def _prefix_forward_prefetch_outlives_step():
    """A forward of layer 1 alone (no_grad: a probe on its features, an early exit) between
    backward and the optimizer step: layer 1's forward prefetches layer 2, nothing uses or drops
    that gather (no backward follows), the step bumps no version, and the next step's layer 2
    runs on the old weights. Fix: stamp a forward prefetch with the step (drop forward
    prefetches when the next forward of the group that issued them starts, or at
    the next forward of the first group), or compare data_ptr()/a global step counter besides
    _version; at least drop forward prefetches left when the next backward ends AND before any
    forward that did not issue them."""

    def between(w1, w2, sp, x0, dy):
        with torch.no_grad():
            _gl(x0, w1, sp)

    _train_with(between)


def _failed_backward_prefetch_outlives_step():
    """A micro-batch whose backward raises after layer 2's backward prefetched layer 1 (skipped,
    then the step on what was accumulated): the failed backward's end callback never runs, so
    the prefetch survives the step (no version bump) and the next forward of layer 1 uses it.
    Fix: a failed backward cannot be observed by a callback; drop backward-phase prefetches at
    the next forward (a forward never needs a gather issued in a backward)."""

    _train_with(_raise_in_backward)


def _autograd_grad_of_a_member_async():
    """torch.autograd.grad(loss, [w[0]]) with async_grad_reduce: the docstring says it returns
    None for the weights; it raises instead, from inside the backward, with torch's internal
    'A leaf node was passed to _will_engine_execute_node but we are currently running
    autograd.grad()'. Fix: in targets(), catch that (or check the exec-info capture first) and
    treat a captured leaf as not accumulated; better, with a capture deliver synchronously."""
    f1, _, sp, x0, dy = _data()
    w = fdd.shard_grouped_weights(f1, async_grad_reduce=True)
    y = _gl(x0.clone().requires_grad_(), w, sp)
    try:
        torch.autograd.grad((y * dy[:, :1]).sum(), [w[0]], allow_unused=True)
    except RuntimeError as err:
        raise AssertionError(f"torch.autograd.grad(loss, [w[0]]) raised: {err}") from None
    assert all(m.grad is None for m in w)


def _fused_main_grad_under_autograd_grad_x():
    """fuse_wgrad_accumulation under torch.autograd.grad(loss, x): in-line writes main_grad
    (deliver() without targets: every member that requires grad, as the plain-weight fused
    path does), async writes none (targets(): the engine does not accumulate them). The two
    modes must agree; pick one rule (TE's fused GEMM writes main_grad whatever the engine
    accumulates: pass targets=[m.requires_grad ...] for fused async too, or compute targets in
    the in-line path as well)."""
    f1, _, sp, x0, _ = _data()
    got = {}
    for async_ in (False, True):
        w = fdd.shard_grouped_weights(f1, async_grad_reduce=async_)
        x = x0.clone().requires_grad_()
        torch.autograd.grad(_gl(x, w, sp, fuse_wgrad_accumulation=True).sum(), x)
        got[async_] = [getattr(m, "main_grad", None) is not None for m in w]
    assert got[False] == got[True], f"main_grad written: in-line {got[False]}, async {got[True]}"


def _other_threads_backward_keeps_my_gather():
    """Two threads, each with its own process group (the pattern ProcessGroup-per-thread code
    uses). Thread A runs a forward with reshard_after_forward=False; thread B then runs a
    forward and backward of its own group; A's backward should use A's kept gather. B's end
    callback clears the module-global _GATHERED, A's included, so A gathers again. When the
    threads interleave differently on different ranks (they do: nothing orders them), one rank
    issues that extra all-gather on A's group and the other does not: A's group hangs
    (/tmp/probe21/p3b.py). Here every rank interleaves the same way, so it shows as a second
    all-gather. Fix: _GATHERED per owner (the thread that ran the forward / the graph task), and
    the end callback drops only its own."""
    f1, f2, sp, x0, _ = _data()
    pga, pgb = dist.new_group([0, 1]), dist.new_group([0, 1])
    out = {}

    def fwd_a():
        out["w"] = fdd.shard_grouped_weights(f1, pga, reshard_after_forward=False)
        out["y"] = _gl(x0.clone().requires_grad_(), out["w"], sp)

    def step_b():
        w = fdd.shard_grouped_weights(f2, pgb)
        _gl(_rnd(3, F, seed=1).requires_grad_(), w, [1, 1, 1]).sum().backward()

    def bwd_a():
        out["y"].backward(torch.ones_like(out["y"]))

    for fn in (fwd_a, step_b, bwd_a):
        t = threading.Thread(target=fn)
        t.start()
        t.join(30)
    n = out["w"][0]._dw.stats["all_gather"]
    assert n == 1, f"thread A's group all-gathered {n} times (its kept gather was dropped by thread B's backward)"


def _failed_backward_leaks_group():
    """An async backward that raises: its pending reduce-scatter's record must not keep the
    group, its parameters and its full-size buffers alive after the model is gone (they were
    held by _PENDING and _GATHERED; _PENDING now holds weak references)."""
    f1, f2, sp, x0, dy = _data()
    w1 = fdd.shard_grouped_weights(f1, async_grad_reduce=True)
    w2 = fdd.shard_grouped_weights(f2, async_grad_reduce=True)
    fdd.set_prefetch_order([*w1, *w2])
    _raise_in_backward(w1, w2, sp, x0, dy)
    refs = [weakref.ref(w1[0]._dw), weakref.ref(w2[0]._dw)]
    del w1, w2
    gc.collect()
    live = [r() for refs_ in fdd._PENDING.values() for r in refs_ if r() is not None]
    alive = [r() is not None for r in refs]
    assert not live and not any(alive), f"pending records of live groups: {len(live)}; groups alive after del: {alive}"


CASES = {
    "reentrant-same-group": _reentrant_same_group_outside_and_inside,
    "prefix-forward-stale-prefetch": _prefix_forward_prefetch_outlives_step,
    "failed-backward-stale-prefetch": _failed_backward_prefetch_outlives_step,
    "autograd-grad-member-async": _autograd_grad_of_a_member_async,
    "fused-main-grad-modes": _fused_main_grad_under_autograd_grad_x,
    "threads-drop-gathers": _other_threads_backward_keeps_my_gather,
    "failed-backward-leak": _failed_backward_leaks_group,
}

results, test_probe21 = make_rank_case_tests(CASES)
