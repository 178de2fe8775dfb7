"""The EAGLE-3 training example: its unrolled forward against the NumPy reference head (each
draft step is the reference run over the chain of K/V the serving loop would hold), a head
saved in the EAGLE-3 layout loads back unchanged, and the script trains a head on the tiny
model that the engine serves with the target's greedy tokens (and `bench_eagle3` runs on)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from models.eagle3 import Eagle3Config
from models.loaders.eagle3 import load_eagle3, save_eagle3
from scripts.examples import eagle3_training, train_eagle3_head
from tests.spec_decode.eagle_head import HEAD_LAYER, random_head, reference_fc, reference_head
from tests.spec_decode.mtp_checks import ARGS

VOCAB, TARGET_HIDDEN, DRAFT_VOCAB = 300, 40, 64


@pytest.fixture(scope="module")
def head():
    """(config, random tensors) of a head in the reference's shapes (`HEAD_LAYER`)."""
    from models.registry import arch_config_from_hf

    layer = arch_config_from_hf({**HEAD_LAYER, "architectures": ["LlamaForCausalLM"],
                                 "model_type": "llama", "num_hidden_layers": 1,
                                 "vocab_size": VOCAB})
    cfg = Eagle3Config(layer, VOCAB, DRAFT_VOCAB, TARGET_HIDDEN, (0, 1, 2))
    return cfg, random_head(VOCAB, TARGET_HIDDEN, draft_vocab=DRAFT_VOCAB, seed=3, scale=0.3)


def test_unrolled_steps_equal_the_reference_chain(head):
    """Step s at position r is the reference head run over the K/V the serving loop holds
    then: step 1's rows at positions 0..r-s+1, then one row of each later step, each fed the
    previous step's prenorm one position before."""
    cfg, t = head
    rng = np.random.default_rng(0)
    length, steps = 9, 3
    aux = rng.standard_normal((2, length, 3, TARGET_HIDDEN)).astype(np.float32)
    embeds = rng.standard_normal((2, length, HEAD_LAYER["hidden_size"])).astype(np.float32)
    params = {k: jnp.asarray(v) for k, v in t.items() if k != "d2t"}
    got = eagle3_training.unrolled_logits(cfg, params, jnp.asarray(aux), jnp.asarray(embeds),
                                          steps)
    for b in range(2):
        g1 = reference_fc(t, aux[b])
        for r in range(length):
            for s in range(min(r + 1, steps)):
                g = g1[:r - s + 1]
                for _ in range(s):  # each later step's row reads the row before's prenorm
                    n = len(g)
                    _, pre = reference_head(t, embeds[b, :n], g, np.arange(n))
                    g = np.concatenate([g, pre[-1:]])
                logits, _ = reference_head(t, embeds[b, :r + 1], g, np.arange(r + 1))
                np.testing.assert_allclose(np.asarray(got[s][b, r]), logits[-1],
                                           rtol=2e-4, atol=2e-4, err_msg=f"step {s} at {r}")


def test_a_saved_head_loads_back(head, tmp_path):
    cfg, t = head
    directory = save_eagle3(str(tmp_path / "h"), cfg, t)
    loaded = load_eagle3(directory, "float32")
    assert loaded.cfg == cfg
    for key, value in t.items():
        np.testing.assert_array_equal(np.asarray(loaded.params[key]), value, err_msg=key)


@pytest.mark.slow(reason="~40 s: three tiny engines and the training programs; the unrolled "
                  "forward and the saved layout stay in the default tier")
def test_the_example_trains_a_head_the_engine_serves(tiny_model_dir, smollm2_tokenizer, tmp_path,
                                                     capsys):
    out = str(tmp_path / "head")
    result = train_eagle3_head.main([
        "--model", tiny_model_dir, "--out", out, "--prompts", "12", "--answer-tokens", "24",
        "--epochs", "3", "--batch", "4", "--draft-vocab", "256", "--aux-layers", "0,1,1"])
    printed = capsys.readouterr().out
    assert result["accuracy"].shape == (3,) and 0.0 < result["coverage"] <= 1.0
    losses = [float(line.split("train loss ")[1].split()[0])
              for line in printed.splitlines() if line.startswith("epoch ")]
    assert len(losses) == 3 and losses[-1] < losses[0], printed
    head = load_eagle3(out, "float32")
    assert head.cfg.draft_vocab_size == 256 and head.cfg.aux_layer_ids == (0, 1, 1)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = ["Once upon a time", "def fibonacci(n):"]
    args = {**ARGS, "max_num_seqs": 8}
    want = [o.outputs[0].token_ids for o in LLM(tiny_model_dir, tokenizer=smollm2_tokenizer,
                                                 **args).generate(prompts, greedy,
                                                                  use_tqdm=False)]
    spec = LLM(tiny_model_dir, tokenizer=smollm2_tokenizer, **args, speculative_config={
        "method": "eagle3", "model": out, "num_speculative_tokens": 3})
    spec.engine.speculator.gate.min_acceptance = 0.0
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, greedy, use_tqdm=False)]
    assert got == want
    assert spec.get_metrics()["jaxserve:spec_decode_num_draft_tokens"] > 0
    # The benchmark runs on the head: three engines, both workloads, every engine each round.
    from scripts.benchmarks import bench_eagle3

    runs = bench_eagle3.main(["--head", out, "--model", tiny_model_dir, "--rounds", "1",
                              "--max-tokens", "6", "--batch1", "1"])
    assert sorted(runs) == sorted((w, e) for w in ("batch 1", "batch 8")
                                  for e in ("none", "ngram", "eagle3"))
    assert all(r[0]["tokens"] > 0 for r in runs.values())
