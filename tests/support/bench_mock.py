"""Dry-run benchmarks/bench.py on the CPU (used by test_bench_script.py): CUDA timing, TE
modules and the "te" backend are stood in for, so the script's flow and tables are checked;
nothing here measures anything. Every clock the script reads is fake and returns fixed numbers
(the timings are data), so the report is the same however fast or busy the machine is."""

import itertools
import sys
import types

import torch

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))  # this checkout's package
import functional_dw as fd  # noqa: E402

gp, ll = sys.modules["functional_dw.grouped_plan"], sys.modules["functional_dw.linear"]
from functional_dw.kernels import get_kernels as real_get  # noqa: E402

# CUDA event times: a fixed cycle of milliseconds, multiples of 0.0005 (a median of two is still
# exact at the 4 decimals the script keeps), small enough that the smoke shapes' TFLOP/s and the
# dense peak are well above the 0.1 they are rounded to, and unequal so ratios are not all 1.
FAKE_MS = itertools.cycle([0.002, 0.003, 0.005, 0.004, 0.006])


class Ev:
    def __init__(self, enable_timing=True):
        pass

    def record(self):
        pass

    def synchronize(self):
        pass

    def elapsed_time(self, other):
        return next(FAKE_MS)


torch.cuda.Event = Ev
torch.cuda.synchronize = lambda *a: None
torch.cuda.reset_peak_memory_stats = lambda *a: None
torch.cuda.memory_allocated = lambda *a: 0
torch.cuda.max_memory_allocated = lambda *a: 0
torch.cuda.empty_cache = lambda: None
torch.cuda.get_device_name = lambda *a: "CPU (mock)"


def fake_get(backend, x, w=None):
    return real_get("torch" if backend == "te" else backend, x, w)


gp.get_kernels = ll.get_kernels = fake_get
te = types.ModuleType("transformer_engine.pytorch")


class GL(fd.nn.GroupedLinear):
    def __init__(self, *a, use_grouped_tensor=None, **k):
        super().__init__(*a, use_grouped_tensor=use_grouped_tensor, backend="torch", **k)
        if use_grouped_tensor and a[0] > 64:
            raise RuntimeError("A_list supports up to 64 tensors per kernel")


te.GroupedLinear, te.Linear = GL, fd.nn.Linear
pkg = types.ModuleType("transformer_engine")
pkg.pytorch = te
sys.modules["transformer_engine"], sys.modules["transformer_engine.pytorch"] = pkg, te
# TE's FP8 autocast and recipes: fd.nn.GroupedLinear (the mock's te.GroupedLinear) follows the
# autocast through FP8GlobalStateManager, as it does TE's; the recipes are ours (as_recipe takes them)
import contextlib  # noqa: E402
from functional_dw import fp8  # noqa: E402


class Manager:
    recipe = None

    @classmethod
    def is_fp8_enabled(cls):
        return cls.recipe is not None

    @classmethod
    def get_fp8_recipe(cls):
        return cls.recipe


@contextlib.contextmanager
def autocast(enabled=True, recipe=None, **kw):
    old, Manager.recipe = Manager.recipe, (recipe if enabled else None)
    try:
        yield
    finally:
        Manager.recipe = old


te.autocast = autocast
quant = types.ModuleType("transformer_engine.pytorch.quantization")
quant.FP8GlobalStateManager = Manager
common, recipes = types.ModuleType("transformer_engine.common"), types.ModuleType("transformer_engine.common.recipe")
recipes.DelayedScaling, recipes.Float8CurrentScaling, recipes.Float8BlockScaling = (
    fp8.DelayedScaling,
    fp8.Float8CurrentScaling,
    fp8.Float8BlockScaling,
)
pkg.common, common.recipe = common, recipes
sys.modules.update(
    {
        "transformer_engine.pytorch.quantization": quant,
        "transformer_engine.common": common,
        "transformer_engine.common.recipe": recipes,
    }
)
tex = types.ModuleType("transformer_engine_torch")
tex.get_cublasLt_version = lambda: 0
sys.modules["transformer_engine_torch"] = tex


def fake_ao_gmm(A, B_t, offs, out_dtype=torch.bfloat16, float8_dtype=None, pad_token_groups_for_grouped_mm=True):
    """torchao 0.18's FP8 rowwise grouped GEMM stood in for (bf16 products), with its argument
    checks: A [M, K] row-major, B_t [E, K, N] column-major per group, offs int32 group ends."""
    assert not pad_token_groups_for_grouped_mm and offs.dtype == torch.int32 and B_t.ndim == 3
    assert (
        A.shape[1] == B_t.shape[1]
        and B_t.stride(-2) == 1
        and B_t.stride(-1) == B_t.shape[1]
        and offs.numel() == B_t.shape[0]
    )
    ends = offs.tolist()
    return torch.cat([A[s:e] @ B_t[g] for g, (s, e) in enumerate(zip([0] + ends[:-1], ends))]).to(out_dtype)


ao, ao_proto, ao_moe = (types.ModuleType(n) for n in ("torchao", "torchao.prototype", "torchao.prototype.moe_training"))
ao_moe._to_fp8_rowwise_then_scaled_grouped_mm = fake_ao_gmm
ao.prototype, ao_proto.moe_training = ao_proto, ao_moe
sys.modules.update({"torchao": ao, "torchao.prototype": ao_proto, "torchao.prototype.moe_training": ao_moe})
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2] / "benchmarks"))
import bench  # noqa: E402
import bench_sections  # noqa: E402
import bench_timing  # noqa: E402

bench_timing.DEV = "cpu"  # (every section reads bench_timing.DEV)


class FakeTime:
    """bench_timing's ``time``: perf_counter (host times) and monotonic (section seconds, --budget)
    advance by a fixed step per call; anything else it might read from ``time`` is missing on purpose."""

    perf_counter = itertools.count(0.0, 1e-4).__next__
    monotonic = itertools.count(0.0, 0.01).__next__


bench_timing.time = FakeTime


class FakeGraphed:
    """A CUDA graph stood in for: a replay runs the step eagerly on the static inputs."""

    def __init__(self, step, inputs):
        self.step, self.inputs = step, inputs
        self.outputs = step(*inputs)

    def __call__(self, *new):
        with torch.no_grad():
            for s, n in zip(self.inputs, new):
                if n is not None:
                    s.copy_(n)
        self.outputs = self.step(*self.inputs)
        return self.outputs


bench_sections.graph_step = lambda step, *inputs, **kw: FakeGraphed(step, inputs)
_orig_save_on_cpu = torch.autograd.graph.save_on_cpu
torch.autograd.graph.save_on_cpu = lambda pin_memory=False: _orig_save_on_cpu(pin_memory=False)
bench.main(["--smoke", "--repeats", "2", "--out", sys.argv[1], *sys.argv[2:]])
