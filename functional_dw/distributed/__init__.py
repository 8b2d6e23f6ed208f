"""Sharded weights for :func:`linear` and :func:`grouped_linear` over ``torch.distributed``
(ZeRO-3 / FSDP style): a :class:`ShardedWeight` implements the DistributedWeight protocol.

Semantics are data parallel: every rank runs its own tokens through the full weights, which
live sharded across the ranks. A rank's weight gradient is therefore the sum over ranks of the
full gradient, restricted to its rows: a reduce-scatter.

The layout (out-feature rows in blocks of ``ceil(N / W)``, one collective per group) is in
:mod:`.sharded`'s docstring.

Runnable recipe (``GLOO_SOCKET_IFNAME=lo torchrun --standalone --nproc-per-node 2 recipe.py``)::

    import torch, torch.distributed as dist, functional_dw as fd
    from functional_dw.distributed import shard_grouped_weights
    dist.init_process_group("gloo")
    torch.manual_seed(0)                                   # the same full weights on every rank
    ws = shard_grouped_weights([torch.randn(64, 32) for _ in range(4)])
    torch.manual_seed(1 + dist.get_rank())                 # this rank's own tokens
    x = torch.randn(10, 32, requires_grad=True)
    fd.grouped_linear(x, ws, [3, 0, 5, 2]).sum().backward()
    print(dist.get_rank(), [tuple(w.grad.shape) for w in ws])   # each rank: its shards' grads
    dist.destroy_process_group()

or, without torchrun, ``functional_dw.distributed.launch(fn, world_size, *args)``.

Every rank must run the same sharded layers in the same order (forward and backward), even a
rank with no tokens: the collectives are matched across ranks by order, as in FSDP.

The modules: :mod:`.sharded` (:class:`ShardedWeight` and its groups: the collectives, prefetch,
async reduce-scatter), :mod:`.fsdp2` (:func:`shard_module`: the same layers under FSDP2),
:mod:`.checkpoint` (distributed and full state dicts), :mod:`.launcher` (:func:`launch`: local
ranks for tests and examples).
"""

from __future__ import annotations

from .checkpoint import checkpoint_state_dict, load_checkpoint, load_full_state_dict, save_checkpoint
from .fsdp2 import shard_module
from .launcher import launch
from .sharded import (
    ShardedWeight,
    prefetch_for_backward,
    prefetch_on_grad,
    set_prefetch_order,
    shard_grouped_weights,
    shard_weight,
    wait_for_grads,
)

__all__ = [
    "ShardedWeight",
    "shard_grouped_weights",
    "shard_weight",
    "set_prefetch_order",
    "prefetch_for_backward",
    "prefetch_on_grad",
    "wait_for_grads",
    "launch",
    "shard_module",
    "checkpoint_state_dict",
    "save_checkpoint",
    "load_checkpoint",
    "load_full_state_dict",
]
