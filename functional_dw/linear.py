"""Linear as a pure fwd/bwd pair: ``y = x W^T + b``.

Legend: ``T`` tokens (x's leading dims flattened), ``K`` in-features, ``N`` out-features.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from . import _checks, distributed_weight as dwp
from .custom_vjp import custom_vjp
from .kernels import Kernels, get_kernels
from .kernels.torch_ref import column_sums
from .residuals import needed, residuals, saved

__all__ = ["LinearResiduals", "linear", "linear_fwd", "linear_bwd", "linear_bwd_dgrad", "linear_bwd_wgrad"]


@residuals
class LinearResiduals:
    x: torch.Tensor = saved()  # the input as given (see grouped_linear's NOTE: [Saved x]): the only saved tensor
    x_version: _checks.Stamp  # x's version at forward: the pure API checks it in backward
    weight: torch.Tensor  # the parameter itself (plain or DistributedWeight), by reference
    weight_version: tuple[int | None, ...]
    distributed: bool
    x_shape: tuple[int, ...]
    out_features: int
    has_bias: bool
    fuse_wgrad_accumulation: bool
    kernels: Kernels
    needs: Any = needed()  # which gradients bwd computes (None: all); see NOTE: [Which gradients]


def _wanted(res: LinearResiduals) -> tuple[bool, bool, bool]:
    """(dx, dW, dbias): the gradients backward computes."""
    if res.needs is None:
        return True, True, True
    return tuple(bool(n) for n in res.needs[:3])  # type: ignore[return-value]


class _Call(NamedTuple):
    """A checked call: what forward computes with, and what its residuals record."""

    distributed: bool
    w_NK: torch.Tensor  # the materialized weight the GEMM reads
    x: torch.Tensor  # dense
    bias: torch.Tensor | None
    kernels: Kernels


def _prepare(x, weight, bias, fuse_wgrad_accumulation, backend) -> _Call:
    """Check every argument, materialize the weight, pick the kernels."""
    _checks.tensor("x", x, ndim=tuple(range(1, 9)))
    _checks.tensor("weight", weight, ndim=2)
    _checks.flag("fuse_wgrad_accumulation", fuse_wgrad_accumulation)
    distributed = dwp.is_distributed_weight(weight)
    w_NK = dwp.materialize([weight], distributed, for_backward=False, like=x, name="weight")[0]
    _checks.tensor("weight (materialized)", w_NK, ndim=2)
    N, K = w_NK.shape
    if x.shape[-1] != K:
        what = " (as materialize_group_for_forward() of the DistributedWeight returned it)" if distributed else ""
        raise ValueError(f"x has {x.shape[-1]} features but weight is [{N}, {K}]{what}: x must be [..., {K}]")
    _checks.like("weight", w_NK, x)
    if bias is not None:
        _checks.tensor("bias", bias, ndim=1)
        _checks.shape("bias", bias, (N,))
        _checks.like("bias", bias, x)
    return _Call(distributed, w_NK, _checks.dense(x), bias, get_kernels(backend, x))


def _fprop(c: _Call) -> torch.Tensor:
    K, N = c.x.shape[-1], c.w_NK.shape[0]
    return c.kernels.fprop(_checks.dense(c.x, (_tokens(c.x.shape), K)), c.w_NK, c.bias).view(*c.x.shape[:-1], N)


def linear_fwd(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
    fuse_wgrad_accumulation: bool = False, backend: str | Kernels | None = None,
) -> tuple[torch.Tensor, LinearResiduals]:
    """``y = x @ W^T + b`` and the residuals its backward needs. x ``[..., K]``, weight ``[N, K]``."""
    c = _prepare(x, weight, bias, fuse_wgrad_accumulation, backend)
    res = LinearResiduals(
        x=x, x_version=_checks.stamp(x), weight=weight, weight_version=dwp.versions([weight]),
        distributed=c.distributed, x_shape=tuple(c.x.shape), out_features=c.w_NK.shape[0],
        has_bias=bias is not None, fuse_wgrad_accumulation=fuse_wgrad_accumulation, kernels=c.kernels,
    )
    return _fprop(c), res


def _check_res(res: Any, fn: str) -> LinearResiduals:
    _checks.record(fn, res, LinearResiduals, "linear_fwd")
    _checks.check_stamp("x", res.x, res.x_version)
    return res


def _dy_TN(res: LinearResiduals, dy: torch.Tensor) -> torch.Tensor:
    _checks.cotangent("dy", dy, (*res.x_shape[:-1], res.out_features), res.x)
    return _checks.dense(dy, (_tokens(dy.shape), dy.shape[-1]))


def _tokens(shape: tuple[int, ...]) -> int:
    return math.prod(shape[:-1])  # not view(-1, K): ambiguous when K == 0


def _x_TK(res: LinearResiduals) -> torch.Tensor:
    return _checks.dense(res.x, (_tokens(res.x_shape), res.x_shape[-1]))


def _checked(res: Any, dy: Any, fn: str) -> torch.Tensor:
    """The record, x's and the weight's versions and dy checked once; dy as ``[T, N]``, dense."""
    dy_TN = _dy_TN(_check_res(res, fn), dy)
    dwp.check_versions([res.weight], res.weight_version, "weight")
    return dy_TN


def linear_bwd_dgrad(res: LinearResiduals, dy: torch.Tensor) -> torch.Tensor:
    """dx = dy @ W, with W materialized again (never kept from forward); None when x needs no
    gradient."""
    return _dgrad(res, _checked(res, dy, "linear_bwd_dgrad"))


def linear_bwd_wgrad(res: LinearResiduals, dy: torch.Tensor) -> tuple[Any, torch.Tensor | None]:
    """(dweight, dbias); dweight is what autograd gets for the parameter (see finalize)."""
    return _wgrad(res, _checked(res, dy, "linear_bwd_wgrad"))


def linear_bwd(res: LinearResiduals, dy: torch.Tensor) -> tuple[torch.Tensor, Any, torch.Tensor | None]:
    """(dx, dweight, dbias): :func:`linear_bwd_dgrad` then :func:`linear_bwd_wgrad`, on one
    checked (and densified) dy."""
    dy_TN = _checked(res, dy, "linear_bwd")
    return (_dgrad(res, dy_TN), *_wgrad(res, dy_TN))


def _dgrad(res: LinearResiduals, dy_TN: torch.Tensor) -> torch.Tensor | None:
    w_NK = dwp.materialize([res.weight], res.distributed, for_backward=True, like=res.x, name="weight")[0]
    dwp.check_materialized([w_NK], [(res.out_features, res.x_shape[-1])], "materialize_group_for_backward()", "weight")
    if not _wanted(res)[0]:
        return None  # (a DistributedWeight was still gathered: its collectives match across ranks)
    return res.kernels.dgrad(dy_TN, w_NK).view(res.x_shape)


def _wgrad(res: LinearResiduals, dy_TN: torch.Tensor) -> tuple[Any, torch.Tensor | None]:
    params, fused = [res.weight], res.fuse_wgrad_accumulation
    _, want_w, want_b = _wanted(res)
    shape = (res.out_features, res.x_shape[-1])
    if not want_w or (fused and not res.weight.requires_grad):  # frozen: no wgrad GEMM, main_grad untouched
        db = column_sums(dy_TN) if res.has_bias and want_b else None
        if res.distributed:  # it still finalizes (zeros), once, as every rank does
            return dwp.finalize(params, True, False, [dy_TN.new_zeros(shape)], "weight")[0], db
        return None, db
    out = dwp.grad_targets(params, res.distributed, [shape], "weight")[0] if fused else None
    dw, db = res.kernels.wgrad(
        _x_TK(res), dy_TN, out=out, accumulate=fused and dwp.accumulates(params, res.distributed),
        with_dbias=res.has_bias and want_b,
    )
    return dwp.finalize(params, res.distributed, fused, [dw], "weight")[0], db


def _bwd(res: LinearResiduals, dy: torch.Tensor) -> tuple:
    dx, dw, db = linear_bwd(res, dy)
    return dx, dw, db, None, None  # cotangents of (x, weight, bias, fuse, backend)


def _fwd(x, weight, bias, fuse_wgrad_accumulation, backend):  # positional form for custom_vjp
    return linear_fwd(x, weight, bias, fuse_wgrad_accumulation=fuse_wgrad_accumulation, backend=backend)


def _primal(*args) -> torch.Tensor:
    """Forward alone, when no gradient can be taken: checks and the GEMM, no residuals."""
    return _fprop(_prepare(*args))


def _jvp(res: LinearResiduals, tangents: tuple) -> torch.Tensor:
    """Forward mode: the layer is bilinear, so ``dy = dx W^T + x dW^T + db``."""
    tx, tw, tb = tangents[:3]
    if tw is not None and res.distributed:
        raise ValueError("forward-mode (jvp) tangents for a DistributedWeight are not supported: "
                         "take the tangent with respect to x or bias, or use a plain weight")
    K, N = res.x_shape[-1], res.out_features
    dy = None
    if tx is not None or tb is not None:
        w_NK = dwp.materialize([res.weight], res.distributed, for_backward=False)[0]
        T = _tokens(res.x_shape)
        tx_TK = _checks.dense(tx, (T, K)) if tx is not None else res.x.new_zeros(T, K)
        dy = res.kernels.fprop(tx_TK, w_NK, tb)
    if tw is not None:
        part = res.kernels.fprop(_x_TK(res), tw, None)
        dy = part if dy is None else dy + part
    if dy is None:
        return res.x.new_zeros(*res.x_shape[:-1], N)
    return dy.view(*res.x_shape[:-1], -1)


def _vmap(batch_size: int, in_dims: tuple, x, weight, bias, fuse, backend):
    """A batch of x with shared weights is just more leading dims: one GEMM for the batch."""
    if in_dims[0] is None or in_dims[1] is not None or in_dims[2] is not None:
        return None  # batched weights or bias (an ensemble): one call per element
    return (x.movedim(in_dims[0], 0), weight, bias, fuse, backend), lambda y: (y, 0)


_linear = custom_vjp(_fwd, _bwd, primal=_primal, jvp=_jvp, vmap=_vmap, name="linear")


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
    fuse_wgrad_accumulation: bool = False, backend: str | Kernels | None = None,
) -> torch.Tensor:
    """Differentiable ``y = x @ weight^T + bias`` (TE ``Linear`` semantics).

    ``weight`` may be a DistributedWeight: it is materialized for forward and again for
    backward, and its grads go through ``finalize_group_grads``. Saved-tensor hooks see only
    ``x``. ``fuse_wgrad_accumulation`` accumulates dW into ``weight.main_grad``.
    """
    return _linear(x, weight, bias, _checks.fuse_flag(fuse_wgrad_accumulation), backend)
