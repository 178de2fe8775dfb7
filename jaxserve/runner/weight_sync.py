"""New weights for a serving model: checked against its layout and turned into its serving form.

A caller (an RL loop, an evaluation job) hands `update_weights` a params tree in the
model's own standard layout (`models.model.abstract_params` of its architecture, dtype and
quantization: what `Model.params` holds when loaded, before any serving transform) or a
checkpoint path. The tree is checked leaf by leaf (structure, shape, dtype: the error
names the first leaf that differs); float weights for a quantized model are quantized by
its plan. Then the model's serving form (`models.linear.serving_params` for its methods:
the `cpu` backend's packed panels, a mixture of experts' whole stacks) is made; the runner
places it (`ModelRunner.set_params`). Leaves
that already have the serving shardings are used as they are: nothing goes through the
host.
"""

from __future__ import annotations

import jax
import numpy as np

from models import linear
from models.model import Model, abstract_params
from models.quant import NO_QUANT, quantize_params


def _mismatch(got, want) -> str | None:
    """Why leaf trees `got` and `want` differ (the first leaf path), or None."""
    got_leaves, got_tree = jax.tree_util.tree_flatten_with_path(got)
    want_leaves, want_tree = jax.tree_util.tree_flatten_with_path(want)
    if got_tree != want_tree:
        got_paths = {jax.tree_util.keystr(p) for p, _ in got_leaves}
        want_paths = {jax.tree_util.keystr(p) for p, _ in want_leaves}
        missing, extra = sorted(want_paths - got_paths), sorted(got_paths - want_paths)
        return (f"the tree differs from the model's: missing {missing[:3]}, unexpected "
                f"{extra[:3]}")
    for (path, g), (_, w) in zip(got_leaves, want_leaves, strict=True):
        if tuple(np.shape(g)) != tuple(w.shape) or np.dtype(g.dtype) != np.dtype(w.dtype):
            return (f"leaf {jax.tree_util.keystr(path)} is {np.dtype(g.dtype).name}"
                    f"{list(np.shape(g))}, the model's is {np.dtype(w.dtype).name}"
                    f"{list(w.shape)}")
    return None


def checked_params(model: Model, params: dict) -> dict:
    """`params` checked against `model`'s standard layout (float weights of a quantized
    model quantized by its plan).

    Raises:
        ValueError: A tree, shape or dtype that is not the model's (naming the leaf).
    """
    if not isinstance(params, dict):
        raise ValueError(f"update_weights takes a params tree (dict) or a path, got "
                         f"{type(params).__name__}")
    dtype = np.dtype(model.dtype).name
    want = abstract_params(model.cfg, dtype, model.quant)
    why = _mismatch(params, want)
    if why is not None and model.quant:
        float_tree = abstract_params(model.cfg, dtype, NO_QUANT)
        if _mismatch(params, float_tree) is None:  # float weights: quantize them
            return jax.device_put(quantize_params(params, model.quant))
    if why is not None:
        raise ValueError(f"update_weights: {why}")
    return params


def standard_params(model: Model) -> dict:
    """`model`'s weights in its standard layout (what `update_weights` takes): packed
    panels unpacked (a copy), a mixture of experts' whole stacks put back."""
    return linear.standard_params(model.params, model.cfg, model.quant)


def serving_params(model: Model, params: dict) -> dict:
    """Standard-layout `params` (checked) in `model`'s serving form."""
    return linear.serving_params(params, model.methods)
