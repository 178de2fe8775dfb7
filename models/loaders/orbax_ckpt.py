"""jaxserve's own checkpoint format: orbax params + architecture JSON + tokenizer files.

Layout of a converted directory:
    jaxserve_model.json   {"format": 1, "dtype": ..., "source": ..., "arch": {...},
                           "quantization": {"name": ..., "formats": {module: [kind, block]}}}
    params/               orbax StandardCheckpointer output
    tokenizer/            tokenizer.save_pretrained output (tokenizer.json, chat template)
"""

from __future__ import annotations

import json
import os

import jax

from models.config import ArchConfig
from models.linear import standard_params
from models.quant import NO_QUANT, QuantPlan

MARKER = "jaxserve_model.json"
FORMAT_VERSION = 1


def _checkpointer():
    """orbax's `StandardCheckpointer`, imported on first use: orbax adds ~25 MB to every
    process's resident set, and only converting and loading checkpoints need it."""
    import orbax.checkpoint as ocp

    return ocp.StandardCheckpointer()


def is_jaxserve_checkpoint(path: str) -> bool:
    """Whether `path` is a directory written by `save_checkpoint`."""
    return os.path.isfile(os.path.join(path, MARKER))


def save_checkpoint(dst: str, cfg: ArchConfig, params, dtype: str, tokenizer,
                    source: str = "", quant: QuantPlan = NO_QUANT) -> None:
    """Writes params (orbax), config and tokenizer to `dst`, which must not exist yet.

    The standard tree is written: params in a serving form (`models.linear.serving_params`:
    panels, whole experts) are put back in the standard layout first.

    Raises:
        ValueError: `dst` already exists.
    """
    params = standard_params(params, cfg, quant)
    dst = os.path.abspath(dst)
    if os.path.exists(dst):
        raise ValueError(f"destination {dst} already exists; choose a new directory")
    os.makedirs(dst)
    ckptr = _checkpointer()
    ckptr.save(os.path.join(dst, "params"), params)
    ckptr.wait_until_finished()
    if tokenizer is not None:
        tokenizer.save_pretrained(os.path.join(dst, "tokenizer"))
    meta = {"format": FORMAT_VERSION, "dtype": dtype, "source": source,
            "arch": json.loads(cfg.to_json()), "quantization": quant.to_dict()}
    with open(os.path.join(dst, MARKER), "w") as f:
        json.dump(meta, f, indent=2)


def read_checkpoint_quant(path: str) -> QuantPlan:
    """The weight plan a checkpoint was saved with (empty: dense; older checkpoints)."""
    meta = _read_meta(path)
    return QuantPlan.from_dict(meta["quantization"]) if "quantization" in meta else QuantPlan()


def read_checkpoint_meta(path: str) -> tuple[ArchConfig, str]:
    """Returns (arch config, dtype name) of a jaxserve checkpoint."""
    meta = _read_meta(path)
    return ArchConfig.from_json(json.dumps(meta["arch"])), meta["dtype"]


def _read_meta(path: str) -> dict:
    with open(os.path.join(path, MARKER)) as f:
        try:
            meta = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{os.path.join(path, MARKER)} is not valid JSON: {e}") from None
    if meta.get("format") != FORMAT_VERSION:
        raise ValueError(f"{path}: checkpoint format {meta.get('format')} is not "
                         f"{FORMAT_VERSION}; convert the model again")
    return meta


def restore_params(path: str, abstract, shardings=None) -> dict:
    """Restores params into the shapes/dtypes of `abstract` (a ShapeDtypeStruct tree).

    Args:
        path: The checkpoint directory.
        abstract: Expected tree.
        shardings: Optional tree of shardings: each device then reads only its shard.

    Raises:
        ValueError: The params directory is missing or does not match the expected tree.
    """
    params_dir = os.path.join(os.path.abspath(path), "params")
    if not os.path.isdir(params_dir):
        raise ValueError(f"{path}: missing params/ directory of the checkpoint")
    ckptr = _checkpointer()
    try:
        stored = ckptr.metadata(params_dir).item_metadata.tree
    except Exception as e:  # orbax raises many types for corrupt checkpoints
        raise ValueError(f"{params_dir}: cannot read checkpoint metadata ({e})") from None
    stored = {jax.tree_util.keystr(kp): m for kp, m in jax.tree_util.tree_leaves_with_path(stored)}
    for kp, want in jax.tree_util.tree_leaves_with_path(abstract):
        key = jax.tree_util.keystr(kp)
        if key not in stored:
            raise ValueError(f"{params_dir}: tensor {key} is missing (written for another "
                             "architecture or by an older jaxserve; convert the model again)")
        if tuple(stored[key].shape) != tuple(want.shape):
            raise ValueError(f"{params_dir}: tensor {key} has shape "
                             f"{tuple(stored[key].shape)}, expected {tuple(want.shape)}")
    # NOTE: restore onto this process's default device, not the devices recorded at save
    # time, so a checkpoint converted on a CPU host loads on a GPU or TPU and back.
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    if shardings is None:
        shardings = jax.tree_util.tree_map(lambda _: device, abstract)
    target = jax.tree_util.tree_map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), abstract, shardings)
    try:
        return ckptr.restore(params_dir, target)
    except Exception as e:  # orbax raises many types for corrupt or mismatched trees
        raise ValueError(f"{params_dir}: cannot restore parameters ({e})") from None
