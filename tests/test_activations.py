"""Activations as records (functional_dw/activations.py, issue 39): a toy activation added by
docs/mlp.md's recipe ("Adding an activation") runs through grouped_mlp and nn.GroupedMLP as a
plain torch composition does (forward, backward, torch.func.jvp), gated and not; the tables
derived from the records agree with the Triton kernels' ACT switch and Megatron's config; bad
registrations are refused naming what is wrong."""

from __future__ import annotations

import ast
import inspect
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import functional_dw as fd
from functional_dw import activations
from functional_dw.activations import ACTIVATIONS, Activation, from_megatron, register, unregister
from functional_dw.kernels import activation as act_mod
from functional_dw.kernels import triton_activation, triton_math
from functional_dw.megatron_experts import mlp_activation

E, H, FFN = 3, 12, 8
SPLITS = [4, 0, 5]
T = sum(SPLITS)

# The recipe: a record (the math in torch ops: the function and its derivative) and register().
SOFTPLUS = Activation("softplus", F.softplus, torch.sigmoid, megatron=F.softplus)
SOFTPLUS_GLU = Activation("softplus_glu", F.softplus, torch.sigmoid, gated=True)
TOYS = {a.name: a for a in (SOFTPLUS, SOFTPLUS_GLU)}


@pytest.fixture
def toys():
    for a in TOYS.values():
        register(a)
    try:
        yield TOYS
    finally:
        for name in TOYS:
            unregister(name)


def _plain(x, w1, w2, probs, b1, b2, a: Activation):
    """The MLP as plain torch ops per expert, the activation written out from torch's own."""
    rows, start = [], 0
    for e, n in enumerate(SPLITS):
        z = x[start : start + n] @ w1[e].T + b1[e]
        if a.gated:
            gate, up = z.chunk(2, dim=-1)
            h = F.softplus(gate) * up
        else:
            h = F.softplus(z)
        p = probs[start : start + n, None]
        rows.append((h * p) @ w2[e].T + b2[e] * p)
        start += n
    return torch.cat(rows)


def _inputs(a: Activation, seed=0):
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    n1 = a.width * FFN
    return [r(T, H), r(E, n1, H), r(E, H, FFN), torch.rand(T, generator=g, dtype=torch.float64), r(E, n1), r(E, H)]


def _mlp(x, w1, w2, probs, b1, b2, name):
    return fd.grouped_mlp(x, w1, w2, SPLITS, probs=probs, bias1=b1, bias2=b2, activation=name)


@pytest.mark.parametrize("name", list(TOYS))
def test_a_registered_activation_runs_as_its_torch_composition(toys, name):
    a = toys[name]
    inp = [t.requires_grad_() for t in _inputs(a)]
    y, y0 = _mlp(*inp, name), _plain(*inp, a)
    torch.testing.assert_close(y, y0, rtol=1e-12, atol=1e-12)
    dy = torch.randn_like(y0)
    grads = torch.autograd.grad(y, inp, dy)
    grads0 = torch.autograd.grad(y0, inp, dy)
    for what, g, g0 in zip(("x", "w1", "w2", "probs", "bias1", "bias2"), grads, grads0):
        torch.testing.assert_close(g, g0, rtol=1e-12, atol=1e-12, msg=lambda m, what=what: f"d{what}: {m}")
    primals = tuple(t.detach() for t in inp)
    tangents = tuple(torch.randn_like(t) for t in primals)
    out, t_out = torch.func.jvp(lambda *args: _mlp(*args, name), primals, tangents)
    out0, t_out0 = torch.func.jvp(lambda *args: _plain(*args, a), primals, tangents)
    torch.testing.assert_close(out, out0, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(t_out, t_out0, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", list(TOYS))
def test_nn_grouped_mlp_takes_a_registered_activation(toys, name):
    a = toys[name]
    mlp = fd.nn.GroupedMLP(E, H, FFN, activation=name, bias=True, params_dtype=torch.float64)
    assert mlp.fc1.weight.shape == (E, a.width * FFN, H)  # fc1's width from the record
    x, probs = _inputs(a)[0], torch.rand(T, dtype=torch.float64)
    w1 = torch.stack(mlp.fc1.weights())
    w2 = torch.stack(mlp.fc2.weights())
    b1 = torch.stack(mlp.fc1.biases())
    b2 = torch.stack(mlp.fc2.biases())
    y = mlp(x, SPLITS, probs)
    torch.testing.assert_close(y, _plain(x, w1, w2, probs, b1, b2, a), rtol=1e-12, atol=1e-12)
    y.sum().backward()
    assert all(p.grad is not None for p in mlp.parameters())


def test_registered_names_are_what_grouped_mlp_accepts(toys):
    x, w1, w2, *_ = _inputs(SOFTPLUS)
    with pytest.raises(
        ValueError, match="activation must be one of 'swiglu', 'gelu', 'silu', 'softplus', 'softplus_glu', got 'relu'"
    ):
        fd.grouped_mlp(x, w1, w2, SPLITS, activation="relu")
    with pytest.raises(ValueError, match=r"activation='softplus_glu' needs 2 \* F = 16 out-features"):
        fd.grouped_mlp(x, w1, w2, SPLITS, activation="softplus_glu")  # (a [F, H] w1)


def test_a_registered_activation_compiles(toys):
    """Under torch.compile (one graph) the record is read while tracing: the same numbers."""
    inp = [t.float().requires_grad_() for t in _inputs(SOFTPLUS_GLU)]
    compiled = torch.compile(lambda *args: _mlp(*args, "softplus_glu"), fullgraph=True)
    y, y0 = compiled(*inp), _mlp(*inp, "softplus_glu")
    torch.testing.assert_close(y, y0)
    torch.testing.assert_close(torch.autograd.grad(y.sum(), inp), torch.autograd.grad(y0.sum(), inp))


def test_an_unregistered_activation_is_refused():
    register(SOFTPLUS)
    assert unregister("softplus") is SOFTPLUS
    x, w1, w2, *_ = _inputs(SOFTPLUS)
    with pytest.raises(ValueError, match="activation must be one of 'swiglu', 'gelu', 'silu', got 'softplus'"):
        fd.grouped_mlp(x, w1, w2, SPLITS, activation="softplus")


def test_an_activation_without_triton_code_runs_the_reference_on_cuda(toys, monkeypatch):
    """select picks the fused kernels only for records with Triton code (on a CUDA operand: here
    ``available`` stands in for one), and the fused kernels hand any other to the reference."""
    monkeypatch.setattr(triton_activation, "available", lambda t: True)
    x = torch.ones(2, 2)
    assert act_mod.select(None, x, "swiglu") is triton_activation.FUSED
    assert act_mod.select(None, x, "softplus") is act_mod.REFERENCE
    z, dh = torch.randn(T, 2 * FFN), torch.randn(T, FFN)
    h = triton_activation.FUSED.act_fwd(z, None, "softplus_glu")
    assert torch.equal(h, act_mod.act_fwd(z, None, "softplus_glu"))
    dz, _ = triton_activation.FUSED.act_bwd(z, None, dh, "softplus_glu")
    assert torch.equal(dz, act_mod.act_bwd(z, None, dh, "softplus_glu")[0])


# --- the tables derived from the records ------------------------------------------------------------


def _kernel(module, name: str) -> ast.FunctionDef:
    """A kernel's definition, from its module's source (Triton need not be installed)."""
    tree = ast.parse(inspect.getsource(module))
    return next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name)


def _names_called(stmts) -> set[str]:
    """The functions the statements call (``f(...)``: f; ``tl.f(...)``: f)."""
    calls = [c.func for s in stmts for c in ast.walk(s) if isinstance(c, ast.Call)]
    return {getattr(f, "id", None) or getattr(f, "attr", None) for f in calls}


def _act_branches(fn: ast.FunctionDef) -> dict:
    """The names called in each branch of the kernel's ``if ACT == c: ... elif ...: ... else:``
    chain, by code c ("else" for the last)."""
    chain = next(
        n
        for n in ast.walk(fn)
        if isinstance(n, ast.If) and isinstance(n.test, ast.Compare) and getattr(n.test.left, "id", None) == "ACT"
    )
    branches = {}
    while True:
        branches[chain.test.comparators[0].value] = _names_called(chain.body)
        if len(chain.orelse) == 1 and isinstance(chain.orelse[0], ast.If):
            chain = chain.orelse[0]
        else:
            branches["else"] = _names_called(chain.orelse)
            return branches


def test_the_triton_codes_are_the_kernels_branches():
    """Each built-in record's ``triton`` code selects the branch of the kernels' one switch,
    triton_math's ``act`` and ``act_grad``, that calls the Triton twins of its ``fn`` and
    ``grad`` (by name); the codes are distinct, and any other code has no branch."""
    fn, grad = _act_branches(_kernel(triton_math, "act")), _act_branches(_kernel(triton_math, "act_grad"))
    coded = [a for a in ACTIVATIONS.values() if a.triton is not None]
    assert len({a.triton for a in coded}) == len(coded) == 3
    assert set(fn) == set(grad) == {a.triton for a in coded} | {"else"}
    for a in coded:
        assert a.fn.__name__ in fn[a.triton], (a.name, a.triton, fn[a.triton])
        assert a.grad.__name__ in grad[a.triton], (a.name, a.triton, grad[a.triton])
    assert "static_assert" in fn["else"] and "static_assert" in grad["else"]


def test_rowwise_scalings_fused_load_reads_the_record(toys):
    """triton_rowwise's activation-as-the-load (NOTE: [The activation as the load]) takes its
    ACT, GATED and h's width from the record, and refuses one without Triton code."""
    from functional_dw.kernels import triton_rowwise

    p = torch.rand(3)
    assert triton_rowwise._activation(None, 16) == (-1, False, None, 16)
    assert triton_rowwise._activation(("swiglu", p), 16) == (0, True, p, 8)
    assert triton_rowwise._activation(("gelu", None), 16) == (1, False, None, 16)
    with pytest.raises(ValueError, match="activation 'softplus' has no Triton code"):
        triton_rowwise._activation(("softplus", p), 16)


def test_megatrons_mapping_round_trips(toys):
    """Megatron's (activation_func, gated_linear_unit) for each record maps back to it, in
    megatron.py too; a config no record maps is refused naming the ones it runs."""
    mapped = [a for a in ACTIVATIONS.values() if a.megatron is not None]
    assert {a.name for a in mapped} == {"swiglu", "gelu", "silu", "softplus"}
    for a in mapped:
        assert from_megatron(a.megatron, a.gated) is a
        assert mlp_activation(SimpleNamespace(activation_func=a.megatron, gated_linear_unit=a.gated)) == a.name
    with pytest.raises(
        NotImplementedError,
        match=r"activation_func=F.gelu with gated_linear_unit=True: .* runs 'swiglu' \(gated_linear_unit=True, activation_func=F.silu\), .*'softplus' \(gated_linear_unit=False, activation_func=F.softplus\); use TEGroupedMLP",
    ):
        mlp_activation(SimpleNamespace(activation_func=F.gelu, gated_linear_unit=True))


def test_the_width_rule():
    assert [activations.glu_width(n) for n in ("swiglu", "gelu", "silu")] == [2, 1, 1]
    assert act_mod.glu_width is activations.glu_width  # (the seam re-exports it)


# --- registration ---------------------------------------------------------------------------------


def test_bad_registrations_are_refused():
    with pytest.raises(TypeError, match="register takes an Activation record, got str"):
        register("softplus")
    with pytest.raises(ValueError, match="activation 'gelu' is registered already"):
        register(Activation("gelu", F.softplus, torch.sigmoid))
    with pytest.raises(ValueError, match="triton=3, but the fused kernels have a branch only for the built-in codes"):
        register(Activation("softplus", F.softplus, torch.sigmoid, triton=3))
    with pytest.raises(ValueError, match="is 'silu''s Megatron config already"):
        register(Activation("softplus", F.softplus, torch.sigmoid, megatron=F.silu))
    with pytest.raises(ValueError, match="activation 'swiglu' is built in"):
        unregister("swiglu")
    with pytest.raises(ValueError, match="no activation 'softplus' is registered"):
        unregister("softplus")
    assert "softplus" not in ACTIVATIONS  # (nothing above registered it)
    with pytest.raises(TypeError):
        ACTIVATIONS["softplus"] = SOFTPLUS  # a read-only view


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(name=""), "name must be a non-empty str"),
        (dict(fn="softplus"), "fn must be callable"),
        (dict(grad=None), "grad must be callable"),
        (dict(gated=1), "gated must be a bool"),
        (dict(triton=-1), "triton must be None or an ACT code"),
        (dict(triton=1.0), "triton must be None or an ACT code"),
        (dict(megatron="F.softplus"), "megatron must be None or callable"),
    ],
)
def test_a_malformed_record_is_refused(kw, match):
    with pytest.raises(TypeError, match=match):
        Activation(**(dict(name="softplus", fn=F.softplus, grad=torch.sigmoid) | kw))


@pytest.mark.parametrize("save", ["default", "h", "x_only"])
def test_backward_runs_the_activation_forward_ran(toys, save):
    """The residuals hold the record, not the name: re-registering (or unregistering) the name
    between forward and backward changes no gradient of that call, and the record still prints."""
    a = toys["softplus"]
    inp = [t.requires_grad_() for t in _inputs(a)]
    y = fd.grouped_mlp(*inp[:3], SPLITS, probs=inp[3], bias1=inp[4], bias2=inp[5], activation="softplus", save=save)
    want = torch.autograd.grad(_plain(*inp, a), inp, torch.ones_like(y))
    unregister("softplus")
    register(Activation("softplus", torch.tanh, lambda z: 1 - torch.tanh(z) ** 2, megatron=F.softplus))
    got = torch.autograd.grad(y, inp, torch.ones_like(y), retain_graph=True)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)
    unregister("softplus")
    got2 = torch.autograd.grad(y, inp, torch.ones_like(y))
    for g, w in zip(got2, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)
    register(a)  # (the fixture unregisters it)


def test_a_record_prints_after_its_name_is_gone(toys):
    """``repr`` of a call's residuals reads the record it holds, not the registry."""
    a = toys["softplus_glu"]
    inp = _inputs(a)
    _, res = fd.grouped_mlp_fwd(*inp[:3], SPLITS, probs=inp[3], bias1=inp[4], bias2=inp[5], activation=a.name)
    unregister(a.name)
    try:
        assert repr(res).startswith("GroupedMLPResiduals(activation='softplus_glu'")
    finally:
        register(a)
