"""Matmul against FP8 weights with block scales (the ``fp8`` format of `models.quant`)."""
