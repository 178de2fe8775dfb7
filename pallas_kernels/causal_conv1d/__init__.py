"""Causal depthwise conv1d over the ragged batch, each request's last inputs in a slot."""
