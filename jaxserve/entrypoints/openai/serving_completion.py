"""`POST /v1/completions`: prompts (text or token ids) to completions, whole or streamed (SSE)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from jaxserve.entrypoints.openai.protocol import REQUEST_FIELDS, CompletionRequest
from jaxserve.entrypoints.openai.serving_engine import (
    SAMPLING_FIELDS,
    OpenAIError,
    OpenAIServing,
    Prepared,
    chunk_usage,
    deltas,
    from_value_error,
    now,
    usage,
)
from jaxserve.outputs import CompletionOutput

_FIELDS = SAMPLING_FIELDS | REQUEST_FIELDS | {"logit_bias", "suffix", "best_of", "prompt"}


def _token_text(entry: dict, token_id: int, tokenizer) -> tuple[str, float]:
    lp = entry.get(token_id)
    text = lp.decoded_token if lp is not None and lp.decoded_token is not None \
        else tokenizer.decode([token_id])
    return text, (lp.logprob if lp is not None else float("nan"))


def completion_logprobs(comp: CompletionOutput, start: int, offset: int, tokenizer) -> dict:
    """OpenAI's legacy logprobs object for tokens `start:` of a completion."""
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    for tid, entry in zip(comp.token_ids[start:], (comp.logprobs or [])[start:], strict=False):
        text, lp = _token_text(entry, tid, tokenizer)
        tokens.append(text)
        token_logprobs.append(lp)
        top_logprobs.append({(v.decoded_token if v.decoded_token is not None
                              else tokenizer.decode([k])): v.logprob for k, v in entry.items()})
        text_offset.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": text_offset}


class OpenAIServingCompletion(OpenAIServing):
    """Handles completion requests."""

    request_model = CompletionRequest
    id_prefix = "cmpl"

    def prepare(self, req: CompletionRequest) -> Prepared:
        """Sampling parameters and tokenized prompts (each checked against max_model_len)."""
        try:
            params = req.to_sampling_params()
        except ValueError as e:
            raise from_value_error(e, _FIELDS) from None
        p = req.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            p = [p]
        if not p:
            raise OpenAIError(400, "prompt must not be empty", "prompt")
        limit = self.limits.max_prompts_per_request
        if len(p) > limit:
            raise OpenAIError(400, f"prompt: at most {limit} prompts per request, got "
                                   f"{len(p)}", "prompt")
        vocab = self.vocab_size or 2**31
        prompts = []
        for item in p:
            if isinstance(item, str):
                prompts.append({"prompt": item, "prompt_token_ids": self.encode(item)})
            else:
                bad = [t for t in item if not 0 <= t < vocab]
                if bad:
                    raise OpenAIError(400, f"prompt holds token ids outside [0, {vocab}): "
                                           f"{bad[:5]}", "prompt")
                prompts.append({"prompt": None, "prompt_token_ids": list(item)})
            if not prompts[-1]["prompt_token_ids"]:
                raise OpenAIError(400, "prompt must not be empty", "prompt")
            self.check_length(len(prompts[-1]["prompt_token_ids"]), params, "prompt")
        return Prepared(params, prompts)

    def _echo(self, req: CompletionRequest, prompt: dict) -> str:
        if not req.echo:
            return ""
        return prompt["prompt"] or self.tokenizer.decode(prompt["prompt_token_ids"])

    def full_response(self, req, prep, request_id, finals) -> dict:
        params, choices = prep.params, []
        for i, out in enumerate(finals):
            echo = self._echo(req, prep.prompts[i])
            for comp in out.outputs:
                choices.append({
                    "index": i * params.n + comp.index, "text": echo + comp.text,
                    "logprobs": completion_logprobs(comp, 0, len(echo), self.tokenizer)
                    if params.logprobs is not None else None,
                    "finish_reason": comp.finish_reason, "stop_reason": comp.stop_reason})
        return {"id": request_id, "object": "text_completion", "created": now(),
                "model": self.model_name, "choices": choices, "usage": usage(finals)}

    async def stream_events(self, req, prep, request_id, streams) -> AsyncIterator[dict]:
        params, created = prep.params, now()
        head = {"id": request_id, "object": "text_completion", "created": created,
                "model": self.model_name}
        finals = [None] * len(streams)
        sent = {}  # (prompt, completion) -> characters of text already streamed
        async for d in deltas(streams, params, finals):
            key = (d.prompt_index, d.comp.index)
            offset = sent.get(key, 0)
            text = (self._echo(req, prep.prompts[d.prompt_index]) if d.first else "") + d.text
            logprobs = completion_logprobs(d.comp, d.token_start, offset, self.tokenizer) \
                if params.logprobs is not None else None
            sent[key] = offset + len(d.text)
            yield {**head, "choices": [{"index": d.prompt_index * params.n + d.comp.index,
                                        "text": text, "logprobs": logprobs,
                                        "finish_reason": d.comp.finish_reason,
                                        "stop_reason": d.comp.stop_reason}],
                   **chunk_usage(req, prep, finals)}
        if req.stream_options is not None and req.stream_options.include_usage:
            yield {**head, "choices": [], "usage": usage(finals)}
