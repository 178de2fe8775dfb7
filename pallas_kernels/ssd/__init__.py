"""Mamba-2's selective state-space scan (SSD) over the ragged batch, with per-request state."""
