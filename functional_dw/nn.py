"""Thin modules for users coming from TE: parameters named as ``te.Linear`` and
``te.GroupedLinear`` name them, so a TE module's ``state_dict`` loads unchanged, and a
``forward`` that is one call of the functional API.

FP8: a module runs with its ``recipe``, else with the recipe of an active TE autocast; delayed
scaling's state is checkpointed in TE's ``_extra_state`` format (NOTE: [FP8 in the modules] in
``nn_fp8.py``, which holds the modules' FP8 mixin).
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Sequence
from typing import Any

import torch

from . import _checks, _fp8
from .grouped_linear import grouped_linear
from .grouped_mlp import grouped_mlp
from .kernels.activation import glu_width
from .kernels import packed
from .linear import linear
from .mlp_checks import check_options
from . import moe, moe_ep
from .nn_layouts import layout_problem, remap_layout
from .nn_fp8 import FP8Module, reset_state, te_autocast_recipe  # noqa: F401  (te_autocast_recipe: nn's name)

__all__ = ["Linear", "GroupedLinear", "GroupedMLP", "MoE", "remap_layouts"]


def _init_(w: torch.Tensor, b: torch.Tensor | None, fan_in: int) -> None:
    """torch.nn.Linear's default init (zero in-features: nothing to draw for w, b bound 0)."""
    if w.numel():
        torch.nn.init.kaiming_uniform_(w, a=math.sqrt(5))
    if b is not None:
        bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0.0
        torch.nn.init.uniform_(b, -bound, bound)


def _size(name: str, v: object, least: int = 0) -> int:
    """An int size (numpy ints too, as torch.nn.Linear takes them) of at least ``least``."""
    try:
        n = operator.index(v) if not isinstance(v, bool) else None
    except TypeError:
        n = None
    if n is None:
        raise TypeError(f"{name} must be an int, got {v!r} ({type(v).__name__})")
    if n < least:
        raise ValueError(f"{name} must be an int >= {least}, got {n}")
    return n


class Linear(FP8Module, torch.nn.Module):
    """``y = x W^T + b`` with parameters ``weight [out, in]`` and ``bias [out]``. ``recipe``:
    an FP8 recipe, or None to follow TE's autocast (see NOTE: [FP8 in the modules]: delayed
    scaling's state lives in buffers and ``_extra_state``, updated lazily at the start of each
    forward after a step)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        fuse_wgrad_accumulation: bool = False,
        backend: str | None = None,
        recipe: Any = None,
    ) -> None:
        super().__init__()
        kw = dict(dtype=params_dtype, device=device)
        self.in_features, self.out_features = _size("in_features", in_features), _size("out_features", out_features)
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features, **kw))
        self.bias = torch.nn.Parameter(torch.empty(out_features, **kw)) if bias else None
        self.fuse_wgrad_accumulation, self.backend = fuse_wgrad_accumulation, backend
        ops = _fp8.family(_fp8.as_recipe(recipe))  # (its family's rule: RowwiseScaling is grouped only)
        if ops.grouped_only:
            raise ValueError(ops.not_for_linear)
        self._init_fp8(recipe, 1, self.weight.device)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initialize the parameters (torch.nn.Linear's rule) and a delayed-scaling state;
        FSDP2-style meta init calls it after ``to_empty``."""
        _init_(self.weight, self.bias, self.in_features)
        reset_state(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        recipe, state = self._fp8_begin(x)
        y = linear(
            x,
            self.weight,
            self.bias,
            fuse_wgrad_accumulation=self.fuse_wgrad_accumulation,
            backend=self.backend,
            recipe=recipe,
            fp8_state=state,
        )
        return self._fp8_end(y, state)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


@functools.lru_cache(maxsize=None)
def _names(prefix: str, n: int) -> tuple[str, ...]:
    """``prefix0 ... prefix{n-1}``: the per-expert parameters' names (made once per size)."""
    return tuple(f"{prefix}{e}" for e in range(n))


# NOTE: [One buffer] The per-expert parameters are views of one contiguous ``[E, out, in]``
# (biases: ``[E, out]``) storage, so the kernels read them in place as one operand (no stack,
# see ``kernels/packing.py``); grads arrive as views of one ``[E, out, in]`` buffer. The
# module keeps the buffer shared: ``load_state_dict`` copies into the views; ``.to()``,
# ``.cuda()``, ``.half()``, ``to_empty()`` convert each group as one tensor (:meth:`_apply`);
# ``load_state_dict(assign=True)`` takes the state dict's tensors where they already are one
# buffer's slices (another GroupedLinear's state dict), else copies them into a new one of
# their dtype and device (the parameters then do not alias them). Sharing one storage, the
# experts share a version counter, and ``safetensors.save_file`` refuses the state dict
# (``torch.save`` stores the buffer once). FSDP2 (``fully_shard``) replaces the parameters with
# its own (sharded DTensors; unsharded per-parameter tensors in forward and backward): there
# the buffer is gone and each pass stacks the weights once (results unchanged); with
# ``single_grouped_weight=True`` FSDP2 gathers the one ``[E, out, in]`` parameter as one
# tensor, read in place (no stack: the layout to use under FSDP2, tests/test_fsdp2.py).
class GroupedLinear(FP8Module, torch.nn.Module):
    """E experts with parameters ``weight0..weight{E-1}`` ``[out, in]`` and ``bias0..``; or, with
    ``single_grouped_weight=True``, one ``weight [E, out, in]`` and one ``bias [E, out]`` (TE's
    names for both layouts; ``single_grouped_bias`` picks the bias layout on its own, by
    default the weight's). A checkpoint of either layout loads into either (as in TE).

    The experts' parameters are views of one buffer (NOTE: [One buffer]): they share a version
    counter, ``safetensors.save_file`` refuses the state dict (``torch.save`` stores the buffer
    once), and under FSDP2 ``single_grouped_weight=True`` keeps the weights one tensor.

    ``recipe``: as for :class:`Linear` (one state of ``num_gemms`` GEMMs, TE's layout)."""

    single_grouped_weight = single_grouped_bias = False  # (for modules pickled before these existed)

    def __init__(
        self,
        num_gemms: int,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        fuse_wgrad_accumulation: bool = False,
        use_grouped_tensor: bool | None = None,
        backend: str | None = None,
        single_grouped_weight: bool = False,
        single_grouped_bias: bool | None = None,
        recipe: Any = None,
    ) -> None:
        super().__init__()
        kw = dict(dtype=params_dtype, device=device)
        self.num_gemms = E = _size("num_gemms", num_gemms, least=1)
        self.in_features, self.out_features = _size("in_features", in_features), _size("out_features", out_features)
        self.use_bias = bias
        self.single_grouped_weight = _checks.flag("single_grouped_weight", single_grouped_weight)
        if single_grouped_bias is not None:
            _checks.flag("single_grouped_bias", single_grouped_bias)
        one_bias = single_grouped_weight if single_grouped_bias is None else single_grouped_bias
        self.single_grouped_bias = bool(bias) and one_bias
        w_ENK = torch.empty(E, out_features, in_features, **kw)  # NOTE: [One buffer]
        b_EN = torch.empty(E, out_features, **kw) if bias else None
        each_bias = not (self.single_grouped_bias if bias else self.single_grouped_weight)  # (None, named so)
        for e in range(E):  # TE's order: weight0, bias0, weight1, ... (views: NOTE: [One buffer])
            if not self.single_grouped_weight:
                self.register_parameter(f"weight{e}", torch.nn.Parameter(w_ENK[e]))
            if each_bias:
                self.register_parameter(f"bias{e}", torch.nn.Parameter(b_EN[e]) if bias else None)
        if self.single_grouped_weight:
            self.register_parameter("weight", torch.nn.Parameter(w_ENK))
        if not each_bias:
            self.register_parameter("bias", torch.nn.Parameter(b_EN) if bias else None)
        self.fuse_wgrad_accumulation, self.use_grouped_tensor = fuse_wgrad_accumulation, use_grouped_tensor
        self.backend = backend
        self._init_fp8(recipe, self.num_gemms, w_ENK.device)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initialize the parameters by torch.nn.Linear's rule for each expert: uniform in
        ``±1/sqrt(in_features)`` (kaiming_uniform_ with a=sqrt(5) is that bound), all weights
        first, then all biases, in expert order: the same values in both layouts from one seed,
        drawn on whole parameters (an FSDP2 DTensor shard takes no per-expert view). FSDP2-style
        meta init calls it after ``to_empty``. Also (re)makes a delayed-scaling state."""
        bound = 1 / math.sqrt(self.in_features) if self.in_features else 0.0
        weights = [self.weight] if self.single_grouped_weight else self.weights()
        biases = [self.bias] if self.single_grouped_bias else self.biases() or []
        with torch.no_grad():
            for p in [*weights, *biases]:
                p.uniform_(-bound, bound)
        reset_state(self)

    def weights(self) -> list[torch.Tensor]:
        """The E ``[out, in]`` weights: the parameters, or views of the one ``weight``."""
        if self.single_grouped_weight:
            return list(self.weight.unbind(0))
        return self._per_expert("weight")

    def biases(self) -> list[torch.Tensor] | None:
        """The E ``[out]`` biases (views of the one ``bias`` in that layout), or None."""
        if not self.use_bias:
            return None
        if self.single_grouped_bias:
            return list(self.bias.unbind(0))
        return self._per_expert("bias")

    def _per_expert(self, prefix: str) -> list[torch.Tensor]:
        names = _names(prefix, self.num_gemms)
        try:  # the registered parameters, read in C (nn.Module.__getattr__ costs ~1 us each)
            return list(map(self._parameters.__getitem__, names))
        except KeyError:  # replaced by plain attributes (FSDP1's flat parameter views): as getattr finds them
            return [getattr(self, n) for n in names]

    def forward(self, x: torch.Tensor, m_splits: Sequence[int] | torch.Tensor) -> torch.Tensor:
        w = self.weight if self.single_grouped_weight else self.weights()
        b = self.bias if self.single_grouped_bias else self.biases()
        recipe, state = self._fp8_begin(x)
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
        return self._fp8_end(y, state)

    # --- NOTE: [One buffer] -------------------------------------------------------------------
    def _groups(self) -> list[list[torch.Tensor]]:
        """The per-expert parameters that share one buffer: the weights, the biases."""
        names = [] if self.single_grouped_weight else ["weight"]
        names += ["bias"] if self.use_bias and not self.single_grouped_bias else []
        groups = [[self._parameters.get(f"{n}{e}") for e in range(self.num_gemms)] for n in names]
        return [g for g in groups if all(isinstance(p, torch.Tensor) for p in g)]

    def _apply(self, fn, recurse: bool = True):
        """nn.Module._apply converts each parameter on its own, into storage of its own: convert
        each group's buffer once instead and hand its parameters views of the result (then
        re-tie any group that was not one buffer)."""
        views = self._converted_views(fn)
        module = super()._apply(lambda t: views.pop(id(t)) if id(t) in views else fn(t), recurse)
        self._tie()
        return module

    def _converted_views(self, fn) -> dict[int, torch.Tensor]:
        """id(parameter) -> its view of ``fn(buffer)``, for each group that is one buffer. (A
        function of its own: no reference to a parameter outlives it, as swap_tensors requires.)"""
        views: dict[int, torch.Tensor] = {}
        with torch.no_grad():
            for ps in self._groups():
                base = packed(ps)
                if base is not None:
                    views.update(zip(map(id, ps), fn(base).unbind(0)))
        return views

    def _tie(self) -> None:
        """Copy each group into one new buffer, unless it is one already (or cannot be: tensor
        subclasses such as FSDP2's DTensors, mixed shapes, dtypes or devices)."""
        with torch.no_grad():
            for ps in self._groups():
                p0 = ps[0]
                if (
                    packed(ps) is not None
                    or not p0.numel()
                    or not all(
                        type(p) is torch.nn.Parameter
                        and p.shape == p0.shape
                        and p.dtype == p0.dtype
                        and p.device == p0.device
                        for p in ps
                    )
                ):
                    continue
                for p, v in zip(ps, torch.stack([p.detach() for p in ps]).unbind(0)):
                    p.data = v

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ) -> None:
        """Load either layout's keys (as TE does); copy into the shared buffer (assign=False)
        or re-tie the assigned tensors (assign=True): NOTE: [One buffer]. The other layout's
        keys that cannot be converted (an expert missing or mis-shaped, a stacked tensor of the
        wrong shape) stay as they are, for torch's missing / unexpected keys, and are an error
        that names the bad key, its shape and the expected one, strict or not (as a size
        mismatch is)."""
        error_msgs += self._remap(state_dict, prefix)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        if local_metadata.get("assign_to_params_buffers", False):
            self._tie()

    def _remap(self, state_dict: dict, prefix: str) -> list[str]:
        """The other layout's keys under ``prefix`` converted in place to this module's
        (:func:`nn_layouts.remap_layout`); returns what cannot be converted (:func:`nn_layouts.layout_problem`),
        those keys left as they are."""
        layouts = [("weight", self.single_grouped_weight, (self.out_features, self.in_features))]
        layouts += [("bias", self.single_grouped_bias, (self.out_features,))] if self.use_bias else []
        problems = []
        for name, single, shape in layouts:
            problem = layout_problem(state_dict, prefix + name, self.num_gemms, single, shape)
            if problem is None:
                remap_layout(state_dict, prefix + name, self.num_gemms, single)
            else:
                problems.append(problem)
        return problems

    def __setstate__(self, state) -> None:
        """After unpickling or ``copy.deepcopy`` (which copies each Parameter on its own): one buffer again."""
        super().__setstate__(state)
        self._tie()

    def extra_repr(self) -> str:
        single = ", single_grouped_weight=True" if self.single_grouped_weight else ""
        single += ", single_grouped_bias=True" if self.single_grouped_bias and not self.single_grouped_weight else ""
        return (
            f"num_gemms={self.num_gemms}, in_features={self.in_features}, "
            f"out_features={self.out_features}, bias={self.use_bias}{single}"
        )


# NOTE: [FSDP2 over GroupedMLP] GroupedMLP's forward runs fc1 and fc2 as one grouped_mlp node on
# their parameters and never calls them, so nothing registered on fc1's or fc2's forward runs.
# FSDP2 gathers a module's parameters in the pre-forward hook of the module fully_shard was
# applied to (and reduce-scatters from hooks that pre-forward sets up): sharded on their own,
# fc1 and fc2 would reach the node as sharded DTensors. So the GroupedMLP is one FSDP2 unit:
# ``distributed.shard_module`` applies fully_shard to it (fc1's and fc2's parameters in its one
# group: one all-gather and one reduce-scatter for both) and never to fc1 or fc2, and forward
# refuses fc1 or fc2 sharded on their own (a ValueError with the fix, not DTensor's "mixed
# torch.Tensor and DTensor"). The other way, forward calling fc1(...) and fc2(...), would split
# the one node into two (two plans, the activation and the probs between them, the save=
# policies gone) and put two module calls' hook dispatch on the host path, to gain nothing:
# the node needs both layers' weights at once, in forward and in backward, so gathering them
# together holds no more memory than gathering them apart. ``_runs_children_fused`` marks the
# modules built this way (functional_dw.megatron.GroupedMLP too) for shard_module.
class GroupedMLP(torch.nn.Module):
    """E experts' MLP, ``fc2(act(fc1(x)) * probs)`` (Megatron's TEGroupedMLP), as one call of
    :func:`functional_dw.grouped_mlp`. ``fc1`` (``hidden_size -> 2 * ffn_hidden_size`` for SwiGLU,
    else ``-> ffn_hidden_size``) and ``fc2`` (``ffn_hidden_size -> hidden_size``) are
    :class:`GroupedLinear` submodules with TE's parameter names, so two GroupedLinear state
    dicts (``fc1.weight0``.. ``fc2.weight{E-1}``, either layout, FP8 ``_extra_state`` included)
    load unchanged. By default each holds one ``weight [E, out, in]`` (``single_grouped_weight=True``:
    the autograd engine then accumulates one gradient per layer, not E, the fastest layout);
    ``single_grouped_weight=False`` keeps TE's E parameters per layer. ``forward`` reads their parameters and runs the pure pair once (not two
    module calls); the other arguments are ``grouped_mlp``'s and GroupedLinear's, for both.

    Under FSDP2 the GroupedMLP is one unit: ``fully_shard`` it (``distributed.shard_module``
    does), not its fc1 or fc2 (refused: NOTE: [FSDP2 over GroupedMLP])."""

    _runs_children_fused = True  # NOTE: [FSDP2 over GroupedMLP]

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        ffn_hidden_size: int,
        *,
        activation: str = "swiglu",
        bias: bool = False,
        save: str = "default",
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        fuse_wgrad_accumulation: bool = False,
        use_grouped_tensor: bool | None = None,
        backend: str | None = None,
        single_grouped_weight: bool = True,
        single_grouped_bias: bool | None = None,
        recipe: Any = None,
    ) -> None:
        super().__init__()
        check_options(activation, save)
        self.activation, self.save = activation, save
        ffn = _size("ffn_hidden_size", ffn_hidden_size)
        kw = dict(
            bias=bias,
            params_dtype=params_dtype,
            device=device,
            fuse_wgrad_accumulation=fuse_wgrad_accumulation,
            use_grouped_tensor=use_grouped_tensor,
            backend=backend,
            single_grouped_weight=single_grouped_weight,
            single_grouped_bias=single_grouped_bias,
            recipe=recipe,
        )
        self.fc1 = GroupedLinear(num_experts, hidden_size, glu_width(activation) * ffn, **kw)
        self.fc2 = GroupedLinear(num_experts, ffn, hidden_size, **kw)

    num_experts = property(lambda self: self.fc1.num_gemms)
    hidden_size = property(lambda self: self.fc1.in_features)
    ffn_hidden_size = property(lambda self: self.fc2.in_features)

    def forward(
        self,
        x: torch.Tensor,
        splits: Sequence[int] | torch.Tensor,
        probs: torch.Tensor | None = None,
        *,
        rows: Any = None,
        combine: bool = False,
    ) -> torch.Tensor:  # rows, combine: as for grouped_mlp (an index into x, or moe's TopkRows)
        return run_grouped_mlp(
            self.fc1, self.fc2, x, splits, probs, activation=self.activation, save=self.save, rows=rows, combine=combine
        )

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}, save={self.save!r}"


def run_grouped_mlp(
    fc1: GroupedLinear,
    fc2: GroupedLinear,
    x: torch.Tensor,
    splits: Sequence[int] | torch.Tensor,
    probs: torch.Tensor | None,
    *,
    activation: str,
    save: str,
    rows: Any = None,
    combine: bool = False,
) -> torch.Tensor:
    """One :func:`functional_dw.grouped_mlp` call on two :class:`GroupedLinear` modules'
    parameters (either layout, biases included): the recipe from fc1's (TE's autocast when it has
    none; fc2 must agree), each layer's delayed-scaling state, fc1's backend and wgrad fusion
    (what :class:`GroupedMLP` and ``functional_dw.megatron.GroupedMLP`` run)."""
    if fc1._forward_pre_hooks or fc2._forward_pre_hooks:  # (two dict reads while fc1 and fc2 have no hooks)
        _refuse_fsdp_layers(fc1, fc2)
        _run_pre_hooks(x, fc1, fc2)
    recipe, state1 = fc1._fp8_begin(x)
    recipe2, state2 = fc2._fp8_begin(x)
    if recipe2 != recipe:
        raise ValueError(f"GroupedMLP runs one FP8 recipe for fc1 and fc2; fc1 has {recipe!r}, fc2 {recipe2!r}")
    states = None if state1 is None and state2 is None else (state1, state2)
    y = grouped_mlp(
        x,
        _layer_weights(fc1),
        _layer_weights(fc2),
        splits,
        probs=probs,
        bias1=_layer_bias(fc1),
        bias2=_layer_bias(fc2),
        activation=activation,
        save=save,
        recipe=recipe,
        fp8_state=states,
        backend=fc1.backend,
        fuse_wgrad_accumulation=fc1.fuse_wgrad_accumulation,
        use_grouped_tensor=fc1.use_grouped_tensor,
        rows=rows,
        combine=combine,
    )
    fc1._fp8_end(y, state1)
    return fc2._fp8_end(y, state2)


def _refuse_fsdp_layers(fc1: GroupedLinear, fc2: GroupedLinear) -> None:
    """ValueError if FSDP2 shards fc1 or fc2 on its own: their forwards never run, so FSDP2 would
    never gather them (NOTE: [FSDP2 over GroupedMLP])."""
    if not torch.distributed.is_available():
        return
    from torch.distributed.fsdp import FSDPModule

    for name, m in (("fc1", fc1), ("fc2", fc2)):
        if isinstance(m, FSDPModule):
            raise ValueError(
                f"GroupedMLP: its {name} ({type(m).__name__}) is sharded on its own with FSDP2's fully_shard, "
                "but GroupedMLP runs fc1 and fc2 as one grouped_mlp node without calling them, so FSDP2 never "
                "gathers their parameters; apply fully_shard to the GroupedMLP instead, not to its fc1 or fc2 "
                "(functional_dw.distributed.shard_module does)"
            )


# NOTE: [The linears' forward pre-hooks] fc1's and fc2's forwards never run (one node: NOTE:
# [FSDP2 over GroupedMLP]), but hooks registered on them must: Megatron's DDP with
# overlap_param_gather waits for each module's parameter all-gather in that module's forward
# pre-hook (``module.parameters(recurse=False)``), so skipping them would read the experts'
# weights before their gather finished. Both run before the node, each given ``(x,)`` (fc2's
# real input, h, is made inside the node); a hook that returns a new input cannot apply and is
# refused, as FSDP2's are (NOTE: [FSDP2 over GroupedMLP]). Forward (post) hooks of fc1/fc2 do
# not run.
def _run_pre_hooks(x: torch.Tensor, *layers: GroupedLinear) -> None:
    """Run ``layers``' forward pre-hooks (NOTE: [The linears' forward pre-hooks])."""
    for m in layers:
        for key, hook in list(m._forward_pre_hooks.items()):
            kw = key in m._forward_pre_hooks_with_kwargs
            out = hook(m, (x,), {}) if kw else hook(m, (x,))
            if out is not None:
                raise ValueError(
                    f"GroupedMLP runs its linears as one node without calling them: a forward pre-hook on "
                    f"{type(m).__name__} {hook!r} returned a new input, which cannot apply there. Register it on "
                    "the GroupedMLP instead (a pre-hook that returns None runs)"
                )


def _layer_weights(m: GroupedLinear) -> Any:
    return m.weight if m.single_grouped_weight else m.weights()


def _layer_bias(m: GroupedLinear) -> Any:
    return m.bias if m.single_grouped_bias else m.biases()


def remap_layouts(model: torch.nn.Module, state_dict: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``state_dict`` with each :class:`GroupedLinear` of ``model`` (at any depth,
    sharded or not) in that module's layout: TE's per-expert ``weight0..weight{E-1}``
    (``bias0..``) stacked into one ``weight [E, out, in]`` (``bias [E, out]``) for a module with
    ``single_grouped_weight=True``, and split back for a per-expert one. ``load_state_dict``
    does this itself; tools that match keys before loading (``set_model_state_dict``,
    ``torch.distributed.checkpoint``) need it first. Other keys are kept as they are. The other
    layout's keys that cannot be converted (an expert missing or mis-shaped, a stacked tensor
    of the wrong shape) raise ValueError naming each bad key, as ``load_state_dict`` does."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: remap_layouts takes a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(state_dict, dict):
        raise TypeError(f"state_dict: remap_layouts takes a dict of tensors, got {type(state_dict).__name__}")
    sd, problems = dict(state_dict), []
    for name, m in model.named_modules():
        if isinstance(m, GroupedLinear):
            problems += m._remap(sd, f"{name}." if name else "")
    if problems:
        raise ValueError("remap_layouts: " + "; ".join(problems))
    return sd


class MoE(torch.nn.Module):
    """``router`` (a :class:`Linear` ``[E, H]``, no bias) picks ``top_k`` experts per token
    (``score``: ``moe.topk_router``'s), ``experts`` (a :class:`GroupedMLP`) runs them weighted by
    the probs: ``y_t = sum_j p_tj * MLP_{e_tj}(x_t)``, dropless, no host sync (``moe.py``).

    ``ep_group``: an expert-parallel process group of ``P`` ranks: ``experts`` then holds this
    rank's ``num_experts / P`` experts (rank ``p``: experts ``p * E / P`` on) and the rows are
    exchanged with ``moe_ep.to_experts``/``from_experts`` (one host read of the counts per
    call); each rank runs its own tokens, and ``router`` must be the same on every rank.
    ``recipe``: the experts' FP8 recipe (:class:`GroupedMLP`'s; the router stays in high precision)."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        ffn_hidden_size: int,
        top_k: int,
        *,
        score: str = "softmax",
        activation: str = "swiglu",
        save: str = "default",
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        backend: str | None = None,
        recipe: Any = None,
        ep_group: Any = None,
    ) -> None:
        super().__init__()
        moe.check_router(top_k, score, E := _size("num_experts", num_experts), "MoE")
        self.top_k, self.score, self.num_experts, self.ep_group = top_k, score, E, ep_group
        E_local = E if ep_group is None else moe_ep.local_experts(E, ep_group)
        kw = dict(params_dtype=params_dtype, device=device, backend=backend)
        self.router = Linear(hidden_size, E, bias=False, **kw)
        self.experts = GroupedMLP(
            E_local, hidden_size, ffn_hidden_size, activation=activation, save=save, recipe=recipe, **kw
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., H] -> y [..., H] (a [H] x: one token)
        if isinstance(x, torch.Tensor) and x.dim() == 0:
            raise ValueError("nn.MoE: x must be [..., hidden_size] (tokens by features), got a 0-dim tensor")
        x2 = x.reshape(-1, x.shape[-1]) if isinstance(x, torch.Tensor) and x.dim() != 2 else x
        y = moe.layer_parts(x2, self.router(x2), self.experts, self.top_k, self.score, self.num_experts, self.ep_group)
        return y.view_as(x)

    def extra_repr(self) -> str:
        ep = "" if self.ep_group is None else f", experts here={self.experts.num_experts} of {self.num_experts}"
        return f"top_k={self.top_k}, score={self.score!r}{ep}"
