"""Triton launches without Triton's per-call Python (NOTE: [Compiled launches]).

``launch(kernel, grid, args, meta)`` does what ``kernel[grid](*args, **meta)`` does: the first
call with a given specialization goes through Triton's own ``JITFunction.run`` (which compiles,
caches and launches, and returns the compiled kernel); later calls launch that compiled kernel
directly. Without Triton's JIT (its CPU interpreter, profiling hooks installed, a Triton whose
compiled kernels launch differently) every call goes through Triton's path.
"""

from __future__ import annotations

from typing import Any

import torch

try:
    import triton
    from triton.runtime.jit import JITFunction
except ImportError:  # CPU-only torch builds ship no Triton
    triton = None
    JITFunction = None

__all__ = ["launch"]


# NOTE: [Compiled launches]
#   ``kernel[grid](...)`` runs ``JITFunction.run`` on every call: it binds the arguments, builds
#   a string key from their specialization and the options, looks the compiled kernel up, checks
#   the globals it read, makes launch metadata for profiling hooks and only then launches. On
#   the H200's host that is tens of microseconds per launch, several times the launch itself,
#   and RowwiseScaling issues a dozen such launches per step. Here the compiled kernel is kept
#   per *our* key, which is at least as fine as Triton's specialization (CUDA backend: each
#   tensor's dtype and 16-byte alignment; each int's ``== 1``, ``% 16 == 0`` and width; floats,
#   bools, None by type; every constexpr and option by value; the device), so a cached entry is
#   exactly the kernel Triton would have picked; it launches with the same arguments Triton's
#   ``run`` passes (every parameter in signature order, the stream of the current device). The
#   first launch of each key, and every launch where Triton's launch hooks are installed (a
#   profiler), goes through Triton's own path. A compiled kernel that refuses our launch (a
#   Triton whose launcher takes other arguments: a TypeError before anything runs) turns the
#   fast path off for good.
_COMPILED: dict[tuple, Any] = {}
_FAST: list[bool] = [True]


def _spec(a: Any) -> Any:
    """What Triton specializes one non-constexpr argument on (or finer)."""
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() % 16 == 0
    if isinstance(a, bool):
        return bool, a
    if isinstance(a, int):
        return int, a == 1, a % 16 == 0, -(2**31) <= a < 2**31, a < 2**63
    return type(a)


def _hooks_installed() -> bool:
    knobs = getattr(triton, "knobs", None)
    runtime = getattr(knobs, "runtime", None)
    if runtime is None:  # an older Triton: no knobs; its hooks live on CompiledKernel
        return True
    return _active(runtime.launch_enter_hook) or _active(runtime.launch_exit_hook)


def _active(hook: Any) -> bool:
    """Whether a launch hook would run: Triton >= 3.6 keeps its own ``HookChain`` (empty: none)
    where earlier ones kept None or the hook itself. Anything else that is not None, a chain's
    subclass or a user's object with a ``calls`` list included, is a hook (Triton's launcher
    calls whatever is not None)."""
    chain = getattr(getattr(triton, "knobs", None), "HookChain", None)
    if chain is not None and type(hook) is chain:
        return bool(hook.calls)
    return hook is not None


def launch(kernel: Any, grid: tuple, args: tuple, meta: dict) -> None:
    """``kernel[grid](*args, **meta)``, through the compiled kernel after the first call of each
    specialization (NOTE: [Compiled launches]). ``args``: the kernel's leading parameters, in
    order; ``meta``: its constexpr parameters and launch options, by name."""
    if not _FAST[0] or not isinstance(kernel, JITFunction) or _hooks_installed():
        kernel[grid](*args, **meta)
        return
    device = torch.cuda.current_device()
    key = (kernel, device, tuple(map(_spec, args)), tuple(meta.items()))
    entry = _COMPILED.get(key)
    if entry is None:
        compiled = kernel[grid](*args, **meta)
        names = kernel.arg_names[len(args) :]  # the constexpr parameters, after the positional ones
        if compiled is not None and all(n in meta for n in names):
            _COMPILED[key] = (compiled, tuple(meta[n] for n in names))
        return
    compiled, constexprs = entry
    g = (*grid, 1, 1)
    run = compiled.run
    try:
        run(
            g[0],
            g[1],
            g[2],
            torch._C._cuda_getCurrentRawStream(device),
            compiled.function,
            compiled.packed_metadata,
            None,  # launch metadata: only launch hooks read it, and none is installed
            None,
            None,
            *args,
            *constexprs,
        )
    except (TypeError, AttributeError):  # a launcher that takes other arguments: Triton's path from now on
        _FAST[0] = False
        _COMPILED.clear()
        kernel[grid](*args, **meta)
