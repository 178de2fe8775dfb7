"""Matmul against FP4 E2M1 weights with block scales (`models.quant`'s ``mxfp4``/``nvfp4``)."""
