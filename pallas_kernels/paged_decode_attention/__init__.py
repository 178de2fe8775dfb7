"""Paged decode attention: one query token per request, split-K over long contexts."""
