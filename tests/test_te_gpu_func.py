"""torch.func and torch.compile on the TE backend (GPU; skips cleanly without CUDA or TE)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from support.compile_cases import GraphCounter

import functional_dw as fd

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("transformer_engine.pytorch")

E, K, N, SPLITS = 4, 128, 256, (96, 0, 160, 64)
T = sum(SPLITS)
BF16 = torch.bfloat16


def _data(seed=0, dtype=BF16):
    g = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: (torch.randn(*s, generator=g, device="cuda") / s[-1] ** 0.5).to(dtype)
    return r(T, K), [r(N, K) for _ in range(E)], [r(K, N) for _ in range(E)], r(E, N)


def _grouped_path_or_skip(path):
    """Skip the grouped case where TE cannot run it; fail there under FDW_EXPECT_GROUPED=1."""
    x, w1, _, _ = _data()
    why = path and fd.kernels.get_kernels("te", x).grouped_path_unsupported(x, w1)
    if why and os.environ.get("FDW_EXPECT_GROUPED") == "1":
        pytest.fail(f"FDW_EXPECT_GROUPED=1 but TE's grouped path cannot run: {why}")
    if why:
        pytest.skip(why)


def _mlp(path):
    def mlp(x, w1, w2, b1):
        h = fd.grouped_linear(x, w1, SPLITS, b1, use_grouped_tensor=path, backend="te")
        return fd.grouped_linear(F.gelu(h), w2, SPLITS, use_grouped_tensor=path, backend="te")

    return mlp


@pytest.mark.parametrize("path", [False, True], ids=["split", "grouped"])
def test_compile_fullgraph_on_te_matches_eager(path):
    _grouped_path_or_skip(path)
    torch._dynamo.reset()
    x, w1, w2, b1 = _data()
    args = [x.requires_grad_(), [w.requires_grad_() for w in w1], [w.requires_grad_() for w in w2], b1.requires_grad_()]
    leaves = [x, *w1, *w2, b1]
    mlp = _mlp(path)
    explained = torch._dynamo.explain(mlp)(*args)
    assert explained.graph_break_count == 0, explained.break_reasons
    counting = GraphCounter("inductor")
    y_c = torch.compile(mlp, fullgraph=True, backend=counting)(*args)
    kind = "grouped" if path else "split"  # TE's kernels, not the reference, ran in the graph
    assert "functional_dw.te_grouped_fprop.default" in counting.ops, counting.ops
    assert all(a[-1] == path for op, a in counting.calls if op == "functional_dw.te_grouped_fprop.default"), kind
    g_c = torch.autograd.grad(y_c.float().square().sum(), leaves)
    y_e = mlp(*args)
    g_e = torch.autograd.grad(y_e.float().square().sum(), leaves)
    torch.testing.assert_close(y_c, y_e)
    for a, b in zip(g_c, g_e):
        torch.testing.assert_close(a, b)


def test_opcheck_real_te_ops():
    from functional_dw.kernels import te_ops  # noqa: F401  (registers the ops)

    x, w1, _, b1 = _data()
    dy = torch.randn(T, N, device="cuda", dtype=BF16)
    sizes, sizes_dev = torch.tensor(SPLITS), torch.tensor(SPLITS, device="cuda")  # host-side or device splits
    ops = torch.ops.functional_dw
    checks = [
        (ops.te_fprop.default, (x, w1[0], b1[0])),
        (ops.te_dgrad.default, (dy, w1[0])),
        (ops.te_wgrad.default, (x, dy, True)),
        (ops.te_grouped_fprop.default, (x, w1, b1, sizes, False)),
        (ops.te_grouped_dgrad.default, (dy, w1, sizes_dev, False)),
        (ops.te_grouped_wgrad.default, (x, dy, sizes, False, True)),
        (
            ops.te_grouped_wgrad_into.default,
            ([torch.zeros(N, K, device="cuda") for _ in range(E)], x, dy, sizes, False, True, False),
        ),
    ]
    if not fd.kernels.get_kernels("te", x).grouped_path_unsupported(x, w1):
        checks += [
            (ops.te_grouped_fprop.default, (x, w1, b1, sizes_dev, True)),
            (ops.te_grouped_dgrad.default, (dy, w1, sizes, True)),
        ]
    for op, args in checks:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("path", [False, True], ids=["split", "grouped"])
def test_func_grad_and_vmap_on_te(path):
    _grouped_path_or_skip(path)
    x, w1, _, b1 = _data()
    f = lambda ws, x: fd.grouped_linear(x, ws, SPLITS, b1, use_grouped_tensor=path, backend="te").float().square().sum()
    got = torch.func.grad(f)(w1, x)
    leaves = [w.clone().requires_grad_() for w in w1]
    want = torch.autograd.grad(f(leaves, x), leaves)
    for a, b in zip(got, want):  # torch.func's backward runs on the reference kernels (see te.py)
        torch.testing.assert_close(a, b)
    xb = torch.stack([x, x.flip(0), 2 * x])
    y = torch.func.vmap(lambda x: fd.grouped_linear(x, w1, SPLITS, b1, use_grouped_tensor=path, backend="te"))(xb)
    loop = torch.stack([fd.grouped_linear(xe, w1, SPLITS, b1, use_grouped_tensor=path, backend="te") for xe in xb])
    torch.testing.assert_close(y, loop)
    per_example = torch.func.vmap(torch.func.grad(f), in_dims=(None, 0))(w1, xb)
    for e in range(E):
        torch.testing.assert_close(
            per_example[e], torch.stack([torch.func.grad(f)(w1, xe)[e] for xe in xb]), rtol=2e-2, atol=2e-2
        )


def test_jvp_on_te():
    x, w1, _, b1 = _data()
    tx, tw, _, tb = _data(seed=1)
    f = lambda x, ws, b: fd.grouped_linear(x, ws, SPLITS, b, backend="te")
    _, t_out = torch.func.jvp(f, (x, w1, b1), (tx, tw, tb))
    want = (
        fd.grouped_linear(tx, w1, SPLITS, tb, backend="te").float()
        + fd.grouped_linear(x, tw, SPLITS, backend="te").float()
    )
    torch.testing.assert_close(t_out.float(), want, rtol=2e-2, atol=2e-2)
