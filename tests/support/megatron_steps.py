"""Megatron-Core 0.19.2's TEGroupedMLP driven through training steps as Megatron's schedule drives
it, with or without its fine-grained activation offloading (shared by tests/test_megatron_gpu.py,
which runs it on CUDA, and tests/test_megatron.py, which runs it on the CPU with CUDA's streams
faked). Import only where megatron-core imports."""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import traceback
from collections import defaultdict
from typing import Any

import torch
import torch.nn.functional as F

from functional_dw.megatron import shard_expert_weights

E, H, FFN = 4, 512, 256  # experts, hidden size, moe_ffn_hidden_size (fc1: [2*FFN, H], fc2: [H, FFN])
SPLITS = [300, 0, 500, 200]  # tokens per expert, one without tokens
T = sum(SPLITS)
assert T not in (H, FFN, 2 * FFN)  # no activation is shaped like a weight
ITERS = 3  # 0: warm-up (everything offloaded), 1-2: steady state
BF16 = torch.bfloat16
WEIGHT_SHAPES = {(2 * FFN, H), (H, FFN)}


def record(key: str, value: Any) -> None:
    """Print a result and add it to the JSON file named by FDW_MEGATRON_OUT (if set)."""
    print(f"\n[megatron-gpu] {key}:\n{json.dumps(value, indent=1, default=str)}", flush=True)
    path = os.environ.get("FDW_MEGATRON_OUT")
    if path:
        data = json.load(open(path)) if os.path.exists(path) else {}
        data[key] = value
        with open(path, "w") as f:
            json.dump(data, f, indent=1, default=str)


# --- the set-up ------------------------------------------------------------------------------


def _config(offload: bool, device: str = "cuda"):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=2,
        hidden_size=H,
        num_attention_heads=4,
        num_moe_experts=E,
        moe_ffn_hidden_size=FFN,
        params_dtype=BF16,
        bf16=True,
        add_bias_linear=False,
        gated_linear_unit=True,
        activation_func=F.silu,
        bias_activation_fusion=False,
        gradient_accumulation_fusion=True,
        fine_grained_activation_offloading=offload,
        offload_modules=["expert_fc1", "moe_act"] if offload else [],
        min_offloaded_tensor_size=1024,
        use_cpu_initialization=device == "cpu",
    )


def _classes(kind: str) -> tuple[type, type]:
    if kind == "te":
        from megatron.core.extensions.transformer_engine import (
            TEColumnParallelGroupedLinear,
            TERowParallelGroupedLinear,
        )

        return TEColumnParallelGroupedLinear, TERowParallelGroupedLinear
    from functional_dw.megatron import ColumnParallelGroupedLinear, RowParallelGroupedLinear

    return ColumnParallelGroupedLinear, RowParallelGroupedLinear


def _build(kind: str, offload: bool, shard: bool, device: str = "cuda"):
    """Two chained TEGroupedMLPs with the same weights for every kind and run (on every rank),
    the experts' weights sharded if asked, each weight with a zeroed fp32 main_grad as Megatron
    DDP gives it. Kinds: "te" (TE's linears), "fd" (functional_dw's linears), "fd-mlp"
    (functional_dw.megatron.GroupedMLP, the whole MLP as one node, with functional_dw's linears).
    Returns (mlps, {name: weight}, [ShardedWeight groups' leaders])."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.experts import GroupedMLPSubmodules, TEGroupedMLP

    fc1, fc2 = _classes(kind)
    config = _config(offload, device)
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    if kind == "fd-mlp":
        from functional_dw.megatron import GroupedMLP as experts
    else:
        experts = TEGroupedMLP
    mlps = [
        experts(E, config, GroupedMLPSubmodules(linear_fc1=fc1, linear_fc2=fc2), pg_collection=pgs) for _ in range(2)
    ]
    g = torch.Generator().manual_seed(1234)
    weights, leaders = {}, []
    for i, mlp in enumerate(mlps):
        for lname in ("linear_fc1", "linear_fc2"):
            lin = getattr(mlp, lname)
            with torch.no_grad():
                for e in range(E):
                    w = getattr(lin, f"weight{e}")
                    w.copy_((torch.randn(w.shape, generator=g) * 0.05).to(w.dtype))
            if shard:
                leaders.append(shard_expert_weights(lin)[0])
            for e in range(E):
                w = getattr(lin, f"weight{e}")
                w.main_grad = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
                w.grad_added_to_main_grad = False
                weights[f"mlp{i}.{lname}.weight{e}"] = w
    return mlps, weights, leaders


def _inputs(it: int, rank: int, device: str = "cuda"):
    g = torch.Generator().manual_seed(1000 * rank + it)
    x = torch.randn(T, H, generator=g).to(BF16)
    probs = torch.rand(T, generator=g)
    dy = torch.randn(T, H, generator=g).to(BF16)
    return x.to(device).requires_grad_(True), probs.to(device), dy.to(device)


class _Spy:
    """Wraps Megatron's ChunkOffloadHandler (class level, for the run): what its pack hook is
    given (shape, type, storage; never the tensor, which would keep it alive) and the bytes it
    copies to the host, per iteration."""

    def __init__(self):
        self.pushed: list[dict] = []
        self.offloaded: dict[int, int] = defaultdict(int)
        self.iteration = 0

    @contextlib.contextmanager
    def installed(self):
        from megatron.core.pipeline_parallel.fine_grained_activation_offload import ChunkOffloadHandler as CH

        push, offload, spy = CH.tensor_push, CH.offload, self

        def tensor_push(handler, tensor):
            spy.pushed.append(
                dict(
                    iteration=spy.iteration,
                    shape=tuple(tensor.shape),
                    dtype=str(tensor.dtype),
                    type=type(tensor).__name__,
                    parameter=isinstance(tensor, torch.nn.Parameter),
                    distributed_weight=bool(getattr(tensor, "is_distributed_weight", False)),
                    storage=_storage(tensor),
                )
            )
            return push(handler, tensor)

        def offload_(handler, src_tensor, *args, **kwargs):
            spy.offloaded[spy.iteration] += src_tensor.numel() * src_tensor.element_size()
            return offload(handler, src_tensor, *args, **kwargs)

        CH.tensor_push, CH.offload = tensor_push, offload_
        try:
            yield self
        finally:
            CH.tensor_push, CH.offload = push, offload


def _storage(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr()
    except Exception:  # (a tensor subclass without one storage)
        return None


def _init_chunk_handler(config) -> None:
    """What GPTModel.preprocess_for_fine_grained_offloading does before each microbatch."""
    from megatron.core.pipeline_parallel.fine_grained_activation_offload import (
        FineGrainedActivationOffloadingInterface as off,
    )

    kw = dict(
        pp_rank=0,
        vp_size=config.virtual_pipeline_model_parallel_size,
        vp_stage=None,
        min_offloaded_tensor_size=config.min_offloaded_tensor_size,
        delta_offload_bytes_across_pp_ranks=config.delta_offload_bytes_across_pp_ranks,
        activation_offload_fraction=config.activation_offload_fraction,
        max_inflight_offloads=getattr(config, "fine_grained_offloading_max_inflight_offloads", None),
    )
    params = inspect.signature(off.init_chunk_handler).parameters
    off.init_chunk_handler(**{k: v for k, v in kw.items() if k in params})


def run_steps(kind: str, offload: bool, shard: bool, rank: int = 0, device: str = "cuda") -> dict:
    """ITERS training steps of the two MLPs; what each produced (on the CPU), or the error of
    the step that failed (construction errors are set-up problems: they propagate)."""
    from megatron.core.pipeline_parallel.fine_grained_activation_offload import (
        FineGrainedActivationOffloadingInterface as off,
        PipelineOffloadManager,
    )

    if offload:
        off.reset_instance()  # a fresh manager (a failed run may have left one mid-step)
    mlps, weights, leaders = _build(kind, offload, shard, device)
    params = {p.untyped_storage().data_ptr() for m in mlps for p in m.parameters()}
    res: dict = dict(kind=kind, offload=offload, shard=shard, outputs=[], x_grads=[], main_grads=[], error=None)
    spy = _Spy()
    with spy.installed():
        for it in range(ITERS):
            spy.iteration = it
            stage = (
                f"step {it} ({'warm-up' if offload and it == 0 else 'steady state' if offload else 'no offloading'})"
            )
            for w in weights.values():
                w.main_grad.zero_()
                w.grad = None
            x, probs, dy = _inputs(it, rank, device)
            try:
                if offload:
                    _init_chunk_handler(mlps[0].config)
                h, tokens = x, torch.tensor(SPLITS)  # the dispatcher's tokens_per_expert (CPU)
                for mlp in mlps:
                    h, bias = mlp(h, tokens, probs)
                    assert bias is None
                stage += ", backward"
                h.backward(dy)
                if device == "cuda":
                    torch.cuda.synchronize()
            except Exception as e:  # the failure under test (TE): record it, stop the run
                res["error"] = f"{stage}: {type(e).__name__}: {e}"
                res["traceback"] = traceback.format_exc()
                break
            finally:
                if offload:
                    with contextlib.suppress(Exception) if res["error"] else contextlib.nullcontext():
                        off.reset()  # what the schedule does after each step
            res["outputs"].append(h.detach().cpu())
            res["x_grads"].append(x.grad.detach().cpu())
            res["main_grads"].append({n: w.main_grad.detach().cpu().clone() for n, w in weights.items()})
    res["offloaded_bytes_per_step"] = [spy.offloaded.get(i, 0) for i in range(ITERS)]
    if offload:
        res["megatron_summary_bytes"] = getattr(PipelineOffloadManager.get_instance(), "_offload_summary_bytes", None)
    res["hook_tensors"] = len(spy.pushed)
    res["weights_through_hooks"] = [
        d
        for d in spy.pushed
        if d["parameter"] or d["distributed_weight"] or d["storage"] in params or d["shape"] in WEIGHT_SHAPES
    ]
    res["collectives"] = [dict(leader._dw.stats) for leader in leaders]
    return res


def differences(a: dict, b: dict) -> list[str]:
    """Where two runs' results are not bitwise equal."""
    out = []
    for it in range(min(len(a["outputs"]), len(b["outputs"]))):
        pairs = [("output", a["outputs"][it], b["outputs"][it]), ("x.grad", a["x_grads"][it], b["x_grads"][it])]
        pairs += [(f"{n}.main_grad", g, b["main_grads"][it][n]) for n, g in a["main_grads"][it].items()]
        for what, u, v in pairs:
            if not torch.equal(u, v):
                out.append(f"step {it} {what}: max |diff| {(u.float() - v.float()).abs().max().item():.3g}")
    return out


def summary(r: dict) -> dict:
    return {
        k: r.get(k)
        for k in (
            "kind",
            "offload",
            "shard",
            "error",
            "offloaded_bytes_per_step",
            "megatron_summary_bytes",
            "hook_tensors",
            "collectives",
        )
    } | {"steps_completed": len(r["outputs"]), "weights_through_hooks": len(r.get("weights_through_hooks", []))}


def check_ours(ref: dict, got: dict, where: str = "") -> None:
    """(2): bitwise equal with and without offloading, collectives ran, no weight through hooks."""
    for r in (ref, got):
        assert r["error"] is None, f"{where}functional_dw's run failed ({summary(r)}):\n{r.get('traceback')}"
    for n, g in ref["main_grads"][-1].items():  # experts with tokens have grads; expert 1 has none
        assert bool(g.any()) == (SPLITS[int(n[-1])] > 0), f"{where}{n}.main_grad is {'non' if g.any() else ''}zero"
    diffs = differences(ref, got)
    assert not diffs, f"{where}offloading changed results ({len(diffs)} tensors):\n" + "\n".join(diffs[:20])
    assert got["hook_tensors"] > 0, f"{where}Megatron's hooks saw no tensor: offloading was not active"
    assert got["offloaded_bytes_per_step"][-1] > 0, (
        f"{where}nothing offloaded in the steady-state step: {got['offloaded_bytes_per_step']}"
    )
    assert not got["weights_through_hooks"], (
        f"{where}weights went through Megatron's hooks: {got['weights_through_hooks']}"
    )
    for stats in got["collectives"] + ref["collectives"]:
        assert stats == {"all_gather": 2 * ITERS, "reduce_scatter": ITERS}, (
            f"{where}DistributedWeight collectives per layer over {ITERS} steps: {stats}"
        )
