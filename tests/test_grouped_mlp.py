"""grouped_mlp: the expert MLP as one pure pair built from fc1's and fc2's (issue 31, CPU core).

The numbers against a plain float64 per-expert loop (matmuls and the activation written out),
for each activation, dtype, probs and bias; the residual policies bitwise equal; saved-tensor
hooks, retain_graph, torch.func, torch.compile; bytes saved per token; the errors; FP8; the
DistributedWeight and main_grad paths; the activation kernels' seam; nn.GroupedMLP.

Tolerance (NOTE: [The tolerance rule] in conftest.py, for a chain): each result is compared with
the float64 reference from the same inputs, within

    u(out) |expected| + ROUNDS * u(act) * mag + n * u(acc) * mag + ROUNDS * eta(out)

where ``act`` is the activations' dtype (what every intermediate is rounded to), ``ROUNDS`` the
longest chain of roundings to it behind any result (y: fc1's GEMM, its bias, the activation,
fc2's GEMM, its bias = 5; the gradients' chains are no longer), and ``mag`` the elementwise
magnitude of the same computation on absolute values with the activation replaced by a
surrogate that bounds it and its slope (SwiGLU: ``|gate| * |up|``, GELU/SiLU: ``|z|``), times 2
(their slopes are at most 1.13): it bounds every GEMM's accumulation error and how far an
intermediate rounding travels.
"""

from __future__ import annotations

import importlib
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree

import functional_dw as fd
from conftest import FWD_SCALE, HOOKS, UNIT, FakeDW, PathRecorder, assert_close, assert_same
from functional_dw import fp8
from functional_dw.kernels import activation as act_mod
from functional_dw.kernels.torch_ref import TorchKernels

E, H, F_ = 4, 32, 16
SPLITS = [3, 0, 5, 2]
T = sum(SPLITS)
ACTS = ["swiglu", "gelu", "silu"]
POLICIES = ["default", "h", "x_only"]
DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16}
ROUNDS, N_TERMS = 5, 256


def _rand(*shape, seed, dtype=torch.float32, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def make(activation="swiglu", dtype=torch.float32, *, probs=True, bias=False, stacked=False, splits=SPLITS, seed=0):
    """Leaf inputs of one call: dict(x, w1, w2, probs, bias1, bias2) and a cotangent dy."""
    T_ = sum(splits)
    n1 = (2 if activation == "swiglu" else 1) * F_
    w1 = _rand(E, n1, H, seed=seed + 1, dtype=dtype, scale=H**-0.5)
    w2 = _rand(E, H, F_, seed=seed + 2, dtype=dtype, scale=F_**-0.5)
    inp = dict(
        x=_rand(T_, H, seed=seed, dtype=dtype),
        w1=w1 if stacked else list(w1.unbind(0)),
        w2=w2 if stacked else list(w2.unbind(0)),
        probs=torch.rand(T_, generator=torch.Generator().manual_seed(seed + 3)).to(dtype) if probs else None,
        bias1=_rand(E, n1, seed=seed + 4, dtype=dtype, scale=0.1) if bias else None,
        bias2=_rand(E, H, seed=seed + 5, dtype=dtype, scale=0.1) if bias else None,
    )
    for k, v in inp.items():
        for t in v if isinstance(v, list) else [v]:
            if t is not None:
                t.requires_grad_()
    return inp, _rand(T_, H, seed=seed + 6, dtype=dtype)


NAMES = ["x", "w1", "w2", "probs", "bias1", "bias2"]


def leaves(inp):
    """The inputs that take a gradient, flattened, in NAMES order."""
    out = []
    for k in NAMES:
        v = inp[k]
        out += [t for t in (v if isinstance(v, list) else [v]) if t is not None]
    return out


def call(inp, splits=SPLITS, **kw):
    return fd.grouped_mlp(
        inp["x"], inp["w1"], inp["w2"], splits, probs=inp["probs"], bias1=inp["bias1"], bias2=inp["bias2"], **kw
    )


def run(inp, dy, splits=SPLITS, **kw):
    """(y, grads of leaves(inp)) by autograd."""
    y = call(inp, splits, **kw)
    return y, list(torch.autograd.grad(y, leaves(inp), dy))


# --- the float64 reference -----------------------------------------------------------------------

ACT = {"swiglu": lambda z: F.silu(z.chunk(2, -1)[0]) * z.chunk(2, -1)[1], "gelu": F.gelu, "silu": F.silu}
SURROGATE = {"swiglu": lambda z: z.chunk(2, -1)[0] * z.chunk(2, -1)[1], "gelu": lambda z: z, "silu": lambda z: z}


def ref_mlp(x, w1, w2, splits, probs, b1, b2, act):
    """A loop over experts of plain matmuls and the activation (Megatron's TEGroupedMLP)."""
    rows, start = [], 0
    for e, n in enumerate(splits):
        xe = x[start : start + n]
        z = xe @ w1[e].T + (0 if b1 is None else b1[e])
        p = 1 if probs is None else probs[start : start + n, None]
        h = act(z) * p
        rows.append(h @ w2[e].T + (0 if b2 is None else b2[e] * p))
        start += n
    return torch.cat(rows)


def reference(inp, dy, activation, splits=SPLITS):
    """(y, grads) in float64 from the same inputs, and their magnitudes (see the docstring)."""
    results = []
    for f, act in (
        (lambda t: t.detach().double(), ACT[activation]),
        (lambda t: t.detach().double().abs(), SURROGATE[activation]),
    ):
        d = {
            k: None
            if v is None
            else [f(t).requires_grad_() for t in v]
            if isinstance(v, list)
            else f(v).requires_grad_()
            for k, v in inp.items()
        }
        y = ref_mlp(d["x"], d["w1"], d["w2"], splits, d["probs"], d["bias1"], d["bias2"], act)
        grads = torch.autograd.grad(y, leaves(d), f(dy), allow_unused=True)
        results.append((y.detach(), list(grads)))
    return results


def close(actual, expected, mag, act_dtype, what=""):
    """``actual`` within the chain's bound of the float64 ``expected`` (module docstring)."""
    assert actual.shape == expected.shape, f"{what}: {tuple(actual.shape)} vs {tuple(expected.shape)}"
    if not actual.numel():
        return
    acc = torch.float64 if act_dtype == torch.float64 else torch.float32
    exp, m = expected.double(), 2 * mag.double()
    eta = torch.finfo(actual.dtype).smallest_normal * torch.finfo(actual.dtype).eps / 2
    bound = UNIT[actual.dtype] * exp.abs() + ROUNDS * UNIT[act_dtype] * m + N_TERMS * UNIT[acc] * m + ROUNDS * eta
    err = (actual.double() - exp).abs()
    bad = err > bound
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} of {err.numel()} outside the bound; worst error "
        f"{(err - bound).max().item():.3g} over it ({actual.dtype}, {act_dtype} activations)"
    )


def check_against_reference(inp, dy, activation, y, grads, splits=SPLITS):
    (ry, rg), (my, mg) = reference(inp, dy, activation, splits)
    dtype = inp["x"].dtype
    close(y, ry, my, dtype, "y")
    names = [k for k in NAMES for t in (inp[k] if isinstance(inp[k], list) else [inp[k]]) if t is not None]
    assert len(grads) == len(rg)
    for name, g, r, m in zip(names, grads, rg, mg):
        assert g is not None and g.dtype == dtype, name
        close(g, r, m, dtype, f"d{name}")


# --- numerics ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("probs", [False, True], ids=["no-probs", "probs"])
@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("activation", ACTS)
def test_matches_float64_reference(activation, dtype, probs, bias):
    inp, dy = make(activation, DTYPES[dtype], probs=probs, bias=bias)
    y, grads = run(inp, dy, activation=activation)
    assert y.shape == (T, H) and y.dtype == DTYPES[dtype]
    check_against_reference(inp, dy, activation, y, grads)


@pytest.mark.parametrize(
    "splits",
    [[3, 0, 5, 2], [0, 0, 10, 0], [10, 0, 0, 0], [0, 0, 0, 0]],
    ids=["one-empty", "one-full-middle", "one-full-first", "no-tokens"],
)
@pytest.mark.parametrize("activation", ACTS)
def test_layouts_and_splits_give_the_same_bits(activation, splits):
    """Stacked [E, ., .] weights and a splits tensor give the list/host result bitwise; all of
    them the reference's, also with empty experts and no tokens at all."""
    inp, dy = make(activation, bias=True, splits=splits)
    y, grads = run(inp, dy, splits, activation=activation)
    check_against_reference(inp, dy, activation, y, grads, splits)
    stk, _ = make(activation, bias=True, stacked=True, splits=splits)
    for variant, s in ((stk, splits), (inp, torch.tensor(splits)), (stk, torch.tensor(splits, dtype=torch.int32))):
        y2, g2 = run(variant, dy, s, activation=activation)
        assert_same(y2, y, "y")
        g2 = [list(g.unbind(0)) if g.dim() == 3 and variant is stk and g.shape[0] == E else g for g in g2]
        flat = [t for g in g2 for t in (g if isinstance(g, list) else [g])]
        assert_same(flat, grads, "grads")


def test_probs_of_another_dtype():
    """fp32 router probs with bf16 activations (Megatron's): dprobs in fp32, from one rounding."""
    inp, dy = make("swiglu", torch.bfloat16, bias=True)
    inp["probs"] = inp["probs"].detach().float().requires_grad_()
    y, grads = run(inp, dy)
    assert y.dtype == torch.bfloat16 and grads[1 + 2 * E].dtype == torch.float32  # x, w1 x E, w2 x E, probs
    check_against_reference(
        inp, dy, "swiglu", y, [g.to(torch.bfloat16) if g.dtype == torch.float32 else g for g in grads]
    )
    (_, rg), (_, mg) = reference(inp, dy, "swiglu")
    close(grads[1 + 2 * E], rg[1 + 2 * E], mg[1 + 2 * E], torch.bfloat16, "dprobs in fp32")


# --- torch.autocast (NOTE: [Autocast] in functional_dw/_amp.py) -------------------------------------


def megatron_mlp(x, w1, w2, splits, probs, b1, b2):
    """Megatron's TEGroupedMLP as torch ops (F.linear per expert; the weighted activation and
    bias cast back to the activations' dtype, as Megatron does): what runs under autocast."""
    rows = []
    for e, (xe, pe) in enumerate(zip(x.split(splits), probs.split(splits))):
        z = F.linear(xe, w1[e], b1[e])
        h = (ACT["swiglu"](z) * pe[:, None]).to(z.dtype)
        y = F.linear(h, w2[e])
        rows.append((y + b2[e] * pe[:, None]).to(y.dtype))
    return torch.cat(rows)


def _cast(inp, dtype):
    """The inputs as autocast casts them (x, the weights, the biases; probs as they are), as new
    leaves."""
    out = {}
    for k, v in inp.items():
        f = (lambda t: t.detach().to(dtype).requires_grad_()) if k != "probs" else (lambda t: t.detach().clone())
        out[k] = None if v is None else [f(t) for t in v] if isinstance(v, list) else f(v)
    out["probs"] = None if out["probs"] is None else out["probs"].requires_grad_()
    return out


@pytest.mark.parametrize("stacked, save", [(False, "default"), (True, "x_only")], ids=["list", "stacked-x_only"])
@pytest.mark.parametrize("path", [False, True], ids=["split", "grouped"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_under_autocast_is_the_call_on_cast_inputs(dtype, path, stacked, save):
    """Under torch.autocast, fp32 inputs (fp32 probs, biases): the call on x, the weights and the
    biases cast to the autocast dtype once (probs not), bitwise, in the dtypes Megatron's
    composition under autocast gives (y in the autocast dtype, every grad in its input's dtype:
    fp32), within the chain's bound of float64. The original failed in the split path's forward
    and ignored autocast on the grouped path."""
    inp, dy = make("swiglu", bias=True, stacked=stacked)
    with torch.autocast("cpu", dtype=dtype):
        y = call(inp, use_grouped_tensor=path, save=save)
    grads = list(torch.autograd.grad(y, leaves(inp), dy.to(y.dtype)))
    cast = _cast(inp, dtype)
    y2, g2 = run(cast, dy.to(dtype), use_grouped_tensor=path, save=save)
    assert_same(y, y2, "y")
    assert_same(grads, [g.to(t.dtype) for g, t in zip(g2, leaves(inp))], "grads (fp32: the cast's grads cast back)")
    mega = dict(inp, w1=list(inp["w1"]), w2=list(inp["w2"]), bias1=list(inp["bias1"]), bias2=list(inp["bias2"]))
    with torch.autocast("cpu", dtype=dtype):
        ym = megatron_mlp(mega["x"], mega["w1"], mega["w2"], SPLITS, inp["probs"], mega["bias1"], mega["bias2"])
    gm = torch.autograd.grad(ym, leaves(inp), dy.to(ym.dtype))
    assert ym.dtype == y.dtype == dtype and [g.dtype for g in gm] == [g.dtype for g in grads]
    check_against_reference(cast, dy.to(dtype), "swiglu", y, [g.to(dtype) for g in g2])


def _weight_grads(fc) -> list:
    """An nn.GroupedLinear's weight grads per expert, in either layout."""
    return list(fc.weight.grad.unbind(0)) if fc.single_grouped_weight else [w.grad for w in fc.weights()]


@pytest.mark.parametrize("single", [True, False], ids=["one-weight", "per-expert"])
def test_module_under_autocast(single):
    """nn.GroupedMLP under autocast: its fp32 parameters cast (its experts one buffer each), the
    numbers of the call on the cast parameters, grads in fp32."""
    m = fd.nn.GroupedMLP(E, H, F_, bias=True, single_grouped_weight=single)
    x = torch.randn(T, H, requires_grad=True)
    probs, dy = torch.rand(T, requires_grad=True), torch.randn(T, H)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(x, SPLITS, probs)
    y.backward(dy.to(y.dtype))
    params = [x, *m.fc1.weights(), *m.fc2.weights(), *m.fc1.biases(), *m.fc2.biases()]
    cast = [t.detach().to(torch.bfloat16).requires_grad_() for t in params]
    p2 = probs.detach().clone().requires_grad_()
    c = iter(cast[1:])
    w1, w2, b1, b2 = ([next(c) for _ in range(E)] for _ in range(4))
    y2 = fd.grouped_mlp(cast[0], w1, w2, SPLITS, probs=p2, bias1=b1, bias2=b2)
    y2.backward(dy.to(torch.bfloat16))
    assert_same(y, y2)
    got = [x.grad, *_weight_grads(m.fc1), *_weight_grads(m.fc2), *_weight_grads_or_biases(m)]
    assert_same(got, [t.grad.float() for t in cast])
    assert_same(probs.grad, p2.grad)


def _weight_grads_or_biases(m) -> list:
    """The biases' grads per expert (fc1's, then fc2's), in either layout."""
    return [
        g
        for fc in (m.fc1, m.fc2)
        for g in (fc.bias.grad.unbind(0) if fc.single_grouped_bias else [b.grad for b in fc.biases()])
    ]


# --- the policies --------------------------------------------------------------------------------------


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("probs", [False, True], ids=["no-probs", "probs"])
@pytest.mark.parametrize("activation", ACTS)
def test_policies_give_the_same_bits(activation, probs, bias):
    inp, dy = make(activation, torch.bfloat16, probs=probs, bias=bias)
    y, grads = run(inp, dy, activation=activation, save="default")
    for save in ("h", "x_only"):
        y2, g2 = run(inp, dy, activation=activation, save=save)
        assert_same(y2, y, f"y ({save})")
        assert_same(g2, grads, f"grads ({save})")


@pytest.mark.parametrize("save", POLICIES)
def test_the_pure_pair_is_the_op(save):
    """grouped_mlp_fwd/bwd directly: the op's numbers, an MLPGrads shaped like the arguments."""
    inp, dy = make("swiglu", bias=True)
    y, grads = run(inp, dy, save=save)
    y2, res = fd.grouped_mlp_fwd(
        inp["x"], inp["w1"], inp["w2"], SPLITS, probs=inp["probs"], bias1=inp["bias1"], bias2=inp["bias2"], save=save
    )
    assert_same(y2, y)
    assert isinstance(res, fd.GroupedMLPResiduals) and isinstance(res.fc1, fd.GroupedLinearResiduals)
    g = fd.grouped_mlp_bwd(res, dy)
    assert isinstance(g, fd.MLPGrads) and g._fields == ("dx", "dw1", "dw2", "dprobs", "dbias1", "dbias2")
    assert_same([g.dx, *g.dw1, *g.dw2, g.dprobs, g.dbias1, g.dbias2], grads)
    g2 = fd.grouped_mlp_bwd(res, dy)  # backward is re-entrant: the record is never consumed
    assert_same(list(g2.dw1), list(g.dw1))


def test_the_record_nests_the_layers_records():
    """res.fc1 and res.fc2 are the layers' own records: grouped_linear_bwd runs on them."""
    inp, dy = make("gelu", probs=False)
    y, res = fd.grouped_mlp_fwd(inp["x"], inp["w1"], inp["w2"], SPLITS, activation="gelu", save="h")
    assert res.fc1.x_TK is inp["x"] and res.fc2.x_TK is not None
    dh, dw2, _ = fd.grouped_linear_bwd(res.fc2, dy)  # fc2's backward alone, on its own record
    g = fd.grouped_mlp_bwd(res, dy)
    assert_same(list(dw2), list(g.dw2))
    dz, _ = act_mod.act_bwd(res.fc1_out, None, dh, "gelu")
    dx, dw1, _ = fd.grouped_linear_bwd(res.fc1, dz)
    assert_same(dx, g.dx)
    assert_same(list(dw1), list(g.dw1))


@pytest.mark.parametrize("save", POLICIES)
def test_record_repr_says_what_is_saved_and_recomputed(save):
    inp, _ = make("swiglu")
    _, res = fd.grouped_mlp_fwd(inp["x"], inp["w1"], inp["w2"], SPLITS, probs=inp["probs"], save=save)
    text = repr(res)
    assert text.startswith(f"GroupedMLPResiduals(activation='swiglu', save={save!r}")
    assert ("[saved] h: fc2.x_TK above" in text) == (save == "h")
    assert ("[recomputed] h: act(fc1_out) * probs" in text) == (save != "h")
    assert ("[recomputed] fc1_out: fc1(x)" in text) == (save == "x_only")
    assert ("[saved] fc1_out = Tensor[10, 32] float32 1280 B" in text) == (save != "x_only")
    saved = fd.saved_activations(res)
    want = {"x_only": 1280 + 40, "default": 1280 + 1280 + 40, "h": 1280 + 1280 + 640 + 40}[save]
    assert sum(t.numel() * t.element_size() for t in saved) == want
    assert text.endswith(f")  # {want} B through save_for_backward")
    assert any(t is inp["x"] for t in saved) and any(t is inp["probs"] for t in saved)


def saved_bytes_per_token(save, dtype, activation="swiglu"):
    inp, dy = make(activation, dtype)
    rec = HOOKS["identity"]()
    with rec:
        y = call(inp, activation=activation, save=save)
    y.backward(dy)
    return sum(t.numel() * t.element_size() for t in rec.packed) / T


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_bytes_saved_per_token(dtype):
    """Measured with a pack hook: x only < default (+ fc1's output) < h (+ h); probs 4 B or 2 B."""
    dt = DTYPES[dtype]
    b = {s: saved_bytes_per_token(s, dt) for s in POLICIES}
    es = dt.itemsize
    assert b == {"x_only": (H + 1) * es, "default": (H + 2 * F_ + 1) * es, "h": (H + 2 * F_ + F_ + 1) * es}
    assert b["x_only"] < b["default"] < b["h"]


# --- hooks, retain_graph, torch.func, torch.compile -------------------------------------------------


@pytest.mark.parametrize("save", POLICIES)
def test_hooks_see_only_activations_and_change_no_bit(save, hook_name):
    inp, dy = make("swiglu", torch.bfloat16, bias=True)
    y, grads = run(inp, dy, save=save)
    rec = HOOKS[hook_name]()
    with rec:
        y2 = call(inp, save=save)
    g2 = list(torch.autograd.grad(y2, leaves(inp), dy))
    assert_same(y2, y)
    assert_same(g2, grads)
    assert rec.packed and rec.unpacks == len(rec.packed)
    params = [t for k in ("w1", "w2", "bias1", "bias2") for t in inp[k]]
    for t in rec.packed:
        assert t.shape[0] == T, f"a saved tensor of shape {tuple(t.shape)}: not an activation"
        assert not any(t is p or t.data_ptr() == p.data_ptr() for p in params), "a weight went through the hooks"


def test_save_on_cpu_is_bitwise():
    inp, dy = make("silu", torch.bfloat16, bias=True)
    y, grads = run(inp, dy, activation="silu")
    with torch.autograd.graph.save_on_cpu():
        y2 = call(inp, activation="silu")
    assert_same(y2, y)
    assert_same(list(torch.autograd.grad(y2, leaves(inp), dy)), grads)


@pytest.mark.parametrize("save", POLICIES)
def test_retain_graph_twice(save):
    inp, dy = make("swiglu", bias=True)
    y = call(inp, save=save)
    g1 = torch.autograd.grad(y, leaves(inp), dy, retain_graph=True)
    g2 = torch.autograd.grad(y, leaves(inp), dy)
    assert_same(list(g2), list(g1))


@pytest.mark.parametrize("save", POLICIES)
def test_torch_func_grad_and_vjp_over_x_and_probs(save):
    inp, dy = make("swiglu", torch.float64, bias=True)
    x, p = inp["x"], inp["probs"]

    def f(x, p):
        return fd.grouped_mlp(
            x,
            inp["w1"],
            inp["w2"],
            SPLITS,
            probs=p,
            bias1=inp["bias1"],
            bias2=inp["bias2"],
            save=save,
            use_grouped_tensor=False,
        )

    y = f(x, p)
    dx, dp = torch.autograd.grad(y, [x, p], dy)
    gx, gp = torch.func.grad(lambda x, p: (f(x, p) * dy).sum(), argnums=(0, 1))(x, p)
    assert_same([gx, gp], [dx, dp])
    y2, vjp_fn = torch.func.vjp(f, x, p)
    assert_same(y2, y.detach())
    assert_same(list(vjp_fn(dy)), [dx, dp])


@pytest.mark.parametrize("stacked", [False, True], ids=["list", "stacked"])
@pytest.mark.parametrize("save", POLICIES)
@pytest.mark.parametrize("activation", ACTS)
def test_jvp_over_every_input(activation, save, stacked):
    """Forward mode (torch.func.jvp, jacfwd): tangents of x, w1, w2, probs, bias1 and bias2 at once
    equal the float64 reference model's own jvp."""
    inp, _ = make(activation, torch.float64, bias=True, stacked=stacked)
    primals = [inp[k] for k in NAMES]
    tangents = pytree.tree_map(lambda t: torch.randn_like(t), primals)

    def ours(x, w1, w2, p, b1, b2):
        return fd.grouped_mlp(x, w1, w2, SPLITS, probs=p, bias1=b1, bias2=b2, activation=activation, save=save)

    def ref(x, w1, w2, p, b1, b2):
        return ref_mlp(x, w1, w2, SPLITS, p, b1, b2, ACT[activation])

    y, ty = torch.func.jvp(ours, tuple(primals), tuple(tangents))
    y0, ty0 = torch.func.jvp(ref, tuple(primals), tuple(tangents))
    torch.testing.assert_close(y, y0, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ty, ty0, rtol=1e-10, atol=1e-10)
    jx = torch.func.jacfwd(lambda x: ours(x, *primals[1:]))(inp["x"])
    torch.testing.assert_close(jx, torch.func.jacfwd(lambda x: ref(x, *primals[1:]))(inp["x"]), rtol=1e-10, atol=1e-10)


def test_jvp_refuses_fp8():
    inp, _ = make("swiglu", torch.bfloat16, splits=FP8_SPLITS)
    f = lambda x: fd.grouped_mlp(x, inp["w1"], inp["w2"], FP8_SPLITS, recipe=fp8.Float8CurrentScaling())  # noqa: E731
    with pytest.raises(NotImplementedError, match="grouped_mlp"):
        torch.func.jvp(f, (inp["x"].detach(),), (torch.ones_like(inp["x"]),))


@pytest.mark.parametrize("save", POLICIES)
def test_second_order(save):
    """A backward that is itself differentiated (create_graph, grad of grad) recomputes fc1's
    output and h from the saved inputs under every policy (saved intermediates carry no graph):
    gradgradcheck passes, and a Hessian-vector product is the float64 reference's and the same
    bits for every policy."""
    g = torch.Generator().manual_seed(5)
    x, p = torch.randn(6, 4, generator=g, dtype=torch.float64), torch.rand(6, generator=g, dtype=torch.float64)
    w1, w2 = (
        torch.randn(3, 4, 4, generator=g, dtype=torch.float64),
        torch.randn(3, 4, 2, generator=g, dtype=torch.float64),
    )
    b2 = torch.randn(3, 4, generator=g, dtype=torch.float64)
    for t in (x, p, w1, w2, b2):
        t.requires_grad_()

    def f(x, p, w1, w2, b2, save=save):
        return fd.grouped_mlp(x, w1, w2, [2, 0, 4], probs=p, bias2=b2, save=save, use_grouped_tensor=False)

    assert torch.autograd.gradgradcheck(lambda x, p, b2: f(x, p, w1, w2, b2), (x, p, b2))

    def hvp(fn):
        (gx,) = torch.autograd.grad(fn(x, p, w1, w2, b2).square().sum(), x, create_graph=True)
        return torch.autograd.grad(gx.sum(), [x, p, w1])

    got = hvp(f)
    want = hvp(lambda x, p, w1, w2, b2: ref_mlp(x, w1, w2, [2, 0, 4], p, None, b2, ACT["swiglu"]))
    for a, b, name in zip(got, want, ("x", "p", "w1")):
        assert_close(a, b, torch.float64, f"d/d{name} of sum(dx)")
    assert_same(list(got), list(hvp(lambda *a: f(*a, save="default"))))
    gx = lambda x: torch.func.grad(lambda x: f(x, p, w1, w2, b2).square().sum())(x)  # noqa: E731
    assert_close(torch.func.grad(lambda x: gx(x).sum())(x), want[0], torch.float64, "grad of grad")


@pytest.mark.parametrize("save", POLICIES)
def test_grad_of_a_vjp_fn_is_second_order(save):
    """torch.func.vjp's vjp_fn called inside a grad (grad of vjp): the backward runs at vjp's
    exited level and the grad level differentiates it, so it recomputes like any second order
    (NOTE: [A transform's dead level]); vjp over x with grad over x, over w1, over probs. And
    vjp_fn called outside any transform is first order: the same grads as autograd's."""
    g = torch.Generator().manual_seed(7)
    x, p = torch.randn(6, 4, generator=g, dtype=torch.float64), torch.rand(6, generator=g, dtype=torch.float64)
    w1 = torch.randn(3, 4, 4, generator=g, dtype=torch.float64)
    w2 = torch.randn(3, 4, 2, generator=g, dtype=torch.float64)
    v = torch.randn(6, 4, generator=g, dtype=torch.float64)
    args = (x, w1, p)

    def f(x, w1, p):
        return fd.grouped_mlp(x, w1, w2, [2, 0, 4], probs=p, save=save, use_grouped_tensor=False)

    def ref(x, w1, p):
        return ref_mlp(x, w1, w2, [2, 0, 4], p, None, None, ACT["swiglu"])

    for i, name in enumerate(("x", "w1", "p")):

        def outer(t, fn, i=i):
            a = list(args)
            a[i] = t
            dx = torch.func.vjp(lambda x: fn(x, *a[1:]), a[0])[1](v)[0]
            return dx.square().sum()

        got = torch.func.grad(outer)(args[i], f)
        assert_close(got, torch.func.grad(outer)(args[i], ref), torch.float64, f"grad over {name} of vjp over x")
    y, vjp_fn = torch.func.vjp(f, *args)
    xs = [t.clone().requires_grad_() for t in args]
    for a, b, name in zip(vjp_fn(v), torch.autograd.grad(ref(*xs), xs, v), ("x", "w1", "p")):
        assert_close(a, b, torch.float64, f"first-order vjp, d{name}")
    if save == "x_only":
        return
    # FP8: grad over x of a vjp over w2 alone (fc2's record holds a recomputed h, not x's copy)
    # came back exactly 0; refused, as over w1
    xf, vf = torch.randn(32, 32, generator=g), torch.randn(32, 32, generator=g)
    w1f, w2f = torch.randn(2, 32, 32, generator=g) * 0.2, torch.randn(2, 32, 16, generator=g) * 0.2
    rec = fp8.RowwiseScaling(bf16_below=0)
    for over in (1, 2):

        def penalty(x, over=over):
            ws = [w1f, w2f]
            vjp = torch.func.vjp(
                lambda w: fd.grouped_mlp(x, *ws[: over - 1], w, *ws[over:], [16, 16], save=save, recipe=rec),
                ws[over - 1],
            )[1]
            return vjp(vf)[0].square().sum()

        with pytest.raises(NotImplementedError, match="^grouped_mlp: .*cannot be differentiated again"):
            torch.func.grad(penalty)(xf)


@pytest.mark.parametrize("save", POLICIES)
def test_autograd_over_a_torch_func_grad_is_second_order(save):
    """A penalty on torch.func.grad's result, then plain autograd (x and w1 leaves requiring
    grad outside the transform): the backward run by the grad level is differentiated by autograd
    below it, so it recomputes (it came back wrong by up to 27 before: a live transform ended the
    check before plain autograd's requires_grad was asked)."""
    g = torch.Generator().manual_seed(8)
    x, p = torch.randn(6, 4, generator=g, dtype=torch.float64), torch.rand(6, generator=g, dtype=torch.float64)
    w1 = torch.randn(3, 4, 4, generator=g, dtype=torch.float64)
    w2 = torch.randn(3, 4, 2, generator=g, dtype=torch.float64)

    def total(fn):
        xs, w1s = x.clone().requires_grad_(), w1.clone().requires_grad_()
        loss = lambda x: fn(x, w1s).square().sum()  # noqa: E731
        t = loss(xs) + torch.func.grad(loss)(xs).square().sum()
        return torch.autograd.grad(t, [xs, w1s])

    got = total(lambda x, w1: fd.grouped_mlp(x, w1, w2, [2, 0, 4], probs=p, save=save, use_grouped_tensor=False))
    want = total(lambda x, w1: ref_mlp(x, w1, w2, [2, 0, 4], p, None, None, ACT["swiglu"]))
    for a, b, name in zip(got, want, ("x", "w1")):
        assert_close(a, b, torch.float64, f"d/d{name} of the penalty")
    if save != "x_only":  # FP8 cannot recompute: first order over weights requiring grad (a module's)
        # runs, as with frozen weights; autograd over its result raises (NOTE: [Refused lazily])
        xf = torch.randn(32, 16, generator=g)
        w1f, w2f = torch.randn(2, 32, 16, generator=g), torch.randn(2, 16, 16, generator=g)
        rec = fp8.RowwiseScaling(bf16_below=0)

        def mlp(x, w1):
            return fd.grouped_mlp(x, w1, w2f, [16, 16], save=save, recipe=rec)

        def results(w1):
            vjp_fn = torch.func.vjp(lambda x: mlp(x, w1), xf)[1]
            return torch.func.grad(lambda x: mlp(x, w1).square().sum())(xf), vjp_fn(torch.ones(32, 16))[0]

        live = w1f.clone().requires_grad_()
        for got, want in zip(results(live), results(w1f)):
            assert torch.equal(got, want)
            with pytest.raises(NotImplementedError, match="^grouped_mlp: .*here by autograd beneath or inside"):
                torch.autograd.grad(mlp(xf, live).sum() + got.square().sum(), live)
        # fc2's weights live: its record's h is recomputed in the vjp_fn's backward (no wrapper
        # of the exited level): it was refused as autograd's own create_graph=True
        w2l, c = w2f.clone().requires_grad_(), torch.randn(32, 16, generator=g)
        vjp = [
            torch.func.vjp(lambda x, w2=w2: fd.grouped_mlp(x, w1f, w2, [16, 16], save=save, recipe=rec), xf)[1]
            for w2 in (w2l, w2f)
        ]
        assert torch.equal(vjp[0](c)[0], vjp[1](c)[0])


def test_a_users_create_graph_inside_a_per_element_vmap_is_refused():
    """A user's pair (no vmap rule: vmap runs it per element) whose bwd takes a second derivative
    in x through FP8 grouped_mlp, under vmap(grad): refused as without vmap. It returned the
    other term alone: that create_graph was read as the per-element run's own."""
    g = torch.Generator().manual_seed(0)
    w1, w2 = torch.randn(2, 64, 32, generator=g) * 0.2, torch.randn(2, 32, 32, generator=g) * 0.2
    c, xs = torch.randn(32, 32, generator=g), torch.randn(2, 32, 32, generator=g)

    def fwd(x):
        return x.sum() * 0, (x,)

    def bwd(res, gy):
        with torch.enable_grad():
            x = res[0].detach().requires_grad_()
            y = fd.grouped_mlp(x, w1, w2, [16, 16], recipe=fp8.RowwiseScaling(bf16_below=0))
            (gx,) = torch.autograd.grad((y * c).sum(), x, create_graph=True)
            (hx,) = torch.autograd.grad(gx.square().sum() + x.square().sum(), x)
        return (gy * hx,)

    op = fd.custom_vjp(fwd, bwd, name="user_hvp")
    x0 = xs[0].clone().requires_grad_()
    for run in (
        lambda: torch.autograd.grad(op(x0), x0),
        lambda: torch.func.vmap(torch.func.grad(op))(xs),
    ):
        with pytest.raises(NotImplementedError, match="^grouped_mlp: .*cannot be differentiated again"):
            run()


def test_a_penalty_on_bias2s_grad_differentiates_through_fp8():
    """bias2's grad sums the unquantized dy, so a penalty on it differentiates with FP8 layers
    as without them (to FP8's error); it was refused along with the grads FP8 made."""
    g = torch.Generator().manual_seed(6)
    x0, c = torch.randn(32, 16, generator=g), torch.randn(32, 16, generator=g)
    w1, w2 = torch.randn(2, 32, 16, generator=g) * 0.3, torch.randn(2, 16, 16, generator=g) * 0.3
    b2 = torch.randn(2, 16, generator=g) * 0.3

    def dx_of_penalty(recipe):
        x = x0.clone().requires_grad_()
        loss = lambda b: (fd.grouped_mlp(x, w1, w2, [16, 16], bias2=b, recipe=recipe) * c).square().sum()  # noqa: E731
        return torch.autograd.grad(torch.func.grad(loss)(b2).square().sum(), x)[0]

    want = dx_of_penalty(None)
    got = dx_of_penalty(fp8.RowwiseScaling(bf16_below=0))
    assert (got - want).norm() < 0.1 * want.norm()


@pytest.mark.parametrize("save", POLICIES)
def test_torch_func_grad_recomputes_forwards_bits(save):
    """Under torch.func.grad fc1 runs again (its level may differentiate it) on the reference's
    split path: with bf16 biases its bias add follows the product as on forward's grouped path,
    so the grads are .backward()'s bitwise (F.linear's fused add rounded once: up to 0.5 off)."""
    g = torch.Generator().manual_seed(5)
    bf = torch.bfloat16
    x, c = torch.randn(32, 16, generator=g).to(bf), torch.randn(32, 16, generator=g).to(bf)
    w1, w2 = (torch.randn(2, 48, 16, generator=g) * 0.2).to(bf), (torch.randn(2, 16, 24, generator=g) * 0.2).to(bf)
    b1 = (torch.randn(2, 48, generator=g) * 0.1).to(bf)

    def loss(w1):
        return (fd.grouped_mlp(x, w1, w2, [12, 20], bias1=b1, save=save) * c).square().sum()

    w = w1.clone().requires_grad_()
    loss(w).backward()
    assert torch.equal(torch.func.grad(loss)(w1), w.grad)


@pytest.mark.parametrize("save", POLICIES)
def test_autograd_grad_inside_a_torch_func_grad_is_second_order(save):
    """torch.autograd.grad(..., create_graph=True) inside torch.func.grad: the backward runs at
    the grad level's own level, which differentiates it afterwards, so it recomputes (in w1 it
    was ~26% off and in x exactly 0: the saved fc1 output carries no graph at that level)."""
    g = torch.Generator().manual_seed(9)
    x, c = torch.randn(6, 4, generator=g, dtype=torch.float64), torch.randn(6, 2, generator=g, dtype=torch.float64)
    w1 = torch.randn(3, 4, 4, generator=g, dtype=torch.float64)
    w2 = torch.randn(3, 2, 2, generator=g, dtype=torch.float64)

    def penalties(fn):
        def over_w1(w):
            (gw,) = torch.autograd.grad((fn(x, w) * c).square().sum(), w, create_graph=True)
            return gw.square().sum()

        def over_x(x):
            (gx,) = torch.autograd.grad((fn(x, w1) * c).sum(), x, create_graph=True)
            return gx.square().sum()

        return torch.func.grad(over_w1)(w1), torch.func.grad(over_x)(x)

    got = penalties(lambda x, w1: fd.grouped_mlp(x, w1, w2, [2, 0, 4], save=save, use_grouped_tensor=False))
    want = penalties(lambda x, w1: ref_mlp(x, w1, w2, [2, 0, 4], None, None, None, ACT["swiglu"]))
    for a, b, name in zip(got, want, ("w1", "x")):
        assert_close(a, b, torch.float64, f"d/d{name} of the penalty")


@pytest.mark.parametrize("save", POLICIES)
def test_second_order_through_dx_with_a_constant_cotangent(save):
    """A gradient penalty (dy constant, the weights frozen, only x and probs requiring grad):
    dx depends on x through the activation, so its derivative is recomputed from x like any
    second order (it was silently zero: only dy and w1 were asked whether they require grad),
    by autograd (create_graph), grad of grad and jacrev of jacrev; with FP8 it is refused."""
    g = torch.Generator().manual_seed(6)
    x, p = torch.randn(6, 4, generator=g, dtype=torch.float64), torch.rand(6, generator=g, dtype=torch.float64)
    w1 = torch.randn(3, 4, 4, generator=g, dtype=torch.float64)
    w2 = torch.randn(3, 4, 2, generator=g, dtype=torch.float64)
    c = torch.linspace(-1, 1, 4, dtype=torch.float64)

    def f(x, p):
        return fd.grouped_mlp(x, w1, w2, [2, 0, 4], probs=p, save=save, use_grouped_tensor=False)

    def ref(x, p):
        return ref_mlp(x, w1, w2, [2, 0, 4], p, None, None, ACT["swiglu"])

    def penalty(fn):
        x_, p_ = x.clone().requires_grad_(), p.clone().requires_grad_()
        (gx,) = torch.autograd.grad((fn(x_, p_) * c).sum(), x_, create_graph=True)
        return torch.autograd.grad(gx.square().sum(), [x_, p_])

    for a, b, name in zip(penalty(f), penalty(ref), ("x", "p")):
        assert_close(a, b, torch.float64, f"d/d{name} of |dx|^2")
    gx = lambda fn: lambda x: torch.func.grad(lambda x: (fn(x, p) * c).sum())(x)  # noqa: E731
    want = torch.func.jacrev(gx(ref))(x)
    assert_close(torch.func.jacrev(gx(f))(x), want, torch.float64, "jacrev of jacrev")
    assert_close(
        torch.func.grad(lambda x: gx(f)(x).square().sum())(x),
        torch.func.grad(lambda x: gx(ref)(x).square().sum())(x),
        torch.float64,
        "grad of grad",
    )
    if save != "x_only":
        xr = torch.randn(32, 16, generator=g).requires_grad_()
        w1r, w2r = torch.randn(2, 32, 16, generator=g), torch.randn(2, 16, 16, generator=g)
        y = fd.grouped_mlp(xr, w1r, w2r, [16, 16], save=save, recipe=fp8.RowwiseScaling(bf16_below=0))
        with pytest.raises(NotImplementedError, match="cannot be differentiated again"):
            torch.autograd.grad(y.sum(), xr, create_graph=True)


@pytest.mark.parametrize("save", ["default", "x_only"])
def test_torch_compile_aot_eager_equals_eager(save):
    torch._dynamo.reset()
    inp, dy = make("swiglu", bias=True)
    splits = torch.tensor(SPLITS)

    def f(x, w1, w2, splits, p, b1, b2):
        return fd.grouped_mlp(x, w1, w2, splits, probs=p, bias1=b1, bias2=b2, save=save)

    args = (inp["x"], inp["w1"], inp["w2"], splits, inp["probs"], inp["bias1"], inp["bias2"])
    y = f(*args)
    grads = torch.autograd.grad(y, leaves(inp), dy)
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    y2 = compiled(*args)
    assert_same(y2, y)
    assert_same(list(torch.autograd.grad(y2, leaves(inp), dy)), list(grads))


# --- which gradients, DistributedWeight, main_grad, the seam -----------------------------------------


def test_only_the_gemms_asked_for_run():
    inp, dy = make("swiglu", probs=False)
    for t in leaves(inp):
        t.requires_grad_(False)
    inp["x"].requires_grad_()
    rec = PathRecorder()
    y = call(inp, backend=rec)
    (dx,) = torch.autograd.grad(y, [inp["x"]], dy)
    assert rec.gemms() == ["dgrad", "dgrad"]  # fc2's and fc1's dgrad: no wgrad for frozen weights
    inp2, _ = make("swiglu", probs=False)
    assert_same(dx, run(inp2, dy)[1][0])
    inp["x"].requires_grad_(False)
    for w in inp["w2"]:
        w.requires_grad_()
    rec.paths.clear()
    y = call(inp, backend=rec)
    dw2 = torch.autograd.grad(y, inp["w2"], dy)
    assert rec.gemms() == ["wgrad"]  # fc2's wgrad alone: nothing of fc1's backward
    assert_same(list(dw2), run(inp2, dy)[1][1 + E : 1 + 2 * E])


@pytest.mark.parametrize("save", POLICIES)
def test_distributed_weights(save):
    """FakeDW groups (TE's protocol) for w1 and w2: forward runs on the gathered weights, grads
    land on the shards, hooks see no weight; x_only gathers fc1's weights for forward again."""
    inp, dy = make("swiglu", bias=True)
    w1 = FakeDW.group_of([w.detach() for w in inp["w1"]])
    w2 = FakeDW.group_of([w.detach() for w in inp["w2"]])
    dw_inp = dict(inp, w1=w1, w2=w2)
    rec = HOOKS["clone"]()
    with rec:
        y = call(dw_inp, save=save)
    plain = dict(inp, w1=[FWD_SCALE * w.detach() for w in inp["w1"]], w2=[FWD_SCALE * w.detach() for w in inp["w2"]])
    assert_same(y, call(plain))
    y.backward(dy)
    assert all(not isinstance(t, FakeDW) and t.shape[0] == T for t in rec.packed)
    assert [tuple(w.grad.shape) for w in w1] == [(F_, H)] * E and [tuple(w.grad.shape) for w in w2] == [
        (H // 2, F_)
    ] * E
    assert w1[0].calls == {"forward": 2 if save == "x_only" else 1, "backward": 1, "finalize": 1}
    assert w2[0].calls == {"forward": 1, "backward": 1, "finalize": 1}
    ref = dict(
        inp, w1=FakeDW.group_of([w.detach() for w in inp["w1"]]), w2=FakeDW.group_of([w.detach() for w in inp["w2"]])
    )
    call(ref).backward(dy)
    assert_same([w.grad for w in w1 + w2], [w.grad for w in ref["w1"] + ref["w2"]])


def test_fused_main_grad():
    inp, dy = make("gelu", bias=True)
    _, grads = run(inp, dy, activation="gelu")
    for w in inp["w1"] + inp["w2"]:
        w.main_grad = torch.zeros_like(w, dtype=torch.float32)
    y = call(inp, activation="gelu", fuse_wgrad_accumulation=True)
    y.backward(dy)
    assert_same([w.main_grad for w in inp["w1"] + inp["w2"]], grads[1 : 1 + 2 * E])


class FusedActivation(TorchKernels):
    """A backend with its own activation kernels (as a Triton one will be): the reference's,
    counted, refusing functorch's wrappers as a kernel reading raw pointers would."""

    def __init__(self):
        self.calls = []

    def _run(self, name, *args, **kw):
        wrapped = torch._C._functorch.is_functorch_wrapped_tensor
        assert not any(isinstance(t, torch.Tensor) and wrapped(t) for t in (*args, *kw.values())), name
        self.calls.append(name)
        return getattr(act_mod.REFERENCE, name)(*args, **kw)

    def act_fwd(self, *args, **kw):
        return self._run("act_fwd", *args, **kw)

    def act_bwd(self, *args, **kw):
        return self._run("act_bwd", *args, **kw)

    def probs_bias_fwd(self, *args, **kw):
        return self._run("probs_bias_fwd", *args, **kw)

    def probs_bias_bwd(self, *args, **kw):
        return self._run("probs_bias_bwd", *args, **kw)


@pytest.mark.parametrize("save", POLICIES)
def test_a_backends_activation_kernels_slot_in(save):
    inp, dy = make("swiglu", bias=True)
    y, grads = run(inp, dy, save=save)
    k = FusedActivation()
    y2, g2 = run(inp, dy, save=save, backend=k)
    assert_same(y2, y)
    assert_same(g2, grads)
    recompute = [] if save == "h" else ["act_fwd"]
    assert k.calls == ["act_fwd", "probs_bias_fwd", *recompute, "probs_bias_bwd", "act_bwd"]
    k.calls.clear()  # torch.func: the backend's kernels run on plain operands, the reference on wrappers
    f = lambda x, p: (call(dict(inp, x=x, probs=p), save=save, backend=k, use_grouped_tensor=False) * dy).sum()  # noqa: E731
    got = torch.func.grad(f, argnums=(0, 1))(inp["x"], inp["probs"])
    want = torch.autograd.grad(call(inp, save=save, use_grouped_tensor=False), [inp["x"], inp["probs"]], dy)
    assert_same(list(got), list(want))
    assert k.calls[:2] == ["act_fwd", "probs_bias_fwd"]  # forward runs below the transform, on plain tensors


def test_reference_activation_rounds_once():
    """The reference computes in fp32 and rounds once: bf16 h is fp32 h rounded."""
    z = _rand(T, 2 * F_, seed=7, dtype=torch.bfloat16)
    p = torch.rand(T).to(torch.bfloat16)
    h = act_mod.act_fwd(z, p, "swiglu")
    g, u = z.float().chunk(2, -1)
    assert_same(h, (F.silu(g) * u * p.float()[:, None]).to(torch.bfloat16))
    dh = _rand(T, F_, seed=8, dtype=torch.bfloat16)
    dz, dp = act_mod.act_bwd(z, p, dh, "swiglu")
    g32 = dh.float() * p.float()[:, None]
    s = torch.sigmoid(g)
    assert_same(dz, torch.cat([g32 * (s * (1 + g * (1 - s))) * u, g32 * F.silu(g)], -1).to(torch.bfloat16))
    assert_same(dp, (F.silu(g) * u * dh.float()).sum(-1).to(torch.bfloat16))


# --- the fused Triton activation (kernels/triton_activation.py) ---------------------------------------


def gpu(test):
    """A test of the CUDA kernels: marked ``gpu``, skipped without CUDA."""
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")(test))


def _on(inp, dy, device):
    """The same leaves (and dy) on ``device``."""
    move = lambda t: None if t is None else t.detach().to(device).requires_grad_()  # noqa: E731
    return {k: [move(t) for t in v] if isinstance(v, list) else move(v) for k, v in inp.items()}, dy.to(device)


def _activation_cases(device, dtype, probs_dtype, seed):
    """(activation, fc1_out, probs, dh, dprobs_in) over odd shapes, a strided fc1_out and
    values that reach exp's overflow and the erf tails."""
    g = torch.Generator().manual_seed(seed)
    for activation in ACTS:
        glu = 2 if activation == "swiglu" else 1
        for T_, F2 in ((0, 16), (1, 5), (37, 150), (300, 1536)):
            z = torch.randn(T_, glu * F2 + 3, generator=g) * 4
            if T_ > 2:
                z[0, :4] = torch.tensor([-100.0, 100.0, -9.5, 88.8])
            z = z.to(device, dtype)[:, 3:]  # strided rows
            dh = torch.randn(T_, F2, generator=g).to(device, dtype)
            for p in (None, torch.rand(T_, generator=g).to(device, probs_dtype)):
                dp_in = None if p is None else torch.randn(T_, generator=g).to(device, torch.float32)
                yield activation, z, p, dh, dp_in


def _within_ulp(a, b, slack, what=""):
    """``a`` within one unit in the last place (of its dtype) of ``b`` plus ``slack``,
    elementwise; NaN where b's."""
    assert a.dtype == b.dtype and a.shape == b.shape, what
    a32, b32 = a.double(), b.double()
    assert torch.equal(a32.isnan(), b32.isnan()), what
    a32, b32 = a32.nan_to_num(), b32.nan_to_num()
    finfo = torch.finfo(b.dtype)
    ulp = torch.ldexp(torch.ones_like(b32), torch.frexp(b32).exponent - 1) * finfo.eps
    ulp = ulp.clamp_min(finfo.smallest_normal * finfo.eps)
    bad = (a32 - b32).abs() > ulp + slack
    assert not bad.any(), f"{what}: {int(bad.sum())} values more than one ulp (+ slack) apart"


@gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("probs_dtype", ["same", "fp32"])
def test_triton_activation_is_the_reference_bitwise_on_cuda(dtype, probs_dtype):
    """h and dfc1_out bitwise the reference's on the same GPU (the same fp32 expressions, expf,
    IEEE division, no FMA contraction); GELU's within one ulp plus what erf's one-fp32-ulp
    difference becomes (NOTE: [erf] in triton_math.py);
    dprobs (a row sum in the kernel's order) within fp32 summation error."""
    from functional_dw.kernels import triton_activation as ta

    pytest.importorskip("triton")
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    pdt = dt if probs_dtype == "same" else torch.float32
    for activation, z, p, dh, dp_in in _activation_cases("cuda", dt, pdt, seed=11):
        what = f"{activation} {tuple(z.shape)} probs={p is not None}"
        h, h0 = ta.FUSED.act_fwd(z, p, activation), act_mod.act_fwd(z, p, activation)
        dz, dp = ta.FUSED.act_bwd(z, p, dh, activation, dprobs_in=dp_in)
        dz0, dp0 = act_mod.act_bwd(z, p, dh, activation, dprobs_in=dp_in)
        if activation != "gelu":
            assert_same(h, h0, f"h {what}")
            assert_same(dz, dz0, f"dfc1_out {what}")
        else:  # erf one fp32 ulp apart (NOTE: [erf] in triton_math.py), carried by z / 2 into h, / 2 into gelu'
            p1 = 1 if p is None else p.double().abs()[:, None]
            _within_ulp(h, h0, 2**-22 * z.double().abs() * p1, f"h {what}")
            _within_ulp(dz, dz0, 2**-22 * dh.double().abs() * p1, f"dfc1_out {what}")
        if p is None:
            assert dp is None and dp0 is None
            continue
        assert dp.dtype == dp0.dtype == pdt
        z32, g32 = z.float(), dh.float()
        terms = act_mod.REFERENCE.act_fwd(z32, None, activation).abs() * g32.abs()
        bound = UNIT[pdt] * dp0.double().abs() + dh.shape[1] * UNIT[torch.float32] * terms.sum(-1).double()
        assert ((dp.double() - dp0.double()).abs() <= bound + 1e-30).all(), f"dprobs {what}"


@gpu
@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("save", POLICIES)
def test_grouped_mlp_on_cuda_runs_the_fused_kernels(activation, save, monkeypatch):
    """On CUDA the record holds the Triton kernels; y and every gradient equal, bitwise, the
    same call with the reference activation (dprobs within fp32 summation error; GELU within
    bf16 rounding: NOTE: [erf] in triton_math.py), and are within the float64 reference's bound."""
    import importlib

    pytest.importorskip("triton")
    gm = importlib.import_module("functional_dw.grouped_mlp")
    inp, dy = _on(*make(activation, torch.bfloat16, bias=True, splits=[40, 0, 88, 17], seed=3), "cuda")
    splits = torch.tensor([40, 0, 88, 17], device="cuda")
    _, res = fd.grouped_mlp_fwd(inp["x"], inp["w1"], inp["w2"], splits, probs=inp["probs"], activation=activation)
    assert "TritonActivation()" in repr(res)
    y, grads = run(inp, dy, splits, activation=activation, save=save)
    monkeypatch.setattr(gm, "select", lambda kernels, x, activation: act_mod.REFERENCE)
    y0, g0 = run(inp, dy, splits, activation=activation, save=save)
    i_p = NAMES.index("probs") + 2 * (E - 1)  # (x, E w1, E w2, probs, ...)
    if activation == "gelu":
        torch.testing.assert_close([y, *grads], [y0, *g0], rtol=2**-6, atol=2**-10)
    else:
        assert_same(y, y0, "y")
        assert_same(grads[:i_p] + grads[i_p + 1 :], g0[:i_p] + g0[i_p + 1 :], "grads")
    torch.testing.assert_close(grads[i_p], g0[i_p], rtol=2**-7, atol=1e-6)
    check_against_reference(inp, dy, activation, y, grads, splits=[40, 0, 88, 17])


@gpu
def test_grouped_mlp_fused_activation_in_a_cuda_graph():
    """A whole fwd+bwd step (device splits, fused activation) captured by ``graphs.graph_step``
    and replayed: the eager bits."""
    pytest.importorskip("triton")
    inp, dy = _on(*make("swiglu", torch.bfloat16, splits=[40, 0, 88, 17], seed=5), "cuda")
    splits = torch.tensor([40, 0, 88, 17], device="cuda")
    y0, g0 = run(inp, dy, splits, backend="torch")  # (torch's grouped GEMM: device splits)
    want = (y0.detach(), g0)  # not y0: its live graph would make capture wait on the default stream
    del y0
    g = fd.graphs.graph_step(lambda x, s, d: run(dict(inp, x=x), d, s, backend="torch"), inp["x"], splits, dy)
    y, grads = g()
    torch.cuda.synchronize()
    assert_same(y, want[0])
    assert_same(grads, want[1])


_INTERPRET = """
import contextlib, os, torch
torch.cuda.device = lambda d: contextlib.nullcontext()
from functional_dw.kernels import activation as ref, triton_activation as ta
g = torch.Generator().manual_seed(0)
worst = {}
for act in ("swiglu", "gelu", "silu"):
    for T, F in ((0, 4), (1, 3), (37, 150)):
        W = 2 * F if act == "swiglu" else F
        z = torch.randn(T, W + 2, generator=g)[:, 2:] * 4
        dh, p = torch.randn(T, F, generator=g), torch.rand(T, generator=g)
        dpin = torch.randn(2 * T, generator=g)[::2]  # a strided dprobs_in (a view)
        for pp, dd in ((None, None), (p, dpin)):
            h, h0 = ta.act_fwd(z, pp, act), ref.act_fwd(z, pp, act)
            (dz, dp), (dz0, dp0) = ta.act_bwd(z, pp, dh, act, dprobs_in=dd), ref.act_bwd(z, pp, dh, act, dprobs_in=dd)
            assert h.shape == h0.shape and dz.shape == dz0.shape and (dp is None) == (dp0 is None)
            rel = lambda a, b: ((a - b).abs() / (b.abs() + 1e-3 * b.abs().max())).max().item() if a.numel() else 0.0
            worst[act] = max(worst.get(act, 0.0), rel(h, h0), rel(dz, dz0), 0.0 if dp is None else rel(dp, dp0))
print(" ".join(f"{k}={v:.3g}" for k, v in worst.items()))
"""


def test_triton_activation_kernels_in_the_interpreter():
    """The kernels' indexing, masks, strides, probs and dprobs on the CPU (Triton's interpreter,
    whose exp and erf are not torch's: 7e-5 apart at worst, relative to each value or a
    thousandth of the largest, where erf's tails and dprobs' cancellations leave tiny values; a
    wrong index or mask errs by O(1). The GPU test checks the bits)."""
    pytest.importorskip("triton")
    import os
    import subprocess
    import sys

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", _INTERPRET], env=env, capture_output=True, text=True, timeout=600)
    if "only 0-dimensional arrays can be converted to Python scalars" in out.stderr:
        pytest.skip("this Triton's interpreter cannot run a loop with a run-time bound under this numpy")
    assert out.returncode == 0, out.stderr[-3000:]
    worst = dict(kv.split("=") for kv in out.stdout.split())
    assert set(worst) == set(ACTS) and all(float(v) < 1e-3 for v in worst.values()), out.stdout


_INTERPRET_FP8 = """
import contextlib, os, torch
torch.cuda.device = lambda d: contextlib.nullcontext()
from functional_dw.kernels import triton_rowwise as tr, triton_activation as ta
from functional_dw.fp8 import rowwise as rw
from functional_dw import fp8
spec = fp8.tensor_spec(fp8.RowwiseScaling(), "input")
g = torch.Generator().manual_seed(0)
names = ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv")
for act in ("swiglu", "gelu", "silu"):
    for sizes, F in (([5, 0, 40, 19], 48), ([1] * 17 + [90], 130)):
        T, W = sum(sizes), (2 * F if act == "swiglu" else F)
        z = (torch.randn(T, W + 2, generator=g) * 3)[:, 2:]
        ends = torch.tensor(sizes).cumsum(0).to(torch.int32)
        pends = rw.padded_ends(torch.tensor(sizes))
        for p in (None, torch.rand(T, generator=g)):
            for rows, cols in ((True, True), (False, True), (True, False)):
                want = tr.quantize_activation(ta.act_fwd(z, p, act), ends, pends, spec, rowwise=rows, columnwise=cols)
                got = tr.quantize_activation(z, ends, pends, spec, rowwise=rows, columnwise=cols, act=(act, p))
                for n in names:
                    a, b = getattr(got, n), getattr(want, n)
                    assert (a is None) == (b is None) and (a is None or torch.equal(a.float(), b.float())), (act, F, n)
                assert got.shape == (T, F) and got.dtype == z.dtype
print("ok")
"""


def test_rowwise_quantization_with_the_activation_as_its_load_in_the_interpreter():
    """NOTE: [The activation as the load]: h's FP8 copies and scales from fc1_out equal, bitwise,
    those of the h the activation kernel writes (Triton's CPU interpreter: the same kernels'
    code; the GPU test runs them compiled)."""
    pytest.importorskip("triton")
    import os
    import subprocess
    import sys

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", _INTERPRET_FP8], env=env, capture_output=True, text=True, timeout=900)
    if "only 0-dimensional arrays can be converted to Python scalars" in out.stderr:
        pytest.skip("this Triton's interpreter cannot run a loop with a run-time bound under this numpy")
    assert out.returncode == 0 and out.stdout.split() == ["ok"], out.stderr[-3000:]


@gpu
def test_rowwise_quantization_with_the_activation_as_its_load_on_cuda():
    """The compiled kernels: h's copies from fc1_out bitwise those of the written h (bf16,
    strided fc1_out, empty experts, a tile straddling experts)."""
    pytest.importorskip("triton")
    from functional_dw.fp8 import rowwise as rw
    from functional_dw.kernels import triton_activation as ta, triton_rowwise as tr

    spec = fp8.tensor_spec(fp8.RowwiseScaling(), "input")
    g = torch.Generator().manual_seed(2)
    for activation in ACTS:
        for sizes, F2 in (([5, 0, 40, 19], 48), ([1] * 17 + [900], 1536), ([0, 3000, 0, 1], 768)):
            T_, W = sum(sizes), (2 if activation == "swiglu" else 1) * F2
            z = (torch.randn(T_, W + 8, generator=g) * 3).to("cuda", torch.bfloat16)[:, 8:]
            ends = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
            pends = rw.padded_ends(torch.tensor(sizes, device="cuda"))
            for p in (None, torch.rand(T_, generator=g).cuda()):
                want = tr.quantize_activation(
                    ta.act_fwd(z, p, activation), ends, pends, spec, rowwise=True, columnwise=True
                )
                got = tr.quantize_activation(z, ends, pends, spec, rowwise=True, columnwise=True, act=(activation, p))
                for n in ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv"):
                    a, b = getattr(got, n), getattr(want, n)
                    assert torch.equal(
                        a.view(torch.uint8) if a.dtype.itemsize == 1 else a,
                        b.view(torch.uint8) if b.dtype.itemsize == 1 else b,
                    ), (activation, sizes, n)


@gpu
@pytest.mark.parametrize("save", ["default", "h"])
def test_rowwise_fp8_mlp_fuses_h_into_its_quantization(save, monkeypatch):
    """RowwiseScaling on CUDA: fc2's FP8 h comes from fc1_out in the quantization's own pass
    (forward, and under "default" the recompute in backward), and y and every gradient equal,
    bitwise, the unfused call (the reference activation writing h, then the quantization)."""
    import importlib

    pytest.importorskip("triton")
    gm = importlib.import_module("functional_dw.grouped_mlp")
    rowwise_ops = importlib.import_module("functional_dw.kernels.rowwise")
    sizes = [40, 0, 88, 17]
    inp, dy = _on(*make("swiglu", torch.bfloat16, splits=sizes, seed=9), "cuda")
    splits = torch.tensor(sizes, device="cuda")
    calls = []
    real = rowwise_ops.quantize_activated
    monkeypatch.setattr(rowwise_ops, "quantize_activated", lambda *a, **k: calls.append(k) or real(*a, **k))
    y, grads = run(inp, dy, splits, recipe=fp8.RowwiseScaling(bf16_below=0), save=save)
    fused = list(calls)
    assert [(c["rowwise"], c["columnwise"]) for c in fused] == [(True, True)] + (
        [(False, True)] if save == "default" else []
    )
    monkeypatch.setattr(gm, "select", lambda kernels, x, activation: act_mod.REFERENCE)
    y0, g0 = run(inp, dy, splits, recipe=fp8.RowwiseScaling(bf16_below=0), save=save)
    assert len(calls) == len(fused)  # the reference activation: nothing fused
    assert_same(y, y0, "y")
    i_p = NAMES.index("probs") + 2 * (E - 1)
    assert_same(grads[:i_p] + grads[i_p + 1 :], g0[:i_p] + g0[i_p + 1 :], "grads")
    torch.testing.assert_close(grads[i_p], g0[i_p], rtol=2**-7, atol=1e-6)


def test_select_decides_once_and_routes_per_call():
    """select: a backend's own kernels, else the fused ones only for a CUDA operand (the CPU
    here: the reference); activation_kernels keeps a record's kernels on plain operands."""
    k = FusedActivation()
    assert act_mod.select(k, torch.ones(2), "swiglu") is k
    assert act_mod.select(TorchKernels(), torch.ones(2), "swiglu") is act_mod.REFERENCE
    assert act_mod.select(None, torch.ones(2, dtype=torch.float64), "swiglu") is act_mod.REFERENCE
    assert act_mod.activation_kernels(k, torch.ones(2)) is k
    assert act_mod.activation_kernels(act_mod.REFERENCE, torch.ones(2)) is act_mod.REFERENCE
    with torch.autograd.forward_ad.dual_level():
        assert act_mod.activation_kernels(k, torch.ones(2)) is act_mod.REFERENCE
    tracked = torch.ones(2, requires_grad=True)  # a create_graph backward: autograd records the reference
    assert act_mod.activation_kernels(k, tracked) is act_mod.REFERENCE
    with torch.no_grad():
        assert act_mod.activation_kernels(k, tracked) is k


# --- FP8 ---------------------------------------------------------------------------------------------

FP8_SPLITS = [16, 0, 32, 16]


@pytest.mark.parametrize("recipe", ["current", "delayed"])
def test_fp8_policies_and_the_layers_chain(recipe):
    """Each linear quantizes as its layer does: y is grouped_linear_fwd, the reference activation,
    grouped_linear_fwd, bitwise; "default" (h recomputed and quantized again) equals "h"."""
    r = fp8.Float8CurrentScaling() if recipe == "current" else fp8.DelayedScaling()

    def states():
        return None if recipe == "current" else (fp8.init_state(r, num_gemms=E), fp8.init_state(r, num_gemms=E))

    inp, dy = make("swiglu", torch.bfloat16, splits=FP8_SPLITS)
    results = {}
    for save in ("default", "h"):
        st = states()
        y = call(inp, FP8_SPLITS, recipe=r, fp8_state=st, save=save)
        results[save] = (y, list(torch.autograd.grad(y, leaves(inp), dy)), st)
    (y, grads, st), (y2, g2, st2) = results["default"], results["h"]
    assert_same(y2, y)
    assert_same(g2, grads)
    if st is not None:  # the recompute records no amax: the same state
        assert_same(pytree.tree_leaves(st), pytree.tree_leaves(st2))
    s1, s2 = (None, None) if recipe == "current" else states()
    fc1, _ = fd.grouped_linear_fwd(inp["x"], inp["w1"], FP8_SPLITS, recipe=r, fp8_state=s1)
    h = act_mod.act_fwd(fc1, inp["probs"], "swiglu")
    y3, _ = fd.grouped_linear_fwd(h, inp["w2"], FP8_SPLITS, recipe=r, fp8_state=s2)
    assert_same(y3, y.detach())
    _, res = fd.grouped_mlp_fwd(
        inp["x"], inp["w1"], inp["w2"], FP8_SPLITS, probs=inp["probs"], recipe=r, fp8_state=states(), save="h"
    )
    assert "FP8(" in repr(res) and not any(t is inp["x"] for t in fd.saved_activations(res))  # x's FP8 copy only


# Pipeline schedules: micro-batches' forwards and backwards interleaved (the module applies its
# pending update at each forward, so a forward may change the scales before an earlier backward)
SCHEDULES = {
    "fA fB bA bB": ["fA", "fB", "bA", "bB"],
    "fA fB bB bA": ["fA", "fB", "bB", "bA"],
    "1F1B": ["fA", "fB", "bA", "fC", "bB", "bC"],
}


def _fwd_state(m):
    """Clones of both linears' forward FP8 state (histories and scales)."""
    return [t.clone() for s in (m.fc1.fp8_state, m.fc2.fp8_state) for t in (s.amax_history_fwd, s.scale_fwd)]


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_delayed_scaling_with_other_forwards_before_a_backward(schedule):
    """Under save="default" backward quantizes the recomputed h again with the scales fc2's forward
    used and records no amax (NOTE: [The state is bound per call]): grads and both linears' FP8
    states equal save="h"'s (the model without the recompute: h's FP8 copy kept) bit for bit, and no
    backward writes into a forward history. (Before, the recompute read the scales a later forward
    had updated, and maxed h's amax into that later micro-batch's row.)"""

    def run(save):
        torch.manual_seed(0)
        m = fd.nn.GroupedMLP(E, H, F_, params_dtype=torch.bfloat16, recipe=fp8.DelayedScaling(), save=save)
        batches = {}
        for i, mb in enumerate("ABC"):
            inp, dy = make("swiglu", torch.bfloat16, splits=FP8_SPLITS, seed=10 * i)
            x = inp["x"].detach() * (40 if mb == "A" else 1)  # A's h far larger: a stale scale or row shows
            batches[mb] = (x.requires_grad_(), inp["probs"], dy)
        ys = {}
        for op, mb in SCHEDULES[schedule]:
            x, probs, dy = batches[mb]
            if op == "f":
                ys[mb] = m(x, FP8_SPLITS, probs)
                after_forwards = _fwd_state(m)
            else:
                ys[mb].backward(dy)
        assert_same(_fwd_state(m), after_forwards)  # backwards left every forward history and scale as it was
        grads = [batches[mb][k].grad for mb in ys for k in (0, 1)] + [p.grad for p in m.parameters()]
        return grads, [t.clone() for s in (m.fc1.fp8_state, m.fc2.fp8_state) for t in pytree.tree_leaves(s)]

    grads, states = run("default")
    want_grads, want_states = run("h")
    assert all(g is not None for g in grads)
    assert_same(grads, want_grads)
    assert_same(states, want_states)


# --- errors ---------------------------------------------------------------------------------------------


def _err(exc, match, **changes):
    inp, _ = make("swiglu")
    kw = {k: changes.pop(k) for k in list(changes) if k in ("activation", "save", "recipe", "fp8_state")}
    inp.update(changes)
    with pytest.raises(exc, match=match):
        call(inp, **kw)


def test_errors_name_the_argument_and_the_fix():
    w1_wrong = [torch.randn(F_, H) for _ in range(E)]  # [F, H]: what GELU takes, not SwiGLU
    _err(
        ValueError,
        r"w1 is \[16, 32\] per expert but activation='swiglu' needs 2 \* F = 32 out-features.*"
        r"make w1 \[32, 32\]",
        w1=w1_wrong,
    )
    _err(
        ValueError,
        r"w1 is \[32, 32\] per expert but activation='gelu' needs F = 16 out-features.*"
        r"make w1 \[16, 32\] \(a \[32, 32\] w1 is for activation='swiglu'\)",
        activation="gelu",
    )
    _err(
        ValueError,
        r"w1 has 4 experts but w2 has 3: fc1 and fc2 need one weight per expert",
        w2=[torch.randn(H, F_) for _ in range(3)],
    )
    _err(ValueError, r"activation must be one of 'swiglu', 'gelu', 'silu', got 'relu'", activation="relu")
    _err(ValueError, r"save must be one of 'default', 'h', 'x_only'", save="all")
    _err(
        ValueError,
        r"probs must be \[T\] = \[10\], one router weight per row of x, got shape \(10, 1\).*"
        r"probs.reshape\(-1\)",
        probs=torch.rand(T, 1),
    )
    _err(ValueError, r"probs must be \[T\] = \[10\].*got shape \(9,\)", probs=torch.rand(9))
    _err(TypeError, r"probs must be float32, bfloat16, float16 or float64", probs=torch.ones(T, dtype=torch.int64))
    _err(
        ValueError, r"x has 32 features but w1 is \[32, 16\] per expert", w1=[torch.randn(2 * F_, F_) for _ in range(E)]
    )
    _err(
        ValueError,
        r"save='x_only' recomputes fc1's output from x, but with FP8",
        save="x_only",
        recipe=fp8.Float8CurrentScaling(),
    )
    _err(
        TypeError,
        r"fp8_state must be None or a pair \(fc1's state, fc2's state\)",
        recipe=fp8.DelayedScaling(),
        fp8_state=fp8.init_state(fp8.DelayedScaling(), num_gemms=E),
    )
    _err(
        ValueError,
        r"grouped_mlp's fc2 \(its x is h = act\(fc1_out\) \* probs, its weights w2, its bias bias2\): "
        r"bias must be None, a sequence of 4",
        bias2=[torch.randn(H) for _ in range(3)],
    )
    with pytest.raises(TypeError, match="grouped_mlp_bwd takes the GroupedMLPResiduals that grouped_mlp_fwd returned"):
        fd.grouped_mlp_bwd(object(), torch.zeros(T, H))


# --- nn.GroupedMLP ------------------------------------------------------------------------------------


@pytest.mark.parametrize("single", [False, True], ids=["per-expert", "single-grouped-weight"])
@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_module_loads_two_grouped_linear_state_dicts(activation, single):
    n1 = (2 if activation == "swiglu" else 1) * F_
    fc1, fc2 = fd.nn.GroupedLinear(E, H, n1, bias=True), fd.nn.GroupedLinear(E, F_, H, bias=True)
    sd = {
        **{f"fc1.{k}": v for k, v in fc1.state_dict().items()},
        **{f"fc2.{k}": v for k, v in fc2.state_dict().items()},
    }
    assert "fc1.weight0" in sd and f"fc2.weight{E - 1}" in sd
    m = fd.nn.GroupedMLP(E, H, F_, activation=activation, bias=True, single_grouped_weight=single)
    m.load_state_dict(sd)  # strict: the keys of two GroupedLinears, in either layout
    if not single:
        assert set(m.state_dict()) == set(sd)
    x = torch.randn(T, H, requires_grad=True)
    probs = torch.rand(T, requires_grad=True)
    dy = torch.randn(T, H)
    y = m(x, SPLITS, probs)
    y.backward(dy)
    w1, w2 = fc1.weights(), fc2.weights()
    for t in (*w1, *w2, *fc1.biases(), *fc2.biases()):
        t.requires_grad_()
    x2, p2 = x.detach().clone().requires_grad_(), probs.detach().clone().requires_grad_()
    y2 = fd.grouped_mlp(x2, w1, w2, SPLITS, probs=p2, bias1=fc1.biases(), bias2=fc2.biases(), activation=activation)
    y2.backward(dy)
    assert_same(y, y2)
    assert_same([x.grad, probs.grad], [x2.grad, p2.grad])
    got = list(m.fc1.weight.grad.unbind(0)) if single else [w.grad for w in m.fc1.weights()]
    assert_same(got, [w.grad for w in w1])


def test_module_defaults_to_one_weight_per_layer_and_loads_te_layout():
    """nn.GroupedMLP(E, H, F) holds one [E, out, in] weight per layer (one gradient for the
    engine per layer, not E) and loads TE's per-expert keys into it."""
    m = fd.nn.GroupedMLP(E, H, F_)
    assert m.fc1.single_grouped_weight and m.fc2.single_grouped_weight
    assert [n for n, _ in m.named_parameters()] == ["fc1.weight", "fc2.weight"]
    te_layout = fd.nn.GroupedMLP(E, H, F_, single_grouped_weight=False)
    assert "fc1.weight0" in te_layout.state_dict()
    m.load_state_dict(te_layout.state_dict())  # strict
    assert torch.equal(m.fc1.weight, torch.stack(te_layout.fc1.weights()))
    assert torch.equal(m.fc2.weight, torch.stack(te_layout.fc2.weights()))


def test_module_runs_fp8_with_a_state_per_linear():
    m = fd.nn.GroupedMLP(E, H, F_, params_dtype=torch.bfloat16, recipe=fp8.DelayedScaling())
    x = torch.randn(sum(FP8_SPLITS), H, dtype=torch.bfloat16, requires_grad=True)
    m(x, FP8_SPLITS).float().square().sum().backward()
    assert m.fc1.fp8_state is not None and m.fc2.fp8_state is not None
    assert m.fc1.fp8_state.amax_history_fwd.abs().sum() > 0 and m.fc2.fp8_state.amax_history_bwd.abs().sum() > 0
    assert m.fc1.weight.grad is not None and x.grad is not None
    assert "fc1._extra_state" in m.state_dict() and "fc2._extra_state" in m.state_dict()


@pytest.mark.parametrize("save", ["default", "h"])
def test_fp8_bytes_saved_per_token(save):
    """With FP8: x's FP8 copy (1 B per feature, per expert columnwise, a scale each), fc1's output
    in bf16, and under "h" h's FP8 copy; never a weight."""
    inp, dy = make("swiglu", torch.bfloat16, probs=False, splits=FP8_SPLITS)
    rec = HOOKS["identity"]()
    with rec:
        y = call(inp, FP8_SPLITS, recipe=fp8.Float8CurrentScaling(), save=save)
    y.backward(dy)
    by = {}
    for t in rec.packed:
        by[t.dtype] = by.get(t.dtype, 0) + t.numel() * t.element_size()
    T_, nonempty = sum(FP8_SPLITS), sum(1 for s in FP8_SPLITS if s)
    h_copy = F_ * T_ if save == "h" else 0
    assert by == {
        torch.float8_e4m3fn: H * T_ + h_copy,
        torch.float32: 4 * E * (2 if save == "h" else 1),
        torch.bfloat16: 2 * F_ * 2 * T_,
    }, (by, nonempty)


@pytest.mark.parametrize("with_kwargs", [False, True])
def test_module_runs_its_linears_forward_pre_hooks(with_kwargs):
    """fc1/fc2 never run their forwards (one node), but hooks on them must (Megatron's DDP waits for
    each module's parameter all-gather in its pre-hook): each runs once per forward, before the
    node reads the weights; one that returns a new input is refused."""
    m = fd.nn.GroupedMLP(E, H, F_)
    x = torch.randn(T, H)
    seen = []

    def hook(mod, args, *kwargs):
        # what a parameter gather does before the layer runs: the node must read these values
        with torch.no_grad():
            for w in mod.weights():
                w.mul_(2.0)
        seen.append((mod, args[0] is x, kwargs == ({},) if with_kwargs else kwargs == ()))

    want_m = fd.nn.GroupedMLP(E, H, F_)
    want_m.load_state_dict(m.state_dict())
    with torch.no_grad():
        for w in (*want_m.fc1.weights(), *want_m.fc2.weights()):
            w.mul_(2.0)
    want = want_m(x, SPLITS)
    handles = [layer.register_forward_pre_hook(hook, with_kwargs=with_kwargs) for layer in (m.fc1, m.fc2)]
    y = m(x, SPLITS)
    assert seen == [(m.fc1, True, True), (m.fc2, True, True)]
    assert_same(y, want)
    for h in handles:
        h.remove()
    m.fc2.register_forward_pre_hook(lambda mod, args: (args[0] * 2,))
    with pytest.raises(ValueError, match="returned a new input"):
        m(x, SPLITS)


def test_bias1_changed_in_place_before_an_x_only_backward_is_refused():
    """save="x_only" runs fc1's GEMM again in backward, reading bias1: changed in place since
    forward, the gradients would silently use the new bias (as a weight's change is refused)."""
    g = torch.Generator().manual_seed(0)
    w1 = torch.randn(3, 8, 6, generator=g, dtype=torch.float64, requires_grad=True)
    w2 = torch.randn(3, 6, 4, generator=g, dtype=torch.float64, requires_grad=True)
    b1 = torch.randn(3, 8, generator=g, dtype=torch.float64, requires_grad=True)
    x = torch.randn(7, 6, generator=g, dtype=torch.float64, requires_grad=True)
    y = fd.grouped_mlp(x, w1, w2, [3, 0, 4], bias1=b1, save="x_only", backend="torch")
    with torch.no_grad():
        b1.add_(1)
    with pytest.raises(RuntimeError, match="bias1 was modified in place"):
        y.sum().backward()


@pytest.mark.parametrize("bad", [None, 1.5, "w"])
def test_weights_of_the_wrong_kind_are_named(bad):
    """Not a tensor nor a sequence of them: the layer's TypeError, naming fc1 or fc2 (the planned
    run's gate leaves them to it)."""
    w = torch.randn(3, 8, 6, dtype=torch.float64)
    x = torch.randn(7, 6, dtype=torch.float64, requires_grad=True)
    with pytest.raises(TypeError, match="grouped_mlp's fc1 .* got"):
        fd.grouped_mlp(x, bad, w, [3, 0, 4], backend="torch")
    with pytest.raises(TypeError, match="grouped_mlp's fc2 .* got"):
        fd.grouped_mlp(x, w, bad, [3, 0, 4], activation="gelu", backend="torch")


# --- rows: the experts' input gathered from x (issue 41) ---------------------------------------------

T_X = 6  # x's tokens; ROWS gathers R = 10 rows from them (top-k repeats, token 2 once, SPLITS' expert 1 empty)
ROWS = torch.tensor([0, 1, 1, 3, 5, 5, 5, 2, 4, 0])
FALLBACK = fp8.RowwiseScaling(bf16_below=float("inf"))  # every call runs its bf16 plan (the per-call rule)
ROWS_RECIPES = {"bf16": None, "rowwise": fp8.RowwiseScaling(bf16_below=0), "fallback": FALLBACK}


def make_rows(activation="swiglu", dtype=torch.float32, *, probs=True, bias=False, seed=0):
    """make()'s inputs with x of T_X tokens (probs, dy per gathered row: R = sum(SPLITS))."""
    inp, dy = make(activation, dtype, probs=probs, bias=bias, seed=seed)
    inp["x"] = _rand(T_X, H, seed=seed + 7, dtype=dtype).requires_grad_()
    return inp, dy


def run_rows(inp, dy, rows=ROWS, splits=SPLITS, gathered=False, **kw):
    """(y, grads of leaves(inp)): grouped_mlp with rows, or (``gathered``) on x.index_select(0, rows)."""
    if gathered:
        y = call(dict(inp, x=inp["x"].index_select(0, rows)), splits, **kw)
    else:
        y = call(inp, splits, rows=rows, **kw)
    return y, list(torch.autograd.grad(y, leaves(inp), dy))


@pytest.mark.parametrize("recipe", list(ROWS_RECIPES))
@pytest.mark.parametrize("probs, bias", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("save", POLICIES)
@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_rows_is_the_gathered_call_bitwise(activation, save, probs, bias, recipe):
    """y, dx (summed into the tokens), dw1, dw2, dprobs and the biases' grads: the bits of the
    call on x.index_select(0, rows) through autograd, for every policy, bf16, RowwiseScaling and
    its bf16 fallback."""
    if recipe != "bf16" and save == "x_only":
        pytest.skip("x_only is refused with a recipe")
    inp, dy = make_rows(activation, probs=probs, bias=bias)
    kw = dict(activation=activation, save=save, recipe=ROWS_RECIPES[recipe])
    y, grads = run_rows(inp, dy, **kw)
    y0, g0 = run_rows(inp, dy, gathered=True, **kw)
    assert y.shape == (ROWS.shape[0], H) and grads[0].shape == (T_X, H)
    assert_same(y, y0)
    assert_same(grads, g0)
    assert grads[0].abs().sum(1).ne(0).all()  # (every token has a row: each got its grads)


def test_rows_rowwise_quantizes_through_the_index(monkeypatch):
    """With RowwiseScaling, fc1's input is quantized from x through the index (its plan's
    quantize_rows): forward gathers no bf16 rows; its bf16 fallback gathers them once."""
    from functional_dw import mlp_rows

    gathers, fused = [], []
    gather = mlp_rows.gather
    monkeypatch.setattr(mlp_rows, "gather", lambda x, r: gathers.append(r) or gather(x, r))
    orig = fd.fp8_rowwise_plan.RowwisePlan.quantize_rows

    def spy(self, *a, **k):
        q = orig(self, *a, **k)
        fused.append(q is not None)
        return q

    monkeypatch.setattr(fd.fp8_rowwise_plan.RowwisePlan, "quantize_rows", spy)
    inp, dy = make_rows()
    y = call(inp, rows=ROWS, recipe=ROWS_RECIPES["rowwise"])
    assert fused == [True] and gathers == [], (fused, len(gathers))
    torch.autograd.grad(y, leaves(inp), dy)
    assert gathers == []  # (FP8 fc1 keeps x[rows]'s FP8 copy: backward gathers nothing either)
    call(inp, rows=ROWS, recipe=FALLBACK)
    assert fused == [True] and len(gathers) == 1


def test_rows_te_recipe_gathers_first():
    """A recipe whose family cannot quantize through the index (TE's current scaling, emulated)
    gathers the rows, then quantizes: the gathered call's bits."""
    splits, rows = [16, 0, 16, 16], torch.arange(48) % 20
    inp, _ = make(probs=True, splits=splits)
    inp["x"] = _rand(20, H, seed=9).requires_grad_()
    dy = _rand(48, H, seed=10)
    kw = dict(recipe=fp8.Float8CurrentScaling())
    y, grads = run_rows(inp, dy, rows=rows, splits=splits, **kw)
    y0, g0 = run_rows(inp, dy, rows=rows, splits=splits, gathered=True, **kw)
    assert_same(y, y0)
    assert_same(grads, g0)


def test_rows_under_autocast_is_the_gathered_call():
    inp, dy = make_rows(bias=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, grads = run_rows(inp, dy.bfloat16())
        y0, g0 = run_rows(inp, dy.bfloat16(), gathered=True)
    assert y.dtype == torch.bfloat16 and grads[0].dtype == torch.float32
    assert_same(y, y0)
    assert_same(grads, g0)


def _saved(inp, dy, gathered, **kw):
    """What the saved-tensor hooks see of a call with rows, or (``gathered``) on x[rows]."""
    rec = HOOKS["identity"]()
    with rec:
        y = call(dict(inp, x=inp["x"].index_select(0, ROWS)), **kw) if gathered else call(inp, rows=ROWS, **kw)
    torch.autograd.grad(y, leaves(inp), dy)
    return rec.packed


@pytest.mark.parametrize("save", POLICIES)
def test_rows_hooks_see_x_not_the_rows(save):
    """The record keeps x [T, H] and rows [R], not x[rows] [R, H]: with R > T, fewer bytes
    through the saved-tensor hooks than the gathered call's, by (R - T) * H elements."""
    inp, dy = make_rows()
    ours, gathered = _saved(inp, dy, False, save=save), _saved(inp, dy, True, save=save)
    assert any(t is inp["x"] for t in ours) and any(t is ROWS for t in ours)
    x_R = inp["x"].detach().index_select(0, ROWS)
    assert any(t.shape == x_R.shape and torch.equal(t, x_R) for t in gathered)
    assert not any(t.shape == x_R.shape and torch.equal(t, x_R) for t in ours), [tuple(t.shape) for t in ours]
    saving = sum(t.numel() * t.element_size() for t in gathered) - sum(t.numel() * t.element_size() for t in ours)
    assert saving == (ROWS.shape[0] - T_X) * H * 4


@pytest.mark.parametrize("save", POLICIES)
def test_rows_retain_graph_twice(save):
    inp, dy = make_rows(bias=True)
    y = call(inp, rows=ROWS, save=save)
    g1 = torch.autograd.grad(y, leaves(inp), dy, retain_graph=True)
    g2 = torch.autograd.grad(y, leaves(inp), dy)
    assert_same(list(g2), list(g1))


@pytest.mark.parametrize("save", POLICIES)
def test_rows_pure_pair_is_the_op(save):
    inp, dy = make_rows(bias=True)
    y, grads = run_rows(inp, dy, save=save)
    w = {k: inp[k] for k in ("probs", "bias1", "bias2")}
    y2, res = fd.grouped_mlp_fwd(inp["x"].detach(), inp["w1"], inp["w2"], SPLITS, rows=ROWS, save=save, **w)
    assert res.rows.index() is ROWS and res.fc1.x_TK is None and res.x.shape == (T_X, H)
    text = repr(res)
    assert "fc1's input is x[rows]" in text and "gathered again in backward" in text
    g = fd.grouped_mlp_bwd(res, dy)
    assert_same(y2, y.detach())
    assert_same(g.dx, grads[0])


@pytest.mark.parametrize(
    "rows, splits, err, match",
    [
        (ROWS.float(), SPLITS, TypeError, "rows must be an int64"),
        (ROWS > 2, SPLITS, TypeError, "nonzero"),
        (ROWS[None], SPLITS, ValueError, "rows must be a dense 1-D"),
        (ROWS[:-1], SPLITS, ValueError, "rows holds 9 indices but splits count 10"),
        (ROWS[:-1], torch.tensor(SPLITS), ValueError, "rows holds 9 indices but splits count 10"),
        (ROWS.to("meta"), SPLITS, ValueError, "rows is on meta"),
        (torch.tensor([0, 1, 1, 3, 5, 5, 6, 2, 4, 0]), SPLITS, IndexError, r"rows has an index outside \[0, 6\)"),
        ([0, 1, 1, 3, 5, 5, 5, 2, 4, 0], SPLITS, TypeError, "rows must be an int64"),
    ],
    ids=["float", "bool", "2-D", "R-not-splits", "R-not-tensor-splits", "device", "range", "list"],
)
def test_rows_bad_rows_are_named(rows, splits, err, match):
    inp, _ = make_rows()
    with pytest.raises(err, match=match):
        call(inp, splits, rows=rows)
    with pytest.raises(err, match=match):
        fd.grouped_mlp_fwd(inp["x"], inp["w1"], inp["w2"], splits, probs=inp["probs"], rows=rows)


@pytest.mark.parametrize("rows", ["index", "topk"])
def test_rows_probs_of_x_tokens_are_named(rows):
    """probs [T] (one per token of x) where the experts weigh R rows: the message says [R] and
    x[rows], not "[T] = [R], one per row of x" (x has T rows)."""
    inp, _ = make_rows()
    r = fd.TopkRows(torch.arange(T_X * 2), 2) if rows == "topk" else ROWS
    splits = [T_X * 2, 0, 0, 0] if rows == "topk" else SPLITS
    R = T_X * 2 if rows == "topk" else ROWS.shape[0]
    with pytest.raises(ValueError, match=rf"probs must be \[R\] = \[{R}\], one router weight per row of x\[rows\]"):
        call(dict(inp, probs=torch.rand(T_X, requires_grad=True)), splits, rows=r)


def test_rows_torch_compile_aot_eager_equals_eager():
    torch._dynamo.reset()
    inp, dy = make_rows(bias=True)
    splits = torch.tensor(SPLITS)

    def f(x, w1, w2, splits, p, b1, b2, rows):
        return fd.grouped_mlp(x, w1, w2, splits, probs=p, bias1=b1, bias2=b2, rows=rows)

    args = (inp["x"], inp["w1"], inp["w2"], splits, inp["probs"], inp["bias1"], inp["bias2"], ROWS)
    y = f(*args)
    grads = torch.autograd.grad(y, leaves(inp), dy)
    y2 = torch.compile(f, backend="aot_eager", fullgraph=True)(*args)
    assert_same(y2, y)
    assert_same(list(torch.autograd.grad(y2, leaves(inp), dy)), list(grads))


@pytest.mark.parametrize("save", POLICIES)
def test_rows_second_order_is_the_gathered_calls(save):
    """Grad of grad (create_graph): the gathered call's, through the saved x (backward's gather
    and sum are torch ops); FP8 refuses it, as without rows."""
    inp, _ = make_rows("swiglu", torch.float64, bias=True)
    x = inp["x"]

    def hvp(gathered):
        kw = dict(save=save, use_grouped_tensor=False)
        y = call(dict(inp, x=x.index_select(0, ROWS)), **kw) if gathered else call(inp, rows=ROWS, **kw)
        (gx,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)
        return torch.autograd.grad(gx.sum(), [x, inp["probs"], *inp["w1"]])

    got, want = hvp(False), hvp(True)
    assert want[0].abs().sum() > 0
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    if save != "x_only":
        inp8, _ = make_rows()
        y = call(inp8, rows=ROWS, save=save, recipe=ROWS_RECIPES["rowwise"])
        with pytest.raises(NotImplementedError, match="cannot be differentiated again"):
            torch.autograd.grad(y.sum(), inp8["x"], create_graph=True)


def test_rows_jvp_is_the_gathered_calls():
    inp, _ = make_rows("swiglu", torch.float64, bias=True)
    primals = tuple(inp[k] for k in NAMES)
    tangents = pytree.tree_map(lambda t: torch.randn_like(t), primals)

    def ours(x, w1, w2, p, b1, b2):
        return fd.grouped_mlp(x, w1, w2, SPLITS, probs=p, bias1=b1, bias2=b2, rows=ROWS)

    def gathered(x, w1, w2, p, b1, b2):
        return fd.grouped_mlp(x.index_select(0, ROWS), w1, w2, SPLITS, probs=p, bias1=b1, bias2=b2)

    y, ty = torch.func.jvp(ours, primals, tangents)
    y0, ty0 = torch.func.jvp(gathered, primals, tangents)
    assert_same(y, y0)
    assert_same(ty, ty0)


def test_rows_distributed_weights_gather_first():
    """FakeDW groups with rows: the rows are gathered first (NOTE: [Rows gathered first]); the
    gathered call's y, dx and the shards' grads."""
    inp, dy = make_rows(bias=True)

    def grads(gathered):
        w = {k: FakeDW.group_of([t.detach() for t in inp[k]]) for k in ("w1", "w2")}
        d = dict(inp, **w)
        y, g = run_rows(d, dy, gathered=gathered)
        return [y, *g, *[t.grad for t in w["w1"] + w["w2"]]]

    assert_same(grads(False), grads(True))


def test_rows_pure_api_checks_x_version():
    inp, dy = make_rows()
    x = inp["x"].detach().clone()
    _, res = fd.grouped_mlp_fwd(x, inp["w1"], inp["w2"], SPLITS, probs=inp["probs"], rows=ROWS)
    x.add_(1)
    with pytest.raises(RuntimeError, match="x was modified in place"):
        fd.grouped_mlp_bwd(res, dy)


@pytest.mark.parametrize("rows", ["index", "topk"])
@pytest.mark.parametrize("recipe", ["bf16", "rowwise"])
def test_rows_pure_api_checks_rows_version(rows, recipe):
    """A routing buffer refilled between the pure forward and backward: backward gathers x[rows]
    again (dw1) and sums dx by it, so the change is named as x's is, not a silently wrong dx, dw1."""
    inp, dy = make_rows()
    index = ROWS.clone() if rows == "index" else torch.arange(T_X * 2)
    r = index if rows == "index" else fd.TopkRows(index, 2)
    splits = SPLITS if rows == "index" else [T_X * 2, 0, 0, 0]
    dy = dy if rows == "index" else _rand(T_X * 2, H, seed=3)
    w = dict(probs=inp["probs"]) if rows == "index" else {}
    _, res = fd.grouped_mlp_fwd(
        inp["x"].detach(), inp["w1"], inp["w2"], splits, rows=r, recipe=ROWS_RECIPES[recipe], **w
    )
    index.copy_(index.flip(0))
    with pytest.raises(RuntimeError, match="rows was modified in place"):
        fd.grouped_mlp_bwd(res, dy)


def test_rows_torch_func_grad_and_vmap_are_the_gathered_calls():
    inp, dy = make_rows("swiglu", torch.float64)
    w = (inp["w1"], inp["w2"], SPLITS)

    def ours(x):
        return fd.grouped_mlp(x, *w, probs=inp["probs"].detach(), rows=ROWS)

    def gathered(x):
        return fd.grouped_mlp(x.index_select(0, ROWS), *w, probs=inp["probs"].detach())

    x = inp["x"].detach()
    grad = [torch.func.grad(lambda x, f=f: (f(x) * dy).sum())(x) for f in (ours, gathered)]
    assert_same(grad[0], grad[1])
    assert grad[0].shape == (T_X, H)
    xb = torch.stack([x, 2 * x, -x])
    assert_same(torch.func.vmap(ours)(xb), torch.func.vmap(gathered)(xb))


# --- rows as a top-k dispatch (TopkRows): dx is the dispatch's deterministic per-token sum -------

TK_T, TK_K = 7, 3  # 7 tokens, 3 choices each: R = 21 rows; a token may pick an expert twice


def make_topk(dtype=torch.float32, seed=0):
    """make()'s weights, x [TK_T, H], router probs [T, k], expert indices [T, k] drawn with
    repeats from experts 0, 2, 3 (expert 1 empty), and dy per dispatched row."""
    inp, _ = make(dtype=dtype, probs=False, bias=True, seed=seed)
    g = torch.Generator().manual_seed(seed + 11)
    inp["x"] = _rand(TK_T, H, seed=seed + 7, dtype=dtype).requires_grad_()
    inp["probs"] = torch.rand(TK_T, TK_K, generator=g).to(dtype).requires_grad_()
    indices = torch.tensor([0, 2, 3])[torch.randint(0, 3, (TK_T, TK_K), generator=g)]
    dy = _rand(TK_T * TK_K, H, seed=seed + 9, dtype=dtype)
    return inp, indices, dy


def run_topk(inp, indices, dy, how, **kw):
    """(y, grads of leaves(inp)): the dispatch's rows into grouped_mlp (``how="parts"``), or
    grouped_mlp on x with ``TopkRows(order, k)`` (``"topk"``) or the plain index ``order // k``
    (``"index"``); probs through the dispatch in each."""
    rows, probs_r, splits, order = fd.moe.dispatch(inp["x"], inp["probs"], indices, E)
    x = rows if how == "parts" else inp["x"]
    rows_arg = {"parts": None, "topk": fd.TopkRows(order, TK_K), "index": order // TK_K}[how]
    y = fd.grouped_mlp(
        x, inp["w1"], inp["w2"], splits, probs=probs_r, bias1=inp["bias1"], bias2=inp["bias2"], rows=rows_arg, **kw
    )
    return y, list(torch.autograd.grad(y, leaves(inp), dy))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("recipe", ["bf16", "rowwise"])
@pytest.mark.parametrize("save", POLICIES)
def test_rows_topk_is_the_dispatch_bitwise(save, recipe, dtype):
    """grouped_mlp(x, rows=TopkRows(order, k)): y and every grad (x's the per-token sum in
    choice order) are the bits of moe.dispatch's rows into grouped_mlp, for every policy, bf16
    and RowwiseScaling (CPU emulation)."""
    if recipe != "bf16" and save == "x_only":
        pytest.skip("x_only is refused with a recipe")
    inp, indices, dy = make_topk(DTYPES[dtype])
    kw = dict(save=save, recipe=ROWS_RECIPES[recipe])
    y, grads = run_topk(inp, indices, dy, "topk", **kw)
    y0, g0 = run_topk(inp, indices, dy, "parts", **kw)
    assert y.shape == (TK_T * TK_K, H) and grads[0].shape == (TK_T, H)
    assert_same(y, y0)
    assert_same(grads, g0)


def test_rows_topk_and_index_agree_to_rounding_but_only_topk_is_the_dispatchs_bits():
    """The plain index ``order // k`` (dx by index_add, in expert order) and TopkRows (the sum in
    choice order) give the same y and weight grads, dx equal to rounding; only TopkRows' dx is
    bit for bit the dispatch's (float32: a token's 3 rows summed in another order round otherwise)."""
    inp, indices, dy = make_topk()
    y, g = run_topk(inp, indices, dy, "topk")
    y_i, g_i = run_topk(inp, indices, dy, "index")
    _, g_p = run_topk(inp, indices, dy, "parts")
    assert_same(y_i, y)
    assert_same(g_i[1:], g[1:])
    torch.testing.assert_close(g_i[0], g[0], atol=1e-5, rtol=1e-5)
    assert not torch.equal(g_i[0], g[0])  # (the index path sums in another order: other bits)
    assert_same(g[0], g_p[0])


def test_rows_topk_runs_planned_and_bitwise_the_bridge():
    """A bf16 TopkRows call runs as grouped_mlp's planned node (its record rides on the node, not
    the bridge's generic path, as an index tensor's does): y and every grad the bridge's bits."""
    bp = importlib.import_module("functional_dw._bridge_planned")
    gm = importlib.import_module("functional_dw.grouped_mlp")
    inp, indices, dy = make_topk()
    for how in ("topk", "index"):
        y, grads = run_topk(inp, indices, dy, how)
        assert issubclass(type(y.grad_fn)._forward_cls, bp._PlannedRun), how
        with mock.patch.object(gm, "run_planned", lambda *a, **k: None):
            yb, gb = run_topk(inp, indices, dy, how)
        assert not issubclass(type(yb.grad_fn)._forward_cls, bp._PlannedRun)
        assert type(yb.grad_fn).__name__ == type(y.grad_fn).__name__
        assert_same(y, yb)
        assert_same(grads, gb)


@pytest.mark.parametrize("save", POLICIES)
def test_rows_topk_hooks_see_x_not_the_rows(save):
    """The record keeps x [T, H] and order [T * k], not x[order // k]."""
    inp, indices, dy = make_topk()
    _, _, splits, order = fd.moe.dispatch(inp["x"].detach(), None, indices, E)
    rec = HOOKS["identity"]()
    with rec:
        y = fd.grouped_mlp(inp["x"], inp["w1"], inp["w2"], splits, save=save, rows=fd.TopkRows(order, TK_K))
    torch.autograd.grad(y, [inp["x"]], dy)
    assert any(t is inp["x"] for t in rec.packed) and any(t is order for t in rec.packed)
    x_R = inp["x"].detach().index_select(0, order // TK_K)
    assert not any(t.shape == x_R.shape and torch.equal(t, x_R) for t in rec.packed), [
        tuple(t.shape) for t in rec.packed
    ]


def test_rows_topk_under_autocast_is_the_dispatchs():
    """Under autocast TopkRows gathers first (NOTE: [Rows gathered first]), x's grad still the
    dispatch's per-token sum."""
    inp, indices, dy = make_topk()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, g = run_topk(inp, indices, dy.bfloat16(), "topk")
        y0, g0 = run_topk(inp, indices, dy.bfloat16(), "parts")
    assert y.dtype == torch.bfloat16
    assert_same(y, y0)
    assert_same(g, g0)


def test_rows_topk_pure_pair_compile_and_transforms_are_the_dispatchs():
    """TopkRows through the pure pair (its record says what it keeps), torch.compile
    (aot_eager: gathered first), torch.func.grad and vmap: y and dx the dispatch's bits;
    second order (create_graph) too for dx, its grad of grad to rounding."""
    inp, indices, dy = make_topk()
    x, w1, w2 = inp["x"], inp["w1"], inp["w2"]
    _, _, splits, order = fd.moe.dispatch(x.detach(), None, indices, E)
    rec = fd.TopkRows(order, TK_K)

    def ours(x, order=order):
        return fd.grouped_mlp(x, w1, w2, splits, rows=fd.TopkRows(order, TK_K))

    def parts(x):
        return fd.grouped_mlp(fd.moe.dispatch(x, None, indices, E)[0], w1, w2, splits)

    y0 = parts(x)
    (g0,) = torch.autograd.grad(y0, x, dy, create_graph=True)
    y, res = fd.grouped_mlp_fwd(x.detach(), w1, w2, splits, rows=rec)
    assert "rows = TopkRows([21] int64, top_k=3)" in repr(res) and res.rows is rec
    assert_same(y, y0.detach())
    assert_same(fd.grouped_mlp_bwd(res, dy).dx, g0.detach())
    torch._dynamo.reset()
    y2 = torch.compile(ours, backend="aot_eager", fullgraph=True)(x)
    assert_same(y2, y0)
    assert_same(torch.autograd.grad(y2, x, dy)[0], g0.detach())
    w1, w2 = [w.detach() for w in w1], [w.detach() for w in w2]
    xd = x.detach()
    assert_same(
        torch.func.grad(lambda x: (ours(x) * dy).sum())(xd), torch.func.grad(lambda x: (parts(x) * dy).sum())(xd)
    )
    xb = torch.stack([xd, 2 * xd, -xd])
    assert_same(torch.func.vmap(ours)(xb), torch.func.vmap(parts)(xb))
    w1, w2 = inp["w1"], inp["w2"]
    (g,) = torch.autograd.grad(ours(x), x, dy, create_graph=True)
    assert_same(g, g0)
    torch.testing.assert_close(
        torch.autograd.grad(g.square().sum(), x)[0], torch.autograd.grad(g0.square().sum(), x)[0]
    )


# --- combine: the experts sum their rows back into the tokens (moe.combine inside grouped_mlp) ---


def run_combined(inp, indices, dy_T, how, **kw):
    """(y [T, H], grads of leaves(inp)): grouped_mlp(x, rows=..., combine=True) with
    ``TopkRows(order, k)`` (``how="topk"``) or the index ``order // k`` (``"index"``), or the
    dispatch's rows into grouped_mlp, then ``moe.combine`` (``"parts"``); probs through the
    dispatch in each."""
    rows, probs_r, splits, order = fd.moe.dispatch(inp["x"], inp["probs"], indices, E)
    w = (inp["w1"], inp["w2"], splits)
    b = dict(probs=probs_r, bias1=inp["bias1"], bias2=inp["bias2"], **kw)
    if how == "parts":
        y = fd.moe.combine(fd.grouped_mlp(rows, *w, **b), order, TK_K)
    else:
        r = fd.TopkRows(order, TK_K) if how == "topk" else order // TK_K
        y = fd.grouped_mlp(inp["x"], *w, rows=r, combine=True, **b)
    return y, list(torch.autograd.grad(y, leaves(inp), dy_T))


def make_combined(dtype=torch.float32, bias=True, seed=0):
    """make_topk's inputs (biases dropped unless ``bias``) and dy per token ``[TK_T, H]``."""
    inp, indices, _ = make_topk(dtype, seed)
    if not bias:
        inp["bias1"] = inp["bias2"] = None
    return inp, indices, _rand(TK_T, H, seed=seed + 13, dtype=dtype)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("recipe", list(ROWS_RECIPES))
@pytest.mark.parametrize("save", POLICIES)
def test_rows_combine_is_the_dispatch_and_combine_bitwise(save, recipe, dtype, bias):
    """grouped_mlp(x, rows=TopkRows(order, k), combine=True): y [T, H] and every grad are the bits
    of moe.dispatch, grouped_mlp and moe.combine through autograd, for every policy, bf16,
    RowwiseScaling (dy quantized through the order) and its bf16 fallback, with and without
    biases (probs * bias2 reads dy's rows: they are gathered)."""
    if recipe != "bf16" and save == "x_only":
        pytest.skip("x_only is refused with a recipe")
    inp, indices, dy = make_combined(DTYPES[dtype], bias)
    kw = dict(save=save, recipe=ROWS_RECIPES[recipe])
    y, grads = run_combined(inp, indices, dy, "topk", **kw)
    y0, g0 = run_combined(inp, indices, dy, "parts", **kw)
    assert y.shape == (TK_T, H) and grads[0].shape == (TK_T, H)
    assert_same(y, y0)
    assert_same(grads, g0)


def test_rows_combine_with_an_index_is_index_add():
    """combine with a plain index: y is index_add of the rows into zeros (and dx index_add's too)."""
    inp, indices, dy = make_combined()
    _, probs_r, splits, order = fd.moe.dispatch(inp["x"], inp["probs"], indices, E)
    y, g = run_combined(inp, indices, dy, "index")
    r = order // TK_K
    h = fd.grouped_mlp(
        inp["x"].index_select(0, r), inp["w1"], inp["w2"], splits, probs=probs_r, bias1=inp["bias1"], bias2=inp["bias2"]
    )
    y0 = h.new_zeros(TK_T, H).index_add(0, r, h)
    assert_same(y, y0)
    assert_same(g, list(torch.autograd.grad(y0, leaves(inp), dy)))


@pytest.mark.parametrize("bias", [False, True])
def test_rows_combine_rowwise_quantizes_dy_through_the_index(bias, monkeypatch):
    """With RowwiseScaling fc2's dy[rows] is quantized from dy [T, H] through the order (its
    plan's quantize_rows with the dy spec): no bf16 dy rows are gathered. A bias grad reads dy's
    rows in high precision: then they are gathered once, and quantized as gathered."""
    from functional_dw import mlp_rows

    gathers, specs = [], []
    gather = mlp_rows.gather
    monkeypatch.setattr(mlp_rows, "gather", lambda t, r: gathers.append(tuple(t.shape)) or gather(t, r))
    orig = fd.fp8_rowwise_plan.RowwisePlan.quantize_rows

    def spy(self, kernels, spec, *a, **k):
        specs.append("dy" if spec is self.dy else "x" if spec is self.x else "?")
        return orig(self, kernels, spec, *a, **k)

    monkeypatch.setattr(fd.fp8_rowwise_plan.RowwisePlan, "quantize_rows", spy)
    inp, indices, dy = make_combined(bias=bias)
    y, grads = run_combined(inp, indices, dy, "topk", recipe=ROWS_RECIPES["rowwise"])
    want_specs = ["x"] if bias else ["x", "dy"]
    assert specs == want_specs and gathers == ([(TK_T, H)] if bias else []), (specs, gathers)
    monkeypatch.setattr(mlp_rows, "gather", gather)
    monkeypatch.setattr(fd.fp8_rowwise_plan.RowwisePlan, "quantize_rows", orig)
    y0, g0 = run_combined(inp, indices, dy, "parts", recipe=ROWS_RECIPES["rowwise"])
    assert_same(y, y0)
    assert_same(grads, g0)


def test_rows_combine_gathers_first_under_autocast_compile_and_distributed_weights():
    """Where rows are gathered first (NOTE: [Rows gathered first]), the sum runs after the call,
    differentiably: y and every grad still the dispatch's and the combine's bits."""
    inp, indices, dy = make_combined()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, g = run_combined(inp, indices, dy.bfloat16(), "topk")
        y0, g0 = run_combined(inp, indices, dy.bfloat16(), "parts")
    assert y.dtype == torch.bfloat16
    assert_same([y, *g], [y0, *g0])

    def dw_grads(how):
        w = {k: FakeDW.group_of([t.detach() for t in inp[k]]) for k in ("w1", "w2")}
        y, g = run_combined(dict(inp, **w), indices, dy, how)
        return [y, *g, *[t.grad for t in w["w1"] + w["w2"]]]

    assert_same(dw_grads("topk"), dw_grads("parts"))
    x, w1, w2 = inp["x"], inp["w1"], inp["w2"]
    _, _, splits, order = fd.moe.dispatch(x.detach(), None, indices, E)

    def ours(x):
        return fd.grouped_mlp(x, w1, w2, splits, rows=fd.TopkRows(order, TK_K), combine=True)

    def parts(x):
        return fd.moe.combine(fd.grouped_mlp(fd.moe.dispatch(x, None, indices, E)[0], w1, w2, splits), order, TK_K)

    torch._dynamo.reset()
    y2 = torch.compile(ours, backend="aot_eager", fullgraph=True)(x)
    y0 = parts(x)
    assert_same(y2, y0)
    assert_same(torch.autograd.grad(y2, x, dy)[0], torch.autograd.grad(y0, x, dy)[0])


def test_rows_combine_pure_pair_transforms_planned_run_and_retain_graph():
    """The pure pair (its record says combine; bwd takes dy [T, H]), torch.func.jvp, grad and
    vmap, the planned node (bitwise the bridge's), backward twice under retain_graph, and grad
    of grad: the dispatch's and the combine's numbers."""
    bp = importlib.import_module("functional_dw._bridge_planned")
    inp, indices, dy = make_combined(torch.float64)
    x, w1, w2 = inp["x"], inp["w1"], inp["w2"]
    _, _, splits, order = fd.moe.dispatch(x.detach(), None, indices, E)
    rec = fd.TopkRows(order, TK_K)

    def ours(x, w1=w1):
        return fd.grouped_mlp(x, w1, w2, splits, rows=rec, combine=True)

    def parts(x, w1=w1):
        return fd.moe.combine(fd.grouped_mlp(fd.moe.dispatch(x, None, indices, E)[0], w1, w2, splits), order, TK_K)

    y0 = parts(x)
    (g0,) = torch.autograd.grad(y0, x, dy, create_graph=True)
    y, res = fd.grouped_mlp_fwd(x.detach(), w1, w2, splits, rows=rec, combine=True)
    assert "combine: y's rows summed" in repr(res)
    assert_same(y, y0.detach())
    assert_same(fd.grouped_mlp_bwd(res, dy).dx, g0.detach())
    ys = [ours(x) for _ in range(2)]
    assert issubclass(type(ys[1].grad_fn)._forward_cls, bp._PlannedRun)
    for yy in ys:
        assert_same(yy, y0)
        assert_same(torch.autograd.grad(yy, x, dy, retain_graph=True)[0], g0)
        assert_same(torch.autograd.grad(yy, x, dy)[0], g0)
    (g,) = torch.autograd.grad(ours(x), x, dy, create_graph=True)
    torch.testing.assert_close(
        torch.autograd.grad(g.square().sum(), x)[0], torch.autograd.grad(g0.square().sum(), x)[0]
    )
    xd = x.detach()
    t = torch.randn_like(xd)

    def torch_parts(x):  # (moe's pairs have no forward-mode rule: their ops in torch)
        h = fd.grouped_mlp(x.index_select(0, order // TK_K), w1, w2, splits)
        return h.index_select(0, order.argsort()).unflatten(0, (-1, TK_K)).sum(1)

    assert_same(torch_parts(xd), parts(xd))
    assert_same(torch.func.jvp(ours, (xd,), (t,)), torch.func.jvp(torch_parts, (xd,), (t,)))
    assert_same(
        torch.func.grad(lambda x: (ours(x) * dy).sum())(xd), torch.func.grad(lambda x: (parts(x) * dy).sum())(xd)
    )
    xb = torch.stack([xd, 2 * xd, -xd])
    assert_same(torch.func.vmap(ours)(xb), torch.func.vmap(parts)(xb))


def test_rows_combine_bad_arguments_are_named():
    inp, indices, dy = make_combined()
    _, _, splits, order = fd.moe.dispatch(inp["x"].detach(), None, indices, E)
    w = (inp["w1"], inp["w2"], splits)
    with pytest.raises(ValueError, match="combine=True sums y's rows into x's tokens, so it needs rows"):
        fd.grouped_mlp(inp["x"], *w, combine=True)
    with pytest.raises(ValueError, match="needs rows"):
        fd.grouped_mlp_fwd(inp["x"], *w, combine=True)
    with pytest.raises(TypeError, match="combine must be a bool, got int"):
        fd.grouped_mlp(inp["x"], *w, rows=fd.TopkRows(order, TK_K), combine=1)
    _, res = fd.grouped_mlp_fwd(inp["x"].detach(), *w, rows=fd.TopkRows(order, TK_K), combine=True)
    with pytest.raises(ValueError, match="dy"):
        fd.grouped_mlp_bwd(res, torch.ones(TK_T * TK_K, H))  # (the rows' dy, not the tokens')


_ORDER = torch.arange(TK_T * TK_K)


@pytest.mark.parametrize(
    "order, k, err, match",
    [
        (_ORDER.float(), TK_K, TypeError, r"rows \(TopkRows\) order must be an int64"),
        (_ORDER.view(TK_T, TK_K), TK_K, ValueError, r"rows \(TopkRows\) order must be a dense 1-D"),
        (_ORDER[:-1], TK_K, ValueError, r"order holds 20 rows but x's 7 tokens times top_k=3 make 21"),
        (_ORDER, 2, ValueError, r"order holds 21 rows but x's 7 tokens times top_k=2 make 14"),
        (_ORDER, 0, ValueError, r"rows \(TopkRows\) top_k must be a positive int, got 0"),
        (_ORDER, 3.0, ValueError, r"rows \(TopkRows\) top_k must be a positive int, got 3.0"),
        (_ORDER.to("meta"), TK_K, ValueError, r"rows \(TopkRows\) order is on meta"),
    ],
    ids=["float", "2-D", "R", "k", "k=0", "k-float", "device"],
)
def test_rows_topk_bad_rows_are_named(order, k, err, match):
    inp, _, _ = make_topk()
    splits = [TK_T * TK_K - 1, 0, 0, 1]
    with pytest.raises(err, match=match):
        fd.grouped_mlp(inp["x"], inp["w1"], inp["w2"], splits, rows=fd.TopkRows(order, k))
    with pytest.raises(err, match=match):
        fd.grouped_mlp_fwd(inp["x"], inp["w1"], inp["w2"], splits, rows=fd.TopkRows(order, k))
    with pytest.raises(ValueError, match="rows holds 21 indices but splits count 20"):
        fd.grouped_mlp(inp["x"], inp["w1"], inp["w2"], [20, 0, 0, 0], rows=fd.TopkRows(_ORDER, TK_K))


@pytest.mark.parametrize("recipe", ["bf16", "rowwise"])
def test_rows_topk_order_not_a_permutation_is_named(recipe):
    """An order with a repeated (token, choice) pair and a missing one: refused on the CPU (as
    moe.combine refuses it), not a dx summed from the wrong rows (inverse(order) has a hole)."""
    inp, _, _ = make_topk()
    order = torch.randperm(TK_T * TK_K, generator=torch.Generator().manual_seed(1))
    order[order == 4] = 5  # (pair 5 twice, pair 4 never)
    splits = [TK_T * TK_K - 1, 0, 0, 1]
    kw = dict(recipe=ROWS_RECIPES[recipe], rows=fd.TopkRows(order, TK_K))
    with pytest.raises(ValueError, match=r"rows \(TopkRows\) order must be a permutation"):
        fd.grouped_mlp(inp["x"], inp["w1"], inp["w2"], splits, **kw)
    with pytest.raises(ValueError, match=r"rows \(TopkRows\) order must be a permutation"):
        fd.grouped_mlp_fwd(inp["x"], inp["w1"], inp["w2"], splits, **kw)


def test_rows_topk_jvp_under_autocast_is_the_index_calls():
    """Under autocast a TopkRows call gathers first (NOTE: [Rows gathered first]); forward mode
    then runs through that gather too: the plain index's y and tangent, not a NotImplementedError."""
    inp, indices, _ = make_topk()
    _, _, splits, order = fd.moe.dispatch(inp["x"].detach(), None, indices, E)
    w1, w2 = [w.detach() for w in inp["w1"]], [w.detach() for w in inp["w2"]]
    x = inp["x"].detach()
    t = torch.randn_like(x)

    def jvp(rows):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return torch.func.jvp(lambda x: fd.grouped_mlp(x, w1, w2, splits, rows=rows), (x,), (t,))

    y, ty = jvp(fd.TopkRows(order, TK_K))
    y0, ty0 = jvp(order // TK_K)
    assert y.dtype == torch.bfloat16
    assert_same(y, y0)
    assert_same(ty, ty0)


@pytest.mark.parametrize("rows", ["index", "topk"])
def test_rows_fake_tensor_splits_are_named(rows):
    """Under FakeTensorMode tensor splits hold no counts: the same ValueError as without rows
    (rows' total check must not read them: a DataDependentOutputException)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.randn(TK_T, H)
        w1, w2 = torch.randn(E, 2 * F_, H), torch.randn(E, H, F_)
        order = torch.arange(TK_T * TK_K)
        r = fd.TopkRows(order, TK_K) if rows == "topk" else order // TK_K
        with pytest.raises(ValueError, match="splits is a fake tensor"):
            fd.grouped_mlp(x, w1, w2, torch.tensor([TK_T * TK_K, 0, 0, 0]), rows=r)
        assert fd.grouped_mlp(x, w1, w2, [TK_T * TK_K, 0, 0, 0], rows=r).shape == (TK_T * TK_K, H)


@gpu
@pytest.mark.parametrize("save", ["default", "h"])
def test_rows_on_cuda_quantize_through_the_index(save, monkeypatch):
    """RowwiseScaling on CUDA with rows: fc1's input is quantized by the Triton kernels reading x
    through the index (forward gathers no bf16 rows), bitwise the gathered call (index_add, which
    sums the repeats' grads, made deterministic for the comparison)."""
    pytest.importorskip("triton")
    from functional_dw import mlp_rows

    sizes = [40, 0, 88, 16]
    inp, dy = _on(*make("swiglu", torch.bfloat16, splits=sizes, seed=9), "cuda")
    inp["x"] = _rand(100, H, seed=11, dtype=torch.bfloat16).cuda().requires_grad_()
    rows = torch.randint(0, 100, (sum(sizes),), generator=torch.Generator().manual_seed(3)).cuda()
    splits = torch.tensor(sizes, device="cuda")
    gathers, real = [], mlp_rows.gather
    monkeypatch.setattr(mlp_rows, "gather", lambda x, r: gathers.append(r) or real(x, r))
    kw = dict(recipe=fp8.RowwiseScaling(bf16_below=0), save=save)
    prev = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        y = call(inp, splits, rows=rows, **kw)
        assert gathers == []
        grads = list(torch.autograd.grad(y, leaves(inp), dy))
        y0, g0 = run_rows(inp, dy, rows=rows, splits=splits, gathered=True, **kw)
    finally:
        torch.use_deterministic_algorithms(prev[0], warn_only=prev[1])
    assert_same(y, y0)
    assert_same(grads, g0)


@gpu
@pytest.mark.parametrize("save", ["default", "h"])
def test_rows_combine_on_cuda_reads_x_and_dy_through_the_order(save, monkeypatch):
    """RowwiseScaling on CUDA with TopkRows and combine: the Triton kernels read x (forward) and
    dy (backward) through the order, so no bf16 rows are gathered; y and every grad the bits of
    moe.dispatch, grouped_mlp and moe.combine (every sum deterministic: no index_add)."""
    pytest.importorskip("triton")
    from functional_dw import mlp_rows

    T_, k = 96, 4
    inp, _ = _on(*make("swiglu", torch.bfloat16, probs=False, seed=5), "cuda")
    inp["x"] = _rand(T_, H, seed=6, dtype=torch.bfloat16).cuda().requires_grad_()
    g = torch.Generator().manual_seed(8)
    inp["probs"] = torch.rand(T_, k, generator=g).cuda().requires_grad_()
    indices = torch.tensor([0, 2, 3])[torch.randint(0, 3, (T_, k), generator=g)].cuda()
    dy = _rand(T_, H, seed=9, dtype=torch.bfloat16).cuda()
    gathers, real = [], mlp_rows.gather
    monkeypatch.setattr(mlp_rows, "gather", lambda t, r: gathers.append(tuple(t.shape)) or real(t, r))
    kw = dict(recipe=fp8.RowwiseScaling(bf16_below=0), save=save)
    rows, probs_r, splits, order = fd.moe.dispatch(inp["x"], inp["probs"], indices, E)
    y = fd.grouped_mlp(
        inp["x"], inp["w1"], inp["w2"], splits, probs=probs_r, rows=fd.TopkRows(order, k), combine=True, **kw
    )
    grads = list(torch.autograd.grad(y, leaves(inp), dy))
    assert gathers == [] and y.shape == (T_, H)
    rows, probs_r, splits, order = fd.moe.dispatch(inp["x"], inp["probs"], indices, E)  # (its own graph)
    y0 = fd.moe.combine(fd.grouped_mlp(rows, inp["w1"], inp["w2"], splits, probs=probs_r, **kw), order, k)
    assert_same(y, y0)
    assert_same(grads, list(torch.autograd.grad(y0, leaves(inp), dy)))
