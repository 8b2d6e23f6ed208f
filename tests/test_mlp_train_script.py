"""benchmarks/mlp_train.py runs end to end on the CPU at a tiny size: every run's loss curve, finite and one
value per step, the summary's gaps computed from them, and its unpermute inverts its permute
(each token gets back the sum of its k rows)."""

import importlib.util
import json
import math
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "mlp_train.py"
SPEC = importlib.util.spec_from_file_location("mlp_train", SCRIPT)
mlp_train = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(mlp_train)

STEPS = 4


def run(tmp_path: Path, *flags: str) -> tuple[int, dict]:
    size = ["--experts", "3", "--top-k", "2", "--hidden", "16", "--ffn", "16", "--tokens", "40"]
    rc = mlp_train.main(["--device", "cpu", "--steps", str(STEPS), *size, "--out", str(tmp_path), *flags])
    return rc, json.loads((tmp_path / "losses.json").read_text())


def test_writes_every_curve_and_the_summary(tmp_path):
    rc, d = run(tmp_path, "--tolerance", "1")
    assert rc == 0 and d["steps"] == list(range(STEPS)) and not d["errors"]
    assert set(d["losses"]) == {"bf16", "rowwise", "current", "control"}
    assert d["summary"]["control"]["ok"] is None, "the control is reported, not judged"
    for curve in d["losses"].values():
        assert len(curve) == STEPS and all(math.isfinite(v) and v > 0 for v in curve)
    for name in ("rowwise", "current"):
        assert d["losses"][name] != d["losses"]["bf16"], "the FP8 runs quantize"
        s = d["summary"][name]
        a, b = d["losses"]["bf16"][-s["gap_steps"] :], d["losses"][name][-s["gap_steps"] :]
        assert s["max_rel_gap_raw"] == max(abs(y - x) / x for x, y in zip(a, b))
        assert s["ok"]
    md = (tmp_path / "summary.md").read_text()
    assert "| rowwise |" in md and "| current |" in md and "| control (bf16" in md


def test_gap_over_tolerance_fails(tmp_path):
    rc, d = run(tmp_path, "--tolerance", "0", "--recipes", "rowwise", "--no-control")
    assert rc == 1 and not d["summary"]["rowwise"]["ok"] and set(d["losses"]) == {"bf16", "rowwise"}


def test_permute_and_unpermute():
    torch.manual_seed(0)
    T, E, k, H = 13, 4, 2, 5
    experts = torch.rand(T, E).topk(k, dim=-1).indices
    rows, splits, token, pos = mlp_train.permute(experts, E, 16)
    assert rows == sum(splits) and all(s % 16 == 0 for s in splits) and len(splits) == E
    assert len(set(pos.tolist())) == T * k  # each (token, choice) its own row
    sorted_experts = experts.reshape(-1)[mlp_train._order(experts)]
    ends = torch.tensor(splits).cumsum(0)
    assert torch.equal(torch.bucketize(pos, ends, right=True), sorted_experts), "each row in its expert's block"
    x = torch.randn(T, H)
    xp = x.new_zeros(rows, H).index_copy(0, pos, x[token])
    back = torch.zeros(T, H).index_add(0, token, xp[pos])
    assert torch.allclose(back, k * x)
