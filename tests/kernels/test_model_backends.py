"""The model gives the same greedy output with the xla, cpu and pallas attention backends."""

from __future__ import annotations

from types import SimpleNamespace

import jax
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from models.config import ArchConfig
from models.linear import ServingChoice
from models.model import Model, random_params
from pallas_kernels import cpu_ffi

TINY = ArchConfig("LlamaForCausalLM", vocab_size=97, hidden_size=64, intermediate_size=96,
                  num_layers=3, num_heads=6, num_kv_heads=2, head_dim=16,
                  layer_windows=(0, 7, 0), max_position_embeddings=256)
# NOTE: a budget of 8 (prompts prefilled in chunks): the XLA paths compile two buckets (4
# and 8 tokens: the C++ kernel's from 8 on) and share them between the tests (and
# test_stacked_gemm.py's engine test); every compile counts, as the default tier runs cold.
ENGINE = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=8, num_kv_blocks=64)
# Pallas: its smallest bucket (16), as a mixed and a decode step (16 rows).
PALLAS_ENGINE = dict(max_num_seqs=16, max_num_batched_tokens=16)


def greedy(model, prompt_ids, max_tokens, tokenizer=None, decode_steps=None, **engine_args):
    """Greedy ids of one prompt through the engine (`LLM`), ignoring EOS; appends the steps
    that ran the paged decode kernel to `decode_steps` when given."""
    tokenizer = tokenizer or SimpleNamespace(eos_token_id=None)  # ids in, ids out
    llm = LLM(model, tokenizer=tokenizer, warmup=False, **{**ENGINE, **engine_args})
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            detokenize=False)
    out = llm.generate([{"prompt_token_ids": list(prompt_ids)}], params, use_tqdm=False)
    if decode_steps is not None:
        decode_steps.append(llm.engine.runner.num_decode_steps)
    return out[0].outputs[0].token_ids


@pytest.fixture(scope="module")
def tiny_params():
    # Sharper logits than the default init, so greedy choices are not near-ties.
    return jax.tree_util.tree_map(lambda x: x * 3.0, random_params(TINY, seed=7))


# NOTE: page size 16 is the engine's default: the xla and cpu engines compile the programs of
# test_many_decode_rows_same_on_xla_and_cpu (and of test_stacked_gemm's engine test) once.
@pytest.mark.parametrize("page_size", [16, pytest.param(8, marks=pytest.mark.slow)])
def test_tiny_model_greedy_same_on_both_backends(tiny_params, page_size):
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, TINY.vocab_size, 21)]
    outs, decode_steps = {}, []
    for backend in ("xla", "cpu", "pallas"):
        model = Model(TINY, tiny_params, serving=ServingChoice(backend))
        outs[backend] = greedy(model, prompt, 24, decode_steps=decode_steps,
                               block_size=page_size,
                               **(PALLAS_ENGINE if backend == "pallas" else {}))
    assert outs["xla"] == outs["cpu"] == outs["pallas"]
    assert len(set(outs["xla"])) > 3  # not a degenerate repetition
    # Pallas runs pure-decode steps on the paged decode kernel (all 23 after the prefill);
    # the XLA paths (the "cpu" backend's decode kernel included) have no separate decode
    # program: decode rows are split off inside the ragged step.
    assert decode_steps == [0, 0, 23]


@pytest.mark.skipif(not cpu_ffi.available(), reason="no CPU decode kernel here")
def test_many_decode_rows_same_on_xla_and_cpu(tiny_params):
    # Ten requests decode together (8-row steps: the C++ kernel's, not the 4-row bucket
    # that keeps the XLA decode part), one layer with a sliding window.
    rng = np.random.default_rng(1)
    prompts = [{"prompt_token_ids": [int(t) for t in rng.integers(0, TINY.vocab_size, n)]}
               for n in (3, 9, 14, 5, 21, 7, 11, 2, 17, 6)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                            detokenize=False)
    outs, hlo = {}, ""
    for backend in ("xla", "cpu"):
        llm = LLM(Model(TINY, tiny_params, serving=ServingChoice(backend)), warmup=False,
                  tokenizer=SimpleNamespace(eos_token_id=None), **ENGINE)
        outs[backend] = [o.outputs[0].token_ids
                         for o in llm.generate(prompts, params, use_tqdm=False)]
        runner = llm.engine.runner
        for (layout, _), step in runner.programs.model_steps().items():
            buf = np.zeros(layout.size, np.int32)
            hlo += step.lower(runner.params, runner.kv_pages, buf, runner.no_prev_ids).as_text()
    assert outs["xla"] == outs["cpu"]
    assert cpu_ffi.op.TARGET in hlo  # the cpu engine's steps called the kernel


@pytest.mark.slow
def test_smollm2_greedy_same_on_both_backends(smollm2, smollm2_tokenizer):
    ids = smollm2_tokenizer("The three primary colors are").input_ids
    pallas = Model(smollm2.cfg, smollm2.params, smollm2.dtype, serving=ServingChoice("pallas"))
    want = greedy(smollm2, ids, 12, smollm2_tokenizer)
    assert greedy(pallas, ids, 12, smollm2_tokenizer, **PALLAS_ENGINE) == want


def test_unknown_backend_is_an_error(tiny_params):
    with pytest.raises(ValueError, match="unknown attention backend 'triton'; choose one of"):
        Model(TINY, tiny_params, serving=ServingChoice("triton"))
