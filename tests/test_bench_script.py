"""benchmarks/bench.py runs end to end (on the CPU, with CUDA timing, CUDA graphs and TE stood
in for), and the numbers it writes are consistent: TFLOP/s and fractions of peak follow from
the recorded times and shapes, the peak is the highest dense measurement, ratios follow from
the times, the markdown tables show the JSON's numbers, the recorded path choices are the ones
the library makes, and --only / --budget leave out what they say. The same for
benchmarks/moe_layer.py (one MoE expert layer, every contender), run in this process with --smoke, and
benchmarks/moe_mlp.py (the expert MLP) with --shapes smoke."""

import copy
import itertools
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent


def run_mock(out, *flags):
    run = subprocess.run(
        [sys.executable, str(HERE / "support" / "bench_mock.py"), str(out), *flags],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=HERE.parent,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads((out / "results.json").read_text()), (out / "results.md").read_text()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    return (out, *run_mock(out))


def _fd(name):
    return name.startswith("fd ")


PEERS = ("te split", "te grouped", "torch._grouped_mm")


def test_bench_script_writes_its_tables(results):
    out, data, md = results
    for section in (
        "## GroupedLinear",
        "## Weight layout",
        "## Frozen experts",
        "## CUDA graphs",
        "## Linear",
        "## Host time",
        "## Saved-tensor hooks",
        "## Dense bf16 GEMMs",
        "## FP8: forward+backward",
        "## FP8: bytes through a saved-tensor pack hook",
    ):
        assert section in md
    e80 = [r for r in data["grouped"] if r["E"] == 80]
    assert e80 and all(r["results"]["te grouped"].startswith("raises") for r in e80), "TE's 64-expert limit is recorded"
    for r in data["grouped"]:
        for path in ("fd auto", "fd te grouped", "fd te split"):
            assert isinstance(r["results"][f"{path} stacked"], dict) and isinstance(r["results"][f"{path} list"], dict)
    assert data["offload"]["results"]["fd te split"]["hook_tensors"] == 1
    v = data["meta"]["versions"]
    assert {"torch", "cuda", "te", "cublaslt_te", "cublaslt_loaded", "cublaslt"} <= set(v)
    assert (out / "tflops.png").stat().st_size > 0
    assert set(data["meta"]["elapsed_s"]) >= {
        "host",
        "linear",
        "offload",
        "frozen",
        "graphed",
        "fp8",
        "grouped",
        "total",
    }
    assert data["meta"]["errors"] == {}, "no section failed"


def _check_timing(v, flops, peak, md=None, what=""):
    assert v["ms"] > 0, (what, v)
    want = flops / v["ms"] / 1e9
    assert v["tflops"] == pytest.approx(want, rel=2e-3, abs=0.06), (what, v, want)  # (rounded to 0.1)
    assert v["frac_peak"] == pytest.approx(v["tflops"] / peak, abs=6e-4), (what, v, peak)
    if md is not None:
        cell = f"{v['tflops']} ({v['frac_peak']:.2f})"
        assert cell in md, f"{what}'s {cell} is not in the markdown"


def test_the_peak_is_the_highest_dense_measurement(results):
    _, data, md = results
    measured = [s["tflops"] for s in data["dense_samples"] if "tflops" in s]
    assert len(measured) >= 4 and {s["round"] for s in data["dense_samples"]} == {1, 2}
    assert data["dense_peak_tflops"] == max(measured) > 0
    assert f"**{data['dense_peak_tflops']:.0f} TFLOP/s**" in md


def test_bench_numbers_follow_from_times_and_shapes(results):
    _, data, md = results
    peak = data["dense_peak_tflops"]
    timed = 0
    for row in data["grouped"]:
        flops = 3 * 2 * row["tokens"] * row["hidden"] * row["ffn"]  # fwd + dgrad + wgrad
        assert 0 <= row["zero_experts"] <= row["E"]
        for name, v in row["results"].items():
            if isinstance(v, dict) and "ms" in v:
                timed += 1
                _check_timing(v, flops, peak, md, name)
        res = row["results"]
        ours = min(v["ms"] for n, v in res.items() if _fd(n) and isinstance(v, dict))
        peers = [res[n]["ms"] for n in PEERS if isinstance(res.get(n), dict)]
        line = next(
            ln
            for ln in md.splitlines()
            if ln.startswith(f"| {row['E']} | {row['hidden']} | {row['ffn']} | {row['tokens']} | {row['splits']} (")
        )
        assert f"| {ours / min(peers):.2f} |" in line, ("fd / best peer", line)
        layout = next(
            ln
            for ln in md.splitlines()
            if ln.startswith(f"| {row['E']} | {row['hidden']} | {row['ffn']} | {row['tokens']} | {row['splits']} |")
        )
        for path in ("fd auto", "fd te grouped", "fd te split"):
            assert f"| {res[path + ' list']['ms'] / res[path + ' stacked']['ms']:.2f} |" in layout, (path, layout)
    assert timed >= 20, "the smoke run timed the implementations"
    for row in data["linear"]:
        for name, v in row["results"].items():
            _check_timing(v, 3 * 2 * row["tokens"] * row["in"] * row["out"], peak, md, name)


def test_frozen_and_graphed_rows_are_consistent(results):
    _, data, md = results
    assert data["frozen"]
    for row in data["frozen"]:
        assert {"fd auto stacked", "fd te grouped list", "fd te split list", "te grouped", "te split"} <= set(
            row["results"]
        )
        for name, v in row["results"].items():
            if not isinstance(v, dict):
                continue
            for case in ("frozen weights", "x without grad"):
                assert v[case] > 0 and v[f"{case} / trainable"] == pytest.approx(v[case] / v["trainable"], abs=6e-4)
            assert f"| {name} | {v['trainable']} | {v['frozen weights']} | {v['x without grad']} |" in md
    assert data["graphed"]
    peak = data["dense_peak_tflops"]
    for row in data["graphed"]:
        flops = 3 * 2 * row["tokens"] * row["hidden"] * row["ffn"]
        graphs = 0
        for name, v in row["results"].items():
            if not isinstance(v, dict) or not isinstance(v.get("graph"), dict):
                continue
            graphs += 1
            _check_timing(v["eager"], flops, peak, None, name)
            _check_timing(v["graph"], flops, peak, md, f"{name} (graph)")
            assert v["graph / eager"] == pytest.approx(v["graph"]["ms"] / v["eager"]["ms"], abs=6e-4)
            assert f"| {name} | {v['eager']['ms']} | {v['graph']['ms']} | {v['graph / eager']} |" in md
        assert graphs >= 5, row["results"]


def test_host_table(results):
    _, data, md = results
    host = data["host"]
    for name in (
        "fd auto",
        "fd te grouped",
        "fd te split",
        "fd linear (te)",
        "te grouped",
        "te split",
        "te.Linear",
        "torch._grouped_mm (autograd)",
        "fd auto (graph)",
        "te grouped (graph)",
    ):
        v = host[name]
        assert v["issue"] > 0 and v["wall"] > 0, (name, v)
        assert f"| {name} | {v['issue']} | {v['wall']} |" in md, name


def test_bench_records_the_paths_the_library_takes(results):
    _, data, _ = results
    for row in data["grouped"]:
        chosen = row["results"]["chosen"]
        # the mock runs on the CPU: bf16 with 64 features is grouped_mm-able, so None takes the grouped path
        assert chosen["te, use_grouped_tensor=None"] == "grouped", chosen


def test_only_and_budget_leave_out_what_they_say(tmp_path):
    data, md = run_mock(tmp_path, "--only", "host,grouped", "--budget", "1")
    assert data["host"] and data["grouped"] == [] and data["frozen"] is None and data["graphed"] is None
    assert data["meta"]["skipped"] and all(s.startswith("grouped E=") for s in data["meta"]["skipped"])
    assert "## Host time" in md and "## Frozen experts" not in md and "Skipped for time" in md


FP8_CONFIGS = [
    ("delayed", "split"),
    ("current", "split"),
    ("current", "grouped"),
    ("block", "split"),
    ("block", "grouped"),
]


def test_fp8_rows_are_consistent(results):
    _, data, md = results
    peak = data["dense_peak_tflops"]
    rows = data["fp8"]["rows"]
    assert rows
    for row in rows:
        res = row["results"]
        flops = 3 * 2 * row["tokens"] * row["hidden"] * row["ffn"]
        for kind, path in FP8_CONFIGS:
            a, b = res[f"fd {kind} {path}"], res[f"te {kind} {path}"]
            assert isinstance(a, dict) and isinstance(b, dict), (kind, path, a, b)
            _check_timing(a, flops, peak, md, f"fd {kind} {path}")
            _check_timing(b, flops, peak, md, f"te {kind} {path}")
            line = f"| {row['E']} | {row['hidden']} | {row['ffn']} | {row['tokens']} | {kind} | {path} | {a['ms']} | {b['ms']} |"
            assert line in md and f"| {a['ms'] / b['ms']:.2f} | {path} |" in md, (line, "fd / te and the path fd took")
            assert res["fd path"][f"{kind} {path}"] == path, "balanced splits of 128s: every path runs as asked"
            assert f"fd {kind} {path} warning" not in res
        for name in ("bf16 fd auto", "bf16 te grouped", "torchao fp8 rowwise"):
            _check_timing(res[name], flops, peak, md, name)


def test_fp8_hook_bytes(results):
    _, data, md = results
    hb = data["fp8"]["hook_bytes"]
    r = hb["results"]
    bf16 = r["bf16 fd te split"]["hook_bytes"]
    assert bf16 == hb["shape"]["tokens"] * hb["shape"]["hidden"] * 2, "bf16 saves x"
    for kind, path in FP8_CONFIGS:
        for who in ("fd", "te"):
            v = r[f"{who} {kind} {path}"]
            assert 0 < v["hook_bytes"] <= 0.55 * bf16 and v["/ bf16 fd"] == pytest.approx(
                v["hook_bytes"] / bf16, abs=6e-4
            )
            assert f"| {who} {kind} {path} | {v['hook_tensors']} | {v['hook_bytes']:,} |" in md


def test_only_fp8(tmp_path):
    data, md = run_mock(tmp_path, "--only", "fp8")
    assert data["fp8"]["rows"] and data["grouped"] is None and data["host"] is None
    assert "## FP8: forward+backward" in md and "## GroupedLinear" not in md and data["meta"]["errors"] == {}


def _bench():
    """bench.py's report and timing modules (beside it in benchmarks/)."""
    sys.path.insert(0, str(HERE.parent / "benchmarks"))
    import bench_report
    import bench_timing

    return bench_report, bench_timing


def test_fractions_of_a_slow_cpus_peak():
    """A contended CPU's dense peak below 0.05 TFLOP/s once rounded to 0.0 and the report died
    dividing by it: the peak keeps 3 decimals, and no peak gives no fractions, not an error."""
    report, _ = _bench()
    timing = {"tflops": 0.01, "ms": 2.0}
    report.add_fractions({"grouped": [timing]}, 0.0)
    assert "frac_peak" not in timing
    report.add_fractions({"grouped": [timing]}, 0.04)
    assert timing["frac_peak"] == 0.25


def _strip_fractions(v):
    if isinstance(v, dict):
        v.pop("frac_peak", None)
        for u in v.values():
            _strip_fractions(u)
    elif isinstance(v, list):
        for u in v:
            _strip_fractions(u)


@pytest.mark.parametrize("peak", [0.0, float("nan")])
def test_readers_take_rows_without_a_fraction_or_a_time(results, tmp_path, peak):
    """No positive dense peak gives no fractions of peak (the mock's timed peak once rounded to
    0.0 and _cell died on KeyError 'frac_peak'), and a time may round to 0: the markdown, the plot
    and the ratios print a dash there instead of raising."""
    report, timing = _bench()
    data = copy.deepcopy(results[1])
    _strip_fractions(data)
    data["dense_peak_tflops"] = peak
    report.add_fractions(data, peak)
    assert "frac_peak" not in json.dumps(data)
    md = report.markdown(data)
    assert "Dense bf16 peak: **- TFLOP/s**" in md
    cells = 0
    for key in ("grouped", "linear"):
        for row in data[key]:
            for name, v in row["results"].items():
                if isinstance(v, dict) and "tflops" in v:
                    cells += 1
                    assert f"| {v['tflops']} (-) |" in md, (key, name, v)
    assert cells >= 20
    # times of 0 (no TFLOP/s then) where the ratios divide: each prints a dash
    g = data["grouped"][0]["results"]
    for name in ("te split", "te grouped", "torch._grouped_mm", "torch._grouped_mm (autograd)", "fd auto stacked"):
        g[name] = timing.ms_tflops(1e9, 0.0)
    assert g["fd auto stacked"] == {"ms": 0.0} and report._cell(g["fd auto stacked"]) == "- (-)"
    data["linear"][0]["results"]["te.Linear"] = timing.ms_tflops(1e9, 0.0)
    fp8 = data["fp8"]["rows"][0]["results"]
    fp8["fd rowwise"] = fp8["te delayed split"] = timing.ms_tflops(1e9, 0.0)
    md = report.markdown(data)
    r0 = data["grouped"][0]
    head = f"| {r0['E']} | {r0['hidden']} | {r0['ffn']} | {r0['tokens']} | {r0['splits']}"
    line = next(ln for ln in md.splitlines() if ln.startswith(head + " ("))
    assert "| - (-) |" in line and line.endswith("| - | - | grouped / torch grouped |"), line
    layout = next(ln for ln in md.splitlines() if ln.startswith(head + " |"))
    assert layout.startswith(head + " | - | "), layout
    assert any(ln.endswith("| - (-) | - |") for ln in md.splitlines() if ln.startswith("| 64 | 64 | 64 |")), (
        "linear fd / te"
    )
    fp8_line = next(ln for ln in md.splitlines() if "| delayed | split |" in ln)
    assert "| - (-) | - | split |" in fp8_line, fp8_line
    rowwise = next(ln for ln in md.splitlines() if ln.startswith("| 2 | 128 | 128 | 256 | balanced | - (-) |"))
    assert rowwise.endswith("| - | - | - |"), rowwise
    report.plot(data["grouped"], tmp_path / "tflops.png")
    assert (tmp_path / "tflops.png").stat().st_size > 0


# --- benchmarks/moe_layer.py -------------------------------------------------------------------
# Run in this process with --smoke (tiny shapes on the CPU, wall clocks for the CUDA events) and a
# fixed clock, so its numbers are data: the tables must show the JSON's numbers and ratios.

CPU_RUNNABLE = ("torch", "fd", "fd_1w", "rowwise", "fd_compiled", "fd_1w_compiled", "rowwise_compiled")


def _moe():
    sys.path.insert(0, str(HERE.parent / "benchmarks"))
    import moe_layer

    return moe_layer


def _fixed_clock(mp, moe):
    """moe_layer's clock advances by a fixed cycle of steps per call: unequal, so ratios are not all 1."""
    ticks = itertools.accumulate(itertools.cycle([0.001, 0.0025, 0.004, 0.0015, 0.003]))
    mp.setattr(moe, "now", lambda: next(ticks))


def _moe_run(tmp, *flags, patch=None):
    moe = _moe()
    with pytest.MonkeyPatch.context() as mp:
        _fixed_clock(mp, moe)
        if patch is not None:
            patch(mp, moe)
        moe.main(["--smoke", "--out", str(tmp), *flags])
    return moe, json.loads((tmp / "results.json").read_text()), (tmp / "results.md").read_text()


@pytest.fixture(scope="module")
def moe_results(tmp_path_factory):
    return _moe_run(tmp_path_factory.mktemp("moe"))


def _check_moe_tables(moe, data, md):
    """Every shape and routing has a row with every contender's cell and the ratios the JSON gives."""
    keys = data["meta"]["contenders"]
    for routing in data["meta"]["routings"]:
        table = md.split(f"## {routing} routing")[1].split("\n\n")[1].splitlines()
        assert table[0] == (
            "| shape (E, hidden, ffn, tokens) | empty experts | "
            + " | ".join(moe.LABELS[k] for k in keys)
            + " | "
            + " | ".join(r[0] for r in moe.RATIOS)
            + " |"
        )
        rows = [ln for ln in table[2:] if ln.startswith("| ")]
        assert len(rows) == len(data["shapes"])
        for s, line in zip(data["shapes"], rows):
            res = s["routings"][routing]["results"]
            assert set(res) == set(keys)
            cells = line.split(" | ")[2:]
            for k, c in zip(keys, cells):
                v = res[k]
                if isinstance(v, dict):
                    assert v["ms"] > 0 and v["ms"] == pytest.approx(statistics.median(v["ms_all"]), abs=1e-4)
                    assert len(v["ms_all"]) == data["meta"]["repeats"]
                    if k.endswith("_graphed"):
                        assert "host_ms" not in v and c == f"{v['ms']:.3f}"
                    else:
                        assert v["host_ms"] > 0 and c == f"{v['ms']:.3f} ({v['host_ms']:.3f})"
                else:
                    assert v and c == ("OOM" if v == "OOM" else "n/a" if v.startswith("n/a") else "raises"), (k, v, c)
                    assert f"- {moe.LABELS[k]}: {v} (" in md, "the reason is listed"
            ratios = line.rstrip(" |").split(" | ")[-len(moe.RATIOS) :]
            for (_, a, b, field), got in zip(moe.RATIOS, ratios):
                ok = isinstance(res.get(a), dict) and isinstance(res.get(b), dict)
                assert got == (f"{res[a][field] / res[b][field]:.2f}" if ok else "-"), (a, b, field, line)


def test_moe_layer_smoke(moe_results):
    moe, data, md = moe_results
    assert [(s["E"], s["hidden"], s["ffn"], s["tokens"]) for s in data["shapes"]] == [s[:4] for s in moe.SMOKE_SHAPES]
    assert data["meta"]["contenders"] == moe.CONTENDERS and data["meta"]["routings"] == ["balanced", "skewed"]
    assert {"torch", "cuda", "te", "cublaslt"} <= set(data["meta"]["versions"])
    assert data["meta"]["commands"] == [
        f"python benchmarks/moe_layer.py --smoke --out {data['meta']['commands'][0].split()[-1]}"
    ]
    for s in data["shapes"]:
        for routing, row in s["routings"].items():
            assert sum(row["splits"]) == s["tokens"] and len(row["splits"]) == s["E"]
            assert all(c % 128 == 0 for c in row["splits"]) and (row["zero_experts"] > 0) == (routing == "skewed")
            for k in CPU_RUNNABLE:  # these run on the CPU: timed, with the output checked
                v = row["results"][k]
                assert isinstance(v, dict), (k, v)
                assert v["rel_err"] < (0.1 if "rowwise" in k else 1e-2), (k, v)
    _check_moe_tables(moe, data, md)


def _fake_te(mp, moe):
    """TE, torchao and CUDA graphs stood in for (as bench_mock.py does for bench.py), so their
    contenders' code runs: te.GroupedLinear is fd's module on the torch backend, following a fake
    te.autocast through FP8GlobalStateManager as fd's modules follow TE's; fd's backend="te" runs
    torch's kernels; torchao's FP8 grouped GEMM is torch's bf16 one, and runs out of memory in
    the timed steps of the second shape; a graph replay runs the captured step eagerly."""
    import contextlib
    import types

    import functional_dw as fd
    from functional_dw import fp8
    from functional_dw.kernels import get_kernels as real_get

    gp = sys.modules["functional_dw.grouped_plan"]  # (where grouped_linear's plan picks its kernels)
    mp.setattr(gp, "get_kernels", lambda backend, x, w=None: real_get("torch" if backend == "te" else backend, x, w))

    class Manager:
        recipe = None

        @classmethod
        def is_fp8_enabled(cls):
            return cls.recipe is not None

        @classmethod
        def get_fp8_recipe(cls):
            return cls.recipe

    @contextlib.contextmanager
    def autocast(enabled=True, recipe=None):
        old, Manager.recipe = Manager.recipe, (recipe if enabled else None)
        try:
            yield
        finally:
            Manager.recipe = old

    class GL(fd.nn.GroupedLinear):
        def __init__(self, *a, **k):
            super().__init__(*a, backend="torch", **k)

    te = types.ModuleType("transformer_engine.pytorch")
    te.GroupedLinear, te.autocast = GL, autocast
    quant = types.ModuleType("transformer_engine.pytorch.quantization")
    quant.FP8GlobalStateManager = Manager
    pkg, common = types.ModuleType("transformer_engine"), types.ModuleType("transformer_engine.common")
    recipes = types.ModuleType("transformer_engine.common.recipe")
    recipes.Float8BlockScaling, recipes.Float8CurrentScaling = fp8.Float8BlockScaling, fp8.Float8CurrentScaling
    pkg.pytorch, pkg.common, common.recipe = te, common, recipes
    tex = types.ModuleType("transformer_engine_torch")
    tex.get_cublasLt_version = lambda: 0
    calls = []

    def ao_gmm(A, B_t, offs, out_dtype=None, pad_token_groups_for_grouped_mm=True):
        assert B_t.stride(-2) == 1 and offs.dtype == torch.int32 and not pad_token_groups_for_grouped_mm
        calls.append(A.shape[0])
        if A.shape[0] == moe.SMOKE_SHAPES[1][3] and calls.count(A.shape[0]) > 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 GiB (fake)")
        return torch._grouped_mm(A, B_t, offs=offs).to(out_dtype)

    ao, proto, moe_training = (
        types.ModuleType(n) for n in ("torchao", "torchao.prototype", "torchao.prototype.moe_training")
    )
    moe_training._to_fp8_rowwise_then_scaled_grouped_mm = ao_gmm
    for name, mod in {
        "transformer_engine": pkg,
        "transformer_engine.pytorch": te,
        "transformer_engine.common": common,
        "transformer_engine.pytorch.quantization": quant,
        "transformer_engine.common.recipe": recipes,
        "transformer_engine_torch": tex,
        "torchao": ao,
        "torchao.prototype": proto,
        "torchao.prototype.moe_training": moe_training,
    }.items():
        mp.setitem(sys.modules, name, mod)
    mp.setattr(fd.nn_fp8, "_TE_MANAGER", [])  # (fd.nn_fp8 remembers the TE it saw: not this one, after the test)

    class Graphed:
        def __init__(self, step, *inputs, params=(), warmup=1):
            self.step, self.inputs = step, inputs
            self.outputs = step(*inputs)

        def __call__(self):
            self.outputs = self.step(*self.inputs)
            return self.outputs

    mp.setattr(moe, "graph_step", Graphed)


def test_moe_layer_with_te_torchao_and_graphs_stood_in(tmp_path):
    eager = [k for k in _moe().CONTENDERS if not k.endswith("_compiled")]  # (compiling is the slow part, checked above)
    moe, data, md = _moe_run(tmp_path, "--only", ",".join(eager), patch=_fake_te)
    for i, s in enumerate(data["shapes"]):
        for row in s["routings"].values():
            res = row["results"]
            for k in eager:
                if k == "torchao" and i == 1:
                    assert res[k] == "OOM", "the OOM is recorded, the others go on"
                    continue
                assert isinstance(res[k], dict), (k, res[k])
            assert res["te_bf16"]["rel_err"] < 1e-2 and res["fd_te"]["rel_err"] < 1e-2
            for k in ("te_block", "te_current"):  # quantized: TE's autocast reached the module
                assert 1e-3 < res[k]["rel_err"] < 0.1, (k, res[k])
    assert "OOM" in md
    _check_moe_tables(moe, data, md)


def test_moe_layer_budget_and_arguments(tmp_path):
    _, data, md = _moe_run(tmp_path, "--only", "torch,fd", "--routing", "skewed", "--budget", "1e-9")
    assert len(data["shapes"]) == 1 and data["meta"]["skipped"] == [
        "{}, {}, {}, {}".format(*_moe().SMOKE_SHAPES[1][:4])
    ]
    assert list(data["shapes"][0]["routings"]) == ["skewed"] and "## balanced routing" not in md
    assert "Skipped for time" in md
    _, data, md = _moe_run(tmp_path, "--only", "torch,fd", "--routing", "skewed", "--shapes", "1", "--append")
    assert [s["E"] for s in data["shapes"]] == [s[0] for s in _moe().SMOKE_SHAPES], "the earlier shape stays"
    assert len(data["meta"]["commands"]) == 2 and not data["meta"]["skipped"]
    assert all(f"`{c}`" in md for c in data["meta"]["commands"])
    for bad in (["--only", "fd,nope"], ["--routing", "zipf"]):
        with pytest.raises(SystemExit):
            _moe().main(["--smoke", "--out", str(tmp_path), *bad])


# --- benchmarks/moe_mlp.py (the expert MLP, every contender) -----------------------------------
# --shapes smoke on the CPU with moe_layer's fixed clock (its measure times the steps): the tables must
# show the JSON's numbers, and the saved bytes follow docs/mlp.md's formulas.

MLP_CPU = ("torch", "fd", "fd_list", "fd_rowwise", "fd_save_h", "fd_x_only")


def _mlp():
    sys.path.insert(0, str(HERE.parent / "benchmarks"))
    import moe_mlp

    return moe_mlp


def _mlp_run(tmp, *flags, patch=None):
    mlp = _mlp()
    with pytest.MonkeyPatch.context() as mp:
        _fixed_clock(mp, _moe())
        if patch is not None:
            patch(mp, mlp)
        mlp.main(["--shapes", "smoke", "--out", str(tmp), *flags])
    return mlp, json.loads((tmp / "results.json").read_text()), (tmp / "results.md").read_text()


def _check_mlp_tables(mlp, data, md):
    keys = data["meta"]["contenders"]
    for routing in data["meta"]["routings"]:
        rows = [ln for ln in md.split(f"## {routing} routing")[1].split("\n\n")[1].splitlines()[2:]]
        assert len(rows) == len(data["shapes"])
        for s, line in zip(data["shapes"], rows):
            res = s["routings"][routing]["results"]
            cells = line.split(" | ")[2:]
            for k, c in zip(keys, cells):
                v = res[k]
                if isinstance(v, dict):
                    assert v["ms"] == pytest.approx(statistics.median(v["ms_all"]), abs=1e-4)
                    want = f"{v['ms']:.3f}" + ("" if k.endswith("_graphed") else f" ({v['host_ms']:.3f})")
                    assert c == want, (k, c)
                else:
                    assert c == ("OOM" if v == "OOM" else "n/a" if v.startswith("n/a") else "raises"), (k, v, c)
                    assert f"- {mlp.LABELS[k]}: {v} (" in md, "the reason is listed"
            ratios = line.rstrip(" |").split(" | ")[-len(mlp.RATIOS) :]
            for (_, a, b, field), got in zip(mlp.RATIOS, ratios):
                ok = isinstance(res.get(a), dict) and isinstance(res.get(b), dict)
                assert got == (f"{res[a][field] / res[b][field]:.2f}" if ok else "-"), (a, b, field, line)
    saved = md.split("## Saved for backward")[1].split("\n\n")[2].splitlines()[2:]
    for s, line in zip(data["shapes"], saved):
        cells = line.split(" | ")[2:]
        for k, c in zip(keys, cells):
            assert c.rstrip(" |") == mlp.saved_cell(s["saved"][k]), (k, c)


def test_moe_mlp_smoke(tmp_path):
    mlp, data, md = _mlp_run(tmp_path)
    assert [(s["E"], s["hidden"], s["ffn"], s["tokens"]) for s in data["shapes"]] == [s[:4] for s in mlp.SMOKE_SHAPES]
    assert data["meta"]["contenders"] == mlp.CONTENDERS and data["meta"]["routings"] == ["balanced", "skewed"]
    for s in data["shapes"]:
        H, F = s["hidden"], s["ffn"]
        for row in s["routings"].values():
            assert sum(row["splits"]) == s["tokens"]
            for k in MLP_CPU:
                v = row["results"][k]
                assert isinstance(v, dict) and v["rel_err"] < (0.1 if "rowwise" in k else 1e-2), (k, v)
            for k, why in mlp.GPU_ONLY.items():  # skipped on the CPU, saying why
                assert row["results"][k] == why
        saved = s["saved"]
        for k, want in mlp.fd_formulas(H, F).items():
            assert saved[k]["per_token"] == want and saved[k]["at_T"]["param_bytes"] == 0, (k, saved[k])
        assert saved["fd_list"]["per_token"] == saved["fd"]["per_token"]
        assert saved["fd_list"]["at_T"]["param_bytes"] == 0
        # torch's composition: x, fc1's output, silu(gate), silu(gate) * up, probs, h; and both weights
        assert saved["torch"]["per_token"] == 2 * H + 10 * F + 4
        assert saved["torch"]["at_T"]["param_bytes"] == 2 * 3 * s["E"] * F * H
        assert saved["fd_rowwise"]["per_token"] < saved["fd"]["per_token"]
    _check_mlp_tables(mlp, data, md)


def test_moe_mlp_with_te_torchao_and_graphs_stood_in(tmp_path):
    def patch(mp, mlp):
        _fake_te(mp, mlp)  # (its torchao OOMs at the second smoke shape)
        mp.setattr(mlp, "ALLOW_CPU", True)

    mlp, data, md = _mlp_run(tmp_path, patch=patch)
    for i, s in enumerate(data["shapes"]):
        for row in s["routings"].values():
            res = row["results"]
            for k in mlp.CONTENDERS:
                if k == "torchao" and i == 1:
                    assert res[k] == "OOM"
                    continue
                assert isinstance(res[k], dict), (k, res[k])
            assert res["te_bf16"]["rel_err"] < 1e-2
            for k in ("te_fp8_block", "te_fp8_current", "torchao"):  # quantized (torchao's stand-in is bf16)
                if isinstance(res[k], dict):
                    assert res[k]["rel_err"] < (1e-2 if k == "torchao" else 0.1), (k, res[k])
        assert s["saved"]["fd_graphed"].startswith("n/a: a graph")
        assert isinstance(s["saved"]["te_fp8_current"], dict)
    _check_mlp_tables(mlp, data, md)


def test_moe_mlp_budget_and_arguments(tmp_path):
    mlp, data, md = _mlp_run(tmp_path, "--only", "torch,fd", "--routing", "skewed", "--budget", "1e-9")
    assert len(data["shapes"]) == 1 and data["meta"]["skipped"] == ["{}, {}, {}, {}".format(*mlp.SMOKE_SHAPES[1][:4])]
    assert "Skipped for time" in md and "## balanced routing" not in md
    for bad in (["--only", "fd,nope"], ["--routing", "zipf"]):
        with pytest.raises(SystemExit):
            mlp.main(["--shapes", "smoke", "--out", str(tmp_path), *bad])


# --- benchmarks/host_cpu.py (the CPU host-time proxy) ----------------------------------------


def test_host_cpu_proxy_quick_writes_every_contender(tmp_path):
    """The proxy the CI runs in seconds: every E and contender measured (positive, finite), the
    markdown's ratios computed from the JSON's numbers (no claim about speed)."""
    sys.path.insert(0, str(HERE.parent / "benchmarks"))
    try:
        import host_cpu
    finally:
        sys.path.remove(str(HERE.parent / "benchmarks"))
    result = host_cpu.main(["--quick", "--experts", "8,32,128", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "host_cpu.json").read_text())
    assert saved["quick"] and list(saved["us_per_step"]) == ["8", "32"]  # quick leaves out E > 32
    want = {
        "torch grouped_mm",
        "fd, one [E, N, K] weight",
        "fd, E weights (TE's layout)",
        "engine per extra parameter",
        "torch MLP",
        "fd GroupedMLP",
    }
    md = (tmp_path / "host_cpu.md").read_text()
    for E, r in result["us_per_step"].items():
        assert set(r) == want
        assert all(v == v and abs(v) < float("inf") for v in r.values())
        assert all(r[k] > 0 for k in want - {"engine per extra parameter"})
        t, one = r["torch grouped_mm"], r["fd, one [E, N, K] weight"]
        assert f"| {E} | {t:.1f} | {one:.1f} | {one / t:.2f}x |" in md
        tm, fm = r["torch MLP"], r["fd GroupedMLP"]
        assert f"| {tm:.1f} | {fm:.1f} | {fm / tm:.2f}x |" in md


# --- benchmarks/moe_block.py -------------------------------------------------------------------


def test_moe_block_smoke_writes_every_contender(tmp_path):
    """The whole MoE block's script on the CPU: torch's and fd's steps timed (the cells show the
    JSON's numbers), the CUDA-only contenders say why they did not run, and the hooks' bytes
    per token show torch's weights passing through them and none of fd's."""
    sys.path.insert(0, str(HERE.parent / "benchmarks"))
    try:
        import moe_block
    finally:
        sys.path.remove(str(HERE.parent / "benchmarks"))
    moe_block.main(["--shapes", "smoke", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "results.json").read_text())
    md = (tmp_path / "results.md").read_text()
    (row,) = data["shapes"]
    for key in ("torch", "fd", "fd_rowwise", "fd_fp8"):
        v = row["times"][key]
        assert (
            v["ms"] > 0 and v["host_ms"] > 0 and v["rel_err"] < (0.1 if "fp8" in key or "rowwise" in key else 0.02)
        ), key
        assert f"{v['ms']:.3f} ({v['host_ms']:.3f})" in md
    assert f"fd over torch {row['times']['torch']['ms'] / row['times']['fd']['ms']:.2f}x" in md
    for key in ("fd_graphed", "fd_fp8_graphed"):
        assert row["times"][key] == "n/a: CUDA graphs need CUDA"
    assert row["times"]["te"].startswith("n/a") and row["times"]["liger"].startswith("n/a")
    assert row["saved"]["fd"]["params_seen"] == 0 and row["saved"]["torch"]["params_seen"] == 3
    assert 0 < row["saved"]["fd"]["bytes_per_token"] < row["saved"]["torch"]["bytes_per_token"]


def test_moe_block_keeps_the_shapes_a_run_did_not_measure():
    """The latest data per shape: a run's shapes replace the previous ones of the same shape,
    the rest are kept, each tagged with the date of the run that measured it."""
    sys.path.insert(0, str(HERE.parent / "benchmarks"))
    try:
        import moe_block
    finally:
        sys.path.remove(str(HERE.parent / "benchmarks"))
    old = {"date": "then", "shapes": [{"shape": "a", "v": 1}, {"shape": "b", "v": 2}]}
    new = {"date": "now", "shapes": [{"shape": "b", "v": 3, "run": "now"}]}
    got = moe_block.merged(new, old)
    assert got["shapes"] == [{"shape": "b", "v": 3, "run": "now"}, {"shape": "a", "v": 1, "run": "then"}]
    assert moe_block.merged(new, None) == new


# --- benchmarks/rows_quantize.py (GPU only) -----------------------------------------------------


def test_rows_quantize_says_it_needs_an_sm90_gpu(monkeypatch):
    # It imports anywhere and exits with its reason where RowwiseScaling's kernels cannot run:
    # without CUDA, and on a GPU other than sm_90 (was: Triton's error compiling the FP8 cast there;
    # on a CPU-only torch, "Torch not compiled with CUDA enabled" once CUDA is claimed).
    if not torch.cuda.is_available():
        run = subprocess.run(
            [sys.executable, "benchmarks/rows_quantize.py"],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=HERE.parent,
        )
        assert run.returncode == 1 and "needs an sm_90 (Hopper) GPU and Triton" in run.stderr, run.stderr[-2000:]
    monkeypatch.syspath_prepend(str(HERE.parent / "benchmarks"))
    import rows_quantize

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: (8, 0))
    with pytest.raises(SystemExit, match=r"needs an sm_90 \(Hopper\) GPU and Triton"):
        rows_quantize.main([])
