"""A BERT-style pair tokenizer from a decoder's tokenizer, for the random-weight encoders the
cross-encoder benchmark and the encoder tests build: SmolLM2's `<|im_start|>` and `<|im_end|>`
as [CLS] and [SEP] in BERT's `[CLS] a [SEP] b [SEP]` layout, token types 0 then 1."""

from __future__ import annotations

CLS_ID, SEP_ID = 1, 2  # SmolLM2's <|im_start|> and <|im_end|>


def pair_tokenizer(tokenizer, directory: str):
    """`tokenizer` (SmolLM2's) with BERT's pair layout, saved to and loaded from `directory`."""
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer

    tokenizer.save_pretrained(directory)
    tok = AutoTokenizer.from_pretrained(directory)
    cls, sep = tok.convert_ids_to_tokens([CLS_ID, SEP_ID])
    tok.backend_tokenizer.post_processor = TemplateProcessing(
        single=f"{cls} $A {sep}", pair=f"{cls} $A {sep} $B:1 {sep}:1",
        special_tokens=[(cls, CLS_ID), (sep, SEP_ID)])
    tok.cls_token, tok.sep_token = cls, sep
    tok.save_pretrained(directory)
    return AutoTokenizer.from_pretrained(directory)
