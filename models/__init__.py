"""Flax decoder-only model families and their weight loaders."""
