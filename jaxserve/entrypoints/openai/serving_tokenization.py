"""Tokenizer endpoints and the model list, answered without the engine thread (parsing and
tokenizing run in a worker thread, off the event loop)."""

from __future__ import annotations

import asyncio

from jaxserve.entrypoints.openai.protocol import DetokenizeRequest, TokenizeRequest
from jaxserve.entrypoints.openai.serving_chat import render_messages
from jaxserve.entrypoints.openai.serving_engine import (
    OpenAIError,
    OpenAIServingBase,
    now,
    parse_body,
)


class OpenAIServingTokenization(OpenAIServingBase):
    """Tokenizer endpoints and the model list."""

    async def tokenize(self, body) -> dict:
        """`{"count", "max_model_len", "tokens"[, "token_strs"]}` of a prompt or messages."""
        return await asyncio.to_thread(self._tokenize, body)

    def _tokenize(self, body) -> dict:
        req = parse_body(body, TokenizeRequest)
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise OpenAIError(400, "give exactly one of prompt and messages", "prompt")
        if req.prompt is not None:
            # NOTE: counting tokens of a text longer than the context is a fair question,
            # so no length check; the body-size limit bounds the work.
            ids = self.encode(req.prompt, add_special_tokens=req.add_special_tokens,
                              check=False)
        else:
            if req.continue_final_message and req.add_generation_prompt:
                raise OpenAIError(400, "continue_final_message needs "
                                       "add_generation_prompt=false", "messages")
            ids = render_messages(self.tokenizer, req.messages, chat_template=req.chat_template,
                                  add_generation_prompt=req.add_generation_prompt,
                                  continue_final_message=req.continue_final_message,
                                  tools=req.tools, template_kwargs=req.chat_template_kwargs)
        out = {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids}
        if req.return_token_strs:
            out["token_strs"] = self.tokenizer.convert_ids_to_tokens(ids)
        return out

    async def detokenize(self, body) -> dict:
        """`{"prompt": text}` of token ids (a 400 for ids outside the vocabulary)."""
        return await asyncio.to_thread(self._detokenize, body)

    def _detokenize(self, body) -> dict:
        req = parse_body(body, DetokenizeRequest)
        self.check_model(req.model)
        vocab = self.vocab_size or 2**31
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise OpenAIError(400, f"tokens hold ids outside [0, {vocab}): {bad[:5]}", "tokens")
        return {"prompt": self.tokenizer.decode(req.tokens)}

    def tokenizer_info(self) -> dict:
        """The tokenizer's configuration (class, special tokens, chat template, limits)."""
        tok = self.tokenizer
        info = {"tokenizer_class": type(tok).__name__, "vocab_size": self.vocab_size,
                "model_max_length": self.max_model_len,
                "chat_template": getattr(tok, "chat_template", None)}
        for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
            info[name] = getattr(tok, name, None)
        info["added_special_tokens"] = list(getattr(tok, "all_special_tokens", []))
        return info

    def models(self) -> dict:
        """OpenAI's model list: one card per served name (no file system paths)."""
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": now(), "owned_by": "jaxserve",
             "root": self.model_name, "parent": None, "max_model_len": self.max_model_len}
            for name in self.served_model_names]}
