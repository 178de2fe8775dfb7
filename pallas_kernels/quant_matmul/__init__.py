"""Matmul against quantized weights (q8 / q4 formats of `models.quant`)."""
