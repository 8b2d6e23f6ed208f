"""bench.py's fp8 section: GroupedLinear forward+backward under FP8 recipes, and the bytes they save.

* TE's Hopper recipes (``FP8_CONFIGS``: delayed scaling on the split path, current and block
  scaling on both paths), fd (``fd.grouped_linear(..., recipe=, backend="te")``) vs
  te.GroupedLinear with the same recipe, path and weights under TE's autocast (``_te_autocast``);
* next to them (``FP8_OTHERS``): fd's own RowwiseScaling (weights unchanged, and updated in place
  after each step), the best bf16 rows, torchao's FP8 rowwise grouped GEMM (``_torchao_gmm``);
* :func:`fp8_hook_bytes`: bytes through a saved-tensor pack hook per layer call, bf16 vs each recipe;
* :func:`fp8_rows`: the section (shapes by ``--quick``/``--smoke``, rows by ``--fp8-configs``).

moe_layer.py imports ``_te_autocast`` and ``_torchao_gmm`` (through bench).
"""

from __future__ import annotations

import warnings

import torch

import functional_dw as fd

import bench_timing
from bench_contenders import Layer, make_inputs, make_splits, reason
from bench_timing import BF16, cuda_times, ms_tflops


FP8_CONFIGS = [("delayed", False), ("current", False), ("current", True), ("block", False), ("block", True)]
FP8_TE_CLASSES = {"delayed": "DelayedScaling", "current": "Float8CurrentScaling", "block": "Float8BlockScaling"}
FP8_OTHERS = ["fd rowwise", "fd rowwise new weights", "bf16 fd auto", "bf16 te grouped", "torchao fp8 rowwise"]
FP8_SPLITS = ("balanced", "zipf")
FP8_HOOK_SHAPE = (8, 2048, 2048, 8192)


def fp8_tag(kind, grouped):
    return f"{kind} {'grouped' if grouped else 'split'}"


def fp8_configs(args) -> list:
    """The (recipe, grouped) rows of FP8_CONFIGS that ``--fp8-configs`` names (all by default)."""
    only = {c.strip() for c in args.fp8_configs.split(",") if c.strip()}
    return [(kind, grouped) for kind, grouped in FP8_CONFIGS if not only or fp8_tag(kind, grouped) in only]


def fp8_shapes(args):
    if args.smoke:
        return [(2, 128, 128, 256)]  # 128 tokens per expert: block scaling's grouped path
    if args.quick:
        return [FP8_HOOK_SHAPE, (32, 4096, 1536, 32768)]
    return [FP8_HOOK_SHAPE, (32, 4096, 1536, 32768), (128, 4096, 1536, 65536), (8, 4096, 4096, 65536)]


def fp8_splits(E, T, kind):
    """balanced, or zipf rounded to multiples of 128 tokens per expert (what TE's grouped block
    scaling takes; every FP8 path here runs them), summing to T."""
    if kind == "balanced":
        return make_splits(E, T, kind)
    raw = make_splits(E, T, kind)
    counts = [c // 128 * 128 for c in raw]
    hot = max(range(E), key=lambda e: raw[e])
    counts[hot] += T - sum(counts)
    return counts


def _te_autocast(te, recipe):
    """TE 2.x's ``te.autocast(enabled=True, recipe=)``; older TE's ``fp8_autocast``."""
    if hasattr(te, "autocast"):
        try:
            return te.autocast(enabled=True, recipe=recipe)
        except TypeError:
            pass
    return te.fp8_autocast(enabled=True, fp8_recipe=recipe)


def _torchao_gmm():
    """torchao's FP8 rowwise grouped GEMM (``_to_fp8_rowwise_then_scaled_grouped_mm(A [M, K],
    B_t [E, K, N] column-major, offs int32 group ends)``), or why not."""
    try:
        from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm as f

        return f
    except Exception as e:  # noqa: BLE001
        return f"n/a: torchao not importable ({str(e).splitlines()[0][:80] if str(e) else type(e).__name__})"


def fp8_impls(layer: Layer, te, configs) -> dict:
    """name -> (forward(x) -> y, params, after_step or None), or the reason it cannot run. fd:
    fd.grouped_linear on the E weights of an fd.nn.GroupedLinear (backend te), delayed scaling's
    state updated after each step (fp8.update_state_); TE: te.GroupedLinear with the same weights
    under TE's autocast with the same recipe (TE updates its state itself); one fd and one TE row
    per (recipe, grouped) in ``configs`` (:func:`fp8_configs`), then the rows of FP8_OTHERS."""
    from functional_dw import fp8

    out = {}
    ws = layer.mod.weights()
    rowwise = fp8.RowwiseScaling(
        bf16_below=0
    )  # FP8 at every size (the row means FP8); (its own name: the loop below rebinds r, which a lambda reading
    # r would see: with TE installed, "fd rowwise" then ran the last TE recipe)
    out["fd rowwise"] = ((lambda x: fd.grouped_linear(x, ws, layer.splits_dev, recipe=rowwise)), ws, None)

    def bump():  # what an optimizer step does to the weights (an in-place update, here of +0): their
        with torch.no_grad():  # versions change, so the next step quantizes them again
            for w in ws:
                w.add_(0)

    out["fd rowwise new weights"] = ((lambda x: fd.grouped_linear(x, ws, layer.splits_dev, recipe=rowwise)), ws, bump)
    for kind, grouped in configs:
        tag, arg = fp8_tag(kind, grouped), layer.split_arg(grouped)
        if te is None:
            out[f"fd {tag}"] = out[f"te {tag}"] = "n/a: Transformer Engine is not installed"
            continue
        try:
            r = {"delayed": fp8.DelayedScaling, "current": fp8.Float8CurrentScaling, "block": fp8.Float8BlockScaling}[
                kind
            ]()
            state = fp8.init_state(r, num_gemms=layer.E, device=bench_timing.DEV) if kind == "delayed" else None
            out[f"fd {tag}"] = (
                (
                    lambda x, r=r, state=state, arg=arg, grouped=grouped: fd.grouped_linear(
                        x, ws, arg, backend="te", use_grouped_tensor=grouped, recipe=r, fp8_state=state
                    )
                ),
                ws,
                (lambda r=r, state=state: fp8.update_state_(state, r)) if state is not None else None,
            )
        except Exception as e:  # noqa: BLE001
            out[f"fd {tag}"] = reason(e)
        try:
            from transformer_engine.common import recipe as te_recipes

            tr = getattr(te_recipes, FP8_TE_CLASSES[kind])()
            m = layer._te_module(grouped, trainable=True)
            if isinstance(m, str):
                out[f"te {tag}"] = m
                continue

            def te_fwd(x, m=m, tr=tr, arg=arg):
                with _te_autocast(te, tr):
                    return m(x, arg)

            out[f"te {tag}"] = (te_fwd, list(m.parameters()), None)
        except Exception as e:  # noqa: BLE001
            out[f"te {tag}"] = reason(e)
    fwd, params = layer.fd_forward("auto", None, "list")
    out["bf16 fd auto"] = (fwd, params, None)
    m = layer.te_mods[True]
    out["bf16 te grouped"] = (
        m if isinstance(m, str) else ((lambda x, m=m: m(x, layer.splits_dev)), list(m.parameters()), None)
    )
    f = _torchao_gmm()
    if isinstance(f, str):
        out["torchao fp8 rowwise"] = f
    else:
        import inspect

        try:
            kw = (
                {"pad_token_groups_for_grouped_mm": False}
                if "pad_token_groups_for_grouped_mm" in inspect.signature(f).parameters
                else {}
            )
        except (TypeError, ValueError):
            kw = {}
        w = layer.w_ENK  # B_t = w^T: [E, K, N] with strides (N*K, 1, K), the column-major layout torchao asks for
        out["torchao fp8 rowwise"] = (
            (lambda x: f(x, w.transpose(-2, -1), layer.offs, out_dtype=BF16, **kw)),
            [w],
            None,
        )
    return out


def fp8_step(fwd, params, after):
    def step(inp):
        x, dy = inp
        g = torch.autograd.grad(fwd(x), [x, *params], dy)
        if after is not None:
            after()
        return g

    return step


def _packed_bytes(t) -> int:
    """Bytes of one packed tensor; a quantized tensor subclass (TE's Float8Tensor...) counts its
    data and scales, not its nominal dtype."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        inner = [
            getattr(t, a, None)
            for a in (
                "_data",
                "_transpose",
                "_rowwise_data",
                "_columnwise_data",
                "_scale_inv",
                "_rowwise_scale_inv",
                "_columnwise_scale_inv",
            )
        ]
        inner = [u for u in inner if isinstance(u, torch.Tensor)]
        if inner:
            return sum(u.numel() * u.element_size() for u in inner)
    return t.numel() * t.element_size()


class Fp8PackCounter:
    def __init__(self):
        self.count, self.bytes, self.param_bytes, self.types = 0, 0, 0, set()

    def pack(self, t):
        n = _packed_bytes(t)
        self.count += 1
        self.bytes += n
        self.types.add(type(t).__name__)
        if isinstance(t, torch.nn.Parameter):
            self.param_bytes += n
        return t

    def unpack(self, t):
        return t


def fp8_hook_bytes(layer: Layer, impls: dict, inputs) -> dict:
    """Bytes through a saved-tensor pack hook for one forward (then backward) per implementation."""
    out = {}
    cases = {
        "bf16 fd te split": (
            (lambda x: fd.grouped_linear(x, layer.mod.weights(), layer.splits, backend="te", use_grouped_tensor=False)),
            layer.mod.weights(),
            None,
        )
    }
    m = layer.te_mods[False]
    cases["bf16 te split"] = m if isinstance(m, str) else ((lambda x: m(x, layer.splits)), list(m.parameters()), None)
    cases |= {n: v for n, v in impls.items() if n.startswith(("fd ", "te "))}
    x, dy = inputs[0]
    for name, impl in cases.items():
        if isinstance(impl, str):
            out[name] = impl
            continue
        fwd, params, after = impl
        try:
            c = Fp8PackCounter()
            with torch.autograd.graph.saved_tensors_hooks(c.pack, c.unpack):
                y = fwd(x)
            torch.autograd.grad(y, [x, *params], dy)
            if after is not None:
                after()
            out[name] = {
                "hook_tensors": c.count,
                "hook_bytes": c.bytes,
                "param_bytes": c.param_bytes,
                "types": sorted(c.types),
            }
        except Exception as e:  # noqa: BLE001
            out[name] = reason(e)
    base = out.get("bf16 fd te split")
    for v in out.values():
        if isinstance(v, dict) and isinstance(base, dict) and base["hook_bytes"]:
            v["/ bf16 fd"] = round(v["hook_bytes"] / base["hook_bytes"], 3)
    print("fp8 hook bytes", out, flush=True)
    return out


def _fd_path(layer, kind, grouped):
    """The path fd.grouped_linear takes for this recipe (grouped, or split when it falls back)."""
    from functional_dw import fp8

    try:
        r = {"delayed": fp8.DelayedScaling, "current": fp8.Float8CurrentScaling, "block": fp8.Float8BlockScaling}[
            kind
        ]()
        st = fp8.init_state(r, num_gemms=layer.E, device=bench_timing.DEV) if kind == "delayed" else None
        x = torch.zeros(layer.T, layer.H, device=bench_timing.DEV, dtype=BF16)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return fd.grouped_linear_fwd(
                x,
                layer.mod.weights(),
                layer.split_arg(grouped),
                backend="te",
                use_grouped_tensor=grouped,
                recipe=r,
                fp8_state=st,
            )[1].path
    except Exception as e:  # noqa: BLE001
        return reason(e)


def fp8_rows(args, te, clock):
    """Forward+backward of one grouped layer under each FP8 recipe and path, fd vs te.GroupedLinear
    with the same recipe, path and weights; the best bf16 rows and torchao's FP8 rowwise grouped
    GEMM next to them; balanced splits (multiples of 128 tokens per expert); and the bytes through
    a saved-tensor hook at one shape."""
    rows, hooks, configs = [], None, fp8_configs(args)
    for (E, H, FF, T), kind in [
        (shape, k) for shape in fp8_shapes(args) for k in (FP8_SPLITS if not args.smoke else ("balanced",))
    ]:
        if clock.over():
            clock.skipped.append(f"fp8 E={E} hidden={H} ffn={FF} tokens={T} {kind}")
            continue
        splits = fp8_splits(E, T, kind)
        assert all(s % 128 == 0 for s in splits), splits
        layer = Layer(E, H, FF, splits, te)
        inputs = make_inputs(T, H, FF)
        flops = 3 * 2 * T * H * FF
        impls = fp8_impls(layer, te, configs)
        if hooks is None and ((E, H, FF, T) == FP8_HOOK_SHAPE or args.smoke):
            hooks = {
                "shape": {"E": E, "hidden": H, "ffn": FF, "tokens": T},
                "results": fp8_hook_bytes(layer, impls, inputs),
            }
            clock.save("fp8", {"rows": rows, "hook_bytes": hooks})
        res, steps = {}, {}
        for name, impl in impls.items():
            if isinstance(impl, str):
                res[name] = impl
                continue
            step = fp8_step(*impl)
            try:  # runs at all (and delayed scaling's warm-up: a few steps with state updates)
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    for i in range(3 if "delayed" in name else 1):
                        step(inputs[i % len(inputs)])
                steps[name] = step
                if caught:
                    res[f"{name} warning"] = str(caught[0].message)[:200]
            except Exception as e:  # noqa: BLE001
                print(f"fp8 {name} at E={E} hidden={H} ffn={FF} tokens={T}: {e}", flush=True)
                res[name] = reason(e)
        try:
            timed = cuda_times(steps, inputs, repeats=args.repeats)
        except Exception as e:  # noqa: BLE001  (one implementation failing mid-timing: time the rest one by one)
            timed = {}
            for name, step in steps.items():
                try:
                    timed |= cuda_times({name: step}, inputs, repeats=args.repeats)
                except Exception as e2:  # noqa: BLE001
                    res[name] = reason(e2)
            print("fp8 interleaved timing failed, timed one by one:", e, flush=True)
        for name, ms in timed.items():
            res[name] = ms_tflops(flops, ms)
        res["fd path"] = {fp8_tag(k, g): _fd_path(layer, k, g) for k, g in configs} if te is not None else {}
        rows.append({"E": E, "hidden": H, "ffn": FF, "tokens": T, "splits": kind, "results": res})
        clock.save("fp8", {"rows": rows, "hook_bytes": hooks})
        print(
            "fp8",
            E,
            H,
            FF,
            T,
            {k: (v["tflops"] if isinstance(v, dict) and "tflops" in v else v) for k, v in res.items()},
            flush=True,
        )
        del layer, inputs, impls, steps
        torch.cuda.empty_cache()
    return {"rows": rows, "hook_bytes": hooks}
