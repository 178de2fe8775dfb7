"""Engines that run models: for now the single-request greedy generator."""
