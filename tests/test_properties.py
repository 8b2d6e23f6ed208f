"""Property-based differential tests (hypothesis) on the reference backend.

Each drawn case runs a layer twice on identical inputs, once without saved-tensor hooks and
once under the drawn hook, with the drawn number of backwards (``retain_graph``), and checks:

* hooked vs unhooked: output and every gradient (x, weights or ``main_grad`` or the
  DistributedWeight shard grads, biases) are bitwise equal, and the DW calls are identical;
* against a float64 reference built from plain torch ops (per expert ``x_e W_e^T + b_e``),
  with FakeDW's x2 (forward) / x4 (backward) scaling, within the per-dtype ``TOL``;
* what the hook saw (the activation only, never a weight), which GEMM path ran, and that the
  fallback warning appears exactly when ``use_grouped_tensor=True`` cannot run grouped.

Profiles (environment variable ``HYPOTHESIS_PROFILE``, default ``ci``):

* ``ci``: 160 examples in total (each test is parametrized over the 5 hook choices: 24
  grouped + 8 linear examples per hook), fresh each run (random seed; a failure prints the
  falsifying case and a ``@reproduce_failure`` blob; ``--hypothesis-seed=N`` replays a run),
  2 s deadline, no example database; about 10 s on 2 cores. The strategy favours the
  one-kernel path with tokens and includes device-like splits (``splits_form="device"``: the
  counts known only as a tensor, the code path of CUDA splits and of ``torch.compile``).
* ``long``: 2000 examples per test (400 per hook), random, no deadline, failures kept in
  ``.hypothesis/`` and replayed first on the next run::

      HYPOTHESIS_PROFILE=long timeout 600 python -m pytest tests/test_properties.py -q

The settings are applied per test (``@settings(...)``), never via ``load_profile``, so other
modules keep Hypothesis' defaults. Bugs found here are pinned as regular tests at the bottom.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import os
import sys
import warnings
from unittest import mock
from datetime import timedelta

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import functional_dw as fd
from conftest import BWD_SCALE, FWD_SCALE, HOOKS, FakeDW, assert_close, assert_same

# --- profiles ----------------------------------------------------------------------------

PROFILES = {
    "ci": dict(
        examples={"grouped": 24, "linear": 8},
        deadline=timedelta(seconds=2),
        derandomize=False,
        database=None,
        suppress_health_check=[HealthCheck.too_slow],
        print_blob=True,
    ),
    "long": dict(
        examples={"grouped": 400, "linear": 400},
        deadline=None,
        derandomize=False,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        print_blob=True,
    ),
}

PROFILE_NAME = os.environ.get("HYPOTHESIS_PROFILE", "ci")
if PROFILE_NAME not in PROFILES:
    raise ValueError(f"HYPOTHESIS_PROFILE={PROFILE_NAME!r}: tests/test_properties.py knows {sorted(PROFILES)}")


def profile(test: str) -> settings:
    """The chosen profile's settings for one test; max_examples is per hook parameter."""
    kw = dict(PROFILES[PROFILE_NAME])
    return settings(max_examples=kw.pop("examples")[test], **kw)


# --- strategies --------------------------------------------------------------------------

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
HOOK_NAMES = [None, "identity", "clone", "save_on_cpu", "megatron_offload"]
DY_FORMS = st.sampled_from(["contiguous", "strided", "expanded_row", "expanded_scalar"])
# multiples of 8 (16-byte rows in every dtype, so the grouped path can run), and sizes that
# are not (the grouped path falls back to split, with a warning when asked for)
ALIGNED = st.sampled_from([8, 16, 24, 32, 40, 48, 56, 64])
UNALIGNED = st.sampled_from([1, 2, 3, 4, 6, 12, 0])


@st.composite
def features(draw) -> tuple[int, int]:
    """(K, N): both aligned 3 times in 4, else K, N or both not."""
    K, N = draw(ALIGNED), draw(ALIGNED)
    which = draw(st.sampled_from(["", "", "", "K", "N", "KN"]))
    return (draw(UNALIGNED) if "K" in which else K), (draw(UNALIGNED) if "N" in which else N)


@st.composite
def split_sizes(draw, E: int) -> list[int]:
    """E token counts: all zeros (T = 0), all on one expert, or random with many zeros."""
    kind = draw(st.sampled_from(["random"] * 6 + ["zeros", "one"]))  # T = 0 one time in 8
    if kind == "zeros":
        return [0] * E
    if kind == "one":
        sizes = [0] * E
        sizes[draw(st.integers(0, E - 1))] = draw(st.integers(1, 96))
        return sizes
    return draw(st.lists(st.one_of(st.just(0), st.integers(0, 12)), min_size=E, max_size=E))


@dataclasses.dataclass(frozen=True)
class GroupedCase:
    E: int
    K: int
    N: int
    dtype: torch.dtype
    splits: tuple[int, ...]
    splits_form: str  # list, tuple, int64, int32, device (a tensor whose counts stay unread on the host)
    weights_form: str  # list, stacked
    dw: bool  # FakeDW group (list weights only)
    bias: str | None  # None, list, stacked
    fused: bool
    grad_added: bool  # plain fused weights carry grad_added_to_main_grad
    overwrite: bool  # plain fused weights carry overwrite_main_grad
    frozen: bool  # plain, unfused weights with requires_grad=False
    hook: str | None
    backwards: int
    path: bool | None  # use_grouped_tensor
    x_grad: bool
    x_contiguous: bool
    params_contiguous: bool  # False: plain weights stored transposed, biases strided
    dy_form: str  # contiguous, strided, expanded_row, expanded_scalar (what y.sum().backward() passes)
    seed: int

    @property
    def T(self) -> int:
        return sum(self.splits)


@st.composite
def grouped_cases(draw, hook: str | None) -> GroupedCase:
    E = draw(st.integers(1, 64))
    dtype = draw(st.sampled_from(DTYPES))
    K, N = draw(features())
    splits = tuple(draw(split_sizes(E)))
    path = draw(st.sampled_from([None, True, True, False]))  # the one-kernel path wherever it can run
    weights_form = draw(st.sampled_from(["list", "stacked"]))
    dw = weights_form == "list" and draw(st.booleans())
    fused = draw(st.booleans())
    plain_fused = fused and not dw
    bias = draw(st.sampled_from([None, "list", "stacked"]))
    frozen = not fused and not dw and draw(st.booleans())
    x_grad = draw(st.booleans()) or (frozen and bias is None)  # something must need a grad
    x_contiguous, dy_form = draw(st.booleans()), draw(DY_FORMS)
    return GroupedCase(
        E=E,
        K=K,
        N=N,
        dtype=dtype,
        splits=splits,
        splits_form=draw(st.sampled_from(["list", "tuple", "int64", "int32", "device"])),
        weights_form=weights_form,
        dw=dw,
        bias=bias,
        fused=fused,
        grad_added=plain_fused and draw(st.booleans()),
        overwrite=plain_fused and draw(st.booleans()),
        frozen=frozen,
        hook=hook,
        backwards=1 if hook == "megatron_offload" else draw(st.integers(1, 2)),
        path=path,
        x_grad=x_grad,
        x_contiguous=x_contiguous,
        params_contiguous=draw(st.booleans()),
        dy_form=dy_form,
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@dataclasses.dataclass(frozen=True)
class LinearCase:
    lead: tuple[int, ...]  # x is [*lead, K]; () is a 1-D x
    K: int
    N: int
    dtype: torch.dtype
    bias: bool
    dw: bool
    fused: bool
    grad_added: bool
    overwrite: bool
    hook: str | None
    backwards: int
    x_grad: bool
    x_contiguous: bool
    params_contiguous: bool
    dy_form: str
    seed: int
    frozen: bool = False  # (grouped only)


@st.composite
def linear_cases(draw, hook: str | None) -> LinearCase:
    dtype = draw(st.sampled_from(DTYPES))
    K, N = draw(features())
    dw, fused = draw(st.booleans()), draw(st.booleans())
    return LinearCase(
        lead=tuple(draw(st.lists(st.integers(0, 6), max_size=3))),
        K=K,
        N=N,
        dtype=dtype,
        bias=draw(st.booleans()),
        dw=dw,
        fused=fused,
        grad_added=fused and not dw and draw(st.booleans()),
        overwrite=fused and not dw and draw(st.booleans()),
        hook=hook,
        backwards=1 if hook == "megatron_offload" else draw(st.integers(1, 2)),
        x_grad=draw(st.booleans()),
        x_contiguous=draw(st.booleans()),
        params_contiguous=draw(st.booleans()),
        dy_form=draw(DY_FORMS),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


# --- inputs ------------------------------------------------------------------------------


def _randn(g: torch.Generator, *shape: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)


def _strided_copy(t: torch.Tensor) -> torch.Tensor:
    """The same values as a non-contiguous view (every other column of a wider buffer)."""
    buf = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
    buf[..., ::2] = t
    return buf[..., ::2]


def _transposed_copy(w: torch.Tensor) -> torch.Tensor:
    """The same values stored transposed (``[E, K, N]``-style storage, as torchtitan keeps it)."""
    return w.transpose(-2, -1).contiguous().transpose(-2, -1)


def _dy(g: torch.Generator, shape: tuple, dtype: torch.dtype, form: str) -> torch.Tensor:
    if form == "expanded_row":  # one row, stride 0 along the leading dims
        return _randn(g, shape[-1], dtype=dtype).expand(shape)
    if form == "expanded_scalar":  # what y.sum().backward() hands over: all strides 0
        return _randn(g, 1, dtype=dtype)[0].expand(shape)
    dy = _randn(g, *shape, dtype=dtype)
    return _strided_copy(dy) if form == "strided" else dy


@dataclasses.dataclass
class Inputs:
    """The drawn values (in the case's dtype) from which each run builds fresh leaves."""

    x: torch.Tensor
    fulls: list[torch.Tensor]  # full [N, K] weights
    biases: list[torch.Tensor]
    dy: torch.Tensor
    main_grad: list[torch.Tensor]  # fp32 initial main_grad per parameter (full shape)


def _inputs(seed: int, dtype: torch.dtype, x_shape: tuple, E: int, K: int, N: int, dy_form: str) -> Inputs:
    g = torch.Generator().manual_seed(seed)
    x = _randn(g, *x_shape, dtype=dtype)
    fulls = [_randn(g, N, K, dtype=dtype, scale=max(K, 1) ** -0.5) for _ in range(E)]
    biases = [_randn(g, N, dtype=dtype) for _ in range(E)]
    dy = _dy(g, (*x_shape[:-1], N), dtype, dy_form)
    main_grad = [torch.randn(N, K, generator=g) for _ in range(E)]
    return Inputs(x, fulls, biases, dy, main_grad)


@dataclasses.dataclass
class Leaves:
    x: torch.Tensor
    params: list[torch.Tensor]  # what autograd sees: E plain, E FakeDW, or one stacked [E, N, K]
    bias: list[torch.Tensor]  # E [N], or one [E, N]


def _leaves(case, inp: Inputs, stacked: bool = False, bias_form: str | None = None) -> Leaves:
    x = inp.x.clone() if case.x_contiguous else _strided_copy(inp.x).detach()
    x.requires_grad_(case.x_grad)
    if case.dw:
        params = FakeDW.group_of([f.clone() for f in inp.fulls], fused=case.fused)
        if case.fused:
            with torch.no_grad():
                for p, m in zip(params, inp.main_grad):
                    p.main_grad += m[: p.shape[0]]
    else:
        if stacked:
            params = [torch.stack(inp.fulls)]
            inits = [torch.stack(inp.main_grad)]
        else:
            params, inits = [f.clone() for f in inp.fulls], inp.main_grad
        if not case.params_contiguous:
            params = [_transposed_copy(p) for p in params]
        for p, m in zip(params, inits):
            p.requires_grad_(not case.frozen)
            if case.fused:
                p.main_grad = m.clone()
                if case.grad_added:
                    p.grad_added_to_main_grad = False
                if case.overwrite:
                    p.overwrite_main_grad = True
    copy = (lambda t: t.clone()) if case.params_contiguous else _strided_copy
    if bias_form == "stacked":
        bias = [copy(torch.stack(inp.biases)).requires_grad_()]
    elif bias_form == "list":
        bias = [copy(b).requires_grad_() for b in inp.biases]
    else:
        bias = []
    return Leaves(x, params, bias)


def _backward(y: torch.Tensor, dy: torch.Tensor, n: int) -> None:
    for i in range(n):
        y.backward(dy, retain_graph=i < n - 1)


def _results(y: torch.Tensor, leaves: Leaves, fused: bool) -> dict:
    return {
        "y": y.detach(),
        "dx": leaves.x.grad,
        "dw": [p.grad for p in leaves.params],
        "main_grad": [p.main_grad for p in leaves.params] if fused else [],
        "db": [b.grad for b in leaves.bias],
        "calls": dict(leaves.params[0].calls) if fd.is_distributed_weight(leaves.params[0]) else None,
    }


@contextlib.contextmanager
def _hooked(name: str | None):
    rec = HOOKS[name]() if name else None
    with rec if rec else contextlib.nullcontext():
        yield rec


# --- checks ------------------------------------------------------------------------------


def _check_same(got: dict, want: dict) -> None:
    for key in want:
        if key == "calls":
            assert got[key] == want[key], key
        else:
            assert_same(got[key], want[key], f"hooked vs unhooked: {key}")


def _check_hook(rec, leaves: Leaves, backwards: int) -> None:
    """The hook saw the activation x (or its contiguous copy) once and never a weight."""
    if rec is None:
        return
    assert len(rec.packed) == 1, f"packed {len(rec.packed)} tensors"
    (p,) = rec.packed
    x = leaves.x
    assert p is x, "x is saved as given (NOTE: [Saved x]: a copy would cut second-order grads off from x)"
    assert torch.equal(p, x.detach())
    forbidden = {id(w) for w in leaves.params} | {id(b) for b in leaves.bias}
    ptrs = {w.data_ptr() for w in leaves.params}
    if fd.is_distributed_weight(leaves.params[0]):
        forbidden |= {id(m) for m in leaves.params[0].materialized}
        ptrs |= {m.data_ptr() for m in leaves.params[0].materialized}
    assert not fd.is_distributed_weight(p) and id(p) not in forbidden
    assert p.numel() == 0 or p.data_ptr() not in ptrs
    assert rec.unpacks == backwards, "each backward unpacks the saved activation exactly once"


def _summed(actual, one, mag, n, dtype, what, init=None):
    """``actual`` = ``init`` + n times ``one`` (float64), accumulated by n roundings to actual's
    dtype: NOTE: [The tolerance rule] with ``rounds = n`` and the magnitudes summed."""
    want, m = n * one, n * mag
    if init is not None:
        want, m = init.double() + want, init.double().abs() + m
    assert_close(actual, want, dtype, what, mag=m, rounds=max(n, 1))


def _check_weights(
    case, leaves: Leaves, got: dict, dW_full: list[torch.Tensor], inp: Inputs, stacked: bool, dW_mag: list[torch.Tensor]
) -> None:
    """Weight grads / main_grad against float64 per-expert ``dW_e = dy_e^T x_e`` (full shape);
    ``dW_mag`` the same on absolute values. main_grad is fp32: held to fp32 accuracy."""
    n, dtype = case.backwards, case.dtype
    if case.dw:
        for e, p in enumerate(leaves.params):
            shard, mag = dW_full[e][: p.shape[0]], dW_mag[e][: p.shape[0]]
            g = got["dw"][e]
            assert g is not None and g.dtype == dtype and g.shape == p.shape, f"DW grad {e}"
            if case.fused:
                assert not g.any(), "fused DW: finalize returns zero dummies"
                _summed(got["main_grad"][e], shard, mag, n, dtype, f"DW main_grad {e}", inp.main_grad[e][: p.shape[0]])
                assert p.grad_added_to_main_grad
            else:
                _summed(g, shard, mag, n, dtype, f"DW shard grad {e}")
        return
    wants = [torch.stack(dW_full)] if stacked else dW_full
    mags = [torch.stack(dW_mag)] if stacked else dW_mag
    inits = [torch.stack(inp.main_grad)] if stacked else inp.main_grad
    for e, (p, dW, mag) in enumerate(zip(leaves.params, wants, mags)):
        g = got["dw"][e]
        if case.frozen:
            assert g is None
        elif case.fused:
            if case.grad_added:
                assert g is not None and g.shape == p.shape and not g.any(), "zero dummy"
                assert p.grad_added_to_main_grad is True
            else:
                assert g is None, "fused plain weight without grad_added_to_main_grad gets no .grad"
            mg = got["main_grad"][e]
            assert mg.dtype == torch.float32 and mg.shape == p.shape
            if case.overwrite:
                _summed(mg, dW, mag, 1, dtype, f"main_grad {e}")
            else:
                _summed(mg, dW, mag, n, dtype, f"main_grad {e}", inits[e])
        else:
            assert g is not None and g.dtype == dtype and g.shape == p.shape, f"weight grad {e}"
            _summed(g, dW, mag, n, dtype, f"weight grad {e}")


def _grouped_supported(dtype: torch.dtype, K: int, N: int) -> bool:
    size = torch.tensor([], dtype=dtype).element_size()
    return (
        dtype in (torch.float32, torch.bfloat16, torch.float16)
        and K > 0
        and N > 0
        and (K * size) % 16 == 0
        and (N * size) % 16 == 0
    )


# --- grouped_linear ----------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def _one_thread_warmed_up():
    """One intra-op thread for this module, and each kernel run once before the timed examples.

    On a small, busy CPU, OpenMP threads spin-waiting for each other make a tiny bfloat16 GEMM
    take milliseconds instead of microseconds (a 43-expert bf16 forward: ~700 ms with 2 threads
    under load, ~1 ms with 1), and the first grouped_mm call of a process takes about a second:
    either would eat the deadline. The thread count is restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for dtype in DTYPES:
            for path, splits in itertools.product((False, True), ([1, 3], [0, 0])):  # T = 0 warms up on its own
                x = torch.randn(sum(splits), 8, dtype=dtype, requires_grad=True)
                ws = [torch.randn(8, 8, dtype=dtype, requires_grad=True) for _ in range(2)]
                y = fd.grouped_linear(x, ws, splits, [w[0] for w in ws], use_grouped_tensor=path)
                y.backward(torch.ones_like(y))
                fd.linear(x, ws[0], ws[1][0]).backward(torch.ones_like(y))
    yield
    torch.set_num_threads(threads)


def _splits_arg(case: GroupedCase):
    return {
        "list": list,
        "tuple": tuple,
        "int64": torch.tensor,
        "device": torch.tensor,
        "int32": lambda s: torch.tensor(s, dtype=torch.int32),
    }[case.splits_form](list(case.splits))


@contextlib.contextmanager
def _device_like_splits(case: GroupedCase):
    """For ``splits_form="device"``: the layer sees the splits as CUDA splits are seen (host
    counts unknown: device-side ends and counts, clamping, the split path's one read)."""
    if case.splits_form != "device":
        yield
        return
    gl = sys.modules["functional_dw.grouped_linear"]
    as_splits = gl.as_splits

    def device_only(*args):
        return dataclasses.replace(as_splits(*args), host=None)

    with mock.patch.object(gl, "as_splits", device_only):
        yield


def _run_grouped(case: GroupedCase, inp: Inputs, hook: str | None):
    stacked = case.weights_form == "stacked"
    leaves = _leaves(case, inp, stacked=stacked, bias_form=case.bias)
    weights = leaves.params[0] if stacked else list(leaves.params)
    bias = None if case.bias is None else (leaves.bias[0] if case.bias == "stacked" else list(leaves.bias))
    with _device_like_splits(case):
        return _run(
            lambda: fd.grouped_linear(
                leaves.x,
                weights,
                _splits_arg(case),
                bias,
                fuse_wgrad_accumulation=case.fused,
                use_grouped_tensor=case.path,
            ),
            case,
            inp,
            leaves,
            hook,
        )


def _run(call, case, inp: Inputs, leaves, hook: str | None):
    """Forward under ``hook`` (recording warnings), then the case's backward passes."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with _hooked(hook) as rec:
            y = call()
        _backward(y, inp.dy, case.backwards)
    return _results(y, leaves, case.fused), leaves, rec, [str(w.message) for w in caught]


@pytest.mark.parametrize("hook", HOOK_NAMES, ids=str)
@profile("grouped")
@given(data=st.data())
def test_grouped_linear_matches_reference_and_unhooked_run(hook, data):
    case = data.draw(grouped_cases(hook), label="case")
    T, K, N, E, n, dtype = case.T, case.K, case.N, case.E, case.backwards, case.dtype
    inp = _inputs(case.seed, dtype, (T, K), E, K, N, case.dy_form)
    want, _, _, _ = _run_grouped(case, inp, None)
    got, leaves, rec, msgs = _run_grouped(case, inp, case.hook)

    _check_same(got, want)
    _check_hook(rec, leaves, n)

    # the path that ran, and the fallback warning exactly when asked for and impossible
    supported = _grouped_supported(dtype, K, N)
    fallback = [m for m in msgs if "use_grouped_tensor=True" in m]
    assert msgs == fallback, f"unexpected warnings: {msgs}"
    assert bool(fallback) == (case.path is True and not supported), msgs
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, res = fd.grouped_linear_fwd(inp.x, inp.fulls, list(case.splits), use_grouped_tensor=case.path)
    assert res.path == ("grouped" if case.path is not False and supported else "split")
    event(f"path={res.path}, T={'0' if T == 0 else '>0'}")
    event(f"dtype={dtype}")
    event(f"splits={case.splits_form}")

    # float64 reference: per expert, plain torch ops
    x64, dy64 = inp.x.double(), inp.dy.double()
    fulls = [f.double() for f in inp.fulls]
    w_fwd = [FWD_SCALE * f for f in fulls] if case.dw else fulls
    w_bwd = [BWD_SCALE * f for f in fulls] if case.dw else fulls
    b64 = [b.double() for b in inp.biases] if case.bias else [None] * E

    def per_expert(x64, dy64, w_fwd, w_bwd, b64):
        xs, dys = x64.split(list(case.splits)), dy64.split(list(case.splits))
        y64 = torch.cat([F.linear(xe, w_fwd[e], b64[e]) for e, xe in enumerate(xs)])
        dx64 = torch.cat([d @ w_bwd[e] for e, d in enumerate(dys)])
        return y64, dx64, [d.t() @ xe for d, xe in zip(dys, xs)], [d.sum(0) for d in dys]

    y64, dx64, dW64, db64 = per_expert(x64, dy64, w_fwd, w_bwd, b64)
    absolute = lambda ts: [None if t is None else t.abs() for t in ts]  # noqa: E731
    y_mag, dx_mag, dW_mag, db_mag = per_expert(x64.abs(), dy64.abs(), absolute(w_fwd), absolute(w_bwd), absolute(b64))

    y = got["y"]
    assert y.dtype == dtype and y.shape == (T, N)
    assert_close(y, y64, dtype, "y", mag=y_mag, rounds=2 if case.bias else 1)  # (+ bias after the GEMM)
    if case.x_grad:
        assert got["dx"].dtype == dtype and got["dx"].shape == (T, K)
        _summed(got["dx"], dx64, dx_mag, n, dtype, "dx")
    else:
        assert got["dx"] is None
    _check_weights(case, leaves, got, dW64, inp, case.weights_form == "stacked", dW_mag)
    if case.bias == "stacked":
        assert got["db"][0].shape == (E, N)
        _summed(got["db"][0], torch.stack(db64), torch.stack(db_mag), n, dtype, "db")
    elif case.bias == "list":
        for e, (g, d, m) in enumerate(zip(got["db"], db64, db_mag)):
            assert g is not None and g.dtype == dtype, f"db {e}"
            _summed(g, d, m, n, dtype, f"db {e}")
    if case.dw:
        leader, followers = leaves.params[0], leaves.params[1:]
        assert leader.calls == {"forward": 1, "backward": n, "finalize": n}
        assert all(w.calls == {"forward": 0, "backward": 0, "finalize": 0} for w in followers)


# --- linear ------------------------------------------------------------------------------


def _run_linear(case: LinearCase, inp: Inputs, hook: str | None):
    leaves = _leaves(case, inp, bias_form="list" if case.bias else None)
    return _run(
        lambda: fd.linear(
            leaves.x, leaves.params[0], leaves.bias[0] if case.bias else None, fuse_wgrad_accumulation=case.fused
        ),
        case,
        inp,
        leaves,
        hook,
    )


@pytest.mark.parametrize("hook", HOOK_NAMES, ids=str)
@profile("linear")
@given(data=st.data())
def test_linear_matches_reference_and_unhooked_run(hook, data):
    case = data.draw(linear_cases(hook), label="case")
    K, N, n, dtype = case.K, case.N, case.backwards, case.dtype
    inp = _inputs(case.seed, dtype, (*case.lead, K), 1, K, N, case.dy_form)
    want, _, _, _ = _run_linear(case, inp, None)
    got, leaves, rec, msgs = _run_linear(case, inp, case.hook)
    assert not msgs, f"unexpected warnings: {msgs}"

    _check_same(got, want)
    _check_hook(rec, leaves, n)

    def reference(x64, dy64, w64, b64):
        y64 = F.linear(x64, FWD_SCALE * w64 if case.dw else w64, b64)
        dx64 = dy64 @ (BWD_SCALE * w64 if case.dw else w64)
        T = math.prod(x64.shape[:-1])  # not reshape(-1, K): ambiguous when K == 0
        x2, dy2 = x64.reshape(T, K), dy64.reshape(T, N)
        return y64, dx64, dy2.t() @ x2, dy2.sum(0)

    x64, dy64, w64 = inp.x.double(), inp.dy.double(), inp.fulls[0].double()
    b64 = inp.biases[0].double() if case.bias else None
    y64, dx64, dW64, db64 = reference(x64, dy64, w64, b64)
    y_mag, dx_mag, dW_mag, db_mag = reference(x64.abs(), dy64.abs(), w64.abs(), None if b64 is None else b64.abs())

    y = got["y"]
    assert y.dtype == dtype and y.shape == (*case.lead, N)
    assert_close(y, y64, dtype, "y", mag=y_mag, rounds=2 if case.bias else 1)  # (addmm: + bias after the GEMM)
    if case.x_grad:
        assert got["dx"].shape == inp.x.shape and got["dx"].dtype == dtype
        _summed(got["dx"], dx64, dx_mag, n, dtype, "dx")
    else:
        assert got["dx"] is None
    _check_weights(case, leaves, got, [dW64], inp, stacked=False, dW_mag=[dW_mag])
    if case.bias:
        _summed(got["db"][0], db64, db_mag, n, dtype, "db")
    if case.dw:
        assert leaves.params[0].calls == {"forward": 1, "backward": n, "finalize": n}


# --- regressions: bugs the properties found (fixed; each stays a regular test) ---------------


def _quiet_grouped(*args, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fd.grouped_linear(*args, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_empty_batch_sum_backward_on_grouped_path(dtype):
    x = torch.zeros(0, 8, dtype=dtype, requires_grad=True)
    ws = [torch.randn(8, 8, dtype=dtype, requires_grad=True) for _ in range(2)]
    fd.grouped_linear(x, ws, [0, 0]).sum().backward()  # use_grouped_tensor=None: the grouped path
    assert x.grad.shape == (0, 8)
    assert all(w.grad is not None and not w.grad.any() for w in ws)


def test_empty_strided_x_on_grouped_path():
    x = torch.zeros(0, 16)[:, ::2].requires_grad_()
    ws = [torch.randn(8, 8, requires_grad=True) for _ in range(2)]
    y = _quiet_grouped(x, ws, [0, 0], use_grouped_tensor=True)
    y.backward(torch.zeros(0, 8))
    assert y.shape == (0, 8) and x.grad.shape == (0, 8)


@pytest.mark.parametrize("layer", ["linear", "grouped"])
def test_fused_wgrad_with_frozen_weight(layer):
    x = torch.randn(4, 8, requires_grad=True)
    ws = [torch.randn(8, 8) for _ in range(2)]  # frozen, no main_grad: nothing to accumulate into
    if layer == "linear":
        y = fd.linear(x, ws[0], fuse_wgrad_accumulation=True)
    else:
        y = fd.grouped_linear(x, ws, [1, 3], fuse_wgrad_accumulation=True)
    y.sum().backward()
    assert x.grad is not None and all(w.grad is None for w in ws)


def test_fused_wgrad_with_frozen_weight_leaves_main_grad_alone():
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(8, 8)
    w.main_grad = torch.zeros(8, 8)
    fd.linear(x, w, fuse_wgrad_accumulation=True).sum().backward()
    assert not w.main_grad.any(), "a frozen weight's main_grad was written"


def test_linear_zero_in_features():
    x = torch.randn(5, 0, requires_grad=True)
    w, b = torch.randn(8, 0, requires_grad=True), torch.randn(8, requires_grad=True)
    y = fd.linear(x, w, b)
    assert_same(y.detach(), F.linear(x, w, b).detach())
    y.backward(torch.ones(5, 8))
    assert x.grad.shape == (5, 0) and w.grad.shape == (8, 0) and torch.equal(b.grad, torch.full((8,), 5.0))


def test_linear_zero_out_features():
    x = torch.randn(5, 8, requires_grad=True)
    w = torch.randn(0, 8, requires_grad=True)
    y = fd.linear(x, w)
    assert y.shape == (5, 0)
    y.backward(torch.ones(5, 0))
    assert not x.grad.any() and w.grad.shape == (0, 8)


@pytest.mark.parametrize("K,N", [(0, 8), (8, 0)], ids=["K=0", "N=0"])
def test_grouped_zero_features_default_path(K, N):
    x = torch.randn(5, K, requires_grad=True)
    ws = [torch.randn(N, K, requires_grad=True) for _ in range(2)]
    y = fd.grouped_linear(x, ws, [2, 3])  # use_grouped_tensor=None
    y.backward(torch.ones(5, N))
    assert y.shape == (5, N) and x.grad.shape == (5, K) and all(w.grad.shape == (N, K) for w in ws)
