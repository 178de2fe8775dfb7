"""Two processes joined by jax.distributed serve one tensor-parallel model across "hosts"."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

from models.config import ArchConfig

TINY = ArchConfig("LlamaForCausalLM", vocab_size=256, hidden_size=64, intermediate_size=128,
                  num_layers=2, num_heads=8, num_kv_heads=2, head_dim=8,
                  max_position_embeddings=512, eos_token_ids=(2,))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_tiny(**engine_args) -> list[list[int]]:
    """Greedy tokens of the tiny model on three prompts (the same in every process)."""
    from jaxserve import LLM, SamplingParams
    from models.loaders import load_tokenizer
    from models.model import Model, random_params

    params = jax.tree_util.tree_map(lambda x: x * 3.0, random_params(TINY, seed=3))
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": [int(t) for t in rng.integers(3, 256, n)]}
               for n in (5, 17, 33)]
    # NOTE: one token bucket (16; prompts are chunked): each process's warm-up compiles one
    # model step.
    llm = LLM(Model(TINY, params), tokenizer=load_tokenizer(None), max_num_seqs=4,
              max_num_batched_tokens=16, max_model_len=128, kv_cache_memory_gib=0.01,
              **engine_args)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, detokenize=False),
                        use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.slow
def test_two_processes_match_one_device(smollm2_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    env = {**os.environ, "PYTHONPATH": ROOT}
    env.pop("XLA_FLAGS", None)
    procs = [subprocess.Popen([sys.executable, "-m", "tests.parallel.multihost_worker",
                               address, str(i)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(2)]
    results = []
    for p in procs:
        out, _ = p.communicate(timeout=400)
        assert p.returncode == 0, out[-3000:]
        line = [x for x in out.splitlines() if x.startswith("RESULT ")][-1]
        results.append(json.loads(line[len("RESULT "):]))
    want = run_tiny(warmup=False)  # this process, one device: only the steps it runs
    for r in results:
        assert r["devices"] == 4  # 2 processes x 2 devices: the mesh spans both
        assert r["tokens"] == want
