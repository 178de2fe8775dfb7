"""Test helpers: teacher-forced forwards of one prompt through a model's paged KV cache."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.utils import cdiv
from pallas_kernels import AttentionMetadata

# The tiny models of the quantized-checkpoint tests (K = 128 or 256: every group size, 32,
# 64, 128 or channel-wise, divides it) and their prompt.
QUANT_LLAMA = dict(model_type="llama", vocab_size=128, hidden_size=128, intermediate_size=256,
                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   max_position_embeddings=64, initializer_range=0.05,
                   tie_word_embeddings=False)
QUANT_QWEN3_MOE = dict(QUANT_LLAMA, model_type="qwen3_moe", head_dim=32,
                       moe_intermediate_size=128, num_experts=4, num_experts_per_tok=2,
                       decoder_sparse_step=1, norm_topk_prob=True)
QUANT_IDS = np.random.default_rng(0).integers(0, 128, 12).tolist()

# One jitted step function per model (keyed by id; the model is kept alive beside it).
_STEP_FNS: dict[int, tuple[object, object]] = {}


def _step_fn(model):
    entry = _STEP_FNS.get(id(model))
    if entry is None or entry[0] is not model:

        def step(params, input_ids, positions, kv_pages, md):
            kv_pages, hidden = model.forward(params, input_ids, positions, kv_pages, md)
            return kv_pages, model.compute_logits(params, hidden)

        entry = (model, jax.jit(step))
        _STEP_FNS[id(model)] = entry
    return entry[1]


def _round_up(n: int, m: int) -> int:
    return cdiv(n, m) * m


def forward_logits(model, token_ids: Sequence[int], page_size: int = 16,
                   chunks: Sequence[int] | None = None, seed: int = 0) -> np.ndarray:
    """Teacher-forced logits of a prompt, run through the paged KV cache.

    The prompt's pages are a shuffled, non-contiguous pick from a pool larger than needed
    (page 0 stays the null page); a model with linear-attention layers also gets state
    pools of a few slots and the prompt a random one of them (slot 0 stays null). Each
    chunk is one step whose token axis is padded to a common bucket (padded tokens write
    the null page), beside an empty padded request (state slot 0), so chunked prefill,
    decode-sized steps and padding all go through the real paths. Every step has the same
    (padded) size, so the chunkings of one prompt share a compiled step.

    Args:
        model: A `models.model.Model`.
        token_ids: The prompt.
        page_size: Slots per page.
        chunks: Token counts of consecutive steps (summing to the prompt length); None runs
            the whole prompt in one step.
        seed: Seed of the page shuffle.

    Returns:
        f32[len(token_ids), vocab_size] logits, row t predicting token t + 1.
    """
    ids = np.asarray(token_ids, np.int32)
    total = len(ids)
    chunks = [total] if chunks is None else list(chunks)
    if sum(chunks) != total or min(chunks) <= 0:
        raise ValueError(f"chunks {chunks} do not split a {total}-token prompt")
    # NOTE: every step is padded to the whole prompt's bucket, whatever the chunking: one
    # compiled step per model and prompt length (a compile costs seconds here, a padded
    # token next to nothing), and short chunks run beside more padding.
    bucket = _round_up(total, 8)

    rng = np.random.default_rng(seed)
    pages_needed = cdiv(total, page_size)
    num_pages = 2 * pages_needed + 3  # spare pages stay unused
    page_ids = rng.permutation(np.arange(1, num_pages))[:pages_needed].astype(np.int32)
    max_pages_per_seq = pages_needed + 1  # a trailing null entry pads the table
    block_tables = np.zeros((2, max_pages_per_seq), np.int32)  # row 1: an empty request
    block_tables[0, :pages_needed] = page_ids

    step = _step_fn(model)
    kv_pages = jnp.zeros(model.kv_pages_shape(num_pages, page_size), model.dtype)
    state_slots = None
    if model.has_linear_attention:  # the state pools, the prompt's slot a random one
        num_slots = 5  # slot 0 is null; the others stay zero
        kv_pages = model.empty_cache(num_pages, page_size, num_slots, model.dtype)
        state_slots = jnp.asarray([rng.integers(1, num_slots), 0], jnp.int32)
    out = []
    start = 0
    for n in chunks:
        end = start + n
        positions = np.zeros(bucket, np.int32)
        positions[:n] = np.arange(start, end)
        input_ids = np.zeros(bucket, np.int32)
        input_ids[:n] = ids[start:end]
        slots = np.zeros(bucket, np.int32)  # padded tokens: slot 0 of the null page
        slots[:n] = page_ids[positions[:n] // page_size] * page_size + positions[:n] % page_size
        md = AttentionMetadata(
            slot_mapping=jnp.asarray(slots),
            block_tables=jnp.asarray(block_tables),
            kv_lens=jnp.asarray([end, 0], jnp.int32),
            cu_q_lens=jnp.asarray([0, n, n], jnp.int32),
            state_slots=state_slots,
        )
        kv_pages, logits = step(model.params, jnp.asarray(input_ids), jnp.asarray(positions),
                                kv_pages, md)
        out.append(np.asarray(logits[:n], np.float32))
        start = end
    return np.concatenate(out)


def hf_logits(hf_model, token_ids: Sequence[int]) -> np.ndarray:
    """transformers' teacher-forced logits f32[T, vocab] of one prompt (no cache)."""
    import torch

    with torch.no_grad():
        out = hf_model(input_ids=torch.tensor([list(token_ids)], dtype=torch.long),
                       use_cache=False)
    return out.logits[0].float().numpy()


def dequantized_params(params: dict) -> dict:
    """The float params tree holding what a quantized tree's codes mean, dequantized by the
    row-form NumPy oracle (`models.quant.dequantize_rows`): each quantized module's leaves
    become its `kernel` (stacked axes kept; the routed experts' stacks a float stack), a
    quantized embedding its `embedding` [vocab, hidden]."""
    from models.quant import QuantFormat, dequantize_rows

    def kernels(leaves: dict) -> np.ndarray:  # f32[..., K, N] of leaves [..., K', N]
        fmt = QuantFormat("q4" if "zeros" in leaves else "q8")
        lead = leaves["qweight"].shape[:-2]
        flat = {k: np.asarray(v).reshape(-1, *v.shape[-2:]) for k, v in leaves.items()}
        out = [dequantize_rows(fmt, {k: v[i].T for k, v in flat.items()}).T
               for i in range(flat["qweight"].shape[0])]
        return np.stack(out).reshape(*lead, *out[0].shape)

    def walk(tree: dict, name: str = "") -> dict:
        if "qweight" in tree:
            w = kernels({k: tree[k] for k in ("qweight", "scales", "zeros") if k in tree})
            if name.split("/")[-1] == "embed_tokens":
                return {"embedding": w.T}
            if "experts" in name.split("/"):
                return w
            return {"kernel": w, **({"bias": tree["bias"]} if "bias" in tree else {})}
        return {k: walk(v, f"{name}/{k}") if isinstance(v, dict) else v
                for k, v in tree.items()}

    return walk(params)  # the leaves say their format (q4 has zeros)


def write_gguf_header(path: str, arch: str, fields: dict, tensors: dict | None = None) -> str:
    """Writes a GGUF file of `arch` at `path` with metadata `fields` ({key suffix: str,
    float or int value}, each stored as `{arch}.{key}`) and `tensors` ({name: array});
    returns `path`."""
    import gguf

    w = gguf.GGUFWriter(path, arch)
    for k, v in fields.items():
        add = (w.add_string if isinstance(v, str) else w.add_float32 if isinstance(v, float)
               else w.add_uint32)
        add(f"{arch}.{k}", v)
    for name, arr in (tensors or {}).items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def forward_routing(model, token_ids: Sequence[int], page_size: int = 16) -> np.ndarray:
    """i32[T, num_layers, top_k]: the experts each token of a prompt is routed to in every
    layer (`Model.forward(routing=True)`), the prompt run whole in one step."""
    ids = np.asarray(token_ids, np.int32)
    n = len(ids)
    pages = cdiv(n, page_size)
    block_tables = np.zeros((1, pages + 1), np.int32)
    block_tables[0, :pages] = np.arange(1, pages + 1)
    positions = np.arange(n, dtype=np.int32)
    md = AttentionMetadata(
        slot_mapping=jnp.asarray(page_size + positions),  # pages 1.. in order
        block_tables=jnp.asarray(block_tables),
        kv_lens=jnp.asarray([n], jnp.int32),
        cu_q_lens=jnp.asarray([0, n], jnp.int32),
    )
    kv_pages = jnp.zeros(model.kv_pages_shape(pages + 2, page_size), model.dtype)
    _, _, routed = jax.jit(functools.partial(model.forward, routing=True))(
        model.params, jnp.asarray(ids), jnp.asarray(positions), kv_pages, md)
    return np.asarray(routed)


def set_quantization_config(directory: str, quant_config: dict | None) -> None:
    """Writes `quant_config` as the `quantization_config` of `directory`'s config.json (a
    saved transformers model's; None leaves it as it is)."""
    import json
    import os

    if quant_config is None:
        return
    path = os.path.join(directory, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = quant_config
    with open(path, "w") as f:
        json.dump(cfg, f)


def checkpoint_variant(src: str, dst, tensors=None, config=None, lib: str = "numpy") -> str:
    """A copy of quantized checkpoint `src` at `dst` with `tensors(dict)` applied to its
    tensors (NumPy arrays, or torch tensors with `lib="torch"`: bfloat16 files) and
    `config(quantization_config)` to its quantization config (a bad file for a refusal
    test)."""
    import importlib
    import json
    import os
    import shutil

    io = importlib.import_module(f"safetensors.{lib}")
    load_file, save_file = io.load_file, io.save_file

    shutil.copytree(src, dst)
    file = os.path.join(dst, "model.safetensors")
    if tensors is not None:
        t = load_file(file)
        tensors(t)
        save_file(t, file, metadata={"format": "pt"})
    if config is not None:
        with open(os.path.join(dst, "config.json")) as f:
            cfg = json.load(f)
        config(cfg["quantization_config"])
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump(cfg, f)
    return str(dst)
