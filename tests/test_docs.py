"""The documents hold: every ```python block of README.md and docs/*.md runs as it stands, each
in a fresh interpreter; the README's set-up and test commands are the ones .ci/run uses; the
NOTE index in docs/design.md matches the NOTE: [...] titles in functional_dw/; relative links
resolve. The fence convention is docs/testing.md's ("The code blocks of the documents"):

    ```python                        runs on the CPU
    ```python gpu                    needs CUDA: marker gpu, skips without it
    ```python requires=<module>      skips when <module> does not import

The CPU blocks are started together (as many at a time as there are cores) when the first of
them is asked for: each pays for a fresh `import torch, functional_dw`, and one after the other
they would take minutes on the CI's two cores.
"""

from __future__ import annotations

import ast
import concurrent.futures
import dataclasses
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if not (ROOT / "README.md").exists():  # mutmut's copy of the tree holds no documents
    pytest.skip("README.md and docs/ are not in this copy of the tree", allow_module_level=True)

DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TIMEOUT_S = 300  # one block, on a loaded two-core machine (the slowest takes ~15 s alone)
FENCE = re.compile(r"^```(?P<lang>[^\s`]*)(?P<info>[^\n`]*)\n(?P<body>.*?)^```[ \t]*$", re.S | re.M)
NOTE = re.compile(r"NOTE:\s*\[((?:[^\]\n]|\n\s*#?\s*)+)\]")


@dataclasses.dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence
    words: tuple[str, ...]  # the info string after "python"
    code: str

    @property
    def where(self) -> str:
        first = next((ln for ln in self.code.splitlines() if ln.strip()), "")
        return f"{self.path.relative_to(ROOT)}:{self.line} (block starting `{first.strip()}`)"

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def requires(self) -> list[str]:
        return [w.split("=", 1)[1] for w in self.words if w.startswith("requires=")]


def blocks() -> list[Block]:
    out = []
    for path in DOCUMENTS:
        text = path.read_text()
        for m in FENCE.finditer(text):
            if m["lang"] == "python":
                line = text.count("\n", 0, m.start()) + 1
                out.append(Block(path, line, tuple(m["info"].split()), m["body"]))
    return out


BLOCKS = blocks()


def importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing
        return False


def marks(b: Block) -> list:
    out = []
    if "gpu" in b.words:
        out += [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
    for module in b.requires:
        out.append(pytest.mark.skipif(not importable(module), reason=f"needs {module}"))
    return out


def on_cpu(b: Block) -> bool:
    """Runs in the plain CPU suite (started together with the others)."""
    return not b.words


def run(b: Block) -> subprocess.CompletedProcess | str:
    """The block in a fresh interpreter, in an empty folder, importing this checkout."""
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    with tempfile.TemporaryDirectory(prefix="fdw-docs-") as cwd:
        try:
            return subprocess.run(
                [sys.executable, "-c", b.code], cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
            )
        except subprocess.TimeoutExpired as e:
            return f"timed out after {TIMEOUT_S} s; output so far:\n{e.stdout or ''}\n{e.stderr or ''}"


@pytest.fixture(scope="module")
def started(request):
    """Futures of the CPU blocks this session selected, all submitted at once."""
    selected = {
        item.callspec.params["block"]
        for item in request.session.items
        if item.module is sys.modules[__name__] and hasattr(item, "callspec") and "block" in item.callspec.params
    }
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 2)
    futures = {b: pool.submit(run, b) for b in BLOCKS if on_cpu(b) and b in selected}
    yield futures
    pool.shutdown(cancel_futures=True)


@pytest.mark.parametrize("block", [pytest.param(b, id=b.id, marks=marks(b)) for b in BLOCKS])
def test_block_runs(block, started):
    result = started[block].result() if block in started else run(block)
    if isinstance(result, str):
        pytest.fail(f"{block.where}: {result}", pytrace=False)
    if result.returncode != 0:
        pytest.fail(
            f"{block.where} exits {result.returncode}:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}", pytrace=False
        )


def test_every_block_follows_the_convention():
    assert len([b for b in BLOCKS if on_cpu(b)]) >= 8, "the documents' runnable examples went missing"
    bad = [b.where for b in BLOCKS if any(w != "gpu" and not re.fullmatch(r"requires=[\w.]+", w) for w in b.words)]
    assert not bad, f"unknown words in a ```python info string (docs/testing.md lists them): {bad}"
    for path in DOCUMENTS:  # a python block with another spelling would not run, silently
        for m in FENCE.finditer(path.read_text()):
            assert m["lang"].lower() not in ("py", "python3", "pycon"), (
                f"{path.name}: write ```python, not ```{m['lang']}"
            )


def test_setup_commands_are_the_ci_ones():
    readme, ci = (ROOT / "README.md").read_text(), (ROOT / ".ci" / "run").read_text()
    install = 'pip install "torch==2.13.0" -e ".[test]" && python -m functional_dw demo'
    assert install in readme
    assert '"torch==2.13.0" -e ".[test]"' in ci, ".ci/run installs what the README's set-up line installs"
    assert "\n    python -m pytest -q\n" in readme, "the README's test command"
    assert re.search(r"^python -m pytest -q( |$)", ci, re.M), ".ci/run runs the README's test command"


def test_readme_stays_short():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= 300, f"README.md has {lines} lines: it is for users; the rest goes to docs/"


def code_notes() -> dict[str, set[str]]:
    """Every NOTE title in functional_dw/, and the files that mention it."""
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / "functional_dw").rglob("*.py")):
        for m in NOTE.finditer(path.read_text()):
            title = re.sub(r"\s*\n\s*#?\s*", " ", m.group(1)).strip()
            found.setdefault(title, set()).add(path.relative_to(ROOT / "functional_dw").as_posix())
    return found


def index_notes() -> dict[str, str]:
    """design.md's NOTE index: title -> the file its row points at."""
    text = (ROOT / "docs" / "design.md").read_text()
    section = text.split("\n## NOTE index\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| \[(.+?)\] \| `([^`]+)`", section, re.M)
    titles = [t for t, _ in rows]
    assert len(titles) == len(set(titles)), "a NOTE listed twice in docs/design.md"
    return dict(rows)


def test_note_index_matches_the_code():
    code, index = code_notes(), index_notes()
    missing, stale = sorted(set(code) - set(index)), sorted(set(index) - set(code))
    assert not missing, f"NOTEs in functional_dw/ without a row in docs/design.md's NOTE index: {missing}"
    assert not stale, f"docs/design.md indexes NOTEs no longer in functional_dw/: {stale}"
    wrong = {t: (f, sorted(code[t])) for t, f in index.items() if f not in code[t]}
    assert not wrong, f"docs/design.md points these NOTEs at a file that does not hold them: {wrong}"
    count = re.search(r"`functional_dw/` \((\d+)\)", (ROOT / "docs" / "design.md").read_text())
    assert count and int(count.group(1)) == len(code), "the NOTE count in docs/design.md"


def test_notes_are_comments_not_docstrings():
    """A NOTE is written out in a # comment block, never in a docstring (help() shows docstrings
    to users). A docstring may refer to a note: its title then ends a clause ("(NOTE: [title])",
    "NOTE: [title], ...", "see NOTE: [title] in ``file``")."""
    written_out = []
    for path in sorted((ROOT / "functional_dw").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            doc = ast.get_docstring(node, clean=False) or ""
            for m in NOTE.finditer(doc):
                if not re.match(r"[)\],;.:]|\s+in\b", doc[m.end() :]):
                    written_out.append(f"{path.relative_to(ROOT)}: {getattr(node, 'name', 'module')}: [{m.group(1)}]")
    assert not written_out, f"NOTEs written out in docstrings (make them # comments): {written_out}"


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_relative_links_resolve():
    anchors = {}
    for path in DOCUMENTS:
        prose = FENCE.sub("", path.read_text())
        anchors[path] = {slug(h) for h in re.findall(r"^#{1,6} (.+)$", prose, re.M)}
    bad = []
    for path in DOCUMENTS:
        prose = FENCE.sub("", path.read_text())
        for target in re.findall(r"\]\(([^)\s]+)\)", prose):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists():
                bad.append(f"{path.name}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors.get(dest, set()):
                bad.append(f"{path.name}: {target} (no such heading)")
    assert not bad, bad


def test_tests_readme_lists_every_test_file():
    """tests/README.md maps each feature to its test files: a test file it does not name is
    stale text (two were missing after issue 39's new features)."""
    readme = (ROOT / "tests" / "README.md").read_text()
    missing = sorted(p.name for p in (ROOT / "tests").glob("test_*.py") if p.name not in readme)
    assert not missing, f"tests/README.md does not list {missing}: add each to its feature's row"
