"""Probe 20: a hostile user's findings on ShardedWeight's overlap options (d5aecca:
set_prefetch_order, reshard_after_forward=False, async_grad_reduce delivered at the end of
backward). Each case asserts the right behaviour; five failed before the fixes that followed
(per-backward pending work, frozen and unreached members skipped, unused gathers dropped when a
backward ends, finalize's grads checked).

CPU, gloo, 2 ranks, one launch for every case (each case's collectives run on every rank, the
assertion failures are collected per case so the ranks stay in step)."""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from support.rank_cases import F, assert_steps_equal, data as _data, gl as _gl, make_rank_case_tests, mlp_weights, rnd as _rnd
from functional_dw import distributed as fdd


def _mlp(x, w1, w2, splits):
    return _gl(torch.nn.functional.gelu(_gl(x, w1, splits)), w2, splits)


def _failed_backward_leaves_nothing_behind():
    """A backward that raises after a group's async reduce-scatter was issued (its end-of-backward
    callback never runs): the next step's grads must be that step's only. Now the failed step's
    pending reduce-scatter is delivered by the next step's first one: w2's grads come out as
    the sum of both steps."""
    f1, f2, sp, x0, dy = _data()
    grads = {}
    for async_ in (False, True):
        w1 = fdd.shard_grouped_weights(f1, async_grad_reduce=async_)
        w2 = fdd.shard_grouped_weights(f2, async_grad_reduce=async_)
        h = torch.nn.functional.gelu(_gl(x0.clone().requires_grad_(), w1, sp))
        h.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("boom")))  # every rank raises here
        try:
            _gl(h, w2, sp).backward(dy)
        except RuntimeError:
            pass
        for w in (*w1, *w2):
            w.grad = None  # the user's zero_grad before retrying
        _mlp(x0.clone().requires_grad_(), w1, w2, sp).backward(dy)
        grads[async_] = [w.grad.clone() for w in (*w1, *w2)]
    for i, (a, b) in enumerate(zip(grads[False], grads[True])):
        assert torch.equal(a, b), f"weight {i}: the async grads after a failed backward differ from in-line"


def _frozen_experts_get_no_grad():
    """requires_grad=False experts (shard_grouped_weights(requires_grad=False), or one member
    frozen) get no .grad, as in-line (autograd drops a frozen input's grad). Now the async
    delivery writes .grad on every member: an optimizer then steps the frozen experts (zeros
    with weight decay, real grads for a frozen member of a trained group)."""
    f1, _, sp, x0, _ = _data()
    dy = torch.ones(x0.shape[0], F, dtype=torch.float64)
    ws = fdd.shard_grouped_weights(f1, async_grad_reduce=True, requires_grad=False)
    _gl(x0.clone().requires_grad_(), ws, sp).backward(dy)
    assert all(w.grad is None for w in ws), "async: frozen group's weights got a .grad"
    ws = fdd.shard_grouped_weights(f1, async_grad_reduce=True)
    ws[1].requires_grad_(False)
    _gl(x0.clone().requires_grad_(), ws, sp).backward(dy)
    assert ws[1].grad is None, "async: the frozen expert got a .grad"
    assert ws[0].grad is not None and ws[2].grad is not None


def _frozen_expert_main_grad_untouched():
    """Fused wgrad: a frozen member's main_grad is never written (TE's rule, which the plain
    weights follow: dwp.grad_targets). Now ShardedWeight creates and fills it (sync and async)."""
    f1, _, sp, x0, _ = _data()
    dy = torch.ones(x0.shape[0], F, dtype=torch.float64)
    ws = fdd.shard_grouped_weights(f1)
    ws[1].requires_grad_(False)
    _gl(x0.clone().requires_grad_(), ws, sp, fuse_wgrad_accumulation=True).backward(dy)
    assert getattr(ws[1], "main_grad", None) is None, "fused: the frozen expert's main_grad was written"


def _autograd_grad_leaves_weight_grads_alone():
    """torch.autograd.grad(loss, x) and backward(inputs=[x]) accumulate into no weight's .grad
    (in-line: they do not). Now the async delivery adds the weights' grads into .grad anyway."""
    f1, _, sp, x0, _ = _data()
    ws = fdd.shard_grouped_weights(f1, async_grad_reduce=True)
    x = x0.clone().requires_grad_()
    torch.autograd.grad(_gl(x, ws, sp).sum(), x)
    assert all(w.grad is None for w in ws), "async: torch.autograd.grad(loss, x) wrote the weights' .grad"
    _gl(x, ws, sp).sum().backward(inputs=[x])
    assert all(w.grad is None for w in ws), "async: backward(inputs=[x]) wrote the weights' .grad"


def _checkpoint_prefetch_not_stale():
    """set_prefetch_order in the right order with layer 1 under activation checkpointing: the
    recomputed forward (inside backward) prefetches layer 2, whose backward is already done, so
    the gather outlives the step; after an update that bumps no version (``.data``, as the
    module's own NOTE allows; torch.optim.AdamW(fused=True) on CPU does the same) the next
    forward of layer 2 runs on the old weights. Must equal the in-line run, and leave no
    gather behind after a step."""
    f1, f2, sp, x0, dy = _data()
    outs = {}
    for overlap in (False, True):
        w1, w2 = mlp_weights(f1, f2, overlap)
        ys = []
        for _ in range(2):
            h = checkpoint(lambda t: torch.nn.functional.gelu(_gl(t, w1, sp)), x0.clone().requires_grad_(),
                           use_reentrant=False)
            y = _gl(h, w2, sp)
            y.backward(dy)
            ys.append(y.detach())
            if overlap:
                assert w2[0]._dw.ready is None, "a gather of layer 2 outlived the step"
            with torch.no_grad():
                for w in (*w1, *w2):
                    w.data.sub_(0.5 * w.grad)
                    w.grad = None
        outs[overlap] = ys
    assert_steps_equal(outs, "from in-line (a stale prefetch was used)")


def _finalize_checks_grad_shapes():
    """finalize_group_grads called directly with grads of the wrong shape raises. (d5aecca's
    _padded zero-padded an [N-1, K] grad silently; the working tree's copy raises.)"""
    ws = fdd.shard_grouped_weights([_rnd(5, 4, seed=e) for e in range(2)])
    try:
        ws[0].finalize_group_grads([_rnd(4, 4, seed=9 + e) for e in range(2)])
    except (ValueError, RuntimeError):
        return
    raise AssertionError("finalize_group_grads accepted [N-1, K] grads for [N, K] weights")


CASES = {
    "failed-backward": _failed_backward_leaves_nothing_behind,
    "frozen-async-grad": _frozen_experts_get_no_grad,
    "frozen-fused-main-grad": _frozen_expert_main_grad_untouched,
    "autograd-grad-async": _autograd_grad_leaves_weight_grads_alone,
    "checkpoint-stale-prefetch": _checkpoint_prefetch_not_stale,
    "finalize-shapes": _finalize_checks_grad_shapes,
}

results, test_probe20 = make_rank_case_tests(CASES)
