"""Probe 17: a hostile user's findings on the C-loop fast paths (_check_weights,
check_materialized, packed) and te_fp8's direct tex.quantize. Each test asserts the right
behaviour."""

from __future__ import annotations

import pytest
import torch

import functional_dw as fd
from functional_dw.distributed_weight import check_materialized
from functional_dw.kernels import packed

pytestmark = pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")


class _Logged(torch.Tensor):
    """A tensor subclass with storage whose __torch_function__ sees every op on it."""

    seen: list = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.seen.append(func)
        return super().__torch_function__(func, types, args, kwargs or {})


def test_packed_refuses_a_subclass_at_any_position():
    # Only ts[0]'s type was checked: [plain, Sub, plain] slices of one buffer were viewed as one
    # plain tensor (the subclass silently dropped) while [Sub, plain, plain] was stacked through
    # the subclass's __torch_function__: the result depended on where the subclass sat.
    buf = torch.randn(3, 4, 5)
    with torch.no_grad():
        assert packed([buf[0].as_subclass(_Logged), buf[1], buf[2]]) is None
        assert packed([buf[0], buf[1].as_subclass(_Logged), buf[2]]) is None
        assert packed([buf[0], buf[1], buf[2]]) is not None


def test_grouped_linear_subclass_weight_keeps_its_semantics_wherever_it_sits():
    buf, x = torch.randn(3, 4, 5), torch.randn(6, 5)
    kinds = []
    for ws in ([buf[0].as_subclass(_Logged), buf[1], buf[2]], [buf[0], buf[1].as_subclass(_Logged), buf[2]]):
        with torch.no_grad():
            kinds.append(type(fd.grouped_linear(x, ws, [2, 2, 2], backend="torch")))
    assert kinds[0] is kinds[1], kinds


def test_packed_non_tensor_in_the_tail_is_not_a_buffer_under_grad_mode_too():
    buf = torch.randn(2, 3)
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            assert packed([buf[0], None]) is None
            assert packed([buf[0], 7]) is None


@pytest.mark.parametrize("pos", [0, 1])
def test_a_nested_weight_is_named(pos):
    # A strided nested tensor has layout torch.strided and no .shape: the fast path (and the
    # slow one) died in torch with "Internal error: NestedTensorImpl doesn't support sizes"
    nt = torch.nested.nested_tensor([torch.randn(5), torch.randn(5)])  # dim() == 2
    ws = [torch.randn(4, 5), torch.randn(4, 5)]
    ws[pos] = nt
    with pytest.raises(TypeError, match=rf"weights\[{pos}\] must be a dense .*nested"):
        fd.grouped_linear(torch.randn(4, 5), ws, [2, 2])


def test_a_nested_x_or_stacked_weight_is_named():
    nt3 = torch.nested.nested_tensor([torch.randn(4, 5), torch.randn(4, 5)])
    with pytest.raises(TypeError, match=r"^weights must be a dense .*nested"):
        fd.grouped_linear(torch.randn(4, 5), nt3, [2, 2])
    nt2 = torch.nested.nested_tensor([torch.randn(5), torch.randn(5)])
    with pytest.raises(TypeError, match=r"^x must be a dense .*nested"):
        fd.grouped_linear(nt2, [torch.randn(4, 5)] * 2, [1, 1])


def test_check_materialized_names_a_nested_weight():
    nt = torch.nested.nested_tensor([torch.randn(5), torch.randn(5)])
    with pytest.raises(ValueError, match=r"returned a nested tensor for weight 1, expected \(2, 5\)"):
        check_materialized([torch.randn(2, 5), nt], [(2, 5), (2, 5)], "materialize_group_for_backward()")


def test_fast_paths_agree_with_the_loops_on_hostile_lists():
    # equivalence of the C-loop checks with the per-expert loops they replaced (errors name the expert)
    x = torch.randn(4, 3)
    P = torch.nn.Parameter
    cases = {
        "dtype": ([torch.randn(5, 3), torch.randn(5, 3, dtype=torch.float64)], TypeError, r"weights\[1\] has dtype"),
        "shape": ([torch.randn(5, 3), torch.randn(6, 3)], ValueError, r"weights\[1\] is \(6, 3\)"),
        "3-D": ([torch.randn(5, 3), torch.randn(1, 5, 3)], ValueError, r"weights\[1\] must be 2-D"),
        "meta": ([P(torch.randn(5, 3)), torch.empty(5, 3, device="meta")], ValueError, r"weights\[1\] is on meta"),
        "sparse": ([torch.randn(5, 3), torch.randn(5, 3).to_sparse()], TypeError, r"weights\[1\] must be a dense"),
        "item": ([torch.randn(5, 3), 3], TypeError, r"weights\[1\] must be a torch.Tensor, got int"),
    }
    for name, (ws, exc, msg) in cases.items():
        with pytest.raises(exc, match=msg):
            fd.grouped_linear(x, ws, [2, 2])
