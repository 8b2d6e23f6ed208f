"""Probe 19: a hostile user's findings after issues 17 and 18 (custom_vjp's view-free outputs,
device splits). Each test asserts the right behaviour."""

from __future__ import annotations

import pytest
import torch

import functional_dw as fd
from functional_dw.kernels import Splits


# --- custom_vjp: outputs that share storage keep torch's view rule ----------------------------------


def _double_fwd(x):
    y = x * 2
    return (y, y[0]), None


def _double_bwd(res, g):
    gy, gv = g
    gx = gy * 2
    if gv is not None:
        gx = gx.clone()
        gx[0] += gv * 2
    return (gx,)


def _two_views_fwd(x):
    buf = x * 2
    return (buf.view(-1), buf.view(x.shape)), None


def _two_views_bwd(res, g):
    ga, gb = g
    out = torch.zeros_like(gb) if gb is not None else torch.zeros_like(ga).view(-1, 3)
    if ga is not None:
        out = out + 2 * ga.view(out.shape)
    if gb is not None:
        out = out + 2 * gb
    return (out,)


@pytest.mark.parametrize("case", ["output_and_its_view", "two_views_of_one_buffer"])
def test_in_place_on_an_output_sharing_storage_is_never_silently_wrong(case):
    # 3e85913 handed out every view of an fwd-made tensor detached; for (y, y[0]) that made y[0]
    # a tensor of its own on y's storage: y[0].mul_(3) changed y's value but not its gradient,
    # so x.grad came out silently wrong. Now such outputs keep torch's rule: the in-place op
    # either raises or gives plain torch's gradient.
    fwd, bwd = {"output_and_its_view": (_double_fwd, _double_bwd),
                "two_views_of_one_buffer": (_two_views_fwd, _two_views_bwd)}[case]
    f = fd.custom_vjp(fwd, bwd)
    x = torch.randn(2, 3, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)

    a_ref, b_ref = fwd(x_ref)[0]
    b_ref.mul_(3)
    (a_ref.sum() * 1.5 + b_ref.sum()).backward()

    a, b = f(x)
    try:
        b.mul_(3)
    except RuntimeError as e:  # torch's rule for a view of a Function's output
        assert "view" in str(e).lower() and "inplace" in str(e).replace("-", "").replace(" ", "").lower()
        return
    (a.sum() * 1.5 + b.sum()).backward()
    torch.testing.assert_close(x.grad, x_ref.grad)


def test_a_lone_view_of_an_fwd_tensor_is_still_modifiable_in_place():
    # the case 3e85913 was for: Linear's reshape of its GEMM output, then y += r
    x = torch.randn(2, 4, 8, requires_grad=True)
    w = torch.randn(5, 8, requires_grad=True)
    y = fd.linear(x, w)
    y += 1.0
    y.sum().backward()
    torch.testing.assert_close(w.grad, x.detach().reshape(-1, 8).sum(0).expand(5, 8))


# --- device splits: counts near int64's limit ---------------------------------------------------------


@pytest.mark.parametrize("sizes,T,ends", [([2**62, 2**62, 5], 10, [10, 10, 10]),
                                          ([3, 2**63 - 1, 2**63 - 1, 1], 9, [3, 9, 9, 9]),
                                          ([-(2**63), 2**62, 2**62], 4, [0, 4, 4])])
@pytest.mark.parametrize("compiled", [False, True])
def test_device_counts_near_int64s_limit_do_not_wrap(sizes, T, ends, compiled):
    # the running sum of counts such as 2**62 + 2**62 wrapped negative, the clamp kept it, and
    # the "memory-safe" ends went backwards (a negative count, rows read out of order)
    def run(t):
        s = Splits(host=None, tensor=t, device=torch.device("cpu"), num_tokens=T, num_experts=len(sizes))
        return s.ends(torch.int32), s.ends(torch.int64), s.on_device()

    if compiled:
        run = torch.compile(run, backend="aot_eager", fullgraph=True)
    e32, e64, counts = run(torch.tensor(sizes, dtype=torch.int64))
    assert e32.tolist() == ends and e64.tolist() == ends
    assert counts.tolist() == [b - a for a, b in zip([0] + ends[:-1], ends)]


def test_huge_host_readable_counts_are_refused_with_their_sum():
    # CPU split tensors are read on the host and validated: a clear error, not a wrapped sum
    x, ws = torch.randn(10, 8), [torch.randn(4, 8) for _ in range(3)]
    with pytest.raises(ValueError, match="must sum to x.shape"):
        fd.grouped_linear(x, ws, torch.tensor([2**62, 2**62, 5]))


# --- the rowwise kernels' launch config -------------------------------------------------------------


@pytest.mark.parametrize("rb,bt", [(24, 16), (16, 32)])
def test_a_launch_config_whose_row_block_is_not_a_multiple_of_its_step_is_refused(rb, bt, monkeypatch):
    # probe 20: with RB % BT != 0 the amax kernel's loop read rows of the next block while its
    # one-expert test covered only its own, so the next expert's values went into this expert's
    # column amax (wrong columnwise scales and data, silently). The shipped config is fine.
    pytest.importorskip("triton")
    from functional_dw.fp8 import rowwise as rw
    from functional_dw.kernels import triton_rowwise as tr

    monkeypatch.setitem(tr.CONFIG, "RB", rb)
    monkeypatch.setitem(tr.CONFIG, "BT", bt)
    sizes = torch.tensor([48, 16])
    spec = fd.fp8.tensor_spec(fd.fp8.RowwiseScaling(), "input")
    with pytest.raises(ValueError, match="RB .* must be a multiple of BT"):
        tr.quantize_activation(torch.ones(64, 16, dtype=torch.bfloat16), sizes.cumsum(0).to(torch.int32),
                               rw.padded_ends(sizes), spec, rowwise=True, columnwise=True)
