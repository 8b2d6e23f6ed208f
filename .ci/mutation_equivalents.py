"""Write tests/mutation_equivalents.md from mutmut's survivors (mutants/) and the reasons below.

Run after `bash .ci/mutation` with that venv's python: `python .ci/mutation_equivalents.py`
(`--check` lists survivors no rule explains: kill them with a test, or add a reason here)."""
import json, glob, re, subprocess, sys
R = {
 "api": "torch 2.13's TreeSpec has both `children()` and `children_specs`: either branch reads the same children",
 "pytree": "torch's C++ pytree (`_cxx_pytree`) also reads a Python TreeSpec, so picking it for every spec gives the same tree",
 "slowpath": "a fast path forced to miss falls back to the slow path, which gives the same result (only slower)",
 "label": "a label that is never compared (the code tests only the other label, or `is None`)",
 "falsy": "`None` where `False` was passed (or the default it replaces is falsy): the same branch",
 "novalue": "no observable value: the Function returns grads autograd discards, zeros where None meant zeros, or holds an extra reference (memory only)",
 "cuda": "a CUDA-only branch (host sizes are missing only for a CUDA splits tensor; `auto` consults the weights only on CUDA) or a `device=` argument: on the CPU runner the default device is the same, and GPU tests are not in the runner",
 "compile": "a branch taken only under torch.compile (the runner excludes compile tests: dynamo traces mutmut's trampolines)",
 "path": "only chooses between the grouped and the split GEMM path, which compute the same products (equal within float rounding). The guard keeps grouped_mm away from forward AD and functorch wrappers, but on torch 2.13 CPU grouped_mm also runs there (tests/test_mutants.py::test_float32_grouped_path_under_jvp_and_vmap passes with the guard inverted), so no test can see the choice",
 "vmapfold": "the fold sorts rows expert-major either way and undoes exactly the permutation it made; rows are independent, so order within an expert and sort stability do not matter; `repeat_interleave(splits)` equals `repeat_interleave(arange(E), splits)`",
 "forms": "a list and a stacked tensor iterate (or index) alike here, so the other form gives the same values",
 "unreachable": "unreachable: `materialize()` already rejects a non-tensor with its own error before this check",
 "cachekey": "only the name of a per-Splits cache entry, which nothing else reads",
 "dead": "the check it guards cannot fire through the public API: torch.func.jvp hands fwd a plain tensor for a DistributedWeight primal (the subclass is lost, see the report), so only a direct call of the rule reaches it",
 "layout": "the layout check still keeps or copies the same operands (the changed bound or arithmetic agrees on every reachable stride)",
 "accum": "summing bf16/fp16 on the CPU already accumulates in float32 inside torch, so dropping the accumulation dtype gives the same sums",
 "noneleaf": "torch 2.13's Python pytree already treats None as a leaf, so `is_leaf=lambda d: d is None` changes nothing",
 "wrapped": "only reached for a functorch-wrapped tensor, and torch.func hands a DistributedWeight argument to fwd as a plain tensor (the subclass does not survive wrapping), so the unwrapped object is never a DistributedWeight either way",
 "dup": "the case it guards is rejected the same way by the next check (`sequence()` returns None for str/bytes too)",
 "defaults": "a keyword default that every caller overrides (the layers always pass `accumulate=` and `with_dbias=`)",
 "intdefault": "`torch.tensor` of a list of ints is int64 by default",
 "msgdead": "the name only appears in an error that cannot occur there (fwd's pair was already checked by the same call)",
}
RULES = [
 (r"_cotangent_leaves__mutmut_(13|14|15|19|20)$", "api"),
 (r"x__tree__mutmut_1$|_flatten_cotangents__mutmut_2$|x_custom_vjp__mutmut_(219|265|310)$", "pytree"),
 (r"_flatten_cotangents__mutmut_(1|11)$|x_custom_vjp__mutmut_(276|278)$|_check_weights__mutmut_(1|3|4|5|7|8|9|16|17|18|19|21|22|38|42|44|46)$", "slowpath"),
 (r"x_custom_vjp__mutmut_(292|293)$|_as_bias__mutmut_(27|28)$", "label"),
 (r"linear\.x__prepare__mutmut_36$|linear\.x__jvp__mutmut_21$|grouped_linear\.x__jvp__mutmut_42$|x_accumulates__mutmut_6$|x_residuals__mutmut_(4|5|7|10)$|grouped_wgrad__mutmut_25$", "falsy"),
 (r"x_custom_vjp__mutmut_(58|62|66|99)$", "novalue"),
 (r"x_custom_vjp__mutmut_236$", "msgdead"),
 (r"x_custom_vjp__mutmut_(72|75)$|_as_splits__mutmut_(20|22|24|41|43|67)$|x__vmap__mutmut_(30|32|34|36|41|43)$|grouped_path_unsupported__mutmut_(8|9|10|11|12|13|14)$|grouped_wgrad__mutmut_(30|31|32)$", "cuda"),
 (r"x__needs_grad__mutmut_|_as_splits__mutmut_(4[6-9]|5\d|60)$|grouped_path_unsupported__mutmut_4$", "compile"),
 (r"grouped_linear\.x__jvp__mutmut_(3|5|6|58|88)$|x__plain__|grouped_fprop__mutmut_|grouped_dgrad__mutmut_|grouped_wgrad__mutmut_(17|18|19|20|21)$", "path"),
 (r"x__vmap__mutmut_(25|26|28|38|48|49)$|_row_expert__mutmut_10$", "vmapfold"),
 (r"grouped_linear\.x__jvp__mutmut_(24|25|79)$|x_grouped_linear__mutmut_6$|_stack__mutmut_|_list__mutmut_|split_wgrad__mutmut_10$|_grouped_mm__mutmut_9$", "forms"),
 (r"check_materialized__mutmut_(13|15)$", "unreachable"),
 (r"_row_expert__mutmut_(13|17|18)$", "cachekey"),
 (r"_mm_ready__mutmut_", "layout"),
 (r"x_unwrap__mutmut_(3|4)$|x_is_distributed_weight__mutmut_(2|3|5|6)$|x_materialize__mutmut_(6|7)$", "wrapped"),
 (r"x_is_distributed_weight__mutmut_10$|grouped_linear\.x__prepare__mutmut_31$", "falsy"),
 (r"x_materialize__mutmut_8$", "compile"),
 (r"_as_splits__mutmut_26$", "dup"),
 (r"grouped_linear\.x__prepare__mutmut_(98|99|10[0-5]|11[7-9]|12[0-8])$", "cuda"),
 (r"xǁTorchKernelsǁwgrad__mutmut_(1|2)$|grouped_wgrad__mutmut_(1|2)$", "defaults"),
 (r"_as_splits__mutmut_(49|51)$", "intdefault"),
 (r"grouped_linear\.x__vmap__mutmut_(3|5|6)$", "noneleaf"),
 (r"_as_params__mutmut_(3|6)$", "slowpath"),
 (r"column_sums__mutmut_(3|5)$", "accum"),
 (r"fprop__mutmut_(15|17)$", "forms"),
]
survivors = []
for f in sorted(glob.glob("mutants/functional_dw/**/*.meta", recursive=True)):
    for k, v in json.load(open(f))["exit_code_by_key"].items():
        if v in (0, 5, 33):
            survivors.append(k)
rows, unexplained = [], []
for m in survivors:
    show = subprocess.run([sys.executable, "-m", "mutmut", "show", m], capture_output=True, text=True).stdout
    minus = [l[1:].strip() for l in show.splitlines() if l.startswith("-") and not l.startswith("---")]
    plus = [l[1:].strip() for l in show.splitlines() if l.startswith("+") and not l.startswith("+++")]
    mod = m.rsplit(".x", 1)[0] if ".x_" in m or ".xǁ" in m else m
    path = mod.replace(".", "/") + ".py"
    path = re.sub(r"/x[_ǁ].*", "", path)
    path = m.split(".x")[0].replace(".", "/") + ".py"
    src = open(path).read().splitlines()
    line = next((i + 1 for i, l in enumerate(src) if minus and l.strip() == minus[-1]), "?")
    reason = next((key for pat, key in RULES if re.search(pat, m)), None)
    mut = f"`{(minus[-1] if minus else '')[:90]}` → `{(plus[-1] if plus else '(removed)')[:90]}`"
    if reason is None:
        unexplained.append((m, mut))
        continue
    rows.append((path, line, m.split(".")[-1], mut, reason))
if "--check" in sys.argv:
    for u in unexplained: print("UNEXPLAINED", *u)
    sys.exit(0)
out = open("tests/mutation_equivalents.md", "w")
out.write("""# Surviving mutants: why each is equivalent

`bash .ci/mutation` (mutmut 3 over the six modules in `pyproject.toml`) leaves these mutants
alive. Each is equivalent for the runner (CPU, no torch.compile): no test can tell it from the
original by a value, an error or a call. Reasons are keyed below; rows name the file, the line
of the original code, the mutant and the mutation. `.ci/mutation_equivalents.py` regenerates the list
after a run (`--check` names survivors no reason covers: a mutant not in this list must be
killed by a test in `tests/test_mutants.py`). Line numbers are those of the mutated commit.

Reasons:

""")
for k, v in R.items():
    if any(r[4] == k for r in rows):
        out.write(f"- **{k}**: {v}\n")
out.write("\n| file | line | mutant | mutation | reason |\n|---|---|---|---|---|\n")
for p, l, n, mut, r in rows:
    bar = "\\|"
    out.write(f"| {p.removeprefix('functional_dw/')} | {l} | {n} | {mut.replace('|', bar)} | {r} |\n")
if unexplained:
    out.write("\nNot yet explained or killed (the run ended before a test for them was confirmed):\n\n")
    for m, mut in unexplained:
        out.write(f"- {m}: {mut}\n")
print(len(rows), "explained;", len(unexplained), "unexplained")
