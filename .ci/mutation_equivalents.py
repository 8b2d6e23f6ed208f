"""Write tests/support/mutation_equivalents.md from mutmut's survivors (mutants/) and the reasons below.

Run after `bash .ci/mutation` with that venv's python: `python .ci/mutation_equivalents.py`
(`--check` lists survivors no rule explains: kill them with a test, or add a reason here)."""

import glob
import json
import re
import subprocess
import sys

R = {
    "api": "torch 2.13's TreeSpec has both `children()` and `children_specs`: either branch reads the same children",
    "pytree": "torch's C++ pytree (`_cxx_pytree`) also reads a Python TreeSpec, so picking it for every spec gives the same tree",
    "slowpath": "a fast path forced to miss falls back to the slow path, which gives the same result (only slower)",
    "label": "a label that is never compared (the code tests only the other label, or `is None`)",
    "falsy": "`None` where `False` was passed (or the default it replaces is falsy): the same branch",
    "novalue": "no observable value: the Function returns grads autograd discards, zeros where None meant zeros, or holds an extra reference (memory only)",
    "cuda": "a CUDA-only branch (host sizes are missing only for a CUDA splits tensor; `auto` consults the weights only on CUDA) or a `device=` argument: on the CPU runner the default device is the same, and GPU tests are not in the runner",
    "compile": "a branch taken only under torch.compile (the runner excludes compile tests: dynamo traces mutmut's trampolines)",
    "path": "only chooses between the grouped and the split GEMM path, which compute the same products (equal within float rounding). The guard keeps grouped_mm away from forward AD and functorch wrappers, but on torch 2.13 CPU grouped_mm also runs there (tests/test_func.py::test_float32_grouped_path_under_jvp_and_vmap passes with the guard inverted), so no test can see the choice",
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
    "slice3": "only indices 0-2 of _wanted's tuple are ever read, and a needs tuple is at least 3 long, so slicing [:4] instead of [:3] changes nothing read",
    "fp8stamp": "with FP8 res.x is the quantized copy, never the stamped x, so check_stamp's identity test skips a stamp taken anyway (it only holds a weakref)",
    "dwfused": "finalize reads `fused` only for plain weights; this call passes dw=True (finalize_group_grads decides)",
    "eagerdisable": "outside torch.compile, torch.compiler.disable(_linear) runs _linear unchanged, so routing a DistributedWeight through _linear_eager gives the same values, errors and calls",
    "reprover": "`__repr__` is replaced by `_describe` right after the dataclass is made, so whether dataclass wrote one first changes nothing",
    "kwonly": "argcount - kwonlyargcount differs from + only when a field is keyword-only, and then the `f.kw_only` test already returns",
    "strleaf": "pytree.tree_leaves of a str/bytes is [the str] itself, which holds no tensor: the same path as []",
    "boolleaf": "a bool is one pytree leaf, so the pytree fallback returns any([b]) == b, the same as the bool fast path",
    "dqnone": "`dequantize(None)`: QTensor.dequantize computes in fp32 and ends with `.to(dtype)`; `.to(None)` returns the tensor unchanged, so the result is fp32 either way",
    "dqdefault": "QTensor.dequantize's dtype defaults to torch.float32: dropping the argument passes the same value",
    "splitacc": "`split_accumulator` is a cuBLASLt mode: the fp32 reference ignores it, and the RowwiseScaling path reads it only in CUDA's `_scaled_grouped_mm` and the compiled op, so on the CPU runner its value (default, None) changes nothing",
    "unused": "TorchKernels.grouped_quantize accepts `grouped=` for the kernels interface and never reads it",
    "identity": "applies the identity Function `_DenseGrad` also when the output needs no grad: the same values (a view of the same tensor), only slower",
    "verdictcache": "the grouped-path verdict reads only dtype, device, N, K (and, on CUDA, whether x is fake): caching it for more or fewer tensors, or not at all, gives the same verdict on the CPU",
    "fwdsave": "`save_for_forward` outside forward mode: torch's apply drops `ctx.saved_for_forward` once the call returns (it reads None afterwards), and with forward mode on but no jvp rule the jvp raises the same NotImplementedError, so nothing is kept or read",
    "outsize": "`output_size=` of repeat_interleave only spares a device sync (CUDA); the result is the same without it or with None",
}
RULES = [  # exact names of the survivors of the mutated commit, by reason
    (
        "^(functional_dw\\.kernels\\.torch_ref\\.x_column_sums__mutmut_3|functional_dw\\.kernels\\.torch_ref\\.x_column_sums__mutmut_5)$",
        "accum",
    ),
    (
        "^(functional_dw\\._bridge_tree\\.x__cotangent_leaves__mutmut_13|functional_dw\\._bridge_tree\\.x__cotangent_leaves__mutmut_14|functional_dw\\._bridge_tree\\.x__cotangent_leaves__mutmut_15|functional_dw\\._bridge_tree\\.x__cotangent_leaves__mutmut_19|functional_dw\\._bridge_tree\\.x__cotangent_leaves__mutmut_20)$",
        "api",
    ),
    ("^(functional_dw\\.residuals\\.x_any_needed__mutmut_1)$", "boolleaf"),
    (
        "^(functional_dw\\.kernels\\.torch_ref\\.x__row_expert__mutmut_13|functional_dw\\.kernels\\.torch_ref\\.x__row_expert__mutmut_17|functional_dw\\.kernels\\.torch_ref\\.x__row_expert__mutmut_18)$",
        "cachekey",
    ),
    (
        "^(functional_dw\\.custom_vjp\\.xǁ_Rulesǁ__init____mutmut_23|functional_dw\\.custom_vjp\\.xǁ_Rulesǁ__init____mutmut_24|functional_dw\\.custom_vjp\\.xǁ_Rulesǁ__init____mutmut_25|functional_dw\\.custom_vjp\\.xǁ_Rulesǁ__init____mutmut_32|functional_dw\\.custom_vjp\\.xǁ_Rulesǁ__init____mutmut_33|functional_dw\\.kernels\\.torch_ref\\.x__plain__mutmut_1|functional_dw\\.kernels\\.torch_ref\\.xǁTorchKernelsǁ_grouped_path_unsupported__mutmut_4|functional_dw\\.linear\\.x_linear__mutmut_17|functional_dw\\.linear\\.x_linear__mutmut_18|functional_dw\\.linear\\.x_linear__mutmut_19|functional_dw\\.linear\\.x_linear__mutmut_20|functional_dw\\.linear\\.x_linear__mutmut_21|functional_dw\\.linear\\.x_linear__mutmut_22|functional_dw\\.linear\\.x_linear__mutmut_23|functional_dw\\.linear\\.x_linear__mutmut_24|functional_dw\\.linear\\.x_linear__mutmut_25|functional_dw\\.linear\\.x_linear__mutmut_26|functional_dw\\.linear\\.x_linear__mutmut_27|functional_dw\\.linear\\.x_linear__mutmut_28|functional_dw\\.linear\\.x_linear__mutmut_29)$",
        "compile",
    ),
    (
        "^(functional_dw\\.grouped_linear\\.x__vmap__mutmut_32|functional_dw\\.grouped_linear\\.x__vmap__mutmut_34|functional_dw\\.grouped_linear\\.x__vmap__mutmut_36|functional_dw\\.grouped_linear\\.x__vmap__mutmut_38|functional_dw\\.grouped_linear\\.x__vmap__mutmut_43|functional_dw\\.grouped_linear\\.x__vmap__mutmut_45|functional_dw\\.kernels\\.torch_ref\\.x__record_amax__mutmut_24|functional_dw\\.kernels\\.torch_ref\\.x__record_amax__mutmut_8|functional_dw\\.kernels\\.torch_ref\\.xǁTorchKernelsǁ_grouped_path_unsupported__mutmut_10|functional_dw\\.kernels\\.torch_ref\\.xǁTorchKernelsǁ_grouped_path_unsupported__mutmut_11|functional_dw\\.kernels\\.torch_ref\\.xǁTorchKernelsǁ_grouped_path_unsupported__mutmut_12|functional_dw\\.kernels\\.torch_ref\\.xǁTorchKernelsǁ_grouped_path_unsupported__mutmut_13|functional_dw\\.kernels\\.torch_ref\\.xǁTorchKernelsǁ_grouped_path_unsupported__mutmut_14|functional_dw\\.kernels\\.torch_ref\\.xǁTorchKernelsǁ_grouped_path_unsupported__mutmut_8|functional_dw\\.kernels\\.torch_ref\\.xǁTorchKernelsǁ_grouped_path_unsupported__mutmut_9)$",
        "cuda",
    ),
    (
        "^(functional_dw\\.kernels\\.torch_ref\\.x__cat__mutmut_4|functional_dw\\.kernels\\.torch_ref\\.x__cols__mutmut_3|functional_dw\\.kernels\\.torch_ref\\.x__rows__mutmut_3|functional_dw\\.kernels\\.torch_ref\\.x__stack32__mutmut_4)$",
        "dqdefault",
    ),
    (
        "^(functional_dw\\.kernels\\.torch_ref\\.x__cat__mutmut_2|functional_dw\\.kernels\\.torch_ref\\.x__cols__mutmut_1|functional_dw\\.kernels\\.torch_ref\\.x__rows__mutmut_1|functional_dw\\.kernels\\.torch_ref\\.x__stack32__mutmut_2)$",
        "dqnone",
    ),
    ("^(functional_dw\\.linear\\.x__wgrad__mutmut_31)$", "dwfused"),
    ("^(functional_dw\\.linear\\.x_linear__mutmut_16)$", "eagerdisable"),
    (
        "^(functional_dw\\.distributed_weight\\.x_accumulates__mutmut_6|functional_dw\\.distributed_weight\\.x_any_distributed__mutmut_11|functional_dw\\.grouped_linear\\.x__fprop_fp8__mutmut_45|functional_dw\\.grouped_linear\\.x__jvp__mutmut_48|functional_dw\\.kernels\\.torch_ref\\.xǁTorchKernelsǁgrouped_dgrad__mutmut_59|functional_dw\\.kernels\\.torch_ref\\.xǁTorchKernelsǁgrouped_wgrad__mutmut_83|functional_dw\\.linear\\.x__fprop_fp8__mutmut_42|functional_dw\\.linear\\.x__jvp__mutmut_27|functional_dw\\.linear\\.x__prepare__mutmut_120|functional_dw\\.linear\\.x__prepare__mutmut_36|functional_dw\\.residuals\\.x_residuals__mutmut_4|functional_dw\\.residuals\\.x_residuals__mutmut_5)$",
        "falsy",
    ),
    (
        "^(functional_dw\\.grouped_linear\\.x__jvp__mutmut_30|functional_dw\\.grouped_linear\\.x__jvp__mutmut_85|functional_dw\\.kernels\\.torch_ref\\.x__list__mutmut_1)$",
        "forms",
    ),
    ("^(functional_dw\\.linear\\.x__forward__mutmut_36)$", "fp8stamp"),
    ("^(functional_dw\\.custom_vjp\\.x__grads_as_given__mutmut_1)$", "fwdsave"),
    ("^(functional_dw\\.kernels\\.torch_ref\\.x__gmm__mutmut_25)$", "identity"),
    ("^(functional_dw\\.residuals\\.x__fast_init__mutmut_14)$", "kwonly"),
    (
        "^(functional_dw\\.kernels\\.torch_ref\\.x__mm_ready__mutmut_12|functional_dw\\.kernels\\.torch_ref\\.x__mm_ready__mutmut_13|functional_dw\\.kernels\\.torch_ref\\.x__mm_ready__mutmut_17|functional_dw\\.kernels\\.torch_ref\\.x__mm_ready__mutmut_18|functional_dw\\.kernels\\.torch_ref\\.x__mm_ready__mutmut_35|functional_dw\\.kernels\\.torch_ref\\.x__mm_ready__mutmut_48|functional_dw\\.kernels\\.torch_ref\\.x__mm_ready__mutmut_6)$",
        "layout",
    ),
    (
        "^(functional_dw\\.grouped_linear\\.x__vmap__mutmut_3|functional_dw\\.grouped_linear\\.x__vmap__mutmut_5|functional_dw\\.grouped_linear\\.x__vmap__mutmut_6)$",
        "noneleaf",
    ),
    (
        "^(functional_dw\\.grouped_linear\\.x__vmap__mutmut_27|functional_dw\\.grouped_linear\\.x__vmap__mutmut_30)$",
        "outsize",
    ),
    (
        "^(functional_dw\\.kernels\\.torch_ref\\.x__list__mutmut_2|functional_dw\\.kernels\\.torch_ref\\.x__plain__mutmut_2|functional_dw\\.kernels\\.torch_ref\\.x__plain__mutmut_3|functional_dw\\.kernels\\.torch_ref\\.x__plain__mutmut_5|functional_dw\\.kernels\\.torch_ref\\.x__plain__mutmut_7|functional_dw\\.kernels\\.torch_ref\\.xǁTorchKernelsǁgrouped_dgrad__mutmut_46|functional_dw\\.kernels\\.torch_ref\\.xǁTorchKernelsǁgrouped_dgrad__mutmut_47|functional_dw\\.kernels\\.torch_ref\\.xǁTorchKernelsǁgrouped_dgrad__mutmut_48|functional_dw\\.kernels\\.torch_ref\\.xǁTorchKernelsǁgrouped_wgrad__mutmut_74|functional_dw\\.kernels\\.torch_ref\\.xǁTorchKernelsǁgrouped_wgrad__mutmut_75|functional_dw\\.kernels\\.torch_ref\\.xǁTorchKernelsǁgrouped_wgrad__mutmut_76|functional_dw\\.kernels\\.torch_ref\\.xǁTorchKernelsǁgrouped_wgrad__mutmut_77|functional_dw\\.kernels\\.torch_ref\\.xǁTorchKernelsǁgrouped_wgrad__mutmut_78)$",
        "path",
    ),
    ("^(functional_dw\\.custom_vjp\\.x__element_plan__mutmut_28)$", "pytree"),
    (
        "^(functional_dw\\.residuals\\.x_residuals__mutmut_10|functional_dw\\.residuals\\.x_residuals__mutmut_7)$",
        "reprover",
    ),
    ("^(functional_dw\\.linear\\.x__wanted__mutmut_7)$", "slice3"),
    ("^(functional_dw\\.residuals\\.x_any_needed__mutmut_9)$", "slowpath"),
    (
        "^(functional_dw\\.kernels\\.torch_ref\\.xǁTorchKernelsǁdgrad__mutmut_1|functional_dw\\.kernels\\.torch_ref\\.xǁTorchKernelsǁfprop__mutmut_1|functional_dw\\.kernels\\.torch_ref\\.xǁTorchKernelsǁgrouped_dgrad__mutmut_1|functional_dw\\.kernels\\.torch_ref\\.xǁTorchKernelsǁgrouped_dgrad__mutmut_5|functional_dw\\.kernels\\.torch_ref\\.xǁTorchKernelsǁgrouped_wgrad__mutmut_10|functional_dw\\.kernels\\.torch_ref\\.xǁTorchKernelsǁgrouped_wgrad__mutmut_3|functional_dw\\.kernels\\.torch_ref\\.xǁTorchKernelsǁwgrad__mutmut_3)$",
        "splitacc",
    ),
    ("^(functional_dw\\.residuals\\.x__describe_value__mutmut_27)$", "strleaf"),
    ("^(functional_dw\\.kernels\\.torch_ref\\.xǁTorchKernelsǁgrouped_quantize__mutmut_3)$", "unused"),
    (
        "^(functional_dw\\.kernels\\.torch_ref\\.xǁTorchKernelsǁgrouped_path_unsupported__mutmut_1|functional_dw\\.kernels\\.torch_ref\\.xǁTorchKernelsǁgrouped_path_unsupported__mutmut_2|functional_dw\\.kernels\\.torch_ref\\.xǁTorchKernelsǁgrouped_path_unsupported__mutmut_3|functional_dw\\.kernels\\.torch_ref\\.xǁTorchKernelsǁgrouped_path_unsupported__mutmut_4)$",
        "verdictcache",
    ),
    (
        "^(functional_dw\\.grouped_linear\\.x__vmap__mutmut_28|functional_dw\\.grouped_linear\\.x__vmap__mutmut_40|functional_dw\\.grouped_linear\\.x__vmap__mutmut_50|functional_dw\\.grouped_linear\\.x__vmap__mutmut_51|functional_dw\\.kernels\\.torch_ref\\.x__row_expert__mutmut_10)$",
        "vmapfold",
    ),
    ("^(functional_dw\\.distributed_weight\\.x_unwrap__mutmut_3)$", "wrapped"),
]
survivors = []
for f in sorted(glob.glob("mutants/functional_dw/**/*.meta", recursive=True)):
    for k, v in json.load(open(f))["exit_code_by_key"].items():
        if v in (0, 5, 33):
            survivors.append(k)
rows, unexplained = [], []
for m in survivors:
    show = subprocess.run([sys.executable, "-m", "mutmut", "show", m], capture_output=True, text=True).stdout
    minus = [ln[1:].strip() for ln in show.splitlines() if ln.startswith("-") and not ln.startswith("---")]
    plus = [ln[1:].strip() for ln in show.splitlines() if ln.startswith("+") and not ln.startswith("+++")]
    mod = m.rsplit(".x", 1)[0] if ".x_" in m or ".xǁ" in m else m
    path = mod.replace(".", "/") + ".py"
    path = re.sub(r"/x[_ǁ].*", "", path)
    path = m.split(".x")[0].replace(".", "/") + ".py"
    src = open(path).read().splitlines()
    line = next((i + 1 for i, ln in enumerate(src) if minus and ln.strip() == minus[-1]), "?")
    reason = next((key for pat, key in RULES if re.search(pat, m)), None)
    mut = f"`{(minus[-1] if minus else '')[:90]}` → `{(plus[-1] if plus else '(removed)')[:90]}`"
    if reason is None:
        unexplained.append((m, mut))
        continue
    rows.append((path, line, m.split(".")[-1], mut, reason))
if "--check" in sys.argv:
    for u in unexplained:
        print("UNEXPLAINED", *u)
    sys.exit(0)
out = open("tests/support/mutation_equivalents.md", "w")
out.write("""# Surviving mutants: why each is equivalent

`bash .ci/mutation` (mutmut 3 over the six modules in `pyproject.toml`) leaves these mutants
alive. Each is equivalent for the runner (CPU, no torch.compile): no test can tell it from the
original by a value, an error or a call. Reasons are keyed below; rows name the file, the line
of the original code, the mutant and the mutation. `.ci/mutation_equivalents.py` regenerates the list
after a run (`--check` names survivors no reason covers: a mutant not in this list must be
killed by a test in the feature test files, see `tests/README.md`). Line numbers are those of the mutated commit.

Reasons:

""")
for k, v in R.items():
    if any(r[4] == k for r in rows):
        out.write(f"- **{k}**: {v}\n")
out.write("\n| file | line | mutant | mutation | reason |\n|---|---|---|---|---|\n")
for p, ln, n, mut, r in rows:
    bar = "\\|"
    out.write(f"| {p.removeprefix('functional_dw/')} | {ln} | {n} | {mut.replace('|', bar)} | {r} |\n")
if unexplained:
    out.write("\nNot yet explained or killed (the run ended before a test for them was confirmed):\n\n")
    for m, mut in unexplained:
        out.write(f"- {m}: {mut}\n")
print(len(rows), "explained;", len(unexplained), "unexplained")
