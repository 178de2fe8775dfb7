"""A tiny random Qwen3-Next (or Qwen3.5) whose checkpoint carries an MTP layer (`mtp.*`,
written by the test: transformers' models create none and skip them on load), and a torch
reference of the layer's proposals written from vLLM's `Qwen3NextMTP` / `Qwen3_5MTP`
(transformers' full-attention decoder layer as the oracle of the MTP block)."""

from __future__ import annotations

import json
import os
import tempfile

import numpy as np
from safetensors.numpy import load_file, save_file

from models.loaders.safetensors_dir import SafetensorsDir
from tests.e2e.hf_family import build_hf_model
from tests.e2e.test_family_conformance import family

# Per conformance row: (transformers' modeling module, its decoder layer class, its
# causal LM class, the config key counting MTP layers). Layer 1 is full attention in both
# rows (Qwen3-Next's: Gated DeltaNet then attention; Qwen3.5's: linear, full, linear).
FAMILIES = {
    "qwen3_next": ("qwen3_next.modeling_qwen3_next", "Qwen3NextDecoderLayer",
                   "Qwen3NextForCausalLM", "num_nextn_predict_layers"),
    "qwen3_5": ("qwen3_5.modeling_qwen3_5", "Qwen3_5DecoderLayer", "Qwen3_5ForCausalLM",
                "mtp_num_hidden_layers"),
}
ATTENTION_LAYER = 1


def _family(hf) -> tuple:
    """(modeling module, decoder layer class, causal LM class, count key) of `hf`'s family."""
    import importlib

    name = "qwen3_next" if hf.config.model_type == "qwen3_next" else "qwen3_5"
    module, layer, lm, key = FAMILIES[name]
    module = importlib.import_module(f"transformers.models.{module}")
    return module, getattr(module, layer), getattr(module, lm), key


def _full_attention_config(hf):
    """The target's config with every layer full attention (transformers builds a decoder
    layer's mixer from `layer_types[layer_idx]`)."""
    fields = hf.config.to_dict()
    fields["layer_types"] = ["full_attention"] * hf.config.num_hidden_layers
    fields.pop("_attn_implementation", None)
    fields.pop("_experts_implementation", None)
    return type(hf.config)(**fields, attn_implementation="eager",
                           experts_implementation="eager")


def _mtp_block(hf):
    """The MTP layer: transformers' decoder layer 0 of a full-attention config (its MLP is
    the target's layer 0's kind, as vLLM builds `mtp.layers.0`), holding the target's
    full-attention layer's weights perturbed."""
    import torch

    layer_cls = _family(hf)[1]
    layer = layer_cls(_full_attention_config(hf), 0).to(torch.float32).eval()
    layer.load_state_dict(hf.model.layers[ATTENTION_LAYER].state_dict())
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.3 * p.abs().mean() * torch.randn(p.shape, generator=gen))
    return layer


def _checkpoint_names(hf, block) -> dict[str, np.ndarray]:
    """`block`'s tensors as the checkpoint names them (`mtp.layers.0.*`): saved by
    transformers as layer 0 of a one-layer full-attention model (its own on-disk layout)."""
    cfg = _full_attention_config(hf)
    # NOTE: a vocabulary of 8: the layer's tensors are all it saves that are read.
    cfg.num_hidden_layers, cfg.layer_types, cfg.vocab_size = 1, ["full_attention"], 8
    one = _family(hf)[2](cfg).eval()
    one.model.layers[0] = block
    with tempfile.TemporaryDirectory() as tmp:
        one.save_pretrained(tmp, safe_serialization=True)
        src = SafetensorsDir(tmp)
        return {"mtp.layers.0." + n.removeprefix("model.layers.0."): src.get(n)
                for n in src.names() if n.startswith("model.layers.0.")}


def write_target(directory: str, tokenizer, name: str = "qwen3_next", mtp: bool = True):
    """The conformance table's tiny `name` (a `FAMILIES` row) saved into `directory`; with
    `mtp`, the MTP layer (`_mtp_block`) and its tensors (`pre_fc_norm_embedding`,
    `pre_fc_norm_hidden`, `norm`: zero-centred, `fc`) added to its file and the family's
    count key 1 in its config (0 without).

    Returns:
        (transformers' target, the MTP block as a transformers decoder layer).
    """
    row = family(name)
    hf = build_hf_model(row.config_cls, row.model_cls, row.config, tokenizer, directory,
                        row.norm_center)
    with open(os.path.join(directory, "config.json")) as f:
        config = json.load(f)
    config[FAMILIES[name][3]] = int(mtp)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    if not mtp:
        return hf, None
    block = _mtp_block(hf)
    out = _checkpoint_names(hf, block)
    rng = np.random.default_rng(7)
    h = config["hidden_size"]
    norm = lambda: (0.3 * rng.standard_normal(h)).astype(np.float32)  # noqa: E731 (1 + w)
    out["mtp.pre_fc_norm_embedding.weight"] = norm()
    out["mtp.pre_fc_norm_hidden.weight"] = norm()
    out["mtp.norm.weight"] = norm()
    out["mtp.fc.weight"] = (rng.standard_normal((h, 2 * h)) * 0.15).astype(np.float32)
    # NOTE: into the model's one file: transformers reads no other without an index.
    path = os.path.join(directory, "model.safetensors")
    save_file({**load_file(path), **out}, path, metadata={"format": "pt"})
    return hf, block


def mtp_tensors(directory: str) -> dict[str, np.ndarray]:
    """The MTP layer's own tensors by short name ("fc", "norm", ...)."""
    src = SafetensorsDir(directory)
    names = ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "fc", "norm")
    return {n: src.get(f"mtp.{n}.weight") for n in names}


def _rms(x, w, eps):
    """Qwen's zero-centred RMSNorm: `1 + weight`."""
    return (1.0 + w) * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def target_states(hf, tokens: list[int]) -> np.ndarray:
    """transformers' final hidden states (after the final norm) at every position: [T, H]."""
    import torch

    with torch.no_grad():
        return hf.model(torch.tensor([tokens]), use_cache=False).last_hidden_state[0].numpy()


def reference_proposals(hf, block, tensors, g: np.ndarray, tokens: list[int], num: int,
                        base: int, k: int) -> list[tuple[int, float]]:
    """The MTP layer's k greedy proposals for a request of `tokens[:num]` whose head attends
    from position `base`, each with the margin of its top logit, on transformers' target
    states `g` (`target_states`): vLLM's `Qwen3NextMTP` (no position masked; the target's LM
    head; a later step reads the layer's normed output)."""
    import torch

    eps = hf.config.rms_norm_eps
    table = hf.get_input_embeddings().weight.detach().numpy()
    head = hf.lm_head.weight.detach().numpy()
    pos = np.arange(base, num - 1)
    embeds, hid = table[tokens[base + 1:num]], g[base:num - 1]
    got = []
    for step in range(k):
        x = np.concatenate([_rms(embeds, tensors["pre_fc_norm_embedding"], eps),
                            _rms(hid, tensors["pre_fc_norm_hidden"], eps)], -1) @ tensors["fc"].T
        t = len(pos)
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        xt = torch.tensor(x[None], dtype=torch.float32)
        pid = torch.tensor(pos[None])
        with torch.no_grad():
            y = block(xt, attention_mask=mask, position_ids=pid,
                      position_embeddings=hf.model.rotary_emb(xt, pid))
        y = (y[0] if isinstance(y, tuple) else y)[0].numpy()  # [t, H] prenorm
        normed = _rms(y[-1:], tensors["norm"], eps)  # [1, H]
        logits = (normed @ head.T)[0]
        top2 = np.sort(logits)[-2:]
        token = int(np.argmax(logits))
        got.append((token, float(top2[1] - top2[0])))
        embeds = np.concatenate([embeds, table[[token]]])
        hid = np.concatenate([hid, normed])
        pos = np.append(pos, num - 1 + step)
    return got
