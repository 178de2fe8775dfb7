"""Builds a transformers tokenizer (with chat template) from GGUF metadata, torch-free.

transformers' own `from_pretrained(..., gguf_file=...)` reads the file through a reader
that imports torch; here the metadata comes from the `gguf` package and only the
vocabulary-to-tokenizer conversion is transformers'.
"""

from __future__ import annotations

from models.loaders.gguf_file import GGUFFile

_SPECIAL = {"bos_token": "bos_token_id", "eos_token": "eos_token_id",
            "unk_token": "unknown_token_id", "pad_token": "padding_token_id"}


def tokenizer_from_gguf(gguf: GGUFFile):
    """A `PreTrainedTokenizerFast` equal to transformers' GGUF tokenizer for the same file.

    Raises:
        ValueError: The file carries no tokenizer, or one transformers cannot convert.
    """
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            GGUF_TOKENIZER_MAPPING,
            convert_gguf_tokenizer,
        )
    except ImportError as e:  # the module moved in another transformers release
        raise ValueError(f"this transformers release cannot convert GGUF tokenizers ({e}); "
                         "load the model from a Hugging Face directory instead") from None
    from transformers import PreTrainedTokenizerFast

    if gguf.field("tokenizer.ggml.tokens") is None:
        raise ValueError(f"{gguf.path}: the GGUF file has no tokenizer (tokenizer.ggml.tokens)")
    grouped = {}
    for group, renames in GGUF_TOKENIZER_MAPPING.items():
        values = {name: gguf.field(f"tokenizer.{key}") for key, name in renames.items()}
        grouped[group] = {name: v for name, v in values.items() if v is not None}
    tokenizer_dict, config = grouped["tokenizer"], grouped["tokenizer_config"]
    if tokenizer_dict.get("tokenizer_type") == "llama":
        # llama.cpp adds BOS to a sentencepiece vocabulary that does not say otherwise.
        config.setdefault("add_bos_token", True)
    tokens = tokenizer_dict["tokens"]
    for name, key in _SPECIAL.items():
        token_id = gguf.field(f"tokenizer.ggml.{key}")
        config[name] = tokens[token_id] if token_id is not None else None
    try:
        fast, extra = convert_gguf_tokenizer(gguf.arch, tokenizer_dict)
    except (ValueError, KeyError) as e:
        raise ValueError(f"{gguf.path}: cannot build the tokenizer ({e})") from None
    return PreTrainedTokenizerFast(tokenizer_object=fast, **config, **extra)
