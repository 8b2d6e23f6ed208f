"""ShardedWeight over torch.distributed: sharded ``linear`` / ``grouped_linear`` on W ranks equal
the single-process unsharded layer run on all ranks' tokens (output, dgrad, each rank's shard
gradient), under ``save_on_cpu``, with ``retain_graph`` twice, with fused wgrad accumulation,
with async reduce-scatter + backward prefetch, with uneven and zero token counts, and with out
features that do not divide by the world size; one collective per pass for a whole group.

CPU: gloo, 2 and 4 ranks (one spawn per world size runs every case; each case is reported as
its own test). GPU (marker ``gpu``): NCCL on two GPUs with TE kernels.
"""

from __future__ import annotations

import contextlib
import functools
import time
from functools import partial
from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import functional_dw as fd
from conftest import HOOKS, assert_close
from helpers import HANG_S, randn
from functional_dw import distributed as fdd

E, K = 3, 16
# tokens per (rank, expert): uneven, experts with no tokens on some ranks (expert 1 on all),
# rank 3 with no tokens at all
SPLITS = [[5, 0, 3], [0, 0, 6], [2, 0, 0], [0, 0, 0]]
LAYERS = ["linear", "grouped-split", "grouped-grouped"]
MODES = {  # hook, backwards, fused, async (async reduce-scatter + prefetch on backward)
    "plain": (None, 1, False, False),
    "save_on_cpu": ("save_on_cpu", 1, False, False),
    "retain2": ("save_on_cpu", 2, False, False),
    "fused": (None, 1, True, False),
    "fused-retain2": ("save_on_cpu", 2, True, False),
    "async": ("save_on_cpu", 2, False, True),
    "async-fused": (None, 2, True, True),
}
INDIVISIBLE = ["plain", "retain2", "fused"]  # N = 5: shards of 3, 2 (W=2) and 2, 2, 1, 0 (W=4)
CASES = (
    [f"{layer}-{mode}" for layer in LAYERS for mode in MODES]
    + [f"{layer}-{mode}-N5" for layer in LAYERS[:2] for mode in INDIVISIBLE]
    + ["overlap", "overlap-retain2", "kept-forward"]
)


def _parse(case: str) -> dict:
    layer = next(lay for lay in LAYERS if case.startswith(lay))
    rest = case[len(layer) + 1 :]
    n5 = rest.endswith("-N5")
    hook, backwards, fused, async_ = MODES[rest[:-3] if n5 else rest]
    return dict(layer=layer, hook=hook, backwards=backwards, fused=fused, async_=async_, N=5 if n5 else 8, K=K)


_randn = functools.partial(randn, scale=0.25, draw_device="cpu")  # drawn on the CPU: the same values on any device


def _shard_rows(N: int, world: int, rank: int) -> slice:
    R = -(-N // world)
    return slice(min(rank * R, N), min(rank * R + R, N))


def _count_collectives() -> Counter:
    """Count every torch.distributed collective the code under test calls."""
    counts: Counter = Counter()
    alias = {
        "all_gather_single": "all_gather",
        "all_gather_into_tensor": "all_gather",
        "reduce_scatter_single": "reduce_scatter",
        "reduce_scatter_tensor": "reduce_scatter",
    }
    for name in [*alias, "all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all_single", "reduce"]:
        f = getattr(dist, name, None)
        if f is not None:

            def wrapped(*a, _f=f, _n=alias.get(name, name), **k):
                counts[_n] += 1
                return _f(*a, **k)

            setattr(dist, name, wrapped)
    return counts


def _data(c: dict, world: int, dtype, device):
    """The same full weights on every rank; every rank's tokens (each rank builds all of them
    for the reference)."""
    N, K, E_ = c["N"], c["K"], 1 if c["layer"] == "linear" else E
    fulls = [_randn(N, K, seed=100 + e, dtype=dtype, device=device) for e in range(E_)]
    bias = [_randn(N, seed=200 + e, dtype=dtype, device=device) for e in range(E_)]
    splits = [s[:E_] if E_ > 1 else [sum(s)] for s in SPLITS[:world]]
    xs = [_randn(sum(s), K, seed=300 + r, dtype=dtype, device=device) for r, s in enumerate(splits)]
    dys = [_randn(sum(s), N, seed=400 + r, dtype=dtype, device=device) for r, s in enumerate(splits)]
    return fulls, bias, splits, xs, dys


def _reference(fulls, bias, splits, xs, dys):
    """The unsharded layer (float64, CPU) on all ranks' tokens concatenated expert by expert;
    returns each rank's output and dgrad rows and the full weight grads."""
    f64 = lambda t: t.detach().double().cpu()  # noqa: E731
    E_, world = len(fulls), len(xs)
    offs = [[sum(s[:e]) for e in range(E_)] for s in splits]
    order, rows_of = [], [[] for _ in range(world)]
    for e in range(E_):
        for r in range(world):
            rows_of[r] += range(len(order), len(order) + splits[r][e])
            order += [(r, offs[r][e] + i) for i in range(splits[r][e])]
    N, K = fulls[0].shape
    X = torch.stack([f64(xs[r][i]) for r, i in order]) if order else torch.zeros(0, K, dtype=torch.float64)
    DY = torch.stack([f64(dys[r][i]) for r, i in order]) if order else torch.zeros(0, N, dtype=torch.float64)
    X.requires_grad_()
    ws = [f64(w).requires_grad_() for w in fulls]
    bs = [f64(b) for b in bias]
    ref_splits = [sum(s[e] for s in splits) for e in range(E_)]
    if E_ == 1:
        Y = fd.linear(X, ws[0], bs[0], backend="torch")
    else:
        Y = fd.grouped_linear(X, ws, ref_splits, bs, backend="torch", use_grouped_tensor=False)
    Y.backward(DY)
    return [Y.detach()[rows] for rows in rows_of], [X.grad[rows] for rows in rows_of], [w.grad for w in ws]


def _close(actual, expected, dtype, what):
    assert_close(actual.detach().cpu(), expected.cpu(), dtype, what)


def _check_case(case: str, c: dict, counts: Counter, dtype, device, backend) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    fulls, bias, splits, xs, dys = _data(c, world, dtype, device)
    ref_y, ref_dx, ref_dw = _reference(fulls, bias, splits, xs, dys)
    if c["layer"] == "linear":
        ws = [fdd.shard_weight(fulls[0], async_grad_reduce=c["async_"])]
    else:  # the grouped path's weights come in as one [E, N, K] tensor, the split path's as a list
        full = torch.stack(fulls) if c["layer"] == "grouped-grouped" else fulls
        ws = fdd.shard_grouped_weights(full, async_grad_reduce=c["async_"])
    rows = _shard_rows(c["N"], world, rank)
    assert all(tuple(w.shape) == (rows.stop - rows.start, c["K"]) for w in ws), [tuple(w.shape) for w in ws]
    if c["fused"]:
        for w in ws:  # Megatron's bookkeeping; ShardedWeight would create main_grad itself
            w.main_grad = torch.full(w.shape, 0.25, dtype=torch.float32, device=device)  # non-zero:
            w.grad_added_to_main_grad = False  # accumulate vs overwrite must show
    x = xs[rank].clone().requires_grad_()
    bs = [b.clone().requires_grad_() for b in bias]
    hook = HOOKS[c["hook"]]() if c["hook"] else contextlib.nullcontext()
    counts.clear()
    with hook:
        if c["layer"] == "linear":
            y = fd.linear(x, ws[0], bs[0], fuse_wgrad_accumulation=c["fused"], backend=backend)
        else:
            grouped = c["layer"] == "grouped-grouped"
            sp = torch.tensor(splits[rank], device=device) if grouped and device != "cpu" else splits[rank]
            y = fd.grouped_linear(
                x, ws, sp, bs, fuse_wgrad_accumulation=c["fused"], use_grouped_tensor=grouped, backend=backend
            )
    if c["async_"]:
        fdd.prefetch_on_grad(y, ws)  # each backward's all-gather starts as backward reaches y
    B = c["backwards"]
    for i in range(B):
        y.backward(dys[rank], retain_graph=i < B - 1)
    if c["async_"]:  # delivered as each backward ended; nothing is left to wait for
        assert not ws[0]._dw.pending, "async: the reduce-scatters were delivered when backward ended"
        assert all(w.grad is not None for w in ws) or c["fused"], "async: .grad filled when backward returned"
        fdd.wait_for_grads(ws)  # a no-op now: must not add the grads twice (checked below)
    assert dict(counts) == {"all_gather": 1 + B, "reduce_scatter": B}, f"one collective per pass: {dict(counts)}"
    assert dict(ws[0]._dw.stats) == dict(counts)
    where = f"{case} rank {rank}/{world}"
    _close(y, ref_y[rank], dtype, f"{where}: output")
    _close(x.grad, B * ref_dx[rank], dtype, f"{where}: dgrad")
    for e, w in enumerate(ws):
        want = B * ref_dw[e][rows]
        if c["fused"]:
            _close(
                w.main_grad,
                want + 0.25,
                torch.float32 if dtype != torch.bfloat16 else dtype,
                f"{where}: main_grad[{e}]",
            )
            assert w.grad_added_to_main_grad is True
            assert w.grad is None or not w.grad.any(), "fused: only zero dummies reach .grad"
        else:
            assert w.grad is not None and w.grad.dtype == w.dtype, f"{where}: grad[{e}]"
            _close(w.grad, want, dtype, f"{where}: grad[{e}]")
    local = [dy for dy in dys[rank].split(splits[rank])]
    for e, b in enumerate(bs):  # bias is not sharded: its grad is this rank's own
        _close(b.grad, B * local[e].double().sum(0), dtype, f"{where}: bias grad[{e}]")


def _mlp_step(x, w1, w2, splits, dy, backward_times, backend):
    y = fd.grouped_linear(
        torch.nn.functional.gelu(fd.grouped_linear(x, w1, splits, backend=backend)), w2, splits, backend=backend
    )
    for i in range(backward_times):
        y.backward(dy, retain_graph=i < backward_times - 1)
    return y.detach()


def _check_overlap(case: str, dtype, device, backend) -> None:
    """A two-layer expert MLP over two steps with an SGD update between: the overlap options
    (set_prefetch_order, reshard_after_forward=False on the last layer, async reduce-scatter)
    under save_on_cpu, with retain_graph twice, and a stale prefetch left before the update,
    give bitwise the numbers of the in-line mode, with the collectives counted."""
    world, rank = dist.get_world_size(), dist.get_rank()
    H, Fh, E_ = 8, 12, 3
    f1 = [_randn(Fh, H, seed=10 + e, dtype=dtype, device=device) for e in range(E_)]
    f2 = [_randn(H, Fh, seed=20 + e, dtype=dtype, device=device) for e in range(E_)]
    splits = SPLITS[rank % len(SPLITS)]
    x0 = _randn(sum(splits), H, seed=30 + rank, dtype=dtype, device=device)
    dy = _randn(sum(splits), H, seed=40 + rank, dtype=dtype, device=device)
    B = 2 if case.endswith("retain2") else 1
    runs = {}
    for overlap in (False, True):
        w1 = fdd.shard_grouped_weights(f1, async_grad_reduce=overlap)
        w2 = fdd.shard_grouped_weights(f2, async_grad_reduce=overlap, reshard_after_forward=not overlap)
        if overlap:
            fdd.set_prefetch_order([*w1, torch.zeros(1), *w2])  # a parameter of no group is skipped
        outs = []
        for step in range(2):
            x = x0.clone().requires_grad_()
            with torch.autograd.graph.save_on_cpu():
                y = _mlp_step(x, w1, w2, splits, dy, B, backend)
            outs += [y, x.grad, *[w.grad.clone() for w in (*w1, *w2)]]
            if overlap and step == 0:  # left unused: the update changes the shards, so it is not used
                fdd.prefetch_for_backward(w1)
            with torch.no_grad():
                for w in (*w1, *w2):
                    w.sub_(0.5 * w.grad)
                    w.grad = None
        runs[overlap] = outs, dict(w1[0]._dw.stats), dict(w2[0]._dw.stats)
    (ref, s1, s2), (got, o1, o2) = runs[False], runs[True]
    for i, (a, b) in enumerate(zip(ref, got)):
        assert torch.equal(a, b), f"{case} rank {rank}/{world}: tensor {i} of the two steps differs from in-line"
    assert s1 == s2 == {"all_gather": 2 * (1 + B), "reduce_scatter": 2 * B}, (s1, s2)
    # overlap: layer 1 as in-line plus the stale prefetch; layer 2 keeps its forward gather for
    # the first backward (a retained second one gathers again)
    assert o1 == {"all_gather": 2 * (1 + B) + 1, "reduce_scatter": 2 * B}, o1
    assert o2 == {"all_gather": 2 * B, "reduce_scatter": 2 * B}, o2


def _check_kept_forward(dtype, device, backend) -> None:
    """reshard_after_forward=False keeps a forward's gather for its backward only: after a
    forward under no_grad (no backward comes) and an update through ``.data`` (which leaves no
    version behind), the next forward gathers the new shards."""
    rank = dist.get_rank()
    f = [_randn(8, 4, seed=50 + e, dtype=dtype, device=device) for e in range(2)]
    ws = fdd.shard_grouped_weights(f, reshard_after_forward=False)
    x = _randn(5, 4, seed=60 + rank, dtype=dtype, device=device)
    with torch.no_grad():
        y0 = fd.grouped_linear(x, ws, [3, 2], backend=backend)
        for w in ws:
            w.data.mul_(2)
        y1 = fd.grouped_linear(x, ws, [3, 2], backend=backend)
    assert torch.equal(y1, 2 * y0), "a forward used the weights kept from the forward before an update"
    assert ws[0]._dw.stats["all_gather"] == 2


def _job(cases: list[str], device: str = "cpu", backend: str | None = None, gpu: bool = False) -> dict:
    """Runs in every rank: each case, recording assertion failures per case (they happen after
    the case's collectives, so the ranks stay in step); any other error fails the whole job."""
    if gpu:
        device = f"cuda:{dist.get_rank()}"
    counts = _count_collectives()
    out = {}
    for case in cases:
        if case.startswith(("overlap", "kept")):
            try:
                check = _check_kept_forward if case == "kept-forward" else partial(_check_overlap, case)
                check(torch.bfloat16 if gpu else torch.float64, device, backend)
                out[case] = None
            except AssertionError as err:
                out[case] = f"{type(err).__name__}: {err}"
            continue
        c = _parse(case)
        if gpu:
            c.update(N=64, K=64)  # TE-friendly sizes (multiples of 16)
        dtype = torch.bfloat16 if gpu else (torch.float32 if c["layer"] == "grouped-grouped" else torch.float64)
        try:
            _check_case(case, c, counts, dtype, device, backend)
            out[case] = None
        except AssertionError as err:
            out[case] = f"{type(err).__name__}: {err}"
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=["W2", "W4"])
def cpu_results(request):
    return fdd.launch(_job, request.param, CASES, backend="gloo", timeout=HANG_S, deadline=HANG_S)


@pytest.mark.parametrize("case", CASES)
def test_sharded_equals_unsharded(cpu_results, case):
    failures = [f"rank {r}: {res[case]}" for r, res in enumerate(cpu_results) if res[case] is not None]
    assert not failures, "\n".join(failures)


# --- launcher: failures are fast --------------------------------------------------------------


def _fail_on_rank_1():
    if dist.get_rank() == 1:
        raise ValueError("rank 1 fails on purpose")
    dist.all_reduce(torch.ones(1))  # rank 0 waits here for a peer that is gone


def test_a_failing_rank_fails_the_launch_fast():
    # rank 0 waits in a collective whose timeout is the hang guard: the launch raises rank 1's
    # error (not the deadline's TimeoutError) only when it stops rank 0 itself
    with pytest.raises(mp.ProcessRaisedException, match="rank 1 fails on purpose"):
        fdd.launch(_fail_on_rank_1, 2, backend="gloo", timeout=HANG_S, deadline=HANG_S)


def _sleep_forever():
    time.sleep(600)


def test_launch_deadline_kills_the_ranks():
    # the rank sleeps 600 s: a launch that waited for it would return without an error
    with pytest.raises(TimeoutError, match="still running"):
        fdd.launch(_sleep_forever, 1, backend="gloo", deadline=4)


# --- single-process checks ---------------------------------------------------------------------


def test_needs_a_process_group():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        fdd.shard_grouped_weights([torch.randn(4, 2)])


def test_rejects_mismatched_experts():
    with pytest.raises(ValueError, match=r"weights\[1\]"):
        fdd.shard_grouped_weights([torch.randn(4, 2), torch.randn(5, 2)])


# --- demo --------------------------------------------------------------------------------------


def test_demo_on_two_ranks(capsys):
    from functional_dw import demo

    assert demo.main(["--ranks", "2", "--experts", "4", "--tokens", "32", "--hidden", "16", "--ffn", "32"]) == 0
    out = capsys.readouterr().out
    assert "OK" in out and "2 ranks" in out


# --- GPU: NCCL on two GPUs, TE kernels ---------------------------------------------------------

GPU_CASES = [case for case in CASES if not case.endswith("-N5")]


def _two_gpus_with_te() -> str | None:
    if torch.cuda.device_count() < 2:
        return "needs 2 CUDA GPUs"
    try:
        import transformer_engine.pytorch  # noqa: F401
    except ImportError:
        return "needs Transformer Engine for PyTorch"
    return None


@pytest.fixture(scope="module")
def gpu_results():
    why = _two_gpus_with_te()
    if why:
        pytest.skip(why)
    return fdd.launch(_job, 2, GPU_CASES, None, "te", True, backend="nccl", timeout=120, deadline=400)


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES)
def test_sharded_equals_unsharded_nccl_te(gpu_results, case):
    failures = [f"rank {r}: {res[case]}" for r, res in enumerate(gpu_results) if res[case] is not None]
    assert not failures, "\n".join(failures)


def _overlap_one_gpu() -> dict:
    out = {}
    for case in ("overlap", "overlap-retain2", "kept-forward"):
        try:
            check = _check_kept_forward if case == "kept-forward" else partial(_check_overlap, case)
            check(torch.bfloat16, "cuda:0", None)
            out[case] = None
        except AssertionError as err:
            out[case] = f"{type(err).__name__}: {err}"
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_overlap_streams_on_one_gpu():
    """NCCL with one rank: the collectives are copies on NCCL's stream, so this checks the
    overlap options' stream ordering (prefetches, kept gathers, async reduce-scatters waited on
    by events) on the GPU: bitwise the in-line mode's numbers over two steps."""
    (res,) = fdd.launch(_overlap_one_gpu, 1, backend="nccl", timeout=120, deadline=300)
    failures = [f"{case}: {msg}" for case, msg in res.items() if msg is not None]
    assert not failures, "\n".join(failures)
