"""functional_dw.megatron on the CPU: the module imports and refuses clearly without
megatron-core (always runs); with megatron-core 0.19.2 importable (``PYTHONPATH`` or
``pip install -e ".[megatron]"``), Megatron's own ``TEGroupedMLP`` built with our classes on one
gloo rank, checked against the same MLP computed by hand from its weights."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

E, H, FFN = 4, 16, 24  # experts, hidden size, moe_ffn_hidden_size
SPLITS = [3, 0, 5, 2]  # an expert with no tokens


def test_imports_and_refuses_clearly_without_megatron():
    code = (
        "import sys; sys.modules['megatron'] = None\n"  # megatron-core absent (or hidden)
        "import functional_dw.megatron as m\n"
        "try:\n"
        "    m.ColumnParallelGroupedLinear(2, 4, 8, config=None, init_method=None, bias=True,\n"
        "                                  skip_bias_add=False, is_expert=True)\n"
        "except ImportError as e:\n"
        "    print('ImportError:', e)\n"
        "try:\n"
        "    m.GroupedMLP\n"  # (made on first access: it subclasses megatron-core's TEGroupedMLP)
        "except ImportError as e:\n"
        "    print('GroupedMLP ImportError:', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "ImportError: functional_dw.megatron needs megatron-core" in out.stdout
    assert 'pip install -e ".[megatron]"' in out.stdout
    assert "GroupedMLP ImportError: functional_dw.megatron needs megatron-core" in out.stdout


# --- with megatron-core ----------------------------------------------------------------------


def _import_megatron():
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron.core.transformer.moe.experts import TEGroupedMLP  # noqa: F401
        return None
    except Exception as e:  # ImportError, or an incompatible version failing at import
        return (
            f"megatron-core is not importable ({type(e).__name__}: {e}); pip install -e '.[megatron]' (Python >= 3.12)"
        )


_SKIP = _import_megatron()
needs_megatron = pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")


@pytest.fixture(scope="module")
def mpu():
    """One gloo rank with Megatron's model-parallel state (all sizes 1); torn down after."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import tempfile

    store = os.path.join(tempfile.mkdtemp(), "store")  # (a file rendezvous: no port to race for)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    ps.initialize_model_parallel(1, 1)
    yield ps
    ps.destroy_model_parallel()
    dist.destroy_process_group()


def _config(**kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(
        num_layers=1,
        hidden_size=H,
        num_attention_heads=1,
        num_moe_experts=E,
        moe_ffn_hidden_size=FFN,
        use_cpu_initialization=True,
        add_bias_linear=True,
        bias_dropout_fusion=False,
        gated_linear_unit=True,
        activation_func=F.silu,
        bias_activation_fusion=False,
    )
    base.update(kw)
    return TransformerConfig(**base)


def _mlp(config):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.experts import GroupedMLPSubmodules, TEGroupedMLP

    from functional_dw.megatron import ColumnParallelGroupedLinear, RowParallelGroupedLinear

    spec = GroupedMLPSubmodules(linear_fc1=ColumnParallelGroupedLinear, linear_fc2=RowParallelGroupedLinear)
    return TEGroupedMLP(E, config, spec, pg_collection=ProcessGroupCollection.use_mpu_process_groups())


def _by_hand(mlp, x, probs, splits):
    """The gated expert MLP in float64 from the module's weights, as TEGroupedMLP computes it:
    fc1 (+bias) -> silu(gate) * linear -> * prob -> fc2, + fc2's bias * prob."""
    f1, f2 = mlp.linear_fc1, mlp.linear_fc2
    outs, start = [], 0
    for e, n in enumerate(splits):
        xe, pe = x[start : start + n].double(), probs[start : start + n, None].double()
        h = xe @ getattr(f1, f"weight{e}").double().T + getattr(f1, f"bias{e}").double()
        gate, lin = h.chunk(2, dim=-1)
        a = F.silu(gate) * lin * pe
        outs.append(a @ getattr(f2, f"weight{e}").double().T + getattr(f2, f"bias{e}").double() * pe)
        start += n
    return torch.cat(outs)


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    T = sum(SPLITS)
    x = torch.randn(T, H, generator=g, requires_grad=True)
    probs = torch.rand(T, generator=g)
    return x, probs


@needs_megatron
def test_te_grouped_mlp_forward_backward_match_by_hand(mpu):
    torch.manual_seed(0)
    mlp = _mlp(_config())
    x, probs = _inputs()
    out, out_bias = mlp(x, torch.tensor(SPLITS), probs)
    assert out_bias is None
    xr = x.detach().clone().requires_grad_(True)
    params = dict(mlp.named_parameters())
    ref_params = {n: p.detach().clone().requires_grad_(True) for n, p in params.items()}
    ref_mlp = SimpleNamespace(
        linear_fc1=SimpleNamespace(**{n.split(".")[1]: p for n, p in ref_params.items() if n.startswith("linear_fc1")}),
        linear_fc2=SimpleNamespace(**{n.split(".")[1]: p for n, p in ref_params.items() if n.startswith("linear_fc2")}),
    )
    ref = _by_hand(ref_mlp, xr, probs, SPLITS)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)
    dy = torch.randn_like(out)
    out.backward(dy)
    ref.backward(dy.double())
    torch.testing.assert_close(x.grad.double(), xr.grad.double(), rtol=1e-5, atol=1e-6)
    for n, p in params.items():
        if n.endswith(("weight1", "bias1")) and n.startswith("linear_fc"):  # expert 1 has no tokens
            assert not p.grad.any(), n
        torch.testing.assert_close(p.grad.double(), ref_params[n].grad.double(), rtol=1e-5, atol=1e-6, msg=n)


@needs_megatron
@pytest.mark.parametrize("overwrite", [False, True])
def test_gradient_accumulation_fusion_writes_main_grad(mpu, overwrite):
    torch.manual_seed(0)
    mlp = _mlp(_config(gradient_accumulation_fusion=True))
    assert mlp.linear_fc1.fuse_wgrad_accumulation and mlp.linear_fc2.fuse_wgrad_accumulation
    weights = {n: p for n, p in mlp.named_parameters() if ".weight" in n}
    for p in weights.values():  # what Megatron DDP gives each parameter
        p.main_grad = torch.ones(p.shape, dtype=torch.float32)
        p.grad_added_to_main_grad = False
        if overwrite:
            p.overwrite_main_grad = True
    ref = _mlp(_config())
    ref.load_state_dict(mlp.state_dict())
    x, probs = _inputs(1)
    dy = torch.randn(x.shape[0], H)
    mlp(x, torch.tensor(SPLITS), probs)[0].backward(dy)
    ref(x.detach(), torch.tensor(SPLITS), probs)[0].backward(dy)
    ref_grads = dict(ref.named_parameters())
    for n, p in weights.items():
        want = ref_grads[n].grad + (0 if overwrite else 1)
        torch.testing.assert_close(p.main_grad, want, rtol=1e-5, atol=1e-6, msg=n)
        assert p.grad_added_to_main_grad is True, n
        assert p.grad is not None and not p.grad.any(), f"{n}: Megatron DDP needs a zero dummy grad"
    bias = dict(mlp.named_parameters())["linear_fc1.bias0"]
    torch.testing.assert_close(bias.grad, ref_grads["linear_fc1.bias0"].grad)  # biases: plain grads, as TE


@needs_megatron
def test_skip_bias_add_returns_the_per_expert_biases(mpu):
    torch.manual_seed(0)
    mlp = _mlp(_config(params_dtype=torch.bfloat16))
    fc1, fc2 = mlp.linear_fc1, mlp.linear_fc2
    assert fc2.te_return_bias and not fc1.te_return_bias
    x = torch.randn(sum(SPLITS), FFN, dtype=torch.bfloat16)
    out, biases = fc2(x, SPLITS)
    assert isinstance(biases, list) and len(biases) == E
    for e, b in enumerate(biases):
        assert b.dtype == torch.bfloat16 and torch.equal(b, getattr(fc2, f"bias{e}"))
    start = 0
    for e, n in enumerate(SPLITS):  # the bias is not added
        torch.testing.assert_close(out[start : start + n], x[start : start + n] @ getattr(fc2, f"weight{e}").T)
        start += n
    with torch.no_grad():
        fc1.bias0.fill_(1.0)
    y, none = fc1(torch.zeros(3, H, dtype=torch.bfloat16), [3, 0, 0, 0])
    assert none is None and torch.equal(y, torch.ones_like(y))  # fc1 adds its bias
    no_bias = _mlp(_config(add_bias_linear=False))
    assert no_bias.linear_fc2(torch.randn(2, FFN), [2, 0, 0, 0])[1] is None


@needs_megatron
def test_parameters_init_attributes_and_state_dict(mpu):
    calls = []

    def init_method(w):
        calls.append(tuple(w.shape))
        w.fill_(len(calls))

    mlp = _mlp(_config(init_method=init_method, output_layer_init_method=init_method, params_dtype=torch.bfloat16))
    fc1, fc2 = mlp.linear_fc1, mlp.linear_fc2
    assert calls == [(2 * FFN, H)] * E + [(H, FFN)] * E  # each expert's weight once, in order
    for e in range(E):
        assert torch.equal(getattr(fc1, f"weight{e}"), torch.full((2 * FFN, H), e + 1.0, dtype=torch.bfloat16))
        assert not getattr(fc2, f"bias{e}").any()  # biases zero, as TE
    for name, p in mlp.named_parameters():
        assert p.dtype == torch.bfloat16 and p.allreduce is True, name
        column = name.startswith("linear_fc1")
        if ".weight" in name or column:
            assert p.tensor_model_parallel is True and p.partition_dim == (0 if column else 1), name
            assert p.partition_stride == 1, name
        else:
            assert p.tensor_model_parallel is False, name  # row-parallel biases are replicated
    keys = list(mlp.state_dict())
    for m in ("linear_fc1", "linear_fc2"):
        assert [k for k in keys if k.startswith(m)] == [
            *(k for e in range(E) for k in (f"{m}.weight{e}", f"{m}.bias{e}")),
            f"{m}._extra_state",
        ]
    other = _mlp(_config(params_dtype=torch.bfloat16))
    sd = mlp.state_dict()
    sd.update({f"linear_fc1._extra_state{e}": sd["linear_fc1._extra_state"] for e in range(1, E)})  # dist-ckpt keys
    other.load_state_dict(sd)
    assert all(torch.equal(a, b) for a, b in zip(other.parameters(), mlp.parameters()))


def _param_attributes(module):
    names = ("allreduce", "tensor_model_parallel", "partition_dim", "partition_stride")
    return {n: {a: getattr(p, a) for a in names if hasattr(p, a)} for n, p in module.named_parameters()}


@needs_megatron
@pytest.mark.parametrize("single", [False, True], ids=["per-expert", "single_grouped_weight"])
@pytest.mark.parametrize("how", ["to_empty", "swap_tensors", "assign"])
def test_megatron_attributes_survive_new_parameter_objects(mpu, monkeypatch, how, single):
    """Megatron's parameter attributes (DDP reads ``allreduce`` to pick the expert-DP group, the
    grad norm ``tensor_model_parallel``) stay on the parameters when torch makes new parameter
    objects: meta -> CPU by ``to_empty`` (Megatron's meta-device init), ``.to()`` with
    swap_tensors on, ``load_state_dict(assign=True)``."""

    def config(**kw):
        c = _config(**kw)
        c.moe_single_grouped_weight = c.moe_single_grouped_bias = single  # (after __post_init__'s TE check)
        return c

    ref = _mlp(config())
    want = _param_attributes(ref)
    assert all(a["allreduce"] is True and "tensor_model_parallel" in a for a in want.values()), want
    if how == "to_empty":
        mlp = _mlp(config(use_cpu_initialization=False, init_model_with_meta_device=True))
        assert all(p.is_meta for p in mlp.parameters()) and _param_attributes(mlp) == want
        mlp.to_empty(device="cpu")
        for m in (mlp.linear_fc1, mlp.linear_fc2):
            m.reset_parameters()
    elif how == "swap_tensors":
        mlp = _mlp(config())
        monkeypatch.setattr(torch.__future__, "get_swap_module_params_on_conversion", lambda: True)
        mlp.to(torch.bfloat16)
        assert all(p.dtype == torch.bfloat16 for p in mlp.parameters())
    else:
        mlp = _mlp(config())
        mlp.load_state_dict({k: v.clone() for k, v in ref.state_dict().items()}, assign=True)
        assert all(torch.equal(a, b) for a, b in zip(mlp.parameters(), ref.parameters()))
    assert all(p.device.type == "cpu" for p in mlp.parameters())
    assert _param_attributes(mlp) == want
    x, probs = _inputs(3)
    mlp(x.to(next(mlp.parameters()).dtype), torch.tensor(SPLITS), probs)[0].sum().backward()  # still runs


@needs_megatron
def test_sharded_state_dict_maps_each_expert(mpu):
    mlp = _mlp(_config(gated_linear_unit=False, activation_func=F.gelu))  # (GLU's fc1 becomes a factory)
    sd = mlp.sharded_state_dict(prefix="mlp.")
    for m in ("linear_fc1", "linear_fc2"):
        for e in range(E):
            sh = sd[f"mlp.{m}.weight{e}"]
            assert sh.key == f"mlp.experts.{m}.weight"
            assert sh.global_shape[0] == E and sh.global_offset[0] == e, (m, e, sh)
            assert sh.local_shape == tuple(getattr(mlp, m).weight0.shape) and sh.replica_id == (0, 0, 0)
            assert sd[f"mlp.{m}.bias{e}"].global_offset[0] == e
        assert sd[f"mlp.{m}._extra_state"].key == f"mlp.experts.{m}._extra_state"
        assert f"mlp.{m}._extra_state{E - 1}" in sd
    gated = _mlp(_config()).sharded_state_dict(prefix="mlp.")  # Megatron wraps GLU's fc1 weights itself
    assert gated["mlp.linear_fc1.weight1"].key == "mlp.experts.linear_fc1.weight"


@needs_megatron
def test_megatron_sets_save_original_input_when_offloading_fc1(mpu):
    mlp = _mlp(_config(fine_grained_activation_offloading=True, offload_modules=["expert_fc1", "moe_act"]))
    assert mlp.offload_expert_fc1 and mlp.linear_fc1.save_original_input is True
    assert mlp.linear_fc2.save_original_input is False
    mlp.backward_dw()  # TEGroupedMLP calls it on both linears: a no-op here


@needs_megatron
def test_sharded_expert_weights_on_one_rank(mpu):
    from functional_dw.distributed import ShardedWeight
    from functional_dw.megatron import shard_expert_weights

    torch.manual_seed(0)
    mlp = _mlp(_config(gradient_accumulation_fusion=True))
    ref = _mlp(_config())
    ref.load_state_dict(mlp.state_dict())
    shards = [*shard_expert_weights(mlp.linear_fc1), *shard_expert_weights(mlp.linear_fc2)]
    for p in shards:
        assert isinstance(p, ShardedWeight) and p.allreduce is True and hasattr(p, "partition_dim")
        p.main_grad, p.grad_added_to_main_grad = torch.zeros(p.shape), False
    assert mlp.linear_fc1.weight0 is shards[0] and mlp.linear_fc2.weight3 is shards[-1]
    x, probs = _inputs(2)
    out = mlp(x, torch.tensor(SPLITS), probs)[0]
    out_ref = ref(x.detach(), torch.tensor(SPLITS), probs)[0]
    torch.testing.assert_close(out, out_ref)
    out.sum().backward()
    out_ref.sum().backward()
    stats = shards[0]._dw.stats
    assert stats["all_gather"] == 2 and stats["reduce_scatter"] == 1, stats  # forward, backward; finalize
    refs = dict(ref.named_parameters())
    for n, p in mlp.named_parameters():
        if isinstance(p, ShardedWeight):
            torch.testing.assert_close(p.main_grad, refs[n].grad, msg=n)
    with pytest.raises(ValueError, match="sharded already"):
        shard_expert_weights(mlp.linear_fc1)


class _Group:
    def __init__(self, size):
        self._size = size

    def size(self):
        return self._size

    def rank(self):
        return 0


@needs_megatron
@pytest.mark.parametrize(
    "setting, error, match",
    [
        (dict(delay_wgrad_compute=True), NotImplementedError, "config.delay_wgrad_compute"),
        (dict(fp8="hybrid", fp8_recipe="mxfp8"), NotImplementedError, "config.fp8_recipe='mxfp8'"),
        (dict(fp8="hybrid", fp8_recipe="delayed", fp8_param=True), NotImplementedError, "config.fp8_param"),
    ],
)
def test_unsupported_settings_refused_at_construction(mpu, setting, error, match):
    from functional_dw.megatron import ColumnParallelGroupedLinear

    config = _config()
    for k, v in setting.items():  # set after __post_init__, which would check them against TE
        setattr(config, k, v)
    with pytest.raises(error, match=match):
        ColumnParallelGroupedLinear(
            E, H, FFN, config=config, init_method=torch.nn.init.zeros_, bias=True, skip_bias_add=False, is_expert=True
        )


@needs_megatron
def test_expert_tensor_parallelism_and_non_experts_refused(mpu):
    from functional_dw.megatron import ColumnParallelGroupedLinear, GroupedLinear

    kw = dict(config=_config(), init_method=torch.nn.init.zeros_, bias=True, skip_bias_add=False)
    pgs = SimpleNamespace(expt_tp=_Group(2), ep=_Group(1), expt_dp=_Group(1))
    with pytest.raises(ValueError, match="expert_tensor_parallel_size=2"):
        ColumnParallelGroupedLinear(E, H, FFN, is_expert=True, pg_collection=pgs, **kw)
    with pytest.raises(ValueError, match="is_expert=False"):
        ColumnParallelGroupedLinear(E, H, FFN, is_expert=False, **kw)
    with pytest.raises(ValueError, match="parallel_mode"):
        GroupedLinear(E, H, FFN, parallel_mode="duplicated", is_expert=True, **kw)


@needs_megatron
def test_hostile_constructor_arguments_and_forward_inputs(mpu):
    """Bad arguments raise ValueError/TypeError naming them (m_splits is the functional API's
    ``splits``); a CPU m_splits tensor (what TEGroupedMLP has before ``.tolist()``) runs."""
    from functional_dw.megatron import ColumnParallelGroupedLinear

    kw = dict(config=_config(), init_method=torch.nn.init.normal_, bias=True, skip_bias_add=False, is_expert=True)
    for bad, error, match in [
        (dict(num_gemms=0), ValueError, "num_gemms must be an int >= 1, got 0"),
        (dict(num_gemms=2.0), TypeError, "num_gemms must be an int"),
        (dict(config=None), TypeError, "config must be Megatron's TransformerConfig"),
        (dict(init_method=None), TypeError, "init_method must be callable"),
    ]:
        with pytest.raises(error, match=match):
            ColumnParallelGroupedLinear(**{"num_gemms": E, "input_size": H, "output_size": FFN, **kw, **bad})
    fc1 = ColumnParallelGroupedLinear(E, H, FFN, **kw)
    x = torch.randn(sum(SPLITS), H)
    want = fc1(x, SPLITS)[0]
    for splits in (torch.tensor(SPLITS), torch.tensor(SPLITS, dtype=torch.int32), tuple(SPLITS)):
        assert torch.equal(fc1(x, splits)[0], want)
    for splits, error, match in [
        ([3.0, 0, 5, 2], TypeError, r"splits\[0\] is 3.0 \(float\)"),
        ("3052", TypeError, "splits must be a list/tuple of ints or a 1-D integer tensor, got str"),
        (None, TypeError, "got NoneType"),
        (torch.tensor([3.0, 0, 5, 2]), TypeError, "splits tensor must be 1-D int32 or int64"),
        (torch.tensor(SPLITS, device="meta"), ValueError, "splits is a tensor on the meta device"),
        ([3, 0, 5, 3], ValueError, "splits sum to 11 but x has 10 rows"),
        (torch.tensor([3, 0, 5, 1]), ValueError, "splits sum to 9 but x has 10 rows"),
        ([3, 0, 7], ValueError, "splits has 3 entries but there are 4 experts"),
    ]:
        with pytest.raises(error, match=match):
            fc1(x, splits)
    with pytest.raises(TypeError, match=r"weights\[0\] has dtype torch.float32 but x has torch.bfloat16"):
        fc1(x.bfloat16(), SPLITS)
    with pytest.raises(TypeError, match="x must be float32, bfloat16, float16 or float64, got torch.int64"):
        fc1(x.long(), SPLITS)


@needs_megatron
def test_fp8_follows_the_te_autocast_megatron_enters(mpu):
    """config.fp8 with a supported recipe: the layer takes the recipe from TE's autocast
    (recipe=None), and without an autocast runs in high precision."""
    from functional_dw.megatron import ColumnParallelGroupedLinear

    config = _config()
    config.fp8, config.fp8_recipe = "hybrid", "tensorwise"
    fc1 = ColumnParallelGroupedLinear(
        E, H, FFN, config=config, init_method=torch.nn.init.normal_, bias=False, skip_bias_add=False, is_expert=True
    )
    assert fc1.recipe is None
    x = torch.randn(sum(SPLITS), H)
    y, _ = fc1(x, SPLITS)
    torch.testing.assert_close(y[:3], x[:3] @ fc1.weight0.T)


@needs_megatron
def test_fp8_extra_state_round_trip_in_a_megatron_process(mpu):
    """An FP8 delayed-scaling _extra_state written in a process that imported megatron.core (a
    Megatron run) loads: the checkpoint of a Megatron+TE run, or our own layers' state_dict."""
    import pickle

    from functional_dw import fp8
    from functional_dw.megatron import ColumnParallelGroupedLinear

    recipe = fp8.DelayedScaling(amax_history_len=3)
    state = fp8.init_state(recipe, E)
    blob = fp8.state_to_extra_state(state, recipe)
    assert b"megatron.core.safe_globals" in bytes(blob.tolist())  # what makes it fail
    kw = dict(config=_config(), init_method=torch.nn.init.normal_, bias=True, skip_bias_add=False, is_expert=True)
    fc1 = ColumnParallelGroupedLinear(E, H, FFN, **kw)
    try:
        fc1.set_extra_state(blob)
    except pickle.UnpicklingError as e:
        pytest.fail(str(e))
    assert torch.equal(fc1.fp8_state.scale_fwd, state.scale_fwd) and fc1._fp8_recipe == recipe


@pytest.fixture
def cuda_faked_offloading(monkeypatch):
    """Megatron's fine-grained offloading on the CPU: CUDA streams and events that do nothing
    (the CPU runs in order), its 'is on CUDA' test widened to the CPU, no pinned memory, and the
    TE flag it sets (``cpu_offload.CPUOffloadEnabled``) without TE. Everything else (warm-up,
    which groups are offloaded, freeing the fc1 input's storage, reloading) is Megatron's code."""
    import contextlib

    from megatron.core.extensions import transformer_engine as te_ext
    from megatron.core.pipeline_parallel import fine_grained_activation_offload as fgo

    class Stream:
        def wait_stream(self, s):
            pass

        def wait_event(self, e):
            pass

        def record_event(self, e=None):
            return e

    class Event:
        def __init__(self, *args, **kwargs):
            pass

        def record(self, stream=None):
            pass

    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: Stream())
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: Stream())
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, s: None)
    monkeypatch.setattr(te_ext, "cpu_offload", SimpleNamespace(CPUOffloadEnabled=False), raising=False)
    handler = fgo.ChunkOffloadHandler
    monkeypatch.setattr(
        handler,
        "_can_manage_tensor_for_offload",
        staticmethod(lambda t: not isinstance(t, torch.nn.Parameter) and t.device.type == "cpu"),
    )
    offload = handler.offload
    monkeypatch.setattr(
        handler,
        "offload",
        lambda self, src, pin_memory=True, use_cpu_pool=True: offload(self, src, pin_memory=False, use_cpu_pool=False),
    )
    yield
    fgo.PipelineOffloadManager.OFFLOAD_MGR = None  # (made with the fake streams)


@needs_megatron
@pytest.mark.parametrize("shard", [True, False], ids=["ShardedWeight", "plain"])
def test_megatron_offloading_steps_bitwise_on_cpu(mpu, cuda_faked_offloading, shard):
    """tests/test_megatron_gpu.py's steps on the CPU: two chained TEGroupedMLPs, warm-up and
    steady-state steps under Megatron's offloading (x's storage freed after fc1, reloaded for
    backward) give bitwise the results of the same steps without it; no weight in the hooks."""
    from support.megatron_steps import T, H, check_ours, run_steps, summary

    ref = run_steps("fd", offload=False, shard=shard, device="cpu")
    got = run_steps("fd", offload=True, shard=shard, device="cpu")
    if shard:
        check_ours(ref, got)
    else:
        assert got["error"] is None and ref["error"] is None, got.get("traceback") or ref.get("traceback")
        assert not got["weights_through_hooks"] and got["hook_tensors"] > 0, summary(got)
    steps = got["offloaded_bytes_per_step"]
    assert steps[0] > steps[-1] >= T * H * 2, steps  # warm-up offloads both MLPs, then only the first
    assert got["megatron_summary_bytes"]["expert_fc1"] == T * H * 2, got["megatron_summary_bytes"]


# --- functional_dw.megatron.GroupedMLP: the whole expert MLP as one autograd node ---------------


def _fused(config, **kw):
    from functional_dw.megatron import GroupedMLP

    return GroupedMLP(E, config, None, **kw)


_ACTIVATIONS = {
    "swiglu": dict(gated_linear_unit=True, activation_func=F.silu),
    "gelu": dict(gated_linear_unit=False, activation_func=F.gelu),
    "silu": dict(gated_linear_unit=False, activation_func=F.silu),
}


class _Act(torch.autograd.Function):
    """functional_dw's reference activation (weighted by probs) as its own autograd node."""

    @staticmethod
    def forward(ctx, fc1_out, probs, activation):
        from functional_dw.kernels.activation import REFERENCE

        ctx.save_for_backward(fc1_out, probs)
        ctx.activation = activation
        return REFERENCE.act_fwd(fc1_out, probs, activation)

    @staticmethod
    def backward(ctx, dh):
        from functional_dw.kernels.activation import REFERENCE

        fc1_out, probs = ctx.saved_tensors
        dz, dprobs = REFERENCE.act_bwd(fc1_out, probs, dh, ctx.activation)
        return dz, dprobs, None


class _ProbsBias(torch.autograd.Function):
    """fc2's bias times probs, added after fc2 (Megatron's _apply_bias), as its own node."""

    @staticmethod
    def forward(ctx, y, b_EH, probs, splits):
        from functional_dw.kernels.activation import REFERENCE

        from functional_dw.kernels import Splits

        splits = Splits(
            host=tuple(splits), tensor=None, device=y.device, num_tokens=y.shape[0], num_experts=len(splits)
        )
        ctx.save_for_backward(b_EH, probs)
        ctx.splits = splits
        return REFERENCE.probs_bias_fwd(y, b_EH, probs, splits)

    @staticmethod
    def backward(ctx, dy):
        from functional_dw.kernels.activation import REFERENCE

        b_EH, probs = ctx.saved_tensors
        db, dprobs = REFERENCE.probs_bias_bwd(dy, b_EH, probs, ctx.splits)
        return dy, db, dprobs, None


def _composed(fc1, fc2, x, splits, probs, activation):
    """Two functional_dw grouped_linear calls and the activation, each its own autograd node."""
    from functional_dw import grouped_linear

    h = _Act.apply(grouped_linear(x, fc1.weights(), splits, fc1.biases()), probs, activation)
    y = grouped_linear(h, fc2.weights(), splits)
    return y if fc2.biases() is None else _ProbsBias.apply(y, torch.stack(fc2.biases()), probs, splits)


def _grads(module, x, probs, y, dy):
    names = [n for n, _ in module.named_parameters()]
    got = torch.autograd.grad(y, [x, probs, *module.parameters()], dy, allow_unused=True)
    return dict(zip(["x", "probs", *names], got))


@needs_megatron
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("activation", ["swiglu", "gelu", "silu"])
def test_grouped_mlp_is_one_node_bitwise_the_composition(mpu, activation, bias):
    """fp32 on the CPU: forward and every grad bitwise those of fc1 -> weighted activation -> fc2
    run as separate functional_dw nodes; the forward bitwise Megatron's TEGroupedMLP (over our
    linears, with the same state dict), its grads close (its autograd's activation backward
    associates the products differently)."""
    torch.manual_seed(0)
    config = _config(add_bias_linear=bias, **_ACTIVATIONS[activation])
    mlp = _fused(config)
    assert mlp.activation == activation and mlp.save == "h"
    ref = _mlp(config)
    ref.load_state_dict(mlp.state_dict())
    x, probs = _inputs(4)
    probs.requires_grad_(True)
    y, out_bias = mlp(x, torch.tensor(SPLITS), probs)
    assert out_bias is None and type(y.grad_fn).__name__ == "CustomVJP_grouped_mlpBackward"  # one node
    dy = torch.randn_like(y)
    got = _grads(mlp, x, probs, y, dy)
    want_y = _composed(mlp.linear_fc1, mlp.linear_fc2, x, SPLITS, probs, activation)
    assert torch.equal(y, want_y)
    want = _grads(mlp, x, probs, want_y, dy)
    for n, g in got.items():
        assert g is not None and torch.equal(g, want[n]), n
    y_meg = ref(x, torch.tensor(SPLITS), probs)[0]
    assert torch.equal(y, y_meg)  # Megatron's own composition: the same forward bits
    meg = _grads(ref, x, probs, y_meg, dy)
    for n, g in got.items():
        torch.testing.assert_close(g, meg[n], rtol=1e-5, atol=1e-6, msg=n)


@needs_megatron
@pytest.mark.parametrize("single", [False, True], ids=["per-expert", "single_grouped_weight"])
def test_grouped_mlp_state_dicts_are_te_grouped_mlps(mpu, single):
    """Parameter names, state dict keys (both layouts) and the sharded state dict are
    TEGroupedMLP's; either loads the other's state dict."""

    def config():
        c = _config()
        c.moe_single_grouped_weight = c.moe_single_grouped_bias = single  # (after __post_init__'s TE check)
        return c

    torch.manual_seed(1)
    mlp, ref = _fused(config()), _mlp(config())
    assert [n for n, _ in mlp.named_parameters()] == [n for n, _ in ref.named_parameters()]
    assert list(mlp.state_dict()) == list(ref.state_dict())
    if not single:
        assert "linear_fc1.weight0" in mlp.state_dict() and "linear_fc2.bias3" in mlp.state_dict()
    else:
        assert "linear_fc1.weight" in mlp.state_dict()
    ref.load_state_dict(mlp.state_dict())
    back = _fused(config())
    back.load_state_dict(ref.state_dict())
    for a, b in zip(back.state_dict().values(), mlp.state_dict().values()):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
    assert _param_attributes(mlp) == _param_attributes(ref)
    if not single:
        sd, sd_ref = mlp.sharded_state_dict(prefix="mlp."), ref.sharded_state_dict(prefix="mlp.")
        assert sd.keys() == sd_ref.keys()
        for k, sh in sd.items():
            r = sd_ref[k]
            assert type(sh) is type(r) and sh.key == r.key, k
            if hasattr(sh, "global_offset"):
                assert (sh.global_shape, sh.global_offset, sh.replica_id) == (
                    r.global_shape,
                    r.global_offset,
                    r.replica_id,
                )
    x, probs = _inputs(5)
    assert torch.equal(mlp(x, torch.tensor(SPLITS), probs)[0], ref(x, torch.tensor(SPLITS), probs)[0])


@needs_megatron
@pytest.mark.parametrize("overwrite", [False, True])
def test_grouped_mlp_fused_main_grad(mpu, overwrite):
    """config.gradient_accumulation_fusion: the weights' grads go into main_grad (accumulated, or
    overwritten), grad_added_to_main_grad set, zero dummy grads; biases get plain grads."""
    torch.manual_seed(0)
    mlp = _fused(_config(gradient_accumulation_fusion=True))
    ref = _fused(_config())
    ref.load_state_dict(mlp.state_dict())
    weights = {n: p for n, p in mlp.named_parameters() if ".weight" in n}
    for p in weights.values():
        p.main_grad, p.grad_added_to_main_grad = torch.ones(p.shape), False
        if overwrite:
            p.overwrite_main_grad = True
    x, probs = _inputs(1)
    dy = torch.randn(x.shape[0], H)
    mlp(x, torch.tensor(SPLITS), probs)[0].backward(dy)
    ref(x.detach(), torch.tensor(SPLITS), probs)[0].backward(dy)
    refs = dict(ref.named_parameters())
    for n, p in weights.items():
        assert torch.equal(p.main_grad, refs[n].grad + (0 if overwrite else 1)), n
        assert p.grad_added_to_main_grad is True and not p.grad.any(), n
    assert torch.equal(mlp.linear_fc1.bias0.grad, refs["linear_fc1.bias0"].grad)


@needs_megatron
def test_grouped_mlp_recompute_maps_to_the_save_policy(mpu):
    """moe_act in recompute_modules -> save="default" (h recomputed in backward), else "h"; an
    explicit save= wins; every policy gives the same bits."""
    mlp = _fused(_config())
    rec = _fused(_config(recompute_granularity="selective", recompute_modules=["moe_act"], moe_grouped_gemm=True))
    assert (mlp.save, rec.save) == ("h", "default")
    x, probs = _inputs(6)
    probs.requires_grad_(True)
    dy = torch.randn(x.shape[0], H)
    out = {}
    for save in ("h", "default", "x_only"):
        m = _fused(_config(), save=save)
        m.load_state_dict(mlp.state_dict())
        assert m.save == save
        y = m(x, torch.tensor(SPLITS), probs)[0]
        out[save] = (y, *_grads(m, x, probs, y, dy).values())
    for save in ("default", "x_only"):
        assert all(torch.equal(a, b) for a, b in zip(out[save], out["h"])), save
    with pytest.raises(ValueError, match="save must be one of"):
        _fused(_config(), save="everything")


@needs_megatron
def test_grouped_mlp_probs_on_input(mpu):
    """moe_apply_probs_on_input (top-1): x scaled by probs first, as Megatron does; the same bits
    as TEGroupedMLP's forward; probs get their grad through x."""
    config = _config(moe_apply_probs_on_input=True, moe_router_topk=1, moe_router_pre_softmax=True)
    torch.manual_seed(2)
    mlp, ref = _fused(config), _mlp(config)
    ref.load_state_dict(mlp.state_dict())
    x, probs = _inputs(7)
    probs.requires_grad_(True)
    y = mlp(x, torch.tensor(SPLITS), probs)[0]
    y_ref = ref(x, torch.tensor(SPLITS), probs)[0]
    assert torch.equal(y, y_ref)
    dy = torch.randn_like(y)
    got, want = _grads(mlp, x, probs, y, dy), _grads(ref, x, probs, y_ref, dy)
    for n, g in got.items():
        torch.testing.assert_close(g, want[n], rtol=1e-5, atol=1e-6, msg=n)
    config.moe_router_topk = 2
    with pytest.raises(ValueError, match="moe_apply_probs_on_input needs moe_router_topk=1"):
        mlp(x, torch.tensor(SPLITS), probs)


@needs_megatron
@pytest.mark.parametrize("hook", ["saved_tensors_hooks", "save_on_cpu"])
def test_grouped_mlp_under_saved_tensor_hooks(mpu, hook):
    """Under a user's saved-tensor hooks the node hands over x, fc1's output, h and probs (no
    parameter) and the results are bitwise those without hooks; retain_graph backward twice."""
    torch.manual_seed(3)
    mlp = _fused(_config())
    params = {p.data_ptr() for p in mlp.parameters()}
    x, probs = _inputs(8)
    probs.requires_grad_(True)
    dy = torch.randn(x.shape[0], H)
    y = mlp(x, torch.tensor(SPLITS), probs)[0]
    want = _grads(mlp, x, probs, y, dy)
    seen = []

    def pack(t):
        seen.append(t)
        return t

    hooks = (
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        if hook == "saved_tensors_hooks"
        else torch.autograd.graph.save_on_cpu()
    )
    with hooks:
        y2 = mlp(x, torch.tensor(SPLITS), probs)[0]
    assert torch.equal(y2, y)
    inputs = [x, probs, *mlp.parameters()]
    for retain in (True, False):  # backward twice through one graph
        got = dict(zip(want, torch.autograd.grad(y2, inputs, dy, retain_graph=retain)))
        assert all(torch.equal(got[n], want[n]) for n in want)
    if hook == "saved_tensors_hooks":
        assert not any(isinstance(t, torch.nn.Parameter) or t.data_ptr() in params for t in seen)
        T = sum(SPLITS)
        assert sorted(tuple(t.shape) for t in seen) == sorted([(T, H), (T, 2 * FFN), (T, FFN), (T,)])


@needs_megatron
@pytest.mark.parametrize(
    "setting, error, match",
    [
        (
            dict(gated_linear_unit=True, activation_func=F.gelu),
            NotImplementedError,
            "activation_func=F.gelu with gated_linear_unit=True",
        ),
        (
            dict(gated_linear_unit=False, activation_func=torch.relu),
            NotImplementedError,
            r"activation_func=torch\.relu with gated_linear_unit=False",
        ),
        (dict(glu_linear_offset=1.0), NotImplementedError, "config.glu_linear_offset=1.0"),
        (dict(activation_func_clamp_value=7.0), NotImplementedError, "config.activation_func_clamp_value"),
        (dict(moe_mlp_glu_interleave_size=32), NotImplementedError, "moe_mlp_glu_interleave_size=32"),
        (dict(use_transformer_engine_op_fuser=True), NotImplementedError, "use_transformer_engine_op_fuser"),
        (dict(activation_func_fp8_input_store=True), NotImplementedError, "activation_func_fp8_input_store"),
        (dict(delay_wgrad_compute=True), NotImplementedError, "config.delay_wgrad_compute"),
        (dict(fp8="hybrid", fp8_recipe="mxfp8"), NotImplementedError, "config.fp8_recipe='mxfp8'"),
        (
            dict(fp8="hybrid", fine_grained_activation_offloading=True, offload_modules=["expert_fc1"]),
            NotImplementedError,
            "only 'expert_fc1'",
        ),
        (dict(params_dtype=None), TypeError, "config must be Megatron's TransformerConfig"),
    ],
)
def test_grouped_mlp_refuses_unsupported_settings(mpu, setting, error, match):
    config = _config()
    for k, v in setting.items():  # set after __post_init__, which would check them against TE
        setattr(config, k, v)
    if "params_dtype" in setting:
        config = SimpleNamespace()
    with pytest.raises(error, match=match):
        _fused(config)


@needs_megatron
def test_grouped_mlp_refuses_other_linears_and_buffers(mpu):
    from megatron.core.transformer.moe.experts import GroupedMLPSubmodules

    from functional_dw.megatron import GroupedMLP, RowParallelGroupedLinear

    class Other(torch.nn.Module):
        def __init__(self, *args, **kwargs):
            super().__init__()

    spec = GroupedMLPSubmodules(linear_fc1=Other, linear_fc2=RowParallelGroupedLinear)
    with pytest.raises(TypeError, match="submodules.linear_fc1 built a Other.*ColumnParallelGroupedLinear"):
        GroupedMLP(E, _config(), spec)
    x, probs = _inputs(9)
    with pytest.raises(NotImplementedError, match="output_buffer/grad_input_buffer"):
        _fused(_config())(x, torch.tensor(SPLITS), probs, output_buffer=torch.empty_like(x))


@needs_megatron
@pytest.mark.parametrize("shard", [True, False], ids=["ShardedWeight", "plain"])
def test_grouped_mlp_megatron_offloading_bitwise_on_cpu(mpu, cuda_faked_offloading, shard):
    """Megatron's fine-grained offloading of expert_fc1 and moe_act around the one node (CUDA's
    streams faked): warm-up and steady-state steps bitwise equal to no offloading; Megatron's
    hooks get x, fc1's output and h (probs are under min_offloaded_tensor_size), never a weight."""
    from support.megatron_steps import FFN as F_, T, H as H_, check_ours, run_steps, summary

    ref = run_steps("fd-mlp", offload=False, shard=shard, device="cpu")
    got = run_steps("fd-mlp", offload=True, shard=shard, device="cpu")
    if shard:
        check_ours(ref, got)
    else:
        assert got["error"] is None and ref["error"] is None, got.get("traceback") or ref.get("traceback")
        assert not got["weights_through_hooks"] and got["hook_tensors"] > 0, summary(got)
        from support.megatron_steps import differences

        assert not differences(ref, got)
    # one group per MLP (named expert_fc1): x [T, H], fc1's output [T, 2F], h [T, F] in bf16
    per_mlp = T * (H_ + 3 * F_) * 2
    assert got["megatron_summary_bytes"] == {"expert_fc1": per_mlp}, got["megatron_summary_bytes"]
    steps = got["offloaded_bytes_per_step"]
    assert steps == [2 * per_mlp, per_mlp, per_mlp], steps  # warm-up both MLPs, then only the first


@needs_megatron
@pytest.mark.parametrize("names", [["expert_fc1"], ["moe_act"]])
def test_grouped_mlp_offloads_only_the_named_activations(mpu, cuda_faked_offloading, names):
    """Only expert_fc1: Megatron gets x alone (fc1's output, h, probs stay in the record); only
    moe_act: everything but x. Bitwise equal to no offloading."""
    from megatron.core.pipeline_parallel.fine_grained_activation_offload import (
        ChunkOffloadHandler,
        FineGrainedActivationOffloadingInterface as off,
    )

    from support.megatron_steps import _init_chunk_handler

    pushed = []
    push = ChunkOffloadHandler.tensor_push

    def spy(handler, t):
        pushed.append(tuple(t.shape))
        return push(handler, t)

    def run(offload):
        torch.manual_seed(4)
        kw = dict(fine_grained_activation_offloading=True, offload_modules=names, min_offloaded_tensor_size=1)
        mlp = _fused(_config(**(kw if offload else {})))
        x, probs = _inputs(10)
        probs.requires_grad_(True)
        if offload:
            off.reset_instance()
            _init_chunk_handler(mlp.config)
        y = mlp(x, torch.tensor(SPLITS), probs)[0]
        g = _grads(mlp, x, probs, y, torch.ones_like(y))
        if offload:
            off.reset()
        return y, g

    y, g = run(False)
    ChunkOffloadHandler.tensor_push = spy
    try:
        y2, g2 = run(True)
    finally:
        ChunkOffloadHandler.tensor_push = push
    assert torch.equal(y, y2) and all(torch.equal(g[n], g2[n]) for n in g)
    T = sum(SPLITS)
    want = [(T, H)] if names == ["expert_fc1"] else [(T, FFN), (T, 2 * FFN), (T,)]
    assert sorted(pushed) == sorted(want), pushed
