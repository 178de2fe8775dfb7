"""A checkpoint source that serves per-expert tensors cut from the stacked [E, ...] tensors
some families store (gpt-oss, Llama 4), reading each stack once per layer."""

from __future__ import annotations

import numpy as np


class StackedExpertsSource:
    """The base of a family's `TensorSource` over stacked expert tensors: `stacked(name)`
    reads the checkpoint's tensor `name` and keeps it until another is read, so the E
    experts of a layer, asked for one by one, read their stack once.

    Args:
        source: The checkpoint's tensors.
    """

    def __init__(self, source):
        self.source = source
        self._last: tuple[str, np.ndarray] | None = None

    def stacked(self, name: str) -> np.ndarray:
        """The checkpoint's tensor `name`, kept until another is read."""
        if self._last is None or self._last[0] != name:
            self._last = (name, self.source.get(name))
        return self._last[1]
