"""Beam search for the server (`use_beam_search`), on the shared async engine.

`LLM.beam_search` forks beams inside an idle engine; a server's engine is never idle, so
here (as vLLM's server does) each step asks every live beam for its top 2W next tokens
with a one-token greedy request beside everyone else's work. A beam's prompt is the
previous step's prompt plus one token, so prefix caching turns all but its last page into
hits. Selection and scoring are `jaxserve.engine.beam_search`'s: the best W non-EOS
continuations by cumulative logprob go on, EOS candidates become finished hypotheses,
and hypotheses are ranked by `beam_score` (`select_beams`, `best_hypotheses`).
"""

from __future__ import annotations

import asyncio

from jaxserve.engine.beam_search import (
    BeamSearchParams,
    BeamSearchSequence,
    best_hypotheses,
    ranked_candidates,
    select_beams,
)
from jaxserve.sampling_params import RequestOutputKind, SamplingParams


async def _top_tokens(llm, tokens: list[int], params: SamplingParams, request_id: str,
                      k: int, cache_salt: str | None, lora_request=None
                      ) -> list[tuple[int, float]]:
    """The top `k` (token, logprob) of the next token after `tokens`."""
    stream = (await llm.add_requests([(request_id, {"prompt_token_ids": tokens})], params,
                                     cache_salt=cache_salt, lora_request=lora_request))[0]
    try:
        out = await stream.get()
        while not out.finished:
            out = await stream.get()
    finally:
        stream.abort()  # a no-op once finished; frees it when this search is cancelled
    return ranked_candidates(out.outputs[0].logprobs[0], k)


async def beam_search(llm, prompt_ids: list[int], params: BeamSearchParams, request_id: str,
                      eos_token_ids: tuple[int, ...], cache_salt: str | None = None,
                      lora_request=None) -> list[BeamSearchSequence]:
    """The best `params.beam_width` hypotheses for one prompt, best first.

    Args:
        llm: The server's `AsyncLLM`.
        prompt_ids: The prompt's token ids.
        params: Width, length, EOS handling and length penalty.
        request_id: Prefix of the engine request ids of the steps.
        eos_token_ids: Tokens that end a hypothesis (unless `params.ignore_eos`).
        cache_salt: The request's prefix-cache salt.
        lora_request: The LoRA adapter every step runs with (None: the base model).

    Raises:
        RequestFailedError, EngineDeadError: A step's request failed.
    """
    width, k = params.beam_width, 2 * params.beam_width
    step_params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=k, ignore_eos=True,
                                 detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY)
    eos = set(eos_token_ids)
    n_prompt = len(prompt_ids)
    beams = [BeamSearchSequence(list(prompt_ids), 0.0, n_prompt)]
    done: list[BeamSearchSequence] = []
    for step in range(params.max_tokens):
        tops = await asyncio.gather(*[
            _top_tokens(llm, beam.tokens, step_params, f"{request_id}-s{step}b{i}", k,
                        cache_salt, lora_request)
            for i, beam in enumerate(beams)])
        scored = [(beam.cum_logprob + lp, -i, token)
                  for i, (beam, cands) in enumerate(zip(beams, tops, strict=True))
                  for token, lp in cands]
        keep, ended = select_beams(scored, width, eos, params.ignore_eos)
        done += [BeamSearchSequence(beams[-neg_i].tokens + [token], cum, n_prompt,
                                    finish_reason="stop") for cum, neg_i, token in ended]
        beams = [BeamSearchSequence(beams[-neg_i].tokens + [token], cum, n_prompt)
                 for cum, neg_i, token in keep]
        if not beams:
            break
    for beam in beams:
        beam.finish_reason = "length"
    return best_hypotheses(done + beams, params)
