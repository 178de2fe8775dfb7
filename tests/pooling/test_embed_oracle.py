"""`LLM(runner="pooling").embed` against transformers' final-normed hidden states of the same
tiny random models (Llama, Qwen3, Gemma 2), pooled LAST / MEAN / CLS and normalized, with
prompts longer than a step's token budget (so MEAN and CLS are added up across chunks)."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve import LLM
from tests.conftest import TINY_ENGINE
from tests.e2e.hf_family import SMALL

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PROMPTS = ["The capital of France is",
           "Once upon a time, in a village by the sea, there lived an old fisherman who "
           "went out every morning before the sun rose, and came back every evening with "
           "a boat full of silver fish, which he sold at the market in the square. " * 2,
           "def add(a, b):\n    return a + b",
           "Hi"]
FAMILIES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(tie_word_embeddings=False)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(sliding_window=16, query_pre_attn_scalar=16, final_logit_softcapping=30.0,
                    attn_logit_softcapping=50.0, hidden_activation="gelu_pytorch_tanh")),
}


def pool(hidden: np.ndarray, kind: str) -> np.ndarray:
    """sentence-transformers-style pooling of [tokens, hidden] states."""
    return {"LAST": hidden[-1], "MEAN": hidden.mean(0), "CLS": hidden[0]}[kind]


def unit(v) -> np.ndarray:
    v = np.asarray(v, np.float64)
    return v / np.linalg.norm(v)


@pytest.fixture(scope="module")
def families(tiny_model_dir, smollm2_tokenizer, tmp_path_factory):
    """{family: (transformers model, directory)}: the tiny Llama and two built here."""
    torch.set_num_threads(1)
    out = {"llama": (transformers.AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, dtype=torch.float32, attn_implementation="eager").eval(),
        tiny_model_dir)}
    root = tmp_path_factory.mktemp("pooling_families")
    for name, (config_cls, model_cls, extra) in FAMILIES.items():
        config = getattr(transformers, config_cls)(**SMALL, **extra,
                                                   attn_implementation="eager")
        torch.manual_seed(0)
        hf = getattr(transformers, model_cls)(config).to(torch.float32).eval()
        path = str(root / name)
        hf.save_pretrained(path, safe_serialization=True)
        smollm2_tokenizer.save_pretrained(path)
        out[name] = (hf, path)
    return out


def hf_hidden(hf, ids: list[int]) -> np.ndarray:
    """The last of transformers' hidden states (after the final norm): f32[tokens, hidden]."""
    with torch.no_grad():
        out = hf(torch.tensor([ids]), output_hidden_states=True)
    return out.hidden_states[-1][0].numpy()


# NOTE: the default tier runs each pooling type once and each family once (a Latin square:
# Llama LAST, Qwen3 MEAN, Gemma 2 CLS); the other six pairs, each an engine of its own, in
# the slow tier.
DEFAULT_PAIRS = {("llama", "LAST"), ("qwen3", "MEAN"), ("gemma2", "CLS")}


@pytest.mark.parametrize("family,kind", [
    pytest.param(f, k, marks=[] if (f, k) in DEFAULT_PAIRS else [pytest.mark.slow(
        reason="its pooling type and its family each run in another default pair")])
    for k in ("LAST", "MEAN", "CLS") for f in ("llama", "qwen3", "gemma2")])
def test_embeddings_equal_transformers_pooled_hidden_states(families, family, kind):
    hf, path = families[family]
    llm = LLM(path, runner="pooling", pooler_config={"pooling_type": kind}, warmup=False,
              **TINY_ENGINE)
    outs = llm.embed(PROMPTS, use_tqdm=False)
    assert max(len(o.prompt_token_ids) for o in outs) > TINY_ENGINE["max_num_batched_tokens"]
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.finished and out.request_id.startswith("embd-")
        want = unit(pool(hf_hidden(hf, out.prompt_token_ids), kind))
        got = np.asarray(out.outputs.embedding)
        assert got.shape == want.shape
        assert np.linalg.norm(got) == pytest.approx(1.0, abs=1e-6)
        assert float(got @ want) > 1 - 1e-5, (family, kind, prompt[:20])
    # the pages went back (the prefix cache may keep full ones of LAST pooling)
    stats = llm.engine.kv.stats()
    assert stats.num_used_pages == 0
    assert stats.num_free_pages + stats.num_cached_pages == stats.num_total_pages
    assert not llm.engine.pooler.params and not llm.engine.states


def test_task_embed_and_override_pooler_config_are_vllms_older_spellings(families):
    hf, path = families["llama"]
    llm = LLM(path, task="embed", override_pooler_config={"pooling_type": "mean",
                                                          "normalize": False},
              warmup=False, **TINY_ENGINE)
    assert llm.engine.runner_type == "pooling"
    (out,) = llm.embed(PROMPTS[0], use_tqdm=False)
    want = pool(hf_hidden(hf, out.prompt_token_ids), "MEAN")
    np.testing.assert_allclose(out.outputs.embedding, want, rtol=1e-4, atol=1e-5)
