"""TE's _extra_state: read what TE writes, write what TE reads, without TE.

A stand-in for ``transformer_engine.common.recipe`` (TE's class names, an Enum of NamedTuple
values, dataclass recipes) goes into ``sys.modules`` only while a payload is built or read the
way TE's ``module/base.py`` does; our loader runs with it removed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import io
import os
import pickle
import sys
import types
from typing import Any, NamedTuple, Optional

import pytest
import torch

from functional_dw.fp8 import DelayedScaling, Float8CurrentScaling, Format, init_state, record_amax, update_state
from functional_dw.fp8.extra_state import read_extra_state, state_from_extra_state, state_to_extra_state

MOD = "transformer_engine.common.recipe"


def fake_te() -> types.ModuleType:
    """A module with TE's recipe names and shapes (TE's recipes are pydantic dataclasses)."""
    m = types.ModuleType(MOD)

    class _FormatHelper(NamedTuple):
        max_fwd: float
        max_bwd: float

    _FormatHelper.__module__ = MOD

    class Format(enum.Enum):
        E2M1 = _FormatHelper(max_fwd=6, max_bwd=6)
        E4M3 = _FormatHelper(max_fwd=448, max_bwd=448)
        E5M2 = _FormatHelper(max_fwd=57344, max_bwd=57344)
        HYBRID = _FormatHelper(max_fwd=448, max_bwd=57344)

    Format.__module__ = MOD

    @dataclasses.dataclass
    class DelayedScaling:
        margin: int = 0
        fp8_format: Any = Format.HYBRID
        amax_history_len: int = 1024
        amax_compute_algo: Any = "max"
        scaling_factor_compute_algo: Any = None
        reduce_amax: bool = True
        fp8_dpa: bool = False
        fp8_mha: bool = False
        backward_override: Optional[str] = None

    @dataclasses.dataclass
    class Float8CurrentScaling:
        use_power_2_scales: bool = False
        fp8_format: Any = Format.HYBRID
        fp8_dpa: bool = False
        fp8_mha: bool = False
        backward_override: Optional[str] = None

    @dataclasses.dataclass
    class MXFP8BlockScaling:
        margin: int = 0
        fp8_format: Any = Format.E4M3

    for cls in (DelayedScaling, Float8CurrentScaling, MXFP8BlockScaling):
        cls.__module__ = MOD
        cls.__qualname__ = cls.__name__
    for obj in (_FormatHelper, Format, DelayedScaling, Float8CurrentScaling, MXFP8BlockScaling):
        obj.__qualname__ = obj.__name__
        setattr(m, obj.__name__, obj)
    return m


@pytest.fixture
def te(monkeypatch):
    """Install the fake TE module; ``te.installed(False)`` removes it for a block."""
    m = fake_te()
    pkg, common = types.ModuleType("transformer_engine"), types.ModuleType("transformer_engine.common")
    pkg.common, common.recipe = common, m
    for name, mod in (("transformer_engine", pkg), ("transformer_engine.common", common), (MOD, m)):
        monkeypatch.setitem(sys.modules, name, mod)

    class Ctl:
        module = m

        @staticmethod
        @contextlib.contextmanager
        def without():
            with pytest.MonkeyPatch.context() as mp:
                for name in ("transformer_engine", "transformer_engine.common", MOD):
                    mp.delitem(sys.modules, name)
                yield

    return Ctl


def te_get_extra_state(recipe: Any, E: int, H: int, seed: int = 0, stateful: bool = True) -> torch.Tensor:
    """module/base.py: get_extra_state, with a module's fp8_meta as TE fills it."""
    g = torch.Generator().manual_seed(seed)
    fp8_meta = {
        "fp8_checkpoint": True,
        "fp8_group": None,
        "recipe": recipe,
        "num_gemms": E,
        "fp8_max_fwd": recipe.fp8_format.value.max_fwd,
        "fp8_max_bwd": recipe.fp8_format.value.max_bwd,
        "scaling_fwd": object(),
        "scaling_bwd": object(),
        "buffer_index_and_autocast_key": [0, "k", 0, "k"],
    }
    state = {"recipe": recipe}
    if stateful:
        state["scale_fwd"] = torch.rand(3 * E, generator=g) + 0.5
        state["amax_history_fwd"] = torch.rand(H, 3 * E, generator=g)
        state["scale_bwd"] = torch.rand(2 * E, generator=g) + 0.5
        state["amax_history_bwd"] = torch.rand(H, 2 * E, generator=g)
    extra = {}
    for k, v in fp8_meta.items():
        if k != "buffer_index_and_autocast_key" and isinstance(v, (bool, int, float, str, tuple, list)):
            extra[k] = v
    state["extra_fp8_variables"] = extra
    return torch.frombuffer(bytearray(pickle.dumps(state)), dtype=torch.uint8), state


@pytest.mark.parametrize("E", [1, 3])
def test_reads_what_te_writes(te, E):
    recipe = te.module.DelayedScaling(
        margin=2,
        fp8_format=te.module.Format.E4M3,
        amax_history_len=5,
        amax_compute_algo="most_recent",
        reduce_amax=False,
    )
    blob, state = te_get_extra_state(recipe, E, 5)
    with te.without():
        assert MOD not in sys.modules
        s = state_from_extra_state(blob, num_gemms=E)
        d = read_extra_state(blob)
    for key in ("scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd"):
        assert torch.equal(getattr(s, key), state[key])
    assert s.num_gemms == E
    assert d["recipe"] == DelayedScaling(
        margin=2, fp8_format=Format.E4M3, amax_history_len=5, amax_compute_algo="most_recent", reduce_amax=False
    )
    assert d["extra_fp8_variables"] == {"fp8_checkpoint": True, "num_gemms": E, "fp8_max_fwd": 448, "fp8_max_bwd": 448}


def test_te_reads_what_we_write(te):
    """What TE's set_extra_state does with our tensor: unpickle (TE's classes), init, copy."""
    r = DelayedScaling(margin=1, amax_history_len=6)
    ours = update_state(record_amax(init_state(r, 2), "input", torch.tensor([3.0, 5.0])), r)
    blob = state_to_extra_state(ours, r)
    assert blob.dtype == torch.uint8 and blob.dim() == 1
    loaded = pickle.loads(blob.numpy().tobytes())  # TE's loader, with TE's (fake) classes importable
    recipe = loaded["recipe"]
    assert type(recipe) is te.module.DelayedScaling and recipe.fp8_format is te.module.Format.HYBRID
    assert dataclasses.asdict(recipe) == {f.name: getattr(r, f.name) for f in dataclasses.fields(r)} | {
        "fp8_format": te.module.Format.HYBRID
    }
    E, H = loaded["extra_fp8_variables"]["num_gemms"], recipe.amax_history_len
    assert list(loaded) == [
        "recipe",
        "scale_fwd",
        "amax_history_fwd",
        "scale_bwd",
        "amax_history_bwd",
        "extra_fp8_variables",
    ]
    assert loaded["extra_fp8_variables"] == {
        "fp8_checkpoint": True,
        "num_gemms": 2,
        "fp8_max_fwd": 448,
        "fp8_max_bwd": 57344,
    }
    scale_fwd, hist_fwd = torch.ones(3 * E), torch.zeros(H, 3 * E)  # init_fp8_meta_tensors(recipe), then copy
    scale_fwd.copy_(loaded["scale_fwd"])
    hist_fwd.copy_(loaded["amax_history_fwd"])
    assert torch.equal(scale_fwd, ours.scale_fwd) and torch.equal(hist_fwd, ours.amax_history_fwd)


def test_round_trip_without_te(te):
    with te.without():
        r = DelayedScaling(amax_history_len=3, fp8_format=Format.E4M3)
        s = record_amax(init_state(r, 4), "grad_output", torch.arange(4.0))
        back = state_from_extra_state(state_to_extra_state(s, r), 4)
        assert all(
            torch.equal(getattr(back, k), getattr(s, k))
            for k in ("scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd")
        )
        assert read_extra_state(state_to_extra_state(s, r))["recipe"] == r
        default = read_extra_state(state_to_extra_state(s))["recipe"]  # no recipe: defaults, the state's H
        assert default == DelayedScaling(amax_history_len=3)
        assert state_from_extra_state(bytes(state_to_extra_state(s).tolist()), 4).num_gemms == 4  # raw bytes


def test_empty_and_stateless(te):
    blob, _ = te_get_extra_state(te.module.Float8CurrentScaling(use_power_2_scales=True), 1, 1, stateful=False)
    mx, _ = te_get_extra_state(te.module.MXFP8BlockScaling(), 1, 1, stateful=False)
    with te.without():
        assert read_extra_state(torch.empty(0, dtype=torch.uint8)) is None
        assert state_from_extra_state(torch.empty(0, dtype=torch.uint8), 1) is None
        assert read_extra_state(None) is None and read_extra_state(b"") is None
        assert state_from_extra_state(blob, 1) is None
        assert read_extra_state(blob)["recipe"] == Float8CurrentScaling(use_power_2_scales=True)
        kept = read_extra_state(mx)["recipe"]  # a recipe we do not run: an inert stand-in, as read
        assert type(kept).__name__ == "MXFP8BlockScaling" and kept.fp8_format == Format.E4M3


def test_te1_checkpoint_without_recipe(te):
    state = {
        "scale_fwd": torch.ones(3),
        "scale_inv_fwd": torch.ones(3),
        "amax_history_fwd": torch.zeros(1024, 3),
        "scale_bwd": torch.ones(2),
        "scale_inv_bwd": torch.ones(2),
        "amax_history_bwd": torch.zeros(1024, 2),
        "extra_fp8_variables": {"num_gemms": 1},
    }
    blob = torch.frombuffer(bytearray(pickle.dumps(state)), dtype=torch.uint8)
    d = read_extra_state(blob)
    assert d["recipe"] == DelayedScaling() and "scale_inv_fwd" not in d and "scale_inv_bwd" not in d
    assert state_from_extra_state(blob, 1).history_len == 1024


def test_deprecated_bytesio_format(te):
    recipe = te.module.DelayedScaling(amax_history_len=2)
    _, state = te_get_extra_state(recipe, 2, 2)
    buf = io.BytesIO()
    torch.save(state, buf)  # TE 1.x wrote torch.save into a BytesIO
    with te.without():
        s = state_from_extra_state(buf, 2)
        assert torch.equal(s.amax_history_bwd, state["amax_history_bwd"])
        assert read_extra_state(buf)["recipe"] == DelayedScaling(amax_history_len=2)


def test_wrong_num_gemms(te):
    blob, _ = te_get_extra_state(te.module.DelayedScaling(amax_history_len=2), 2, 2)
    with pytest.raises(ValueError, match="saved for 2 GEMM.*not num_gemms=1"):
        state_from_extra_state(blob, 1)


class _Evil:
    def __reduce__(self):
        return (os.getenv, ("HOME",))


def test_refuses_other_globals():
    blob = torch.frombuffer(bytearray(pickle.dumps({"recipe": _Evil()})), dtype=torch.uint8)
    with pytest.raises(pickle.UnpicklingError, match="refusing to unpickle os.getenv"):
        read_extra_state(blob)
    buf = io.BytesIO()
    torch.save({"recipe": _Evil()}, buf)
    with pytest.raises(pickle.UnpicklingError, match="refusing to unpickle os.getenv"):
        read_extra_state(buf)


def test_argument_errors():
    with pytest.raises(ValueError, match="1-D uint8"):
        read_extra_state(torch.zeros(3))
    with pytest.raises(TypeError, match="uint8 tensor, bytes or io.BytesIO"):
        read_extra_state({"scale_fwd": 1})
    s = init_state(DelayedScaling(amax_history_len=2), 1)
    with pytest.raises(ValueError, match="amax_history_len is 1024 but the state has 2"):
        state_to_extra_state(s, DelayedScaling())
    with pytest.raises(ValueError, match="only DelayedScaling"):
        state_to_extra_state(s, Float8CurrentScaling())
    with pytest.raises(TypeError, match="DelayedScalingState"):
        state_to_extra_state({"scale_fwd": 1})
    blob = torch.frombuffer(bytearray(pickle.dumps([1, 2])), dtype=torch.uint8)
    with pytest.raises(ValueError, match="holds a dict"):
        read_extra_state(blob)


def _decoded(extra):
    d = read_extra_state(extra)
    return (
        d["recipe"],
        d["extra_fp8_variables"],
        [d[k] for k in ("scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd")],
    )


@pytest.mark.parametrize("via", ["torch.save", "save_checkpoint"])
@pytest.mark.parametrize("kind", ["linear", "grouped"])
def test_module_round_trip_restores_the_state_and_the_next_steps_bitwise(kind, via, tmp_path):
    """A module saved mid-training (updates still pending) and loaded into a fresh one steps on
    bitwise as its twin that was never saved: equal decoded state (recipe, TE's extra
    variables, scales, amax histories), forward outputs and grads. The ``_extra_state`` bytes
    themselves need not be equal, not even for one state encoded twice: pickle writes each
    tensor's storage under a key from its address."""
    from conftest import assert_same

    from functional_dw import nn as fnn
    from functional_dw.distributed import load_checkpoint, save_checkpoint

    E, K, N, splits = 3, 32, 16, [16, 0, 32]
    recipe = DelayedScaling(amax_history_len=4, margin=1, fp8_format=Format.E4M3)

    def module():
        torch.manual_seed(0)
        return fnn.Linear(K, N, recipe=recipe) if kind == "linear" else fnn.GroupedLinear(E, K, N, recipe=recipe)

    def step(m, s):
        g = torch.Generator().manual_seed(s)
        x = (torch.randn(sum(splits), K, generator=g) * (s + 1)).requires_grad_()
        y = m(x) if kind == "linear" else m(x, splits)
        y.backward(torch.randn(y.shape, generator=g))
        out = [y.detach(), x.grad, *(p.grad for p in m.parameters())]
        with torch.no_grad():
            for p in m.parameters():
                p -= 0.01 * p.grad
                p.grad = None
        return out

    def buffers(m):
        return [getattr(m, f"fp8_{k}") for k in ("scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd")]

    saved, twin = module(), module()
    for s in range(3):
        assert_same(step(saved, s), step(twin, s))
    assert saved._fp8_pending == {"fwd", "bwd"}  # the last step's updates, applied by the save
    loaded = module()
    if via == "torch.save":
        torch.save(saved.state_dict(), tmp_path / "sd.pt")
        loaded.load_state_dict(torch.load(tmp_path / "sd.pt"))
    else:
        save_checkpoint(saved, tmp_path / "ckpt")
        load_checkpoint(loaded, tmp_path / "ckpt")
    want, got = _decoded(twin.get_extra_state()), _decoded(loaded.get_extra_state())
    assert got[:2] == want[:2] and got[0] == recipe
    assert_same(got[2], want[2])
    assert_same(buffers(loaded), buffers(twin))
    for s in range(3, 6):
        assert_same(step(loaded, s), step(twin, s), f"step {s}")
    assert_same(buffers(loaded), buffers(twin))
