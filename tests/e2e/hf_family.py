"""Shared by the new-family engine tests: prompts longer than the tiny models' windows, a
tiny transformers model built and saved beside SmolLM2's tokenizer, and its greedy tokens."""

from __future__ import annotations

PROMPTS = [
    "Paged attention stores the key and value cache in fixed-size blocks, and the "
    "scheduler decides which requests advance",
    "Once upon a time, in a village by the sea, there lived",
    "The three primary colors are red, yellow and blue; mixing two of them gives",
]
# SmolLM2's vocabulary (49152, the tokenizer's); hidden 64, heads of 16; an untied LM head
# (a tied random one repeats one token).
TINY = dict(vocab_size=49152, hidden_size=64, intermediate_size=96, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1,
            pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
# Two layers, 4/2 heads of 16, SmolLM2's vocabulary: the families built by the pooling
# oracle and LoRA family tests (each adds its family's own settings; ties left to the
# family's default).
SMALL = dict(vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
             initializer_range=0.1)
# Gated DeltaNet layers as tests/models/test_numerics.py's (2 key heads, each serving 2 of the
# 4 value heads); NOTE: at its initializer_range 0.05 the tiny models are not chaotic (one
# float32 ulp in the weights stays below 1e-5 in the logits), so greedy ties do not flip.
LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
              linear_value_head_dim=8, linear_conv_kernel_dim=4, initializer_range=0.05,
              tie_word_embeddings=False)


def qwen_hybrid_norm_center(name: str) -> float:
    """Where Qwen3.5's and Qwen3-Next's norms are drawn around (`build_hf_model`): their
    `1 + weight` RMSNorms at 0, the linear layers' plain gated norm at 1."""
    return 1.0 if "linear_attn.norm" in name else 0.0


def build_hf_model(config_cls: str, model_cls: str, config: dict, tokenizer, directory: str,
                   norm_center):
    """A float32 transformers model of `config` (eager attention), its norms drawn around
    `norm_center` (0 for Gemma's `1 + weight`, 1 elsewhere; or a function of the norm
    parameter's name, for models mixing both kinds) so they matter, saved as safetensors
    into `directory` with `tokenizer`."""
    import torch
    import transformers

    cfg = getattr(transformers, config_cls)(**config, attn_implementation="eager")
    torch.manual_seed(0)
    hf = getattr(transformers, model_cls)(cfg).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                center = norm_center(name) if callable(norm_center) else norm_center
                p.copy_(center + 0.3 * torch.randn(p.shape, generator=gen))
    hf.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return hf


def hf_greedy(hf, ids: list[int], max_tokens: int) -> list[int]:
    """transformers' greedy continuation of `ids`, exactly `max_tokens` long."""
    import torch

    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False,
                          min_new_tokens=max_tokens, pad_token_id=0)
    return out[0, len(ids):].tolist()


def check_engine_greedy(llm, hf, tokenizer, ids: list[list[int]], max_tokens: int) -> None:
    """The engine's greedy tokens for every prompt (batched) equal transformers', and are
    not one token repeated."""
    from jaxserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": x} for x in ids], params, use_tqdm=False)
    for prompt_ids, out in zip(ids, outs, strict=True):
        ours = out.outputs[0].token_ids
        assert len(set(ours)) > 1  # not a degenerate repeat
        assert ours == hf_greedy(hf, prompt_ids, max_tokens), tokenizer.decode(ours)


def long_decode(engine, ids: list[int], max_tokens: int) -> dict:
    """Runs one greedy request of `max_tokens` alone to its end and watches its pages after
    every step (the "pages go back" tests of the hybrid KV cache's families).

    Returns:
        {"most": {group: most pages its table held (the null page not counted)},
         "first_kept": {group: the latest index of its table's first page kept},
         "used": the pool's most used pages, "tokens": the request's output tokens}.
    """
    from jaxserve import SamplingParams

    kv = engine.kv
    engine.add_request("long", {"prompt_token_ids": ids},
                       SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    groups = range(kv.num_groups)
    seen = {"most": dict.fromkeys(groups, 0), "first_kept": dict.fromkeys(groups, 0),
            "used": 0, "tokens": None}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen["tokens"] = out.outputs[0].token_ids
        if not kv.has_request("long"):
            continue
        for g in groups:
            table = kv.page_ids("long", g)
            seen["most"][g] = max(seen["most"][g], sum(1 for page in table if page != 0))
            kept = next((i for i, page in enumerate(table) if page != 0), 0)
            seen["first_kept"][g] = max(seen["first_kept"][g], kept)
        seen["used"] = max(seen["used"], kv.pool.num_used_pages)
    return seen
