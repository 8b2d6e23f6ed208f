"""DistributedWeight under saved-tensor hooks and retain_graph: the bug this project exists for."""

from __future__ import annotations

import contextlib
import gc
import weakref

import pytest
import torch
import torch.nn.functional as F

import functional_dw as fd
from conftest import BWD_SCALE, FWD_SCALE, HOOKS, FakeDW, PathRecorder, assert_close, assert_same
from helpers import grouped_inputs, ref_grouped

E, K, N = 3, 16, 8
SPLITS = [5, 0, 7]
T = sum(SPLITS)


def _inputs(dtype=torch.float32, fused=False, seed=0, experts=E):
    x, fulls, bias, dy = grouped_inputs(SPLITS, K, N, seed=seed, dtype=dtype, draw_dtype=None, grad=True)
    return x, FakeDW.group_of(fulls[:experts], fused=fused), bias, dy


def _run(layer, hook=None, backwards=1, fused=False, path=None, seed=0):
    """Forward (under ``hook`` if given) and ``backwards`` backward passes; returns the results,
    the DW group and the recorder."""
    x, ws, bs, dy = _inputs(fused=fused, seed=seed, experts=1 if layer == "linear" else E)
    ctx = HOOKS[hook]() if hook else None
    kw = dict(fuse_wgrad_accumulation=fused)
    with ctx if ctx else contextlib.nullcontext():
        if layer == "linear":
            y = fd.linear(x, ws[0], bs[0], **kw)
        else:
            rec = PathRecorder()
            y = fd.grouped_linear(x, ws, SPLITS, bs, use_grouped_tensor=path, backend=rec, **kw)
            rec.check(path, x, [m.full for m in ws] if hasattr(ws[0], "full") else ws)
    for i in range(backwards):
        y.backward(dy, retain_graph=i < backwards - 1)
    grads = {
        "y": y.detach(),
        "dx": x.grad,
        "dw": [w.grad for w in ws],
        "db": [b.grad for b in bs[: len(ws)]],
        "main_grad": [getattr(w, "main_grad", None) for w in ws],
    }
    return grads, ws, ctx


LAYERS = [("linear", None), ("grouped", False), ("grouped", True)]
LAYER_IDS = ["linear", "grouped-split", "grouped-grouped"]


@pytest.mark.parametrize("layer,path", LAYERS, ids=LAYER_IDS)
def test_dw_hooks_fire_and_grads_are_right(layer, path):
    grads, ws, _ = _run(layer, path=path)
    leader = ws[0]
    assert leader.calls == {"forward": 1, "backward": 1, "finalize": 1}
    assert all(w.calls == {"forward": 0, "backward": 0, "finalize": 0} for w in ws[1:]), "followers are never called"
    x, _, bs, dy = _inputs(experts=len(ws))
    fulls = [w.full for w in ws]
    if layer == "linear":
        y = F.linear(x, FWD_SCALE * fulls[0], bs[0])
        dx = dy @ (BWD_SCALE * fulls[0])
        dws = [(dy.t() @ x)[: N // 2]]
    else:
        y = ref_grouped(x, [FWD_SCALE * f for f in fulls], SPLITS, bs)
        dx = torch.cat([d @ (BWD_SCALE * f) for d, f in zip(dy.split(SPLITS), fulls)])
        dws = [(d.t() @ xe)[: N // 2] for d, xe in zip(dy.split(SPLITS), x.split(SPLITS))]
    torch.testing.assert_close(grads["y"], y.detach())
    torch.testing.assert_close(grads["dx"], dx, msg="dgrad must use materialize_group_for_backward")
    for got, want in zip(grads["dw"], dws):
        torch.testing.assert_close(got, want)
    if layer == "grouped":
        assert torch.equal(grads["dw"][1], torch.zeros(N // 2, K)), "a zero-token expert gets zeros, not None"


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
@pytest.mark.parametrize("layer,path", LAYERS, ids=LAYER_IDS)
def test_hooks_give_bitwise_equal_results(hook_name, layer, path, fused):
    want, _, _ = _run(layer, path=path, fused=fused)
    got, ws, rec = _run(layer, hook=hook_name, path=path, fused=fused)
    assert ws[0].calls == {"forward": 1, "backward": 1, "finalize": 1}
    for key in want:
        assert_same(got[key], want[key], key)
    if fused:
        assert all(w.grad_added_to_main_grad for w in ws)
    # the pack hook saw activations only: never a weight, plain or distributed, nor a gathered one
    assert rec.packed, "the hook must see the saved activation"
    forbidden = {id(w) for w in ws} | {w.data_ptr() for w in ws} | {m.data_ptr() for m in ws[0].materialized}
    for t in rec.packed:
        assert not fd.is_distributed_weight(t)
        assert id(t) not in forbidden and t.data_ptr() not in forbidden
    assert rec.unpacks == len(rec.packed), "each saved tensor is unpacked exactly once per backward"


@pytest.mark.parametrize("hook", ["identity", "clone", "save_on_cpu"])
@pytest.mark.parametrize("layer,path", LAYERS, ids=LAYER_IDS)
def test_retain_graph_three_backwards(hook, layer, path):
    once, _, _ = _run(layer, path=path)
    thrice, ws, rec = _run(layer, hook=hook, path=path, backwards=3)
    assert ws[0].calls == {"forward": 1, "backward": 3, "finalize": 3}
    assert rec.unpacks == 3 * len(rec.packed)
    torch.testing.assert_close(thrice["dx"], 3 * once["dx"])
    for a, b in zip(thrice["dw"], once["dw"]):
        torch.testing.assert_close(a, 3 * b)
    for a, b in zip(thrice["db"], once["db"]):
        torch.testing.assert_close(a, 3 * b)


@pytest.mark.parametrize("layer,path", LAYERS, ids=LAYER_IDS)
def test_fused_accumulates_with_retain_graph(layer, path):
    once, _, _ = _run(layer, path=path, fused=True)
    twice, _, _ = _run(layer, path=path, fused=True, backwards=2, hook="identity")
    for a, b in zip(twice["main_grad"], once["main_grad"]):
        if b is not None:
            torch.testing.assert_close(a, 2 * b)


def test_saved_activations_are_freed_with_the_graph():
    x, ws, bs, dy = _inputs()
    refs = []

    def pack(t):
        copy = t.clone()
        refs.append(weakref.ref(copy))
        return copy

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = fd.grouped_linear(x, ws, SPLITS, bs)
    y.backward(dy, retain_graph=True)
    assert refs and all(r() is not None for r in refs), "retain_graph keeps them"
    del y
    gc.collect()
    assert all(r() is None for r in refs), "the saved activations die with the graph"


def test_plain_weights_under_hooks_pack_only_x():
    """Plain parameters too: TE-style saving would pack every weight; we pack x once."""
    x = torch.randn(T, K, requires_grad=True)
    ws = [torch.randn(N, K, requires_grad=True) for _ in range(E)]
    rec = HOOKS["identity"]()
    with rec:
        y = fd.grouped_linear(x, ws, SPLITS)
    assert len(rec.packed) == 1 and rec.packed[0] is x
    with rec:
        y2 = fd.linear(x, ws[0])
    assert len(rec.packed) == 2 and rec.packed[1] is x
    (y.sum() + y2.sum()).backward()


def test_fused_plain_weights_main_grad_semantics():
    """TE 4.4: accumulate into fp32 main_grad; grad_added_to_main_grad -> True and a zero dummy
    is returned; without the attribute the weight gets no .grad; the group's accumulate flag is weights[0]'s, as in TE."""
    x = torch.randn(T, K, dtype=torch.bfloat16, requires_grad=True)
    ws = [torch.randn(N, K, dtype=torch.bfloat16, requires_grad=True) for _ in range(E)]
    for w in ws:
        w.main_grad = torch.ones(N, K, dtype=torch.float32)
    ws[0].grad_added_to_main_grad = False
    y = fd.grouped_linear(x, ws, SPLITS, fuse_wgrad_accumulation=True, use_grouped_tensor=False)
    dy = torch.randn_like(y)
    y.backward(dy)
    ref = [(d.double().t() @ xe.double()) for d, xe in zip(dy.split(SPLITS), x.detach().split(SPLITS))]
    torch.testing.assert_close(ws[0].main_grad.double(), 1 + ref[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ws[1].main_grad.double(), torch.ones(N, K, dtype=torch.float64))  # no tokens
    torch.testing.assert_close(ws[2].main_grad.double(), 1 + ref[2], rtol=1e-5, atol=1e-5)
    assert ws[0].grad_added_to_main_grad is True
    assert ws[0].grad is not None and not ws[0].grad.any(), "a zero dummy keeps DDP hooks firing"
    assert ws[1].grad is None and ws[2].grad is None


def test_overwrite_main_grad():
    x = torch.randn(T, K, requires_grad=True)
    w = torch.randn(N, K, requires_grad=True)
    w.main_grad, w.overwrite_main_grad = torch.ones(N, K), True
    y = fd.linear(x, w, fuse_wgrad_accumulation=True)
    dy = torch.randn_like(y)
    y.backward(dy)
    torch.testing.assert_close(w.main_grad, dy.t() @ x.detach())


def test_fused_needs_main_grad():
    x = torch.randn(T, K, requires_grad=True)
    w = torch.randn(N, K, requires_grad=True)
    y = fd.linear(x, w, fuse_wgrad_accumulation=True)
    with pytest.raises(ValueError, match="main_grad"):
        y.sum().backward()


@pytest.mark.parametrize("layer,path", LAYERS, ids=LAYER_IDS)
def test_weight_changed_in_place_raises(layer, path):
    x, ws, bs, dy = _inputs(experts=1 if layer == "linear" else E)
    y = fd.linear(x, ws[0]) if layer == "linear" else fd.grouped_linear(x, ws, SPLITS, use_grouped_tensor=path)
    with torch.no_grad():
        ws[0].add_(1.0)
    with pytest.raises(RuntimeError, match="modified in place"):
        y.backward(torch.ones_like(y))


def test_megatron_offload_frees_device_copy_and_hands_back_once():
    """The offload hook copies x out and can be read exactly once: the bridge reads
    ctx.saved_tensors once per backward, so this works; a retain_graph second backward is the
    hook's own limit (it raises), not ours."""
    x, ws, bs, dy = _inputs()
    rec = HOOKS["megatron_offload"]()
    with rec:
        y = fd.grouped_linear(x, ws, SPLITS, bs)
    y.backward(dy, retain_graph=True)
    with pytest.raises(KeyError):
        y.backward(dy)


def test_any_distributed_reads_the_leader_of_a_tensor_or_a_sequence():
    """``any_distributed`` (the torch.compile guard of both layers): a DistributedWeight given
    alone or leading a list/tuple; never a plain tensor (0-d included), a list of them or an
    empty list; an object without the attribute is not one."""
    from functional_dw.distributed_weight import any_distributed

    group = FakeDW.group_of([torch.randn(N, K) for _ in range(2)])
    plain = [torch.randn(N, K), torch.randn(N, K)]
    assert any_distributed(group[0]) is True
    assert any_distributed(group[:1]) is True
    assert any_distributed(tuple(group)) is True
    assert any_distributed([group[0], *plain]) is True
    assert any_distributed(plain[0]) is False
    assert any_distributed(torch.tensor(1.0)) is False
    assert any_distributed(plain) is False
    assert any_distributed([]) is False
    assert any_distributed([object()]) is False


def test_fused_frozen_group_finalizes_with_its_grad_buffers():
    """Every weight frozen and fused: no wgrad GEMM, but the leader still finalizes (its
    collectives match the other ranks'), handing over the group's own ``grad_buffer()``s (the
    fp32 buffers every rank reduces), not scratch or zeros in the layer's dtype."""
    fulls = [torch.randn(N, K, dtype=torch.bfloat16) for _ in range(E)]
    group = FakeDW.group_of(fulls, fused=True)
    for m in group:
        m.requires_grad_(False)
    got = []
    real = group[0].finalize_group_grads
    group[0].finalize_group_grads = lambda wgrads: (got.append(list(wgrads)), real(wgrads))[1]
    x = torch.randn(T, K, dtype=torch.bfloat16, requires_grad=True)
    fd.grouped_linear(x, group, SPLITS, fuse_wgrad_accumulation=True).sum().backward()
    assert x.grad is not None and len(got) == 1
    assert len(got[0]) == E and all(g is m.buffer for g, m in zip(got[0], group))


# --- under torch.autocast (NOTE: [Autocast] in functional_dw/_amp.py) -------------------------------


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
@pytest.mark.parametrize("layer,path", LAYERS, ids=LAYER_IDS)
def test_dw_under_autocast_is_cast_after_each_gather(layer, path, fused):
    """fp32 DistributedWeights under bf16 autocast: each gather (forward's, backward's) is cast
    to bf16 and the GEMMs run on it, bitwise F.linear per expert on the gathered weights cast;
    the weight grads reach finalize in the weights' dtype (fp32) with the bf16 product's values,
    or, fused, the grad buffer at fp32 accuracy; hooks see only activations. (The original
    refused the bf16 dy in backward.)"""
    x, ws, bs, dy = _inputs(fused=fused, experts=1 if layer == "linear" else E)
    bf = torch.bfloat16
    rec = HOOKS["clone"]()
    with rec, torch.autocast("cpu", dtype=bf):
        if layer == "linear":
            y = fd.linear(x, ws[0], bs[0], fuse_wgrad_accumulation=fused)
        else:
            y = fd.grouped_linear(x, ws, SPLITS, bs, use_grouped_tensor=path, fuse_wgrad_accumulation=fused)
    y.backward(dy.to(bf))
    assert not any(isinstance(t, FakeDW) for t in rec.packed)
    assert ws[0].calls == {"forward": 1, "backward": 1, "finalize": 1}
    # the model without the feature: the layer on plain weights, cast by hand (forward's gather,
    # backward's), no autocast
    x16, dy16, bs16 = x.detach().to(bf).requires_grad_(), dy.to(bf), [b.detach().to(bf) for b in bs]

    def plain(scale):
        w16 = [(scale * w.full).to(bf).requires_grad_() for w in ws]
        if layer == "linear":
            return fd.linear(x16, w16[0], bs16[0]), w16
        return fd.grouped_linear(x16, w16, SPLITS, bs16[: len(ws)], use_grouped_tensor=path), w16

    assert_same(y, plain(FWD_SCALE)[0])
    y16, w16 = plain(BWD_SCALE)
    y16.backward(dy16)
    assert_same(x.grad, x16.grad.float())
    splits = [T] if layer == "linear" else SPLITS
    for w, w_, xe, de in zip(ws, w16, x16.detach().double().split(splits), dy16.double().split(splits)):
        if fused:  # finalize added the shard of the fp32 buffer the GEMM wrote into: at fp32 accuracy
            assert_close(w.main_grad, (de.T @ xe)[: N // 2], bf, "main_grad", mag=(de.abs().T @ xe.abs())[: N // 2])
        else:
            assert_same(w.grad, w_.grad[: N // 2].float())
