"""The demo: a small MoE expert MLP (grouped_linear, GELU, grouped_linear) forward and backward
under a saved-tensor hook that moves what it packs to host memory, with a DistributedWeight
group, backward twice with ``retain_graph``; checked against plain PyTorch.

``--ranks N`` runs it on N local processes (gloo on CPU; NCCL with ``--device cuda``), the
weights sharded across them as ShardedWeight groups, each rank with its own tokens."""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from .grouped_linear import grouped_linear

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


class LocalGroupWeight(torch.nn.Parameter):
    """A single-process DistributedWeight (world size 1): the shard is the whole weight, so
    materialize returns the group's tensors and finalize returns their grads. It counts calls,
    which is all a one-process demo can show of the protocol."""

    is_distributed_weight = True

    def __new__(cls, data: torch.Tensor):
        self = super().__new__(cls, data, True)
        self.group = [self]
        self.calls = {"materialize_fwd": 0, "materialize_bwd": 0, "finalize": 0}
        return self

    @classmethod
    def group_of(cls, tensors: list[torch.Tensor]) -> list["LocalGroupWeight"]:
        group = [cls(t) for t in tensors]
        for w in group:
            w.group = group
        return group

    def materialize_group_for_forward(self):
        self.calls["materialize_fwd"] += 1
        return [w.detach() for w in self.group]

    def materialize_group_for_backward(self, **kwargs):
        self.calls["materialize_bwd"] += 1
        return [w.detach() for w in self.group]

    def finalize_group_grads(self, wgrads):
        self.calls["finalize"] += 1
        return wgrads if isinstance(wgrads, list) else [wgrads]

    def grad_buffer(self):
        raise NotImplementedError("the demo does not fuse wgrad accumulation")


class HostOffload:
    """A saved-tensor hook that copies every packed tensor to host memory and counts bytes."""

    def __init__(self) -> None:
        self.count, self.bytes, self.kinds = 0, 0, set()

    def pack(self, t: torch.Tensor):
        self.count += 1
        self.bytes += t.numel() * t.element_size()
        self.kinds.add(type(t).__name__)
        return t.device, t.to("cpu", copy=True)

    def unpack(self, packed):
        device, host = packed
        return host.to(device)


def _weight_bytes(groups: list[list[torch.Tensor]]) -> int:
    """TE's modules pack the same activations plus every weight object of each layer (the
    DistributedWeight shards go through save_for_backward)."""
    return sum(w.numel() * w.element_size() for group in groups for w in group)


def run(args: argparse.Namespace) -> dict:
    dtype, device = DTYPES[args.dtype], torch.device(args.device)
    g = torch.Generator().manual_seed(0)
    E, T, H, F_ = args.experts, args.tokens, args.hidden, args.ffn
    splits = torch.randint(0, E, (T,), generator=g).bincount(minlength=E)  # random routing
    rnd = lambda *s: (torch.randn(*s, generator=g) / s[-1] ** 0.5).to(dtype).to(device)
    w1 = LocalGroupWeight.group_of([rnd(F_, H) for _ in range(E)])
    w2 = LocalGroupWeight.group_of([rnd(H, F_) for _ in range(E)])
    x = rnd(T, H).requires_grad_()
    dy = rnd(T, H)
    hook = HostOffload()
    t0 = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(hook.pack, hook.unpack):
        y1 = grouped_linear(x, w1, splits, backend=args.backend)
        y = grouped_linear(F.gelu(y1), w2, splits, backend=args.backend)
    y.backward(dy, retain_graph=True)
    grads_once = [t.grad.clone() for t in (x, *w1, *w2)]
    y.backward(dy)
    elapsed = time.perf_counter() - t0
    # plain PyTorch reference: the same math with plain tensors and a loop of F.linear
    ref_params = [w.detach().clone().requires_grad_() for w in (*w1, *w2)]
    xr = x.detach().clone().requires_grad_()
    sizes = splits.tolist()
    h = torch.cat([F.linear(xe, ref_params[e]) for e, xe in enumerate(xr.split(sizes))])
    yr = torch.cat([F.linear(he, ref_params[E + e]) for e, he in enumerate(F.gelu(h).split(sizes))])
    ref_grads = torch.autograd.grad(yr, [xr, *ref_params], dy)
    err = max((a.double() - b.double()).abs().max().item() for a, b in zip(grads_once, ref_grads))
    twice = max((t.grad.double() - 2 * a.double()).abs().max().item() for t, a in zip((x, *w1, *w2), grads_once))
    return dict(
        hook=hook,
        te_bytes=hook.bytes + _weight_bytes([w1, w2]),
        err=err,
        twice=twice,
        elapsed=elapsed,
        calls=w1[0].calls,
        splits=sizes,
    )


def _tokens(args: argparse.Namespace, rank: int, dtype: torch.dtype, device: torch.device):
    g = torch.Generator().manual_seed(1 + rank)
    splits = torch.randint(0, args.experts, (args.tokens,), generator=g).bincount(minlength=args.experts)
    rnd = lambda *s: (torch.randn(*s, generator=g) / s[-1] ** 0.5).to(dtype).to(device)  # noqa: E731
    return splits, rnd(args.tokens, args.hidden), rnd(args.tokens, args.hidden)


def _reference_grads(
    args: argparse.Namespace, fulls: list, rank: int, world: int, dtype: torch.dtype, device: torch.device
) -> tuple:
    """Plain PyTorch on the full weights over every rank's tokens: this rank's dx and the weight
    grads summed over ranks."""
    E = args.experts
    ref = [f.detach().clone().requires_grad_() for f in fulls]
    sums = [torch.zeros_like(f) for f in fulls]
    for r in range(world):
        sp, xr, dyr = _tokens(args, r, dtype, device)
        xr.requires_grad_()
        sizes = sp.tolist()
        h = torch.cat([F.linear(xe, ref[e]) for e, xe in enumerate(xr.split(sizes))])
        yr = torch.cat([F.linear(he, ref[E + e]) for e, he in enumerate(F.gelu(h).split(sizes))])
        grads = torch.autograd.grad(yr, [xr, *ref], dyr)
        sums = [s + gr for s, gr in zip(sums, grads[1:])]
        if r == rank:
            dx = grads[0]
    return dx, sums


def run_rank(args: argparse.Namespace) -> dict:
    """One rank of ``--ranks N``: the MLP with ShardedWeight groups on this rank's tokens. The
    reference is plain PyTorch on the full weights, with every rank's tokens (each rank builds
    them all): a shard's grad must equal the rows it holds of the weight grads summed over ranks."""
    import torch.distributed as dist

    from .distributed import shard_grouped_weights

    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = DTYPES[args.dtype]
    device = torch.device(f"cuda:{rank}" if args.device == "cuda" else "cpu")
    E, H, F_ = args.experts, args.hidden, args.ffn
    g = torch.Generator().manual_seed(0)  # the same full weights on every rank
    rnd = lambda *s: (torch.randn(*s, generator=g) / s[-1] ** 0.5).to(dtype).to(device)  # noqa: E731
    fulls = [rnd(F_, H) for _ in range(E)] + [rnd(H, F_) for _ in range(E)]
    w1, w2 = shard_grouped_weights(fulls[:E]), shard_grouped_weights(fulls[E:])
    splits, x, dy = _tokens(args, rank, dtype, device)
    x.requires_grad_()
    hook = HostOffload()
    t0 = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(hook.pack, hook.unpack):
        y = grouped_linear(
            F.gelu(grouped_linear(x, w1, splits, backend=args.backend)), w2, splits, backend=args.backend
        )
    y.backward(dy, retain_graph=True)
    once = [t.grad.clone() for t in (x, *w1, *w2)]
    y.backward(dy)
    elapsed = time.perf_counter() - t0
    dx, sums = _reference_grads(args, fulls, rank, world, dtype, device)
    lo = [min(rank * -(-f.shape[0] // world), f.shape[0]) for f in fulls]
    want = [dx] + [s[a : a + w.shape[0]] for s, a, w in zip(sums, lo, (*w1, *w2))]
    err = max((a.double() - b.double()).abs().max().item() for a, b in zip(once, want) if a.numel())
    twice = max((t.grad.double() - 2 * a.double()).abs().max().item() for t, a in zip((x, *w1, *w2), once) if a.numel())
    return dict(
        err=err,
        twice=twice,
        elapsed=elapsed,
        packed=hook.count,
        kinds=hook.kinds,
        splits=splits.tolist(),
        shard=tuple(w1[0].shape),
        collectives=dict(w1[0]._dw.stats),
    )


def main_ranks(args: argparse.Namespace) -> int:
    from .distributed import launch

    backend = "nccl" if args.device == "cuda" else "gloo"
    results = launch(run_rank, args.ranks, args, backend=backend, timeout=120)
    print(
        f"functional_dw demo: MoE expert MLP on {args.ranks} ranks ({backend}), {args.experts} experts, "
        f"{args.tokens} tokens per rank, hidden {args.hidden}, ffn {args.ffn}, {args.dtype} on {args.device}"
    )
    print(
        "weights sharded along out features (ShardedWeight); each rank: forward + 2 backwards under a host-offload hook\n"
    )
    print(
        "| rank | tokens per expert | layer-1 shard | collectives (layer 1, all experts) | max grad err | 2nd bwd dev | ms |"
    )
    print(
        "|------|-------------------|---------------|------------------------------------|--------------|-------------|----|"
    )
    for r, res in enumerate(results):
        c = res["collectives"]
        print(
            f"| {r} | {res['splits']} | {list(res['shard'])} | {c.get('all_gather', 0)} all-gathers, "
            f"{c.get('reduce_scatter', 0)} reduce-scatters | {res['err']:.3g} | {res['twice']:.3g} | {res['elapsed'] * 1e3:.1f} |"
        )
    tol = {"float64": 1e-10, "float32": 1e-4}.get(args.dtype, 5e-2)
    ok = all(res["err"] <= tol and res["twice"] <= tol and res["kinds"] == {"Tensor"} for res in results)
    print("\nOK" if ok else "\nMISMATCH")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="functional_dw demo", description=__doc__)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--ffn", type=int, default=256)
    p.add_argument("--dtype", choices=list(DTYPES), default="float32")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--backend", choices=["torch", "te"], default=None, help="default: te on CUDA with TE, else torch")
    p.add_argument(
        "--ranks",
        type=int,
        default=1,
        help="run on N local processes with sharded weights (gloo; NCCL with --device cuda)",
    )
    args = p.parse_args(argv)
    if args.ranks > 1:
        return main_ranks(args)
    r = run(args)
    hook = r["hook"]
    print(
        f"functional_dw demo: MoE expert MLP, {args.experts} experts, {args.tokens} tokens, "
        f"hidden {args.hidden}, ffn {args.ffn}, {args.dtype} on {args.device}"
    )
    print(f"token splits: {r['splits']}")
    print()
    print("| what                                   | value |")
    print("|----------------------------------------|-------|")
    print(f"| tensors packed by the saved-tensor hook | {hook.count} activations (x, GELU in/out), no weight |")
    print(f"| bytes packed (functional_dw)           | {hook.bytes:,} |")
    print(f"| bytes TE's modules would pack          | {r['te_bytes']:,} (the same + all weights) |")
    print(f"| DistributedWeight calls (layer 1)      | {r['calls']} |")
    print(f"| max |grad - plain PyTorch|             | {r['err']:.3g} |")
    print(f"| 2nd backward (retain_graph) = 2x grads | max dev {r['twice']:.3g} |")
    print(f"| forward + 2 backwards                  | {r['elapsed'] * 1e3:.1f} ms |")
    tol = {"float64": 1e-10, "float32": 1e-4}.get(args.dtype, 5e-2)
    ok = r["err"] <= tol and r["twice"] <= tol and hook.kinds == {"Tensor"}
    print("\nOK" if ok else "\nMISMATCH")
    return 0 if ok else 1
