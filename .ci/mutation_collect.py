"""Quick check (seconds, no mutation) that bash .ci/mutation's test selection collects.

mutmut runs the tests from a copy of the repository, mutants/, holding only what it copies: the
source_paths, what also_copy names, and its own defaults (tests/, pyproject.toml, ...). A test
that reads a file from elsewhere in the checkout collects here and fails there, and the mutation
job then stops before its first mutant ("failed to collect stats"). This lays out a temporary
directory the way mutmut lays out mutants/ and runs pytest --collect-only there with the
arguments mutmut passes, read from [tool.mutmut] in pyproject.toml (so they cannot drift).

    python .ci/mutation_collect.py      # exit status: pytest's (0: the selection collects)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest's own dependency
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
# What mutmut 3 copies besides source_paths and also_copy (mutmut/configuration.py, load_config).
MUTMUT_ALSO_COPY = [
    "tests/",
    "test/",
    "setup.cfg",
    "pyproject.toml",
    "uv.lock",
    "poetry.lock",
    "Pipfile.lock",
    "pdm.lock",
]


def mutmut_config() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mutmut"]


def lay_out(cfg: dict, dest: Path) -> list[str]:
    """Copy what mutmut copies into ``dest``; returns the paths copied."""
    paths = [*cfg["source_paths"], *cfg.get("also_copy", []), *MUTMUT_ALSO_COPY]
    paths += [p.name for p in ROOT.glob("test*.py")]
    copied = []
    for rel in dict.fromkeys(paths):
        src = ROOT / rel
        if not src.exists():
            continue
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, target, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, target)
        copied.append(rel)
    return copied


def pytest_args(cfg: dict) -> list[str]:
    """mutmut's stats run (runners/harness.py: execute_pytest around _pytest_args_regular_run), collect only."""
    return [
        "--rootdir=.",
        "--tb=native",
        "-x",
        "-q",
        "-p",
        "no:randomly",
        "-p",
        "no:random-order",
        "--collect-only",
        *cfg.get("pytest_add_cli_args_test_selection", []),
        *cfg.get("tests_dir", []),
        *cfg.get("pytest_add_cli_args", []),
    ]


def main() -> int:
    cfg = mutmut_config()
    with tempfile.TemporaryDirectory(prefix="mutmut-layout-") as tmp:
        copied = lay_out(cfg, Path(tmp))
        args = pytest_args(cfg)
        print(f"mutation selection: copied {', '.join(copied)}; pytest {' '.join(args)}", flush=True)
        # the copy's package first, as mutmut puts mutants/ first on sys.path (not the checkout's)
        env = os.environ | {"PYTHONPATH": os.pathsep.join([tmp, *filter(None, [os.environ.get("PYTHONPATH")])])}
        run = subprocess.run([sys.executable, "-m", "pytest", *args], cwd=tmp, env=env, capture_output=True, text=True)
    lines = run.stdout.strip().splitlines()
    if run.returncode != 0:
        print(run.stdout[-6000:], run.stderr[-3000:], sep="\n")
        print(
            f"FAILED: bash .ci/mutation's test selection does not collect in mutmut's layout (pytest exit "
            f"{run.returncode}); add what the tests read to also_copy in [tool.mutmut], or leave them out there"
        )
    else:
        print(f"mutation selection collects: {lines[-1] if lines else '?'}")
    return run.returncode


if __name__ == "__main__":
    sys.exit(main())
