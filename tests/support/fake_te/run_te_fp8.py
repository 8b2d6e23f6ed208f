"""te_fp8 on the fake TE (see transformer_engine/__init__.py), on the CPU: every recipe, Linear
and both grouped paths, against fp8's emulation; run in a subprocess by tests/test_te_fp8_fake.py."""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))  # the checkout: tests/support/fake_te/../../..
sys.path[:0] = [HERE, ROOT]

import torch  # noqa: E402
import torch.utils._pytree as pytree  # noqa: E402
import transformer_engine_torch as tex  # noqa: E402

from functional_dw import fp8  # noqa: E402
from functional_dw.kernels import Splits  # noqa: E402
from functional_dw.kernels import te as te_mod  # noqa: E402
from functional_dw.kernels import te_fp8, te_fp8_gemm  # noqa: E402

assert te_mod.__file__.startswith(ROOT), "not this checkout's functional_dw"
TE = te_fp8_gemm.TE_FP8  # TE's FP8 kernels (the family's on backend="te")
te_mod.prepare = te_fp8_gemm.prepare = lambda *a, **k: None  # no CUDA workspaces
te_fp8._env = lambda t: ((9, 0), 131000, (12, 9))  # an H200, for CPU tensors
te_mod.te_env = te_fp8_gemm.te_env = lambda i: ((9, 0), 131000)
torch.manual_seed(0)
DT, FAILED = torch.bfloat16, []


def deq(q, cw=None):
    return q.dequantize(torch.float32, columnwise=cw)


def close(a, b, what, tol=2e-2):
    err = (a.float() - b.float()).abs().max().item() if a.numel() else 0.0
    if err > tol * max(b.float().abs().max().item() if b.numel() else 1.0, 1e-3):
        FAILED.append(f"{what}: err {err:.3g}")


def roundtrip(q):
    leaves, spec = pytree.tree_flatten(q)
    return pytree.tree_unflatten([t.clone() for t in leaves], spec)


for name, recipe in [
    ("delayed", fp8.DelayedScaling(amax_history_len=4)),
    ("current", fp8.Float8CurrentScaling()),
    ("block", fp8.Float8BlockScaling()),
]:
    sx, sw, sdy = (fp8.tensor_spec(recipe, r) for r in fp8.ROLES)
    acc = fp8.split_accumulator(recipe)
    d = name == "delayed"
    T, K, N = 32, 64, 48
    x, w, b, dy = (
        torch.randn(T, K).to(DT),
        (torch.randn(N, K) * 0.1).to(DT),
        torch.randn(N).to(DT),
        torch.randn(T, N).to(DT),
    )
    st = fp8.init_state(recipe, 1) if d else None
    view = lambda role: (
        dict(scale=fp8.scale_for(st, role), amax=getattr(st, "amax_history_" + fp8.slot(role)[0])[0, fp8.slot(role)[1]])
        if d
        else {}
    )  # noqa: E731
    xq = TE.quantize(x, sx, rowwise=True, columnwise=True, **view("input"))
    wq = TE.quantize(w, sw, rowwise=True, columnwise=False, **view("weight"))
    y = TE.fprop(xq, wq, b, split_accumulator=acc.fprop)
    rx = fp8.quantize(x, sx, scale=fp8.scale_for(st, "input") if d else None, columnwise=True)
    rw = fp8.quantize(w, sw, scale=fp8.scale_for(st, "weight") if d else None)
    close(y, deq(rx) @ deq(rw).t() + b.float(), f"{name} linear y")
    if d and not (
        st.amax_history_fwd[0, 0] == x.float().abs().max() and st.amax_history_fwd[0, 1] == w.float().abs().max()
    ):
        FAILED.append(f"delayed: amaxes not recorded into the state: {st.amax_history_fwd[0]}")
    saved = roundtrip(xq.with_usage(rowwise=False, columnwise=True))
    wb = TE.quantize(w, sw, rowwise=False, columnwise=True, **({"scale": fp8.scale_for(st, "weight")} if d else {}))
    for at_quantize in (True, False):  # dbias from quantization, or recomputed for wgrad(with_dbias=True)
        dyq = TE.quantize(dy, sdy, rowwise=True, columnwise=True, with_dbias=at_quantize, **view("grad_output"))
        rdy = fp8.quantize(dy, sdy, scale=fp8.scale_for(st, "grad_output") if d else None, columnwise=True)
        close(TE.dgrad(dyq, wb, split_accumulator=acc.dgrad), deq(rdy) @ deq(rw), f"{name} linear dx")
        mg = torch.zeros(N, K)
        dw, db = TE.wgrad(saved, dyq, out=mg, accumulate=True, with_dbias=True, split_accumulator=acc.wgrad)
        close(mg, deq(rdy, True).t() @ deq(rx, True), f"{name} linear main_grad")
        close(db, dy.float().sum(0), f"{name} linear db")
    E, sizes = 4, [16, 0, 32, 16]
    x, dy = torch.randn(sum(sizes), K).to(DT), torch.randn(sum(sizes), N).to(DT)
    W, B = (torch.randn(E, N, K) * 0.1).to(DT), torch.randn(E, N).to(DT)
    for grouped in [False] if d else [False, True]:
        what = f"{name} {'grouped' if grouped else 'split'}"
        sp = Splits(
            host=None if grouped else tuple(sizes),
            tensor=torch.tensor(sizes) if grouped else None,
            device=x.device,
            num_tokens=sum(sizes),
            num_experts=E,
        )
        st = fp8.init_state(recipe, E) if d else None

        def gview(role):
            if not d:
                return {}
            side, col = fp8.slot(role, 0)
            row = getattr(st, "amax_history_" + side)[0]
            return dict(scales=fp8.group_scales(st, role), amaxes=row[col :: 3 if side == "fwd" else 2])

        xq = TE.grouped_quantize(x, sp, sx, rowwise=True, columnwise=True, grouped=grouped, **gview("input"))
        if xq.is_grouped != grouped:
            FAILED.append(f"{what}: quantized for the wrong path")
        wq = [
            TE.quantize(
                W[e],
                sw,
                **({} if not d else dict(scale=fp8.scale_for(st, "weight", e), amax=st.amax_history_fwd[0, 3 * e + 1])),
            )
            for e in range(E)
        ]
        y = TE.grouped_fprop(xq, wq, B, sp, grouped, split_accumulator=acc.fprop)
        rxs = fp8.quantize_groups(x, sizes, sx, scales=fp8.group_scales(st, "input") if d else None, columnwise=True)
        rws = [fp8.quantize(W[e], sw, scale=fp8.scale_for(st, "weight", e) if d else None) for e in range(E)]
        close(y, torch.cat([deq(rxs[e]) @ deq(rws[e]).t() + B[e].float() for e in range(E)]), f"{what} y")
        saved = roundtrip(xq.with_usage(rowwise=False, columnwise=True))
        wb = [
            TE.quantize(
                W[e], sw, rowwise=False, columnwise=True, **({"scale": fp8.scale_for(st, "weight", e)} if d else {})
            )
            for e in range(E)
        ]
        for at_quantize in (True, False):
            dyq = TE.grouped_quantize(
                dy,
                sp,
                sdy,
                rowwise=True,
                columnwise=True,
                grouped=grouped,
                with_dbias=at_quantize,
                **gview("grad_output"),
            )
            rdys = fp8.quantize_groups(
                dy, sizes, sdy, scales=fp8.group_scales(st, "grad_output") if d else None, columnwise=True
            )
            close(
                TE.grouped_dgrad(dyq, wb, sp, grouped, split_accumulator=acc.dgrad),
                torch.cat([deq(rdys[e]) @ deq(rws[e]) for e in range(E)]),
                f"{what} dx",
            )
            for fused in (False, True):
                mgs = [torch.zeros(N, K) for _ in range(E)] if fused else None
                dw, db = TE.grouped_wgrad(
                    saved, dyq, sp, grouped, out=mgs, accumulate=fused, with_dbias=True, split_accumulator=acc.wgrad
                )
                want = torch.stack(
                    [deq(rdys[e], True).t() @ deq(rxs[e], True) if sizes[e] else torch.zeros(N, K) for e in range(E)]
                )
                close(torch.stack(list(dw)), want, f"{what} dw fused={fused}")
                close(db, torch.stack([p.float().sum(0) for p in dy.split(sizes)]), f"{what} db")

seen = {c[0] for c in tex.CALLS}
want = {
    "quantize",
    "split_quantize",
    "bgrad_quantize",
    "group_quantize",
    "bgrad_group_quantize",
    "general_gemm",
    "general_grouped_gemm",
    "grouped_tensor_gemm",
}
if seen != want:
    FAILED.append(f"TE entry points called: {sorted(seen)}, expected {sorted(want)}")
print("\n".join(FAILED) if FAILED else "ok")
sys.exit(1 if FAILED else 0)
