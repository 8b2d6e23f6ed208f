"""functional_dw: Transformer Engine's Linear and GroupedLinear as pure fwd/bwd pairs.

Each layer is ``fwd(inputs) -> (out, residuals)`` and ``bwd(residuals, d_out) -> grads``
with an explicit residuals record; :func:`custom_vjp` turns a pair into an autograd
Function that is safe under saved-tensor hooks, ``retain_graph`` and ``torch.func``.
"""

from . import nn
from . import graphs  # (CUDA graphs: graph_step, PinnedOffload)
from . import moe  # (the MoE layer's routing: dispatch, combine, topk_router, moe_layer)
from .custom_vjp import custom_vjp
from .distributed_weight import DistributedWeight, is_distributed_weight
from .grouped_linear import (
    GroupedLinearResiduals,
    grouped_linear,
    grouped_linear_bwd,
    grouped_linear_bwd_dgrad,
    grouped_linear_bwd_wgrad,
    grouped_linear_fwd,
)
from .grouped_mlp import GroupedMLPResiduals, MLPGrads, grouped_mlp, grouped_mlp_bwd, grouped_mlp_fwd
from .mlp_rows import TopkRows
from .linear import LinearResiduals, linear, linear_bwd, linear_bwd_dgrad, linear_bwd_wgrad, linear_fwd
from .residuals import residuals, saved, saved_activations

__all__ = [
    "custom_vjp",
    "residuals",
    "saved",
    "saved_activations",
    "nn",
    "graphs",
    "moe",
    "DistributedWeight",
    "is_distributed_weight",
    "linear",
    "linear_fwd",
    "linear_bwd",
    "linear_bwd_dgrad",
    "linear_bwd_wgrad",
    "LinearResiduals",
    "grouped_linear",
    "grouped_linear_fwd",
    "grouped_linear_bwd",
    "grouped_linear_bwd_dgrad",
    "grouped_linear_bwd_wgrad",
    "GroupedLinearResiduals",
    "grouped_mlp",
    "grouped_mlp_fwd",
    "grouped_mlp_bwd",
    "GroupedMLPResiduals",
    "MLPGrads",
    "TopkRows",
]
__version__ = "0.1.0"
