"""Ragged paged attention: packed prefill chunks and decodes attending through block tables."""
