"""CUDA graphs, the parts a CPU can check: the clear errors for splits that cannot be captured
(capture is simulated), and ``functional_dw.graphs``' argument errors (what to pass instead) and
CPU pass-through.
The captures themselves run in ``tests/test_graphs_gpu.py``."""

from __future__ import annotations

import types

import pytest
import torch

import functional_dw as fd
from functional_dw import kernels
from functional_dw.kernels import Splits


@pytest.fixture
def capturing(monkeypatch):
    """Pretend the current CUDA stream is capturing a graph."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)


def test_device_splits_on_the_split_path_raise_clearly_under_capture(capturing):
    fake_cuda = types.SimpleNamespace(is_cuda=True)  # a CUDA splits tensor, as far as sizes() asks
    s = Splits(host=None, tensor=fake_cuda, device=torch.device("cuda"), num_tokens=4, num_experts=2)
    with pytest.raises(RuntimeError, match="split path .* host.* sync, which CUDA graph capture forbids"):
        s.sizes()


def test_host_splits_copied_to_the_gpu_raise_clearly_under_capture(capturing):
    with pytest.raises(RuntimeError, match="splits given on the host .* cannot be captured"):
        kernels.to_device([1, 2], torch.int64, torch.device("cuda"))


def test_host_splits_outside_capture_are_untouched(capturing):
    s = Splits(host=(1, 3), tensor=None, device=torch.device("cpu"), num_tokens=4, num_experts=2)
    assert s.sizes() == (1, 3)  # host sizes need no device: nothing to refuse
    assert kernels.to_device([1, 2], torch.int64, torch.device("cpu")).tolist() == [1, 2]


# --- functional_dw.graphs: argument errors (checked before CUDA is needed) -------------------


def _step(*a):
    return None


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(step=3), TypeError, "step must be callable"),
        (dict(inputs=(torch.ones(2), "x")), TypeError, r"inputs\[1\] must be a torch.Tensor, got str"),
        (dict(params=[torch.ones(2), None]), TypeError, r"params\[1\] must be a torch.Tensor, got NoneType"),
        (dict(grads="sum"), ValueError, "grads must be one of"),
        (dict(warmup=0), ValueError, "warmup must be an int >= 1"),
        (dict(warmup=True), ValueError, "warmup must be an int >= 1"),
        (dict(warmup=2.0), ValueError, "warmup must be an int >= 1"),
    ],
)
def test_graph_step_argument_errors(kwargs, exc, match):
    kwargs = dict(kwargs)  # the parameter's own dict outlives the session: mutmut runs pytest again in the same process
    step = kwargs.pop("step", _step)
    inputs = kwargs.pop("inputs", ())
    with pytest.raises(exc, match=match):
        fd.graphs.graph_step(step, *inputs, **kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_graph_step_without_cuda_says_so():
    with pytest.raises(RuntimeError, match="CUDA graphs need a CUDA device"):
        fd.graphs.graph_step(_step)


def test_graph_step_names_a_cpu_input(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # get past the device check
    with pytest.raises(ValueError, match=r"inputs\[0\] is on cpu; a CUDA graph reads and writes CUDA memory only"):
        fd.graphs.graph_step(_step, torch.ones(2))
    with pytest.raises(ValueError, match=r"params\[0\] is on cpu"):
        fd.graphs.graph_step(_step, params=[torch.ones(2)])


def test_graphed_step_checks_new_inputs_and_rebound_grads():
    class FakeGraph:
        replays = 0

        def replay(self):
            FakeGraph.replays += 1

    x, w = torch.zeros(3), torch.ones(2, requires_grad=True)
    w.grad = torch.zeros(2)
    g = fd.graphs.GraphedStep(FakeGraph(), (x,), "out", [(w, w.grad)], "accumulate")
    assert g(torch.full((3,), 2.0)) == "out" and x.tolist() == [2.0] * 3 and FakeGraph.replays == 1
    assert g(None) == "out" and x.tolist() == [2.0] * 3  # None keeps the static input
    with pytest.raises(ValueError, match=r"inputs\[0\] must be torch.float32\(3,\) as captured"):
        g(torch.zeros(4))
    with pytest.raises(TypeError, match="takes 1 inputs"):
        g(x, x)
    w.grad.add_(5)
    g.zero_grad()
    assert w.grad.tolist() == [0.0, 0.0]
    w.grad = None  # what optimizer.zero_grad() does by default
    with pytest.raises(RuntimeError, match=r"set to None since capture.*zero_grad\(set_to_none=False\)"):
        g()
    assert FakeGraph.replays == 2


@pytest.mark.parametrize(
    "params,match",
    [
        (lambda m: m, r"params must be a sequence of tensors \(e\.g\. model\.parameters\(\)\), got GroupedLinear"),
        (lambda m: None, r"params must be a sequence of tensors \(e\.g\. model\.parameters\(\)\), got NoneType"),
        (lambda m: m.named_parameters(), r"params\[0\] is a \(name, tensor\) pair: pass model\.parameters\(\)"),
    ],
    ids=["module", "none", "named"],
)
def test_graph_step_params_errors_say_what_to_pass(params, match):
    """Was: "'GroupedLinear' object is not iterable", "'NoneType' object is not iterable",
    "params[0] must be a torch.Tensor, got tuple"."""
    m = fd.nn.GroupedLinear(2, 16, 16)
    with pytest.raises(TypeError, match=match):
        fd.graphs.graph_step(_step, params=params(m))


def test_graph_step_checks_flags_and_takes_numpy_warmup():
    np = pytest.importorskip("numpy")
    with pytest.raises(TypeError, match="check_sync must be True or False"):
        fd.graphs.graph_step(_step, check_sync="no")  # was: taken as True
    if torch.cuda.is_available():  # an empty step captures: the warm-up count was taken
        assert isinstance(fd.graphs.graph_step(_step, warmup=np.int64(2)), fd.graphs.GraphedStep)
    else:  # past the warm-up check to the device check (was: "warmup must be an int >= 1 ... np.int64(2)")
        with pytest.raises(RuntimeError, match="CUDA graphs need a CUDA device"):
            fd.graphs.graph_step(_step, warmup=np.int64(2))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_make_graphed_callables_without_cuda_says_so():
    """Was: torch's "Tried to instantiate dummy base class CUDAGraph"."""
    m = fd.nn.Linear(4, 4)
    with pytest.raises(RuntimeError, match="make_graphed_callables: CUDA graphs need a CUDA device"):
        fd.graphs.make_graphed_callables(m, (torch.ones(2, 4),))


# --- PinnedOffload on the CPU: everything passes through --------------------------------------


def test_pinned_offload_keeps_cpu_tensors_as_they_are():
    x = torch.randn(6, 16, requires_grad=True)
    ws = [torch.randn(8, 16, requires_grad=True) for _ in range(2)]
    off = fd.graphs.PinnedOffload()
    with off:
        y = fd.grouped_linear(x, ws, [2, 4])
    y.sum().backward()
    want = torch.autograd.grad(fd.grouped_linear(x, ws, [2, 4]).sum(), [x, *ws])
    for a, b in zip([x.grad, *[w.grad for w in ws]], want):
        assert torch.equal(a, b)
    assert off.buffers == []


@pytest.mark.parametrize("bad", [-1, 1.5, True, "0"])
def test_pinned_offload_min_bytes_errors(bad):
    with pytest.raises(ValueError, match="min_bytes must be an int >= 0"):
        fd.graphs.PinnedOffload(min_bytes=bad)


# --- make_graphed_callables' grads: the aliasing torch's version has, and the fix -------------


class _GraphedLike(torch.autograd.Function):
    """What torch.cuda.make_graphed_callables' backward does: replay (here: fill the static grad
    buffer with this call's gradient) and return ``static.detach()``."""

    static = torch.zeros(3)

    @staticmethod
    def forward(ctx, w, value):
        ctx.value = value
        return w * 1

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        _GraphedLike.static.fill_(ctx.value)
        return _GraphedLike.static.detach(), None


def _two_calls(w):
    for value in (1.0, 2.0):
        _GraphedLike.apply(w, value).sum().backward()
    return w.grad


def test_graphed_grads_alias_the_static_buffer_without_the_fix():
    w = torch.ones(3, requires_grad=True)
    assert _two_calls(w).tolist() == [4.0] * 3  # 2 + 2: the second replay overwrote the first grad
    assert w.grad.data_ptr() == _GraphedLike.static.data_ptr()


def test_own_grads_makes_graphed_grads_accumulate_as_in_eager():
    w = torch.ones(3, requires_grad=True)
    frozen = torch.ones(3)  # no hook for a tensor without grad
    handles = fd.graphs._own_grads([w, frozen])
    assert len(handles) == 1
    assert _two_calls(w).tolist() == [3.0] * 3
    assert w.grad.data_ptr() != _GraphedLike.static.data_ptr()
    w.grad = None  # zeroed the default way: the next call copies again
    assert _two_calls(w).tolist() == [3.0] * 3


def test_make_graphed_callables_restores_main_grad(monkeypatch):
    """The wrapper around torch's: main_grad as before torch's warm-up, hooks on the module's
    trainable parameters (torch's function stood in for: it needs CUDA)."""
    lin = fd.nn.Linear(4, 3, bias=True)
    lin.weight.main_grad = torch.zeros(3, 4)
    lin.bias.requires_grad_(False)

    def fake(callables, sample_args, **kw):
        lin.weight.main_grad.add_(7.0)  # what the warm-up's backwards do
        return "graphed"

    monkeypatch.setattr(torch.cuda, "make_graphed_callables", fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # get past the device check
    hooked = []
    monkeypatch.setattr(fd.graphs, "_own_grads", lambda ps: hooked.extend(p for p in ps if p.requires_grad))
    assert fd.graphs.make_graphed_callables(lin, (torch.ones(2, 4),)) == "graphed"
    assert torch.count_nonzero(lin.weight.main_grad) == 0
    assert hooked == [lin.weight]


def test_a_failed_capture_names_a_live_eager_graph_and_calls_the_rng_repair(monkeypatch):
    """CUDA's "legacy stream" error comes from inside the step, then capture_end's "previous
    error during capture" replaces it: _capture finds the first in the chain, adds the live-graph
    hint, and calls the generator's repair (NOTE: [A failed capture's RNG]; the repair itself runs
    in test_graphs_gpu's live-eager-graph case) whatever the error."""
    import contextlib

    class Graph:
        pass

    @contextlib.contextmanager
    def graph(g, pool=None):  # capture_end fails after a CUDA error or an empty step; another error passes
        try:
            yield
        except RuntimeError:
            pass
        raise RuntimeError("CUDA error: operation failed due to a previous error during capture")

    def step():
        raise RuntimeError("CUDA error: operation would make the legacy stream depend on a capturing blocking stream")

    repaired = []
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(fd.graphs, "_unstick_rng", lambda: repaired.append(1))
    with pytest.raises(RuntimeError, match="(?s)capture failed.*still alive.*legacy stream") as info:
        fd.graphs._capture(step, [], None)
    assert "previous error during capture" in str(info.value.__cause__)  # chained to what torch raised
    with pytest.raises(RuntimeError, match="(?s)capture failed(?!.*still alive)"):
        fd.graphs._capture(lambda: None, [], None)  # capture_end's error alone: the general hint
    with pytest.raises(ValueError, match="mine"):
        fd.graphs._capture(lambda: (_ for _ in ()).throw(ValueError("mine")), [], None)
    assert repaired == [1, 1]  # (a ValueError is not a capture failure: not repaired)
