class Float8BlockwiseQTensorStorage:
    def __new__(
        cls,
        rowwise_data,
        rowwise_scale_inv,
        columnwise_data,
        columnwise_scale_inv,
        fp8_dtype,
        quantizer,
        is_2D_scaled,
        *args,
        fake_dtype=None,
        **kw,
    ):
        i = object.__new__(cls)
        i._rowwise_data, i._rowwise_scale_inv, i._columnwise_data, i._columnwise_scale_inv = (
            rowwise_data,
            rowwise_scale_inv,
            columnwise_data,
            columnwise_scale_inv,
        )
        i._fp8_dtype, i._quantizer, i._is_2D_scaled, i._dtype = (
            fp8_dtype,
            quantizer.copy() if quantizer is not None else None,
            is_2D_scaled,
            fake_dtype,
        )
        return i

    def get_metadata(self):
        return {
            "rowwise_data": self._rowwise_data,
            "rowwise_scale_inv": self._rowwise_scale_inv,
            "columnwise_data": self._columnwise_data,
            "columnwise_scale_inv": self._columnwise_scale_inv,
            "fp8_dtype": self._fp8_dtype,
            "quantizer": self._quantizer,
            "is_2D_scaled": self._is_2D_scaled,
            "fake_dtype": self._dtype,
        }

    @property
    def device(self):
        return (self._rowwise_data if self._rowwise_data is not None else self._columnwise_data).device
