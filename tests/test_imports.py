"""What importing does, checked in fresh interpreters: ``functional_dw.fp8`` stands on its own
(it imports nothing from ``functional_dw.kernels``; the kernels hand it TE's fused update), and
importing ``functional_dw`` leaves torch's global state alone (no optimizer hook until a
RowwiseScaling weight cache is first used)."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FP8 = ROOT / "functional_dw" / "fp8"


def _run(code: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), str(ROOT)], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_fp8_loads_and_runs_without_the_kernels():
    # functional_dw's own __init__ imports the layers (and with them the kernels), so the fp8
    # package is loaded under a bare parent package: only fp8's own imports run.
    _run("""
    import sys, types, pathlib
    root = pathlib.Path(sys.argv[1])
    parent = types.ModuleType("functional_dw")
    parent.__path__ = [str(root / "functional_dw")]
    sys.modules["functional_dw"] = parent
    import torch
    import functional_dw.fp8 as fp8
    import functional_dw.fp8.rowwise  # noqa: F401  (not imported by fp8/__init__)

    recipe = fp8.DelayedScaling(amax_history_len=4)
    state = fp8.init_state(recipe, num_gemms=2)
    spec = fp8.tensor_spec(recipe, "input")
    q = fp8.quantize(torch.randn(8, 16), spec, scale=fp8.scale_for(state, "input", 0), rowwise=True, columnwise=True)
    fp8.record_amax_(state, "input", q.amax, gemm=0)
    fp8.update_state_(state, recipe)  # no fused kernel registered: the torch path
    fp8.update_state_(state, recipe, fused=True)
    assert not fp8.state._FUSED_KERNEL
    loaded = sorted(m for m in sys.modules if m.startswith("functional_dw."))
    assert loaded and all(m.startswith("functional_dw.fp8") for m in loaded), loaded
    assert not [m for m in sys.modules if m == "functional_dw.kernels" or m.startswith("functional_dw.kernels.")]
    """)


def test_no_fp8_module_imports_the_kernels():
    for path in sorted(FP8.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                names = [f"{'.' * node.level}{node.module or ''}"] + [
                    f"{node.module or ''}.{a.name}" for a in node.names
                ]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            assert not any("kernels" in n for n in names), f"{path.name}:{node.lineno} imports {names}"


def test_the_kernels_give_fp8_te_s_fused_update():
    from functional_dw.fp8 import state as S
    from functional_dw.kernels import te_update_delayed

    assert S._FUSED_KERNEL == [te_update_delayed]


def test_the_package_imports_and_runs_without_triton():
    # CPU-only torch ships no Triton (CI has none): every Triton module must import without it
    # and the MLP must run on the reference activation.
    out = _run("""
    import sys
    sys.modules["triton"] = None  # import triton -> ImportError
    sys.path.insert(0, sys.argv[1])
    import torch, functional_dw as fd
    from functional_dw.kernels import activation, triton_activation, triton_math, triton_rowwise  # noqa: F401
    x, w1, w2 = torch.randn(6, 8), torch.randn(2, 8, 8), torch.randn(2, 8, 4)
    y, res = fd.grouped_mlp_fwd(x, w1, w2, [2, 4], probs=torch.rand(6))
    print(y.shape[0], "TorchActivation()" in repr(res), triton_activation.available(x))
    """)
    assert out.split() == ["6", "True", "False"], out


def test_importing_functional_dw_registers_no_optimizer_hook():
    _run("""
    from torch.optim import optimizer
    before = dict(optimizer._global_optimizer_post_hooks)
    import functional_dw, functional_dw.fp8.rowwise, functional_dw.nn, functional_dw.distributed  # noqa: F401
    assert dict(optimizer._global_optimizer_post_hooks) == before, optimizer._global_optimizer_post_hooks
    """)


def test_the_weight_cache_installs_the_optimizer_hook_once_and_it_can_be_removed():
    _run("""
    import torch
    from torch.optim import optimizer
    import functional_dw as fd
    from functional_dw import fp8
    from functional_dw.fp8 import rowwise as rw

    hooks = optimizer._global_optimizer_post_hooks
    before = dict(hooks)
    torch.manual_seed(0)
    m = fd.nn.GroupedLinear(2, 16, 16, recipe=fp8.RowwiseScaling())
    x, sizes = torch.randn(6, 16), [2, 4]
    assert dict(hooks) == before and not rw.WEIGHT_CACHE
    m(x, sizes)  # the first cached use installs the hook
    assert len(hooks) == len(before) + 1 and len(rw.WEIGHT_CACHE) == 1
    m(x, sizes).sum().backward()
    assert len(hooks) == len(before) + 1  # once
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    steps = rw.OPTIMIZER_STEPS[0]
    opt.step()
    assert rw.OPTIMIZER_STEPS[0] == steps + 1
    fp8.remove_optimizer_hook()
    assert dict(hooks) == before and not rw.WEIGHT_CACHE
    opt.step()
    assert rw.OPTIMIZER_STEPS[0] == steps + 1  # not counted: nothing is cached to go stale
    fp8.remove_optimizer_hook()  # (again: nothing to remove)
    m(x, sizes)
    assert len(hooks) == len(before) + 1  # the next cached use installs it again
    """)
