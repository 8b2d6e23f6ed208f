"""Megatron-Core drop-ins: functional_dw's experts inside Megatron's MoE layer.

:class:`GroupedMLP` goes in place of ``TEGroupedMLP`` (its subclass, made on first access) and
runs the whole expert MLP as one :func:`functional_dw.grouped_mlp` node on the parameters of its
``linear_fc1``/``linear_fc2``, the grouped linears below (docs/megatron.md says what each
setting does; its helpers are at the end of this module). The linears alone:

Put :class:`ColumnParallelGroupedLinear` / :class:`RowParallelGroupedLinear` into the MoE layer
spec where Megatron-Core 0.19.2 has ``TEColumnParallelGroupedLinear`` /
``TERowParallelGroupedLinear`` (``megatron/core/extensions/transformer_engine.py``)::

    GroupedMLPSubmodules(linear_fc1=ColumnParallelGroupedLinear, linear_fc2=RowParallelGroupedLinear)

``TEGroupedMLP`` builds them with the constructor of Megatron's TE classes and calls
``fc(x, m_splits) -> (out, bias or None)``. The layers are :class:`functional_dw.nn.GroupedLinear`
(the experts' weights and DistributedWeights ride in the residuals record, never through
``save_for_backward``), so Megatron's fine-grained activation offloading (saved-tensor hooks
around ``expert_fc1`` and ``moe_act``) sees only activations.

What each Megatron setting does here (the rest of :class:`GroupedLinear`'s docstring):

- ``config.gradient_accumulation_fusion``: the weight grads are accumulated into each weight's
  fp32 ``main_grad`` (Megatron DDP's buffer), ``overwrite_main_grad`` overwrites instead,
  ``grad_added_to_main_grad`` is set and a zero dummy grad returned, so DDP's hook still fires
  (functional_dw's ``fuse_wgrad_accumulation``, TE's rules).
- parameters ``weight0..``/``bias0..`` (or one ``weight``/``bias`` with
  ``config.moe_single_grouped_weight``/``moe_single_grouped_bias``) in ``config.params_dtype``
  on the device TE would use; weights drawn with ``init_method`` under Megatron's expert RNG
  tracker (when it is initialized), biases zero, as TE's class does; Megatron's parameter
  attributes (``allreduce``, ``tensor_model_parallel``, ``partition_dim``,
  ``partition_stride``) set by Megatron's own ``_set_expert_parameter_attributes``. They (and any
  other attribute a parameter carries) survive what makes new parameter objects: ``to_empty`` or
  Megatron's ``to_empty_if_meta_device`` from the meta device, ``.to()`` under
  ``torch.__future__.set_swap_module_params_on_conversion(True)``, ``load_state_dict(assign=True)``
  (re-attached as TE's ``_apply`` re-attaches its quantized parameters' attributes).
- ``_extra_state`` in TE's format; ``sharded_state_dict`` per expert as ``TEGroupedLinear``
  builds it (Megatron's ``make_sharded_tensors_for_checkpoint``); loading accepts (and drops)
  the ``_extra_state1..`` keys a distributed checkpoint adds.
- ``config.fp8`` with the ``delayed``, ``tensorwise`` or ``blockwise`` recipe: the layers follow
  the TE autocast Megatron enters for the step (``recipe=None``: see functional_dw.nn's
  NOTE: [FP8 in the modules]); ``mxfp8``, ``custom``, ``config.fp4``, ``config.fp8_param`` and
  ``config.quant_recipe`` raise ``NotImplementedError`` at construction.
- ``save_original_input`` (set by Megatron's ``set_save_original_input`` when ``expert_fc1`` is
  offloaded): without FP8 x is always saved as given, so it changes nothing; with FP8 forward
  raises ``NotImplementedError`` (FP8 saves x's quantized copy).
- ``backward_dw()`` is a no-op; ``config.delay_wgrad_compute`` (and
  ``overlap_dispatch_backward_with_experts_wgrad``) raise ``NotImplementedError`` at construction.
- expert tensor parallelism (``expert_tensor_parallel_size > 1``) is out of scope:
  ``ValueError`` at construction.

Sharded DistributedWeights: ``weight_shard_group=`` (a process group; bind it with
``functools.partial`` in the spec) or :func:`shard_expert_weights` after construction make the
experts' weights :class:`functional_dw.distributed.ShardedWeight` (ZeRO-3 style: gathered for
each GEMM, grads reduce-scattered over that group into ``main_grad``). Their grads arrive
already summed over the group: do not also let Megatron DDP reduce them over it.

This module imports without megatron-core; megatron-core is imported by the constructors
(``pip install -e ".[megatron]"``; megatron-core 0.19.2 declares Python >= 3.12).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from . import nn
from .nn_fp8 import reset_state
from .distributed import ShardedWeight, shard_grouped_weights
from .grouped_linear import grouped_linear
from .megatron_experts import check_linears, mlp_activation, pad_probs, refuse_unsupported_mlp, route_to_megatron

# (and GroupedMLP, made on first access, not listed: ``import *`` works without megatron-core)
__all__ = ["GroupedLinear", "ColumnParallelGroupedLinear", "RowParallelGroupedLinear", "shard_expert_weights"]

MEGATRON_VERSION = "0.19.2"
_SUPPORTED_FP8 = ("delayed", "tensorwise", "blockwise")


def _megatron() -> dict[str, Any]:
    """What the layers use from megatron-core, imported now (never at module import)."""
    try:
        from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
        from megatron.core.extensions.transformer_engine import _set_expert_parameter_attributes
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, get_expert_parallel_rng_tracker_name
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint
        from megatron.core.utils import get_pg_rank, get_pg_size
    except ImportError as e:
        raise ImportError(
            f"functional_dw.megatron needs megatron-core (tested with {MEGATRON_VERSION}): "
            f'pip install -e ".[megatron]" (megatron-core {MEGATRON_VERSION} needs Python >= 3.12). '
            f"Importing it failed: {e}"
        ) from e
    return dict(
        replace_prefix_for_sharding=replace_prefix_for_sharding,
        set_expert_parameter_attributes=_set_expert_parameter_attributes,
        ProcessGroupCollection=ProcessGroupCollection,
        get_cuda_rng_tracker=get_cuda_rng_tracker,
        expert_rng_name=get_expert_parallel_rng_tracker_name,
        make_sharded_tensors_for_checkpoint=make_sharded_tensors_for_checkpoint,
        get_pg_rank=get_pg_rank,
        get_pg_size=get_pg_size,
    )


def _refuse_unsupported(config: Any) -> None:
    """NotImplementedError for the Megatron settings these layers do not implement."""
    for flag in ("delay_wgrad_compute", "overlap_dispatch_backward_with_experts_wgrad"):
        if getattr(config, flag, False):
            raise NotImplementedError(
                f"config.{flag}=True: functional_dw.megatron's grouped linears compute the weight grads "
                f"in backward (backward_dw() is a no-op); set config.{flag}=False or use TE's classes"
            )
    if getattr(config, "fp4", None):
        raise NotImplementedError(f"config.fp4={config.fp4!r}: functional_dw runs no FP4; set config.fp4=None")
    if getattr(config, "fp8", None):
        recipe = getattr(config.fp8_recipe, "value", config.fp8_recipe)
        if recipe not in _SUPPORTED_FP8:
            raise NotImplementedError(
                f"config.fp8_recipe={recipe!r}: functional_dw.megatron runs the {', '.join(_SUPPORTED_FP8)} "
                "recipes (Hopper FP8); pick one of them or use TE's classes"
            )
        if getattr(config, "fp8_param", False):
            raise NotImplementedError(
                "config.fp8_param=True (FP8 primary weights): not supported by "
                "functional_dw; set config.fp8_param=False"
            )
    if getattr(config, "quant_recipe", None) is not None:
        raise NotImplementedError(
            "config.quant_recipe (per-module quantization overrides) is not supported by "
            "functional_dw.megatron; set config.quant_recipe=None"
        )


def _device(config: Any) -> torch.device | str:
    """Where TE's class puts the parameters (Megatron's _get_extra_te_kwargs)."""
    if config.use_cpu_initialization:
        return "cpu"
    if config.init_model_with_meta_device:
        return "meta"
    return torch.device("cuda", torch.cuda.current_device())


def _check_linear_args(is_expert: bool, parallel_mode: Any, config: Any, init_method: Any) -> None:
    """The grouped linears' constructor arguments checked, before anything is built."""
    if not is_expert:
        raise ValueError(
            "is_expert=False: functional_dw.megatron's grouped linears serve MoE experts only "
            "(as TEGroupedLinear); build them through TEGroupedMLP (is_expert=True)"
        )
    if parallel_mode not in ("column", "row", None):
        raise ValueError(f"parallel_mode must be 'column', 'row' or None, got {parallel_mode!r}")
    if not hasattr(config, "params_dtype"):
        raise TypeError(f"config must be Megatron's TransformerConfig, got {type(config).__name__}")
    if not callable(init_method):  # (None would leave the weights as uninitialized memory)
        raise TypeError(f"init_method must be callable (Megatron passes config.init_method), got {init_method!r}")
    _refuse_unsupported(config)


class GroupedLinear(nn.GroupedLinear):
    """``TEGroupedLinear``'s constructor and forward on :class:`functional_dw.nn.GroupedLinear`
    (see this module's docstring for what each Megatron setting does). Use the column/row
    subclasses in a spec; this base takes ``parallel_mode`` as TE's base class does.

    ``forward(x, m_splits) -> (out, bias)``: ``bias`` is None unless ``skip_bias_add`` and
    ``bias``, when it is the list of E per-expert biases in x's dtype, not added (what
    ``TEGroupedMLP._apply_bias`` scales by the router probabilities per split).

    ``weight_shard_group`` (not Megatron's): a process group over which to shard the experts'
    weights as DistributedWeights (:func:`shard_expert_weights`); None keeps plain parameters.
    """

    def __init__(
        self,
        num_gemms: int,
        input_size: int,
        output_size: int,
        *,
        parallel_mode: str | None,
        config: Any,
        init_method: Callable[[torch.Tensor], Any],
        bias: bool,
        skip_bias_add: bool,
        is_expert: bool = False,
        tp_comm_buffer_name: str | None = None,
        pg_collection: Any = None,
        name: str | None = None,
        weight_shard_group: Any = None,
    ) -> None:
        mc = _megatron()
        _check_linear_args(is_expert, parallel_mode, config, init_method)
        if pg_collection is None:
            pg_collection = mc["ProcessGroupCollection"].use_mpu_process_groups()
        etp = mc["get_pg_size"](getattr(pg_collection, "expt_tp", None))
        if etp > 1:
            raise ValueError(
                f"expert tensor parallelism (expert_tensor_parallel_size={etp}) is not supported by "
                "functional_dw.megatron; set expert_tensor_parallel_size=1 or use TE's classes"
            )
        self._mc, self._pg_collection, self._tp_group = mc, pg_collection, pg_collection.expt_tp
        self._megatron_init: Callable | None = None  # set below: super().__init__'s reset draws nothing
        super().__init__(
            num_gemms,
            input_size,
            output_size,
            bias,
            params_dtype=config.params_dtype,
            device=_device(config),
            fuse_wgrad_accumulation=bool(config.gradient_accumulation_fusion),
            single_grouped_weight=bool(getattr(config, "moe_single_grouped_weight", False)),
            single_grouped_bias=bool(getattr(config, "moe_single_grouped_bias", False)),
        )
        self.config, self.parallel_mode, self.name = config, parallel_mode, name
        self.te_return_bias = bool(skip_bias_add and bias)  # TE's name: the biases are returned, not added
        self.delay_wgrad_compute = False
        self.save_original_input = False
        self.expert_parallel = config.expert_model_parallel_size > 1
        use_expert_pgs = self.expert_parallel or config.expert_tensor_parallel_size != config.tensor_model_parallel_size
        self._megatron_init = init_method if config.perform_initialization else (lambda w: None)
        self.reset_parameters()
        mc["set_expert_parameter_attributes"](self, parallel_mode, use_expert_pgs)
        self._register_load_state_dict_pre_hook(_drop_split_extra_states, with_module=True)
        if weight_shard_group is not None:
            shard_expert_weights(self, weight_shard_group)

    def reset_parameters(self) -> None:
        """Megatron's initialization (TE's order): each expert's weight by ``init_method``, under
        the expert-parallel RNG tracker when it is initialized; biases zero. (During the base
        constructor nothing is drawn: the weights stay uninitialized until ``init_method`` is set.)"""
        reset_state(self)
        init = getattr(self, "_megatron_init", None)
        if init is None:
            return
        tracker = self._mc["get_cuda_rng_tracker"]()
        with torch.no_grad():
            for w in self.weights():
                if tracker.is_initialized():
                    with tracker.fork(self._mc["expert_rng_name"]()):
                        init(w)
                else:
                    init(w)
            for b in self.biases() or []:
                b.zero_()

    def forward(
        self, x: torch.Tensor, m_splits: Sequence[int] | torch.Tensor
    ) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        w = self.weight if self.single_grouped_weight else self.weights()
        b = None if self.te_return_bias else (self.bias if self.single_grouped_bias else self.biases())
        recipe, state = self._fp8_begin(x)
        if recipe is not None and self.save_original_input:
            raise NotImplementedError(
                f"{self.name or type(self).__name__}: save_original_input=True under FP8 (Megatron sets it when "
                "'expert_fc1' is in config.offload_modules or with moe_act recompute): functional_dw saves x's "
                "quantized copy under FP8; drop 'expert_fc1' from offload_modules or run without FP8"
            )
        y = grouped_linear(
            x,
            w,
            m_splits,
            b,
            fuse_wgrad_accumulation=self.fuse_wgrad_accumulation,
            use_grouped_tensor=self.use_grouped_tensor,
            backend=self.backend,
            recipe=recipe,
            fp8_state=state,
        )
        y = self._fp8_end(y, state)
        if self.te_return_bias:
            return y, [bias.to(x.dtype) for bias in self.biases()]
        return y, None

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        """Converted parameters keep their attributes (see :func:`_kept_attributes`)."""
        with _kept_attributes(self):
            return super()._apply(fn, recurse)

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        """Assigned parameters (``assign=True``) keep the attributes of those they replace."""
        with _kept_attributes(self):
            super()._load_from_state_dict(*args, **kwargs)

    def backward_dw(self) -> None:
        """A no-op: the weight grads are computed in backward (``delay_wgrad_compute`` is refused)."""

    def _sharded_state_dict_grouped(
        self, tp_axis_map: dict[str, int], prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict:
        """Per expert ``weight{i}``, ``bias{i}``, ``_extra_state{i or ''}`` with an expert-parallel
        axis at the global expert index: ``TEGroupedLinear._sharded_state_dict_grouped``, with
        Megatron's helpers. Every expert's ``_extra_state`` entry is the module's whole state
        (TE splits a delayed-scaling state per expert; TE's FP8 distributed checkpoints do not
        load here)."""
        mc = self._mc
        from megatron.core.dist_checkpointing.mapping import ShardedObject
        from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

        metadata = ensure_metadata_has_dp_cp_group(metadata)
        singleton_local_shards = metadata.get("singleton_local_shards", False)
        full = self.state_dict(prefix="", keep_vars=True)
        weights, biases = self.weights(), self.biases()
        E, ep = self.num_gemms, self._pg_collection.ep
        num_global, offset = mc["get_pg_size"](ep) * E, mc["get_pg_rank"](ep) * E
        out: dict = {}
        for i in range(E):
            expert = {f"{i}.weight": weights[i], f"{i}._extra_state": full["_extra_state"]}
            if self.use_bias:
                expert[f"{i}.bias"] = biases[i]
            if singleton_local_shards:
                expert_prefix, offsets = f"{offset + i}.{prefix}", sharded_offsets
            else:
                expert_prefix, offsets = prefix, (*sharded_offsets, (len(sharded_offsets), offset + i, num_global))
            sub = mc["make_sharded_tensors_for_checkpoint"](
                expert, "", tp_axis_map, offsets, tp_group=self._tp_group, dp_cp_group=metadata["dp_cp_group"]
            )
            mc["replace_prefix_for_sharding"](sub, f"{i}.", expert_prefix)
            out[f"{prefix}weight{i}"] = sub[f"{i}.weight"]
            out[f"{prefix}_extra_state{'' if i == 0 else i}"] = sub[f"{i}._extra_state"]
            if self.use_bias:
                out[f"{prefix}bias{i}"] = sub[f"{i}.bias"]
        pgs = self._pg_collection
        for sh in out.values():  # the expert-DP replica id, as TEGroupedLinear sets it
            if getattr(sh, "is_data_parallel_fully_shard", False):
                rank = 0
            elif isinstance(sh, ShardedObject):
                rank = mc["get_pg_rank"](getattr(pgs, "expt_dp_gtp_remat", None) or pgs.expt_dp)
            else:
                rank = mc["get_pg_rank"](pgs.expt_dp)
            sh.replica_id = (*sh.replica_id[:2], rank)
        return out


@contextlib.contextmanager
def _kept_attributes(module: torch.nn.Module) -> Iterator[None]:
    """Re-attach each parameter's Python attributes (Megatron's ``allreduce``, ``partition_dim``,
    ...) to the parameter of that name afterwards, where it is a new object without them: torch
    makes new parameters from meta tensors (``to_empty``), under ``swap_tensors`` (which swaps
    ``__dict__`` too) and for ``load_state_dict(assign=True)``. What the new one has is kept."""
    kept = {n: dict(vars(p)) for n, p in module._parameters.items() if p is not None}
    yield
    for n, attrs in kept.items():
        new = module._parameters.get(n)
        if new is not None:
            for k, v in attrs.items():
                if k not in vars(new):
                    setattr(new, k, v)


def _drop_split_extra_states(module: GroupedLinear, state_dict: dict, prefix: str, *args: Any) -> None:
    """A distributed checkpoint has ``_extra_state1..`` (one per expert, see
    ``_sharded_state_dict_grouped``): each holds the whole state, which ``_extra_state`` loads."""
    for i in range(1, module.num_gemms):
        state_dict.pop(f"{prefix}_extra_state{i}", None)


class ColumnParallelGroupedLinear(GroupedLinear):
    """In place of Megatron's ``TEColumnParallelGroupedLinear`` (``linear_fc1``): the same
    constructor (``parallel_mode`` is "column")."""

    def __init__(
        self,
        num_gemms: int,
        input_size: int,
        output_size: int,
        *,
        config: Any,
        init_method: Callable[[torch.Tensor], Any],
        bias: bool,
        skip_bias_add: bool,
        is_expert: bool,
        tp_comm_buffer_name: str | None = None,
        pg_collection: Any = None,
        name: str | None = None,
        weight_shard_group: Any = None,
    ) -> None:
        super().__init__(
            num_gemms,
            input_size,
            output_size,
            parallel_mode="column",
            config=config,
            init_method=init_method,
            bias=bias,
            skip_bias_add=skip_bias_add,
            is_expert=is_expert,
            tp_comm_buffer_name=tp_comm_buffer_name,
            pg_collection=pg_collection,
            name=name,
            weight_shard_group=weight_shard_group,
        )

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """Each expert's weight and bias sharded along axis 0 (TE's column-parallel map)."""
        axes = {f"{i}.{n}": 0 for i in range(self.num_gemms) for n in ("weight", "bias")}
        return self._sharded_state_dict_grouped(axes, prefix, sharded_offsets, metadata)


class RowParallelGroupedLinear(GroupedLinear):
    """In place of Megatron's ``TERowParallelGroupedLinear`` (``linear_fc2``): the same
    constructor (``parallel_mode`` is "row")."""

    def __init__(
        self,
        num_gemms: int,
        input_size: int,
        output_size: int,
        *,
        config: Any,
        init_method: Callable[[torch.Tensor], Any],
        bias: bool,
        skip_bias_add: bool,
        is_expert: bool,
        tp_comm_buffer_name: str | None = None,
        pg_collection: Any = None,
        name: str | None = None,
        weight_shard_group: Any = None,
    ) -> None:
        super().__init__(
            num_gemms,
            input_size,
            output_size,
            parallel_mode="row",
            config=config,
            init_method=init_method,
            bias=bias,
            skip_bias_add=skip_bias_add,
            is_expert=is_expert,
            tp_comm_buffer_name=tp_comm_buffer_name,
            pg_collection=pg_collection,
            name=name,
            weight_shard_group=weight_shard_group,
        )

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """Each expert's weight sharded along axis 1, biases replicated (TE's row-parallel map)."""
        axes = {f"{i}.weight": 1 for i in range(self.num_gemms)}
        return self._sharded_state_dict_grouped(axes, prefix, sharded_offsets, metadata)


def shard_expert_weights(module: torch.nn.Module, group: Any = None) -> list[ShardedWeight]:
    """Replace ``module``'s ``weight0..weight{E-1}`` by this rank's shards of them, one
    :class:`~functional_dw.distributed.ShardedWeight` group over ``group`` (default: the world),
    keeping each parameter's Python attributes (Megatron's ``allreduce``, ``partition_dim``, ...;
    not ``main_grad``, which must be the shard's shape: give each new weight its own). Works on
    these layers and on any module with TE's per-expert weight names (TE's ``GroupedLinear``).
    Call it on every rank of ``group``, after the module is on its device. Returns the shards."""
    E = getattr(module, "num_gemms", None)
    if not isinstance(E, int) or getattr(module, "single_grouped_weight", False):
        raise ValueError(
            f"shard_expert_weights: {type(module).__name__} needs per-expert weights weight0..weight{{E-1}} "
            "and num_gemms (config.moe_single_grouped_weight=False)"
        )
    names = [f"weight{i}" for i in range(E)]
    olds = [module._parameters[n] for n in names]
    if any(isinstance(w, ShardedWeight) for w in olds):
        raise ValueError(f"shard_expert_weights: {type(module).__name__}'s weights are sharded already")
    shards = shard_grouped_weights([w.detach() for w in olds], group, requires_grad=olds[0].requires_grad)
    for n, old, new in zip(names, olds, shards):
        for k, v in vars(old).items():
            if k != "main_grad" and k not in vars(new):
                setattr(new, k, v)
        module._parameters[n] = new
    return shards


# --- the experts module: the whole MLP as one pure pair ---------------------------------------


# Over 60 lines: the class is built inside this function because it subclasses megatron-core's
# TEGroupedMLP, which is imported only on first access (the module imports without
# megatron-core); its body is TEGroupedMLP's constructor and forward, each one short piece.
def _grouped_mlp_class() -> type:
    """functional_dw.megatron.GroupedMLP, made on first use (it subclasses Megatron's TEGroupedMLP)."""
    _megatron()  # (megatron-core missing: the install hint)
    from megatron.core.pipeline_parallel.fine_grained_activation_offload import (
        FineGrainedActivationOffloadingInterface as off_interface,
    )
    from megatron.core.transformer.moe.experts import TEGroupedMLP
    from megatron.core.transformer.moe.moe_utils import skip_routed_expert_padding

    from .mlp_checks import check_options

    class GroupedMLP(TEGroupedMLP):
        __doc__ = _GROUPED_MLP_DOC
        _runs_children_fused = True  # one FSDP2 unit with its linears: NOTE: [FSDP2 over GroupedMLP] in nn.py

        def __init__(
            self,
            num_local_experts: int,
            config: Any,
            submodules: Any = None,
            pg_collection: Any = None,
            name: str | None = None,
            save: str | None = None,
        ) -> None:
            if not hasattr(config, "params_dtype"):
                raise TypeError(f"config must be Megatron's TransformerConfig, got {type(config).__name__}")
            activation = mlp_activation(config)
            refuse_unsupported_mlp(config, submodules)
            if submodules is None:
                from megatron.core.transformer.moe.experts import GroupedMLPSubmodules

                submodules = GroupedMLPSubmodules(
                    linear_fc1=ColumnParallelGroupedLinear, linear_fc2=RowParallelGroupedLinear
                )
            if pg_collection is None:
                pg_collection = _megatron()["ProcessGroupCollection"].use_mpu_process_groups()
            super().__init__(num_local_experts, config, submodules, pg_collection=pg_collection, name=name)
            check_linears(self, GroupedLinear, (ColumnParallelGroupedLinear, RowParallelGroupedLinear))
            if save is None:  # Megatron's moe_act recompute: h recomputed in backward; else kept, as TE's fc2 keeps it
                save = "default" if self.activation_recompute else "h"
            check_options(activation, save)
            self.activation, self.save = activation, save

        def forward(
            self,
            permuted_local_hidden_states: torch.Tensor,
            tokens_per_expert: torch.Tensor | Sequence[int],
            permuted_probs: torch.Tensor,
            output_buffer: torch.Tensor | None = None,
            grad_input_buffer: torch.Tensor | None = None,
        ) -> tuple[torch.Tensor, None]:
            """TEGroupedMLP's forward as one autograd node: ``(output, None)``."""
            if output_buffer is not None or grad_input_buffer is not None:
                raise NotImplementedError(
                    "output_buffer/grad_input_buffer (NCCL-EP zero-copy) need TE's op-fuser path; "
                    "functional_dw.megatron.GroupedMLP takes neither"
                )
            config = self.config
            x, probs = permuted_local_hidden_states, permuted_probs
            splits = tokens_per_expert.tolist() if isinstance(tokens_per_expert, torch.Tensor) else [*tokens_per_expert]
            unpadded = None
            if (config.fp8 or config.fp4) and not skip_routed_expert_padding(config):  # as TEGroupedMLP
                unpadded = splits
                x, splits = self.quantization_padding(x, splits)
                probs = pad_probs(self.quantization_padding, probs, unpadded)
            if config.moe_apply_probs_on_input:
                if config.moe_router_topk != 1:
                    raise ValueError(
                        f"config.moe_apply_probs_on_input needs moe_router_topk=1, got {config.moe_router_topk}"
                    )
                x = (probs.unsqueeze(-1) * x).to(x.dtype)  # Megatron's order and rounding
                # probs already applied: 1 (as Megatron), kept only to weight fc2's bias (x * 1 is exact)
                probs = torch.ones_like(probs) if self.linear_fc2.use_bias else None
            fc1_off, act_off = self.offload_expert_fc1, self.offload_moe_act
            manager = off_interface(fc1_off or act_off, x, "expert_fc1" if fc1_off else "moe_act")
            with manager as x:
                with route_to_megatron(x, fc1_off, act_off) if fc1_off or act_off else contextlib.nullcontext():
                    y = nn.run_grouped_mlp(
                        self.linear_fc1, self.linear_fc2, x, splits, probs, activation=self.activation, save=self.save
                    )
            y = manager.group_offload(
                y,
                forced_released_tensors=[x] if fc1_off else [],
                delay_offload=config.delay_offload_until_cuda_graph,
            )
            if unpadded is not None:
                y = self.quantization_unpadding(y, unpadded)
            return y, None

        def extra_repr(self) -> str:
            return f"activation={self.activation!r}, save={self.save!r}"

    GroupedMLP.__module__ = __name__
    GroupedMLP.__qualname__ = "GroupedMLP"
    return GroupedMLP


_GROUPED_MLP_DOC = """In place of Megatron's ``TEGroupedMLP`` (its subclass: the same constructor,
``forward``, parameters, ``state_dict`` and ``sharded_state_dict``), running fc1, the
activation weighted by the router's probs and fc2 as ONE autograd node,
:func:`functional_dw.grouped_mlp`, on the parameters of its ``linear_fc1``/``linear_fc2``
(:class:`ColumnParallelGroupedLinear`/:class:`RowParallelGroupedLinear`, the default
submodules). The weights ride in the residual record by reference; Megatron's fine-grained
offloading of ``expert_fc1`` and ``moe_act`` sees only activations. See docs/megatron.md.

``save`` (not Megatron's; bind it with ``functools.partial`` in a spec): grouped_mlp's residual
policy. None: ``"default"`` (h recomputed in backward) with ``moe_act`` in
``config.recompute_modules`` (``recompute_granularity="selective"``), else ``"h"`` (kept).
"""

GroupedMLP: type  # made on first access (module __getattr__): it subclasses megatron-core's TEGroupedMLP


def __getattr__(name: str) -> Any:
    if name == "GroupedMLP":
        cls = _grouped_mlp_class()
        globals()["GroupedMLP"] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
