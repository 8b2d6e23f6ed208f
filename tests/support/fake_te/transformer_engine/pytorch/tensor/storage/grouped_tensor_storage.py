class GroupedTensorStorage:
    def __new__(
        cls,
        shape,
        dtype,
        *,
        num_tensors,
        shapes=None,
        quantizer=None,
        data=None,
        columnwise_data=None,
        scale_inv=None,
        columnwise_scale_inv=None,
        amax=None,
        columnwise_amax=None,
        scale=None,
        first_dims=None,
        last_dims=None,
        tensor_offsets=None,
        offsets=None,
        scale_inv_offsets=None,
        columnwise_scale_inv_offsets=None,
        requires_grad=False,
        stride=None,
        with_gemm_swizzled_scales=False,
        row_scaled_nvfp4=False,
        nvfp4_use_4over6=False,
        nvfp4_e4m3_max=448,
    ):
        i = object.__new__(cls)
        i.logical_shape, i.fake_dtype, i.num_tensors, i.tensor_shapes, i.quantizer = (
            shape,
            dtype,
            num_tensors,
            shapes,
            quantizer,
        )
        i.rowwise_data, i.columnwise_data, i.scale_inv, i.columnwise_scale_inv = (
            data,
            columnwise_data,
            scale_inv,
            columnwise_scale_inv,
        )
        i.amax, i.columnwise_amax, i.scale, i.first_dims, i.last_dims, i.tensor_offsets = (
            amax,
            columnwise_amax,
            scale,
            first_dims,
            last_dims,
            tensor_offsets,
        )
        i.offsets, i.scale_inv_offsets, i.columnwise_scale_inv_offsets = (
            offsets,
            scale_inv_offsets,
            columnwise_scale_inv_offsets,
        )
        i._with_gemm_swizzled_scales, i.row_scaled_nvfp4, i.nvfp4_use_4over6, i.nvfp4_e4m3_max = (
            with_gemm_swizzled_scales,
            row_scaled_nvfp4,
            nvfp4_use_4over6,
            nvfp4_e4m3_max,
        )
        i.quantized_tensors = None
        return i
