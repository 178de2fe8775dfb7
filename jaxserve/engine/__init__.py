"""Engines that run models: `LLMEngine` (the step loop), `LLM` (offline), `AsyncLLM`
(serving), plus the detokenizer and beam search they use."""
