"""The expert MLP as one pure pair: fc1, the activation (weighted by the router's probs), fc2.

    h = act(x W1_e^T + b1_e) * probs          (per expert e on its rows; SwiGLU: silu(gate) * up)
    y = h W2_e^T + b2_e * probs                (fc2's bias weighted by probs, as Megatron's _apply_bias)

``grouped_mlp_fwd`` runs fc1's and fc2's own forward (``grouped_linear``'s ``prepare``/``forward``,
the options path of ``grouped_linear_fwd``: NOTE: [The layer's seam]) with the activation in between, and its residual
record NESTS theirs: ``res.fc1`` and ``res.fc2`` are the two layers' ``GroupedLinearResiduals``.
``grouped_mlp_bwd`` is fc2's ``grouped_linear_bwd``, the activation's backward, then fc1's
``grouped_linear_bwd``. ``grouped_mlp`` joins the pair through the one bridge, ``custom_vjp``,
with the options as one nondiff argument (NOTE: [nondiff_argnums]).

With ``rows`` (an ``[R]`` index into x's T rows, or a :class:`TopkRows` dispatch) the experts'
input is ``x[rows]``: y is ``[R, H_out]``, dx ``[T, H]`` summed back as the rows' record decides
(``index_add``, or TopkRows' deterministic choice-order sum); the record keeps x and rows (``mlp_rows.py``).

Legend: ``T`` tokens, ``H`` x's features (fc1's in), ``F`` the ffn width (fc2's in), ``H_out``
fc2's out (usually H), ``E`` experts. w1 is E x ``[2F, H]`` for SwiGLU (gate rows, then up rows),
E x ``[F, H]`` for GELU/SiLU; w2 is E x ``[H_out, F]``; each a list or one stacked tensor.

What backward needs, and the policy (``save=``) that decides what forward keeps of it:

=========  =====================================  ===========================================
save       kept through save_for_backward         recomputed in backward
=========  =====================================  ===========================================
"default"  x (fc1's record), fc1_out, probs       h = act(fc1_out) * probs (fc2's wgrad input)
"h"        x, fc1_out, h (fc2's record), probs    nothing
"x_only"   x, probs                               fc1_out = fc1(x) (a GEMM), then h
=========  =====================================  ===========================================

Every policy gives the same numbers, bitwise (a recompute runs the very ops forward ran). A
backward that is itself differentiated (``create_graph``, grad of grad) recomputes fc1's output
and h under every policy (:func:`_steps.differentiated`).

With FP8 (``recipe=``) each linear quantizes as its layer does: fc1's record keeps x's FP8
copy, fc2's h's FP8 copy (``"h"``), or backward quantizes the recomputed h again by fc2's plan
(``"default"``: the same bits; delayed scaling with the scales forward used and no amax
recorded, so a state update or another forward before this backward changes nothing: NOTE:
[The state is bound per call]). ``"x_only"`` is refused with FP8 (fc1 keeps only x's FP8
copy, not x). The activation runs in high precision between FP8 GEMMs; with
RowwiseScaling on CUDA it runs inside h's quantization (fc2's plan's ``quantize_activated``:
NOTE: [The activation as the load] in ``kernels/triton_rowwise.py``), fc2 planned on a
stand-in with h's shape.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import torch

from . import _amp, _checks, _fp8, distributed_weight as dwp, mlp_rows
from ._steps import differentiated, refused_later
from ._bridge_planned import run_planned
from .custom_vjp import custom_vjp
from .grouped_linear import GroupedLinearResiduals, check_dy, forward, fprop, grouped_linear_bwd, one_buffer, prepare
from .grouped_linear import jvp as grouped_linear_jvp
from .grouped_linear import saved_x
from .grouped_plan import SplitsArg, WeightsArg, check_bias
from .kernels import Kernels, stacked
from .kernels.splits import row_expert
from .activations import Activation
from .activations import get as get_activation
from .mlp_checks import POLICIES, MLPOptions, check_call, in_layer, keep_x_args, options
from .kernels.activation import ActivationKernels, act_fwd, act_jvp, activation_kernels, glu_width
from .kernels.activation import probs_bias_fwd, select
from .plan import Options, route
from .residuals import any_needed, describe_value, nbytes, needed, residuals, saved, saved_activations

__all__ = ["GroupedMLPResiduals", "MLPGrads", "POLICIES", "grouped_mlp", "grouped_mlp_fwd", "grouped_mlp_bwd"]


class MLPGrads(NamedTuple):
    """What :func:`grouped_mlp_bwd` returns: one gradient per differentiable input (None where
    there is none: no probs, no bias, not wanted), each shaped like its argument (weights and
    biases as lists or stacked tensors, as given)."""

    dx: Any
    dw1: Any
    dw2: Any
    dprobs: Any
    dbias1: Any
    dbias2: Any


class _ProbsBias(NamedTuple):
    """fc2's bias when the probs weight it: added after fc2 (``y + probs * b2_e``), not by fc2."""

    bias: Any  # as given (by reference): E x [H_out] or one [E, H_out]
    form: str  # "list" or "stacked"


@residuals
class GroupedMLPResiduals:
    fc1: GroupedLinearResiduals = saved()  # fc1's own record: saves x (or with FP8 x's FP8 copy) for fc1's wgrad
    fc2: GroupedLinearResiduals = saved()  # fc2's own record: saves h (or h's FP8 copy) only under save="h";
    # otherwise its x_TK is None and backward recomputes h = act(fc1_out) * probs
    fc1_out: Any = saved()  # [T, 2F] (SwiGLU) or [T, F], the activation's input; None under "x_only" (recomputed)
    probs: Any = saved()  # [T] router weights, or None
    x: Any = saved()  # with rows and a bf16 fc1: x [T, H] as given (fc1's record holds no input: its x[rows] is
    # gathered again in backward, exact); else None (fc1's record holds x, or with FP8 x's FP8 copy)
    rows: Any = saved()  # IndexRows or TopkRows: fc1's input is x[rows.index()] (mlp_rows.py), or None
    activation: Activation  # the record forward ran ("swiglu", "gelu", "silu" or a registered one)
    save: str  # the policy: "default", "h" or "x_only"
    act: ActivationKernels  # the activation's kernels: the backend's fused ones, or the reference (each call
    # runs the reference where its operands are functorch wrappers: activation_kernels)
    probs_bias: _ProbsBias | None  # fc2's bias weighted by probs (added outside fc2), else None
    bias1: Any  # fc1's bias as given, by reference (a parameter): to run fc1's GEMM again (x_only, second order)
    bias1_version: tuple  # bias1's versions at forward: checked where fc1's GEMM runs again
    h_kept: bool  # fc2's forward kept h for its wgrad (False only with FP8 and w2 frozen): rebuild it if not saved
    num_tokens: int | None  # with rows: x's T (dx's rows); else None
    x_version: _checks.Stamp  # with rows, x's version at forward (the pure API checks it in backward); else None
    combine: bool  # with rows, y's rows were summed into x's tokens: dy is [T, H_out], fc2's dy[rows]
    rows_version: _checks.Stamp  # with rows, its index's (order's) version at forward, checked as x's is; else None
    needs: Any = needed()  # which gradients bwd computes, shaped like (x, w1, w2, splits, probs, bias1, bias2)


def _describe(self: GroupedMLPResiduals) -> str:
    """What is saved, what is recomputed, and what is held by reference."""
    lines = [f"GroupedMLPResiduals(activation={self.activation.name!r}, save={self.save!r}"]
    for name, rec in (("fc1", self.fc1), ("fc2", self.fc2)):
        inner = repr(rec).splitlines()
        if name == "fc2" and rec.x_TK is None and self.h_kept:
            inner = [line + "  (h: recomputed in backward)" if "] x_TK = " in line else line for line in inner]
        lines.append(f"  [saved] {name} = {inner[0]}")
        lines += [f"    {line}" for line in inner[1:]]
    if self.rows is not None:
        lines.append(f"  [saved] rows = {describe_value(self.rows)}: fc1's input is x[rows]")
        if self.x is not None:
            lines.append(f"  [saved] x = {describe_value(self.x)}: x[rows] gathered again in backward, for fc1's wgrad")
        if self.combine:
            lines.append("  combine: y's rows summed into x's tokens; fc2's dy is dy[rows] (read through the index)")
    width = "2F" if glu_width(self.activation) == 2 else "F"
    if self.fc1_out is not None:
        lines.append(f"  [saved] fc1_out = {describe_value(self.fc1_out)}")
    else:
        lines.append(f"  [recomputed] fc1_out: fc1(x) [T, {width}] again in backward (a GEMM)")
    if self.fc2.x_TK is not None:
        lines.append("  [saved] h: fc2.x_TK above")
    elif self.h_kept:
        fp8 = ", quantized again by fc2's FP8 plan" if self.fc2.fp8 is not None else ""
        lines.append(f"  [recomputed] h: act(fc1_out) * probs [T, F] in backward, for fc2's wgrad{fp8}")
    lines.append(f"  [saved] probs = {describe_value(self.probs)}")
    lines.append(f"  [ref  ] act = {self.act!r}")
    if self.probs_bias is not None:
        lines.append(f"  [ref  ] probs_bias = bias2 ({self.probs_bias.form}), added as probs * bias2 after fc2")
    lines.append(f")  # {nbytes(saved_activations(self))} B through save_for_backward")
    return "\n".join(lines)


GroupedMLPResiduals.__repr__ = _describe  # type: ignore[method-assign]


# --- forward --------------------------------------------------------------------------------------


def _run(x, w1, w2, splits, probs, bias1, bias2, rows, opts: MLPOptions, keep: bool):
    """Forward; with ``keep``, also the residual record (else None). ``rows``: fc1's input is
    ``x[rows]`` (mlp_rows.py)."""
    if rows is not None:  # (an index tensor wrapped: the record decides the gather and the sum)
        rows = mlp_rows.record(x, rows, splits)
    x_in = x if rows is None else mlp_rows.like(x, rows)  # (with rows, a stand-in until fc1 reads them)
    check_call(x_in, w1, w2, probs, opts.activation, opts.save, fp8=opts.fc1.fp8 is not None, rows=rows is not None)
    activation = get_activation(opts.activation)  # (the record: backward runs what forward ran)
    weighted = probs is not None and bias2 is not None  # fc2's bias times probs, added after fc2
    c1 = in_layer("fc1", prepare, x_in, w1, splits, bias1, opts.fc1, rows is not None)
    act = select(c1.plan.kernels, x, activation)  # (fused on CUDA; each step below routes on its own operands)
    fc1_out, r1 = mlp_rows.fc1(c1, x, rows, keep, _keep_x(opts.fc1))
    k = activation_kernels(act, fc1_out, probs)
    # fc2 is planned on a stand-in with h's shape, so that with FP8 its plan can quantize h
    # straight from fc1_out (NOTE: [The activation as the load]); else h is written and read
    c2 = in_layer("fc2", prepare, _h_like(fc1_out, activation), w2, splits, None if weighted else bias2, opts.fc2, True)
    keep2 = keep and _keep_x(opts.fc2)
    h = hq = None
    if c2.fp8 is not None:
        hq = c2.fp8.quantize_activated(
            c2.kernels, k, fc1_out, probs, activation, c2.split, rowwise=True, columnwise=keep2
        )
    if hq is None:
        # (fc2 reads it dense: a backend's own act_fwd may return any strides)
        h = k.act_fwd(fc1_out, probs, activation)
    if keep:
        y, r2 = forward(c2, h, keep_x=_keep_x(opts.fc2), xq=hq)
    else:
        y, r2 = fprop(c2, h, xq=hq), None
    pb = None
    if weighted:
        form = in_layer("fc2", check_bias, bias2, c2.plan.num_experts, c2.plan.out_features, y)
        pb = _ProbsBias(bias2, form)
        y = activation_kernels(act, y, probs).probs_bias_fwd(y, _bias_EH(pb), probs, c2.split)
    if opts.combine:  # each token's rows summed (moe.combine's sum, the record's sum_rows)
        y = rows.sum_rows(y, x.shape[0])
    return y, (_record(opts, activation, r1, r2, fc1_out, probs, act, pb, bias1, x, rows) if keep else None)


def _record(
    opts: MLPOptions, activation: Activation, r1, r2, fc1_out, probs, act, pb, bias1, x, rows
) -> GroupedMLPResiduals:
    """The MLP's residual record, nesting fc1's and fc2's (fc2's without h where the policy
    recomputes it; with rows, fc1's without its bf16 input x[rows]: x and rows are kept)."""
    h_kept = r2.x_TK is not None
    if opts.save != "h" and h_kept:  # h is recomputed in backward: fc2's record holds it not
        r2 = dataclasses.replace(r2, x_TK=None, x_version=None)
    x_kept = rows is not None and r1.fp8 is None  # (with FP8, fc1 keeps x[rows]'s FP8 copy, and no x)
    if x_kept:
        r1 = dataclasses.replace(r1, x_TK=None, x_version=None)
    return GroupedMLPResiduals(
        fc1=r1,
        fc2=r2,
        fc1_out=None if opts.save == "x_only" else fc1_out,
        probs=probs,
        activation=activation,
        save=opts.save,
        act=act,
        probs_bias=pb,
        bias1=bias1,
        bias1_version=() if bias1 is None else dwp.versions((bias1,) if isinstance(bias1, torch.Tensor) else bias1),
        h_kept=h_kept,
        x=x if x_kept else None,
        rows=rows,
        num_tokens=None if rows is None else x.shape[0],
        x_version=_checks.stamp(x) if x_kept else None,
        combine=opts.combine,
        rows_version=None if rows is None else _checks.stamp(mlp_rows.index_of(rows)),
    )


def _h_like(fc1_out: torch.Tensor, activation: Activation) -> torch.Tensor:
    """A view with h's shape, dtype and device (fc2's stand-in input; its values are not h's)."""
    return fc1_out[:, : fc1_out.shape[1] // 2] if glu_width(activation) == 2 else fc1_out


def _keep_x(o: Options) -> bool:
    """Whether a layer keeps its x for wgrad (with FP8, only where a weight may get a grad)."""
    return o.fp8 is None or o.fp8.keep_x


def _bias_EH(pb: _ProbsBias) -> torch.Tensor:
    return pb.bias if pb.form == "stacked" else stacked(pb.bias)


def grouped_mlp_fwd(
    x: torch.Tensor,
    w1: WeightsArg,
    w2: WeightsArg,
    splits: SplitsArg,
    *,
    probs: torch.Tensor | None = None,
    activation: str = "swiglu",
    bias1: Any = None,
    bias2: Any = None,
    save: str = "default",
    recipe: Any = None,
    fp8_state: Any = None,
    backend: str | Kernels | None = None,
    fuse_wgrad_accumulation: bool = False,
    use_grouped_tensor: bool | None = None,
    rows: Any = None,
    combine: bool = False,
) -> tuple[torch.Tensor, GroupedMLPResiduals]:
    """``y`` ``[T, H_out]`` (``[R, H_out]`` with rows, unless ``combine``) and the residual record
    (fc1's and fc2's records nested in it). Arguments as for :func:`grouped_mlp`."""
    mlp_rows.check_combine(combine, rows)
    args = (w1, w2, splits, bias1, bias2, activation, save, recipe, fp8_state, backend, fuse_wgrad_accumulation)
    opts, (w1, w2, splits, bias1, bias2) = options(*args, use_grouped_tensor, keep_x=(True, True))
    opts = opts._replace(combine=combine)
    with _amp.off(x):  # (in the dtypes given: NOTE: [Autocast] in _amp.py)
        return _run(x, w1, w2, splits, probs, bias1, bias2, rows, opts, keep=True)


# --- backward -------------------------------------------------------------------------------------


def _wanted(res: GroupedMLPResiduals) -> tuple:
    """(x, w1, w2, probs, bias1, bias2): what autograd asked for, each a bool or a list of them
    (all True for a direct call)."""
    if res.needs is None:
        return True, True, True, True, True, True
    x, w1, w2, _, p, b1, b2 = res.needs[:7]
    return x, w1, w2, p, b1, b2


def _fc1_record(res: GroupedMLPResiduals) -> GroupedLinearResiduals:
    """fc1's record as its backward reads it: with rows (bf16), with its input x[rows] gathered
    again from the saved x (exact: the same bits; a torch op, so a differentiated backward sees it)."""
    if res.x is None:
        return res.fc1
    _checks.check_stamp("x", res.x, res.x_version)
    return dataclasses.replace(res.fc1, x_TK=mlp_rows.gather(res.x, res.rows.index()))


def _recompute_fc1(res: GroupedMLPResiduals, r1: GroupedLinearResiduals) -> torch.Tensor:
    """fc1's output again (``save="x_only"``): fc1's GEMM on the saved x with forward's plan,
    kernels, path and split counts (fc1's record ``r1``, with x[rows] gathered again: :func:`_fc1_record`),
    so the same bits. Nothing is planned again; a DistributedWeight is gathered for forward again."""
    x_TK = saved_x(r1)
    full = dwp.materialize(r1.weights, r1.distributed, for_backward=False, like=x_TK, name="w1", amp=r1.plan.amp)
    dwp.check_materialized(full, r1.weight_shapes, "materialize_group_for_forward()", "w1")
    w_ENK = full[0] if r1.stacked else one_buffer(full, r1.plan)
    b1 = res.bias1
    if b1 is not None:  # (read again here: changed in place since forward, fc1_out would silently differ)
        dwp.check_versions((b1,) if isinstance(b1, torch.Tensor) else b1, res.bias1_version, "bias1")
    b_EN = None if b1 is None else (b1 if r1.plan.bias_form == "stacked" else stacked(b1))
    kernels, grouped = route(r1.kernels, r1.path == "grouped", x_TK, w_ENK)
    if r1.path == "grouped" and not grouped and kernels is r1.kernels and b_EN is not None:  # the reference's
        # grouped path rerouted under a transform: its bias add after the product, as forward ran it
        # (F.linear's fused add rounds once; TE's kernels reroute to the reference, other numerics anyway)
        return kernels.grouped_fprop(x_TK, w_ENK, None, r1.splits, False) + b_EN[row_expert(r1.splits)]
    return kernels.grouped_fprop(x_TK, w_ENK, b_EN, r1.splits, grouped)


def _fc1_inputs(res: GroupedMLPResiduals) -> tuple:
    """The saved inputs fc1's output and h are computed from: x (as given; with FP8 its copy,
    which carries no grad), fc1's weights and bias, probs."""
    b1 = res.bias1
    bias = () if b1 is None else (b1,) if isinstance(b1, torch.Tensor) else tuple(b1)
    return (res.fc1.x_TK if res.x is None else res.x, *res.fc1.weights, *bias, res.probs)


def _with_h(res: GroupedMLPResiduals, r2: GroupedLinearResiduals, fc1_out: torch.Tensor) -> GroupedLinearResiduals:
    """fc2's record with h recomputed where forward kept it. With FP8, its columnwise FP8 copy
    again by fc2's plan, with the scales forward used and no amax recorded (delayed scaling:
    NOTE: [The state is bound per call]): the same bits as forward's, whatever ran in between
    (from fc1_out where the plan fuses the activation: RowwiseScaling, which has no state)."""
    k = activation_kernels(res.act, fc1_out, res.probs)
    if r2.fp8 is not None and not r2.fp8.delayed:
        hq = r2.fp8.quantize_activated(
            r2.kernels, k, fc1_out, res.probs, res.activation, r2.splits, rowwise=False, columnwise=True
        )
        if hq is not None:
            return dataclasses.replace(r2, x_TK=hq)
    h = k.act_fwd(fc1_out, res.probs, res.activation)
    if r2.fp8 is None:
        return dataclasses.replace(r2, x_TK=h)
    return dataclasses.replace(r2, x_TK=r2.fp8.requantize_x(r2.kernels, h, r2.splits, r2.path == "grouped"))


def grouped_mlp_bwd(res: GroupedMLPResiduals, dy: torch.Tensor) -> MLPGrads:
    """(dx, dw1, dw2, dprobs, dbias1, dbias2) as an :class:`MLPGrads`: fc2's ``grouped_linear_bwd``
    on fc2's record, the activation's backward, fc1's ``grouped_linear_bwd`` on fc1's record; what
    the policy did not save is recomputed first. With autocast off, as every pure function (NOTE:
    [Autocast] in ``_amp.py``)."""
    _checks.record("grouped_mlp_bwd", res, GroupedMLPResiduals, "grouped_mlp_fwd")
    with _amp.off(dy), _fp8.dead_level(_fc1_inputs(res) if res.fc2.fp8 is not None else ()):
        return _backward(res, dy)


def _backward(res: GroupedMLPResiduals, dy: torch.Tensor) -> MLPGrads:
    want_x, want_w1, want_w2, want_p, want_b1, want_b2 = _wanted(res)
    if res.rows is not None:  # (backward gathers and sums by it again)
        _checks.check_stamp("rows", mlp_rows.index_of(res.rows), res.rows_version)
    r2, act = res.fc2, res.act
    # fc1's backward runs when it has a gradient to give, and always for a DistributedWeight (its
    # gathers and finalize match across ranks, as in grouped_linear); dh also feeds dprobs
    fc1_side = bool(want_x) or any_needed(want_w1) or any_needed(want_b1) or res.fc1.distributed
    need_dh = fc1_side or (res.probs is not None and bool(want_p))
    fp8 = res.fc1.fp8 is not None  # (FP8 refuses where bf16 recomputes: plain autograd below a transform not asked)
    second = differentiated(dy, _fc1_inputs(res), x_wanted=fp8 and bool(want_x), below=not fp8)
    if second and fp8:
        raise NotImplementedError(
            "grouped_mlp: " + _fp8.NOT_TWICE.format(how=" (create_graph=True, grad of grad, jacrev of jacrev)")
        )
    if fp8 or r2.fp8 is not None:  # FP8's own rule on the saved x (fc2's record may hold a recomputed h, unwrapped)
        _fp8.check_first_order("grouped_mlp", dy, (*res.fc1.weights, *r2.weights), _fc1_inputs(res)[0])
    recompute = res.fc1_out is None or second
    r1 = _fc1_record(res) if fc1_side or recompute else res.fc1  # (with rows: x[rows] gathered at most once)
    fc1_out = _recompute_fc1(res, r1) if recompute else res.fc1_out
    if (r2.x_TK is None and res.h_kept) or (second and r2.fp8 is None):
        r2 = _with_h(res, r2, fc1_out)
    pb = res.probs_bias
    needs2 = None if res.needs is None else (need_dh, want_w2, False, want_b2 if pb is None else None)
    r2 = dataclasses.replace(r2, needs=needs2)
    if res.combine:  # fc2's dy is dy[rows] (probs * bias2 reads its rows: then gathered, not quantized ahead)
        dy, dyq = mlp_rows.fc2_dy(res.rows, res.num_tokens, r2, dy, quantize=pb is None)
    else:
        dy, dyq = check_dy(r2, dy), None
    db2 = dprobs_b = None
    if pb is not None and (any_needed(want_b2) or need_dh):
        db_EH, dprobs_b = activation_kernels(act, dy, res.probs).probs_bias_bwd(dy, _bias_EH(pb), res.probs, r2.splits)
        db2 = db_EH if pb.form == "stacked" else list(db_EH.unbind(0))
    dh, dw2, db2_fc2 = grouped_linear_bwd(r2, dy, dyq)
    if pb is None:
        db2 = db2_fc2
    dfc1 = dprobs = None
    if dh is not None and need_dh:
        k = activation_kernels(act, fc1_out, res.probs, dh, dprobs_b)
        dfc1, dprobs = k.act_bwd(fc1_out, res.probs, dh, res.activation, dprobs_in=dprobs_b)
    dx = dw1 = db1 = None
    if fc1_side:
        needs1 = None if res.needs is None else (want_x, want_w1, False, want_b1)
        dx, dw1, db1 = grouped_linear_bwd(dataclasses.replace(r1, needs=needs1), dfc1)
        if dx is not None and res.rows is not None:  # the rows' grads summed into their tokens
            dx = res.rows.sum_rows(dx, res.num_tokens)
    return MLPGrads(dx, dw1, dw2, dprobs, db1, db2)


# --- the op ---------------------------------------------------------------------------------------


def _fwd(x, w1, w2, splits, probs, bias1, bias2, rows, opts: MLPOptions):
    return _run(x, w1, w2, splits, probs, bias1, bias2, rows, opts, keep=True)


def _primal(x, w1, w2, splits, probs, bias1, bias2, rows, opts: MLPOptions) -> torch.Tensor:
    """Forward alone, when no gradient can be taken: no residuals."""
    return _run(x, w1, w2, splits, probs, bias1, bias2, rows, opts, keep=False)[0]


def _bwd(res: GroupedMLPResiduals, dy: torch.Tensor) -> tuple:
    """Cotangents of (x, w1, w2, splits, probs, bias1, bias2, rows); the options are nondiff."""
    g = grouped_mlp_bwd(res, dy)
    if res.fc1.fp8 is None and res.fc2.fp8 is None:
        return g.dx, g.dw1, g.dw2, None, g.dprobs, g.dbias1, g.dbias2, None
    # (dbias2 sums the unquantized dy, as the layers' bias grads: differentiable as it is)
    grads = refused_later(
        "grouped_mlp",
        _fp8.NOT_TWICE,
        (g.dx, g.dw1, g.dw2, g.dprobs, g.dbias1),
        (dy, *_fc1_inputs(res), *res.fc2.weights),
    )
    dx, dw1, dw2, dprobs, dbias1 = grads
    return dx, dw1, dw2, None, dprobs, dbias1, g.dbias2, None


def _planned(x, w1, w2, splits, probs, bias1, bias2, rows, opts: MLPOptions) -> torch.Tensor | None:
    """y as one planned node (NOTE: [The plan's runner] in ``_bridge_planned.py``), or None where the
    call takes the bridge: FP8, DistributedWeights. Forward and backward are the pair's own."""
    if opts.fc1.fp8 is not None or not all(isinstance(w, (torch.Tensor, list)) for w in (w1, w2)):
        return None  # (weights of another kind: the bridge's checks name them)
    if dwp.any_distributed(w1) or dwp.any_distributed(w2):
        return None

    fwd = functools.partial(_fwd, opts=opts)
    static = ((3, splits),)
    if isinstance(rows, mlp_rows.TopkRows):  # no leaf: static (its order is kept by the record as any bridge keeps it)
        static, rows = ((3, splits), (7, rows)), None
    return run_planned("grouped_mlp", fwd, _bwd, (x, w1, w2, None, probs, bias1, bias2, rows), static)


def _jvp(res: GroupedMLPResiduals, tangents: tuple) -> torch.Tensor:
    """Forward mode: fc1's jvp rule, the activation's (``act_jvp``), fc2's, and the weighted
    bias's ``t_probs * b2_e + probs * t_b2_e``; what the policy did not save is recomputed."""
    _fp8.no_jvp(res.fc1.fp8, "grouped_mlp")
    tx, tw1, tw2, _, tp, tb1, tb2 = tangents[:7]
    r1 = _fc1_record(res)
    if tx is not None and res.rows is not None:  # (fc1's input is x[rows]: its tangent is tx[rows])
        tx = tx.index_select(0, res.rows.index())
    fc1_out = res.fc1_out if res.fc1_out is not None else _recompute_fc1(res, r1)
    r2, pb = res.fc2, res.probs_bias
    if r2.x_TK is None:
        r2 = dataclasses.replace(r2, x_TK=act_fwd(fc1_out, res.probs, res.activation))
    t_fc1 = None
    if tx is not None or _any_tangent(tw1) or _any_tangent(tb1):
        t_fc1 = grouped_linear_jvp(r1, (tx, tw1, None, tb1))
    t_h = act_jvp(fc1_out, res.probs, t_fc1, tp, res.activation)
    ty = grouped_linear_jvp(r2, (t_h, tw2, None, tb2 if pb is None else None))
    if pb is not None:
        zeros = torch.zeros_like(ty)
        if tp is not None:
            ty = ty + probs_bias_fwd(zeros, _bias_EH(pb), tp, r2.splits)
        if _any_tangent(tb2):
            tb = (
                tb2
                if pb.form == "stacked"
                else stacked([torch.zeros_like(b) if t is None else t for t, b in zip(tb2, pb.bias)])
            )
            ty = ty + probs_bias_fwd(zeros, tb, res.probs, r2.splits)
    return res.rows.sum_rows(ty, res.num_tokens) if res.combine else ty


def _any_tangent(t: Any) -> bool:
    return t is not None and not (isinstance(t, (list, tuple)) and all(u is None for u in t))


_grouped_mlp = custom_vjp(_fwd, _bwd, nondiff_argnums=(8,), primal=_primal, jvp=_jvp, name="grouped_mlp")
_grouped_mlp_eager = torch.compiler.disable(_grouped_mlp, reason=dwp.NO_COMPILE)


def grouped_mlp(
    x: torch.Tensor,
    w1: WeightsArg,
    w2: WeightsArg,
    splits: SplitsArg,
    *,
    probs: torch.Tensor | None = None,
    activation: str = "swiglu",
    bias1: Any = None,
    bias2: Any = None,
    save: str = "default",
    recipe: Any = None,
    fp8_state: Any = None,
    backend: str | Kernels | None = None,
    fuse_wgrad_accumulation: bool = False,
    use_grouped_tensor: bool | None = None,
    rows: Any = None,
    combine: bool = False,
) -> torch.Tensor:
    """Differentiable expert MLP: ``y = fc2(act(fc1(x)) * probs)`` per expert (Megatron's
    TEGroupedMLP), as one autograd node built from the two layers' pure pairs.

    Args:
        x: ``[T, H]`` tokens, sorted by expert.
        w1: fc1's weights, E ``[2F, H]`` for SwiGLU (the gate rows, then the up rows: Megatron's
            layout) or E ``[F, H]`` for GELU/SiLU; a list or one stacked ``[E, ., H]`` tensor
            (``w1[0]`` may be a DistributedWeight leader), as for ``grouped_linear``.
        w2: fc2's weights, E ``[H_out, F]`` (usually ``H_out = H``), a list or one stacked tensor.
        splits: E token counts summing to T: a list/tuple of ints or a 1-D integer tensor.
        probs: None or ``[T]`` router weights: ``h = act(fc1_out) * probs[:, None]`` and fc2's
            bias is added times probs (Megatron's weighted activation and ``_apply_bias``); any
            float dtype (their gradient comes in it), on x's device.
        activation: ``"swiglu"`` (``silu(gate) * up``), ``"gelu"`` (exact, Megatron's default
            ``F.gelu``), ``"silu"``, or a name registered with
            :func:`functional_dw.activations.register` (docs/mlp.md: "Adding an activation").
        bias1, bias2: None, E ``[out]`` tensors, or one ``[E, out]`` tensor each.
        save: the residual policy: ``"default"`` (x and fc1's output; h recomputed in backward),
            ``"h"`` (h too: no recompute), ``"x_only"`` (x: fc1's GEMM runs again in backward).
            The same numbers, bitwise, for each.
        recipe: an FP8 recipe (None: no FP8), for both linears; ``fp8_state``: delayed scaling's
            states as a pair (fc1's, fc2's), each ``fp8.init_state(recipe, num_gemms=E, ...)``.
        backend, fuse_wgrad_accumulation, use_grouped_tensor: as for ``grouped_linear``, for both
            linears (``main_grad`` of w1's and w2's weights with fused accumulation).
        rows: None, or an int64/int32 ``[R]`` index into x's T rows (an MoE's dispatch, sorted
            by expert): the experts' input is ``x[rows]``, ``splits`` count its R rows, probs
            is ``[R]``, y is ``[R, H_out]`` and dx ``[T, H]`` (the rows' grads summed into their
            tokens): bitwise ``grouped_mlp(x.index_select(0, rows), ...)`` through autograd
            (dx by ``index_add``: on CUDA its sum order is not fixed). Or a
            :class:`functional_dw.TopkRows` ``(order, top_k)``, a top-k dispatch: the rows are
            ``x[order // top_k]`` and dx is bit for bit ``moe.dispatch``'s backward (each
            token's rows summed in choice order: deterministic). The record keeps x and rows,
            not the gathered rows (``functional_dw/mlp_rows.py``; RowwiseScaling quantizes
            fc1's input through the index).
        combine: with ``rows``, sum each token's rows of y back into it (an MoE's combine): y is
            ``[T, H_out]``, bitwise ``moe.combine(grouped_mlp(..., rows=TopkRows(order, k)),
            order, k)`` (an index: ``index_add`` into zeros), and fc2's dy is ``dy[rows]``, which
            RowwiseScaling quantizes through the index (the gathered dy rows are never written).

    Under ``torch.autocast``, x, the weights and the biases run in the autocast dtype (probs as
    given), the grads come in their inputs' dtypes (NOTE: [Autocast] in ``_amp.py``).
    """
    fuse = _checks.fuse_flag(fuse_wgrad_accumulation)
    mlp_rows.check_combine(combine, rows)
    keep_x = keep_x_args(w1, w2, recipe, fp8_state)
    amp = _amp.dtype(x)
    first = None  # with rows gathered first, their record (y's rows are summed after the call)
    if rows is not None and (
        amp is not None or torch.compiler.is_compiling() or dwp.any_distributed(w1) or dwp.any_distributed(w2)
    ):  # NOTE: [Rows gathered first] in mlp_rows.py
        first, T = mlp_rows.record(x, rows, splits), x.shape[0]
        x, rows = first.gather(x), None
    args = (w1, w2, splits, bias1, bias2)
    opts, (w1, w2, splits, bias1, bias2) = options(
        *args, activation, save, recipe, fp8_state, backend, fuse, use_grouped_tensor, keep_x, amp
    )
    y = _call(x, w1, w2, splits, probs, bias1, bias2, rows, opts._replace(combine=combine and first is None), amp)
    return y if first is None or not combine else first.sum_rows(y, T)  # (differentiable: backward gathers dy)


def _call(x, w1, w2, splits, probs, bias1, bias2, rows, opts: MLPOptions, amp: torch.dtype | None) -> torch.Tensor:
    """y as one planned node where the call is planned (NOTE: [The plan's runner]), else through
    the bridge (eagerly, with DistributedWeights while compiling); under autocast in its dtype."""
    if amp is None and not torch.compiler.is_compiling():
        y = _planned(x, w1, w2, splits, probs, bias1, bias2, rows, opts)
        if y is not None:
            return y
    run = _grouped_mlp
    if torch.compiler.is_compiling() and (dwp.any_distributed(w1) or dwp.any_distributed(w2)):
        run = _grouped_mlp_eager
    if amp is None:
        return run(x, w1, w2, splits, probs, bias1, bias2, rows, opts)
    with _amp.off(x):  # NOTE: [Autocast] in _amp.py: x and the biases cast here (not probs), the weights where
        # materialized
        return run(_amp.cast(x, amp), w1, w2, splits, probs, _amp.cast(bias1, amp), _amp.cast(bias2, amp), None, opts)
