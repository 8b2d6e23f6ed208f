"""FP8 in functional_dw.nn: the recipe argument, TE's autocast (through a fake TE module), the
delayed-scaling state as buffers and TE's ``_extra_state``, and the lazy updates."""

from __future__ import annotations

import contextlib
import io
import sys
import types

import pytest
import torch
import torch.utils._pytree as pytree

import functional_dw as fd
from conftest import assert_same
from helpers import draws, grouped_module, linear_module
from functional_dw import fp8
from functional_dw import nn as fnn
from functional_dw import nn_fp8

E, K, N = 3, 32, 16
SPLITS = [16, 0, 32]
T = sum(SPLITS)
RECIPES = {
    "delayed": fp8.DelayedScaling(amax_history_len=4),
    "current": fp8.Float8CurrentScaling(),
    "block": fp8.Float8BlockScaling(),
}
STATE_BUFFERS = ["fp8_amax_history_fwd", "fp8_scale_fwd", "fp8_amax_history_bwd", "fp8_scale_bwd"]


def _data(step, kind):
    x, dy = draws((T, K), (T, N), seed=step)
    return x * (step + 1), dy


def _module(kind, recipe=None, **kw):
    if kind == "linear":
        return linear_module(K, N, recipe=recipe, **kw)
    return grouped_module(E, K, N, recipe=recipe, **kw)


def _params(m):
    return [m.weight] if isinstance(m, fnn.Linear) else m.weights()


def _biases(m):
    return [m.bias] if isinstance(m, fnn.Linear) else m.biases()


def _functional(m, x, recipe, state):
    ws, bs = _params(m), _biases(m)
    if isinstance(m, fnn.Linear):
        return fd.linear(x, ws[0], bs[0], recipe=recipe, fp8_state=state)
    return fd.grouped_linear(x, ws, SPLITS, bs, recipe=recipe, fp8_state=state)


def _forward(m, x):
    return m(x) if isinstance(m, fnn.Linear) else m(x, SPLITS)


@pytest.mark.parametrize("kind", ["linear", "grouped"])
@pytest.mark.parametrize("name", list(RECIPES))
def test_module_steps_equal_functional_steps_with_updates_between(name, kind):
    """Three steps: the module (lazy updates) against the functional API with
    ``fp8.update_state_`` after each step: the same outputs, grads and states."""
    recipe = RECIPES[name]
    m, ref = _module(kind, recipe), _module(kind)
    gemms = 1 if kind == "linear" else E
    state = fp8.init_state(recipe, num_gemms=gemms) if name == "delayed" else None
    for step in range(3):
        x, dy = _data(step, kind)
        xm, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
        ym, yr = _forward(m, xm), _functional(ref, xr, recipe, state)
        ym.backward(dy)
        yr.backward(dy)
        if state is not None:
            fp8.update_state_(state, recipe)
        assert_same(ym, yr, f"step {step}: y")
        assert_same(xm.grad, xr.grad, f"step {step}: dx")
        assert_same([p.grad for p in m.parameters()], [p.grad for p in ref.parameters()], f"step {step}: grads")
    if state is None:
        assert m.fp8_state is None and all(getattr(m, b) is None for b in STATE_BUFFERS)
        assert m.get_extra_state().numel() == 0  # TE writes an empty tensor for stateless recipes
    else:
        m.get_extra_state()  # applies the pending updates of the last step
        assert_same(pytree.tree_leaves(m.fp8_state), pytree.tree_leaves(state), "state")
        assert float(state.scale_fwd[0]) != 1.0


@pytest.mark.parametrize("kind", ["linear", "grouped"])
def test_state_is_buffers_and_te_extra_state(kind):
    """The state lives in non-persistent buffers (following .to, float32 under .to(dtype)); the
    state_dict has TE's keys only, its _extra_state TE's format; another module (or TE) loads it."""
    recipe = RECIPES["delayed"]
    m = _module(kind, recipe)
    gemms = 1 if kind == "linear" else E
    assert [n for n, _ in m.named_buffers()] == STATE_BUFFERS
    assert m.fp8_state.num_gemms == gemms and m.fp8_state.history_len == 4
    x, dy = _data(0, kind)
    _forward(m, x.requires_grad_()).backward(dy)
    sd = m.state_dict()
    params = {n for n, _ in m.named_parameters()}
    assert set(sd) == params | {"_extra_state"}
    saved = fp8.read_extra_state(sd["_extra_state"])
    assert saved["recipe"] == recipe and saved["extra_fp8_variables"]["num_gemms"] == gemms
    loaded = fp8.state_from_extra_state(sd["_extra_state"], gemms)
    assert_same(pytree.tree_leaves(loaded), pytree.tree_leaves(m.fp8_state))
    assert float(loaded.scale_fwd[0]) != 1.0, "the step's update was applied before saving"

    other = _module(kind)  # no recipe: no state until it loads one
    assert other.fp8_state is None
    other.load_state_dict(sd, strict=True)
    assert_same(pytree.tree_leaves(other.fp8_state), pytree.tree_leaves(m.fp8_state))
    assert other._fp8_recipe == recipe and other.recipe is None

    m.to(torch.bfloat16)
    assert m.weight0.dtype == torch.bfloat16 if kind == "grouped" else m.weight.dtype == torch.bfloat16
    assert all(getattr(m, b).dtype == torch.float32 for b in STATE_BUFFERS)
    assert_same(pytree.tree_leaves(m.fp8_state), pytree.tree_leaves(other.fp8_state), "kept exactly")


def test_meta_init_then_to_empty_and_reset_parameters():
    m = fnn.GroupedLinear(E, K, N, recipe=RECIPES["delayed"], device="meta")
    assert m.fp8_scale_fwd.is_meta
    m.to_empty(device="cpu")
    m.reset_parameters()
    assert torch.equal(m.fp8_scale_fwd, torch.ones(3 * E)) and not m.fp8_amax_history_fwd.any()
    assert not m.fp8_amax_history_bwd.any() and torch.equal(m.fp8_scale_bwd, torch.ones(2 * E))


def test_no_grad_forward_records_but_leaves_no_update_pending():
    recipe = RECIPES["delayed"]
    m = _module("grouped", recipe)
    x, _ = _data(0, "grouped")
    with torch.no_grad():
        m(x, SPLITS)
        m(2 * x, SPLITS)
    assert float(m.fp8_amax_history_fwd[0, 0]) == float(fp8.amax_of(2 * x[:16]))
    assert m._fp8_pending == set()
    m(x, SPLITS)  # no update ran: the inference amaxes are still in row 0 (TE keeps maxing into it)
    assert float(m.fp8_amax_history_fwd[0, 0]) == float(fp8.amax_of(2 * x[:16]))
    assert torch.equal(m.fp8_scale_fwd, torch.ones(3 * E))


def test_retain_graph_backward_twice_updates_once():
    recipe = RECIPES["delayed"]
    m, ref = _module("linear", recipe), _module("linear")
    state = fp8.init_state(recipe)
    x, dy = _data(0, "linear")
    y = m(x.requires_grad_())
    y.backward(dy, retain_graph=True)
    y.backward(dy)
    yr = _functional(ref, x, recipe, state)
    yr.backward(dy, retain_graph=True)
    yr.backward(dy)
    fp8.update_state_(state, recipe)
    assert m._fp8_pending == {"fwd", "bwd"}
    m.get_extra_state()
    assert_same(pytree.tree_leaves(m.fp8_state), pytree.tree_leaves(state))


# --- TE's autocast, faked ----------------------------------------------------------------------


class FakeAutocast:
    """``transformer_engine.pytorch.quantization`` with an ``FP8GlobalStateManager`` whose
    autocast state is set by the test."""

    def __init__(self, monkeypatch):
        self.enabled, self.recipe = False, None
        fake = types.ModuleType("transformer_engine.pytorch.quantization")
        owner = self

        class FP8GlobalStateManager:
            @classmethod
            def is_fp8_enabled(cls):
                return owner.enabled

            @classmethod
            def get_fp8_recipe(cls):
                return owner.recipe

        fake.FP8GlobalStateManager = FP8GlobalStateManager
        monkeypatch.setitem(sys.modules, "transformer_engine.pytorch.quantization", fake)
        monkeypatch.setattr(nn_fp8, "_TE_MANAGER", [])

    def __call__(self, enabled=True, recipe=None):
        self.enabled, self.recipe = enabled, recipe
        return self


def _te_like(name, **attrs):
    return type(name, (), {"__module__": "transformer_engine.common.recipe", **attrs})()


@pytest.mark.parametrize("kind", ["linear", "grouped"])
def test_follows_te_autocast(kind, monkeypatch):
    autocast = FakeAutocast(monkeypatch)
    m, ref = _module(kind), _module(kind)
    x, dy = _data(0, kind)
    autocast(enabled=False)
    assert_same(_forward(m, x), _functional(ref, x, None, None), "no autocast: no FP8")
    autocast(recipe=_te_like("Float8CurrentScaling"))  # TE's recipe object
    y = _forward(m, x)
    assert_same(y, _functional(ref, x, RECIPES["current"], None), "TE's current scaling")
    assert not torch.equal(y, _functional(ref, x, None, None))
    assert m.fp8_state is None
    autocast(recipe=_te_like("DelayedScaling", amax_history_len=4))
    gemms = 1 if kind == "linear" else E
    state = fp8.init_state(RECIPES["delayed"], num_gemms=gemms)
    assert_same(_forward(m, x), _functional(ref, x, RECIPES["delayed"], state), "delayed: a state made lazily")
    assert m.fp8_state.num_gemms == gemms and m._fp8_recipe == RECIPES["delayed"]
    assert_same(pytree.tree_leaves(m.fp8_state), pytree.tree_leaves(state))
    explicit = _module(kind, RECIPES["block"])  # an explicit recipe wins over the autocast's
    assert_same(_forward(explicit, x), _functional(ref, x, RECIPES["block"], None))
    autocast(recipe=_te_like("MXFP8BlockScaling"))
    with pytest.raises(ValueError, match="MXFP8BlockScaling is not supported"):
        _forward(m, x)


def test_autocast_history_length_change_resizes_the_state(monkeypatch):
    autocast = FakeAutocast(monkeypatch)
    m = _module("linear")
    x, dy = _data(0, "linear")
    autocast(recipe=fp8.DelayedScaling(amax_history_len=4))
    m(x.requires_grad_()).backward(dy)
    autocast(recipe=fp8.DelayedScaling(amax_history_len=8))
    m(x)
    assert m.fp8_state.history_len == 8 and m._fp8_recipe.amax_history_len == 8


def test_te_is_never_imported():
    """Without TE imported, a module never imports it (and this CPU environment has no TE)."""
    before = {k for k in sys.modules if k.startswith("transformer_engine")}
    fnn.te_autocast_recipe()
    _forward(_module("grouped"), _data(0, "grouped")[0])
    _forward(_module("grouped", RECIPES["delayed"]), _data(0, "grouped")[0])
    assert {k for k in sys.modules if k.startswith("transformer_engine")} == before


def test_recipe_argument_errors():
    with pytest.raises(TypeError, match="expected an FP8 recipe"):
        fnn.Linear(K, N, recipe="delayed")
    with pytest.raises(ValueError, match="NVFP4BlockScaling is not supported"):
        fnn.GroupedLinear(E, K, N, recipe=_te_like("NVFP4BlockScaling"))
    assert fnn.Linear(K, N, recipe=_te_like("Float8BlockScaling")).recipe == fp8.Float8BlockScaling()


# --- materializing a meta module: the state is the construction-time one, or the checkpoint's ----------

KINDS = {"linear": {}, "grouped": {}, "grouped-single": {"single_grouped_weight": True}}


def _kind_module(kind, recipe=None, **kw):
    return _module("linear" if kind == "linear" else "grouped", recipe, **KINDS[kind], **kw)


def _checkpoint(module):
    """A state dict as a file holds it: its own tensors (torch.save / torch.load)."""
    buf = io.BytesIO()
    torch.save(module.state_dict(), buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@contextlib.contextmanager
def _swap_tensors(on):
    """torch's swap_tensors conversions (``_apply`` and ``load_state_dict`` swap the parameters in place)."""
    was = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(on)
    try:
        yield
    finally:
        torch.__future__.set_swap_module_params_on_conversion(was)


def _to_empty(m):
    """``to_empty(device="cpu")`` whose new memory is NaN (deterministic mode), not whatever was there."""
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        return m.to_empty(device="cpu")
    finally:
        torch.use_deterministic_algorithms(was)


MATERIALIZE = {  # path: how it loads a state dict into a meta module
    "to_empty-load": lambda m, sd: _to_empty(m).load_state_dict(sd),
    "to_empty-load-no-extra-state": lambda m, sd: _to_empty(m).load_state_dict(  # e.g. torch.nn.Linear's keys
        {k: v for k, v in sd.items() if k != "_extra_state"}, strict=False
    ),
    "assign": lambda m, sd: m.load_state_dict(sd, assign=True),  # torch's meta-init recipe
    "assign-to_empty-first": lambda m, sd: _to_empty(m).load_state_dict(sd, assign=True),
}


@pytest.mark.parametrize("swap", [False, True], ids=["", "swap_tensors"])
@pytest.mark.parametrize("path", MATERIALIZE)
@pytest.mark.parametrize("saved", [None, "current", "block"], ids=["bf16", "current", "block"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_meta_module_materialized_without_fp8_state_starts_from_the_construction_state(kind, saved, path, swap):
    """A delayed-scaling module built on meta, materialized by ``to_empty`` and/or
    ``load_state_dict`` (``assign=True`` too; ``.to`` and loads by swap_tensors too) of a
    checkpoint without FP8 state: its state is the one an eager construction makes (scales 1,
    histories 0, on the parameters' device), and it steps as the eager module that loaded the
    same checkpoint. (Before: ``to_empty`` left uninitialized memory there, which the forward
    quantized with; ``assign=True`` left the state on meta, where the forward refused it.)"""
    recipe = RECIPES["delayed"]
    sd = _checkpoint(_kind_module(kind, RECIPES[saved] if saved else None, params_dtype=torch.bfloat16))
    eager = _kind_module(kind, recipe, params_dtype=torch.bfloat16)
    eager.load_state_dict(sd)
    m = _kind_module(kind, recipe, params_dtype=torch.bfloat16, device="meta")
    with _swap_tensors(swap):
        MATERIALIZE[path](m, sd)
    fresh = fp8.init_state(recipe, num_gemms=1 if kind == "linear" else E)
    assert_same(pytree.tree_leaves(m.fp8_state), pytree.tree_leaves(fresh), "the construction-time state")
    assert m._fp8_pending == set()
    for step in range(2):
        x, dy = _data(step, kind)
        xm, xe = x.bfloat16().requires_grad_(), x.bfloat16().requires_grad_()
        ym, ye = _forward(m, xm), _forward(eager, xe)
        ym.backward(dy.bfloat16())
        ye.backward(dy.bfloat16())
        assert_same(ym, ye, f"step {step}: y")
        assert_same(xm.grad, xe.grad, f"step {step}: dx")
    assert_same(pytree.tree_leaves(m.fp8_state), pytree.tree_leaves(eager.fp8_state), "state after the steps")


def _sgd_step(m, step, kind):
    """Forward, backward, SGD update; returns what to compare (y, dx, the updated parameters)."""
    x, dy = _data(step, kind)
    x.requires_grad_()
    y = _forward(m, x)
    y.backward(dy)
    with torch.no_grad():
        for p in m.parameters():
            p -= 0.1 * p.grad
            p.grad = None
    return [y, x.grad, *(p.detach().clone() for p in m.parameters())]


@pytest.mark.parametrize("swap", [False, True], ids=["", "swap_tensors"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_meta_module_assign_loaded_steps_bitwise_like_the_saved_module(kind, swap):
    """torch's meta-init recipe, ``load_state_dict(checkpoint, assign=True)`` on a meta module,
    of a delayed-scaling module saved after two steps: the state lands where the parameters do
    (CPU) with the saved values, and three steps (forward, backward, SGD) of the loaded module
    equal the saved module's next three bitwise, the FP8 state after them too. (Before: the
    checkpoint's state was rebuilt on meta, its scales lost, and the forward refused it.)"""
    recipe = RECIPES["delayed"]
    saved = _kind_module(kind, recipe)
    for step in range(2):
        _sgd_step(saved, step, kind)
    sd = _checkpoint(saved)
    with _swap_tensors(swap):
        m = _kind_module(kind, recipe, device="meta")
        m.load_state_dict(sd, assign=True)
    assert all(not t.is_meta for t in [*m.parameters(), *m.buffers()])
    assert_same(pytree.tree_leaves(m.fp8_state), pytree.tree_leaves(saved.fp8_state), "the checkpoint's state")
    assert float(m.fp8_scale_fwd[0]) != 1.0
    for step in range(2, 5):
        assert_same(_sgd_step(m, step, kind), _sgd_step(saved, step, kind), f"step {step}")
    m.get_extra_state(), saved.get_extra_state()  # the last step's pending updates applied
    assert_same(pytree.tree_leaves(m.fp8_state), pytree.tree_leaves(saved.fp8_state), "state after the steps")


@pytest.mark.parametrize("trained", [False, True], ids=["fresh", "trained"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_to_empty_of_a_module_on_a_real_device_keeps_its_fp8_state(kind, trained):
    """``to_empty`` of a module that is not on meta hands every tensor new, uninitialized memory;
    the parameters are then loaded or reset, but nothing restores the non-persistent FP8 state,
    so it keeps its values (before: NaN scales after a load of a bf16 checkpoint, a NaN forward)."""
    recipe = RECIPES["delayed"]
    m = _kind_module(kind, recipe)
    if trained:
        _sgd_step(m, 0, kind)
        m._fp8_flush()
    want = [t.clone() for t in pytree.tree_leaves(m.fp8_state)]
    sd = _checkpoint(_kind_module(kind, None))
    _to_empty(m).load_state_dict(sd, strict=False)
    assert_same(pytree.tree_leaves(m.fp8_state), want, "the state before to_empty")
    x, _ = _data(1, kind)
    assert torch.isfinite(_forward(m, x)).all()


@pytest.mark.parametrize("kind", list(KINDS))
def test_state_dict_of_a_meta_module_round_trips(kind):
    """A meta-built delayed-scaling module has a state dict (meta tensors, an empty meta
    ``_extra_state``), as torch's modules on meta do; loading it changes no real FP8 state
    (before: ``state_dict()`` raised "Cannot copy out of meta tensor")."""
    recipe = RECIPES["delayed"]
    sd = _kind_module(kind, recipe, device="meta").state_dict()
    assert sd["_extra_state"].is_meta and sd["_extra_state"].numel() == 0
    assert all(v.is_meta for v in sd.values())
    other = _kind_module(kind, recipe, device="meta")
    other.load_state_dict(sd, assign=True)
    real = _kind_module(kind, recipe)
    real.fp8_state.scale_fwd.fill_(3.0)
    real.load_state_dict({k: (torch.zeros(v.shape) if k != "_extra_state" else v) for k, v in sd.items()})
    assert (real.fp8_state.scale_fwd == 3.0).all()
