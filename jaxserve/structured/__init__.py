"""Structured outputs: constraints (JSON schema, regex, choice, grammar) as token bitmasks."""

from jaxserve.structured.grammar import (
    GrammarCompiler,
    RequestGrammar,
    bitmask_width,
    fill_bitmasks,
    row_bitmasks,
)
from jaxserve.structured.params import StructuredOutputsParams

__all__ = ["GrammarCompiler", "RequestGrammar", "StructuredOutputsParams", "bitmask_width",
           "fill_bitmasks", "row_bitmasks"]
