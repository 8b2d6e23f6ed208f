"""CUDA graphs for steps built from functional_dw layers (docs/cuda-graphs.md).

Three small tools on top of torch's CUDA graphs:

* :func:`graph_step` captures a whole step (forward + backward, e.g. an expert MLP) once and
  returns a :class:`GraphedStep` that replays it: the warm-up on a side stream, a check that
  the step never synchronizes with the host (which capture forbids), what happens to ``.grad``
  and ``main_grad``, and errors that say what to change.
* :class:`PinnedOffload`, an offloading saved-tensor hook that can be captured (unlike
  ``torch.autograd.graph.save_on_cpu``: see its docstring).
* :func:`make_graphed_callables`, torch's function of that name (a graph pair per module,
  eager autograd around it) plus two fixes: ``.grad`` never aliases the graph's static grad
  buffers (with torch's, a second backward before the grads are zeroed adds the new gradient
  to itself: ``2 * g2`` instead of ``g1 + g2``), and ``main_grad`` is left as it was before the
  warm-up (whose backwards add uninitialized output grads into it).

What a graph replays is the device work of the capture, nothing else. For functional_dw:

* The routing must live on the device: pass ``splits`` as a CUDA int tensor (a static buffer
  you copy each step's counts into). The grouped path (``backend="auto"`` or ``"te"``, bf16)
  reads it at every replay, without a sync. The split path needs host sizes: a list is baked
  into the graph (every replay reuses the capture's routing); a CUDA tensor there is a sync and
  cannot be captured (functional_dw raises a clear error).
* Python runs at capture only: a DistributedWeight's ``materialize_group_for_forward/backward``
  and ``finalize_group_grads`` are called once, during capture. The device work they enqueue
  (a copy, an NCCL all-gather or reduce-scatter) is replayed; their Python side effects
  (counters, flags such as ``grad_added_to_main_grad``, host-side bookkeeping) are not.
* Every tensor a graph reads or writes is an address fixed at capture: inputs, weights,
  ``main_grad`` and the grads must be updated in place, never rebound.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

__all__ = ["graph_step", "GraphedStep", "make_graphed_callables", "PinnedOffload"]

_GRADS = ("overwrite", "accumulate")

_SYNC_HINT = (
    "graph_step: the step synchronized with the host during warm-up, and a CUDA graph cannot capture a "
    "synchronization. Usual causes with functional_dw: a CUDA splits tensor on the split path "
    "(use_grouped_tensor=False, a dtype or backend without the grouped path, or fuse_wgrad_accumulation=True "
    "on the torch backend): use the grouped path (backend='auto' or 'te', bf16); a saved-tensor hook that copies "
    "with .cpu()/.to('cpu') (save_on_cpu without pin_memory): use functional_dw.graphs.PinnedOffload; .item(), "
    ".tolist(), print(tensor) or torch.cuda.synchronize() in the step. (check_sync=False skips this check.)"
)
_CAPTURE_HINT = (
    "graph_step: CUDA graph capture failed. Everything the step does must be device work on the current "
    "stream without a host sync or a host allocation: splits as a CUDA tensor on the grouped path (not a list: "
    "its copy to the GPU cannot be captured), no save_on_cpu (use PinnedOffload), no .item()/.tolist(), "
    "collectives only on backends that support capture (NCCL, not gloo)."
)
_ALIVE_HINT = (
    "This cause usually means an autograd graph built on the default stream is still alive: an output or loss "
    "of an earlier eager step that you kept (it holds its grad_fn, whose gradient accumulators for the leaves "
    "run on the stream they were created on, which capture cannot wait on). Keep only .detach()ed results of "
    "eager steps, or del them and run gc.collect() (a failed capture's traceback holds the step's graph in a "
    "reference cycle) before graph_step."
)


def _check_tensors(what: str, ts: Sequence[Any], cuda: bool) -> None:
    for i, t in enumerate(ts):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"graph_step: {what}[{i}] must be a torch.Tensor, got {type(t).__name__}")
        if cuda and not t.is_cuda:
            raise ValueError(
                f"graph_step: {what}[{i}] is on {t.device}; a CUDA graph reads and writes CUDA memory only "
                "(move it to the GPU; for splits, a CUDA int tensor)"
            )


@contextlib.contextmanager
def _sync_is_error(on: bool):
    """Within: any host synchronization torch can see raises (``set_sync_debug_mode``)."""
    if not on:
        yield
        return
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(prev)


class GraphedStep:
    """A captured step. ``step(*new_inputs)`` copies each given tensor into its static input
    (``None`` keeps it) and replays; it returns :attr:`outputs`, the tensors the step returned
    at capture, rewritten by every replay (read or clone them before the next one).

    :attr:`inputs` are the static inputs (copy into them yourself and call :meth:`replay`,
    if you prefer); :attr:`graph` the ``torch.cuda.CUDAGraph``; :attr:`grads` the pairs
    (parameter or input, the ``.grad`` tensor the graph writes); :attr:`mode` the ``grads``
    argument of :func:`graph_step`.
    """

    def __init__(self, graph: torch.cuda.CUDAGraph, inputs: tuple, outputs: Any, grads: list, mode: str):
        self.graph, self.inputs, self.outputs, self.mode = graph, inputs, outputs, mode
        self.grads: list[tuple[torch.Tensor, torch.Tensor]] = grads

    def __call__(self, *new_inputs: torch.Tensor | None) -> Any:
        if new_inputs:
            if len(new_inputs) != len(self.inputs):
                raise TypeError(f"GraphedStep takes {len(self.inputs)} inputs (as captured), got {len(new_inputs)}")
            for i, (static, new) in enumerate(zip(self.inputs, new_inputs)):
                if new is None or new is static:
                    continue
                if not isinstance(new, torch.Tensor) or new.shape != static.shape or new.dtype != static.dtype:
                    got = f"{new.dtype}{tuple(new.shape)}" if isinstance(new, torch.Tensor) else type(new).__name__
                    raise ValueError(
                        f"GraphedStep: inputs[{i}] must be {static.dtype}{tuple(static.shape)} as "
                        f"captured (a graph has fixed shapes), got {got}"
                    )
                with torch.no_grad():
                    static.copy_(new)
        self.replay()
        return self.outputs

    def replay(self) -> None:
        """Replay the graph (after checking that no captured ``.grad`` was rebound)."""
        for p, g in self.grads:
            if p.grad is not g:
                raise RuntimeError(
                    "GraphedStep: a parameter's .grad was replaced or set to None since capture (e.g. by "
                    "optimizer.zero_grad(), which sets grads to None by default), so the graph would write "
                    "gradients nobody reads. Zero grads in place instead: step.zero_grad() or "
                    "optimizer.zero_grad(set_to_none=False)"
                )
        self.graph.replay()

    def zero_grad(self) -> None:
        """Zero the captured ``.grad`` tensors in place (for ``grads="accumulate"``)."""
        with torch.no_grad():
            for _, g in self.grads:
                g.zero_()


def graph_step(
    step: Callable[..., Any],
    *inputs: torch.Tensor,
    params: Sequence[torch.Tensor] = (),
    grads: str = "overwrite",
    warmup: int = 3,
    pool: Any = None,
    check_sync: bool = True,
) -> GraphedStep:
    """Capture ``step(*inputs)`` (forward and backward) in a CUDA graph; return the replayable
    :class:`GraphedStep`.

    Args:
        step: runs one step on ``inputs`` and returns what you want to read after a replay
            (e.g. the loss, or ``torch.autograd.grad(...)``'s grads). It may call
            ``.backward()``; it runs ``warmup`` times eagerly, then once under capture.
        inputs: the static inputs: CUDA tensors the step reads (activations, cotangents, the
            splits as a CUDA int tensor). Their shapes are fixed; their values may change between
            replays (copy into them, or pass new values to the :class:`GraphedStep`).
        params: the tensors whose ``.grad`` the step's backward fills (usually the model's
            parameters); inputs that require grad count too. ``grads`` says what a replay does
            to them:

            * ``"overwrite"`` (torch's whole-network recipe): grads are set to None before
              capture; each ``.grad`` becomes a tensor of the graph's memory pool that every
              replay overwrites with that replay's gradient. Zero nothing between steps.
            * ``"accumulate"``: each ``.grad`` is kept (zeros where it was None) and every
              replay adds into it, as eager backwards do; zero it in place between steps
              (:meth:`GraphedStep.zero_grad`).

            Either way the graph writes into the tensors it captured: never set them to None or
            rebind them afterwards (a replay checks). Weight grads accumulated into ``main_grad``
            (``fuse_wgrad_accumulation=True``) are always added by every replay; zero
            ``main_grad`` in place between steps. ``main_grad`` is left as it was before the
            warm-up (whose backwards would otherwise have added into it).
        warmup: eager runs before capture, on a side stream (torch's recipe): they build TE's
            and Triton's cached workspaces and compiled kernels, which must exist before capture.
            At least 1.
        pool: a graph memory pool to share (``torch.cuda.graph_pool_handle()`` or another
            graph's ``graph.pool()``), for graphs that replay in the order they were captured.
        check_sync: run the warm-ups after the first with ``torch.cuda.set_sync_debug_mode("error")``,
            so a host synchronization fails there with a traceback to its line (capture would
            fail with CUDA's "operation not permitted when stream is capturing").
    """
    params, warmup = _checked_args(step, inputs, params, grads, warmup, check_sync)
    leaves = _grad_leaves(params, inputs)
    saved, kept = _main_grads(leaves), [p.grad for p in leaves]
    _warm_up(step, inputs, leaves, warmup, check_sync)
    _restore(saved)  # the warm-ups' backwards added into main_grad: undo
    _grads_for_capture(leaves, kept, grads)
    torch.cuda.synchronize()
    graph, outputs = _capture(step, inputs, pool)
    captured = [(p, p.grad) for p in leaves if p.grad is not None]
    return GraphedStep(graph, tuple(inputs), outputs, captured, grads)


def _checked_args(
    step: Any, inputs: Sequence[Any], params: Any, grads: Any, warmup: Any, check_sync: Any
) -> tuple[list[torch.Tensor], int]:
    """graph_step's arguments checked, in order (each error says what to pass), and the machine
    (a CUDA device, not capturing already); returns the params as a list and the warm-up count."""
    if not callable(step):
        raise TypeError(f"graph_step: step must be callable, got {type(step).__name__}")
    _check_tensors("inputs", inputs, cuda=False)
    params = _params_list(params)
    if grads not in _GRADS:
        raise ValueError(f"graph_step: grads must be one of {_GRADS}, got {grads!r}")
    try:
        n = operator.index(warmup) if not isinstance(warmup, bool) else 0
    except TypeError:
        n = 0
    if n < 1:
        raise ValueError(f"graph_step: warmup must be an int >= 1 (eager runs before capture), got {warmup!r}")
    if not isinstance(check_sync, bool):
        raise TypeError(f"graph_step: check_sync must be True or False, got {check_sync!r}")
    if not torch.cuda.is_available():
        raise RuntimeError("graph_step: CUDA graphs need a CUDA device; none is available")
    _check_tensors("inputs", inputs, cuda=True)
    _check_tensors("params", params, cuda=True)
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("graph_step: called while a CUDA graph is being captured")
    return params, n


def _grad_leaves(params: list[torch.Tensor], inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors whose ``.grad`` the step fills: ``params``, then the leaf inputs that require
    grad and are not among them."""
    return list(params) + [t for t in inputs if t.requires_grad and t.is_leaf and not any(t is p for p in params)]


def _warm_up(
    step: Callable[..., Any], inputs: Sequence[torch.Tensor], leaves: list[torch.Tensor], warmup: int, check_sync: bool
) -> None:
    """Run the step ``warmup`` times eagerly on a side stream (torch's recipe), each from no
    grads; after the first, a host synchronization raises :data:`_SYNC_HINT`."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(side):
            for i in range(warmup):
                for p in leaves:
                    p.grad = None
                try:
                    with _sync_is_error(check_sync and i > 0):  # the first run may sync: autotuning, first use
                        step(*inputs)
                except RuntimeError as e:
                    if "synchronizing" in str(e):
                        raise RuntimeError(f"{_SYNC_HINT}\n(torch: {e})") from e
                    raise
    finally:
        torch.cuda.current_stream().wait_stream(side)


def _grads_for_capture(leaves: list[torch.Tensor], kept: list[torch.Tensor | None], grads: str) -> None:
    """Each ``.grad`` as the capture must see it: the one from before the warm-up (zeros where
    there was none) for ``"accumulate"``, None for ``"overwrite"``."""
    for p, g in zip(leaves, kept):
        if grads == "accumulate":
            p.grad = g if g is not None else torch.zeros_like(p)
        else:
            p.grad = None


def _capture(step: Callable[..., Any], inputs: Sequence[torch.Tensor], pool: Any) -> tuple[torch.cuda.CUDAGraph, Any]:
    """Capture one run of the step: the graph and the step's outputs (the tensors every replay
    rewrites); a capture error raises :data:`_CAPTURE_HINT` with its cause."""
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, pool=pool):
            outputs = step(*inputs)
    except RuntimeError as e:
        _unstick_rng()
        msg, cause = str(e), e.__cause__ or e.__context__  # capture_end's error hides the step's
        if cause is not None and "legacy stream" in str(cause):
            msg = f"{cause}\n{msg}"
        if "legacy stream" in msg:
            raise RuntimeError(f"{_CAPTURE_HINT}\n{_ALIVE_HINT}\n(cause: {msg})") from e
        if "captur" in msg.lower() or "not permitted" in msg:
            raise RuntimeError(f"{_CAPTURE_HINT}\n(cause: {msg})") from e
        raise
    return graph, outputs


# NOTE: [A failed capture's RNG] When CUDA itself fails a capture (cudaStreamEndCapture returns
# an error), torch's CUDAGraph.capture_end raises before it ends the capture of the default CUDA
# generator (torch 2.11: the generator's state keeps ``capturing_``). From then on every random op
# outside a capture raises "Offset increment outside graph capture encountered unexpectedly": one
# failed graph_step poisoned torch.randn, nn.init and dropout for the rest of the process. After a
# failed capture we probe the current device's default generator and, if it is stuck, give it a
# fresh copy of its state (same seed and offset, not capturing): eager work goes on (verified on
# the H200). What it does not repair (from torch's source, not run): graphs captured before the
# failure hold the old, still-stuck state object, so their replays may raise the same error
# (recapture them); capture_end's raise also skips restoring the current stream (the thread stays
# on the capture's side stream) and ending the allocator's capture-pool mode. Treat a process that
# hit a failed capture as degraded: fix the cause and restart it. Not safe while another thread
# captures with the same generator.
def _unstick_rng() -> None:
    """Repair the current device's default CUDA generator after a failed capture (NOTE: [A failed
    capture's RNG]); a no-op when it works."""
    gen = torch.cuda.default_generators[torch.cuda.current_device()]
    try:
        torch.empty(1, device="cuda").uniform_(generator=gen)
    except RuntimeError as e:
        if "outside graph capture" not in str(e):
            return  # another failure: the capture's own error is the one to report
        gen.graphsafe_set_state(gen.clone_state())


def _params_list(params: Any) -> list[torch.Tensor]:
    """``params`` as a list of tensors, or an error that says what to pass."""
    if isinstance(params, torch.Tensor):
        return [params]
    if isinstance(params, torch.nn.Module) or not isinstance(params, Iterable) or isinstance(params, (str, bytes)):
        raise TypeError(
            f"graph_step: params must be a sequence of tensors (e.g. model.parameters()), got {type(params).__name__}"
        )
    params = list(params)
    for i, p in enumerate(params):
        if isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str):
            raise TypeError(
                f"graph_step: params[{i}] is a (name, tensor) pair: pass model.parameters(), "
                "not model.named_parameters()"
            )
    _check_tensors("params", params, cuda=False)
    return params


def _main_grads(params: Sequence[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(main_grad, a copy of its values) for each parameter that has one."""
    mgs = [getattr(p, "main_grad", None) for p in params]
    return [(mg, mg.clone()) for mg in mgs if isinstance(mg, torch.Tensor)]


def _restore(saved: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    with torch.no_grad():
        for mg, before in saved:
            mg.copy_(before)


# NOTE: [Graphed grads alias] torch's graphed backward returns ``static.detach()``;
# AccumulateGrad steals such a grad into ``.grad`` (a view of the graph's buffer), and the next
# replay overwrites it before adding the next grad to it. With ``.grad`` already there, the
# add reads the grad at once: no copy is needed.
def _own_grads(params: Sequence[torch.Tensor]) -> list:
    """A hook per parameter that hands AccumulateGrad a copy of the incoming grad when ``.grad``
    is None (NOTE: [Graphed grads alias])."""

    def own(p: torch.Tensor) -> Callable:
        return lambda g: g.clone() if g is not None and p.grad is None else None  # fused: no grad

    return [p.register_hook(own(p)) for p in params if p.requires_grad]


def make_graphed_callables(
    callables: Any, sample_args: tuple, num_warmup_iters: int = 3, allow_unused_input: bool = False, pool: Any = None
) -> Any:
    """``torch.cuda.make_graphed_callables`` (same arguments, same result: each module's
    forward and backward replay a graph of their own; autograd, the optimizer and everything
    else stay eager), with two fixes for the modules' parameters:

    * ``.grad`` accumulates across calls as in eager: a hook copies the graph's grad when
      ``.grad`` is None (once per parameter per zeroing; see NOTE: [Graphed grads alias]);
    * each ``main_grad`` (``fuse_wgrad_accumulation=True``) is restored after torch's warm-up,
      whose backwards add uninitialized output grads into it. Every backward replay then adds
      its wgrad, as eager does.

    ``sample_args``: tensors only, e.g. ``(x, splits)`` with the splits as a CUDA int tensor
    (static: each call copies its arguments into the captured ones). The grads of leaf tensors
    passed as arguments are views of the graph's buffers, valid until the next call."""
    if not torch.cuda.is_available():
        raise RuntimeError("make_graphed_callables: CUDA graphs need a CUDA device; none is available")
    mods = callables if isinstance(callables, tuple) else (callables,)
    params = list({id(p): p for m in mods if isinstance(m, torch.nn.Module) for p in m.parameters()}.values())
    saved = _main_grads(params)
    out = torch.cuda.make_graphed_callables(
        callables, sample_args, num_warmup_iters=num_warmup_iters, allow_unused_input=allow_unused_input, pool=pool
    )
    _restore(saved)
    _own_grads(params)
    return out


class PinnedOffload:
    """Saved-tensor hooks that keep each saved CUDA activation in pinned host memory between
    forward and backward, and that a CUDA graph can capture.

    Use one instance per forward in flight::

        off = PinnedOffload()
        def step(x, splits, dy):
            with off:
                y = mlp(x, splits)
            y.backward(dy)

    Pack copies the tensor into a pinned host buffer with an asynchronous copy on the current
    stream and drops the device tensor; unpack copies it back the same way. No host sync, and
    after the first step no host allocation: the buffers (one per saved tensor, in pack order)
    are made on first use and reused by every later forward under this instance, so a graph's
    replays copy into the buffers its capture saw (keep the instance alive as long as the
    graph). ``torch.autograd.graph.save_on_cpu`` is not graph-safe: without ``pin_memory`` it
    synchronizes; with it, it allocates a pinned buffer per saved tensor per step and frees it
    after backward, so a captured graph would copy into host memory the allocator has since
    handed out again (or the capture fails).

    Make the buffers before capture (an eager warm-up step, as :func:`graph_step` runs):
    a new saved tensor during capture raises. Two forwards under one instance before their
    backwards (pipeline schedules) would share buffers: give each its own instance.
    Tensors below ``min_bytes``, and tensors not on CUDA, are kept as they are.
    """

    def __init__(self, min_bytes: int = 0):
        if isinstance(min_bytes, bool) or not isinstance(min_bytes, int) or min_bytes < 0:
            raise ValueError(f"PinnedOffload: min_bytes must be an int >= 0, got {min_bytes!r}")
        self.min_bytes = min_bytes
        self.buffers: list[torch.Tensor] = []
        self._next = 0
        self._hooks: Any = None

    def __enter__(self) -> "PinnedOffload":
        self._next = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)

    def pack(self, t: torch.Tensor) -> Any:
        if not t.is_cuda or t.numel() * t.element_size() < self.min_bytes:
            return t
        i = self._next
        self._next += 1
        buf = self.buffers[i] if i < len(self.buffers) else None
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    f"PinnedOffload: saved tensor #{i} ({t.dtype}{tuple(t.shape)}) has no pinned buffer yet, and "
                    "host memory cannot be allocated for a graph during capture: run the step once eagerly "
                    "under this PinnedOffload first (graph_step's warm-up does)"
                )
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            if i < len(self.buffers):
                self.buffers[i] = buf
            else:
                self.buffers.append(buf)
        buf.copy_(t, non_blocking=True)
        return (t.device, buf)

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        device, buf = packed
        return buf.to(device, non_blocking=True)
