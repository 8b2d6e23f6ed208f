"""Distributed checkpoints of sharded functional_dw models (gloo on CPU).

``torch.distributed.checkpoint`` (DCP) saves a model on 4 ranks and loads it on 2, and back
(2 -> 4), and into an unsharded model in a process without a process group (4 -> 1), for:
an FSDP2-sharded expert MLP in both weight layouts (per-expert ``weight0..``, and one
``[E, out, in]`` weight whose 3 experts leave rank 3 of 4 without rows), a MoE block around an
``nn.GroupedMLP`` with biases (one FSDP2 unit: fc1 and fc2 in its group) in both layouts, and a
model whose weights are :class:`functional_dw.distributed.ShardedWeight` groups (out features
5: shards of 2, 2, 1, 0 rows on 4 ranks). Each load starts from other values (another seed)
and must give back the saved parameters, the saved model's outputs, and (the expert MLP,
through ``save_checkpoint``/``load_checkpoint``) fc1's FP8 delayed-scaling state, whose size
differs between the saved and the loading model.

A Transformer Engine state dict (keys as ``te.GroupedLinear``/``te.Linear`` write them:
``weight0..``, ``bias0..``, ``_extra_state``; built by hand, TE is not installed here; an FP8
delayed-scaling ``_extra_state`` in TE's format on one layer) loads with
``load_full_state_dict`` into the FSDP2-sharded model of either layout and into ShardedWeight
groups; ``nn.remap_layouts`` is tested on its own.

What does not fit raises on every rank alike (one message, gathered and compared) before any
rank changes a weight: a full tensor not of its parameter's full shape (``[10, 4]`` and ``[6, 4]``
for an ``[8, 4]`` ShardedWeight, a mis-shaped FSDP2 weight), and with ``strict=True`` a missing
or unexpected key, of a full state dict (``load_full_state_dict``) or of a checkpoint
(``load_checkpoint``); ``strict=False`` returns those keys and leaves what was missing as it was.

Three launches (W=4 saves, W=2 loads and saves, W=4 loads) run every case; each case is
reported as its own test.
"""

from __future__ import annotations

import os
import traceback
from functools import partial

import pytest
import torch
import torch.nn.functional as F

import functional_dw as fd
from functional_dw import distributed as fdd
from helpers import HANG_S
from test_fsdp2 import FFN, SPLITS, E, ExpertMLP, H, MoEBlock, _tokens

N5 = 5  # ShardedWeight out features: 3, 2 rows on 2 ranks; 2, 2, 1, 0 on 4
LAYOUTS = ["per-expert", "single"]


class ShardedMLP(torch.nn.Module):
    """Two expert layers over ShardedWeight groups (no bias): x [T, H] -> [T, N5] -> [T, H]."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        w1, w2 = _fulls(seed)
        self.w1 = torch.nn.ParameterList(fdd.shard_grouped_weights(w1))
        self.w2 = torch.nn.ParameterList(fdd.shard_grouped_weights(w2))

    def forward(self, x: torch.Tensor, splits: list[int]) -> torch.Tensor:
        return fd.grouped_linear(F.gelu(fd.grouped_linear(x, list(self.w1), splits)), list(self.w2), splits)


def _fulls(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(E, N5, H, generator=g), torch.randn(E, H, N5, generator=g)


def _expert_mlp(layout: str, seed: int) -> ExpertMLP:
    """ExpertMLP from ``seed``, its fc1 with an FP8 delayed-scaling state (``seed`` rows of
    history, scales 1 / seed): the extra state's size depends on the seed."""
    torch.manual_seed(seed)
    m = ExpertMLP(single=layout == "single")
    recipe = fd.fp8.DelayedScaling(amax_history_len=seed)
    state = fd.fp8.init_state(recipe, E)
    state.scale_fwd.fill_(1 / seed)
    m.fc1.set_extra_state(fd.fp8.state_to_extra_state(state, recipe))
    return m


def _moe_block(layout: str, seed: int) -> MoEBlock:
    """MoEBlock (a GroupedMLP with biases inside, sharded whole by shard_module) from ``seed``."""
    torch.manual_seed(seed)
    return MoEBlock(single=layout == "single", bias=True)


def _check_fp8_state(m: ExpertMLP, seed: int) -> None:
    state = m.fc1.fp8_state
    assert torch.equal(state.scale_fwd, torch.full_like(state.scale_fwd, 1 / seed)), state.scale_fwd
    assert state.history_len == seed and m.fc2.fp8_state is None


def _full(p: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return p.full_tensor() if isinstance(p, DTensor) else p.detach()


def _rows(full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    R = -(-full.shape[0] // world)
    return full[min(rank * R, full.shape[0]) : (rank + 1) * R]


def _check_fsdp(model: ExpertMLP, ref: ExpertMLP, rank: int) -> None:
    """model (FSDP2) holds ref's parameters and computes ref's output on this rank's tokens."""
    want = dict(ref.named_parameters())
    got = {n: _full(p) for n, p in model.named_parameters()}
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    for n, p in got.items():
        torch.testing.assert_close(p, want[n].detach(), rtol=0, atol=0, msg=n)
    x, _ = _tokens(rank)
    torch.testing.assert_close(model(x, SPLITS[rank]), ref(x, SPLITS[rank]), rtol=0, atol=0)


def _check_sharded(model: ShardedMLP, seed: int, rank: int, world: int) -> None:
    w1, w2 = _fulls(seed)
    for e in range(E):
        torch.testing.assert_close(model.w1[e].detach(), _rows(w1[e], rank, world), rtol=0, atol=0)
        torch.testing.assert_close(model.w2[e].detach(), _rows(w2[e], rank, world), rtol=0, atol=0)
    x, _ = _tokens(rank)
    y = model(x, SPLITS[rank])
    torch.testing.assert_close(
        y,
        fd.grouped_linear(F.gelu(fd.grouped_linear(x, list(w1), SPLITS[rank])), list(w2), SPLITS[rank]),
        rtol=0,
        atol=0,
    )
    y.sum().backward()  # the loaded shards still gather and reduce-scatter
    assert all(p.grad is not None and p.grad.shape == p.shape for p in model.parameters())


def _save_all(root: str, tag: str, seed: int) -> None:
    """Save the models (FSDP2 per-expert and single: ExpertMLP, MoEBlock; ShardedWeight) made
    from ``seed``."""
    import torch.distributed.checkpoint as dcp

    for layout in LAYOUTS:
        fdd.save_checkpoint(fdd.shard_module(_expert_mlp(layout, seed)), os.path.join(root, f"{tag}-{layout}"))
        fdd.save_checkpoint(fdd.shard_module(_moe_block(layout, seed)), os.path.join(root, f"{tag}-mlp-{layout}"))
    dcp.save(fdd.checkpoint_state_dict(ShardedMLP(seed)), checkpoint_id=os.path.join(root, f"{tag}-sharded"))


def _load_all(root: str, tag: str, saved_seed: int) -> dict[str, str | None]:
    """Load the checkpoints into models made from another seed; check each (the FSDP2 models
    with load_checkpoint, the ShardedWeights with dcp.load itself)."""
    import torch.distributed.checkpoint as dcp

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    out = {}
    for layout in LAYOUTS:
        out[f"fsdp2-{layout}"] = _try(
            lambda: _load_fsdp(dcp, os.path.join(root, f"{tag}-{layout}"), layout, saved_seed, rank)
        )
        out[f"fsdp2-mlp-{layout}"] = _try(
            lambda: _load_mlp(os.path.join(root, f"{tag}-mlp-{layout}"), layout, saved_seed, rank)
        )
    out["sharded-weight"] = _try(
        lambda: _load_sharded(dcp, os.path.join(root, f"{tag}-sharded"), saved_seed, rank, world)
    )
    return out


def _load_fsdp(dcp, path: str, layout: str, saved_seed: int, rank: int) -> None:
    m = fdd.shard_module(_expert_mlp(layout, saved_seed + 1))
    fdd.load_checkpoint(m, path)
    _check_fsdp(m, _expert_mlp(layout, saved_seed), rank)
    _check_fp8_state(m, saved_seed)


def _load_mlp(path: str, layout: str, saved_seed: int, rank: int) -> None:
    m = fdd.shard_module(_moe_block(layout, saved_seed + 1))
    fdd.load_checkpoint(m, path)
    _check_fsdp(m, _moe_block(layout, saved_seed), rank)


def _load_sharded(dcp, path: str, saved_seed: int, rank: int, world: int) -> None:
    m = ShardedMLP(saved_seed + 1)
    dcp.load(fdd.checkpoint_state_dict(m), checkpoint_id=path)
    _check_sharded(m, saved_seed, rank, world)


def _try(fn) -> str | None:
    try:
        fn()
        return None
    except Exception:
        return traceback.format_exc()


# --- Transformer Engine state dicts ------------------------------------------------------------


def te_state_dict(seed: int = 7) -> dict[str, torch.Tensor]:
    """What ``ExpertMLP``'s TE twin writes: ``te.GroupedLinear`` fc1, fc2 (``weight0..``,
    ``bias0..``, ``_extra_state``) and ``te.Linear`` proj; fc1's extra state holds a delayed
    scaling state (TE's format), the others TE's empty one."""
    g = torch.Generator().manual_seed(seed)
    sd: dict[str, torch.Tensor] = {}
    for layer, (k, n) in {"fc1": (H, FFN), "fc2": (FFN, H)}.items():
        for e in range(E):
            sd[f"{layer}.weight{e}"] = torch.randn(n, k, generator=g)
            sd[f"{layer}.bias{e}"] = torch.randn(n, generator=g)
        sd[f"{layer}._extra_state"] = torch.empty(0, dtype=torch.uint8)
    state = fd.fp8.init_state(fd.fp8.DelayedScaling(), E)
    state.scale_fwd.fill_(0.5)
    sd["fc1._extra_state"] = fd.fp8.state_to_extra_state(state, fd.fp8.DelayedScaling())
    sd["proj.weight"], sd["proj.bias"] = torch.randn(H, H, generator=g), torch.randn(H, generator=g)
    sd["proj._extra_state"] = torch.empty(0, dtype=torch.uint8)
    return sd


def _te_reference(layout: str) -> ExpertMLP:
    ref = ExpertMLP(single=layout == "single")
    ref.load_state_dict(te_state_dict())  # TE's keys load into the unsharded module, either layout (test_nn.py)
    return ref


def _load_te(layout: str) -> None:
    rank = torch.distributed.get_rank()
    m = fdd.shard_module(_expert_mlp(layout, 1))
    fdd.load_full_state_dict(m, te_state_dict())
    _check_fsdp(m, _te_reference(layout), rank)
    assert torch.equal(m.fc1.fp8_state.scale_fwd, torch.full_like(m.fc1.fp8_state.scale_fwd, 0.5))
    assert m.fc2.fp8_state is None


def _load_te_into_sharded_weights() -> None:
    """The TE layers' weights into ShardedWeight groups (no biases: strict=False reports them)."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    te = te_state_dict()
    fc1 = torch.stack([te[f"fc1.weight{e}"] for e in range(E)])
    m = torch.nn.Module()
    m.fc1 = torch.nn.ParameterList(fdd.shard_grouped_weights(torch.zeros_like(fc1)))
    sd = {f"fc1.{e}": te[f"fc1.weight{e}"] for e in range(E)}
    fdd.load_full_state_dict(m, sd)
    for e in range(E):
        assert torch.equal(m.fc1[e].detach(), _rows(fc1[e], rank, world)), e


# --- keys and shapes that do not fit: every rank raises alike, before anything is loaded ---------


def _error(fn) -> str:
    """What ``fn()`` raised, as "Type: message" (DCP's CheckpointException, a BaseException:
    the ranks' errors it holds), or "nothing"."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        fn()
    except CheckpointException as e:
        return " | ".join(sorted({f"{type(x).__name__}: {x}" for x, _ in e.failures.values()}))
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "nothing"


def _raises_alike(fn, *want: str) -> None:
    """``fn`` raises on every rank with one message, which names each of ``want``."""
    msgs = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(msgs, _error(fn))
    assert len(set(msgs)) == 1 and all(w in msgs[0] for w in want), msgs


def _params(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: _full(p).clone() for n, p in m.named_parameters()}


def _assert_params(m: torch.nn.Module, want: dict[str, torch.Tensor], what: str) -> None:
    got = _params(m)
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    for n, p in got.items():
        assert torch.equal(p, want[n]), f"{n}: {what}"


def _two_sharded_weights() -> torch.nn.Module:
    m = torch.nn.Module()
    m.a, m.b = fdd.shard_weight(torch.zeros(8, 4)), fdd.shard_weight(torch.zeros(8, 4))
    return m


def _full_mis_shaped_into_sharded_weight(rows: int) -> None:
    """[10, 4] (rows were dropped) and [6, 4] (rank 1 alone raised) for an [8, 4] ShardedWeight."""
    m = _two_sharded_weights()
    for strict in (True, False):
        sd = {"a": torch.ones(rows, 4), "b": torch.ones(8, 4)}
        _raises_alike(
            partial(fdd.load_full_state_dict, m, sd, strict=strict),
            "ValueError: load_full_state_dict",
            f"a: expected full shape [8, 4], given [{rows}, 4]",
        )
        assert not m.a.any() and not m.b.any(), "a weight was loaded"


def _full_keys_into_sharded_weight() -> None:
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    m = _two_sharded_weights()
    full = torch.arange(32.0).view(8, 4)
    _raises_alike(
        lambda: fdd.load_full_state_dict(m, {"a": full}),
        "RuntimeError: Error(s) in loading state_dict",
        'Missing key(s) in state_dict: "b".',
    )
    _raises_alike(
        lambda: fdd.load_full_state_dict(m, {"a": full, "b": full, "c": full}), 'Unexpected key(s) in state_dict: "c".'
    )
    assert not m.a.any() and not m.b.any(), "strict loaded a weight"
    out = fdd.load_full_state_dict(m, {"a": full, "c": full}, strict=False)
    assert (out.missing_keys, out.unexpected_keys) == (["b"], ["c"]), out
    assert torch.equal(m.a.detach(), _rows(full, rank, world)) and not m.b.any()


def _full_into_fsdp2() -> None:
    """A mis-shaped tensor, a missing and an unexpected key, into an FSDP2 model."""
    m = fdd.shard_module(_expert_mlp("per-expert", 1))
    before, saved = _params(m), _expert_mlp("per-expert", 2)
    sd = saved.state_dict()
    bad = {**sd, "fc2.weight1": torch.ones(H + 1, FFN)}
    for strict in (True, False):
        _raises_alike(
            partial(fdd.load_full_state_dict, m, bad, strict=strict),
            f"fc2.weight1: expected full shape [{H}, {FFN}], given [{H + 1}, {FFN}]",
        )
    missing = {k: v for k, v in sd.items() if k != "fc1.bias2"}
    _raises_alike(lambda: fdd.load_full_state_dict(m, missing), 'Missing key(s) in state_dict: "fc1.bias2".')
    _raises_alike(
        lambda: fdd.load_full_state_dict(m, {**sd, "fc3.weight": sd["proj.weight"]}),
        'Unexpected key(s) in state_dict: "fc3.weight".',
    )
    _assert_params(m, before, "changed by a load that raised")
    out = fdd.load_full_state_dict(m, {**missing, "fc3.weight": sd["proj.weight"]}, strict=False)
    assert (out.missing_keys, out.unexpected_keys) == (["fc1.bias2"], ["fc3.weight"]), out
    _assert_params(m, {**_params(saved), "fc1.bias2": before["fc1.bias2"]}, "strict=False")
    _check_fp8_state(m, 2)


def _checkpoint_keys(root: str) -> None:
    """A checkpoint with keys the model lacks (they were ignored) or lacking some of the model's."""
    path = os.path.join(root, "w4-per-expert")  # (seed 10)
    fewer = _expert_mlp("per-expert", 11)
    del fewer.proj
    fewer = fdd.shard_module(fewer)
    before = _params(fewer)
    _raises_alike(
        lambda: fdd.load_checkpoint(fewer, path),
        "RuntimeError: Error(s) in loading state_dict",
        'Unexpected key(s) in the checkpoint: "proj.',
    )
    _assert_params(fewer, before, "changed by a load that raised")
    out = fdd.load_checkpoint(fewer, path, strict=False)
    assert out.missing_keys == [] and set(out.unexpected_keys) == {"proj.weight", "proj.bias", "proj._extra_state"}
    _assert_params(
        fewer, {n: p for n, p in _params(_expert_mlp("per-expert", 10)).items() if "proj" not in n}, "strict=False"
    )
    _check_fp8_state(fewer, 10)

    more = _expert_mlp("per-expert", 11)
    more.extra = fd.nn.Linear(H, H, backend="torch")
    more = fdd.shard_module(more)
    before = _params(more)
    _raises_alike(lambda: fdd.load_checkpoint(more, path), 'Missing key(s) in the checkpoint: "extra.')
    _assert_params(more, before, "changed by a load that raised")
    out = fdd.load_checkpoint(more, path, strict=False)
    assert set(out.missing_keys) == {"extra.weight", "extra.bias", "extra._extra_state"} and out.unexpected_keys == []
    _assert_params(
        more,
        {
            **_params(_expert_mlp("per-expert", 10)),
            "extra.weight": before["extra.weight"],
            "extra.bias": before["extra.bias"],
        },
        "strict=False",
    )


def _full_bad_extra_state() -> None:
    """An FP8 ``_extra_state`` that does not fit (saved for 4 GEMMs, not 2; not bytes) or a meta
    tensor raises on every rank before any weight changes (before: after every weight loaded)."""
    recipe = fd.fp8.DelayedScaling()
    m = torch.nn.Sequential(fd.nn.Linear(4, 8, backend="torch"), fd.nn.GroupedLinear(2, 8, 4, recipe=recipe))
    before, sd = _params(m), {k: torch.ones_like(v) for k, v in m.state_dict().items() if k != "1._extra_state"}
    four = fd.fp8.state_to_extra_state(fd.fp8.init_state(recipe, 4), recipe)
    _raises_alike(
        lambda: fdd.load_full_state_dict(m, {**sd, "1._extra_state": four}),
        "ValueError: load_full_state_dict",
        "1._extra_state: the extra state was saved for 4 GEMM(s)",
    )
    _raises_alike(
        lambda: fdd.load_full_state_dict(m, {**sd, "1._extra_state": "garbage"}),
        "1._extra_state: extra state must be a uint8 tensor",
    )
    _raises_alike(
        lambda: fdd.load_full_state_dict(
            m, {**sd, "1._extra_state": four, "0.weight": torch.empty(8, 4, device="meta")}
        ),
        "0.weight: a meta tensor, which holds no values",
    )
    _assert_params(m, before, "changed by a load that raised")


def _full_into_tied_sharded_weight() -> None:
    """One ShardedWeight under two names: each key gets this rank's rows (before: the second
    name was not sliced, and a size mismatch raised after the first had loaded)."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    m = torch.nn.Module()
    m.a = m.b = fdd.shard_weight(torch.zeros(8, 4))
    full = torch.arange(32.0).view(8, 4)
    fdd.load_full_state_dict(m, {"a": full, "b": full})
    assert torch.equal(m.a.detach(), _rows(full, rank, world)) and m.a is m.b


KEY_CASES = {
    "full-10-rows-into-sharded-weight-of-8": partial(_full_mis_shaped_into_sharded_weight, 10),
    "full-bad-extra-state": _full_bad_extra_state,
    "full-into-tied-sharded-weight": _full_into_tied_sharded_weight,
    "full-6-rows-into-sharded-weight-of-8": partial(_full_mis_shaped_into_sharded_weight, 6),
    "full-keys-into-sharded-weight": _full_keys_into_sharded_weight,
    "full-into-fsdp2": _full_into_fsdp2,
}


# --- the launches ------------------------------------------------------------------------------


def _save_job(root: str) -> None:
    _save_all(root, "w4", seed=10)


def _load_and_save_job(root: str) -> dict[str, str | None]:
    out = {f"4to2-{k}": v for k, v in _load_all(root, "w4", saved_seed=10).items()}
    for layout in LAYOUTS:
        out[f"te-into-fsdp2-{layout}"] = _try(lambda: _load_te(layout))
    out["te-into-sharded-weight"] = _try(_load_te_into_sharded_weights)
    out.update({case: _try(fn) for case, fn in KEY_CASES.items()})
    out["checkpoint-keys"] = _try(lambda: _checkpoint_keys(root))
    _save_all(root, "w2", seed=20)
    return out


def _load_job(root: str) -> dict[str, str | None]:
    return {f"2to4-{k}": v for k, v in _load_all(root, "w2", saved_seed=20).items()}


MODELS = [f"fsdp2-{layout}" for layout in LAYOUTS] + [f"fsdp2-mlp-{layout}" for layout in LAYOUTS] + ["sharded-weight"]
CASES = (
    [f"4to2-{m}" for m in MODELS]
    + [f"2to4-{m}" for m in MODELS]
    + [f"te-into-fsdp2-{layout}" for layout in LAYOUTS]
    + ["te-into-sharded-weight"]
    + list(KEY_CASES)
    + ["checkpoint-keys"]
)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    pytest.importorskip("torch.distributed.checkpoint")
    root = str(tmp_path_factory.mktemp("dcp"))
    fdd.launch(_save_job, 4, root, backend="gloo", timeout=HANG_S, deadline=HANG_S)
    merged: dict[str, list[str]] = {}
    for job, world in ((_load_and_save_job, 2), (_load_job, 4)):
        for r, res in enumerate(fdd.launch(job, world, root, backend="gloo", timeout=HANG_S, deadline=HANG_S)):
            for case, err in res.items():
                merged.setdefault(case, []).extend([] if err is None else [f"rank {r} of {world}: {err}"])
    return root, merged


@pytest.mark.parametrize("case", CASES)
def test_distributed_checkpoint(checkpoints, case):
    _, results = checkpoints
    assert case in results, f"{case} did not run: {sorted(results)}"
    assert not results[case], "\n".join(results[case])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_four_rank_checkpoint_loads_without_a_process_group(checkpoints, layout):
    """DCP reads a sharded checkpoint into an unsharded model in one process (no process group)."""
    root, _ = checkpoints
    m = _expert_mlp(layout, 11)
    fdd.load_checkpoint(m, os.path.join(root, f"w4-{layout}"))
    _check_fp8_state(m, 10)
    ref = _expert_mlp(layout, 10)
    for (n, p), q in zip(m.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), n
    x, _ = _tokens(0)
    assert torch.equal(m(x, SPLITS[0]), ref(x, SPLITS[0]))


# --- remap_layouts --------------------------------------------------------------------------------


def test_remap_layouts_converts_te_keys_to_each_modules_layout():
    te = te_state_dict()
    model = torch.nn.Module()
    model.a, model.b = ExpertMLP(single=True), ExpertMLP(single=False)
    sd = {f"{m}.{k}": v for m in "ab" for k, v in te.items()}
    out = fd.nn.remap_layouts(model, sd)
    assert out is not sd and sd.keys() == {f"{m}.{k}" for m in "ab" for k in te}, "the input was changed"
    assert set(out) == set(model.state_dict()), sorted(set(out) ^ set(model.state_dict()))
    assert torch.equal(out["a.fc1.weight"], torch.stack([te[f"fc1.weight{e}"] for e in range(E)]))
    assert torch.equal(out["a.fc2.bias"], torch.stack([te[f"fc2.bias{e}"] for e in range(E)]))
    assert out["b.fc1.weight1"] is te["fc1.weight1"] and out["a.proj.weight"] is te["proj.weight"]
    back = fd.nn.remap_layouts(model.b, {k[len("a.") :]: v for k, v in out.items() if k.startswith("a.")})
    assert all(torch.equal(back[k], te[k]) for k in te), "single -> per-expert"
    model.load_state_dict(out)  # strict


def test_remap_layouts_refuses_bad_input():
    with pytest.raises(TypeError, match="model: remap_layouts takes a torch.nn.Module"):
        fd.nn.remap_layouts({}, {})
    with pytest.raises(TypeError, match="state_dict: remap_layouts takes a dict"):
        fd.nn.remap_layouts(ExpertMLP(), [("fc1.weight0", torch.zeros(1))])


def test_checkpoint_helpers_refuse_what_is_not_a_module(tmp_path):
    with pytest.raises(TypeError, match="model: checkpoints are taken of a torch.nn.Module"):
        fdd.save_checkpoint({"w": torch.zeros(1)}, tmp_path)
    with pytest.raises(TypeError, match="model: checkpoints are taken of a torch.nn.Module"):
        fdd.load_checkpoint([torch.nn.Linear(1, 1)], tmp_path)
    with pytest.raises(TypeError, match="state_dict: remap_layouts takes a dict"):
        fdd.load_full_state_dict(ExpertMLP(), None)


def test_full_state_dict_into_an_unsharded_model_reports_keys_it_did_not_load():
    """strict=False: a missing key's parameter is left as it is, an unexpected key ignored, and
    both returned; strict=True raises on either before anything is loaded."""
    m = _expert_mlp("single", 1)
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    sd = {k: v for k, v in te_state_dict().items() if k != "proj.bias"}
    sd["fc4.weight"] = torch.zeros(1)
    with pytest.raises(
        RuntimeError,
        match=r'Missing key\(s\) in state_dict: "proj.bias".\n\tUnexpected key\(s\) '
        r'in state_dict: "fc4.weight".',
    ):
        fdd.load_full_state_dict(m, sd)
    assert all(torch.equal(p, before[n]) for n, p in m.named_parameters())
    out = fdd.load_full_state_dict(m, sd, strict=False)
    assert (out.missing_keys, out.unexpected_keys) == (["proj.bias"], ["fc4.weight"]), out
    want = dict(_te_reference("single").named_parameters())
    for n, p in m.named_parameters():
        assert torch.equal(p, before[n] if n == "proj.bias" else want[n]), n
