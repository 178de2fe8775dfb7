"""jaxserve: a JAX/XLA LLM serving engine (PagedAttention, continuous batching, chunked prefill)."""

__version__ = "0.1.0"
