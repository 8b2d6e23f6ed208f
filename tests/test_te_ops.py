"""The TE custom ops' schemas and fake implementations, checked with torch.library.opcheck.

On a machine without TE the reference kernels stand in for TEKernels (the ops only forward
to them), so CI checks every schema, fake shape and mutation annotation; with TE installed the
real kernels run in tests/test_te_gpu.py instead.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from functional_dw.kernels import te_available
from functional_dw.kernels.torch_ref import TORCH

pytestmark = pytest.mark.skipif(te_available(), reason="TE is installed: the real ops are checked on the GPU")


@pytest.fixture(scope="module")
def ops():
    sys.modules.setdefault("functional_dw.kernels.te", types.SimpleNamespace(TE=TORCH))
    from functional_dw.kernels import te_ops

    return te_ops


def _cases():
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)
    T, K, N, E = 7, 16, 8, 3
    x, dy, w, b = r(T, K), r(T, N), r(N, K), r(N)
    ws, w3, b2 = [r(N, K) for _ in range(E)], r(E, N, K), r(E, N)
    sizes = torch.tensor([2, 0, 5])  # the splits as the ops take them: one int tensor
    return [
        ("te_fprop", (x, w, b)),
        ("te_fprop", (x, w, None)),
        ("te_dgrad", (dy, w)),
        ("te_wgrad", (x, dy, True)),
        ("te_wgrad", (x, dy, False)),
        ("te_wgrad_into", (torch.zeros(N, K), x, dy, True, True)),
        ("te_grouped_fprop", (x, ws, b2, sizes, False)),
        ("te_grouped_fprop", (x, [w3], None, sizes, True)),
        ("te_grouped_dgrad", (dy, ws, sizes, False)),
        ("te_grouped_dgrad", (dy, [w3], sizes, True)),
        ("te_grouped_wgrad", (x, dy, sizes, True, True)),
        ("te_grouped_wgrad_into", ([torch.zeros(N, K) for _ in range(E)], x, dy, sizes, False, True, True)),
        ("te_grouped_wgrad_into", ([torch.zeros(E, N, K)], x, dy, sizes, True, False, False)),
        ("ref_split_fprop", (x, ws, b2, sizes)),
        ("ref_split_fprop", (x, [w3], None, sizes)),
        ("ref_split_dgrad", (dy, ws, sizes)),
        ("ref_split_wgrad", (x, dy, sizes)),
    ]


@pytest.mark.parametrize("i", range(17))
def test_opcheck(ops, i):
    name, args = _cases()[i]
    op = getattr(torch.ops.functional_dw, name).default
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))


def test_traced_kernels_match_reference(ops):
    x, w, b = torch.randn(5, 16), torch.randn(8, 16), torch.randn(8)
    k = ops.TRACED_TE
    torch.testing.assert_close(k.fprop(x, w, b), TORCH.fprop(x, w, b))
    dy = torch.randn(5, 8)
    dw, db = k.wgrad(x, dy, with_dbias=True)
    dw_r, db_r = TORCH.wgrad(x, dy, with_dbias=True)
    torch.testing.assert_close(dw, dw_r)
    torch.testing.assert_close(db, db_r)


@pytest.mark.parametrize(
    "dtype,path,form,dynamic",
    [(torch.bfloat16, True, "list", None), (torch.float32, False, "tensor", True)],
    ids=["bf16-grouped-list-dynNone", "fp32-split-tensor-dynTrue"],
)
def test_traced_kernels_compile_once_for_every_routing(ops, dtype, path, form, dynamic):
    """The TE ops' plumbing under torch.compile (splits tensor, Splits.in_op, fake shapes with
    symbolic sizes), with the reference standing in for TE: one graph for ten routings (two for
    a list with dynamic=None), the te_* ops in it, eager numerics (see tests/test_compile_gpu.py
    for the real kernels)."""
    from support.compile_cases import check_routings, make_model, max_graphs

    model = make_model("layer", dtype, "cpu", path, True, ops.TRACED_TE)
    counter = check_routings(model, form, dynamic, "cpu")
    assert counter.graphs <= max_graphs(form, dynamic)
    assert {f"functional_dw.te_grouped_{m}.default" for m in ("fprop", "dgrad", "wgrad")} <= counter.ops
    assert all(args[-1] == path for op, args in counter.calls if op == "functional_dw.te_grouped_fprop.default")
