"""The main job: `python -m functional_dw demo` runs and checks itself."""

import subprocess
import sys

import functional_dw.__main__ as cli
from functional_dw import demo


def test_demo_checks_gradients_and_hooks(capsys):
    assert demo.main(["--experts", "4", "--tokens", "64", "--hidden", "16", "--ffn", "32"]) == 0
    out = capsys.readouterr().out
    assert "OK" in out and "no weight" in out


def test_demo_numbers():
    import argparse

    r = demo.run(
        argparse.Namespace(experts=4, tokens=64, hidden=16, ffn=32, dtype="float64", device="cpu", backend=None)
    )
    assert r["err"] < 1e-12 and r["twice"] < 1e-12
    assert r["hook"].kinds == {"Tensor"}
    weights = 2 * 4 * 16 * 32 * 8
    assert r["te_bytes"] == r["hook"].bytes + weights
    assert r["calls"] == {"materialize_fwd": 1, "materialize_bwd": 2, "finalize": 2}


def test_cli_entry_point():
    assert cli.main(["--help"]) == 0
    assert cli.main(["nonsense"]) == 2
    out = subprocess.run([sys.executable, "-m", "functional_dw", "demo", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "--experts" in out.stdout
