"""The checks a scheduler makes of a new request before queueing it: what could never run
is refused now, naming why, instead of waiting forever."""

from __future__ import annotations


def check_new_request(sched, request) -> None:
    """Refuses a request `sched` (a `Scheduler`) could never run.

    Raises:
        ValueError: Duplicate id, prompt longer than `max_model_len`, more pages than the
            pool holds (less the watermark), without chunked prefill more tokens than
            `max_num_batched_tokens`, or more samples than `max_num_seqs`.
    """
    if request.request_id in sched.requests:
        raise ValueError(f"request id {request.request_id!r} is already in use")
    if request.num_prompt_tokens > sched.max_model_len:
        raise ValueError(f"prompt of request {request.request_id!r} has "
                         f"{request.num_prompt_tokens} tokens, more than max_model_len "
                         f"{sched.max_model_len}")
    if request.fan_out > sched.max_num_seqs:
        raise ValueError(f"request {request.request_id!r} fans out into {request.fan_out} "
                         f"samples, more than max_num_seqs {sched.max_num_seqs}")
    if request.num_prompt_tokens > sched.max_kv_tokens:
        kv, budget = sched.kv, sched.max_num_batched_tokens
        if request.num_prompt_tokens > budget and not sched.config.chunked:
            raise ValueError(f"prompt of request {request.request_id!r} has "
                             f"{request.num_prompt_tokens} tokens, more than "
                             f"max_num_batched_tokens {budget} without chunked prefill")
        raise ValueError(f"request {request.request_id!r} needs KV for "
                         f"{request.num_prompt_tokens} tokens; one request may hold at "
                         f"most {kv.max_tokens_per_request} (the pool less its admission "
                         "watermark)")
