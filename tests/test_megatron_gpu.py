"""Megatron-Core 0.19.2's real fine-grained activation offloading on functional_dw's experts (issue 17).

Megatron's ``TEGroupedMLP`` (two of them chained, so that steady-state iterations offload the
first one's groups: Megatron keeps the last group of each name on the GPU after warm-up), bf16,
``gradient_accumulation_fusion`` into fp32 ``main_grad`` buffers (as Megatron DDP lays them out:
``main_grad`` + ``grad_added_to_main_grad`` on each weight), ``fine_grained_activation_offloading``
with ``offload_modules=["expert_fc1", "moe_act"]``, so Megatron's own
``FineGrainedActivationOffloadingInterface``/``PipelineOffloadManager`` install the saved-tensor
hooks. Each step is driven as Megatron's schedule and GPTModel drive it: ``init_chunk_handler``
before the forward, ``reset()`` after the backward; iteration 0 is the warm-up.

The experts' weights are DistributedWeights: ``functional_dw.distributed.ShardedWeight`` (via
``functional_dw.megatron.shard_expert_weights``), not Megatron's ``GTPShardedParam``: GTP is
active only when ``expt_gtp_remat`` spans more than one rank (on one rank Megatron builds plain
parameters), and its construction goes through TE's GTP hooks inside ``TEGroupedLinear``'s
constructor, so it cannot wrap our classes; ShardedWeight runs on any number of ranks and
implements the same TE 2.20 protocol (materialize/finalize/grad_buffer).

Shown here:
1. ``test_te_classes_fail_or_differ``: the same set-up with TE's ``TEColumnParallelGroupedLinear``/
   ``TERowParallelGroupedLinear`` raises (the error is recorded) or gives gradients that differ.
2. ``test_ours_bitwise_equal_with_and_without_offloading``: functional_dw's classes give bitwise
   the same outputs, input grads and ``main_grad``s as without offloading, the DistributedWeight
   collectives run (2 all-gathers and 1 reduce-scatter per layer and step), and no weight (nor a
   gathered copy) goes through Megatron's hooks.
3. ``test_bytes_offloaded_per_step``: bytes Megatron offloaded per step, TE's module vs ours.
4. ``test_fused_mlp_bitwise_equal_with_and_without_offloading``: ``functional_dw.megatron.GroupedMLP``
   (the whole expert MLP as one autograd node, in place of ``TEGroupedMLP``) under the same
   offloading of ``expert_fc1`` and ``moe_act``: bitwise equal to no offloading, no weight through
   Megatron's hooks, one offload group per MLP.
Plus ``test_two_ranks``: (2) on 2 GPUs (spawned ranks, NCCL; skipped with fewer GPUs).

Run: ``PYTHONPATH=<megatron-core 0.19.2> python -m pytest -q -s tests/test_megatron_gpu.py``;
``FDW_MEGATRON_OUT=path.json`` also writes what is printed.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

pytestmark = pytest.mark.gpu


def _why_not() -> str | None:
    if not torch.cuda.is_available():
        return "needs CUDA"
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as e:
        return f"needs Transformer Engine (import failed: {type(e).__name__}: {e})"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron.core.extensions.transformer_engine import TEColumnParallelGroupedLinear
            from megatron.core.transformer.moe.experts import TEGroupedMLP  # noqa: F401
    except Exception as e:
        return f"needs megatron-core 0.19.2 on PYTHONPATH (import failed: {type(e).__name__}: {e})"
    if TEColumnParallelGroupedLinear is None:
        return "megatron-core imported but did not find Transformer Engine (its HAVE_TE is False)"
    return None


WHY = _why_not()
if WHY:
    pytest.skip(WHY, allow_module_level=True)

import torch.distributed as dist  # noqa: E402

from functional_dw import distributed as fdd  # noqa: E402

from support.megatron_steps import FFN, H, T, check_ours, differences, record, run_steps, summary  # noqa: E402


# --- one rank, in this process ---------------------------------------------------------------


@pytest.fixture(scope="module")
def mpu():
    """One NCCL rank (a file rendezvous in a temporary folder) and
    Megatron's model-parallel state (all sizes 1)."""
    from megatron.core import parallel_state as ps

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    import tempfile

    torch.cuda.set_device(0)
    store = os.path.join(tempfile.mkdtemp(), "store")  # (a file rendezvous: no port to race for)
    dist.init_process_group(
        "nccl", init_method=f"file://{store}", rank=0, world_size=1, device_id=torch.device("cuda", 0)
    )
    ps.initialize_model_parallel(1, 1)
    yield
    ps.destroy_model_parallel()
    dist.destroy_process_group()


_RUNS: dict[tuple, dict] = {}


def _cached(kind: str, offload: bool, shard: bool) -> dict:
    if (kind, offload, shard) not in _RUNS:
        _RUNS[kind, offload, shard] = run_steps(kind, offload, shard)
    return _RUNS[kind, offload, shard]


def test_te_classes_fail_or_differ(mpu):
    """(1) TE 2.20's classes in the same set-up: an error (recorded) or different gradients."""
    te_off, te_plain = _cached("te", True, True), _cached("te", False, True)
    ours = _cached("fd", False, True)
    assert ours["error"] is None, f"functional_dw's reference run failed:\n{ours.get('traceback')}"
    differs = []
    if te_off["error"] is None:
        if te_plain["error"] is None:
            differs = differences(te_plain, te_off)
        for it, grads in enumerate(te_off["main_grads"]):  # against ours without offloading, bf16-close
            for n, g in grads.items():
                want = ours["main_grads"][it][n]
                if not torch.allclose(g, want, rtol=2e-2, atol=1e-2 * want.abs().max().item()):
                    differs.append(f"step {it} {n}.main_grad vs functional_dw: max |diff| {(g - want).abs().max():.3g}")
    record(
        "te_vs_ours",
        {
            "TE with offloading": te_off["error"]
            or (f"ran; differs: {differs[:5]}" if differs else "ran, same results"),
            "TE without offloading": te_plain["error"] or "ran",
            "functional_dw with offloading": _cached("fd", True, True)["error"] or "ran",
            "TE traceback": te_off.get("traceback"),
            "TE run": summary(te_off),
            "TE run without offloading": summary(te_plain),
        },
    )
    assert te_off["error"] or differs, (
        "TE's TEColumnParallelGroupedLinear/TERowParallelGroupedLinear ran under Megatron's offloading with "
        f"ShardedWeight experts and gave the same gradients: the original failure did not reproduce. {summary(te_off)}"
    )


def test_ours_bitwise_equal_with_and_without_offloading(mpu):
    """(2) functional_dw's classes: offloading changes no bit; the DW hooks fire; no weight in the hooks."""
    ref, got = _cached("fd", False, True), _cached("fd", True, True)
    record("ours_offload_vs_not", {"with offloading": summary(got), "without": summary(ref)})
    check_ours(ref, got)
    plain = _cached("fd", True, False)  # the same with plain parameters as the experts' weights
    assert plain["error"] is None, plain.get("traceback")
    assert not plain["weights_through_hooks"], plain["weights_through_hooks"]


def test_bytes_offloaded_per_step(mpu):
    """(3) What Megatron offloaded per step for TE's module and ours (plain and sharded weights)."""
    table = {}
    for kind in ("te", "fd"):
        for shard in (False, True):
            r = _cached(kind, True, shard)
            table[f"{'TE' if kind == 'te' else 'functional_dw'}, {'ShardedWeight' if shard else 'plain'} weights"] = (
                dict(
                    warm_up_step_bytes=r["offloaded_bytes_per_step"][0],
                    steady_state_step_bytes=r["offloaded_bytes_per_step"][-1] if r["error"] is None else None,
                    megatron_summary_bytes=r.get("megatron_summary_bytes"),
                    weights_through_hooks=len(r["weights_through_hooks"]),
                    error=r["error"],
                )
            )
    record("offloaded_bytes_per_step", table)
    ours = table["functional_dw, ShardedWeight weights"]
    assert ours["error"] is None and ours["steady_state_step_bytes"] > 0, ours
    # offloaded each steady-state step: at least the first MLP's fc1 input (x, bf16; the second
    # MLP's groups stay on the GPU after warm-up)
    assert ours["steady_state_step_bytes"] >= T * H * 2, ours


def test_fused_mlp_bitwise_equal_with_and_without_offloading(mpu):
    """(4) functional_dw.megatron.GroupedMLP (fc1, activation, fc2 as one node) under Megatron's
    real fine-grained offloading of expert_fc1 and moe_act: outputs, input grads and main_grads
    bitwise those without offloading (ShardedWeight and plain weights), no weight through the
    hooks, one group per MLP holding x, fc1's output and h (bf16; probs are under
    min_offloaded_tensor_size)."""
    ref, got = _cached("fd-mlp", False, True), _cached("fd-mlp", True, True)
    plain_ref, plain = _cached("fd-mlp", False, False), _cached("fd-mlp", True, False)
    record(
        "fused_mlp_offload_vs_not",
        {"with offloading": summary(got), "without": summary(ref), "plain weights, with offloading": summary(plain)},
    )
    check_ours(ref, got)
    for r in (plain_ref, plain):
        assert r["error"] is None, r.get("traceback")
    diffs = differences(plain_ref, plain)
    assert not diffs, "offloading changed results (plain weights):\n" + "\n".join(diffs[:20])
    assert not plain["weights_through_hooks"], plain["weights_through_hooks"]
    per_mlp = T * (H + 3 * FFN) * 2
    assert got["megatron_summary_bytes"] == {"expert_fc1": per_mlp}, got["megatron_summary_bytes"]
    assert got["offloaded_bytes_per_step"][-1] == per_mlp, got["offloaded_bytes_per_step"]


# --- two ranks (spawned, NCCL) -----------------------------------------------------------------


def _two_rank_job() -> dict:
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(1, 1)  # expert data parallel over both ranks
    rank = dist.get_rank()
    ref, got = run_steps("fd", False, True, rank), run_steps("fd", True, True, rank)
    try:
        check_ours(ref, got, where=f"rank {rank}: ")
        failure = None
    except AssertionError as e:
        failure = str(e)
    ps.destroy_model_parallel()
    return dict(rank=rank, failure=failure, with_offloading=summary(got), without=summary(ref))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_ranks():
    """(2) on 2 GPUs: ShardedWeight experts sharded over both ranks (each holds half of every
    expert's rows; grads reduce-scattered), each rank with its own tokens."""
    results = fdd.launch(_two_rank_job, 2, backend="nccl", timeout=300, deadline=540)
    record("two_ranks", results)
    failures = [r["failure"] for r in results if r["failure"]]
    assert not failures, "\n".join(failures)
