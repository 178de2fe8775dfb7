"""Gated delta rule (Gated DeltaNet) over the ragged batch, with per-request state slots."""
