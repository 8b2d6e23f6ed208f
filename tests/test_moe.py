"""The MoE layer's routing (``functional_dw/moe.py``): dispatch and combine as pure pairs,
``topk_router``, ``moe_layer`` and ``nn.MoE`` against a float64 per-token reference, on the
reference backend: gradients, empty experts, hooks, retain_graph, torch.func, bad input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import functional_dw as fd
from functional_dw import moe, moe_ep

T, H, FF, E, K = 12, 16, 8, 5, 2
F64 = torch.float64


def _params(seed=0, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g, dtype=dtype).requires_grad_()
    wr = (torch.randn(E, H, generator=g, dtype=dtype) / 4).requires_grad_()
    w1 = (torch.randn(E, 2 * FF, H, generator=g, dtype=dtype) / 4).requires_grad_()
    w2 = (torch.randn(E, H, FF, generator=g, dtype=dtype) / 4).requires_grad_()
    return x, wr, w1, w2


def _reference(x, wr, w1, w2, top_k, score="softmax"):
    """Token by token: the router's top-k, then sum_j p_j * fc2(swiglu(fc1(x)))."""
    logits = x @ wr.t()
    values, idx = torch.topk(logits, top_k, dim=-1)
    s = torch.sigmoid(values)  # Megatron's sigmoid: normalized when top_k > 1
    p = torch.softmax(values, -1) if score == "softmax" else s / s.sum(-1, True) if top_k > 1 else s
    out = []
    for t in range(x.shape[0]):
        acc = 0
        for j in range(top_k):
            e = int(idx[t, j])
            gate, up = (w1[e] @ x[t]).chunk(2)
            acc = acc + p[t, j] * (w2[e] @ (F.silu(gate) * up))
        out.append(acc)
    return torch.stack(out)


def _experts(w1, w2):
    """moe.layer_parts' experts on the torch backend, as moe_layer runs them (swiglu)."""

    def experts(x, splits, probs_r, rows=None, combine=False):
        return fd.grouped_mlp(x, w1, w2, splits, probs=probs_r, backend="torch", rows=rows, combine=combine)

    return experts


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_moe_layer_matches_the_per_token_reference(score, top_k):
    x, wr, w1, w2 = _params()
    y = moe.moe_layer(x, wr, w1, w2, top_k, score=score, backend="torch")
    want = _reference(x, wr, w1, w2, top_k, score)
    torch.testing.assert_close(y, want)
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, (x, wr, w1, w2), dy)
    ref = torch.autograd.grad(want, (x, wr, w1, w2), dy)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b)


def test_dispatch_sorts_stably_by_expert_and_counts_on_the_device():
    x = torch.arange(4.0, dtype=F64)[:, None].repeat(1, 3)
    idx = torch.tensor([[2, 0], [0, 2], [2, 1], [0, 0]])  # expert 3 and 4 empty; token 3 twice to 0
    rows, probs_r, splits, order = moe.dispatch(x, None, idx, 5)
    assert probs_r is None
    assert splits.tolist() == [4, 1, 3, 0, 0] and splits.device == x.device
    assert rows[:, 0].tolist() == [0, 1, 3, 3, 2, 0, 1, 2]  # within an expert: token order, then choice
    assert order.tolist() == [1, 2, 6, 7, 5, 0, 3, 4]
    y = moe.combine(rows, order, 2)
    torch.testing.assert_close(y, 2 * x)  # each token's two copies summed back


def test_combine_of_weighted_rows_is_the_weighted_sum_and_its_grads_are_gathers():
    x, *_ = _params()
    g = torch.Generator().manual_seed(3)
    idx = torch.randint(0, E, (T, K), generator=g)
    probs = torch.rand(T, K, generator=g, dtype=F64).requires_grad_()
    rows, probs_r, splits, order = moe.dispatch(x, probs, idx, E)
    y = moe.combine(rows * probs_r[:, None], order, K)
    want = (x[:, None, :] * probs[:, :, None]).sum(1)
    torch.testing.assert_close(y, want)
    dy = torch.randn_like(y)
    for a, b in zip(torch.autograd.grad(y, (x, probs), dy), torch.autograd.grad(want, (x, probs), dy)):
        torch.testing.assert_close(a, b)


def test_every_expert_empty_but_one_and_one_token():
    x, wr, w1, w2 = _params()
    with torch.no_grad():
        wr.zero_()
        wr[3] = 10.0  # every token's top-1 is expert 3 (ties elsewhere: torch.topk's order)
    y = moe.moe_layer(x, wr, w1, w2, 1, backend="torch")
    torch.testing.assert_close(y, _reference(x, wr, w1, w2, 1))
    y1 = moe.moe_layer(x[:1], wr, w1, w2, 2, backend="torch")
    torch.testing.assert_close(y1, _reference(x[:1], wr, w1, w2, 2))


def test_hooks_see_no_parameter_and_retain_graph_gives_the_same_grads():
    x, wr, w1, w2 = _params()
    packed = []

    def pack(t):
        packed.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = moe.moe_layer(x, wr, w1, w2, K, backend="torch")
    params = {p.data_ptr() for p in (wr, w1, w2)}
    assert packed and not any(t.data_ptr() in params for t in packed)
    dy = torch.randn_like(y)
    first = torch.autograd.grad(y, (x, wr, w1, w2), dy, retain_graph=True)
    second = torch.autograd.grad(y, (x, wr, w1, w2), dy)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_routing_records_keep_indices_only():
    x, *_ = _params()
    idx = torch.randint(0, E, (T, K))
    (rows, splits, order), res = moe.dispatch_fwd(x, None, idx, E)
    assert [t.dtype for t in fd.saved_activations(res)] == [torch.int64]
    _, cres = moe.combine_fwd(rows, order, K)
    assert [t.dtype for t in fd.saved_activations(cres)] == [torch.int64]


def test_torch_func_grad_through_dispatch_and_combine():
    x, *_ = _params()
    idx = torch.randint(0, E, (T, K), generator=torch.Generator().manual_seed(1))
    probs = torch.rand(T, K, dtype=F64)

    def f(x):
        rows, probs_r, _, order = moe.dispatch(x, probs, idx, E)
        return moe.combine(rows.sin() * probs_r[:, None], order, K).sum()

    want = torch.autograd.grad(f(x), x)[0]
    torch.testing.assert_close(torch.func.grad(f)(x.detach()), want)


def test_nn_moe_is_moe_layer_on_its_parameters():
    torch.manual_seed(0)
    m = fd.nn.MoE(E, H, FF, K, backend="torch", params_dtype=F64)
    x = torch.randn(T, H, dtype=F64, requires_grad=True)
    y = m(x)
    w1, w2 = m.experts.fc1.weight, m.experts.fc2.weight
    torch.testing.assert_close(y, _reference(x, m.router.weight, w1, w2, K))
    y.sum().backward()
    assert all(p.grad is not None for p in m.parameters())


@pytest.mark.parametrize(
    "args,err,match",
    [
        ((torch.zeros(4, 3), None, torch.tensor([[0], [5], [1], [2]]), 5), ValueError, r"lie in \[0, 5\)"),
        ((torch.zeros(4, 3), None, torch.tensor([[0], [-1], [1], [2]]), 5), ValueError, r"lie in \[0, 5\)"),
        ((torch.zeros(4, 3), None, torch.zeros(4, 1), 5), TypeError, "int32/int64"),
        ((torch.zeros(4, 3), None, torch.zeros(3, 1, dtype=torch.long), 5), ValueError, "rows"),
        ((torch.zeros(4, 3), torch.zeros(4, 2), torch.zeros(4, 1, dtype=torch.long), 5), ValueError, "probs"),
        ((torch.zeros(4, 3), None, torch.zeros(4, 1, dtype=torch.long), 0), ValueError, "num_experts"),
        ((torch.zeros(12), None, torch.zeros(4, 1, dtype=torch.long), 5), TypeError, r"\[T, H\]"),
    ],
)
def test_dispatch_names_what_is_wrong(args, err, match):
    with pytest.raises(err, match=match):
        moe.dispatch(*args)


def test_router_and_module_refuse_bad_options():
    with pytest.raises(ValueError, match=r"topk_router: logits must be \[T, E\].*got shape \(4,\)"):
        moe.topk_router(torch.zeros(4), 2)  # (was refused only in backward, by a scatter)
    with pytest.raises(TypeError, match="floating-point"):
        moe.topk_router(torch.zeros(3, 4, dtype=torch.long), 2)
    with pytest.raises(ValueError, match=r"load_balancing_loss: indices \(3, 2\) on cpu must have the logits' 6 rows"):
        moe.load_balancing_loss(torch.zeros(6, 4), torch.zeros(3, 2, dtype=torch.long))  # (was a silent number)
    with pytest.raises(ValueError, match=r"expert indices must lie in \[0, 4\)"):
        moe.load_balancing_loss(torch.zeros(2, 4), torch.tensor([[0, 7], [1, 2]]))  # (was a raw IndexError)
    with pytest.raises(TypeError, match=r"load_balancing_loss: indices must be a \[T, k\] int32/int64 tensor"):
        moe.load_balancing_loss(torch.zeros(2, 4), torch.zeros(2, 2))  # (was a silent number)
    logits = torch.zeros(0, 4, requires_grad=True)  # no tokens: 0, with a graph (was a ZeroDivisionError)
    loss = moe.load_balancing_loss(logits, torch.zeros(0, 2, dtype=torch.long))
    loss.backward()
    assert loss.item() == 0.0 and logits.grad.shape == (0, 4)
    x, wr, w1, w2 = _params()
    for w1_, w2_ in ((w1[:-1], w2[:-1]), (list(w1[:-1]), list(w2[:-1]))):  # (was a message about splits)
        for run in (moe.moe_layer, torch.compile(moe.moe_layer, backend="eager")):
            with pytest.raises(
                ValueError, match=f"routes to E = {E} experts, so w1 must hold {E} experts; it holds {E - 1}"
            ):
                run(x, wr, w1_, w2_, K, backend="torch")
    with pytest.raises(ValueError, match="0-dim"):
        fd.nn.MoE(E, H, FF, K, backend="torch")(torch.tensor(1.0))
    with pytest.raises(ValueError, match="score"):
        moe.topk_router(torch.zeros(3, 4), 2, "relu")
    with pytest.raises(ValueError, match="top_k"):
        moe.topk_router(torch.zeros(3, 4), 5)
    with pytest.raises(ValueError, match="top_k"):
        fd.nn.MoE(4, 8, 8, 0)
    with pytest.raises(ValueError, match="top_k"):
        moe.combine(torch.zeros(5, 2), torch.arange(5), 2)


def test_compile_fullgraph_and_meta_tensors():
    """The CPU-only index check stays out of a trace and off meta tensors (no values there)."""
    torch._dynamo.reset()
    x, wr, w1, w2 = _params()
    f = torch.compile(lambda *a: moe.moe_layer(*a, K, backend="torch"), fullgraph=True, backend="aot_eager")
    y = f(x, wr, w1, w2)
    torch.testing.assert_close(y, _reference(x, wr, w1, w2, K))
    got = torch.autograd.grad(y.sum(), (x, wr, w1, w2))
    want = torch.autograd.grad(_reference(x, wr, w1, w2, K).sum(), (x, wr, w1, w2))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    rows, _, splits, order = moe.dispatch(
        torch.empty(T, H, device="meta"), None, torch.empty(T, K, dtype=torch.long, device="meta"), E
    )
    assert rows.shape == (T * K, H) and splits.shape == (E,) and order.shape == (T * K,)
    m = fd.nn.MoE(E, H, FF, K, backend="torch", params_dtype=F64)
    x3 = torch.randn(2, T, H, dtype=F64)
    torch.testing.assert_close(m(x3), m(x3.reshape(-1, H)).view(2, T, H))  # leading dims as nn.Linear's
    assert torch.equal(m(x3[0, 0]), m(x3[0, :1])[0])  # and one token as [H]


def test_routing_under_fake_tensor_mode():
    """Shape inference under a plain FakeTensorMode: the CPU-only value checks skip fake tensors
    (they hold no values: a DataDependentOutputException before)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x, idx, p = torch.randn(T, H), torch.randint(0, E, (T, K)), torch.rand(T, K)
        rows, probs_r, splits, order = moe.dispatch(x, p, idx, E)
        assert rows.shape == (T * K, H) and probs_r.shape == (T * K,) and splits.shape == (E,)
        probs_r, splits, order = moe.sort_by_expert(p, idx, E)
        assert order.shape == (T * K,) and moe.combine(rows, order, K).shape == (T, H)
        assert moe.load_balancing_loss(torch.randn(T, E), idx).shape == ()


def test_combine_refuses_an_order_that_is_not_a_permutation():
    rows = torch.arange(8.0)[:, None].repeat(1, 2)
    with pytest.raises(ValueError, match="permutation"):
        moe.combine(rows, torch.tensor([0, 0, 2, 3, 4, 5, 6, 7]), 2)
    with pytest.raises(ValueError, match="device"):
        moe.dispatch(torch.zeros(4, 3), torch.zeros(4, 1, device="meta"), torch.zeros(4, 1, dtype=torch.long), 5)
    with pytest.raises(ValueError, match="at least one expert"):
        fd.nn.MoE(0, 16, 8, 1)


def test_expert_bias_steers_the_selection_not_the_weights():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(T, E, generator=g, dtype=F64)
    bias = torch.zeros(E, dtype=F64)
    bias[4] = 100.0  # every token picks expert 4 first
    probs, idx = moe.topk_router(logits, 2, "sigmoid", expert_bias=bias)
    assert (idx[:, 0] == 4).all()
    s = torch.sigmoid(logits).gather(1, idx)
    torch.testing.assert_close(probs, s / s.sum(-1, keepdim=True))  # weights from the unbiased scores
    with pytest.raises(ValueError, match="sigmoid"):
        moe.topk_router(logits, 2, expert_bias=bias)


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_load_balancing_loss_is_switch_transformers(score):
    """coeff * E * sum_e f_e * P_e, written out (Megatron's docstring formula)."""
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(T, E, generator=g, dtype=F64, requires_grad=True)
    _, idx = moe.topk_router(logits, K, score)
    loss = moe.load_balancing_loss(logits, idx, score, coeff=0.01)
    full = torch.softmax(logits, -1) if score == "softmax" else torch.sigmoid(logits)
    full = full / full.sum(-1, keepdim=True)
    want = 0
    for e in range(E):
        f_e = (idx == e).sum() / (T * K)
        want = want + f_e * full[:, e].mean()
    want = 0.01 * E * want
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(torch.autograd.grad(loss, logits)[0], torch.autograd.grad(want, logits)[0])


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_router_and_loss_are_megatrons(score):
    """The same numbers from Megatron-Core's own functions (where it is installed)."""
    mc = pytest.importorskip("megatron.core.transformer.moe.moe_utils")
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(7), dtype=F64)
    probs, idx = moe.topk_router(logits, K, score)
    theirs_p, theirs_i = mc.topk_routing_with_score_function(logits, K, score_function=score, dense_output=True)
    assert torch.equal(idx, theirs_i)
    torch.testing.assert_close(probs, theirs_p)
    routing_map, scores = mc.compute_routing_scores_for_aux_loss(logits, K, score)
    theirs = mc.switch_load_balancing_loss_func(scores, routing_map.sum(0), T, K, E, 0.01)
    ours = moe.load_balancing_loss(logits, idx, score, coeff=0.01)  # (Megatron's softmax scores are fp32)
    torch.testing.assert_close(ours, theirs.to(ours.dtype), rtol=1e-5, atol=0)


def test_the_layer_is_one_node_whose_record_nests_the_parts():
    x, wr, w1, w2 = _params()
    y = moe.moe_layer(x, wr, w1, w2, K, backend="torch")
    assert type(y.grad_fn).__name__ == "CustomVJP_moe_layerBackward"
    _, res = moe.moe_layer_fwd(x, wr, w1, w2, K, backend="torch")
    assert type(res.experts).__name__ == "GroupedMLPResiduals" and type(res.dispatch) is moe.DispatchResiduals
    params = {p.data_ptr() for p in (wr, w1, w2)}
    assert not any(t.data_ptr() in params for t in fd.saved_activations(res))
    # the one node and the five ops (what a compiled call runs) compute the same bits
    logits = fd.linear(x, wr, backend="torch")
    probs, idx = moe.topk_router(logits, K)
    rows, probs_r, splits, order = moe.dispatch(x, probs, idx, E)
    parts = moe.combine(fd.grouped_mlp(rows, w1, w2, splits, probs=probs_r, backend="torch"), order, K)
    assert torch.equal(y, parts)
    dy = torch.randn_like(y)
    for a, b in zip(torch.autograd.grad(y, (x, wr, w1, w2), dy), torch.autograd.grad(parts, (x, wr, w1, w2), dy)):
        assert torch.equal(a, b)


def test_the_one_node_keeps_x_once():
    """NOTE: [Rows from x]: the one node does not keep fc1's rows (k gathered copies of x, which the
    router keeps): exactly T * k * H elements fewer through the hooks than the parts, the same grads."""
    x, wr, w1, w2 = _params()

    def saved_bytes(f):
        packed = {}

        def pack(t):
            packed[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = f()
        return y, sum(packed.values())

    def parts():
        probs, idx = moe.topk_router(fd.linear(x, wr, backend="torch"), K)
        rows, probs_r, splits, order = moe.dispatch(x, probs, idx, E)
        return moe.combine(fd.grouped_mlp(rows, w1, w2, splits, probs=probs_r, backend="torch"), order, K)

    y1, one = saved_bytes(lambda: moe.moe_layer(x, wr, w1, w2, K, backend="torch"))
    y2, five = saved_bytes(parts)
    assert five - one == T * K * H * x.element_size()
    _, res = moe.moe_layer_fwd(x, wr, w1, w2, K, backend="torch")
    assert res.rows_from_x and res.experts.fc1.x_TK is None
    dy = torch.randn_like(y1)
    for a, b in zip(torch.autograd.grad(y1, (x, wr, w1, w2), dy), torch.autograd.grad(y2, (x, wr, w1, w2), dy)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_torch_func_grad_of_the_layer(score):
    x, wr, w1, w2 = _params()

    def loss(x, wr, w1=w1.detach(), w2=w2.detach()):
        return moe.moe_layer(x, wr, w1, w2, K, score=score, backend="torch").square().sum()

    got = torch.func.grad(loss, argnums=(0, 1))(x.detach(), wr.detach())
    want = torch.autograd.grad(_reference(x, wr, w1, w2, K, score).square().sum(), (x, wr))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    # closed-over weights that require grad (an nn.Module's): first order runs, the same grads
    got = torch.func.grad(lambda x: loss(x, wr.detach(), w1, w2))(x.detach())
    assert torch.equal(got, torch.func.grad(loss)(x.detach(), wr.detach()))


def test_vmap_over_tokens_and_over_an_ensemble_of_experts():
    """torch.func.vmap over a batch of token sets (and vmap of grad), and over a batch of expert
    weights: each element what the layer gives it alone, bit for bit."""
    x, wr, w1, w2 = (t.detach() for t in _params())
    xb = torch.stack([x, x.flip(0), x * 2])

    def layer(x, w1=w1):
        return moe.moe_layer(x, wr, w1, w2, K, backend="torch")

    assert torch.equal(torch.func.vmap(layer)(xb), torch.stack([layer(e) for e in xb]))
    g = torch.func.grad(lambda x: layer(x).square().sum())
    assert torch.equal(torch.func.vmap(g)(xb), torch.stack([g(e) for e in xb]))
    w1b = torch.stack([w1, w1 * 0.5])
    got = torch.func.vmap(lambda w: layer(x, w))(w1b)
    assert torch.equal(got, torch.stack([layer(x, w) for w in w1b]))


# --- expert parallelism (moe_ep.py) on gloo: P ranks bitwise one rank ------------------------------


def _ep_job(E: int, T: int, top_k: int, device: str = "cpu", dims: tuple = (H, FF)) -> dict:
    """On each rank: the layer over its own T tokens with its E / P experts, against one rank
    holding every rank's tokens and every expert (computed here, no group). Both entry points:
    ``moe_layer(group=...)`` (one node) and ``nn.MoE(ep_group=...)`` (the parts). On the CPU in
    float32 on the reference backend; on CUDA (NCCL) in bf16 on the default backend."""
    import torch.distributed as dist

    rank, P = dist.get_rank(), dist.get_world_size()
    hidden, ffn = dims
    dtype, backend = (torch.float32, "torch") if device == "cpu" else (torch.bfloat16, None)
    E_l = E // P
    g = torch.Generator().manual_seed(7)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device, dtype)

    x_all, dy_all = rand(P * T, hidden), rand(P * T, hidden)
    wr, w1, w2 = rand(E, hidden, scale=0.25), rand(E, 2 * ffn, hidden, scale=0.25), rand(E, hidden, ffn, scale=0.25)
    mine, local = slice(rank * T, (rank + 1) * T), slice(rank * E_l, (rank + 1) * E_l)
    leaves = [t.clone().requires_grad_() for t in (x_all, wr, w1, w2)]
    y_ref = moe.moe_layer(*leaves, top_k, backend=backend)
    ref = [y_ref, *torch.autograd.grad(y_ref, leaves, dy_all)]
    want = [ref[0][mine], ref[1][mine], ref[3][local], ref[4][local]]  # y, dx, this rank's experts' grads
    out = {"router_grad": ref[2]}
    x = x_all[mine].clone().requires_grad_()
    params = [wr.clone().requires_grad_(), w1[local].clone().requires_grad_(), w2[local].clone().requires_grad_()]
    y = moe.moe_layer(x, *params, top_k, backend=backend, group=dist.group.WORLD)
    dx, dwr, dw1, dw2 = torch.autograd.grad(y, [x, *params], dy_all[mine])
    out["layer"] = [torch.equal(a, b) for a, b in zip([y, dx, dw1, dw2], want)]
    out["layer_router_grad"] = dwr
    m = fd.nn.MoE(E, hidden, ffn, top_k, backend=backend, ep_group=dist.group.WORLD, params_dtype=dtype, device=device)
    with torch.no_grad():
        m.router.weight.copy_(wr), m.experts.fc1.weight.copy_(w1[local]), m.experts.fc2.weight.copy_(w2[local])
    x = x_all[mine].clone().requires_grad_()
    y = m(x)
    dx, dw1, dw2 = torch.autograd.grad(y, [x, m.experts.fc1.weight, m.experts.fc2.weight], dy_all[mine])
    out["module"] = [torch.equal(a, b) for a, b in zip([y, dx, dw1, dw2], want)]
    out["experts_here"] = m.experts.num_experts
    return out


def check_ep(P: int, results: list, E: int) -> None:
    """Every rank's y, dx and expert grads bitwise one rank's; the router grad summed over the
    ranks to rounding (also ``test_moe_gpu.py``'s check)."""
    for rank, r in enumerate(results):
        assert r["experts_here"] == E // P
        assert r["layer"] == [True] * 4, f"rank {rank} of {P}: moe_layer(group=...) (y, dx, dw1, dw2)"
        assert r["module"] == [True] * 4, f"rank {rank} of {P}: nn.MoE(ep_group=...) (y, dx, dw1, dw2)"
    router = sum(r["layer_router_grad"].float() for r in results)
    torch.testing.assert_close(router, results[0]["router_grad"].float(), atol=2e-2 * P, rtol=2e-2)


@pytest.fixture(scope="module", params=[2, 4], ids=lambda p: f"{p}ranks")
def ep_results(request):
    fdd = pytest.importorskip("functional_dw.distributed")
    P = request.param
    return P, fdd.launch(_ep_job, P, 8, 9, 2, backend="gloo", timeout=60, deadline=240)


def test_expert_parallel_is_bitwise_one_rank(ep_results):
    """y, dx and each rank's experts' weight grads bitwise one rank's (the rows reach each
    expert in the same order); the router's grad, a sum over the ranks' tokens, to rounding."""
    check_ep(*ep_results, E=8)


def _ep_second_order_job(E: int, T: int, top_k: int) -> dict:
    """A gradient penalty through nn.MoE(ep_group=...) (dx with create_graph, then the grad of
    |dx|^2), against one rank holding every token and expert (nn.MoE without a group), float64."""
    import torch.distributed as dist

    rank, P = dist.get_rank(), dist.get_world_size()
    E_l = E // P
    torch.manual_seed(11)
    full = fd.nn.MoE(E, H, FF, top_k, backend="torch", params_dtype=F64)
    x_all = torch.randn(P * T, H, dtype=F64)
    mine, local = slice(rank * T, (rank + 1) * T), slice(rank * E_l, (rank + 1) * E_l)
    m = fd.nn.MoE(E, H, FF, top_k, backend="torch", params_dtype=F64, ep_group=dist.group.WORLD)
    with torch.no_grad():
        m.router.weight.copy_(full.router.weight)
        (
            m.experts.fc1.weight.copy_(full.experts.fc1.weight[local]),
            m.experts.fc2.weight.copy_(full.experts.fc2.weight[local]),
        )

    def penalty(module, x):
        x = x.clone().requires_grad_()
        y = module(x)
        (dx,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)
        w = [module.experts.fc1.weight, module.experts.fc2.weight]
        return torch.autograd.grad(dx.square().sum(), [x, *w])

    got, want = penalty(m, x_all[mine]), penalty(full, x_all)
    return {
        "ok": [
            torch.allclose(a, b, rtol=1e-9, atol=1e-12)
            for a, b in zip(got, [want[0][mine], want[1][local], want[2][local]])
        ]
    }


def test_expert_parallel_gradient_penalty_is_one_ranks():
    """The exchange's backward is itself differentiable (NOTE: [A backward through the exchange
    differentiates again]): second-order terms reach every rank's tokens and experts."""
    fdd = pytest.importorskip("functional_dw.distributed")
    for r in fdd.launch(_ep_second_order_job, 2, 8, 9, 2, backend="gloo", timeout=60, deadline=180):
        assert r["ok"] == [True, True, True]


def test_first_order_vjp_and_jacrev_of_the_one_node_layer():
    """torch.func.vjp's vjp_fn runs autograd with create_graph=True after its level exited (and
    jacrev vmaps it): first order, not a second-order gradient (NOTE: [A transform's dead
    level]); it was refused as "differentiated again". The grads are the parts'."""
    x, wr, w1, w2 = (t.detach() for t in _params())
    xs = x[:4]

    def layer(*a):
        return moe.moe_layer(*a, K, backend="torch")

    def parts(x, wr, w1, w2):
        return moe.layer_parts(x, fd.linear(x, wr, backend="torch"), _experts(w1, w2), K, "softmax", E)

    dy = torch.randn(T, H, dtype=F64)
    got = torch.func.vjp(layer, x, wr, w1, w2)[1](dy)
    want = torch.func.vjp(parts, x, wr, w1, w2)[1](dy)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert torch.equal(
        torch.func.jacrev(lambda x: layer(x, wr, w1, w2))(xs), torch.func.jacrev(lambda x: parts(x, wr, w1, w2))(xs)
    )


def test_the_one_node_layer_refuses_second_order_through_any_input():
    """Its saved intermediates carry no graph back to x, the router's weight or the experts'
    weights: a backward differentiated in any of them is refused, also where torch.func.vjp's
    vjp_fn runs inside a grad (grad of vjp: NOTE: [A transform's dead level]). Before, grad of
    vjp over x and autograd's second order in the router's weight came back silently wrong (or
    as a raw autograd error)."""
    x, wr, w1, w2 = (t.detach() for t in _params())
    dy = torch.randn(T, H, dtype=F64)

    def layer(*a):
        return moe.moe_layer(*a, K, backend="torch")

    for i in range(4):

        def outer(t, i=i):
            a = [x, wr, w1, w2]
            a[i] = t
            return torch.func.vjp(lambda x: layer(x, *a[1:]), a[0])[1](dy)[0].square().sum()

        with pytest.raises(NotImplementedError, match="differentiated again"):
            torch.func.grad(outer)((x, wr, w1, w2)[i])
    for which in ((1,), (2,), (3,), (1, 2)):  # a weight's second order by autograd (dy constant)
        a = [t.clone().requires_grad_(i in which) for i, t in enumerate((x, wr, w1, w2))]
        with pytest.raises(NotImplementedError, match="differentiated again"):
            torch.autograd.grad(layer(*a), [a[i] for i in which], dy, create_graph=True)


def test_autograd_over_a_torch_func_grad_of_the_one_node_layer_is_refused_there():
    """The experts' weights require grad outside torch.func.grad (a module's): the first-order
    result is the parts' and the one with frozen weights; a loss on it, then autograd, raises
    (NOTE: [Refused lazily]). Before, it came back silently missing the saved rows' terms."""
    x, wr, w1, w2 = (t.detach() for t in _params())

    def loss(f, w1):
        return lambda x: f(x, wr, w1, w2).square().sum()

    def layer(*a):
        return moe.moe_layer(*a, K, backend="torch")

    def parts(x, wr, w1, w2):
        return moe.layer_parts(x, fd.linear(x, wr, backend="torch"), _experts(w1, w2), K, "softmax", E)

    live = w1.clone().requires_grad_()
    got = torch.func.grad(loss(layer, live))(x)
    assert torch.equal(got, torch.func.grad(loss(layer, w1))(x))
    assert torch.equal(got, torch.func.grad(loss(parts, live))(x))
    with pytest.raises(NotImplementedError, match="^moe_layer: .*here by autograd beneath"):
        torch.autograd.grad(got.square().sum(), live)
    per_copy = [torch.func.vmap(torch.func.grad(loss(layer, w)))(x.expand(2, *x.shape)) for w in (live, w1)]
    assert torch.equal(*per_copy)  # (vmap(grad): one call per element, its backward was refused)
    with pytest.raises(NotImplementedError, match="differentiated again"):
        torch.autograd.grad(per_copy[0].square().sum(), live)
    penalty = torch.func.grad(loss(parts, live))(x).square().sum()  # the parts differentiate it
    assert torch.autograd.grad(penalty, live)[0].abs().sum() > 0

    def inside(f):  # torch.autograd.grad inside the transform: the grad level differentiates it
        def outer(xx):
            (gx,) = torch.autograd.grad(f(xx, wr, w1, w2).square().sum(), xx, create_graph=True)
            return gx.square().sum()

        return torch.func.grad(outer)(x)

    with pytest.raises(NotImplementedError, match="^moe_layer: .*inside a torch.func transform"):
        inside(layer)  # (it came back silently 0)
    assert inside(parts).abs().sum() > 0


def test_the_one_node_layer_under_autocast_runs_as_its_parts():
    """Under torch.autocast the eager layer computes what a compiled call and nn.MoE's parts do
    (each part casts as every layer does); it returned float32 before, the compiled one bf16."""
    x, wr, w1, w2 = (t.detach().float() for t in _params())

    def parts(x, wr, w1, w2):
        return moe.layer_parts(x, fd.linear(x, wr, backend="torch"), _experts(w1, w2), K, "softmax", E)

    torch._dynamo.reset()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = moe.moe_layer(x, wr, w1, w2, K, backend="torch")
        yc = torch.compile(lambda *a: moe.moe_layer(*a, K, backend="torch"), backend="eager")(x, wr, w1, w2)
        yp = parts(x, wr, w1, w2)
    assert y.dtype == torch.bfloat16 and torch.equal(y, yc) and torch.equal(y, yp)


def test_the_one_node_layer_refuses_to_be_differentiated_twice():
    """moe_layer's one node saves rows with no graph back to x: differentiating its backward is
    refused (before, second-order terms went silently missing); the parts differentiate twice."""
    x, wr, w1, w2 = _params()
    y = moe.moe_layer(x, wr, w1, w2, K, backend="torch")
    with pytest.raises(NotImplementedError, match="differentiated again"):
        torch.autograd.grad(y.square().sum(), x, create_graph=True)
    with pytest.raises(NotImplementedError, match="differentiated again"):
        torch.func.jacrev(torch.func.grad(lambda x: moe.moe_layer(x, wr, w1, w2, K, backend="torch").square().sum()))(
            x.detach()[:3]
        )

    def parts(x):
        logits = fd.linear(x, wr, backend="torch")
        probs, idx = moe.topk_router(logits, K)
        rows, probs_r, splits, order = moe.dispatch(x, probs, idx, E)
        return moe.combine(fd.grouped_mlp(rows, w1, w2, splits, probs=probs_r, backend="torch"), order, K)

    def second(f):
        xx = x.detach().clone().requires_grad_()
        (g,) = torch.autograd.grad(f(xx).square().sum(), xx, create_graph=True)
        return torch.autograd.grad(g.square().sum(), [xx, w1])

    for a, b in zip(second(parts), second(lambda x: _reference(x, wr, w1, w2, K))):
        torch.testing.assert_close(a, b)


def _ep_compile_job() -> bool:
    """nn.MoE(ep_group=...) under torch.compile: the exchange runs eagerly (a graph break), the
    rest compiled; the same y and grads as eager."""
    import torch.distributed as dist

    torch.manual_seed(5)
    m = fd.nn.MoE(4, H, FF, 2, backend="torch", ep_group=dist.group.WORLD)
    x = torch.randn(10, H)
    compiled = torch.compile(m, backend="aot_eager")
    out = []
    for f in (m, compiled):
        xx = x.clone().requires_grad_()
        y = f(xx)
        out.append([y, *torch.autograd.grad(y.square().sum(), [xx, *m.parameters()])])
    return all(torch.equal(a, b) for a, b in zip(*out))


def test_expert_parallel_under_torch_compile():
    fdd = pytest.importorskip("functional_dw.distributed")
    assert fdd.launch(_ep_compile_job, 1, backend="gloo", timeout=120, deadline=240) == [True]


def _ep_bad_job() -> list[str]:
    import torch.distributed as dist

    errors = []
    sizes = torch.tensor([[1, 1], [1, 1]])
    for call in (
        lambda: fd.nn.MoE(3, H, FF, 1, ep_group=dist.group.WORLD),
        lambda: moe_ep.from_experts(torch.zeros(2, H), torch.arange(2), torch.zeros(2, 2, dtype=torch.long), None),
        lambda: moe_ep.from_experts(torch.zeros(2, H), torch.zeros(2, dtype=torch.long), sizes, None),
        lambda: moe_ep.to_experts(torch.zeros(3, H), None, torch.tensor([1, 1, 0, 0]), None),
        lambda: moe.moe_layer(
            torch.zeros(4, H),
            torch.zeros(4, H),
            torch.zeros(4, 2 * FF, H),
            torch.zeros(4, H, FF),
            1,
            group=dist.group.WORLD,
        ),
    ):
        try:
            call()
        except (ValueError, TypeError) as e:
            errors.append(str(e))
    return errors


def test_expert_parallel_refuses_what_cannot_split():
    fdd = pytest.importorskip("functional_dw.distributed")
    errors = fdd.launch(_ep_bad_job, 2, backend="gloo", timeout=60, deadline=120)[0]
    assert len(errors) == 5
    assert "num_experts (3) must be a positive multiple of the group's 2 ranks" in errors[0]
    assert "from_experts" in errors[1]
    assert "perm must be a permutation" in errors[2]
    assert "splits count 2 rows but rows has 3" in errors[3]
    assert "each rank holds 2 (rank p: experts p * 2 on), so w1 must hold 2 experts; it holds 4" in errors[4]


def test_nn_moe_runs_its_experts_in_fp8_with_a_recipe():
    """nn.MoE(recipe=...) hands the recipe to its experts (the router stays in high precision):
    RowwiseScaling forced to FP8 (emulated on the CPU), within FP8's rounding of the same layer without one."""
    torch.manual_seed(0)
    plain = fd.nn.MoE(4, 32, 16, 2, backend="torch")
    m = fd.nn.MoE(4, 32, 16, 2, backend="torch", recipe=fd.fp8.RowwiseScaling(bf16_below=0))
    m.load_state_dict(plain.state_dict())
    x = torch.randn(64, 32)
    y, y_fp8 = plain(x), m(x)
    assert not torch.equal(y, y_fp8)  # FP8 ran
    assert ((y_fp8 - y).norm() / y.norm()) < 0.1
    y_fp8.square().sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters())


def _gathered_parts(m, x):
    """nn.MoE's math with the experts on the dispatch's gathered rows (x's grad through the
    dispatch's backward): what layer_parts ran before it handed the experts TopkRows."""
    probs, indices = moe.topk_router(m.router(x), m.top_k, m.score)
    rows, probs_r, splits, order = moe.dispatch(x, probs, indices, m.num_experts)
    return moe.combine(m.experts(rows, splits, probs_r), order, m.top_k)


@pytest.mark.parametrize("recipe", [None, "rowwise"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("save", ["default", "h", "x_only"])
@pytest.mark.parametrize("top_k", [1, 3])
def test_nn_moe_experts_read_x_through_topk_rows_bitwise(top_k, save, dtype, recipe):
    """Without an expert-parallel group nn.MoE's experts read x through TopkRows(order, k)
    (fc1 keeps x, not its k gathered copies): y and every grad the bits of the experts on the
    dispatch's gathered rows; the saved-tensor hooks see no [T * k, H] rows of x."""
    if recipe and save == "x_only":
        pytest.skip("x_only is refused with a recipe")
    torch.manual_seed(0)
    fp8 = fd.fp8.RowwiseScaling(bf16_below=0) if recipe else None
    m = fd.nn.MoE(6, 48, 16, top_k, backend="torch", save=save, params_dtype=dtype, recipe=fp8)
    x = torch.randn(13, 48, dtype=dtype, requires_grad=True)
    dy = torch.randn(13, 48, dtype=dtype)
    params = [x, *m.parameters()]
    rows_x = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: rows_x.append(t.shape) or t, lambda t: t):
        y = m(x)
    got = torch.autograd.grad(y, params, dy)
    y0 = _gathered_parts(m, x)
    want = torch.autograd.grad(y0, params, dy)
    assert torch.equal(y, y0)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    if recipe is None and top_k > 1:  # (with top_k=1 the rows have x's shape)
        assert (13 * top_k, 48) not in rows_x, rows_x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("top_k", [1, 3])
def test_sort_by_expert_is_the_dispatch_without_rows(top_k, dtype):
    """probs_r, splits and order are the dispatch's, and so is the probs grad, bit for bit;
    the record is a DispatchResiduals that keeps the order only (no rows, no x)."""
    torch.manual_seed(0)
    x = torch.randn(13, 48, dtype=dtype)
    probs, indices = moe.topk_router(torch.randn(13, 6, requires_grad=True), top_k)
    g = torch.randn(13 * top_k, dtype=probs.dtype)
    got = moe.sort_by_expert(probs, indices, 6)
    _, *want = moe.dispatch(x, probs, indices, 6)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    (d_got,) = torch.autograd.grad(got[0], probs, g)
    (d_want,) = torch.autograd.grad(want[0], probs, g)
    assert torch.equal(d_got, d_want)
    _, res = moe.sort_by_expert_fwd(probs.detach(), indices, 6)
    assert type(res) is moe.DispatchResiduals
    assert [t.data_ptr() for t in fd.saved_activations(res)] == [res.order.data_ptr()]
    with pytest.raises(TypeError, match="sort_by_expert: probs"):
        moe.sort_by_expert(None, indices, 6)
    with pytest.raises(ValueError, match="sort_by_expert: probs"):
        moe.sort_by_expert(probs.t(), indices, 6)
    with pytest.raises(ValueError, match=r"lie in \[0, 6\)"):
        moe.sort_by_expert(probs, torch.full_like(indices, 6), 6)


_GATHERS = {torch.ops.aten.index_select.default, torch.ops.aten.gather.default, torch.ops.aten.index.Tensor}


class _CountRowGathers(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the gathers whose output is [R, H] (k gathered copies of x's rows)."""

    def __init__(self, shape):
        super().__init__()
        self.shape, self.count = shape, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.count += func in _GATHERS and tuple(out.shape) == self.shape
        return out


def test_nn_moe_without_a_group_gathers_no_rows_beyond_its_experts(monkeypatch):
    """layer_parts without a group routes by sort_by_expert: no dispatch (refused here) and, in
    forward and backward, no [T*k, H] gather beyond what the experts and the combine make when
    called directly on sort_by_expert's output."""
    torch.manual_seed(0)
    m = fd.nn.MoE(6, 48, 16, 3, backend="torch")
    x = torch.randn(13, 48, requires_grad=True)
    dy = torch.randn(13, 48)

    def parts():
        probs, indices = moe.topk_router(m.router(x), 3)
        probs_r, splits, order = moe.sort_by_expert(probs, indices, 6)
        return moe.combine(m.experts(x, splits, probs_r, rows=fd.TopkRows(order, 3)), order, 3)

    counts = []
    for f in (parts, lambda: m(x)):
        with _CountRowGathers((13 * 3, 48)) as mode:
            torch.autograd.grad(f(), [x, *m.parameters()], dy)
        counts.append(mode.count)
    with _CountRowGathers((13 * 3, 48)) as mode:
        _gathered_parts(m, x)
    assert counts[0] == counts[1] and mode.count > 0, (counts, mode.count)

    def refuse(*a, **k):
        raise AssertionError("layer_parts gathered rows through moe.dispatch without a group")

    monkeypatch.setattr(moe, "dispatch", refuse)
    assert torch.equal(m(x), parts())


# --- the per-token sum (moe_ep.token_sum: the combine's, the dispatch's backward's) -------------


def _routed(T, k, H, dtype, seed=0):
    """rows [T * k, H] and the dispatch's order for T tokens of k choices over 4 experts."""
    g = torch.Generator().manual_seed(seed)
    indices = torch.randint(0, 4, (T, k), generator=g)
    order = torch.argsort(indices.flatten(), stable=True)
    return (torch.randn(T * k, H, generator=g) * 3).to(dtype), order


def test_token_sum_adds_in_float32_in_choice_order_and_rounds_once():
    """Each token's rows are added in choice order in float32 ((r0 + r1) + r2: no pairwise or
    reordered sum), and rounded to rows' dtype once; with two rows that is exactly torch's sum."""
    order = torch.arange(3)
    rows = torch.tensor([[1.0], [1e8], [-1e8]])  # choice order loses the 1: (1 + 1e8) - 1e8 = 0
    assert moe_ep.token_sum(rows, order, 3).item() == 0.0
    assert moe_ep.token_sum(rows.flip(0), order, 3).item() == 1.0  # (-1e8 + 1e8) + 1
    assert moe_ep.token_sum(rows, torch.tensor([2, 0, 1]), 3).item() == 1.0  # choices 1e8, -1e8, 1
    for dtype in (torch.bfloat16, torch.float32, torch.float64):
        rows, order = _routed(6, 2, 5, dtype)
        want = rows.index_select(0, moe_ep.inverse(order)).view(6, 2, 5).sum(1)
        assert torch.equal(moe_ep.token_sum(rows, order, 2), want), dtype
        rows, order = _routed(6, 4, 5, dtype)
        got = moe_ep.token_sum(rows, order, 4)
        per = rows.index_select(0, moe_ep.inverse(order)).view(6, 4, 5)
        acc = torch.promote_types(dtype, torch.float32)
        want = ((per[:, 0].to(acc) + per[:, 1].to(acc)) + per[:, 2].to(acc)) + per[:, 3].to(acc)
        assert got.dtype == dtype and torch.equal(got, want.to(dtype)), dtype


def test_token_sum_refuses_an_order_of_other_rows():
    rows, order = _routed(4, 2, 3, torch.float32)
    with pytest.raises(ValueError, match=r"token_sum: order \(7,\) must hold one entry per row of rows \(8, 3\)"):
        moe_ep.token_sum(rows, order[:-1], 2)
    with pytest.raises(ValueError, match="top_k=3 divides"):
        moe_ep.token_sum(rows, order, 3)
    for k in (0, -2, 2.0):  # (was a ZeroDivisionError, an unflatten error)
        with pytest.raises(ValueError, match="top_k must be a positive int"):
            moe_ep.token_sum(rows, order, k)
    with pytest.raises(TypeError, match="order must be int64 or int32"):
        moe_ep.token_sum(rows, order.float(), 2)
    # the kernel reads the order where the rows are: an order elsewhere is refused, not launched
    # (on the CPU, an order on meta gave uninitialized memory); combine takes the same check
    for f in (moe_ep.token_sum, moe.combine):
        with pytest.raises(ValueError, match="order is on meta and rows on cpu: move order to rows' device"):
            f(rows, order.to("meta"), 2)


def test_token_sum_kernel_in_the_interpreter_is_the_torch_ops_bitwise():
    """The Triton kernel (run by Triton's CPU interpreter) against the torch ops, bit for bit:
    bf16, fp16, fp32; one, three and eight choices; widths across its column tiles; no tokens;
    rows with a row stride and broadcast rows (stride 0, as autograd's expanded grads). (The
    interpreter casts float32 to bf16 by truncation, the GPU to nearest: for bf16 the float32
    sum is compared, truncated; the GPU test compares the bf16 bits.)"""
    from test_fp8_rowwise import _interpret

    out = _interpret("""
        from functional_dw import moe_ep
        from functional_dw.kernels import triton_tokens as tt
        g = torch.Generator().manual_seed(0)
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            for T, k, H in ((5, 1, 33), (7, 3, 300), (3, 8, 16), (0, 2, 8), (4, 3, 1)):
                order = torch.argsort(torch.randint(0, 4, (T * k,), generator=g), stable=True)
                base = (torch.randn(T * k, H + 3, generator=g) * 5).to(dtype)
                for rows in (base[:, :H].contiguous(), base[:, :H], base[:1, :H].expand(T * k, H)):
                    got = tt.token_sum(rows, moe_ep.inverse(order), k)
                    want = moe_ep.token_sum(rows, order, k)  # (CPU tensors: the torch ops)
                    if dtype == torch.bfloat16:  # the sum in float32, cast as the interpreter casts
                        acc = moe_ep.token_sum(rows.float(), order, k)
                        want = (acc.view(torch.int32) & -65536).view(torch.float32).to(dtype)
                    print(got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want))
    """)
    assert out.split() == ["True"] * 45, out


def test_token_sum_kernel_keeps_signed_zeros_and_copies_one_choice():
    """Bitwise includes the sign of zero: the kernel starts from choice 0 as loaded, as the torch
    ops do, not from 0.0 (0.0 + -0.0 is +0.0: a token whose rows are all -0.0, common in grads,
    would come out +0.0, which torch.equal does not see); with k = 1 the row is copied, bits and
    all. (In Triton's interpreter; the GPU test runs the same rows.)"""
    from test_fp8_rowwise import _interpret

    out = _interpret("""
        from functional_dw import moe_ep
        from functional_dw.kernels import triton_tokens as tt
        ints = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            for k in (1, 2, 3):
                rows = torch.tensor([[-0.0, 0.0, -0.0, 2.0]] * (3 * k)).to(dtype)
                order = torch.randperm(3 * k, generator=torch.Generator().manual_seed(k))
                got = tt.token_sum(rows, moe_ep.inverse(order), k)
                want = moe_ep.token_sum(rows, order, k)
                print(torch.equal(got.view(ints[dtype]), want.view(ints[dtype])))
    """)
    assert out.split() == ["True"] * 9, out


def test_token_sum_gate_asks_whether_compiling_before_anything_dynamo_cannot_trace(monkeypatch):
    """Under torch.compile (dynamo traces the combine's forward and the dispatch's backward, on
    fake CUDA tensors) ``available`` must say no before it reaches functorch's queries, which
    dynamo cannot trace: on CUDA that is a graph break inside the autograd.Function
    (fullgraph=True: an error). Here on the CPU: rows that pass as CUDA, a compile that pretends."""
    from functional_dw.kernels import triton_tokens

    def untraceable(*args):
        raise AssertionError("dynamo cannot trace this: available reached it while compiling")

    monkeypatch.setattr(triton_tokens, "triton", triton_tokens.triton or object())
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch._C._functorch, "is_functorch_wrapped_tensor", untraceable)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert triton_tokens.available(torch.ones(4, 2)) is False


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_token_sum_on_cuda_compiles_fullgraph():
    """The combine and the dispatch's backward compiled in one graph on CUDA: the torch ops run
    there (the gate says no before anything dynamo cannot trace), the same bits as eager."""
    rows, order = _routed(64, 2, 256, torch.float32)
    x = rows[::2].clone().cuda().requires_grad_()
    indices = torch.randint(0, 4, (64, 2), generator=torch.Generator().manual_seed(1)).cuda()

    def f(x):
        r, _, _, order = moe.dispatch(x, None, indices, 4)
        return moe.combine(r * 2, order, 2)

    y = f(x)
    (dx,) = torch.autograd.grad(y, x, torch.ones_like(y))
    y2 = torch.compile(f, backend="aot_eager", fullgraph=True)(x)
    (dx2,) = torch.autograd.grad(y2, x, torch.ones_like(y2))
    assert torch.equal(y, y2) and torch.equal(dx, dx2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_token_sum_on_cuda_is_the_torch_ops_bitwise():
    """On CUDA the kernel runs where nothing records the rows; where autograd records them the
    torch ops run (differentiable): the same bits, k = 1, 2, 8, bf16 and fp32."""
    pytest.importorskip("triton")
    for dtype in (torch.bfloat16, torch.float32):
        for T, k, H in ((1000, 1, 2048), (4096, 2, 4096), (777, 8, 2048 + 64)):
            rows, order = _routed(T, k, H, dtype)
            rows, order = rows.cuda(), order.cuda()
            got = moe_ep.token_sum(rows, order, k)
            ops = moe_ep.token_sum(rows.clone().requires_grad_(), order, k)
            assert got.grad_fn is None and ops.grad_fn is not None
            bits = torch.int16 if dtype == torch.bfloat16 else torch.int32  # (bits: -0.0 is not 0.0)
            assert torch.equal(got.view(bits), ops.detach().view(bits)), (dtype, T, k, H)
