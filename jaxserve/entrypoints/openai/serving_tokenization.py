"""Tokenizer endpoints and the model list, answered without the engine thread (parsing and
tokenizing run in a lane of `PrepareLanes`, off the event loop), with a cap on the tokens."""

from __future__ import annotations

from jaxserve.entrypoints.openai.errors import OpenAIError, parse_body
from jaxserve.entrypoints.openai.protocol import DetokenizeRequest, TokenizeRequest
from jaxserve.entrypoints.openai.serving_base import OpenAIServingBase
from jaxserve.entrypoints.openai.serving_chat import render_messages
from jaxserve.entrypoints.openai.serving_engine import now


def _text_chars(content) -> int:
    if isinstance(content, list):
        return sum(len(getattr(p, "text", None) or "") for p in content)
    return len(content or "")


class OpenAIServingTokenization(OpenAIServingBase):
    """Tokenizer endpoints and the model list."""

    @property
    def max_tokens(self) -> int:
        """Most token ids `/tokenize` returns and `/detokenize` takes."""
        return self.limits.max_tokenize_tokens or 4 * self.max_model_len

    def _too_many(self, what: str, count: int, param: str) -> OpenAIError:
        return OpenAIError(400, f"{param}: {what} {count}, more than the limit of "
                                f"{self.max_tokens} tokens (--max-tokenize-tokens)", param)

    async def tokenize(self, body) -> dict:
        """`{"count", "max_model_len", "tokens", "token_strs"}` of a prompt or messages
        (`token_strs` null unless `return_token_strs`, as vLLM).

        Raises:
            OpenAIError: 400 for a bad body or more than `max_tokens` tokens; 429 when the
                heavy lane is full.
        """
        heavy = self.lanes.is_heavy(len(body)) if isinstance(body, (bytes, str)) else False
        result = await self.lanes.run(heavy, self._tokenize, body, heavy)
        if callable(result):  # the request's own chat template: render it in the heavy lane
            result = await self.lanes.run(True, result)
        return result

    def _tokenize(self, body, heavy: bool = True):
        req = parse_body(body, TokenizeRequest)
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise OpenAIError(400, "give exactly one of prompt and messages", "prompt")
        if req.prompt is not None:
            # NOTE: counting tokens of a text longer than the context is a fair question,
            # up to max_tokens; a text that surely holds more is refused untokenized.
            self._check_chars(len(req.prompt), "prompt")
            ids = self.encode(req.prompt, add_special_tokens=req.add_special_tokens,
                              check=False)
            return self._answer(req, ids, "prompt")
        if req.continue_final_message and req.add_generation_prompt:
            raise OpenAIError(400, "continue_final_message needs "
                                   "add_generation_prompt=false", "messages")
        self._check_chars(sum(_text_chars(m.content) for m in req.messages), "messages")

        def render() -> dict:
            ids = render_messages(self.tokenizer, req.messages, chat_template=req.chat_template,
                                  add_generation_prompt=req.add_generation_prompt,
                                  continue_final_message=req.continue_final_message,
                                  tools=req.tools, template_kwargs=req.chat_template_kwargs)
            return self._answer(req, ids, "messages")

        return render if req.chat_template is not None and not heavy else render()

    def _check_chars(self, chars: int, param: str) -> None:
        """400 for text longer than `max_tokens` tokens of the longest vocabulary entry can
        hold: it surely tokenizes to more, and tokenizing megabytes costs seconds and
        hundreds of MB."""
        per_token = self.limits.max_chars_per_token
        if per_token and chars > per_token * self.max_tokens:
            raise OpenAIError(400, f"{param}: {chars} characters are more than the limit of "
                                   f"{self.max_tokens} tokens can hold "
                                   "(--max-tokenize-tokens)", param)

    def _answer(self, req, ids: list[int], param: str) -> dict:
        if len(ids) > self.max_tokens:
            raise self._too_many("tokenizes to", len(ids), param)
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids,
                "token_strs": self.tokenizer.convert_ids_to_tokens(ids)
                if req.return_token_strs else None}

    async def detokenize(self, body) -> dict:
        """`{"prompt": text}` of token ids (a 400 for ids outside the vocabulary or more
        than `max_tokens` of them)."""
        heavy = self.lanes.is_heavy(len(body)) if isinstance(body, (bytes, str)) else False
        return await self.lanes.run(heavy, self._detokenize, body)

    def _detokenize(self, body) -> dict:
        req = parse_body(body, DetokenizeRequest)
        self.check_model(req.model)
        if len(req.tokens) > self.max_tokens:
            raise self._too_many("holds", len(req.tokens), "tokens")
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
        """OpenAI's model list: one card per served name (no file system paths), then one
        per LoRA adapter (`parent`: its base model; `root`: its directory)."""
        return self.serving_models.cards(self.max_model_len, now(), self.llm.quantization)
