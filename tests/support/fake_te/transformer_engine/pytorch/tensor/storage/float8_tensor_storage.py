class Float8TensorStorage:
    def __new__(
        cls,
        *args,
        data,
        fp8_scale_inv,
        fp8_dtype,
        fake_dtype=None,
        data_transpose=None,
        quantizer=None,
        transpose_invalid=None,
        **kw,
    ):
        i = object.__new__(cls)
        i._data, i._scale_inv, i._fp8_dtype, i._dtype, i._transpose = (
            data,
            fp8_scale_inv,
            fp8_dtype,
            fake_dtype,
            data_transpose,
        )
        i._quantizer = quantizer.copy() if quantizer is not None else None
        i._transpose_invalid = transpose_invalid if transpose_invalid is not None else data_transpose is None
        return i

    def get_metadata(self):
        return {
            "data": self._data,
            "fp8_scale_inv": self._scale_inv,
            "fp8_dtype": self._fp8_dtype,
            "data_transpose": self._transpose,
            "quantizer": self._quantizer,
            "fake_dtype": self._dtype,
        }

    @property
    def device(self):
        return (self._data if self._data is not None else self._transpose).device
