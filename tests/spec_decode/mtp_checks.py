"""Shared by the draft-head tests (EAGLE-3, MTP): their prompts and engine sizes, the engine's
proposals recorded, greedy generation, and every recorded proposal checked against a
reference (`tests/spec_decode/*mtp_target.py`, the EAGLE-3 reference head)."""

from __future__ import annotations

from collections.abc import Callable

from jaxserve import LLM, SamplingParams

MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
# A 16-token budget (prompts chunk), 9 pages (requests are preempted and recomputed) and
# prefix caching (a second pass hits the first's pages).
ARGS = dict(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=256, num_kv_blocks=9,
            preemption_mode="recompute", enable_prefix_caching=True, attention_backend="xla",
            warmup=False)
PROMPTS = [
    "The history of the city begins with a small fishing village on the river bank. Over "
    "the centuries, merchants arrived from distant lands",
    "def fibonacci(n):",
    "Once upon a time",
    "1, 2, 3, 4, 5,",
]


def recording(llm: LLM) -> list:
    """Records the speculator's proposals: (request id, its tokens then, the head's first
    position, the proposals); a random layer is never right, so every step verifies."""
    sp = llm.engine.speculator
    sp.gate.min_acceptance = 0.0
    records, propose = [], sp.propose

    def recorded(requests):
        requests = list(requests)
        got = propose(requests)
        tokens = {r.request_id: len(r.all_token_ids) for r in requests}
        records.extend((i, tokens[i], sp.pages.seqs[i].base, p) for i, p in got.items())
        return got

    sp.propose = recorded
    return records


def generate(llm: LLM, prompts, params: SamplingParams = GREEDY
             ) -> tuple[list[list[int]], dict[str, list[int]]]:
    """Greedy outputs of `prompts` batched, and each request's final tokens by id."""
    outs = llm.generate(prompts, params, use_tqdm=False)
    return ([o.outputs[0].token_ids for o in outs],
            {o.request_id: list(o.prompt_token_ids) + list(o.outputs[0].token_ids)
             for o in outs})


def check_proposals(records, final: dict[str, list[int]],
                    reference: Callable[[list[int], int, int, int], list[tuple[int, float]]],
                    k: int) -> int:
    """Every recorded proposal is the reference's (`reference(tokens, num, base, k)`: the k
    greedy proposals for a request of `tokens[:num]` whose head starts at `base`, each with
    its top logit's margin; a near-tie, margin < 1e-3, ends a comparison); returns how many
    were compared."""
    compared = 0
    for req_id, num, base, proposals in records:
        want = reference(final[req_id], num, base, k)
        for got, (token, margin) in zip(proposals, want, strict=True):
            if margin < 1e-3:
                break
            assert got == token, (req_id, num, base, proposals, want)
            compared += 1
    return compared
