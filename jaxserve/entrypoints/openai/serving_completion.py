"""`POST /v1/completions`: prompts (text or token ids) to completions, whole or streamed (SSE)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from jaxserve.entrypoints.openai.protocol import REQUEST_FIELDS, CompletionRequest
from jaxserve.entrypoints.openai.serving_base import SAMPLING_FIELDS, Prepared
from jaxserve.entrypoints.openai.serving_engine import (
    OpenAIError,
    OpenAIServing,
    chunk_usage,
    deltas,
    final_usage,
    from_value_error,
    now,
    routed_experts_json,
    token_label,
    usage,
)
from jaxserve.outputs import CompletionOutput, RequestOutput

_FIELDS = SAMPLING_FIELDS | REQUEST_FIELDS | {"logit_bias", "suffix", "best_of", "prompt"}


# What a -inf logprob (a token the processed logprobs modes dropped) is sent as: JSON has no
# infinity (vLLM's value).
MIN_JSON_LOGPROB = -9999.0


def json_logprob(logprob: float) -> float:
    """`logprob` as the responses send it: -inf (and anything below) as MIN_JSON_LOGPROB."""
    return logprob if not logprob < MIN_JSON_LOGPROB else MIN_JSON_LOGPROB


def _token_text(entry: dict, token_id: int, tokenizer) -> tuple[str, float]:
    lp = entry.get(token_id)
    text = lp.decoded_token if lp is not None and lp.decoded_token is not None \
        else tokenizer.decode([token_id])
    return text, (json_logprob(lp.logprob) if lp is not None else float("nan"))


def _top_key(token_id: int, lp, tokenizer, as_ids: bool) -> str:
    """A `top_logprobs` key: the alternative's text, or `token_id:N`."""
    if as_ids:
        return token_label(token_id, "", True)
    return lp.decoded_token if lp.decoded_token is not None else tokenizer.decode([token_id])


def completion_logprobs(comp: CompletionOutput, start: int, offset: int, tokenizer,
                        as_ids: bool = False) -> dict:
    """OpenAI's legacy logprobs object for tokens `start:` of a completion (`as_ids`: tokens
    and `top_logprobs` keys as `token_id:N`; `text_offset` still counts the text)."""
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    for tid, entry in zip(comp.token_ids[start:], (comp.logprobs or [])[start:], strict=False):
        text, lp = _token_text(entry, tid, tokenizer)
        tokens.append(token_label(tid, text, as_ids))
        token_logprobs.append(lp)
        top_logprobs.append({_top_key(k, v, tokenizer, as_ids): json_logprob(v.logprob)
                             for k, v in entry.items()})
        text_offset.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": text_offset}


def _empty_logprobs() -> dict:
    return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}


def _extend(logprobs: dict, more: dict) -> None:
    for key, values in more.items():
        logprobs[key].extend(values)


def prompt_part(out: RequestOutput, k: int, tokenizer, as_ids: bool = False) -> dict:
    """OpenAI's legacy logprobs object over the prompt tokens (echo): the first token has
    no logprob (None), the others their logprob and the top `k` alternatives."""
    part, offset = _empty_logprobs(), 0
    lps = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
    for tid, entry in zip(out.prompt_token_ids, lps, strict=True):
        text, lp = _token_text(entry or {}, tid, tokenizer)
        part["tokens"].append(token_label(tid, text, as_ids))
        part["token_logprobs"].append(None if entry is None else lp)
        part["top_logprobs"].append(None if entry is None else {
            _top_key(t, v, tokenizer, as_ids): json_logprob(v.logprob)
            for t, v in entry.items() if t == tid or (v.rank or 0) <= k})
        part["text_offset"].append(offset)
        offset += len(text)
    return part


def prompt_logprobs_json(out: RequestOutput) -> list | None:
    """vLLM's `prompt_logprobs`: per prompt position None or {token id: logprob, rank,
    decoded token}."""
    if out.prompt_logprobs is None:
        return None
    return [None if e is None else {str(t): {"logprob": json_logprob(v.logprob), "rank": v.rank,
                                             "decoded_token": v.decoded_token}
                                    for t, v in e.items()} for e in out.prompt_logprobs]


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
        self.check_constraint(req, params)
        p = self.prompt_list(req.prompt)
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

    def _choice(self, req, prep, i: int, out: RequestOutput, comp: CompletionOutput,
                first: bool, text: str, token_start: int, offset: int,
                stream: bool = False) -> tuple[dict, int]:
        """One choice (or stream chunk choice), with vLLM's keys, and the characters of text
        it covers (for the next chunk's `text_offset`): the echo and prompt logprobs come
        with the first; echo with max_tokens=0 drops the generated token.

        With `return_token_ids` (vLLM's), the first carries the prompt's ids and each its
        new output ids; an echoed prompt then comes as ids only, not as text (as vLLM)."""
        params = prep.params
        echo = self._echo(req, prep.prompts[i]) if first else ""
        generated = "" if req.echo_only else text
        logprobs = None
        if params.logprobs is not None:
            as_ids = self.tokens_as_ids(req)
            logprobs = prompt_part(out, params.logprobs, self.tokenizer, as_ids) if echo \
                else _empty_logprobs()
            if not req.echo_only:
                _extend(logprobs, completion_logprobs(comp, token_start, offset + len(echo),
                                                      self.tokenizer, as_ids))
        ids = req.return_token_ids
        choice = {"index": i * params.n + comp.index,
                  "text": ("" if ids else echo) + generated, "logprobs": logprobs,
                  "finish_reason": comp.finish_reason, "stop_reason": comp.stop_reason,
                  "prompt_token_ids": list(out.prompt_token_ids) if ids and first else None,
                  "token_ids": ([] if req.echo_only else list(comp.token_ids[token_start:]))
                  if ids else None}
        if comp.routed_experts is not None and comp.finish_reason is not None:
            choice["routed_experts"] = routed_experts_json(comp)  # jaxserve's, as chat's
        asked = req.prompt_logprobs is not None and first
        if not stream or asked:  # NOTE: vLLM refuses prompt logprobs when streaming
            choice["prompt_logprobs"] = prompt_logprobs_json(out) if asked else None
        return choice, len(echo) + len(generated)

    def full_response(self, req, prep, request_id, finals) -> dict:
        choices = [self._choice(req, prep, i, out, comp, True, comp.text, 0, 0)[0]
                   for i, out in enumerate(finals) for comp in out.outputs]
        return {"id": request_id, "object": "text_completion", "created": now(),
                "model": self.serving_models.response_name(prep.lora_request),
                "choices": choices, "service_tier": None, "system_fingerprint": None,
                "usage": usage(finals, req, details=self.limits.enable_prompt_tokens_details),
                "kv_transfer_params": None}

    async def stream_events(self, req, prep, request_id, streams) -> AsyncIterator[dict]:
        head = {"id": request_id, "object": "text_completion", "created": now(),
                "model": self.serving_models.response_name(prep.lora_request)}
        finals = [None] * len(streams)
        sent = {}  # (prompt, completion) -> characters of text already streamed
        async for d in deltas(streams, prep.params, finals):
            key = (d.prompt_index, d.comp.index)
            offset = sent.get(key, 0)
            choice, covered = self._choice(req, prep, d.prompt_index, finals[d.prompt_index],
                                           d.comp, d.first, d.text, d.token_start, offset,
                                           stream=True)
            sent[key] = offset + covered
            if req.echo_only and not d.first and d.comp.finish_reason is None:
                continue
            yield {**head, "choices": [choice], **chunk_usage(req, prep, finals)}
        if req.stream_options is not None and req.stream_options.include_usage:
            yield {**head, "choices": [], "usage": final_usage(
                finals, req, self.limits.enable_prompt_tokens_details)}
