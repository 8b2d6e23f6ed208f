"""One buffer for a group's weights (NOTE: [One buffer]): nn.GroupedLinear's per-expert
parameters are views of one [E, N, K] storage, every backend reads them in place (no stack),
weight grads arrive as views of one buffer, and the module keeps the sharing through
state_dict loads, dtype/device moves and meta init. ``single_grouped_weight=True`` (one
[E, N, K] ``weight``, TE's names) matches the per-expert layout bit for bit. ``packed()`` sees
one buffer only in plain consecutive slices (no subclass at any position, no non-tensor)."""

from __future__ import annotations

import pytest
import torch

import functional_dw as fd
from conftest import CopyCounter, assert_close, assert_same, reference
from helpers import HANG_S, draws, grouped_module, ref_grouped
from functional_dw.kernels import packed, stacked

E, K, N = 3, 16, 32
SPLITS = [4, 0, 6]  # T = 10 < K: any copy of >= N*K elements is a copy of weights
T = sum(SPLITS)
PATHS = {"split": False, "grouped": True}


def _module(dtype=torch.float32, path=None, bias=True, **kw):
    return grouped_module(E, K, N, bias=bias, params_dtype=dtype, use_grouped_tensor=path, backend="torch", **kw)


def _is_one_buffer(ts) -> bool:
    with torch.no_grad():
        view = packed(list(ts))
    return view is not None and view.data_ptr() == ts[0].data_ptr()


def _run(m, dtype=torch.float32, seed=1):
    x, dy = draws((T, K), (T, N), seed=seed, dtype=dtype)
    x.requires_grad_()
    y = m(x, SPLITS)
    y.backward(dy)
    return x, dy, y


# --- packed(): what counts as one buffer ---------------------------------------------------------


def test_packed_recognises_consecutive_slices_only():
    buf = torch.randn(4, N, K)
    view = packed(list(buf))
    assert view is not None and view.shape == buf.shape and view.data_ptr() == buf.data_ptr() and torch.equal(view, buf)
    assert packed(list(buf[1:])).data_ptr() == buf[1].data_ptr()  # an offset start
    assert packed(list(buf)[::-1]) is None, "reversed order"
    assert packed(list(buf[::2])) is None, "a gap between slices"
    assert packed(list(buf.transpose(1, 2))) is None, "non-contiguous slices"
    half = torch.zeros(2, N, K, dtype=torch.bfloat16)
    assert packed([half[0], half[1].view(torch.float16)]) is None, "consecutive, but another dtype"
    assert packed([torch.randn(N, K) for _ in range(3)]) is None, "separately made"
    assert packed(list(torch.empty(3, N, K, device="meta"))) is not None  # (meta: offsets)
    assert packed([torch.empty(N, K, device="meta") for _ in range(3)]) is None
    assert packed(list(torch.empty(3, 0, K))) is None  # nothing to read


def test_packed_refuses_what_autograd_would_record():
    buf = torch.randn(3, N, K)
    ws = [torch.nn.Parameter(w) for w in buf]
    assert packed(ws) is None, "grad mode on and the tensors require grad: the view would route every grad to ws[0]"
    with torch.no_grad():
        assert packed(ws) is not None
    s = stacked(ws)  # differentiable instead: each weight gets its own grad
    s.sum().backward()
    assert all(torch.equal(w.grad, torch.ones(N, K)) for w in ws)


def test_packed_needs_addresses():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        assert packed(list(torch.empty(3, N, K))) is None
    with torch.no_grad():
        assert stacked(list(torch.randn(3, N, K).requires_grad_())).shape == (3, N, K)


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


@pytest.mark.xfail(
    strict=True,
    reason="packed() does not look at the negative bit (private torch._neg_view; "
    "a per-tensor is_neg() costs ~35 us at 128 experts on the hot path)",
)
def test_packed_refuses_a_negative_view():
    buf = torch.randn(2, 4)
    with torch.no_grad():
        assert packed([buf[0], torch._neg_view(buf[1])]) is None


# --- the module's layout --------------------------------------------------------------------------


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_module_parameters_are_views_of_one_buffer(bias):
    m = _module(bias=bias)
    assert [n for n, _ in m.named_parameters()] == [
        f"{k}{e}" for e in range(E) for k in ("weight", "bias") if bias or k == "weight"
    ]
    assert _is_one_buffer(m.weights())
    assert all(p.is_leaf and p.requires_grad and isinstance(p, torch.nn.Parameter) for p in m.parameters())
    assert not bias or _is_one_buffer(m.biases())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("path", PATHS)
def test_no_weight_copies_in_forward_and_backward(path, bias, dtype):
    """Every aten op of forward and backward (autograd's own included) is recorded: none is a
    stack, and no copy-like op makes a tensor of a weight's size or more; the grads are views
    of one buffer and equal the per-expert float64 reference."""
    m = _module(dtype, PATHS[path], bias)
    with CopyCounter() as ops:
        x, dy, y = _run(m, dtype)
    assert not ops.named("stack") and not ops.copies(N * K), ops.copies(N * K)
    assert ("_grouped_mm" in {op for op, _ in ops.ops}) == PATHS[path]
    assert _is_one_buffer([w.grad for w in m.weights()])
    params = [*m.weights(), *(m.biases() or [])]
    (ry, rgrads), (my, mgrads) = reference(lambda x, *p: ref_grouped(x, p[:E], SPLITS, p[E:] or None), [x, *params], dy)
    assert_close(y, ry, dtype, "y", mag=my.abs().max(), rounds=2 if bias and dtype != torch.float32 else 1)
    for what, got, want, mag in zip(
        ["dx", *(f"w{e}" for e in range(E)), *(f"b{e}" for e in range(E))],
        [x.grad, *(p.grad for p in params)],
        rgrads,
        mgrads,
    ):
        assert_close(got, want, dtype, what, mag=mag.abs().max())


@pytest.mark.parametrize("path", PATHS)
def test_under_autocast_the_buffer_is_cast_as_one_tensor(path):
    """fp32 experts in one buffer under bf16 autocast (NOTE: [Autocast] in _amp.py): forward casts
    the buffer once, backward once for dgrad and once to bring the grads back to fp32; no stack,
    no per-expert copy; the grads are views of one buffer, the numbers those of the module's
    parameters cast by hand (no autocast)."""
    m = _module(path=PATHS[path])
    x, dy = draws((T, K), (T, N), seed=1)
    x.requires_grad_()
    with CopyCounter() as ops:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = m(x, SPLITS)
        y.backward(dy.to(torch.bfloat16))
    assert ops.named("stack") == [(E, N)]  # (the biases, once in forward, as without autocast)
    assert ops.weight_copies(N, K) == [("_to_copy", (E, N, K))] * 3, ops.weight_copies(N, K)
    assert _is_one_buffer([w.grad for w in m.weights()])
    cast = [t.detach().to(torch.bfloat16).requires_grad_() for t in [x, *m.weights(), *m.biases()]]
    y2 = fd.grouped_linear(cast[0], cast[1 : 1 + E], SPLITS, cast[1 + E :], use_grouped_tensor=PATHS[path])
    y2.backward(dy.to(torch.bfloat16))
    assert_same(y, y2)
    assert_same([x.grad, *(p.grad for p in [*m.weights(), *m.biases()])], [t.grad.float() for t in cast])


@pytest.mark.parametrize("path", PATHS)
def test_separate_weights_are_stacked_once_per_pass(path):
    """The control: E separately made tensors cost one stack in forward and one in backward
    on the grouped path (none on the split path); results equal the module layout's bitwise."""
    m = _module(path=PATHS[path])
    ws = [torch.nn.Parameter(w.detach().clone()) for w in m.weights()]
    bs = [torch.nn.Parameter(b.detach().clone()) for b in m.biases()]
    x0, dy, y0 = _run(m)
    x = x0.detach().requires_grad_()
    with CopyCounter() as ops:
        y = fd.grouped_linear(x, ws, SPLITS, bs, use_grouped_tensor=PATHS[path], backend="torch")
        y.backward(dy)
    want = [(E, N, K)] * 2 if PATHS[path] else []
    assert sorted(ops.named("stack")) == sorted(want + [(E, N)])  # (and the biases, once in forward)
    assert_same(
        [y, x.grad, *(w.grad for w in ws), *(b.grad for b in bs)],
        [y0, x0.grad, *(w.grad for w in m.weights()), *(b.grad for b in m.biases())],
    )


@pytest.mark.parametrize("path", PATHS)
def test_packed_main_grads_are_written_in_place(path):
    """fuse_wgrad_accumulation with main_grads that are slices of one fp32 buffer: the split
    path adds each expert's [N, K] product into its slice (add_; a GEMM writing into main_grad
    would sum in an order that depends on main_grad's strides, see test_layouts), the grouped
    path adds its one [E, N, K] product with one add_ (grouped_mm has no out=); no copy of
    weight size either way."""
    m = _module(path=PATHS[path], fuse_wgrad_accumulation=True)
    main = torch.full((E, N, K), 0.5)
    for w, g in zip(m.weights(), main):
        w.main_grad = g
    with CopyCounter() as ops:
        x, dy, _ = _run(m)
    assert not ops.copies(N * K), ops.copies(N * K)
    assert ops.named("add_") == ([(E, N, K)] if PATHS[path] else [(N, K)] * E)
    assert all(w.grad is None for w in m.weights())
    (_, g), _ = reference(lambda x, *p: ref_grouped(x, p, SPLITS), [x, *m.weights()], dy)
    for e in range(E):
        assert_close(main[e] - 0.5, g[1 + e], torch.float32, f"main_grad[{e}]")


def test_an_in_place_change_of_one_expert_is_caught():
    """The experts share one storage, so one version counter: changing any of them in place
    between forward and backward raises (as for a stacked [E, N, K] weight)."""
    m = _module()
    y = m(torch.randn(T, K, requires_grad=True), SPLITS)
    with torch.no_grad():
        m.weight2.add_(1)
    with pytest.raises(RuntimeError, match="modified in place"):
        y.sum().backward()


def test_in_place_change_of_one_expert_says_the_experts_share_a_version_counter():
    """Changing weight2 in place raised "weights[0] was modified in place" (the experts share
    one buffer, hence one version counter): the message now says so instead of only blaming
    an expert the user never touched."""
    m = grouped_module(3, 16, 32, backend="torch")
    y = m(torch.randn(10, 16, requires_grad=True), [4, 0, 6])
    with torch.no_grad():
        m.weight2.add_(1)
    with pytest.raises(RuntimeError, match=r"weights\[0\] was modified in place.*share one buffer"):
        y.sum().backward()


@pytest.mark.parametrize("path", PATHS)
def test_second_order_gradients_through_the_module_layout(path):
    """Where autograd records the GEMMs (create_graph), the weights are stacked, not viewed:
    the second-order grads equal those of separately made weights."""

    def second_order(ws):
        x = torch.randn(T, K, generator=torch.Generator().manual_seed(3), requires_grad=True)
        y = fd.grouped_linear(x, ws, SPLITS, use_grouped_tensor=PATHS[path], backend="torch")
        (dx,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)
        return torch.autograd.grad(dx.square().sum(), ws)

    m = _module(bias=False)
    separate = [torch.nn.Parameter(w.detach().clone()) for w in m.weights()]
    got, want = second_order(m.weights()), second_order(separate)
    assert_same(list(got), list(want))
    assert all(g.abs().sum() > 0 for e, g in enumerate(got) if SPLITS[e])


# --- state_dict, conversions, meta init --------------------------------------------------------------


def _te_state_dict(dtype=torch.float32):  # te.GroupedLinear(E, K, N).state_dict(): E separate tensors
    g = torch.Generator().manual_seed(7)
    sd = {
        k: torch.randn(*s, generator=g).to(dtype)
        for e in range(E)
        for k, s in [(f"weight{e}", (N, K)), (f"bias{e}", (N,))]
    }
    return {**sd, "_extra_state": torch.empty(0, dtype=torch.uint8)}


def test_load_te_state_dict_copies_into_the_buffer():
    m = _module()
    ptrs = [p.data_ptr() for p in m.parameters()]
    sd = _te_state_dict()
    assert m.load_state_dict(sd, strict=True) is not None
    assert [p.data_ptr() for p in m.parameters()] == ptrs, "assign=False copies into the same views"
    assert _is_one_buffer(m.weights()) and _is_one_buffer(m.biases())
    for name, p in m.named_parameters():
        assert torch.equal(p, sd[name]), name
    out = m.state_dict()
    assert set(out) == set(sd)
    fresh = _module()
    fresh.load_state_dict(out, strict=True)  # a round trip
    assert all(torch.equal(p, q) for p, q in zip(fresh.parameters(), m.parameters()))


def test_load_with_assign():
    """assign=True: tensors that are one buffer's slices (another module's state dict) become
    the parameters as they are; separate tensors (TE's) are copied into one new buffer of their
    dtype and device."""
    src = _module(torch.bfloat16)
    m = _module()
    m.load_state_dict(src.state_dict(), strict=True, assign=True)
    assert [p.data_ptr() for p in m.parameters()] == [p.data_ptr() for p in src.parameters()]
    assert m.weight0.dtype == torch.bfloat16 and _is_one_buffer(m.weights())
    sd = _te_state_dict(torch.float16)
    m.load_state_dict(sd, strict=True, assign=True)
    assert m.weight1.dtype == torch.float16 and _is_one_buffer(m.weights()) and _is_one_buffer(m.biases())
    assert all(torch.equal(p, sd[n]) for n, p in m.named_parameters())
    assert all(p.requires_grad and isinstance(p, torch.nn.Parameter) for p in m.parameters())
    assert m.weight0.data_ptr() != sd["weight0"].data_ptr()


CONVERSIONS = {
    "to-bf16": lambda m: m.to(torch.bfloat16),
    "half": lambda m: m.half(),
    "double": lambda m: m.double(),
    "to-cpu": lambda m: m.to("cpu"),
    "to-meta": lambda m: m.to("meta"),
    "to_empty": lambda m: m.to_empty(device="cpu"),
    "share_memory": lambda m: m.share_memory(),
}


@pytest.mark.parametrize("swap", [False, True], ids=["set-data", "swap-tensors"])
@pytest.mark.parametrize("how", CONVERSIONS)
def test_conversions_keep_one_buffer(how, swap):
    m = _module()
    m.weight0.grad = torch.ones(N, K)
    before = [id(p) for p in m.parameters()]
    old = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(swap)
    try:
        with CopyCounter() as ops:
            assert CONVERSIONS[how](m) is m
    finally:
        torch.__future__.set_swap_module_params_on_conversion(old)
    assert _is_one_buffer(m.weights()) and _is_one_buffer(m.biases())
    assert not ops.named("stack"), "each group converted as one tensor (not per parameter, then tied by a copy)"
    if how in ("to-bf16", "half", "double"):
        assert sorted(ops.named("_to_copy")) == sorted([(N, K), (E, N), (E, N, K)])  # (the grad, the buffers)
    if how != "to-meta":  # (to another device type torch makes new Parameters, for any module)
        assert [id(p) for p in m.parameters()] == before, "the same Parameter objects (an optimizer keeps them)"
    assert m.weight0.grad is not None and m.weight0.grad.dtype == m.weight0.dtype


def test_a_group_with_separate_storage_is_tied_again():
    """If something gave the experts separate storage (e.g. ``p.data = ...``), the next
    conversion puts them back into one buffer."""
    m = _module()
    m.weight1.data = torch.zeros(N, K)
    assert not _is_one_buffer(m.weights())
    m.float()
    assert _is_one_buffer(m.weights()) and not m.weight1.any()


def test_meta_init_then_to_empty_and_reset():
    with torch.device("meta"):
        m = fd.nn.GroupedLinear(E, K, N, backend="torch")
    assert _is_one_buffer(m.weights())
    m.to_empty(device="cpu")
    assert _is_one_buffer(m.weights()) and _is_one_buffer(m.biases())
    torch.manual_seed(0)
    m.reset_parameters()
    assert _is_one_buffer(m.weights())
    for p, q in zip(m.parameters(), _module().parameters()):  # the eager constructor's values
        assert torch.equal(p, q)


# --- single_grouped_weight (TE's name) ---------------------------------------------------------------


def test_single_grouped_weight_names_and_state_dict():
    m = _module(single_grouped_weight=True)
    assert {n: tuple(p.shape) for n, p in m.named_parameters()} == {"weight": (E, N, K), "bias": (E, N)}
    assert set(m.state_dict()) == {"weight", "bias", "_extra_state"}
    assert torch.equal(m.weight, torch.stack(_module().weights())), "the same init as the per-expert layout"
    assert torch.equal(m.bias, torch.stack(_module().biases()))
    split_bias = _module(single_grouped_weight=True, single_grouped_bias=False)
    assert [n for n, _ in split_bias.named_parameters()] == [f"bias{e}" for e in range(E)] + ["weight"]
    only_bias = _module(single_grouped_bias=True)
    assert [n for n, _ in only_bias.named_parameters()] == [f"weight{e}" for e in range(E)] + ["bias"]
    assert "single_grouped_weight=True" in repr(m)


def test_either_layout_loads_the_other():
    """As TE's GroupedLinear: weight0.. load into ``weight`` (stacked) and back (split)."""
    single, each = _module(single_grouped_weight=True), _module()
    sd = _te_state_dict()
    single.load_state_dict(sd, strict=True)
    assert torch.equal(single.weight, torch.stack([sd[f"weight{e}"] for e in range(E)]))
    assert torch.equal(single.bias, torch.stack([sd[f"bias{e}"] for e in range(E)]))
    single.weight.data.mul_(2)
    each.load_state_dict(single.state_dict(), strict=True)
    assert _is_one_buffer(each.weights())
    assert all(torch.equal(w, 2 * sd[f"weight{e}"]) for e, w in enumerate(each.weights()))
    model = torch.nn.Sequential(_module(single_grouped_weight=True))
    model.load_state_dict({f"0.{k}": v for k, v in sd.items()}, strict=True)  # under a prefix
    assert torch.equal(model[0].weight[2], sd["weight2"])
    with pytest.raises(RuntimeError, match=r'(?s)Missing key.*"weight0".*Unexpected key.*"weight"'):
        _module().load_state_dict({"weight": torch.zeros(E + 1, N, K)}, strict=True)  # not E experts: kept as is


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("path", PATHS)
def test_single_grouped_weight_matches_the_per_expert_layout_bitwise(path, dtype):
    each = _module(dtype, PATHS[path])
    single = _module(dtype, PATHS[path], single_grouped_weight=True)
    with CopyCounter() as ops:
        xs, _, ys = _run(single, dtype)
    x, _, y = _run(each, dtype)
    assert not ops.copies(N * K) and not ops.named("stack")
    assert_same(
        [ys, xs.grad, single.weight.grad, single.bias.grad],
        [y, x.grad, torch.stack([w.grad for w in each.weights()]), torch.stack([b.grad for b in each.biases()])],
    )


def test_bad_layout_flags_are_refused():
    with pytest.raises(TypeError, match="single_grouped_weight must be a bool"):
        fd.nn.GroupedLinear(E, K, N, single_grouped_weight="yes")
    with pytest.raises(TypeError, match="single_grouped_bias must be a bool"):
        fd.nn.GroupedLinear(E, K, N, single_grouped_bias=1)


# --- torch.compile -----------------------------------------------------------------------------


def test_compiled_module_reads_the_buffer_in_place(monkeypatch):
    """Traced, a list of weights has no addresses: the grouped path's weight GEMMs take the
    list into the ``ref_weights_gmm`` op, which finds the buffer at run time. No stack in the
    graph; every run found one buffer; output and grads equal eager's."""
    from support.compile_cases import GraphCounter
    from functional_dw.kernels import torch_ref

    found = []

    def spy(ts):
        with torch.no_grad():
            found.append(packed(ts) is not None)
        return stacked(ts)

    m = _module(torch.bfloat16, True)
    torch._dynamo.reset()
    counter = GraphCounter()
    compiled = torch.compile(m, backend=counter, fullgraph=True)
    x, dy, y = _run(m, torch.bfloat16)
    grads = [x.grad, *(p.grad for p in m.parameters())]
    m.zero_grad()
    monkeypatch.setattr(torch_ref, "stacked", spy)
    xc, _, yc = _run(compiled, torch.bfloat16)
    assert found == [True, True], found  # forward's and backward's weight GEMM
    assert "functional_dw.ref_weights_gmm.default" in counter.ops
    stacks = [[a.meta["example_value"].dim() for a in args[0]] for op, args in counter.calls if "stack" in op]
    assert stacks and all(dims == [1] * E for dims in stacks), stacks  # the biases' only (small), never the weights
    assert_same([yc, xc.grad, *(p.grad for p in m.parameters())], [y, *grads])


# --- FSDP2 (fully_shard), 2 ranks on gloo --------------------------------------------------------------

FSDP_CASES = [f"{layout}-{path}" for layout in ("per-expert", "single") for path in PATHS]


def _fsdp2_case(case: str) -> None:
    """fully_shard the module and compare forward/backward with the unsharded module on the
    same tokens (FSDP2 averages the grads: equal on every rank), twice; then the meta init flow
    (meta, fully_shard, to_empty, reset_parameters) computes with its gathered weights."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    single, path = case.startswith("single"), PATHS[case.split("-")[-1]]
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    ref, m = (_module(path=path, single_grouped_weight=single) for _ in range(2))
    fully_shard(m, mesh=mesh)
    assert all(isinstance(p, DTensor) for p in m.parameters())
    x_ref, _, y_ref = _run(ref)
    for _ in range(2):
        m.zero_grad()
        x, _, y = _run(m)
        assert_same([y, x.grad], [y_ref, x_ref.grad])
        for (name, p), q in zip(m.named_parameters(), ref.parameters()):
            assert_same(p.grad.full_tensor(), q.grad, name)
    with torch.device("meta"):
        lazy = fd.nn.GroupedLinear(E, K, N, use_grouped_tensor=path, backend="torch", single_grouped_weight=single)
    fully_shard(lazy, mesh=mesh)
    lazy.to_empty(device="cpu")
    lazy.reset_parameters()
    full = {n: p.full_tensor() for n, p in lazy.named_parameters()}
    want = (
        {"weight": (E, N, K), "bias": (E, N)}
        if single
        else {k: s for e in range(E) for k, s in [(f"weight{e}", (N, K)), (f"bias{e}", (N,))]}
    )
    assert {n: tuple(v.shape) for n, v in full.items()} == want
    assert all(0 < v.abs().max() <= K**-0.5 for v in full.values())
    w = full["weight"] if single else [full[f"weight{e}"] for e in range(E)]
    b = full["bias"] if single else [full[f"bias{e}"] for e in range(E)]
    x = torch.randn(T, K)
    assert_same(lazy(x, SPLITS), fd.grouped_linear(x, w, SPLITS, b, use_grouped_tensor=path, backend="torch"))


def _fsdp2_job() -> dict[str, str | None]:
    import traceback

    out = {}
    for case in FSDP_CASES:
        try:
            _fsdp2_case(case)
            out[case] = None
        except Exception:
            out[case] = traceback.format_exc()
    return out


@pytest.fixture(scope="module")
def fsdp2_results():
    pytest.importorskip("torch.distributed.fsdp")
    from functional_dw import distributed as fdd

    return fdd.launch(_fsdp2_job, 2, backend="gloo", timeout=HANG_S, deadline=HANG_S)


@pytest.mark.parametrize("case", FSDP_CASES)
def test_fsdp2_fully_shard(fsdp2_results, case):
    """FSDP2 replaces the parameters (DTensor shards; unsharded per-parameter tensors in
    forward and backward), so the shared buffer does not survive it; results stay right."""
    failures = [f"rank {r}: {res[case]}" for r, res in enumerate(fsdp2_results) if res[case] is not None]
    assert not failures, "\n".join(failures)


def test_deepcopy_and_pickle_keep_one_buffer():
    """copy.deepcopy copies each Parameter on its own; the module ties them again."""
    import copy
    import io

    m = _module()
    b = io.BytesIO()
    torch.save(m, b)
    b.seek(0)
    for other in (copy.deepcopy(m), torch.load(b, weights_only=False)):
        assert _is_one_buffer(other.weights()) and _is_one_buffer(other.biases())
        assert other.weight0.data_ptr() != m.weight0.data_ptr()
        assert all(torch.equal(p, q) for p, q in zip(other.parameters(), m.parameters()))
