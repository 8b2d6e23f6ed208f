"""te_fp8's plumbing on the CPU, over a fake TE (tests/support/fake_te: TE's names and signatures, fp8's
emulation for quantization, GEMMs that read only the copy TE's TN-only GEMM reads): every recipe,
Linear and both grouped paths, usages, pytree round trips, dbias at quantization or recomputed,
amaxes recorded into the state. In a subprocess, so the fake never meets a real TE or the rest
of the suite. TE's numerics are tests/test_te_fp8_gpu.py's business."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parent / "support" / "fake_te" / "run_te_fp8.py"


def test_te_fp8_plumbing_on_a_fake_te():
    run = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout[-3000:] + run.stderr[-3000:]
