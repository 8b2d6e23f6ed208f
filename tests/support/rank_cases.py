"""Cases that run in every rank of one launch (CPU, gloo, 2 ranks): named check functions,
each case's assertion failure collected (so the ranks stay in step) and reported as its own
test; and the data the cases share (a two-layer expert MLP's full weights, each rank's tokens).
Used by test_distributed_overlap.py."""

from __future__ import annotations

from typing import Callable

import pytest
import torch
import torch.distributed as dist

import functional_dw as fd
from functional_dw import distributed as fdd
from helpers import randn

H, F, E = 8, 12, 3  # hidden, ffn, experts of the cases' two-layer expert MLP


def rnd(*shape: int, seed: int) -> torch.Tensor:
    return randn(*shape, seed=seed, dtype=torch.float64, draw_dtype=None, scale=0.25)


def data() -> tuple:
    """The same full weights on every rank (fc1 [F, H], fc2 [H, F] per expert), this rank's
    splits, tokens and output grad."""
    rank = dist.get_rank()
    f1 = [rnd(F, H, seed=10 + e) for e in range(E)]
    f2 = [rnd(H, F, seed=20 + e) for e in range(E)]
    splits = [[3, 0, 2], [1, 4, 0]][rank]
    return f1, f2, splits, rnd(sum(splits), H, seed=30 + rank), rnd(sum(splits), H, seed=40 + rank)


def gl(x: torch.Tensor, ws: list, splits: list, **kw) -> torch.Tensor:
    return fd.grouped_linear(x, ws, splits, backend="torch", **kw)


def _run(cases: dict[str, Callable[[], None]]) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name, check in cases.items():
        try:
            check()
            out[name] = None
        except AssertionError as err:
            out[name] = f"AssertionError: {err}"
    return out


def launch_cases(cases: dict[str, Callable[[], None]], world_size: int = 2) -> list[dict]:
    """Every rank's results (gloo): ``{case: None or the failure}``. The checks must be
    module-level functions (they are pickled by name into the spawned ranks)."""
    return fdd.launch(_run, world_size, cases, backend="gloo", timeout=60, deadline=120)


def failures(results: list[dict], case: str) -> str:
    return "\n".join(f"rank {r}: {res[case]}" for r, res in enumerate(results) if res[case] is not None)


def mlp_weights(f1: list, f2: list, prefetch: bool) -> tuple[list, list]:
    """The two layers' ShardedWeights, with set_prefetch_order along them when ``prefetch``."""
    w1, w2 = fdd.shard_grouped_weights(f1), fdd.shard_grouped_weights(f2)
    if prefetch:
        fdd.set_prefetch_order([*w1, *w2])
    return w1, w2


def assert_steps_equal(outs: dict, why: str) -> None:
    """``outs[False]`` (the reference run) and ``outs[True]``, step by step, bitwise."""
    for step, (a, b) in enumerate(zip(outs[False], outs[True])):
        assert torch.equal(a, b), f"step {step}: output differs {why}"


def make_rank_case_tests(cases: dict[str, Callable[[], None]]) -> tuple:
    """A module's fixture and test, one test per case (all cases in one launch):
    ``results, test_name = make_rank_case_tests(CASES)``."""

    @pytest.fixture(scope="module")
    def results() -> list[dict]:
        return launch_cases(cases)

    @pytest.mark.parametrize("case", list(cases))
    def test(results: list[dict], case: str) -> None:
        assert not failures(results, case), failures(results, case)

    return results, test
