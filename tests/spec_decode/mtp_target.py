"""A tiny random DeepSeek-V3 with one MTP layer written into its checkpoint, and a torch
reference of the MTP layer's proposals written from vLLM's `DeepSeekMTP` (transformers'
DeepSeek-V3 creates no MTP tensors, so the test writes them; its decoder layer is the oracle
of the MTP block)."""

from __future__ import annotations

import json
import os

import numpy as np
from safetensors.numpy import load_file, save_file

from models.loaders.safetensors_dir import SafetensorsDir
from tests.e2e.hf_family import build_hf_model
from tests.e2e.test_family_conformance import family

NUM_LAYERS = 2  # the conformance row's: layer 0 dense, layer 1 sparse; the MTP layer is 2


def write_target(directory: str, tokenizer, mtp: bool = True, own_head: bool = True,
                 **overrides):
    """The conformance table's tiny DeepSeek-V3 saved into `directory`; with `mtp`, layer 2
    (a copy of sparse layer 1's tensors, perturbed) and the MTP tensors (`enorm`, `hnorm`,
    `eh_proj`, `shared_head.norm`, with `own_head` `shared_head.head`) added to its file,
    and `num_nextn_predict_layers` 1 in its config (0 without); `overrides` change the row's
    transformers config (a smaller `vocab_size`, say)."""
    row = family("deepseek_v3")
    hf = build_hf_model(row.config_cls, row.model_cls, {**row.config, **overrides}, tokenizer,
                        directory, row.norm_center)
    with open(os.path.join(directory, "config.json")) as f:
        config = json.load(f)
    config["num_nextn_predict_layers"] = int(mtp)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    if not mtp:
        return hf
    src = SafetensorsDir(directory)
    rng = np.random.default_rng(7)
    h, v = config["hidden_size"], config["vocab_size"]
    src_prefix, prefix = f"model.layers.{NUM_LAYERS - 1}.", f"model.layers.{NUM_LAYERS}."
    out = {}
    for name in src.names():
        if name.startswith(src_prefix):
            value = src.get(name).astype(np.float32)
            noise = rng.standard_normal(value.shape).astype(np.float32)
            out[prefix + name[len(src_prefix):]] = value + 0.3 * np.abs(value).mean() * noise
    norm = lambda: (1.0 + 0.3 * rng.standard_normal(h)).astype(np.float32)  # noqa: E731
    out[prefix + "enorm.weight"], out[prefix + "hnorm.weight"] = norm(), norm()
    out[prefix + "shared_head.norm.weight"] = norm()
    out[prefix + "eh_proj.weight"] = (rng.standard_normal((h, 2 * h)) * 0.15).astype(np.float32)
    if own_head:
        out[prefix + "shared_head.head.weight"] = (
            rng.standard_normal((v, h)) * 0.1).astype(np.float32)
    # NOTE: into the model's one file: transformers reads no other without an index.
    path = os.path.join(directory, "model.safetensors")
    save_file({**load_file(path), **out}, path, metadata={"format": "pt"})
    return hf


def mtp_tensors(directory: str) -> dict[str, np.ndarray]:
    """The MTP layer's own tensors (short names: "enorm", "eh_proj", "shared_head.head", ...)."""
    src, prefix = SafetensorsDir(directory), f"model.layers.{NUM_LAYERS}."
    names = ("enorm", "hnorm", "eh_proj", "shared_head.norm", "shared_head.head")
    return {n: src.get(f"{prefix}{n}.weight") for n in names
            if f"{prefix}{n}.weight" in src.names()}


def reference_block(directory: str):
    """transformers' decoder layer 2 of the checkpoint (the MTP block), loaded by reading the
    directory as a three-layer DeepSeek-V3."""
    import transformers

    model = transformers.DeepseekV3ForCausalLM.from_pretrained(
        directory, num_hidden_layers=NUM_LAYERS + 1, attn_implementation="eager")
    return model.eval().model


def _rms(x, w, eps):
    return w * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def target_states(hf, tokens: list[int]) -> np.ndarray:
    """transformers' final hidden states (after the final norm) at every position: [T, H]."""
    import torch

    with torch.no_grad():
        return hf.model(torch.tensor([tokens])).last_hidden_state[0].numpy()


def reference_proposals(hf, ref, tensors, g: np.ndarray, tokens: list[int], num: int,
                        base: int, k: int) -> list[tuple[int, float]]:
    """The MTP layer's k greedy proposals for a request of `tokens[:num]` whose head attends
    from position `base`: each with the margin of its top logit (vLLM's math, module
    docstring of `models.mtp`), on transformers' target states `g` (`target_states`)."""
    import torch

    eps = hf.config.rms_norm_eps
    table = hf.get_input_embeddings().weight.detach().numpy()
    head = tensors.get("shared_head.head", hf.lm_head.weight.detach().numpy())
    pos = np.arange(base, num - 1)
    embeds, hid = table[tokens[base + 1:num]], g[base:num - 1]
    got = []
    for step in range(k):
        e = np.where((pos == 0)[:, None], 0.0, embeds)
        x = np.concatenate([_rms(e, tensors["enorm"], eps), _rms(hid, tensors["hnorm"], eps)],
                           -1) @ tensors["eh_proj"].T
        t = len(pos)
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        xt = torch.tensor(x[None], dtype=torch.float32)
        pid = torch.tensor(pos[None])
        with torch.no_grad():
            y = ref.layers[NUM_LAYERS](xt, attention_mask=mask, position_ids=pid,
                                       position_embeddings=ref.rotary_emb(xt, pid))
        y = (y[0] if isinstance(y, tuple) else y)[0].numpy()  # [t, H] prenorm
        logits = _rms(y[-1], tensors["shared_head.norm"], eps) @ head.T
        top2 = np.sort(logits)[-2:]
        token = int(np.argmax(logits))
        got.append((token, float(top2[1] - top2[0])))
        embeds = np.concatenate([embeds, table[[token]]])
        hid = np.concatenate([hid, y[-1:]])
        pos = np.append(pos, num - 1 + step)
    return got
