"""benchmarks/fp8_train.py runs end to end on the CPU at a tiny size: it writes both loss curves,
finite and one value per step, and a second bf16 run (--recipe none) matches the first exactly."""

import importlib.util
import json
import math
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "fp8_train.py"
SPEC = importlib.util.spec_from_file_location("fp8_train", SCRIPT)
fp8_train = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(fp8_train)

STEPS = 5


def run(tmp_path: Path, recipe: str, *flags: str) -> tuple[int, dict]:
    rc = fp8_train.main(
        [
            "--device",
            "cpu",
            "--steps",
            str(STEPS),
            "--experts",
            "2",
            "--hidden",
            "32",
            "--ffn",
            "32",
            "--tokens",
            "64",
            "--recipe",
            recipe,
            "--out",
            str(tmp_path),
            *flags,
        ]
    )
    return rc, json.loads((tmp_path / f"losses_{recipe}.json").read_text())


@pytest.mark.parametrize("recipe", ["current", "none"])
def test_writes_both_curves(tmp_path, recipe):
    rc, d = run(tmp_path, recipe)
    assert d["steps"] == list(range(STEPS))
    for curve in (d["loss_bf16"], d["loss_fp8"]):
        assert len(curve) == STEPS and all(math.isfinite(v) and v > 0 for v in curve)
    s = d["summary"]
    assert rc == 0 and s["ok"] and s["max_rel_gap"] <= 0.05
    assert d["config"]["recipe"] == recipe and d["torch"]
    if recipe == "none":
        assert d["loss_fp8"] == d["loss_bf16"] and s["max_rel_gap"] == 0.0
    else:
        assert d["loss_fp8"] != d["loss_bf16"], "the FP8 run quantizes"


def test_gap_over_tolerance_fails(tmp_path):
    rc, d = run(tmp_path, "current", "--tolerance", "0")
    assert rc == 1 and not d["summary"]["ok"] and d["summary"]["max_rel_gap"] > 0
