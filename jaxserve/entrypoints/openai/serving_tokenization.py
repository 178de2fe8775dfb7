"""`POST /tokenize`, `POST /detokenize` and `GET /v1/models`: answered without the engine thread."""

from __future__ import annotations

from jaxserve.entrypoints.openai.protocol import DetokenizeRequest, TokenizeRequest
from jaxserve.entrypoints.openai.serving_chat import render_messages
from jaxserve.entrypoints.openai.serving_engine import (
    OpenAIError,
    OpenAIServing,
    now,
    parse_body,
)


class OpenAIServingTokenization(OpenAIServing):
    """Tokenizer endpoints and the model list."""

    def tokenize(self, body) -> dict:
        """`{"count", "max_model_len", "tokens"[, "token_strs"]}` of a prompt or messages."""
        req = parse_body(body, TokenizeRequest)
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise OpenAIError(400, "give exactly one of prompt and messages", "prompt")
        if req.prompt is not None:
            ids = self.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        else:
            ids = render_messages(self.tokenizer, req.messages,
                                  add_generation_prompt=req.add_generation_prompt)
        out = {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids}
        if req.return_token_strs:
            out["token_strs"] = self.tokenizer.convert_ids_to_tokens(ids)
        return out

    def detokenize(self, body) -> dict:
        """`{"prompt": text}` of token ids (a 400 for ids outside the vocabulary)."""
        req = parse_body(body, DetokenizeRequest)
        self.check_model(req.model)
        vocab = self.llm.engine.model.cfg.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise OpenAIError(400, f"tokens hold ids outside [0, {vocab}): {bad[:5]}", "tokens")
        return {"prompt": self.tokenizer.decode(req.tokens)}

    def models(self) -> dict:
        """OpenAI's model list: one card per served name."""
        root = str(getattr(self.llm.engine.model, "source", self.model_name))
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": now(), "owned_by": "jaxserve",
             "root": root, "parent": None, "max_model_len": self.max_model_len}
            for name in self.served_model_names]}
