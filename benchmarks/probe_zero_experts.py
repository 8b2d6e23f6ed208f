"""Does TE's grouped-tensor wgrad GEMM write zeros for an expert with no tokens?
(If it does, functional_dw need not zero the fresh [E, N, K] wgrad buffer.)"""

import torch
import transformer_engine.pytorch  # noqa: F401
from transformer_engine.pytorch.cpp_extensions.gemm import general_grouped_gemm_for_grouped_tensor
import functional_dw as fd
from functional_dw.kernels import te as fte, te_shared

E, K, N, splits = 4, 256, 128, [64, 0, 32, 0]
x = torch.randn(sum(splits), K, device="cuda", dtype=torch.bfloat16)
dy = torch.randn(sum(splits), N, device="cuda", dtype=torch.bfloat16)
sp = fd.kernels.Splits(
    host=None, tensor=torch.tensor(splits, device="cuda"), device=x.device, num_tokens=x.shape[0], num_experts=E
)
fte.TE.prepare(x.device, E, grouped=True)
sizes_E, _, offs_K, offs_N = te_shared.offsets(sp, K, N)
for layout_name, dw in (
    ("list", [torch.full((N, K), float("nan"), device="cuda", dtype=torch.bfloat16) for _ in range(E)]),
    ("uniform", torch.full((E, N, K), float("nan"), device="cuda", dtype=torch.bfloat16)),
):
    D = dw if isinstance(dw, list) else te_shared.uniform(dw, E, (N, K))
    general_grouped_gemm_for_grouped_tensor(
        te_shared.token_rows(x, sizes_E, offs_K),
        te_shared.token_rows(dy, sizes_E, offs_N),
        D,
        layout="NT",
        use_split_accumulator=True,
    )
    torch.cuda.synchronize()
    outs = dw if isinstance(dw, list) else list(dw)
    print(layout_name, ["nan" if o.isnan().any() else ("zeros" if not o.any() else "values") for o in outs])
