"""Engines that run models: `LLMEngine` (input processing, the core step, output processing),
`LLM` (offline), `AsyncLLM` (serving), `DataParallelEngine` (replicas behind one front end),
plus the detokenizer and beam search they use."""
