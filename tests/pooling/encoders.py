"""Tiny random BERT / XLM-RoBERTa / ModernBERT models for the encoder tests, saved by
transformers beside SmolLM2's tokenizer made a pair tokenizer (`<|im_start|>` as CLS,
`<|im_end|>` as SEP, BERT's `[CLS] a [SEP] b [SEP]` layout with token types 0 then 1)."""

from __future__ import annotations

import os

# Small shapes with SmolLM2's vocabulary: a 64-token context (RoBERTa's offset of 1 past its
# padding index 0 on top), 2 layers, 4 heads of 16.
ENCODER_SHAPES = dict(vocab_size=49152, hidden_size=64, num_hidden_layers=2,
                      num_attention_heads=4, intermediate_size=96, initializer_range=0.1)
# The engines' sizes: every prompt whole in a step (chunked prefill is off for encoders).
ENCODER_ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=128, max_model_len=64,
                      num_kv_blocks=64, warmup=False)


def save_encoder(root: str, name: str, arch: str, tokenizer_dir: str, seed: int = 0,
                 **overrides):
    """A transformers model of class `arch` (random weights, float32, eager attention) saved
    with the pair tokenizer under `root/name`; returns (model, directory)."""
    import torch
    import transformers

    family = "roberta" if arch.startswith("XLMRoberta") else \
        "modernbert" if arch.startswith("ModernBert") else "bert"
    config_cls = {"roberta": transformers.XLMRobertaConfig, "bert": transformers.BertConfig,
                  "modernbert": transformers.ModernBertConfig}[family]
    extra = {"roberta": dict(pad_token_id=0, max_position_embeddings=65),
             "bert": dict(max_position_embeddings=64),
             "modernbert": dict(max_position_embeddings=64, local_attention=8,
                                global_attn_every_n_layers=2, pad_token_id=0, bos_token_id=1,
                                eos_token_id=2, cls_token_id=1, sep_token_id=2)}[family]
    config = config_cls(**ENCODER_SHAPES, **{**extra, **overrides}, attn_implementation="eager")
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config).to(torch.float32).eval()
    directory = os.path.join(root, name)
    model.save_pretrained(directory, safe_serialization=True)
    transformers.AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(directory)
    return model, directory
