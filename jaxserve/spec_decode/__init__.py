"""Speculative decoding (issue 14): proposers, the acceptance rule and their configuration."""
