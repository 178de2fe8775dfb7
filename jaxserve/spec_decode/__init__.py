"""Speculative decoding (issue 14): proposers, the acceptance rule and `make_speculator`
(`factory.py`); their `SpeculativeConfig` is in `jaxserve.config`."""
