"""A CPU stand-in for the parts of Transformer Engine 2.20 that ``functional_dw.kernels.te`` and
``te_fp8`` import, for tests/test_te_fp8_fake.py only: same names and signatures, storages with
TE's constructor kwargs and ``get_metadata``, quantization by ``functional_dw.fp8``'s emulation,
GEMMs that dequantize the copy TE's TN-only Hopper GEMM would read (and fail if it is missing).
It checks te_fp8's plumbing (operands, layouts, usages, pytrees, dbias, amax recording), not
TE's numerics: tests/test_te_fp8_gpu.py does that against the real TE."""
