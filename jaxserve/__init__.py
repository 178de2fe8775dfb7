"""jaxserve: a JAX/XLA LLM serving engine (PagedAttention, continuous batching, chunked prefill)."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["LLM", "LLMEngine", "EngineConfig", "RequestOutput", "CompletionOutput",
           "SamplingParams", "StructuredOutputsParams", "PoolingParams", "PoolerConfig",
           "EmbeddingRequestOutput", "ClassificationRequestOutput", "ScoringRequestOutput",
           "PoolingRequestOutput"]

# NOTE: resolved lazily, so `import jaxserve.core` (plain Python, no JAX) stays light.
_LAZY = {
    "LLM": "jaxserve.engine.llm",
    "LLMEngine": "jaxserve.engine.llm_engine",
    "EngineConfig": "jaxserve.config",
    "RequestOutput": "jaxserve.outputs",
    "CompletionOutput": "jaxserve.outputs",
    "SamplingParams": "jaxserve.sampling_params",
    "StructuredOutputsParams": "jaxserve.structured.params",
    "PoolingParams": "jaxserve.pooling_params",
    "PoolerConfig": "jaxserve.pooling_params",
    "EmbeddingRequestOutput": "jaxserve.outputs",
    "ClassificationRequestOutput": "jaxserve.outputs",
    "ScoringRequestOutput": "jaxserve.outputs",
    "PoolingRequestOutput": "jaxserve.outputs",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'jaxserve' has no attribute {name!r}")
