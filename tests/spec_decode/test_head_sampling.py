"""Draft heads keep the target's sampled distribution: a chi-square test over many samples
of a tiny model, with proposals that are accepted often (the accept path at every position).

A head whose draft vocabulary is the one token X (`d2t` maps its one draft id to X) proposes
X at every position. The requests sample at temperature 1 with `logit_bias` on X and top-k 2,
so each position's token is X or the context's other top token, X often: a request's output
is one of 2**MAX_TOKENS sequences, whose exact probabilities transformers' target gives (the
oracle). The sequences the engine samples with speculation follow them, and follow those the
target's own sampler samples (other seeds; the same engine with its proposals paused, and in
the slow tier an engine without speculation): a goodness-of-fit test against the oracle for
each, and a two-sample test between them (p = 0.001). The target is the conftest's tiny Llama
with a 512-token vocabulary (scipy's tests: scipy comes with JAX). The slow tier runs the same
for an MTP draft (a tiny DeepSeek-V3 whose MTP layer always proposes token 0)."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from models.loaders import load_model
from tests.spec_decode.eagle_head import random_head, write_head_dir

stats = pytest.importorskip("scipy.stats")
torch = pytest.importorskip("torch")

K = 3
X = 250  # the token every proposal is (the top token after PROMPT)
BIAS = 1.0
MAX_TOKENS = 5
NUM = 256  # requests per engine
VOCAB = 512  # small: sampling a row costs its vocabulary, and the test samples ~5000 rows
PROMPT = [1, 300, 17, 421, 88, 250]  # token ids (below VOCAB)
ALPHA = 0.001
# NOTE: a 32-token budget: a step's cost grows with its tokens (a 64-token budget made the
# speculating engine's run 40% slower), and 2 buckets fewer to compile.
ARGS = dict(max_num_seqs=16, max_num_batched_tokens=32, max_model_len=32, num_kv_blocks=64,
            attention_backend="xla", enable_prefix_caching=False, warmup=False)


def params(seed: int, x: int = X, bias: float = BIAS) -> SamplingParams:
    return SamplingParams(temperature=1.0, top_k=2, logit_bias={x: bias}, seed=seed,
                          max_tokens=MAX_TOKENS, ignore_eos=True)


def sequence_probs(next_logits, prompt: list[int], num_tokens: int, x: int = X,
                   bias: float = BIAS) -> dict[tuple, float]:
    """The probability of every token sequence `params(_, x, bias)` can sample after `prompt`:
    `next_logits(ids)` is the target's f32[V] logits after `ids`; each position adds `bias` to
    x's logit, keeps the top 2 and samples their softmax (temperature 1)."""
    out: dict[tuple, float] = {}

    def walk(seq: tuple, prob: float) -> None:
        if len(seq) == num_tokens:
            out[seq] = prob
            return
        logits = np.asarray(next_logits(prompt + list(seq)), np.float64)  # f64[V]
        logits[x] += bias
        order = np.argsort(-logits)
        top, third = logits[order[:2]], logits[order[2]]
        assert top[1] - third > 1e-3, (seq, top, third)  # no near-tie for the second place
        p = np.exp(top - top.max())
        for token, q in zip(order[:2], p / p.sum(), strict=True):
            walk(seq + (int(token),), prob * q)

    walk((), 1.0)
    return out


def cells(probs: dict[tuple, float], num: int) -> list[list[tuple]]:
    """The sequences grouped into cells of expected count >= 5 in a sample of `num`: each
    likely sequence its own cell, the unlikely ones pooled into the last."""
    order = sorted(probs, key=lambda s: -probs[s])
    keep = [[s] for s in order if probs[s] * num >= 5]
    rest = [s for s in order if probs[s] * num < 5]
    if sum(probs[s] for s in rest) * num >= 5:
        keep.append(rest)
    elif rest:
        keep[-1].extend(rest)
    return keep


def counts(samples: list[tuple], groups: list[list[tuple]]) -> np.ndarray:
    """i64[cells]: how many samples fall into each cell."""
    index = {s: i for i, g in enumerate(groups) for s in g}
    return np.bincount([index[s] for s in samples], minlength=len(groups))


def check_distribution(spec: list[tuple], base: list[tuple], probs: dict[tuple, float]) -> None:
    """Both samples fit the oracle's probabilities and each other (chi-square, p = ALPHA)."""
    unknown = {s for s in spec + base if s not in probs}
    assert not unknown, f"sequences the target cannot sample: {sorted(unknown)[:4]}"
    groups = cells(probs, len(spec))
    assert len(groups) >= 6, groups  # enough cells for the test to see a shift
    expected = np.array([sum(probs[s] for s in g) for g in groups])
    for sample in (spec, base):
        observed = counts(sample, groups)
        fit = stats.chisquare(observed, expected * len(sample))
        assert fit.pvalue > ALPHA, (fit, observed, expected * len(sample))
    table = np.stack([counts(spec, groups), counts(base, groups)])
    two = stats.chi2_contingency(table)
    assert two.pvalue > ALPHA, (two, table)


def sample(llm: LLM, seeds, x: int = X, bias: float = BIAS) -> list[tuple]:
    """The token sequences `llm` samples after PROMPT, one request per seed."""
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * len(seeds),
                        [params(s, x, bias) for s in seeds], use_tqdm=False)
    return [tuple(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def tiny_dir(smollm2_path, smollm2_tokenizer, tmp_path_factory) -> str:
    """The conftest's tiny random Llama with a VOCAB-token vocabulary."""
    from models.loaders.gguf_file import open_gguf
    from tests.conftest import write_tiny_hf_dir

    return write_tiny_hf_dir(str(tmp_path_factory.mktemp("small_vocab")), smollm2_tokenizer,
                             open_gguf(smollm2_path).hf_config(), vocab_size=VOCAB)


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load_model(tiny_dir, "float32")


def hf_probs(hf, x: int = X, bias: float = BIAS) -> dict[tuple, float]:
    """transformers' model `hf`: the probabilities of the sequences after PROMPT."""

    def next_logits(ids):
        with torch.no_grad():
            return hf(torch.tensor([ids])).logits[0, -1].numpy()

    return sequence_probs(next_logits, PROMPT, MAX_TOKENS, x, bias)


@pytest.fixture(scope="module")
def oracle(tiny_dir) -> dict[tuple, float]:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    return hf_probs(AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval())


def one_token_head(tiny, directory: str) -> str:
    """A random EAGLE-3 head whose draft vocabulary is X alone, as a checkpoint directory."""
    v, h = tiny.cfg.vocab_size, tiny.cfg.hidden_size
    tensors = random_head(v, h, draft_vocab=1, seed=3)
    tensors["d2t"] = np.array([X], np.int64)  # draft id 0 is target id 0 + X
    return write_head_dir(directory, tensors, v, h, aux_ids=(0, 1, 1))


def check_acceptance(llm: LLM) -> None:
    """Proposals were accepted often, at each of the K positions, and rejected often."""
    drafted, num_accepted, per_pos = accepted(llm)
    assert 0.2 * drafted < num_accepted < 0.9 * drafted, (drafted, num_accepted)
    assert min(per_pos) >= NUM // 8, per_pos


def accepted(llm: LLM) -> tuple[int, int, list[int]]:
    """The engine's (draft tokens, accepted tokens, accepted per position) so far."""
    m = llm.get_metrics()
    return (m["jaxserve:spec_decode_num_draft_tokens"],
            m["jaxserve:spec_decode_num_accepted_tokens"],
            [m[f"jaxserve:spec_decode_num_accepted_tokens_per_pos{{position={i}}}"]
             for i in range(K)])


@pytest.fixture(scope="module")
def eagle(tiny, smollm2_tokenizer, tmp_path_factory) -> tuple[LLM, list[tuple]]:
    """An EAGLE-3 engine with the one-token head, and its samples of seeds 0..NUM - 1."""
    head = one_token_head(tiny, str(tmp_path_factory.mktemp("one_token_head")))
    llm = LLM(tiny, tokenizer=smollm2_tokenizer, speculative_config={
        "method": "eagle3", "model": head, "num_speculative_tokens": K}, **ARGS)
    llm.engine.speculator.gate.min_acceptance = 0.0  # verify every step
    return llm, sample(llm, range(NUM))


def test_eagle3_keeps_the_targets_distribution(eagle, oracle):
    """Every proposal is X and is accepted often, at each of the K positions (and rejected
    often); the sampled sequences follow the oracle's probabilities and those the same
    engine samples with its proposals paused (the target's own sampler, other seeds)."""
    llm, got = eagle
    check_acceptance(llm)
    drafted = accepted(llm)[0]
    gate = llm.engine.speculator.gate
    gate.paused_for = 10**9  # no proposals: each step samples one row per request
    try:
        base = sample(llm, range(NUM, 2 * NUM))
    finally:
        gate.paused_for = 0
    assert accepted(llm)[0] == drafted  # nothing was proposed
    check_distribution(got, base, oracle)


@pytest.mark.slow  # another engine's compiles (~10 s here); the paused engine stands in above
def test_eagle3_against_an_engine_without_speculation(eagle, oracle, tiny, smollm2_tokenizer):
    """The same test against an engine built without a speculative config."""
    _, got = eagle
    base = sample(LLM(tiny, tokenizer=smollm2_tokenizer, **ARGS), range(NUM, 2 * NUM))
    check_distribution(got, base, oracle)


@pytest.mark.slow  # a DeepSeek-V3 target's compiles on two engines (~40 s here)
def test_mtp_keeps_the_targets_distribution(smollm2_tokenizer, tmp_path):
    """An MTP layer whose final norm is zero: its logits are all 0, so its greedy proposal
    is token 0 (the first of equal maxima) at every position; bias on token 0 makes the
    target sample it often. The same checks against a tiny DeepSeek-V3 target (transformers'
    probabilities, an engine without speculation)."""
    from safetensors.numpy import load_file, save_file

    from tests.spec_decode import mtp_target

    torch.set_num_threads(1)
    directory = str(tmp_path)
    hf = mtp_target.write_target(directory, smollm2_tokenizer, vocab_size=VOCAB)
    path = f"{directory}/model.safetensors"
    tensors = load_file(path)
    norm = f"model.layers.{mtp_target.NUM_LAYERS}.shared_head.norm.weight"
    tensors[norm] = np.zeros_like(tensors[norm])
    save_file(tensors, path, metadata={"format": "pt"})
    x, bias = 0, 3.0  # P(0) 0.5-0.9 at each position
    target = load_model(directory, "float32")
    llm = LLM(target, tokenizer=smollm2_tokenizer, speculative_config={
        "method": "mtp", "num_speculative_tokens": K}, **ARGS)
    llm.engine.speculator.gate.min_acceptance = 0.0
    got = sample(llm, range(NUM), x, bias)
    check_acceptance(llm)
    base = sample(LLM(target, tokenizer=smollm2_tokenizer, **ARGS), range(NUM, 2 * NUM), x, bias)
    check_distribution(got, base, hf_probs(hf, x, bias))
