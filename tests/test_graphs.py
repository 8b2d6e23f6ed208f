"""CUDA graphs, the parts a CPU can check: the clear errors for splits that cannot be captured
(capture is simulated), and ``functional_dw.graphs``' argument errors and CPU pass-through.
The captures themselves run in ``tests/test_graphs_gpu.py``."""

from __future__ import annotations

import types

import pytest
import torch

import functional_dw as fd
from functional_dw import kernels
from functional_dw.kernels import Splits


@pytest.fixture
def capturing(monkeypatch):
    """Pretend the current CUDA stream is capturing a graph."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)


def test_device_splits_on_the_split_path_raise_clearly_under_capture(capturing):
    fake_cuda = types.SimpleNamespace(is_cuda=True)  # a CUDA splits tensor, as far as sizes() asks
    s = Splits(host=None, tensor=fake_cuda, device=torch.device("cuda"), num_tokens=4, num_experts=2)
    with pytest.raises(RuntimeError, match="split path .* host.* sync, which CUDA graph capture forbids"):
        s.sizes()


def test_host_splits_copied_to_the_gpu_raise_clearly_under_capture(capturing):
    with pytest.raises(RuntimeError, match="splits given on the host .* cannot be captured"):
        kernels._to_device([1, 2], torch.int64, torch.device("cuda"))


def test_host_splits_outside_capture_are_untouched(capturing):
    s = Splits(host=(1, 3), tensor=None, device=torch.device("cpu"), num_tokens=4, num_experts=2)
    assert s.sizes() == (1, 3)  # host sizes need no device: nothing to refuse
    assert kernels._to_device([1, 2], torch.int64, torch.device("cpu")).tolist() == [1, 2]
