import torch
from functional_dw.fp8.qtensor import apply_scale_inv
from transformer_engine.pytorch.tensor.storage.float8_tensor_storage import Float8TensorStorage
from transformer_engine.pytorch.tensor.storage.float8_blockwise_tensor_storage import Float8BlockwiseQTensorStorage
from transformer_engine.pytorch.tensor.storage.grouped_tensor_storage import GroupedTensorStorage
import transformer_engine_torch as tex


def get_cublas_workspace(*a):
    return None


def _get_grouped_cublas_workspace(*a):
    return None


def _get_grouped_gemm_setup_workspace(*a):
    return None


def _get_fp32_ones_tensor(*a):
    return None


def _get_fp32_zeros_tensor(*a):
    return None


def _deq(st, cw):
    """Logical [rows, cols] fp32 from the rowwise (cw=False) or columnwise copy (which must exist)."""
    if isinstance(st, torch.Tensor):
        return st.float()
    if isinstance(st, Float8TensorStorage):
        d = st._transpose if cw else st._data
        assert d is not None, f"missing {'columnwise' if cw else 'rowwise'} data"
        m = d.float() * st._scale_inv
        return m.t() if cw else m
    assert isinstance(st, Float8BlockwiseQTensorStorage)
    d, s = (st._columnwise_data, st._columnwise_scale_inv) if cw else (st._rowwise_data, st._rowwise_scale_inv)
    assert d is not None, f"missing {'columnwise' if cw else 'rowwise'} data"
    m = apply_scale_inv(d, s, (128, 128) if st._is_2D_scaled else (1, 128))
    return m.t() if cw else m


def _gparts(g, cw):
    """Per-expert logical matrices of a grouped storage (plain or FP8)."""
    sizes = g.first_dims.tolist() if g.first_dims is not None else [g.logical_shape[0] // g.num_tensors] * g.num_tensors
    C = g.logical_shape[1]
    if g.quantizer is None:
        data = g.rowwise_data
        out, o = [], 0
        for n in sizes:
            out.append(data[o : o + n * C].view(n, C))
            o += n * C
        return out
    from transformer_engine.pytorch.tensor import Float8BlockQuantizer

    data = g.columnwise_data if cw else g.rowwise_data
    assert data is not None, f"grouped: missing {'columnwise' if cw else 'rowwise'} data"
    sc = g.columnwise_scale_inv if cw else g.scale_inv
    assert sc is not None, "grouped: missing scale_inv"
    out, o, so = [], 0, 0
    for e, n in enumerate(sizes):
        d = data[o : o + n * C]
        o += n * C
        if not isinstance(g.quantizer, Float8BlockQuantizer):
            m = d.view(C, n).float().t() * sc[e] if cw else d.view(n, C).float() * sc[e]
        else:
            blk = (128, 128) if g.quantizer.block_scaling_dim == 2 else (1, 128)
            R, Cc = (C, n) if cw else (n, C)
            ns = -(-R // blk[0]) * -(-Cc // blk[1])
            s = sc[so : so + ns].view(-(-R // blk[0]), -(-Cc // blk[1]))
            so += ns
            m = apply_scale_inv(d.view(R, Cc), s, blk)
            m = m.t() if cw else m
        out.append(m)
    return out


def _mm(A, B, layout):
    if layout == "TN":
        return B @ A.t()
    if layout == "NN":
        return B @ A
    return B.t() @ A


def _fp8(st):
    return isinstance(st, (Float8TensorStorage, Float8BlockwiseQTensorStorage)) or (
        isinstance(st, GroupedTensorStorage) and st.quantizer is not None
    )


def general_gemm(
    A,
    B,
    out_dtype=None,
    quantization_params=None,
    gelu=False,
    gelu_in=None,
    alpha=1.0,
    beta=None,
    accumulate=False,
    layout="TN",
    out=None,
    bias=None,
    use_split_accumulator=False,
    grad=False,
    **kw,
):
    tex.CALLS.append(
        (
            "general_gemm",
            layout,
            grad,
            accumulate,
            use_split_accumulator,
            None if bias is None else bias.dtype,
            out_dtype,
        )
    )
    assert quantization_params is None
    if _fp8(A) or _fp8(B):
        assert _fp8(A) and _fp8(B)
        assert bias is None or bias.dtype != torch.float32, "FP8 GEMM with fp32 bias"
    D = _mm(_deq(A, layout[0] == "N"), _deq(B, layout[1] == "T"), layout)
    if bias is not None and not grad:
        D = D + bias.float()
    if out is not None:
        assert out.dtype == out_dtype
        if accumulate:
            out.add_(D.to(out.dtype))
        else:
            out.copy_(D.to(out.dtype))
        return out, None, None, None
    return D.to(out_dtype), None, None, None


def general_grouped_gemm(
    A,
    B,
    out,
    quantization_params,
    out_dtype,
    layout="TN",
    m_splits=None,
    gelu=False,
    grad=False,
    accumulate=False,
    bias=None,
    use_bias=False,
    use_split_accumulator=False,
    D_dtype=None,
    single_output=False,
):
    tex.CALLS.append(
        (
            "general_grouped_gemm",
            layout,
            grad,
            accumulate,
            use_split_accumulator,
            bool(use_bias),
            single_output,
            tuple(m_splits),
        )
    )
    assert all(q is None for q in quantization_params) and len(A) == len(B)
    dt = out[0].dtype
    row = 0
    for e, (a, b) in enumerate(zip(A, B)):
        n = m_splits[e]
        if single_output:
            o = out[0][row : row + n]
            row += n
        else:
            o = out[e]
        if n == 0:
            if not accumulate:
                o.zero_()
            continue
        D = _mm(_deq(a, layout[0] == "N"), _deq(b, layout[1] == "T"), layout)
        if use_bias and not grad:
            assert bias[e].dtype != torch.float32
            D = D + bias[e].float()
        if accumulate:
            o.add_(D.to(dt))
        else:
            o.copy_(D.to(dt))
    return out, None, None


def general_grouped_gemm_for_grouped_tensor(
    A,
    B,
    out,
    *,
    layout="TN",
    accumulate=False,
    use_split_accumulator=False,
    bias=None,
    bias_scale=None,
    grad=False,
    alpha=None,
    beta=None,
):
    tex.CALLS.append(
        (
            "grouped_tensor_gemm",
            layout,
            accumulate,
            use_split_accumulator,
            bias is not None,
            type(A).__name__,
            type(out).__name__,
        )
    )
    assert not (isinstance(A, list) and isinstance(out, list))
    E = B.num_tensors
    As = [_deq(a, layout[0] == "N") for a in A] if isinstance(A, list) else _gparts(A, layout[0] == "N")
    Bs = _gparts(B, layout[1] == "T")
    if isinstance(A, list):
        assert len(A) <= 64
    outs = out if isinstance(out, list) else _gparts(out, False)
    bs = None if bias is None else _gparts(bias, False)
    for e in range(E):
        D = _mm(As[e], Bs[e], layout)
        if bs is not None:
            D = D.to(outs[e].dtype).float() + bs[e].float()  # TE adds the bias to the rounded output
        if accumulate:
            outs[e].add_(D.to(outs[e].dtype))
        else:
            outs[e].copy_(D.to(outs[e].dtype))
    return out
