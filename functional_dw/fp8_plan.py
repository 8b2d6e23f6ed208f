"""FP8 plumbing for the layers: a :class:`Plan` per call says how it quantizes; its class is
the recipe's family's.

A layer builds its plan in ``_prepare`` (:func:`plan`; None when ``recipe`` is None, and then
nothing here runs) and hands each tensor to the kernels' ``quantize``/``grouped_quantize``
through the plan's methods (the kernels' side: ``kernels/protocol.py``, NOTE: [FP8 operands]):

=================  ===================================  ==========================================
when               tensor                               copies, scale (delayed scaling)
=================  ===================================  ==========================================
forward            x (per expert for a group)           rowwise for fprop + columnwise kept for
                                                        wgrad; the state's input scale, amax
                                                        recorded into its history row 0
forward            each expert's weight                 rowwise; the state's weight scale (a
                                                        snapshot is kept), amax recorded
backward           each expert's weight, materialized   columnwise for dgrad; forward's scale
                   again                                snapshot, no amax recorded (the bits of
                                                        forward's FP8 weight)
backward           x recomputed (grouped_mlp's h)       columnwise for wgrad; forward's scale
                                                        snapshot, no amax recorded (the bits of
                                                        forward's copy)
backward           dy (per expert for a group)          rowwise for dgrad, columnwise for wgrad;
                                                        the state's grad_output scale, amax
                                                        recorded into the backward history
=================  ===================================  ==========================================

Current and block scaling compute every scale from the tensor itself (no state, no snapshot).

The plan is context in the residuals (by reference, never saved): the recipe, the three
:class:`~functional_dw.fp8.TensorSpec`, the split-accumulator flags, the state (the caller's
object: its amax histories are written in place), the activations' dtype and device, and for
delayed scaling the forward scales the call quantized with. A plan as :func:`plan` makes it
(and the layers cache it) holds no state: each call binds its own (:meth:`Plan.bind`, NOTE:
[The state is bound per call]).

Recipe families (NOTE: [FP8 kernels by family]). :func:`family` is the one place that looks at
the recipe's kind: it maps the recipe's class to its family's subclass of :class:`Plan`
(:data:`FAMILIES`, filled by :func:`register_family` in each family's module), which :func:`plan`
instantiates with the family's kernels for the call's backend (:meth:`Plan.choose_kernels`).
The layers read only what the family declares (``one_path``, ``compiles``, ``grouped_only``,
``backend``, ``fixed_path``, ``grouped_problem``, ``check_counts``) and the plan's ``kernels``:

- ``fp8_te_plan.py``, :class:`TEPlan`: TE's recipes (DelayedScaling, Float8CurrentScaling), each
  expert quantized on its own (this base's rules); :class:`TEBlockPlan` (Float8BlockScaling) adds
  the grouped path's 128-token rule. Kernels: ``kernels/emulated.py`` (torch), ``kernels/te_fp8_gemm.py`` (TE).
- ``fp8_rowwise_plan.py``, :class:`RowwisePlan`: functional_dw's RowwiseScaling, the group
  quantized at once (weights cached per version), one grouped path, any token counts, compiles.
  Kernels: ``kernels/rowwise.py`` (torch; Triton on an sm_90 GPU).

docs/design.md "Add an FP8 format" lists the files a new format touches.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch

from . import fp8
from .fp8.state import BWD_PER_GEMM, FWD_PER_GEMM
from .kernels.emulated import EMULATED
from .kernels.packing import per_expert
from .kernels.resolve import builtin_backend

__all__ = [
    "FAMILIES",
    "Plan",
    "as_recipe",
    "plan",
    "family",
    "register_family",
    "with_usage",
    "check_dims",
    "plan_key",
]

_ACTIVATIONS = (torch.float32, torch.bfloat16, torch.float16)
FEATURE_MULTIPLE = 16  # K and N (TE: assert_dim_for_fp8_exec's last dim; cuBLASLt's FP8 leading dims)
LINEAR_TOKEN_MULTIPLE = 8  # TE 2.20 utils.py: assert_dim_for_fp8_exec, product of the leading dims
GROUP_TOKEN_MULTIPLE = 16  # TE 2.20 quantization.py: get_align_size_for_quantization (what Fp8Padding pads to)


def _te_fp8() -> Any:
    """TE's FP8 kernels (imports Transformer Engine: only where backend='te' runs FP8)."""
    from .kernels.te_fp8_gemm import TE_FP8

    return TE_FP8


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
    """How one call quantizes (see the module docstring): the base of the families' classes,
    made by :func:`plan`. ``dtype``/``device`` are the activations' (the record stands in for x
    where the layer checks dy: ``like=``). Immutable and shared (the layers cache plans): a call
    changes it with ``dataclasses.replace``, which keeps the family's class.

    The class attributes and classmethods are the family's rules, which the layers read (some
    before a plan exists); the defaults are TE's recipes'."""

    one_path: ClassVar[bool] = False  # the products have one grouped path (no per-expert path to route to)
    compiles: ClassVar[bool] = False  # runs under torch.compile (else refused: refuse_compile)
    grouped_only: ClassVar[bool] = False  # a GroupedLinear's only: a Linear is refused with not_for_linear
    falls_back: ClassVar[bool] = False  # a call may run bf16 where FP8 does not pay (``pays``); stateless families only
    not_for_linear: ClassVar[str] = ""
    # backend name -> the family's FP8 kernels there (a function that imports them on first use:
    # TE's only where asked for); TE's recipes': the emulation on torch's backend, TE's FP8 GEMMs on TE's
    KERNELS: ClassVar[dict[str, Callable[[], Any]]] = {"torch": lambda: EMULATED, "te": _te_fp8}

    recipe: fp8.Recipe
    x: fp8.TensorSpec
    w: fp8.TensorSpec
    dy: fp8.TensorSpec
    acc: fp8.SplitAccumulator
    state: fp8.DelayedScalingState | None  # delayed: the call's (bind); None as planned
    num_gemms: int
    dtype: torch.dtype
    device: torch.device
    scales: torch.Tensor | None = None  # delayed: the state's scale_fwd when the call began (a clone, bind)
    w_dgrad: Any = None  # forward's FP8 weights, columnwise (NOTE: [FP8 weights for dgrad])
    kernels: Any = None  # the family's kernels for the call's backend (choose_kernels)

    @property
    def delayed(self) -> bool:
        return isinstance(self.recipe, fp8.DelayedScaling)

    # NOTE: [The state is bound per call]
    #   What a plan reads of a delayed-scaling state is metadata (its type, GEMMs, history rows and
    #   device: :func:`_check_state`), so the plan cache keys on that (:func:`plan_key`) and a plan
    #   as planned holds no state. A call binds its own state, and a snapshot of the forward scales
    #   it quantizes with, to the plan it runs (:meth:`bind`; the record keeps it). Hence:
    #   - a module's state may be a new record over its buffers at every access: its calls share
    #     one cached plan, and no cached plan keeps a deleted module's histories alive;
    #   - backward re-quantizes with forward's scales and records no amax (forward recorded
    #     them): the weights (:meth:`requantize_weights`) and a recomputed input
    #     (:meth:`requantize_x`, grouped_mlp's h under ``save="default"``). A state update or
    #     another forward between a forward and its backward (pipeline schedules) changes
    #     neither backward's bits nor the later forward's history row (as TE's
    #     ``te.checkpoint`` restores forward's scales for its recompute).
    #   The snapshot is one clone of ``scale_fwd`` per call (the weights' scale snapshot it
    #   replaces cost the same); forward itself reads the state's scales (TE's quantizers are
    #   cached by their addresses: NOTE: [Delayed quantizers by address]).
    def bind(self, state: Any) -> Plan:
        """This call's plan: for delayed scaling, with ``state`` (checked as planned: the plan
        cache keys on its metadata) and a snapshot of its forward scales; else the plan itself."""
        if not self.delayed:
            return self
        return dataclasses.replace(self, state=state, scales=state.scale_fwd.clone())

    def _forward_scales(self, role: str) -> torch.Tensor | None:
        """The ``[E]`` scales ``role`` (input or weight) was quantized with in forward (strided
        views of the snapshot), or None without delayed scaling."""
        if self.scales is None:
            return None
        return self.scales[fp8.slot(role, 0)[1] :: FWD_PER_GEMM]

    def __repr__(self) -> str:
        names = "/".join(
            str(getattr(s, "fp8_dtype", s)).removeprefix("torch.float8_") for s in (self.x, self.w, self.dy)
        )
        return f"FP8({type(self.recipe).__name__}, x/w/dy {names}{', state' if self.delayed else ''})"

    # --- the family's rules ----------------------------------------------------------------------
    @classmethod
    def backend(cls, asked: Any) -> Any:
        """The backend a GroupedLinear runs for ``backend=asked``: as asked (None and "auto": TE's
        kernels where TE runs, as for one GEMM: FP8 on torch's kernels is the CPU emulation)."""
        return asked

    @classmethod
    def fixed_path(cls, use_grouped_tensor: bool | None) -> tuple[str, str] | None:
        """(path, why) where the family fixes a GroupedLinear's GEMM path (raising for a
        ``use_grouped_tensor`` it cannot honour); None: the kernels' verdict decides."""
        return None

    # NOTE: [FP8 kernels by family]
    #   Which code multiplies FP8 operands is the recipe family's choice, made once when the plan is
    #   made: the family declares its kernels per backend (``KERNELS``: "torch" -> the emulation,
    #   "te" -> TE's FP8 GEMMs; RowwiseScaling: "torch" -> kernels/rowwise.py), and
    #   :meth:`choose_kernels` picks them for the bf16 kernels ``get_kernels`` resolved. The plan
    #   carries them (``Plan.kernels``): the layers quantize and multiply through them, and never
    #   ask an operand's type or the recipe's kind. So the recipe (what is quantized how: the
    #   specs) and the kernels (which code multiplies: emulated, TE, Triton/torch) are separate
    #   settings, as torchao's MoE training separates its recipe from ``KernelPreference``. The
    #   bf16 kernels (``TorchKernels``, ``TEKernels``) take bf16/fp16/fp32 operands only. A
    #   backend object of the user's is its own FP8 kernels (it quantizes, or the plan refuses it).
    #   Adding a format: docs/design.md "Add an FP8 format".
    @classmethod
    def choose_kernels(cls, kernels: Any) -> Any:
        """This family's FP8 kernels on ``kernels``' backend: ``KERNELS[kernels.name]`` for
        functional_dw's own bf16 kernels; any other object (a user's Kernels, or kernels already
        chosen) as it is (NOTE: [FP8 kernels by family])."""
        load = cls.KERNELS.get(builtin_backend(kernels))
        return kernels if load is None else load()

    @classmethod
    def specs(cls, recipe: Any) -> tuple[Any, Any, Any]:
        """How ``recipe`` quantizes x, the weights and dy (``fp8.tensor_spec`` per role)."""
        return tuple(fp8.tensor_spec(recipe, role) for role in fp8.ROLES)

    @classmethod
    def split_accumulator(cls, recipe: Any) -> fp8.SplitAccumulator:
        """Which GEMMs accumulate in split mode (``fp8.split_accumulator``)."""
        return fp8.split_accumulator(recipe)

    @classmethod
    def check_kernels(cls, kernels: Any) -> None:
        """Raise unless ``kernels`` can quantize for this family."""
        if not callable(getattr(kernels, "quantize", None)) or not callable(getattr(kernels, "grouped_quantize", None)):
            raise TypeError(
                f"backend {type(kernels).__name__} has no FP8 kernels (no quantize/grouped_quantize): with a "
                "recipe, functional_dw's own backends (None, 'auto', 'torch', 'te') run the recipe family's FP8 "
                "kernels, and a backend object must quantize and multiply FP8 operands itself (a subclass of "
                "the bf16 TorchKernels or TEKernels is a bf16 backend: NOTE: [FP8 kernels by family]); pass "
                "backend='torch' or 'te', or use your object without a recipe"
            )

    @classmethod
    def check_x(cls, x: torch.Tensor) -> None:
        """Raise where the family cannot run on x's device or dtype (beyond :func:`plan`'s checks)."""

    def pays(self, T: int, K: int, N: int) -> bool:
        """Whether a ``T x K x N`` GEMM runs in FP8; False: the layer runs its bf16 plan instead
        (a family with ``falls_back``; NOTE: [FP8 where it pays] in ``fp8_rowwise_plan.py``)."""
        return True

    def grouped_problem(self, splits: Any) -> str | None:
        """Why the grouped path cannot quantize these per-expert counts (a ``Splits``; the layer
        then runs the split path), or None."""
        return None

    def check_counts(self, K: int, N: int, splits: Sequence[int] | None) -> None:
        """Raise for sizes the FP8 GEMMs do not take (:func:`check_dims`); ``splits`` None:
        counts known only on the device (not checked)."""
        check_dims(K, N, splits=splits)

    # --- delayed scaling: views into the state -------------------------------------------------
    def _views(self, role: str, gemm: int | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(scale, amax) views into the state for ``role``: 0-d for one GEMM, strided ``[E]`` for
        all (``gemm=None``); (None, None) without delayed scaling."""
        if not self.delayed:
            return None, None
        side, first = fp8.slot(role, 0)
        scale = getattr(self.state, f"scale_{side}")
        amax = getattr(self.state, f"amax_history_{side}")[0]
        if gemm is not None:
            col = first + gemm * (FWD_PER_GEMM if side == "fwd" else BWD_PER_GEMM)
            return scale[col], amax[col]
        cols = slice(first, None, FWD_PER_GEMM if side == "fwd" else BWD_PER_GEMM)
        return scale[cols], amax[cols]

    # --- forward ---------------------------------------------------------------------------------
    def quantize_x(
        self, kernels: Any, x_TK: torch.Tensor, splits: Any = None, grouped: bool = False, *, keep: bool
    ) -> Any:
        """x for fprop (rowwise), plus the columnwise copy wgrad reads when ``keep``. ``splits``
        None: one GEMM (``quantize``), else per expert (``grouped_quantize``)."""
        return self._quantize(kernels, "input", self.x, x_TK, splits, grouped, rowwise=True, columnwise=keep)

    def quantize_rows(
        self,
        kernels: Any,
        spec: fp8.TensorSpec,
        t: torch.Tensor,
        rows: torch.Tensor,
        splits: Any,
        grouped: bool,
        *,
        rowwise: bool,
        columnwise: bool,
    ) -> Any:
        """``t[rows]`` per expert (``splits`` count its R rows) as :meth:`quantize_x` (``spec``
        this plan's ``x``) or :meth:`quantize_dy` (its ``dy``) would quantize the gathered rows,
        bit for bit, read through the index (grouped_mlp's ``rows``: fc1's input, and with
        ``combine`` fc2's dy); None where this family and these kernels cannot (TE's recipes
        here): then the caller gathers the rows and quantizes them."""
        return None

    def quantize_activated(
        self,
        kernels: Any,
        act: Any,
        fc1_out: torch.Tensor,
        probs: Any,
        activation: str,
        splits: Any,
        *,
        rowwise: bool,
        columnwise: bool,
    ) -> Any:
        """grouped_mlp's fc2 input ``h = act(fc1_out) * probs``, the copies asked for, bitwise as
        :meth:`quantize_x` would quantize the written h, but computed inside the quantization
        (``act``: the call's activation kernels); None where this family and these kernels
        cannot: then the caller writes h and quantizes it."""
        return None

    # NOTE: [FP8 weights for dgrad] With ``keep`` (plain weights; the layer checks their
    # versions in backward, so a cached copy is never stale) forward quantizes each weight
    # both ways in one pass and the plan holds the columnwise copies by reference, as TE's
    # module keeps its FP8 weights: backward runs no weight quantization. They live on the
    # residual record's context, never through ``save_for_backward`` (hooks see no weight).
    # A DistributedWeight is re-materialized and re-quantized in backward instead (its hooks
    # fire as without FP8); so is a weight whose copy was not kept.
    def quantize_weights(
        self, kernels: Any, w_ENK: Any, *, keep: bool = False, params: Sequence[torch.Tensor] | None = None
    ) -> tuple[Any, Plan]:
        """Each expert's weight for fprop (rowwise; delayed scaling: the state's scales, amaxes
        recorded), and the plan for backward: with ``keep``, it also holds the columnwise copies
        dgrad reads, by reference.
        ``params``: the plain parameters the weights are (a family may cache by them).

        With ``keep``, backward runs no weight quantization (NOTE: [FP8 weights for dgrad]).
        Here (TE's recipes): each weight on its own, with the state's per-GEMM scales under
        delayed scaling (``params`` unused: nothing is cached)."""
        scales, amaxes = self._views("weight", None)
        qs = _quantize_each(kernels, w_ENK, self.w, scales, amaxes, rowwise=True, columnwise=keep)
        if not keep:
            return qs, self
        return qs, dataclasses.replace(self, w_dgrad=tuple(q.with_usage(rowwise=False, columnwise=True) for q in qs))

    # --- backward --------------------------------------------------------------------------------
    def requantize_weights(self, kernels: Any, w_ENK: Any) -> Any:
        """The weights for dgrad (columnwise): forward's copies when kept, else quantized again
        (materialized again) with forward's scales and no amax recorded: for an unchanged
        weight, forward's FP8 bits."""
        if self.w_dgrad is not None:
            return list(self.w_dgrad)
        return _quantize_each(
            kernels, w_ENK, self.w, self._forward_scales("weight"), None, rowwise=False, columnwise=True
        )

    def requantize_x(self, kernels: Any, x_TK: torch.Tensor, splits: Any, grouped: bool) -> Any:
        """x's columnwise copy (wgrad's) of an x recomputed in backward, per expert: with the
        scales forward quantized it with and no amax recorded (NOTE: [The state is bound per
        call]): for the same x, forward's copy, bit for bit."""
        return kernels.grouped_quantize(
            x_TK,
            splits,
            self.x,
            scales=self._forward_scales("input"),
            amaxes=None,
            rowwise=False,
            columnwise=True,
            grouped=grouped,
        )

    def quantize_dy(
        self, kernels: Any, dy_TN: torch.Tensor, splits: Any = None, grouped: bool = False, *, dgrad: bool, wgrad: bool
    ) -> Any:
        """dy for dgrad (rowwise) and wgrad (columnwise), as asked; None when neither GEMM runs."""
        if not (dgrad or wgrad):
            return None
        return self._quantize(kernels, "grad_output", self.dy, dy_TN, splits, grouped, rowwise=dgrad, columnwise=wgrad)

    def _quantize(
        self,
        kernels: Any,
        role: str,
        spec: fp8.TensorSpec,
        t: torch.Tensor,
        splits: Any,
        grouped: bool,
        *,
        rowwise: bool,
        columnwise: bool,
    ) -> Any:
        """An activation (x or dy) through the kernels: one GEMM's (``splits`` None) or per expert,
        with the state's scale/amax views for ``role`` (None without delayed scaling)."""
        if splits is None:
            scale, amax = self._views(role, 0)
            return kernels.quantize(t, spec, scale=scale, amax=amax, rowwise=rowwise, columnwise=columnwise)
        scales, amaxes = self._views(role, None)
        return kernels.grouped_quantize(
            t, splits, spec, scales=scales, amaxes=amaxes, rowwise=rowwise, columnwise=columnwise, grouped=grouped
        )


def with_usage(q: Any, *, rowwise: bool, columnwise: bool) -> Any:
    """``q`` (a quantized tensor, or a group of them: a list per expert, or a backend's grouped
    object) with only the copies asked for."""
    if isinstance(q, (list, tuple)):
        return [m.with_usage(rowwise=rowwise, columnwise=columnwise) for m in q]
    return q.with_usage(rowwise=rowwise, columnwise=columnwise)


def _quantize_each(
    kernels: Any, ts: Any, spec: Any, scales: Any, amaxes: Any, *, rowwise: bool, columnwise: bool
) -> list[Any]:
    """Each of a group's weights quantized on its own: the kernels' ``quantize_each`` where they
    have one (checks once, one call per weight), else ``quantize`` per weight; ``scales``/
    ``amaxes`` strided ``[E]`` views (delayed scaling) or None."""
    each = getattr(kernels, "quantize_each", None)
    if each is not None:
        return each(ts, spec, scales=scales, amaxes=amaxes, rowwise=rowwise, columnwise=columnwise)
    return [
        kernels.quantize(t, spec, scale=scale, amax=amax, rowwise=rowwise, columnwise=columnwise)
        for t, (scale, amax) in zip(ts, per_expert(scales, amaxes, len(ts)))
    ]


FAMILIES: dict[type, type[Plan]] = {}  # recipe class -> its family (register_family)


def register_family(recipe_cls: type, family_cls: type[Plan]) -> type[Plan]:
    """Make ``family_cls`` (a :class:`Plan` subclass) the family of ``recipe_cls``'s recipes;
    returns it. Each family's module registers its recipes when imported (``_fp8.py`` imports
    the built-in ones)."""
    if not (isinstance(family_cls, type) and issubclass(family_cls, Plan)):
        raise TypeError(f"family_cls must be a subclass of fp8_plan.Plan, got {family_cls!r}")
    if not isinstance(recipe_cls, type):
        raise TypeError(f"recipe_cls must be a class, got {recipe_cls!r}")
    FAMILIES[recipe_cls] = family_cls
    return family_cls


def _registered(recipe: Any) -> type[Plan] | None:
    """The family of the nearest class in ``recipe``'s MRO that has one (a subclass registered
    on its own wins over its base's family), or None."""
    for cls in type(recipe).__mro__:
        if cls in FAMILIES:
            return FAMILIES[cls]
    return None


def as_recipe(recipe: Any) -> Any:
    """``recipe`` itself where a family is registered for it, else ``fp8.as_recipe`` (TE's
    recipe objects converted; None for None; anything else refused)."""
    return recipe if _registered(recipe) is not None else fp8.as_recipe(recipe)


def family(recipe: Any) -> type[Plan]:
    """The :class:`Plan` subclass of ``recipe``'s family (:data:`FAMILIES`): the one place the
    recipe's kind is looked at. TE's recipe objects get their converted recipe's family; anything
    else (None, or what :func:`plan` refuses) gets the base's rules (TE's recipes')."""
    ops = _registered(recipe)
    if ops is None:
        try:
            ops = _registered(fp8.as_recipe(recipe))
        except (TypeError, ValueError):
            ops = None
    return Plan if ops is None else ops


def plan(
    recipe: Any, fp8_state: Any, num_gemms: int, x: torch.Tensor, kernels: Any, grouped: bool = True
) -> Plan | None:
    """The checked plan of a call, of the recipe's family's class, or None for ``recipe=None``
    (no FP8: nothing else here runs). It holds no state (``fp8_state`` is checked): a call runs
    ``plan(...).bind(fp8_state)`` (NOTE: [The state is bound per call]).

    ``grouped``: a GroupedLinear's call (a ``grouped_only`` family runs only there).
    Raises TypeError for a recipe that is not one, float64 activations or a backend without FP8;
    ValueError for MXFP8/NVFP4 (from :func:`fp8.as_recipe`), ``backward_override``, a delayed
    recipe without its state, or a state of another size or device."""
    if recipe is None:
        if fp8_state is not None:
            raise ValueError("fp8_state was given without a recipe: pass recipe=fp8.DelayedScaling(...) too")
        return None
    r = as_recipe(recipe)
    refuse_compile(r)
    ops = family(r)
    if getattr(r, "backward_override", None) is not None:
        raise ValueError(
            f"{type(r).__name__}(backward_override={r.backward_override!r}) is not supported: "
            "backward runs the FP8 GEMMs of the recipe (set backward_override=None)"
        )
    if x.dtype not in _ACTIVATIONS:
        raise TypeError(
            f"FP8 ({type(r).__name__}) takes float32, bfloat16 or float16 activations (what TE "
            f"quantizes); x is {x.dtype}: cast x and the weights (e.g. .to(torch.bfloat16)), or "
            "pass recipe=None"
        )
    kernels = ops.choose_kernels(kernels)
    ops.check_kernels(kernels)
    delayed = isinstance(r, fp8.DelayedScaling)
    if delayed:
        _check_state(fp8_state, r, num_gemms, x.device)
    elif fp8_state is not None:
        raise ValueError(
            f"fp8_state is delayed scaling's; {type(r).__name__} computes its scales from each "
            "tensor and keeps no state: pass fp8_state=None"
        )
    if ops.grouped_only and not grouped:
        raise ValueError(ops.not_for_linear)
    ops.check_x(x)
    return ops(r, *ops.specs(r), ops.split_accumulator(r), None, num_gemms, x.dtype, x.device, kernels=kernels)


def _check_state(state: Any, recipe: fp8.DelayedScaling, num_gemms: int, device: torch.device) -> None:
    make = f"fp8.init_state(recipe, num_gemms={num_gemms}, device={str(device)!r})"
    if state is None:
        raise ValueError(
            "DelayedScaling quantizes with scales from amaxes of earlier steps, kept in a state: "
            f"make one with {make}, pass it as fp8_state=..., and call fp8.update_state_(state, "
            "recipe) between steps"
        )
    if not isinstance(state, fp8.DelayedScalingState):
        raise TypeError(f"fp8_state must be a DelayedScalingState (made by {make}), got {type(state).__name__}")
    if state.num_gemms != num_gemms:
        raise ValueError(
            f"fp8_state is for {state.num_gemms} GEMM(s) but this layer runs {num_gemms}: make it with {make}"
        )
    if state.scale_fwd.device != device:
        raise ValueError(
            f"fp8_state is on {state.scale_fwd.device} but x is on {device}: make it with {make} (or move its tensors)"
        )
    if state.history_len != recipe.amax_history_len:
        raise ValueError(
            f"fp8_state has {state.history_len} history rows but recipe.amax_history_len is "
            f"{recipe.amax_history_len}: fp8.adjust_history_len(state, {recipe.amax_history_len})"
        )


def check_dims(K: int, N: int, *, tokens: int | None = None, splits: Sequence[int] | None = None) -> None:
    """The sizes TE's FP8 GEMMs take (checked on every backend, so the CPU refuses what the GPU
    would): in/out features multiples of 16; a Linear's tokens a multiple of 8 (TE's
    ``assert_dim_for_fp8_exec``); a group's tokens per expert multiples of 16 (TE's FP8 alignment
    for grouped GEMMs, ``get_align_size_for_quantization``; pad with ``te.Fp8Padding`` or
    Megatron's ``moe_router_padding_for_fp8``). ``splits`` None: counts known only on the device
    (not checked: that would sync)."""
    for name, n in (("in_features (x's last dim, K)", K), ("out_features (the weight's rows, N)", N)):
        if n % FEATURE_MULTIPLE:
            raise ValueError(f"FP8 GEMMs need {name} to be a multiple of {FEATURE_MULTIPLE}, got {n}")
    if tokens is not None and tokens % LINEAR_TOKEN_MULTIPLE:
        raise ValueError(
            f"FP8 GEMMs need x's tokens (the product of its leading dims) to be a multiple of "
            f"{LINEAR_TOKEN_MULTIPLE} (TE's assert_dim_for_fp8_exec), got {tokens}"
        )
    if splits is not None:
        for e, s in enumerate(splits):
            if s % GROUP_TOKEN_MULTIPLE:
                raise ValueError(
                    f"FP8 grouped GEMMs need each expert's tokens to be a multiple of "
                    f"{GROUP_TOKEN_MULTIPLE}; splits[{e}] is {s} (pad the routing: te.Fp8Padding, "
                    "Megatron's moe_router_padding_for_fp8)"
                )


_NO_COMPILE = (
    "FP8 layers do not run under torch.compile yet (per-expert quantization reads host split sizes, and "
    "the reference GEMMs on quantized operands have no custom ops): run them eager, or compile with "
    "recipe=None"
)


@functools.partial(torch.compiler.disable, reason=_NO_COMPILE)
def fp8_layers_do_not_run_under_torch_compile() -> None:
    """Raises :data:`_NO_COMPILE`, eagerly: dynamo does not trace a disabled function, so without
    ``fullgraph`` the graph breaks here and the user sees this error; with ``fullgraph`` dynamo's
    own error names this function."""
    raise NotImplementedError(_NO_COMPILE)


def refuse_compile(recipe: Any = None) -> None:
    """FP8 under torch.compile: a clear error, from the public wrappers before the autograd
    Function (a raise traced inside its forward surfaces as dynamo's own error instead); not for
    a family that ``compiles`` (RowwiseScaling: NOTE: [RowwiseScaling under torch.compile])."""
    if torch.compiler.is_compiling() and not family(recipe).compiles:
        fp8_layers_do_not_run_under_torch_compile()


def plan_key(args: Any) -> Any:
    """What an FP8 plan reads of ``args``, for the plan cache (NOTE: [Plan once, run lean]):
    the recipe's value (functional_dw's recipes are frozen; another object, e.g. TE's recipe,
    by the recipe it converts to: what the plan reads, class attributes included) and the
    state's metadata, not its identity (a plan holds no state: NOTE: [The state is bound per
    call]); None without FP8, or where the recipe does not convert or a field cannot be hashed
    (then the call plans afresh, and its checks say what is wrong)."""
    if args is None:
        return None
    r, state = args.recipe, args.state
    try:
        rk = r if _registered(r) is not None else (type(r), fp8.as_recipe(r))
        sk = None if state is None else (type(state), state.num_gemms, state.history_len, state.scale_fwd.device)
        key = (rk, sk)
        hash(key)
    except (TypeError, ValueError, AttributeError):
        return None
    return key
