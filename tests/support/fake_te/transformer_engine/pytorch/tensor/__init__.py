class Quantizer:
    def __init__(self, *, rowwise, columnwise):
        self.rowwise_usage, self.columnwise_usage, self.internal, self.optimize_for_gemm = (
            rowwise,
            columnwise,
            False,
            False,
        )

    def set_usage(self, *, rowwise=None, columnwise=None):
        if rowwise is not None:
            self.rowwise_usage = rowwise
        if columnwise is not None:
            self.columnwise_usage = columnwise

    def copy(self):
        import copy

        return copy.copy(self)

    def quantize(self, t):
        import transformer_engine_torch as tex

        assert self.internal
        return tex.quantize(t, self)

    __call__ = quantize


class Float8Quantizer(Quantizer):
    def __init__(self, scale, amax, fp8_dtype, *, rowwise=True, columnwise=True):
        super().__init__(rowwise=rowwise, columnwise=columnwise)
        assert amax.shape == (1,) and scale.numel() == 1
        self.scale, self.amax, self.dtype = scale, amax, fp8_dtype


class Float8CurrentScalingQuantizer(Quantizer):
    def __init__(self, fp8_dtype, device, *, rowwise=True, columnwise=True, force_pow_2_scales=False, amax_epsilon=0.0):
        super().__init__(rowwise=rowwise, columnwise=columnwise)
        self.dtype, self.force_pow_2_scales, self.amax_epsilon = fp8_dtype, force_pow_2_scales, amax_epsilon


class Float8BlockQuantizer(Quantizer):
    def __init__(
        self, fp8_dtype, *, rowwise, columnwise, amax_epsilon=0.0, force_pow_2_scales=True, block_scaling_dim=2
    ):
        super().__init__(rowwise=rowwise, columnwise=columnwise)
        self.dtype, self.amax_epsilon, self.force_pow_2_scales, self.block_scaling_dim = (
            fp8_dtype,
            amax_epsilon,
            force_pow_2_scales,
            block_scaling_dim,
        )
