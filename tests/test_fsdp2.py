"""FSDP2 (``torch.distributed.fsdp.fully_shard``) over a model of ``functional_dw.nn`` layers:
an expert MLP (two GroupedLinear layers, a Linear on a 3-D view, an in-place residual add).

Every case compares the sharded model with the same unsharded model (same init) on every
rank's tokens: outputs and x's grads per rank, and each parameter's grad (its full tensor)
with the mean over ranks of the per-rank grads, which is what FSDP2's reduce-scatter makes.
Cases: reshard_after_forward True and False, MixedPrecisionPolicy (bf16 params, fp32 reduce),
``save_on_cpu`` and a Megatron-style offloading hook (only activations reach the hook),
``retain_graph`` (two backwards), frozen experts, two SGD steps, the layouts of a group's
weights (one buffer, one ``[E, out, in]`` parameter), and plain ``fully_shard`` calls. And
``nn.GroupedMLP``, one FSDP2 unit (NOTE: [FSDP2 over GroupedMLP]), on 2 ranks: alone and in a
block, both layouts, with and without biases and probs, over three SGD steps; ``fully_shard``
on its fc1 or fc2 alone is refused.

gloo on CPU with 2 and 4 ranks: one spawn per world size runs every case; each case is
reported as its own test. Tokens per (rank, expert) are uneven, expert 1 gets none, rank 3
none at all; ffn 18 shards unevenly over 4 ranks and the 3 experts of a stacked weight leave
rank 3 of 4 without rows.
"""

from __future__ import annotations

import traceback
from functools import partial

import pytest
import torch
import torch.nn.functional as F

import functional_dw as fd
from functional_dw import distributed as fdd
from helpers import HANG_S

E, H, FFN = 3, 16, 18
SPLITS = [[4, 0, 2], [0, 0, 6], [2, 0, 2], [0, 0, 0]]  # tokens per expert on rank r (T even)
CASES = [
    "plain",
    "reshard-false",
    "raw-fully_shard",
    "mixed-bf16",
    "save_on_cpu",
    "offload-hook",
    "retain-graph",
    "frozen-experts",
    "sgd-two-steps",
    "single-layout",
    "per-expert-layout-stacks",
]


class ExpertMLP(torch.nn.Module):
    """fc1 -> gelu -> fc2 (GroupedLinear, E experts) -> proj (Linear, on a [2, T/2, H] view) -> += x."""

    def __init__(self, single: bool = False, path: bool | None = None, ffn: int = FFN) -> None:
        super().__init__()
        kw = dict(backend="torch", use_grouped_tensor=path, single_grouped_weight=single)
        self.fc1 = fd.nn.GroupedLinear(E, H, ffn, **kw)
        self.fc2 = fd.nn.GroupedLinear(E, ffn, H, **kw)
        self.proj = fd.nn.Linear(H, H, backend="torch")

    def forward(self, x: torch.Tensor, splits: list[int]) -> torch.Tensor:
        y = self.fc2(F.gelu(self.fc1(x, splits)), splits)
        y = self.proj(y.view(2, -1, H))  # NOTE: [Outputs made inside fwd are not views]
        y += x.view(2, -1, H)
        return y


def _model(single: bool = False, path: bool | None = None, ffn: int = FFN) -> ExpertMLP:
    torch.manual_seed(0)  # the same full weights on every rank, sharded or not
    return ExpertMLP(single, path, ffn)


def _tokens(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    T = sum(SPLITS[rank])
    return torch.randn(T, H, generator=g), torch.randn(2, T // 2, H, generator=g)


def _step(model, rank, dtype=torch.float32, backwards=1, hook=None):
    """One forward and ``backwards`` backwards of rank ``rank``'s tokens: (y, x.grad)."""
    x, dy = _tokens(rank)
    x = x.to(dtype).requires_grad_()
    with hook if hook is not None else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        y = model(x, SPLITS[rank])
    for i in range(backwards):
        y.backward(dy.to(y.dtype), retain_graph=i + 1 < backwards)
    return y.detach(), x.grad


def _reference(world, dtype=torch.float32, backwards=1, frozen=False, steps=1, lr=0.0, single=False, ffn=FFN):
    """The unsharded model on every rank's tokens, at each step: per rank (y, x.grad), and the
    mean over ranks of the parameters' grads (accumulated in fp32 from grads in ``dtype``);
    then the parameters after the steps (SGD with ``lr``)."""
    ref = _model(single, ffn=ffn).to(dtype)
    if frozen:
        ref.fc1.requires_grad_(False)
    outs, grads = [], []
    for _ in range(steps):
        mean = {n: torch.zeros(p.shape) for n, p in ref.named_parameters() if p.requires_grad}
        outs.append([])
        for r in range(world):
            ref.zero_grad()
            outs[-1].append(_step(ref, r, dtype, backwards))
            for n, p in ref.named_parameters():
                if p.requires_grad:
                    mean[n] += p.grad.float() / world
        grads.append(mean)
        with torch.no_grad():
            for n, p in ref.named_parameters():
                if p.requires_grad:
                    p -= lr * mean[n].to(dtype)
    return outs, grads, {n: p.detach().float() for n, p in ref.named_parameters()}


def _close(actual, expected, what, rtol=1e-5, atol=1e-6):
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


class _Offload:
    """A Megatron-style offloading hook: pack copies the activation to host memory and keeps
    its device; unpack copies it back there. Records the shapes it packed."""

    def __init__(self) -> None:
        self.shapes: list[tuple[int, ...]] = []

    def pack(self, t: torch.Tensor) -> tuple[torch.device, torch.Tensor]:
        host = torch.empty(t.shape, dtype=t.dtype, device="cpu")
        host.copy_(t, non_blocking=True)
        self.shapes.append(tuple(t.shape))
        return t.device, host

    def unpack(self, packed: tuple[torch.device, torch.Tensor]) -> torch.Tensor:
        device, host = packed
        return host.to(device, non_blocking=True)


GROUPED_FFN = 20  # the grouped GEMM (grouped_mm) needs rows of 16-byte multiples: 18 fp32 runs the split path


def _weight_stacks(ops) -> list:
    return [s for s in ops.named("stack") if s in ((E, GROUPED_FFN, H), (E, H, GROUPED_FFN))]


def _case(case: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor

    from conftest import CopyCounter

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    single = case == "single-layout"
    layouts = case in ("single-layout", "per-expert-layout-stacks")
    path, ffn = (True, GROUPED_FFN) if layouts else (None, FFN)  # the grouped GEMM: one [E, out, in] operand
    model = _model(single, path, ffn)
    dtype, backwards, steps, lr, hook, kw = torch.float32, 1, 1, 0.0, None, {}
    if case == "frozen-experts":
        model.fc1.requires_grad_(False)
    if case == "reshard-false":
        kw = dict(reshard_after_forward=False)
    if case == "mixed-bf16":
        dtype, kw = (
            torch.bfloat16,
            dict(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)),
        )
    if case == "raw-fully_shard":
        mesh = init_device_mesh("cpu", (world,))
        for m in (model.fc1, model.fc2, model.proj, model):
            fully_shard(m, mesh=mesh)
    else:
        fdd.shard_module(model, **kw)
    assert all(isinstance(m, FSDPModule) for m in (model.fc1, model.fc2, model.proj, model))
    assert all(isinstance(p, DTensor) for p in model.parameters())
    offload = _Offload()
    if case == "save_on_cpu":
        hook = torch.autograd.graph.save_on_cpu()
    elif case == "offload-hook":
        hook = torch.autograd.graph.saved_tensors_hooks(offload.pack, offload.unpack)
    backwards = 2 if case == "retain-graph" else 1
    steps, lr = (2, 0.5) if case == "sgd-two-steps" else (1, 0.0)
    outs, grads, final = _reference(world, dtype, backwards, case == "frozen-experts", steps, lr, single, ffn)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr) if steps > 1 else None
    ops = CopyCounter()
    for step in range(steps):
        model.zero_grad()
        with ops:
            y, dx = _step(model, rank, dtype, backwards, hook)
        tol = dict(rtol=1.6e-2, atol=1e-2) if dtype == torch.bfloat16 else {}  # (bf16 sums in another order)
        _close(y, outs[step][rank][0], f"output (step {step})", **tol)
        _close(dx, outs[step][rank][1], f"x.grad (step {step})", **tol)
        for n, p in model.named_parameters():
            if not p.requires_grad:
                assert p.grad is None, n
                continue
            assert isinstance(p.grad, DTensor) and p.grad.dtype == torch.float32, (n, type(p.grad), p.grad.dtype)
            _close(p.grad.full_tensor(), grads[step][n], f"{n}.grad (step {step})")
        if opt is not None:
            opt.step()
    if case == "frozen-experts":
        assert [n for n, p in model.named_parameters() if p.grad is None] == [
            n for n, _ in model.fc1.named_parameters(prefix="fc1")
        ]
    if opt is not None:
        for n, p in model.named_parameters():
            _close(p.detach().full_tensor(), final[n], f"{n} after {steps} SGD steps")
    if case == "offload-hook":
        weights = {tuple(p.shape) for p in _model().parameters()}
        assert offload.shapes, "the hook packed nothing"
        assert not weights & set(offload.shapes), f"weights went through the hook: {offload.shapes}"
    if case == "single-layout":  # NOTE: [One buffer] under FSDP2: one [E, out, in] parameter, no stack
        assert _weight_stacks(ops) == [], _weight_stacks(ops)
    if case == "per-expert-layout-stacks":  # FSDP2 gathers each expert into its own tensor: one stack per GEMM
        assert len(_weight_stacks(ops)) >= 4, _weight_stacks(ops)  # (fc1 and fc2, forward and backward)


def _job() -> dict[str, str | None]:
    out = {}
    for case in CASES:
        try:
            _case(case)
            out[case] = None
        except Exception:
            out[case] = traceback.format_exc()
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=["W2", "W4"])
def results(request):
    pytest.importorskip("torch.distributed.fsdp")
    return fdd.launch(_job, request.param, backend="gloo", timeout=HANG_S, deadline=HANG_S)


@pytest.mark.parametrize("case", CASES)
def test_fsdp2_equals_unsharded(results, case):
    failures = [f"rank {r}: {res[case]}" for r, res in enumerate(results) if res[case] is not None]
    assert not failures, "\n".join(failures)


def test_shard_module_refuses_bad_input():
    with pytest.raises(TypeError, match="model: shard_module takes a torch.nn.Module"):
        fdd.shard_module([torch.nn.Linear(2, 2)])
    with pytest.raises(RuntimeError, match="init_process_group"):
        fdd.shard_module(_model())


# --- GroupedMLP: one FSDP2 unit (NOTE: [FSDP2 over GroupedMLP] in functional_dw/nn.py) ----------

MLP_FFN = 20  # (fc1: 2 * 20 SwiGLU rows; fp32 rows of 16-byte multiples: the grouped GEMM runs)
MLP_SPLITS = SPLITS[:2]  # 2 ranks: uneven, expert 1 without tokens on both
MLP_LR, MLP_MOMENTUM, MLP_STEPS = 0.1, 0.9, 3
# (host, layout, bias, probs): a GroupedMLP alone (probs an input) or inside a MoE block (probs
# from a router), each layout of the experts' weights, with and without biases and probs
MLP_CASES = {
    f"{host}-{layout}{'-bias' if bias else ''}{'-probs' if probs else ''}": (host, layout, bias, probs)
    for host in ("alone", "in-block")
    for layout in ("per-expert", "single")
    for bias in (False, True)
    for probs in (False, True)
}


class MoEBlock(torch.nn.Module):
    """x + proj(experts(norm(x), splits, probs)): a LayerNorm, a router (torch's Linear; probs:
    the softmax's entry for each token's expert), a GroupedMLP and a Linear around it."""

    def __init__(self, single: bool = False, bias: bool = False, probs: bool = True) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(H)
        self.router = torch.nn.Linear(H, E) if probs else None
        self.experts = fd.nn.GroupedMLP(E, H, MLP_FFN, bias=bias, single_grouped_weight=single, backend="torch")
        self.proj = fd.nn.Linear(H, H, backend="torch")

    def forward(self, x: torch.Tensor, splits: list[int]) -> torch.Tensor:
        h, probs = self.norm(x), None
        if self.router is not None:
            expert = torch.repeat_interleave(torch.arange(E), torch.tensor(splits))
            probs = self.router(h).softmax(-1).gather(1, expert[:, None]).squeeze(1)
        return x + self.proj(self.experts(h, splits, probs))


def _mlp_model(host: str, layout: str, bias: bool, probs: bool) -> torch.nn.Module:
    torch.manual_seed(0)  # the same full weights on every rank, sharded or not
    single = layout == "single"
    if host == "alone":
        return fd.nn.GroupedMLP(E, H, MLP_FFN, bias=bias, single_grouped_weight=single, backend="torch")
    return MoEBlock(single, bias, probs)


def _mlp_step(model: torch.nn.Module, rank: int, probs: bool) -> tuple:
    """One forward and backward of rank ``rank``'s tokens: (y, x.grad, probs.grad or None); a
    GroupedMLP alone gets probs as an input, a block makes them."""
    g = torch.Generator().manual_seed(200 + rank)
    T = sum(MLP_SPLITS[rank])
    x, dy = torch.randn(T, H, generator=g).requires_grad_(), torch.randn(T, H, generator=g)
    p = torch.rand(T, generator=g).requires_grad_() if probs and isinstance(model, fd.nn.GroupedMLP) else None
    if isinstance(model, fd.nn.GroupedMLP):
        y = model(x, MLP_SPLITS[rank], p)
    else:
        y = model(x, MLP_SPLITS[rank])
    y.backward(dy)
    return y.detach(), x.grad, None if p is None else p.grad


def _sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=MLP_LR, momentum=MLP_MOMENTUM)


def _mlp_reference(world: int, *spec) -> tuple[list, list, dict]:
    """The unsharded model on every rank's tokens, per step: per rank (y, x.grad, probs.grad),
    and the mean over ranks of the parameters' grads, which the step applies; then the
    parameters after the steps."""
    ref = _mlp_model(*spec)
    opt = _sgd(ref.parameters())
    outs, grads = [], []
    for _ in range(MLP_STEPS):
        mean = {n: torch.zeros(p.shape) for n, p in ref.named_parameters()}
        outs.append([])
        for r in range(world):
            ref.zero_grad()
            outs[-1].append(_mlp_step(ref, r, spec[3]))
            for n, p in ref.named_parameters():
                mean[n] += p.grad / world
        grads.append(mean)
        for n, p in ref.named_parameters():
            p.grad = mean[n].clone()
        opt.step()
    return outs, grads, {n: p.detach().clone() for n, p in ref.named_parameters()}


def _mlp_case(host: str, layout: str, bias: bool, probs: bool) -> None:
    """shard_module over a GroupedMLP (alone or in a block): one FSDP2 unit holding fc1's and
    fc2's parameters; outputs, x's and probs' grads, every parameter's grad and the parameters
    after SGD steps equal the unsharded model's."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    spec = (host, layout, bias, probs)
    model = fdd.shard_module(_mlp_model(*spec))
    mlp = model if host == "alone" else model.experts
    assert isinstance(mlp, FSDPModule) and not isinstance(mlp.fc1, FSDPModule) and not isinstance(mlp.fc2, FSDPModule)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    outs, grads, final = _mlp_reference(world, *spec)
    opt = _sgd(model.parameters())
    for step in range(MLP_STEPS):
        model.zero_grad()
        y, dx, dprobs = _mlp_step(model, rank, probs)
        want = outs[step][rank]
        _close(y, want[0], f"output (step {step})")
        _close(dx, want[1], f"x.grad (step {step})")
        if want[2] is not None:
            _close(dprobs, want[2], f"probs.grad (step {step})")
        for n, p in model.named_parameters():
            _close(p.grad.full_tensor(), grads[step][n], f"{n}.grad (step {step})")
        opt.step()
    for n, p in model.named_parameters():
        _close(p.detach().full_tensor(), final[n], f"{n} after {MLP_STEPS} SGD steps")


def _mlp_layers_sharded_alone() -> None:
    """fully_shard on fc1 or fc2 of a GroupedMLP (whose forward never calls them): a ValueError
    naming the layer and the fix, on every rank, instead of a sharded DTensor in the GEMM."""
    from torch.distributed.fsdp import fully_shard

    for layer in ("fc1", "fc2"):
        mlp = _mlp_model("alone", "single", True, True)
        fully_shard(getattr(mlp, layer))
        fully_shard(mlp)
        x = torch.randn(sum(MLP_SPLITS[0]), H)
        try:  # (not pytest.raises: its failure is a BaseException, which would end the rank)
            mlp(x, MLP_SPLITS[0], torch.rand(x.shape[0]))
            raise AssertionError(f"{layer} sharded on its own: no error")
        except ValueError as e:
            assert f"its {layer} (FSDPGroupedLinear) is sharded on its own" in str(e), e
            assert "apply fully_shard to the GroupedMLP instead" in str(e), e


def _mlp_job() -> dict[str, str | None]:
    out = {}
    cases = {
        **{c: partial(_mlp_case, *spec) for c, spec in MLP_CASES.items()},
        "fc1-or-fc2-alone": _mlp_layers_sharded_alone,
    }
    for case, fn in cases.items():
        try:
            fn()
            out[case] = None
        except Exception:
            out[case] = traceback.format_exc()
    return out


@pytest.fixture(scope="module")
def mlp_results():
    pytest.importorskip("torch.distributed.fsdp")
    return fdd.launch(_mlp_job, 2, backend="gloo", timeout=HANG_S, deadline=HANG_S)


@pytest.mark.parametrize("case", [*MLP_CASES, "fc1-or-fc2-alone"])
def test_fsdp2_grouped_mlp_equals_unsharded(mlp_results, case):
    failures = [f"rank {r}: {res[case]}" for r, res in enumerate(mlp_results) if res[case] is not None]
    assert not failures, "\n".join(failures)
