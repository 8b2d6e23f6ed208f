"""benchmarks/bench.py runs end to end (on the CPU, with CUDA timing and TE stood in for)."""

import json
import subprocess
import sys
from pathlib import Path


def test_bench_script_runs_and_writes_its_tables(tmp_path):
    here = Path(__file__).resolve().parent
    run = subprocess.run([sys.executable, str(here / "bench_mock.py"), str(tmp_path)], capture_output=True,
                         text=True, timeout=300, cwd=here.parent)
    assert run.returncode == 0, run.stderr[-3000:]
    md = (tmp_path / "results.md").read_text()
    for section in ("## GroupedLinear", "## Linear", "## Host overhead", "## Saved-tensor hooks"):
        assert section in md
    data = json.loads((tmp_path / "results.json").read_text())
    e80 = [r for r in data["grouped"] if r["E"] == 80]
    assert e80 and all(r["results"]["te grouped"].startswith("raises") for r in e80), "TE's 64-expert limit is recorded"
    assert data["offload"]["results"]["fd te split"]["hook_tensors"] == 1
    assert (tmp_path / "tflops.png").stat().st_size > 0
