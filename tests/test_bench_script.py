"""benchmarks/bench.py runs end to end (on the CPU, with CUDA timing and TE stood in for), and
the numbers it writes are consistent: TFLOP/s and fractions of peak follow from the recorded
times and shapes, the markdown table shows the JSON's numbers, the recorded path choices are
the ones the library makes."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    here = Path(__file__).resolve().parent
    run = subprocess.run([sys.executable, str(here / "bench_mock.py"), str(out)], capture_output=True,
                         text=True, timeout=600, cwd=here.parent)
    assert run.returncode == 0, run.stderr[-3000:]
    return out, json.loads((out / "results.json").read_text()), (out / "results.md").read_text()


def test_bench_script_writes_its_tables(results):
    out, data, md = results
    for section in ("## GroupedLinear", "## Linear", "## Host overhead", "## Saved-tensor hooks"):
        assert section in md
    e80 = [r for r in data["grouped"] if r["E"] == 80]
    assert e80 and all(r["results"]["te grouped"].startswith("raises") for r in e80), "TE's 64-expert limit is recorded"
    assert data["offload"]["results"]["fd te split"]["hook_tensors"] == 1
    assert (out / "tflops.png").stat().st_size > 0


def test_bench_numbers_follow_from_times_and_shapes(results):
    _, data, md = results
    peak = data["dense_peak_tflops"]
    assert peak > 0
    timed = 0
    for row in data["grouped"]:
        flops = 3 * 2 * row["tokens"] * row["hidden"] * row["ffn"]  # fwd + dgrad + wgrad
        assert 0 <= row["zero_experts"] <= row["E"]
        for name, v in row["results"].items():
            if not isinstance(v, dict) or "ms" not in v:
                continue
            timed += 1
            assert v["ms"] > 0, (name, v)
            want = flops / v["ms"] / 1e9
            assert v["tflops"] == pytest.approx(want, rel=2e-3, abs=0.06), (name, v, want)  # (rounded to 0.1)
            lo, hi = want / (peak + 0.05), want / max(peak - 0.05, 1e-9)  # (the peak is recorded to 0.1)
            assert lo - 6e-4 <= v["frac_peak"] <= hi + 6e-4, (name, v, lo, hi)
            cell = f"{v['tflops']} ({v['frac_peak']:.2f})"
            assert cell in md, f"{name}'s {cell} is not in the markdown table"
        res = row["results"]
        ours = min(res[n]["ms"] for n in ("fd te split", "fd te grouped", "fd auto") if isinstance(res.get(n), dict))
        peers = [res[n]["ms"] for n in ("te split", "te grouped", "torch._grouped_mm") if isinstance(res.get(n), dict)]
        line = next(ln for ln in md.splitlines() if ln.startswith(f"| {row['E']} | {row['hidden']} | {row['ffn']} | "
                                                                    f"{row['tokens']} | {row['splits']} "))
        assert f"| {ours / min(peers):.2f} |" in line, ("fd / best peer", line)
    assert timed >= 10, "the smoke run timed the implementations"
    for row in data["linear"]:
        for v in row["results"].values() if "results" in row else []:
            if isinstance(v, dict) and "tflops" in v:
                want = 3 * 2 * row["tokens"] * row["in"] * row["out"] / v["ms"] / 1e9
                assert v["tflops"] == pytest.approx(want, rel=2e-3, abs=0.06)
    host = data["host_overhead_us"]
    assert host and all(v > 0 for v in host.values())
    for name, us in host.items():
        assert re.search(rf"{re.escape(name)}.*{us}", md), f"host overhead of {name} ({us} us) not in the table"


def test_bench_records_the_paths_the_library_takes(results):
    _, data, _ = results
    for row in data["grouped"]:
        chosen = row["results"]["chosen"]
        # the mock runs on the CPU: bf16 with 64 features is grouped_mm-able, so None takes the grouped path
        assert chosen["te, use_grouped_tensor=None"] == "grouped", chosen
