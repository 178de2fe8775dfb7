"""The quantized checkpoint formats: importing this package registers each format's
builder with `models.loaders.checkpoint_quant.register` (one module per format family)."""
from models.loaders.quant_formats import (
    awq,  # noqa: F401
    compressed_tensors,  # noqa: F401
    fp8,  # noqa: F401
    gpt_oss,  # noqa: F401
    gptq,  # noqa: F401
)
