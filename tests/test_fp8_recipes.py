"""Recipes: TE's fields and defaults, field checks, TE's objects read without TE, specs per role."""

from __future__ import annotations

import dataclasses
import enum
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

import functional_dw as fd
from functional_dw import fp8
from functional_dw.fp8 import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    MMParams,
    QParams,
    as_recipe,
    split_accumulator,
    tensor_spec,
)

TE = "transformer_engine.common.recipe"
E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2


# ---- TE's defaults (transformer_engine/common/recipe/__init__.py, TE 2.20) ------------------


def test_format_values_are_tes():
    assert Format.E4M3.value == (448, 448) and Format.E5M2.value == (57344, 57344)
    assert Format.HYBRID.value == (448, 57344) and Format.E2M1.value == (6, 6)
    assert Format.HYBRID.value.max_fwd == 448 and Format.HYBRID.value.max_bwd == 57344


def test_delayed_scaling_defaults():
    r = DelayedScaling()
    assert (r.margin, r.fp8_format, r.amax_history_len, r.amax_compute_algo) == (0, Format.HYBRID, 1024, "max")
    assert (r.scaling_factor_compute_algo, r.reduce_amax, r.fp8_dpa, r.fp8_mha) == (None, True, False, False)
    assert not any(f.name.startswith("fp8_gemm_") for f in dataclasses.fields(r))  # TE has none for delayed


def test_current_scaling_defaults():
    r = Float8CurrentScaling()
    assert r.fp8_format == Format.HYBRID
    for q in (r.fp8_quant_fwd_inp, r.fp8_quant_fwd_weight, r.fp8_quant_bwd_grad):
        assert q == QParams(power_2_scale=r.use_power_2_scales, amax_epsilon=0.0)
    assert (r.fp8_gemm_fprop, r.fp8_gemm_dgrad, r.fp8_gemm_wgrad) == (MMParams(False), MMParams(True), MMParams(True))


def test_block_scaling_defaults():
    r = Float8BlockScaling()
    assert r.fp8_format == Format.E4M3
    assert (r.x_block_scaling_dim, r.w_block_scaling_dim, r.grad_block_scaling_dim) == (1, 2, 1)
    for q in (r.fp8_quant_fwd_inp, r.fp8_quant_fwd_weight, r.fp8_quant_bwd_grad):
        assert q == QParams(power_2_scale=not r.use_f32_scales, amax_epsilon=0.0)
    assert (r.fp8_gemm_fprop, r.fp8_gemm_dgrad, r.fp8_gemm_wgrad) == (MMParams(True),) * 3


def test_params_defaults():
    assert MMParams().use_split_accumulator is True
    q = QParams()
    assert (
        q.power_2_scale,
        q.amax_epsilon,
        q.random_hadamard_transform,
        q.stochastic_rounding,
        q.fp4_2d_quantization,
    ) == (False, 0.0, False, False, False)


@pytest.mark.skipif(any(k.startswith("NVTE_") for k in os.environ), reason="NVTE_* set in this environment")
def test_env_defaults_as_te_reads_them():
    """TE computes these defaults from the environment at import; so do we (a fresh interpreter)."""
    code = (
        "from functional_dw.fp8 import *; c, b = Float8CurrentScaling(), Float8BlockScaling();"
        "print(c.use_power_2_scales, c.fp8_quant_fwd_inp.power_2_scale, b.use_f32_scales,"
        " b.fp8_quant_bwd_grad.power_2_scale, c.backward_override)"
    )
    root = str(Path(fp8.__file__).parents[2])  # this checkout's package, whatever the cwd
    env = dict(
        os.environ,
        NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES="1",
        NVTE_FP8_BLOCK_SCALING_FP32_SCALES="1",
        NVTE_BACKWARD_OVERRIDE="dequantized",
        PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, check=True
    ).stdout
    assert out.split() == ["True", "True", "True", "False", "dequantized"]


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        DelayedScaling().margin = 1  # type: ignore[misc]


# ---- field checks: a ValueError naming the field ----------------------------------------------

BAD = [
    (DelayedScaling, dict(margin=1.5), "DelayedScaling.margin"),
    (DelayedScaling, dict(margin=True), "DelayedScaling.margin"),
    (DelayedScaling, dict(fp8_format="HYBRID"), "DelayedScaling.fp8_format"),
    (DelayedScaling, dict(fp8_format=Format.E5M2), "DelayedScaling.fp8_format"),
    (DelayedScaling, dict(fp8_format=Format.E2M1), "DelayedScaling.fp8_format"),
    (DelayedScaling, dict(amax_history_len=0), "DelayedScaling.amax_history_len"),
    (DelayedScaling, dict(amax_compute_algo="mean"), "DelayedScaling.amax_compute_algo"),
    (DelayedScaling, dict(scaling_factor_compute_algo="x"), "DelayedScaling.scaling_factor_compute_algo"),
    (DelayedScaling, dict(reduce_amax=1), "DelayedScaling.reduce_amax"),
    (DelayedScaling, dict(backward_override="dequantized"), "DelayedScaling.backward_override"),
    (Float8CurrentScaling, dict(fp8_quant_fwd_inp=(True, 0.0)), "Float8CurrentScaling.fp8_quant_fwd_inp"),
    (Float8CurrentScaling, dict(fp8_gemm_dgrad=True), "Float8CurrentScaling.fp8_gemm_dgrad"),
    (Float8CurrentScaling, dict(backward_override="fast"), "Float8CurrentScaling.backward_override"),
    (Float8CurrentScaling, dict(use_power_2_scales=None), "Float8CurrentScaling.use_power_2_scales"),
    (Float8CurrentScaling, dict(fp8_mha="no"), "Float8CurrentScaling.fp8_mha"),
    (Float8BlockScaling, dict(x_block_scaling_dim=3), "Float8BlockScaling.x_block_scaling_dim"),
    (Float8BlockScaling, dict(x_block_scaling_dim=2), "Float8BlockScaling.x_block_scaling_dim"),  # 2x2 with w
    (
        Float8BlockScaling,
        dict(w_block_scaling_dim=1, grad_block_scaling_dim=2, x_block_scaling_dim=2),
        "Float8BlockScaling.x_block_scaling_dim and Float8BlockScaling.grad_block_scaling_dim",
    ),
    (Float8BlockScaling, dict(fp8_gemm_fprop=MMParams(False)), "Float8BlockScaling.fp8_gemm_fprop"),
    (Float8BlockScaling, dict(fp8_dpa=True), "Float8BlockScaling.fp8_dpa"),
    (Float8BlockScaling, dict(fp8_format=Format.E5M2), "Float8BlockScaling.fp8_format"),
    (QParams, dict(amax_epsilon=-1.0), "QParams.amax_epsilon"),
    (QParams, dict(amax_epsilon=float("nan")), "QParams.amax_epsilon"),
    (QParams, dict(power_2_scale=1), "QParams.power_2_scale"),
    (QParams, dict(stochastic_rounding=None), "QParams.stochastic_rounding"),
    (MMParams, dict(use_split_accumulator="yes"), "MMParams.use_split_accumulator"),
]


@pytest.mark.parametrize("cls,kwargs,field", BAD, ids=[f"{c.__name__}-{next(iter(k))}" for c, k, _ in BAD])
def test_bad_field_names_it(cls, kwargs, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        cls(**kwargs)


def test_callable_algos_accepted():
    r = DelayedScaling(amax_compute_algo=lambda h: h[0], scaling_factor_compute_algo=lambda a, s, m, r: s)
    assert callable(r.amax_compute_algo) and callable(r.scaling_factor_compute_algo)


# ---- TE's objects, without TE --------------------------------------------------------------


class _Helper(NamedTuple):
    max_fwd: float
    max_bwd: float


TEFormat = enum.Enum(
    "Format",
    {"E2M1": _Helper(6, 6), "E4M3": _Helper(448, 448), "E5M2": _Helper(57344, 57344), "HYBRID": _Helper(448, 57344)},
)
TEFormat.__module__ = TE


def te_class(name: str, attrs: dict[str, Any], base: type = object) -> type:
    """A class that looks like TE's (by module and name), holding ``attrs`` as class attributes."""
    return type(name, (base,), {**attrs, "__module__": TE})


TEMMParams = te_class("MMParams", {"use_split_accumulator": True})
TEQParams = te_class("QParams", {"power_2_scale": False, "amax_epsilon": 0.0})


def te_obj(cls: type, **values: Any) -> Any:
    obj = cls()
    obj.__dict__.update(values)
    return obj


def test_as_recipe_none_and_ours():
    assert as_recipe(None) is None
    r = Float8BlockScaling()
    assert as_recipe(r) is r


def test_as_recipe_te_delayed():
    cls = te_class("DelayedScaling", {})
    te = te_obj(
        cls,
        margin=2,
        fp8_format=TEFormat.E4M3,
        amax_history_len=16,
        amax_compute_algo="most_recent",
        scaling_factor_compute_algo=None,
        reduce_amax=False,
        fp8_dpa=False,
        fp8_mha=False,
        backward_override=None,
        interval=1,
    )  # an unknown attribute (TE 1.x) is ignored
    assert as_recipe(te) == DelayedScaling(
        margin=2, fp8_format=Format.E4M3, amax_history_len=16, amax_compute_algo="most_recent", reduce_amax=False
    )


def test_as_recipe_te_current_reads_class_attributes():
    """TE's fp8_quant_* are class attributes (not in the instance dict); a user may assign them."""
    cls = te_class(
        "Float8CurrentScaling",
        {
            "fp8_quant_fwd_inp": te_obj(TEQParams, power_2_scale=True, amax_epsilon=1e-3),
            "fp8_quant_fwd_weight": te_obj(TEQParams),
            "fp8_quant_bwd_grad": te_obj(TEQParams, amax_epsilon=0.5),
            "fp8_gemm_fprop": te_obj(TEMMParams, use_split_accumulator=False),
            "fp8_gemm_dgrad": te_obj(TEMMParams),
            "fp8_gemm_wgrad": te_obj(TEMMParams),
        },
    )
    te = te_obj(
        cls, use_power_2_scales=False, fp8_format=TEFormat.HYBRID, fp8_dpa=False, fp8_mha=False, backward_override=None
    )
    r = as_recipe(te)
    assert isinstance(r, Float8CurrentScaling)
    assert r.fp8_quant_fwd_inp == QParams(True, 1e-3) and r.fp8_quant_bwd_grad == QParams(False, 0.5)
    assert r.fp8_gemm_fprop == MMParams(False)


def test_as_recipe_te_block_and_subclass():
    base = te_class("Float8BlockScaling", {})
    sub = type("MyBlocks", (base,), {"__module__": "user.code"})  # a user's subclass of TE's recipe
    r = as_recipe(te_obj(sub, fp8_format=TEFormat.HYBRID, w_block_scaling_dim=1, x_block_scaling_dim=2))
    assert r == Float8BlockScaling(fp8_format=Format.HYBRID, w_block_scaling_dim=1, x_block_scaling_dim=2)


def test_as_recipe_te_bad_field_names_it():
    te = te_obj(te_class("DelayedScaling", {}), amax_history_len=-1)
    with pytest.raises(ValueError, match="DelayedScaling.amax_history_len"):
        as_recipe(te)


@pytest.mark.parametrize("name", ["MXFP8BlockScaling", "NVFP4BlockScaling"])
def test_as_recipe_blackwell_recipes_refused(name):
    with pytest.raises(ValueError) as e:
        as_recipe(te_obj(te_class(name, {})))
    msg = str(e.value)
    assert name in msg and "10.0" in msg and "Hopper" in msg
    for ok in ("DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling"):
        assert ok in msg


def test_as_recipe_custom_refused():
    with pytest.raises(ValueError, match="custom recipe.*Hopper"):
        as_recipe(te_obj(te_class("CustomRecipe", {})))


def test_as_recipe_other_objects():
    with pytest.raises(TypeError, match="got builtins.str: 'delayed'"):
        as_recipe("delayed")
    lookalike = type("DelayedScaling", (), {"__module__": "not_te"})()
    with pytest.raises(TypeError, match="not_te.DelayedScaling"):
        as_recipe(lookalike)


# ---- specs per role ------------------------------------------------------------------------


@pytest.mark.parametrize("fmt,fwd,bwd", [(Format.HYBRID, E4, E5), (Format.E4M3, E4, E4)])
def test_spec_dtypes(fmt, fwd, bwd):
    for r in (DelayedScaling(fp8_format=fmt), Float8CurrentScaling(fp8_format=fmt), Float8BlockScaling(fp8_format=fmt)):
        assert [tensor_spec(r, role).fp8_dtype for role in fp8.ROLES] == [fwd, fwd, bwd]
        assert [tensor_spec(r, role).fp8_max for role in fp8.ROLES] == [fmt.value.max_fwd] * 2 + [fmt.value.max_bwd]


def test_spec_delayed():
    s = tensor_spec(DelayedScaling(margin=3), "weight")
    assert (s.role, s.scaling, s.block, s.power_2_scale, s.amax_epsilon, s.margin) == (
        "weight",
        "delayed",
        None,
        False,
        0.0,
        3,
    )


def test_spec_current_uses_fp8_quant_fields():
    r = Float8CurrentScaling(
        fp8_quant_fwd_inp=QParams(True, 0.25),
        fp8_quant_fwd_weight=QParams(False, 0.5),
        fp8_quant_bwd_grad=QParams(True, 0.0),
    )
    got = [(s.scaling, s.power_2_scale, s.amax_epsilon) for s in (tensor_spec(r, role) for role in fp8.ROLES)]
    assert got == [("current", True, 0.25), ("current", False, 0.5), ("current", True, 0.0)]


def test_spec_block():
    r = Float8BlockScaling(fp8_quant_fwd_weight=QParams(False, 1e-6))
    got = [(s.scaling, s.block, s.power_2_scale, s.amax_epsilon) for s in (tensor_spec(r, role) for role in fp8.ROLES)]
    assert got == [("block", (1, 128), True, 0.0), ("block", (128, 128), False, 1e-6), ("block", (1, 128), True, 0.0)]
    r = Float8BlockScaling(x_block_scaling_dim=2, w_block_scaling_dim=1)
    assert [tensor_spec(r, role).block for role in fp8.ROLES] == [(128, 128), (1, 128), (1, 128)]


def test_spec_from_te_recipe_and_errors():
    te = te_obj(te_class("DelayedScaling", {}), margin=1)
    assert tensor_spec(te, "input").margin == 1
    with pytest.raises(ValueError, match="role must be one of"):
        tensor_spec(DelayedScaling(), "output")
    with pytest.raises(ValueError, match="no FP8 recipe"):
        tensor_spec(None, "input")
    with pytest.raises(ValueError, match="TensorSpec.block"):
        fp8.TensorSpec("input", "current", E4, block=(1, 128))
    with pytest.raises(ValueError, match="TensorSpec.fp8_dtype"):
        fp8.TensorSpec("input", "current", torch.bfloat16)


def test_split_accumulator():
    assert split_accumulator(DelayedScaling()) == (False, True, True)  # TE's module defaults (_2X_ACC_*)
    assert split_accumulator(Float8CurrentScaling()) == (False, True, True)
    assert split_accumulator(Float8CurrentScaling(fp8_gemm_fprop=MMParams(True), fp8_gemm_wgrad=MMParams(False))) == (
        True,
        True,
        False,
    )
    assert split_accumulator(Float8BlockScaling()) == (True, True, True)


# ---- a toy format, added the way docs/design.md "Add an FP8 format" says ---------------------
# (1. the recipe; 2. its kernels and quantized tensor; 3. its family, registered; 4. in the
# package, _fp8.py would import the family's module: here the test registers it itself.)


@dataclasses.dataclass(frozen=True)
class Pow2Half:
    """1. The recipe: each tensor scaled by the power of two that brings its amax into [1, 2),
    stored in float16 (a toy: what is quantized how, nothing about which code multiplies)."""


@dataclasses.dataclass(frozen=True)
class ToySpec:
    role: str


class ToyQ:
    """2. Its quantized tensor: float16 data and a power-of-two inverse scale (one copy serves
    both usages); a pytree node whose leaves are its tensors."""

    def __init__(self, data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> None:
        self.data, self.scale_inv, self.dtype = data, scale_inv, dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    def with_usage(self, *, rowwise: bool, columnwise: bool) -> ToyQ:
        return self

    def value(self) -> torch.Tensor:
        return self.data.float() * self.scale_inv


torch.utils._pytree.register_pytree_node(
    ToyQ, lambda q: ([q.data, q.scale_inv], q.dtype), lambda leaves, dtype: ToyQ(*leaves, dtype)
)


def _toy_quantize(t: torch.Tensor) -> ToyQ:
    amax = t.detach().abs().float().amax() if t.numel() else torch.tensor(1.0)
    scale_inv = torch.exp2(torch.floor(torch.log2(amax))) if amax > 0 else torch.tensor(1.0)
    return ToyQ((t.detach().float() / scale_inv).half(), scale_inv, t.dtype)


class ToyKernels:
    """2. Its kernels on torch's backend: the protocol's methods on ToyQ operands, products in fp32
    rounded once to the activations' dtype (``grouped`` is not read: always per expert)."""

    name = "toy"

    def quantize(self, t, spec, *, scale=None, amax=None, rowwise=True, columnwise=False):
        return _toy_quantize(t)

    def grouped_quantize(
        self, x, splits, spec, *, scales=None, amaxes=None, rowwise=True, columnwise=False, grouped=False
    ):
        return [_toy_quantize(p) for p in x.split(splits.sizes())]

    def grouped_path_unsupported(self, x, w, recipe=None):
        return None

    def fprop(self, x, w, b, *, split_accumulator=False):
        y = x.value() @ w.value().t()
        return (y if b is None else y + b.float()).to(x.dtype)

    def dgrad(self, dy, w, *, split_accumulator=False):
        return (dy.value() @ w.value()).to(dy.dtype)

    def wgrad(self, x, dy, *, out=None, accumulate=False, with_dbias=False, split_accumulator=False):
        dw = dy.value().t() @ x.value()
        if out is None:
            return dw.to(x.dtype), None
        return (out.add_(dw.to(out.dtype)) if accumulate else out.copy_(dw.to(out.dtype))), None

    def grouped_fprop(self, xs, ws, b, splits, grouped, *, split_accumulator=False):
        return torch.cat([self.fprop(x, ws[e], None if b is None else b[e]) for e, x in enumerate(xs)])

    def grouped_dgrad(self, dys, ws, splits, grouped, *, split_accumulator=False):
        return torch.cat([self.dgrad(dy, ws[e]) for e, dy in enumerate(dys)])

    def grouped_wgrad(self, xs, dys, splits, grouped, *, out=None, accumulate=False, with_dbias=False, **kw):
        if out is None:
            return torch.stack([self.wgrad(x, dy)[0] for x, dy in zip(xs, dys)]), None
        for e, (x, dy) in enumerate(zip(xs, dys)):
            self.wgrad(x, dy, out=out[e], accumulate=accumulate)
        return out, None


TOY = ToyKernels()


@pytest.fixture
def toy_family():
    """3. Its family: a Plan subclass declaring its kernels per backend and its specs, registered
    for the recipe (unregistered after the test)."""
    from functional_dw import fp8_plan

    class ToyPlan(fp8_plan.Plan):
        KERNELS = {"torch": lambda: TOY}

        @classmethod
        def specs(cls, recipe):
            return tuple(ToySpec(role) for role in fp8.ROLES)

        @classmethod
        def split_accumulator(cls, recipe):
            return fp8.SplitAccumulator(False, False, False)

    fp8_plan.register_family(Pow2Half, ToyPlan)
    try:
        yield ToyPlan
    finally:
        del fp8_plan.FAMILIES[Pow2Half]


def _toy(t: torch.Tensor) -> torch.Tensor:
    """The toy's own plain-torch math: t scaled into [1, 2) by a power of two, through float16, back."""
    if not t.numel():
        return t.float()
    s = 2.0 ** torch.floor(torch.log2(t.detach().abs().float().max()))
    return (t.detach().float() / s).half().float() * s


def _toy_reference(xs, ws, bs, dys):
    """Per expert (a Linear: one): y, dx, dw, db of the toy's math, in the activations' dtype."""
    dt = xs[0].dtype
    ys = [(_toy(x) @ _toy(w).t() + b.float()).to(dt) for x, w, b in zip(xs, ws, bs)]
    dxs = [(_toy(dy) @ _toy(w)).to(dt) for dy, w in zip(dys, ws)]
    dws = [(_toy(dy).t() @ _toy(x)).to(dt) for x, dy in zip(xs, dys)]
    dbs = [dy.float().sum(0).to(dt) for dy in dys]
    return ys, dxs, dws, dbs


def _close_all(got, want):
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=2.0**-8, atol=1e-6)


@pytest.mark.parametrize("use_grouped_tensor", [None, False], ids=["grouped", "split"])
def test_a_toy_format_in_four_places(toy_family, use_grouped_tensor):
    """A format defined outside the package (recipe, kernels, family, registration) runs through
    grouped_linear (an expert without tokens included) and linear, forward and backward, as its
    own plain-torch math says; the plan is the family's class and carries the family's kernels."""
    import functional_dw as fd

    g = torch.Generator().manual_seed(0)
    rand = lambda *s, scale=1.0: (torch.randn(*s, generator=g) * scale).to(torch.bfloat16).requires_grad_()  # noqa: E731
    sizes, K_, N_ = [16, 0, 32], 32, 16
    x, dy = rand(sum(sizes), K_), rand(sum(sizes), N_, scale=0.1)
    ws, bs = [rand(N_, K_, scale=0.2) for _ in sizes], [rand(N_) for _ in sizes]
    _, res = fd.grouped_linear_fwd(x, ws, sizes, bs, recipe=Pow2Half())
    assert type(res.fp8) is toy_family and res.fp8.kernels is TOY and res.kernels is TOY
    y = fd.grouped_linear(x, ws, sizes, bs, use_grouped_tensor=use_grouped_tensor, recipe=Pow2Half())
    y.backward(dy)
    ys, dxs, dws, dbs = _toy_reference(x.split(sizes), ws, bs, dy.split(sizes))
    _close_all([y, x.grad], [torch.cat(ys), torch.cat(dxs)])
    _close_all([w.grad for w in ws] + [b.grad for b in bs], dws + dbs)
    assert torch.count_nonzero(ws[1].grad) == 0  # the empty expert's

    x1, w1, b1, dy1 = rand(16, K_), rand(N_, K_, scale=0.2), rand(N_), rand(16, N_, scale=0.1)
    y1 = fd.linear(x1, w1, b1, recipe=Pow2Half())
    y1.backward(dy1)
    ys, dxs, dws, dbs = _toy_reference([x1], [w1], [b1], [dy1])
    _close_all([y1, x1.grad, w1.grad, b1.grad], ys + dxs + dws + dbs)


def test_a_subclass_of_a_recipe_gets_its_own_family():
    """register_family(Sub, Family) for a subclass of a built-in recipe: the subclass's family
    runs, not its base's (the first isinstance match used to win); the base keeps its own."""
    from functional_dw import fp8_plan

    class MyCurrent(fp8.Float8CurrentScaling):
        pass

    class MyPlan(fp8_plan.family(fp8.Float8CurrentScaling())):
        pass

    fp8_plan.register_family(MyCurrent, MyPlan)
    try:
        assert fp8_plan.family(MyCurrent()) is MyPlan
        assert fp8_plan.family(fp8.Float8CurrentScaling()) is not MyPlan
        x, w = torch.randn(16, 32), torch.randn(16, 32)
        _, res = fd.linear_fwd(x, w, recipe=MyCurrent())
        assert type(res.fp8) is MyPlan
    finally:
        del fp8_plan.FAMILIES[MyCurrent]
