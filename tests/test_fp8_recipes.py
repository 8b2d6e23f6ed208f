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
