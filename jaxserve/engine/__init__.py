"""Engines that run models: `LLMEngine` (input processing, the core step, output processing),
`LLM` (offline), `AsyncLLM` (serving), plus the detokenizer and beam search they use."""
