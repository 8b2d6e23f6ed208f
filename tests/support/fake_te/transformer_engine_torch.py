"""A CPU fake of TE's extension, enough to exercise functional_dw.kernels.te_fp8's plumbing."""

import enum

import torch
from functional_dw import fp8 as _fp8


class DType(enum.IntEnum):
    kFloat8E4M3 = 7
    kFloat8E5M2 = 8


CALLS = []


def get_cublasLt_version():
    return 131000


def splits_to_offsets_multi(sizes, device, strides, include_leading_zero, dtypes, bulk_allocate):
    sizes = sizes.to(torch.int64)
    offs = [torch.cat([sizes.new_zeros(1), torch.cumsum(sizes * s, 0)]) for s in strides]
    return sizes, offs


def _spec(q):
    from transformer_engine.pytorch.tensor import Float8CurrentScalingQuantizer, Float8Quantizer

    dt = torch.float8_e4m3fn if q.dtype == DType.kFloat8E4M3 else torch.float8_e5m2
    if isinstance(q, Float8Quantizer):
        return _fp8.TensorSpec("input", "delayed", dt)
    if isinstance(q, Float8CurrentScalingQuantizer):
        return _fp8.TensorSpec("input", "current", dt, power_2_scale=q.force_pow_2_scales, amax_epsilon=q.amax_epsilon)
    return _fp8.TensorSpec(
        "input",
        "block",
        dt,
        block=(1, 128) if q.block_scaling_dim == 1 else (128, 128),
        power_2_scale=q.force_pow_2_scales,
        amax_epsilon=q.amax_epsilon,
    )


def quantize(t, q, output=None, noop=None):
    from transformer_engine.pytorch.tensor.storage.float8_tensor_storage import Float8TensorStorage
    from transformer_engine.pytorch.tensor.storage.float8_blockwise_tensor_storage import Float8BlockwiseQTensorStorage

    CALLS.append(
        (
            "quantize",
            tuple(t.shape),
            type(q).__name__,
            q.rowwise_usage,
            q.columnwise_usage,
            q.internal,
            q.optimize_for_gemm,
        )
    )
    spec = _spec(q)
    if spec.scaling == "delayed":
        if not q.rowwise_usage:
            raise NotImplementedError("Columnwise-only per-tensor FP8 quantization is not implemented")
        qt = _fp8.quantize(t, spec, scale=q.scale, rowwise=True, columnwise=q.columnwise_usage)
        if t.numel():
            q.amax.copy_(torch.maximum(q.amax, qt.amax))
    else:
        if spec.scaling == "current" and not q.rowwise_usage:
            raise NotImplementedError("Columnwise-only per-tensor FP8 quantization is not implemented")
        qt = _fp8.quantize(t, spec, rowwise=q.rowwise_usage or spec.scaling != "block", columnwise=q.columnwise_usage)
    if spec.scaling == "block":
        return Float8BlockwiseQTensorStorage(
            qt.rowwise_data,
            qt.rowwise_scale_inv,
            qt.columnwise_data,
            qt.columnwise_scale_inv,
            q.dtype,
            q,
            q.block_scaling_dim == 2,
            fake_dtype=t.dtype,
        )
    return Float8TensorStorage(
        data=qt.rowwise_data,
        fp8_scale_inv=qt.rowwise_scale_inv,
        fp8_dtype=q.dtype,
        fake_dtype=t.dtype,
        data_transpose=qt.columnwise_data,
        quantizer=q,
    )


def split_quantize(x, sizes, qs, disable_bulk_allocation=False):
    CALLS.append(("split_quantize", tuple(sizes)))
    return [quantize(p, q) for p, q in zip(torch.split(x, list(sizes)), qs)]


def bgrad_quantize(x, q):
    CALLS.append(("bgrad_quantize", tuple(x.shape), q.rowwise_usage, q.columnwise_usage))
    return [x.float().sum(0).to(x.dtype), quantize(x, q)]


def group_quantize(x, q, E, first_dims, last_dims=None, tensor_offsets=None, noop_flag=None, output=None):
    from transformer_engine.pytorch.tensor.storage.grouped_tensor_storage import GroupedTensorStorage

    CALLS.append(("group_quantize", tuple(x.shape), E, q.rowwise_usage, q.columnwise_usage))
    sizes = first_dims.tolist()
    parts = [quantize(p, q) for p in torch.split(x, sizes)]
    cat = lambda name: [getattr(p, name) for p in parts]
    if hasattr(parts[0], "_data"):
        data = torch.cat([d.reshape(-1) for d in cat("_data")]) if q.rowwise_usage else None
        col = torch.cat([d.reshape(-1) for d in cat("_transpose")]) if q.columnwise_usage else None
        si = torch.cat(cat("_scale_inv"))
        return GroupedTensorStorage(
            shape=tuple(x.shape),
            dtype=x.dtype,
            num_tensors=E,
            quantizer=q,
            data=data,
            columnwise_data=col,
            scale_inv=si if q.rowwise_usage else None,
            columnwise_scale_inv=si if q.columnwise_usage else None,
            amax=torch.zeros(E),
            scale=torch.zeros(E),
            first_dims=first_dims,
            tensor_offsets=tensor_offsets,
        )
    g = GroupedTensorStorage(
        shape=tuple(x.shape),
        dtype=x.dtype,
        num_tensors=E,
        quantizer=q,
        data=torch.cat([d.reshape(-1) for d in cat("_rowwise_data")]) if q.rowwise_usage else None,
        columnwise_data=torch.cat([d.reshape(-1) for d in cat("_columnwise_data")]) if q.columnwise_usage else None,
        scale_inv=torch.cat([d.reshape(-1) for d in cat("_rowwise_scale_inv")]) if q.rowwise_usage else None,
        columnwise_scale_inv=torch.cat([d.reshape(-1) for d in cat("_columnwise_scale_inv")])
        if q.columnwise_usage
        else None,
        first_dims=first_dims,
        tensor_offsets=tensor_offsets,
    )
    return g


def bgrad_group_quantize(x, q, E, first_dims, last_dims=None, tensor_offsets=None):
    CALLS.append(("bgrad_group_quantize",))
    g = group_quantize(x, q, E, first_dims, tensor_offsets=tensor_offsets)
    return g, torch.stack([p.float().sum(0).to(x.dtype) for p in torch.split(x, first_dims.tolist())])
