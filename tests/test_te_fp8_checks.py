"""The TE backend's FP8 refusals, on the CPU: ``kernels/te_fp8_checks.py`` is pure torch and takes
the device facts as data, so every rule is checked here with synthetic devices (the GPU run of
tests/test_te_fp8_gpu.py checks that TE really computes what passes)."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from functional_dw import fp8
from functional_dw.kernels import Splits, te_available
from functional_dw.kernels.te_fp8_checks import check_quantize, device_problem, grouped_path_problem

H200 = ((9, 0), 131000, (12, 9))  # compute capability, cuBLASLt, CUDA (torch's build)
RECIPES = {"delayed": fp8.DelayedScaling(), "current": fp8.Float8CurrentScaling(), "block": fp8.Float8BlockScaling()}


def spec(scaling, role="input"):
    return fp8.tensor_spec(RECIPES[scaling], role)


def splits(sizes, device_only=False):
    return Splits(
        host=None if device_only else tuple(sizes),
        tensor=torch.tensor(sizes) if device_only else None,
        device=torch.device("cpu"),
        num_tokens=sum(sizes),
        num_experts=len(sizes),
    )


def t(rows, cols, dtype=torch.bfloat16):
    return torch.zeros(rows, cols, dtype=dtype)


def scale_args(scaling, E=None):
    if scaling != "delayed":
        return None, None
    return (torch.ones(E), torch.zeros(E)) if E else (torch.ones(()), torch.zeros(()))


# --- devices ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "env,scaling,match",
    [
        (((8, 0), 131000, (12, 9)), "current", "compute capability 8.9 or higher"),
        (((8, 9), 120000, (12, 9)), "delayed", "Ada needs cuBLASLt >= 12.1.3"),
        (((8, 9), 131000, (12, 9)), "block", "Float8BlockScaling needs compute capability 9.0"),
        (((9, 0), 131000, (12, 8)), "block", "CUDA >= 12.9"),
    ],
)
def test_device_problems(env, scaling, match):
    assert match in device_problem(scaling, env)
    with pytest.raises(ValueError, match=match):
        check_quantize(t(32, 64), spec(scaling), *scale_args(scaling), True, False, env)


@pytest.mark.parametrize("scaling", list(RECIPES))
def test_hopper_runs_every_recipe(scaling):
    assert device_problem(scaling, H200) is None
    assert device_problem(scaling, ((8, 9), 131000, (12, 9))) is None or scaling == "block"


# --- the grouped-tensor path (TE's is_module_grouped_tensor_path_supported) -------------------


@pytest.mark.parametrize(
    "recipe,env,E,match",
    [
        (fp8.DelayedScaling(), H200, 4, "no delayed-scaling kernels"),
        (fp8.Float8CurrentScaling(), ((9, 0), 130400, (12, 9)), 4, "cuBLASLt >= 13.5.0"),
        (fp8.Float8BlockScaling(), ((9, 0), 130500, (12, 9)), 4, "cuBLASLt >= 13.6.0"),
        (fp8.Float8BlockScaling(), ((10, 0), 131000, (12, 9)), 4, "Hopper only"),
        (fp8.Float8CurrentScaling(backward_override="dequantized"), H200, 4, "backward_override"),
        (fp8.Float8CurrentScaling(), H200, 65, "at most 64"),
    ],
)
def test_grouped_path_problems(recipe, env, E, match):
    assert match in grouped_path_problem(recipe, env, E)


@pytest.mark.parametrize("recipe", [None, fp8.Float8CurrentScaling(), fp8.Float8BlockScaling()])
def test_grouped_path_runs_current_and_block_on_the_h200(recipe):
    assert grouped_path_problem(recipe, H200, 64) is None
    assert grouped_path_problem(fp8.Float8CurrentScaling(), ((10, 0), 130300, (12, 9)), 8) is None  # Blackwell


# --- sizes (NOTE: [FP8 sizes]) ---------------------------------------------------------------


@pytest.mark.parametrize("scaling", list(RECIPES))
def test_features_must_be_multiples_of_16(scaling):
    with pytest.raises(ValueError, match=r"x's in-features to be a multiple of 16.*got 40"):
        check_quantize(t(32, 40), spec(scaling), *scale_args(scaling), True, True, H200)
    with pytest.raises(ValueError, match=r"dy's out-features to be a multiple of 16.*got 24"):
        check_quantize(t(32, 24), spec(scaling, "grad_output"), *scale_args(scaling), True, True, H200)


def test_rows_multiple_of_8_or_16_when_transposed():
    check_quantize(t(24, 64), spec("current"), None, None, True, False, H200)  # fprop only: 8 will do
    with pytest.raises(ValueError, match=r"x's tokens to be a multiple of 16 \(its transposed copy"):
        check_quantize(t(24, 64), spec("current"), None, None, True, True, H200)
    with pytest.raises(ValueError, match=r"weight's out-features to be a multiple of 8"):
        check_quantize(t(20, 64), spec("current", "weight"), None, None, True, False, H200)


@pytest.mark.parametrize("scaling", list(RECIPES))
def test_split_path_counts(scaling):
    sizes = [16, 0, 32, 48]
    check_quantize(t(96, 64), spec(scaling), *scale_args(scaling, 4), True, True, H200, (splits(sizes), False))
    with pytest.raises(ValueError, match=r"splits\[1\] is 8, but an FP8 wgrad .* multiple of 16"):
        check_quantize(
            t(88, 64), spec(scaling), *scale_args(scaling, 4), True, True, H200, (splits([16, 8, 32, 32]), False)
        )


def test_block_rowwise_counts_multiple_of_8():
    check_quantize(t(24, 64), spec("current"), None, None, True, False, H200, (splits([4, 20]), False))
    with pytest.raises(ValueError, match=r"splits\[0\] is 4, but an FP8 block-scaled GEMM"):
        check_quantize(t(24, 64), spec("block"), None, None, True, False, H200, (splits([4, 20]), False))


def test_grouped_block_scaling_needs_128_rows_per_expert():
    check_quantize(t(384, 64), spec("block"), None, None, True, True, H200, (splits([128, 0, 256]), True))
    with pytest.raises(ValueError, match=r"splits\[2\] is 240, but TE's grouped FP8 block-scaling quantize"):
        check_quantize(t(368, 64), spec("block"), None, None, True, True, H200, (splits([128, 0, 240]), True))
    # a CUDA splits tensor is not read on the host on the grouped path (no sync): the caller's business
    check_quantize(t(368, 64), spec("block"), None, None, True, True, H200, (splits([128, 0, 240], True), True))


def test_grouped_path_refuses_delayed_and_fp32():
    with pytest.raises(ValueError, match="no delayed-scaling kernels"):
        check_quantize(
            t(32, 64), spec("delayed"), *scale_args("delayed", 2), True, True, H200, (splits([16, 16]), True)
        )
    with pytest.raises(TypeError, match="bfloat16 or float16"):
        check_quantize(
            t(32, 64, torch.float32), spec("current"), None, None, True, True, H200, (splits([16, 16]), True)
        )
    check_quantize(t(32, 64, torch.float32), spec("current"), None, None, True, True, H200, (splits([16, 16]), False))


# --- arguments -------------------------------------------------------------------------------


def test_argument_errors():
    with pytest.raises(TypeError, match="fp8.TensorSpec"):
        check_quantize(t(32, 64), "current", None, None, True, False, H200)
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        check_quantize(t(32, 64, torch.float64), spec("current"), None, None, True, False, H200)
    with pytest.raises(ValueError, match="rowwise=True or columnwise=True"):
        check_quantize(t(32, 64), spec("current"), None, None, False, False, H200)
    with pytest.raises(ValueError, match="pass scale"):
        check_quantize(t(32, 64), spec("delayed"), None, None, True, False, H200)
    with pytest.raises(ValueError, match="delayed scaling only"):
        check_quantize(t(32, 64), spec("block"), torch.ones(()), None, True, False, H200)
    with pytest.raises(ValueError, match="scales must have 3 entries"):
        check_quantize(
            t(48, 64), spec("delayed"), torch.ones(2), None, True, False, H200, (splits([16, 16, 16]), False)
        )


@pytest.mark.skipif(te_available(), reason="TE is installed: tests/test_te_fp8_gpu.py covers it")
def test_fp8_under_compile_is_refused_clearly():
    from functional_dw.kernels.torch_ref import TORCH

    sys.modules.setdefault("functional_dw.kernels.te", types.SimpleNamespace(TE=TORCH))
    from functional_dw.kernels.te_ops import TRACED_TE

    with pytest.raises(NotImplementedError, match="not supported under torch.compile yet"):
        TRACED_TE.quantize(t(32, 64), spec("current"))
    with pytest.raises(NotImplementedError, match="torch.compiler.disable"):
        TRACED_TE.grouped_quantize(t(32, 64), splits([16, 16]), spec("current"))
