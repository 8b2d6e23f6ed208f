"""Score per file from mutmut's results in mutants/ (killed includes timeouts; 'survived'
lists the mutant names, to check against tests/support/mutation_equivalents.md)."""

import collections
import json
import pathlib
import sys

KILLED = {1, 3, 36, -24, 24, 152, 255, -9, -11}  # failed, pytest internal error, timeout, crash
rows, survivors, unchecked = [], [], 0
for meta in sorted(pathlib.Path("mutants").rglob("*.py.meta")):
    codes = json.loads(meta.read_text())["exit_code_by_key"]
    c = collections.Counter(
        "killed" if v in KILLED else "survived" if v in (0, 5, 33) else "unchecked" if v is None else f"other {v}"
        for v in codes.values()
    )
    survivors += sorted(k for k, v in codes.items() if v in (0, 5, 33))
    unchecked += c["unchecked"]
    checked = sum(c.values()) - c["unchecked"]
    rows.append((str(meta.relative_to("mutants"))[: -len(".meta")], c["killed"], checked, sum(c.values())))
print(f"{'file':45} killed/checked   score  (total mutants)")
for name, k, n, total in rows:
    print(f"{name:45} {k:5}/{n:<5}  {100 * k / max(n, 1):6.1f}%  ({total})")
K, Nn = sum(r[1] for r in rows), sum(r[2] for r in rows)
print(f"{'total':45} {K:5}/{Nn:<5}  {100 * K / max(Nn, 1):6.1f}%  ({unchecked} not checked)")
if "-v" in sys.argv:
    print("\n".join(survivors))
