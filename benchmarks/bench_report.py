"""bench.py's report: results.md (the tables) and tflops.png (the plot), from the result bench.py stores.

* :func:`add_fractions`: ``frac_peak`` on every timing, once the dense peak is known (at the end);
* :func:`markdown`: the header (versions, the dense peak, what was skipped or failed), then one
  function per section's tables, each reading only the JSON (so a committed results.json can be
  rendered again);
* :func:`plot`: GroupedLinear TFLOP/s per shape and implementation.

The readers (``_cell``, ``_ms``, ``_ratio``...) take what is there: a timing may lack its fraction
of peak or its TFLOP/s, or be the reason it did not run; a missing number prints a dash.
"""

from __future__ import annotations

from bench_contenders import FD_NAMES, FD_PATHS, GROUPED_NAMES, PEERS_FOR_RATIO
from bench_fp8 import FP8_CONFIGS, FP8_OTHERS, fp8_tag
from bench_sections import FROZEN_CASES


def add_fractions(result, peak):
    """frac_peak on every timing that has TFLOP/s, from the final peak (known at the end);
    none without a positive peak."""
    if not (isinstance(peak, (int, float)) and peak > 0):
        return

    def walk(v):
        if isinstance(v, dict):
            if "tflops" in v and "ms" in v:
                v["frac_peak"] = round(v["tflops"] / peak, 3)
            for u in v.values():
                walk(u)
        elif isinstance(v, list):
            for u in v:
                walk(u)

    for key in ("grouped", "linear", "graphed", "fp8"):
        walk(result.get(key))


def plot(rows, path):
    """tflops.png: a bar per implementation (GROUPED_NAMES) per grouped row; 0 where it has no TFLOP/s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = GROUPED_NAMES
    labels = [f"E{r['E']} {r['ffn']} {r['tokens'] // 1024}k {r['splits'][0]}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(10, len(rows) * 1.1), 5))
    width = 0.8 / len(names)
    for i, n in enumerate(names):
        vals = [_tflops(r["results"].get(n)) or 0 for r in rows]
        ax.bar([j + i * width for j in range(len(rows))], vals, width, label=n)
    ax.set_xticks([j + 0.4 for j in range(len(rows))], labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("TFLOP/s (bf16, fwd+bwd)")
    ax.legend(fontsize=7, ncol=4)
    ax.set_title("GroupedLinear fwd+bwd, hidden in/ffn out (0 = raises, n/a or no time)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# The readers of a row take what is there: a timing may lack its fraction of peak (no positive
# peak: add_fractions gives none), its TFLOP/s (a time that is not positive), or be a reason it
# did not run; a missing number prints a dash, a ratio over a zero time too.


def _number(x):
    return x if isinstance(x, (int, float)) and not isinstance(x, bool) and x == x else None  # (not NaN)


def _tflops(v):
    return _number(v.get("tflops")) if isinstance(v, dict) else None


def _ms_of(v):
    return _number(v.get("ms")) if isinstance(v, dict) else None


def _cell(v):
    if isinstance(v, dict) and ("tflops" in v or "ms" in v):
        tflops, frac = _tflops(v), _number(v.get("frac_peak"))
        return f"{'-' if tflops is None else tflops} ({'-' if frac is None else f'{frac:.2f}'})"
    return "raises" if isinstance(v, str) and v.startswith("raises") else "n/a"


def _ms(v):
    return (
        f"{v['ms']}"
        if isinstance(v, dict) and "ms" in v
        else "raises"
        if isinstance(v, str) and v.startswith("raises")
        else "n/a"
    )


def _ratio(a, b, digits=2):
    """a's time over b's: n/a when either is not a timing, a dash when there is no time to divide by."""
    if not (isinstance(a, dict) and isinstance(b, dict)):
        return "n/a"
    x, y = _ms_of(a), _ms_of(b)
    return f"{x / y:.{digits}f}" if x is not None and y is not None and y > 0 else "-"


def _fmt(x, spec=".2f"):
    return "-" if _number(x) is None else format(x, spec)


def best_fd_over_peers(res):
    """functional_dw's best time over the best peer's; NaN without both or with a zero peer time."""
    ours = [t for t in (_ms_of(res.get(n)) for n in FD_NAMES) if t is not None]
    peers = [t for t in (_ms_of(res.get(n)) for n in PEERS_FOR_RATIO) if t is not None]
    return min(ours) / min(peers) if ours and peers and min(peers) > 0 else float("nan")


def markdown(result) -> str:
    """results.md: the header, then each section's tables (a section not run has none)."""
    lines = _header(result)
    for tables in (
        _grouped_tables,
        _fp8_tables,
        _fp8_hook_bytes_table,
        _frozen_table,
        _graphed_table,
        _linear_table,
        _host_table,
        _offload_table,
        _dense_table,
    ):
        lines += tables(result)
    return "\n".join(lines) + "\n"


def _header(result) -> list[str]:
    """The title, the versions, the dense peak, what was skipped or failed, and the seconds per section."""
    meta, peak = result["meta"], _number(result.get("dense_peak_tflops"))
    v = meta["versions"]
    return [
        f"# Benchmarks ({meta['date']}, {meta['card']})",
        "",
        f"torch {v['torch']} (CUDA {v['cuda']}), TE {v['te']}, cuBLASLt {v['cublaslt']} (TE reports {v['cublaslt_te']}; "
        f"loaded: {v['cublaslt_loaded']} from {v['cublaslt_path']}). Dense bf16 peak: **{f'{peak:.0f}' if peak else '-'} TFLOP/s**, the highest "
        f"of {len([s for s in result['dense_samples'] if 'tflops' in s])} dense GEMM measurements below (fractions of peak "
        "use it). Forward+backward, bf16, median of repeats, CUDA events, implementations interleaved."
        + (" Run with --quick." if meta["quick"] else "")
        + (
            f" Skipped for time (--budget {meta['budget_s']} s): {', '.join(meta['skipped'])}."
            if meta["skipped"]
            else ""
        )
        + "".join(f" **Section {k} failed**: {e}." for k, e in meta["errors"].items()),
        "",
        "Seconds per section: " + ", ".join(f"{k} {s}" for k, s in meta["elapsed_s"].items()),
        "",
    ]


def _grouped_tables(result) -> list[str]:
    """GroupedLinear TFLOP/s per shape and implementation, and the weight layouts' ratio."""
    if not result.get("grouped"):
        return []
    names = GROUPED_NAMES
    lines = [
        "## GroupedLinear: TFLOP/s (fraction of peak)",
        "",
        "| E | hidden | ffn | tokens | splits | "
        + " | ".join(names)
        + " | fd / best peer | fd auto / autograd grouped_mm | chosen (te None / auto) |",
        "|" + "---|" * (8 + len(names)),
    ]
    for r in result["grouped"]:
        res = r["results"]
        ag, ours = res.get("torch._grouped_mm (autograd)"), res.get("fd auto stacked")
        ratio_ag = _ratio(ours, ag)
        ch = res["chosen"]
        lines.append(
            f"| {r['E']} | {r['hidden']} | {r['ffn']} | {r['tokens']} | {r['splits']} ({r['zero_experts']} empty) | "
            + " | ".join(_cell(res.get(n)) for n in names)
            + f" | {_fmt(best_fd_over_peers(res))} | {ratio_ag} | {ch['te, use_grouped_tensor=None']} / {ch['auto']} |"
        )
    lines += [
        "",
        "fd / best peer: functional_dw's best time (any path, either layout) over the best of te split, te "
        "grouped and torch._grouped_mm (<= 1.00: at least as fast). stacked: one [E, out, in] weight; list: the E "
        "[out, in] weights of an fd.nn.GroupedLinear (what a module user passes). torch._grouped_mm is its three raw "
        "GEMMs (no autograd); torch._grouped_mm (autograd) is the same op differentiated by torch's autograd; fd auto "
        "/ autograd grouped_mm compares fd auto stacked with it.",
        "",
        "## Weight layout: time of the list (nn.GroupedLinear) over the stacked [E, out, in] weight",
        "",
        "| E | hidden | ffn | tokens | splits | fd auto | fd te grouped | fd te split |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["grouped"]:
        res = r["results"]
        cells = []
        for p in FD_PATHS:
            a, b = res.get(f"{p} list"), res.get(f"{p} stacked")
            cells.append(_ratio(a, b))
        lines.append(
            f"| {r['E']} | {r['hidden']} | {r['ffn']} | {r['tokens']} | {r['splits']} | " + " | ".join(cells) + " |"
        )
    return lines


def _fp8_tables(result) -> list[str]:
    """FP8 recipes fd vs te.GroupedLinear, then RowwiseScaling, bf16 and torchao at the same shapes."""
    if not (result.get("fp8") and result["fp8"].get("rows")):
        return []
    lines = [
        "",
        "## FP8: forward+backward TFLOP/s (fraction of the bf16 peak), fd vs te.GroupedLinear, same recipe and path",
        "",
        "| E | hidden | ffn | tokens | recipe | path | fd ms | te ms | fd | te | fd / te | fd path taken |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["fp8"]["rows"]:
        res = r["results"]
        for kind, grouped in FP8_CONFIGS:
            tag = fp8_tag(kind, grouped)
            a, b = res.get(f"fd {tag}"), res.get(f"te {tag}")
            ratio = _ratio(a, b)
            lines.append(
                f"| {r['E']} | {r['hidden']} | {r['ffn']} | {r['tokens']} | {kind} | "
                f"{'grouped' if grouped else 'split'} | {_ms(a)} | {_ms(b)} | {_cell(a)} | {_cell(b)} | {ratio} | "
                f"{res.get('fd path', {}).get(tag, 'n/a')} |"
            )
    lines += [
        "",
        "Same shapes: fd's own RowwiseScaling, bf16 and torchao, TFLOP/s (fraction of peak); speedups of fd "
        "rowwise (time of the other / time of fd rowwise)",
        "",
        "| E | hidden | ffn | tokens | splits | "
        + " | ".join(FP8_OTHERS)
        + " | rowwise / bf16 fd | rowwise / best te FP8 | rowwise / torchao |",
        "|---|---|---|---|---|" + "---|" * (len(FP8_OTHERS) + 3),
    ]
    for r in result["fp8"]["rows"]:
        res = r["results"]
        ms = lambda n: _ms_of(res.get(n))  # noqa: E731
        te8 = [ms(f"te {fp8_tag(k, g)}") for k, g in FP8_CONFIGS if ms(f"te {fp8_tag(k, g)}")]
        ours = ms("fd rowwise")
        speed = lambda other: "n/a" if other is None or ours is None else f"{other / ours:.2f}" if ours > 0 else "-"  # noqa: E731
        lines.append(
            f"| {r['E']} | {r['hidden']} | {r['ffn']} | {r['tokens']} | {r.get('splits', 'balanced')} | "
            + " | ".join(_cell(res.get(n)) for n in FP8_OTHERS)
            + f" | {speed(ms('bf16 fd auto'))} | {speed(min(te8) if te8 else None)} | "
            f"{speed(ms('torchao fp8 rowwise'))} |"
        )
    warned = [
        f"{r['E']}/{r['hidden']}/{r['ffn']}/{r['tokens']} {k[: -len(' warning')]}: {v}"
        for r in result["fp8"]["rows"]
        for k, v in r["results"].items()
        if k.endswith(" warning")
    ]
    lines += [
        "",
        "Balanced and zipf splits (multiples of 128 tokens per expert, so block scaling can take the grouped path), bf16 "
        "activations. fd: fd.grouped_linear(..., recipe=fp8.<Recipe>(), backend='te', use_grouped_tensor=path), "
        "delayed scaling with fp8.update_state_ after each step (in the timed step); te: te.GroupedLinear with fd's "
        "weights under TE's autocast with TE's recipe of the same class; delayed scaling warmed up 3 steps for both. "
        "fd / te <= 1.00: fd at least as fast. bf16 fd auto: fd's bf16 auto path (list weights); torchao fp8 "
        "rowwise: torchao.prototype.moe_training._to_fp8_rowwise_then_scaled_grouped_mm (per-row scales, "
        "differentiable). fd rowwise: fd.grouped_linear(..., recipe=fp8.RowwiseScaling(bf16_below=0)) on device splits, "
        "weights unchanged between steps (quantized once, NOTE: [FP8 weights per version]); fd rowwise new "
        "weights: the same with an in-place update of the weights after each step (an optimizer step), so "
        "every step quantizes them again.",
    ] + ([""] + [f"Warning: {w}" for w in warned] if warned else [])
    return lines


def _fp8_hook_bytes_table(result) -> list[str]:
    """Bytes through a saved-tensor pack hook per layer call, bf16 vs each FP8 recipe."""
    hb = (result.get("fp8") or {}).get("hook_bytes")
    if not hb:
        return []
    s = hb["shape"]
    lines = [
        "",
        f"## FP8: bytes through a saved-tensor pack hook per layer call (E={s['E']}, hidden {s['hidden']}, "
        f"ffn {s['ffn']}, {s['tokens']} tokens)",
        "",
        "| impl | tensors packed | bytes packed | of which parameters | / bf16 fd | packed types |",
        "|---|---|---|---|---|---|",
    ]
    for k, v in hb["results"].items():
        if isinstance(v, dict):
            lines.append(
                f"| {k} | {v['hook_tensors']} | {v['hook_bytes']:,} | {v['param_bytes']:,} | "
                f"{v.get('/ bf16 fd', 'n/a')} | {', '.join(v['types'])} |"
            )
        else:
            lines.append(f"| {k} | {v} | | | | |")
    return lines


def _frozen_table(result) -> list[str]:
    """Backward ms with frozen weights and with an x without grad, vs trainable."""
    if not result.get("frozen"):
        return []
    lines = [
        "",
        "## Frozen experts: backward ms (forward not timed), and the ratio to trainable",
        "",
        "| E | hidden | ffn | tokens | impl | trainable | frozen weights | x without grad | frozen / trainable | "
        "x without grad / trainable |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["frozen"]:
        for name, v in r["results"].items():
            head = f"| {r['E']} | {r['hidden']} | {r['ffn']} | {r['tokens']} | {name} | "
            if isinstance(v, dict):
                ratios = [
                    _fmt(v[f"{c} / trainable"])
                    if _number(v.get(f"{c} / trainable")) is not None
                    else v.get(f"{c} / trainable", "n/a")
                    for c in FROZEN_CASES[1:]
                ]
                lines.append(
                    head + " | ".join(str(v.get(c, "n/a")) for c in FROZEN_CASES) + f" | {ratios[0]} | {ratios[1]} |"
                )
            else:
                lines.append(head + f"{v} | | | | |")
    lines += [
        "",
        "frozen weights: requires_grad=False on the weights, x requires grad (no wgrad GEMM); x without grad: "
        "trainable weights (no dgrad GEMM).",
    ]
    return lines


def _graphed_table(result) -> list[str]:
    """Eager vs CUDA-graph replay, ms per forward+backward."""
    if not result.get("graphed"):
        return []
    lines = [
        "",
        "## CUDA graphs: ms per forward+backward, eager vs graph replay (functional_dw.graphs.graph_step)",
        "",
        "| E | hidden | ffn | tokens | impl | eager ms | graph ms | graph / eager | graph TFLOP/s (fraction of peak) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["graphed"]:
        for name, v in r["results"].items():
            head = f"| {r['E']} | {r['hidden']} | {r['ffn']} | {r['tokens']} | {name} | "
            if not isinstance(v, dict):
                lines.append(head + f"{v} | | | |")
                continue
            g = v.get("graph")
            lines.append(
                head + f"{_ms(v.get('eager'))} | {_ms(g) if isinstance(g, dict) else g} | "
                f"{v.get('graph / eager', 'n/a')} | {_cell(g) if isinstance(g, dict) else 'n/a'} |"
            )
    lines += [
        "",
        "A replay includes copying the new x and dy into the graph's static inputs. Splits: a CUDA tensor on "
        "the grouped paths (read at each replay); a host list on the split paths (baked into the graph).",
    ]
    return lines


def _linear_table(result) -> list[str]:
    """Linear: fd (TE backend) vs te.Linear."""
    if not result.get("linear"):
        return []
    lines = [
        "",
        "## Linear: TFLOP/s (fraction of peak)",
        "",
        "| tokens | in | out | fd linear (te) | te.Linear | fd / te |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["linear"]:
        a, b = r["results"].get("fd linear (te)"), r["results"].get("te.Linear")
        ratio = _ratio(a, b, 3)
        lines.append(f"| {r['tokens']} | {r['in']} | {r['out']} | {_cell(a)} | {_cell(b)} | {ratio} |")
    return lines


def _host_table(result) -> list[str]:
    """Host microseconds per forward+backward at the launch-bound shape."""
    if not result.get("host"):
        return []
    lines = [
        "",
        "## Host time (launch-bound: E=8, 128x128, 64 tokens): microseconds per forward+backward",
        "",
        "| impl | issue us (host, before sync) | wall us (with the GPU) |",
        "|---|---|---|",
    ]
    for name, v in result["host"].items():
        lines.append(f"| {name} | {v['issue']} | {v['wall']} |" if isinstance(v, dict) else f"| {name} | {v} | |")
    lines += [
        "",
        "Minimum over interleaved blocks of 100 steps. fd te grouped/split and fd linear run through the "
        "fd.nn modules, as te.GroupedLinear and te.Linear do; fd auto on a stacked weight, as torch._grouped_mm. "
        "(graph): a CUDA-graph replay of that step, with its inputs copied in.",
    ]
    return lines


def _offload_table(result) -> list[str]:
    """Saved-tensor hook bytes, time under save_on_cpu, peak memory."""
    if not result.get("offload"):
        return []
    s = result["offload"]["shape"]
    lines = [
        "",
        f"## Saved-tensor hooks and memory (E={s['E']}, hidden {s['hidden']}, ffn {s['ffn']}, {s['tokens']} tokens, split path)",
        "",
        "| impl | tensors packed | bytes packed | fwd+bwd ms | under save_on_cpu(pin_memory) ms | peak memory MiB |",
        "|---|---|---|---|---|---|",
    ]
    for k, v in result["offload"]["results"].items():
        lines.append(
            f"| {k} | {v['hook_tensors']} | {v['hook_bytes']:,} | {v['ms']} | {v['ms_save_on_cpu']} | {v['peak_mem_bytes'] / 2**20:.0f} |"
        )
    return lines


def _dense_table(result) -> list[str]:
    """The dense bf16 GEMMs the peak is the highest of."""
    lines = [
        "",
        "## Dense bf16 GEMMs (the peak is the highest)",
        "",
        "| gemm | M | N | K | round | ms | TFLOP/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for d in result["dense_samples"]:
        lines.append(
            f"| {d['gemm']} | {d['M']} | {d['N']} | {d['K']} | {d['round']} | {d.get('ms', d.get('error'))} | {d.get('tflops', '')} |"
        )
    return lines
