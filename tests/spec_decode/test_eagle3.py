"""EAGLE-3 heads: the head's forward against a NumPy reference, the target's aux states against
transformers' hidden states, every proposal the engine makes against the reference head run
on transformers' states (chunked, preempted, prefix hits), greedy outputs equal the target's
alone (batched and alone), nothing compiles after warm-up (refusals: test_eagle3_config.py).

The heads are random (the test writes them as checkpoint directories, both layouts); the
target is the conftest's tiny random Llama (2 layers, so the head reads layers 0, 1, 1)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.spec_decode.eagle_programs import greedy
from models.eagle3 import head_forward
from models.loaders import load_model
from models.loaders.eagle3 import load_eagle3
from pallas_kernels import AttentionMetadata
from pallas_kernels.attention_ops import AttentionOps
from pallas_kernels.metadata import kv_pages_shape
from tests.spec_decode import mtp_checks
from tests.spec_decode.eagle_head import (
    HEAD_LAYER,
    random_head,
    reference_fc,
    reference_head,
    write_head_dir,
)
from tests.spec_decode.mtp_checks import ARGS, PROMPTS, recording

AUX = (0, 1, 1)
K = 3
# NOTE: mtp_checks.ARGS at the sizes of test_draft_model.py's tiny engines (their target
# programs are then in the persistent compilation cache), with prefix caching (host-side only) on.
ARGS = {**ARGS, "max_num_seqs": 8}
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model(tiny_model_dir, "float32")


@pytest.fixture(scope="module")
def tensors(tiny) -> dict[str, np.ndarray]:
    return random_head(tiny.cfg.vocab_size, tiny.cfg.hidden_size, seed=0)


@pytest.fixture(scope="module")
def head_dir(tiny, tensors, tmp_path_factory) -> str:
    return write_head_dir(str(tmp_path_factory.mktemp("eagle3") / "head"), tensors,
                          tiny.cfg.vocab_size, tiny.cfg.hidden_size, aux_ids=AUX)


def eagle(head, k: int = K, **extra) -> dict:
    return {"method": "eagle3", "model": head, "num_speculative_tokens": k, **extra}


# NOTE: "cpu": the head's attention on a target served by the CPU kernels (`head_attention`).
@pytest.mark.parametrize("backend", ["xla", "cpu"])
def test_head_forward_matches_the_reference(tensors, tiny, tmp_path, backend):
    """Two requests of 5 and 3 tokens in one packed step, through the head's pool: logits
    and hidden states as the NumPy reference's; both checkpoint layouts load the same."""
    v, h = tiny.cfg.vocab_size, tiny.cfg.hidden_size
    head = load_eagle3(write_head_dir(str(tmp_path / "a"), tensors, v, h), jnp.float32)
    other = load_eagle3(write_head_dir(str(tmp_path / "b"), tensors, v, h,
                                       layout="speculators"), jnp.float32)
    assert head.cfg == other.cfg
    assert all(np.array_equal(head.params[k], other.params[k]) for k in head.params)
    rng = np.random.default_rng(1)
    ps, hh = 4, HEAD_LAYER["hidden_size"]
    embeds = rng.standard_normal((8, hh)).astype(np.float32)
    aux = rng.standard_normal((8, 3, h)).astype(np.float32)
    positions = np.array([0, 1, 2, 3, 4, 7, 8, 9], np.int32)  # the second from position 7
    tables = np.array([[1, 2, 0], [3, 4, 5]], np.int32)
    local = np.array([0, 1, 2, 3, 4, 7, 8, 9])
    slots = tables[[0] * 5 + [1] * 3, local // ps] * ps + local % ps
    md = AttentionMetadata(jnp.asarray(slots, jnp.int32), jnp.asarray(tables),
                           jnp.array([5, 10], jnp.int32), jnp.array([0, 5, 8], jnp.int32))
    lc = head.cfg.layer
    pool = jnp.zeros(kv_pages_shape(1, lc.num_kv_heads, 6, ps, lc.head_dim), jnp.float32)
    # The second request's first 7 positions, as an earlier step wrote them (same shapes:
    # one compile; the eighth token is padding, written to the null page).
    pre_e = rng.standard_normal((8, hh)).astype(np.float32)
    pre_a = rng.standard_normal((8, 3, h)).astype(np.float32)
    fc = lambda a: jnp.asarray(a.reshape(len(a), -1)) @ head.params["fc"].T  # noqa: E731
    pre_slots = np.append(tables[1, np.arange(7) // ps] * ps + np.arange(7) % ps, 0)
    pre_md = AttentionMetadata(jnp.asarray(pre_slots, jnp.int32),
                               jnp.asarray(tables[::-1] * [[1], [0]]),
                               jnp.array([7, 0], jnp.int32), jnp.array([0, 7, 7], jnp.int32))
    forward = jax.jit(functools.partial(head_forward, head.cfg, AttentionOps(backend)))
    pool, _, _ = forward(head.params, jnp.asarray(pre_e), fc(pre_a),
                         jnp.arange(8, dtype=jnp.int32), pool, pre_md)
    _, normed, prenorm = forward(head.params, jnp.asarray(embeds), fc(aux),
                                 jnp.asarray(positions), pool, md)
    logits = np.asarray(normed @ head.params["lm_head"].T)
    for rows, e, a, pos in ((slice(0, 5), embeds[:5], aux[:5], positions[:5]),
                            (slice(5, 8), np.concatenate([pre_e[:7], embeds[5:]]),
                             np.concatenate([pre_a[:7], aux[5:]]), np.arange(10))):
        ref_logits, ref_pre = reference_head(tensors, e, reference_fc(tensors, a), pos)
        n = rows.stop - rows.start
        np.testing.assert_allclose(logits[rows], ref_logits[-n:], rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(np.asarray(prenorm)[rows], ref_pre[-n:], rtol=1e-4,
                                   atol=1e-4)
    # A draft id d is the target's d + d2t[d].
    want = np.argmax(logits, -1) + tensors["d2t"][np.argmax(logits, -1)]
    np.testing.assert_array_equal(np.asarray(greedy(head.params, normed)), want)


@pytest.fixture(scope="module")
def want(tiny, smollm2_tokenizer) -> list[list[int]]:
    llm = LLM(tiny, tokenizer=smollm2_tokenizer, **{**ARGS, "enable_prefix_caching": False})
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def spec(tiny, smollm2_tokenizer, head_dir) -> tuple[LLM, list]:
    """An EAGLE-3 engine whose proposals are recorded: (request id, its tokens then, the
    head's first position, the proposals)."""
    # NOTE: 4 sequences (the 4 prompts): one row bucket, so one proposal loop to compile.
    llm = LLM(tiny, tokenizer=smollm2_tokenizer, speculative_config=eagle(head_dir),
              **{**ARGS, "max_num_seqs": 4})
    return llm, recording(llm)  # a random head is never right: every step verifies


def generate(llm: LLM, prompts) -> tuple[list[list[int]], dict[str, list[int]]]:
    return mtp_checks.generate(llm, prompts, GREEDY)


def test_greedy_identity_batched_preempted_prefix_hits(spec, want):
    """Batched, chunked and preempted, then again with prefix hits: the target's tokens;
    proposals were made and verified each time; every page went back."""
    llm, _ = spec
    before = llm.get_metrics()
    assert generate(llm, PROMPTS)[0] == want
    mid = llm.get_metrics()
    assert generate(llm, PROMPTS)[0] == want
    after = llm.get_metrics()
    assert mid["jaxserve:num_preemptions"] > before["jaxserve:num_preemptions"]
    assert after["jaxserve:prefix_cache_hits"] > mid["jaxserve:prefix_cache_hits"]
    drafted = "jaxserve:spec_decode_num_draft_tokens"
    assert after[drafted] > mid[drafted] > before[drafted]
    assert "jaxserve:spec_decode_num_accepted_tokens_per_pos{position=2}" in after
    assert llm.get_metrics()["jaxserve:kv_cache_usage_perc"] == 0.0
    assert not llm.engine.speculator.pages.seqs  # every request's head pages went back


def test_greedy_identity_alone(spec, want):
    llm, _ = spec
    for prompt, tokens in zip(PROMPTS[:2], want[:2], strict=True):
        assert generate(llm, [prompt])[0] == [tokens]


@pytest.fixture(scope="module")
def hf_tiny(tiny_model_dir):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def hf_aux(hf_tiny, tokens: list[int]) -> np.ndarray:
    """transformers' residual stream entering layers 0, 1, 1 at every position: [T, 3, H]."""
    import torch

    with torch.no_grad():
        out = hf_tiny(torch.tensor([tokens]), output_hidden_states=True)
    states = out.hidden_states  # (embeddings, after layer 0, ...): the input of layer i at i
    return np.stack([states[i][0].numpy() for i in AUX], axis=1)


def reference_proposals(tensors, table, aux, tokens: list[int], num: int, base: int) -> list:
    """The reference head's k greedy proposals for a request of `tokens[:num]` whose head
    attends from position `base`, on the target's states `aux` [T, 3, H] (`hf_aux`) and
    embedding `table`; each with the margin of its top draft logit."""
    pos = np.arange(base, num - 1)
    embeds, g = table[tokens[base + 1:num]], reference_fc(tensors, aux[base:num - 1])
    got = []
    for step in range(K):
        logits, prenorm = reference_head(tensors, embeds, g, pos)
        top2 = np.sort(logits[-1])[-2:]
        draft = int(np.argmax(logits[-1]))
        target = draft + int(tensors["d2t"][draft])
        got.append((target, top2[1] - top2[0]))
        embeds = np.concatenate([embeds, table[[target]]])
        g = np.concatenate([g, prenorm[-1:]])
        pos = np.append(pos, num - 1 + step)
    return got


def test_proposals_follow_the_reference(spec, tensors, hf_tiny):
    """Every proposal the engine made (batched, chunked prompts, recomputed after
    preemption, after prefix hits) is the reference head's on transformers' states: the
    head's K/V stayed right across steps. Near-ties (margin < 1e-3) end a comparison."""
    llm, records = spec
    records.clear()
    _, final = generate(llm, PROMPTS)
    _, more = generate(llm, PROMPTS[:2])
    final.update(more)
    assert len(records) > 20
    # The second pass's prefix hits found the head's pages of the prompts' starts too.
    assert llm.engine.speculator.pages.num_cached_pages_hit > 0
    compared = 0
    table = hf_tiny.get_input_embeddings().weight.detach().numpy()
    aux = {req_id: hf_aux(hf_tiny, tokens) for req_id, tokens in final.items()}
    for req_id, num, base, proposals in records:
        ref = reference_proposals(tensors, table, aux[req_id], final[req_id], num, base)
        for got, (target, margin) in zip(proposals, ref, strict=True):
            if margin < 1e-3:
                break
            assert got == target, (req_id, num, base, proposals, ref)
            compared += 1
    assert compared > 0.9 * K * len(records)


def test_a_paused_head_restarts_where_it_left(spec, want):
    """A gate that never sees speculation pay pauses proposals (the head then computes
    nothing, steps overlap); when it tries again the head starts each request anew from
    its latest position: the target's tokens all along, nothing left in the head's pool."""
    llm, records = spec
    gate = llm.engine.speculator.gate
    pauses = llm.get_metrics()["jaxserve:spec_decode_num_pauses"]
    gate.min_acceptance, gate.window, gate.min_pause = 1.0, 4, 2
    try:
        records.clear()
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want
        assert llm.get_metrics()["jaxserve:spec_decode_num_pauses"] > pauses + 1
        # Proposals after a pause came from heads started past the prompt.
        prompt_len = {o.request_id: len(o.prompt_token_ids) for o in outs}
        assert any(base >= prompt_len[i] for i, _, base, _ in records)
    finally:
        gate.min_acceptance, gate.window, gate.min_pause = 0.0, 64, 8
        gate.paused_for, gate.pause = 0, 8
    assert not llm.engine.speculator.pages.seqs


@pytest.mark.slow  # a warmed-up engine: ~30 s of compiles from an empty cache
def test_nothing_compiles_after_warm_up(tiny, smollm2_tokenizer, head_dir, want):
    """Warm-up compiles the target's aux-returning steps, the head's observe program per
    token bucket and its proposal loop."""
    llm = LLM(tiny, tokenizer=smollm2_tokenizer, speculative_config=eagle(head_dir),
              **{**ARGS, "warmup": True})
    llm.engine.speculator.gate.min_acceptance = 0.0
    assert generate(llm, PROMPTS)[0] == want
    metrics = llm.get_metrics()
    assert metrics["jaxserve:spec_decode_num_drafts"] > 0
    assert metrics["jaxserve:num_compilations"] == 0


@pytest.mark.slow  # the seeded sampler's programs on both engines
def test_seeded_sampling_is_the_targets(spec, tiny, smollm2_tokenizer):
    """Temperature 1, seeded: every request samples what it samples without speculation
    (each verified row draws with its output position's counter), so the output follows the
    target's distribution whatever the head proposes."""
    llm, _ = spec
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=10, ignore_eos=True)
              for i in range(6)]
    base = LLM(tiny, tokenizer=smollm2_tokenizer, **{**ARGS, "enable_prefix_caching": False})
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(6)]
    drafted = llm.get_metrics()["jaxserve:spec_decode_num_draft_tokens"]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == [o.outputs[0].token_ids for o in base.generate(prompts, params,
                                                                 use_tqdm=False)]
    assert llm.get_metrics()["jaxserve:spec_decode_num_draft_tokens"] > drafted


@pytest.mark.slow  # another engine's compiles; recompute preemption runs in the default tier
def test_greedy_identity_under_swap_preemption(tiny, smollm2_tokenizer, head_dir, want):
    llm = LLM(tiny, tokenizer=smollm2_tokenizer, speculative_config=eagle(head_dir, k=2),
              **{**ARGS, "preemption_mode": "swap", "enable_prefix_caching": False})
    llm.engine.speculator.gate.min_acceptance = 0.0
    assert generate(llm, PROMPTS)[0] == want
    metrics = llm.get_metrics()
    assert metrics["jaxserve:num_preemptions"] > 0
    assert metrics["jaxserve:spec_decode_num_draft_tokens"] > 0


@pytest.mark.slow  # one more compile of the head; its default form runs in the default tier
def test_norm_before_residual(tensors, tiny, tmp_path):
    """The `speculators` option: the residual is hidden_norm(g), as the reference's."""
    v, h = tiny.cfg.vocab_size, tiny.cfg.hidden_size
    head = load_eagle3(write_head_dir(str(tmp_path / "h"), tensors, v, h, layout="speculators",
                                      norm_before_residual=True), jnp.float32)
    assert head.cfg.norm_before_residual
    rng = np.random.default_rng(2)
    embeds = rng.standard_normal((6, HEAD_LAYER["hidden_size"])).astype(np.float32)
    aux = rng.standard_normal((6, 3, h)).astype(np.float32)
    lc = head.cfg.layer
    pool = jnp.zeros(kv_pages_shape(1, lc.num_kv_heads, 3, 4, lc.head_dim), jnp.float32)
    md = AttentionMetadata(jnp.arange(4, 10, dtype=jnp.int32), jnp.array([[1, 2]], jnp.int32),
                           jnp.array([6], jnp.int32), jnp.array([0, 6], jnp.int32))
    g = jnp.asarray(aux.reshape(6, -1)) @ head.params["fc"].T
    _, normed, prenorm = jax.jit(functools.partial(head_forward, head.cfg, AttentionOps("xla")))(
        head.params, jnp.asarray(embeds), g, jnp.arange(6, dtype=jnp.int32), pool, md)
    ref_logits, ref_pre = reference_head(tensors, embeds, reference_fc(tensors, aux),
                                         np.arange(6), norm_before_residual=True)
    np.testing.assert_allclose(np.asarray(prenorm), ref_pre, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(normed @ head.params["lm_head"].T), ref_logits,
                               rtol=1e-4, atol=1e-4)
