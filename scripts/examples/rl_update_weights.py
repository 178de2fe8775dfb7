"""A worked example: a JAX training loop that updates the serving engine's weights in place.

A tiny random model with SmolLM2's tokenizer (so prompts are real text) is served by an
`LLM`; a plain `jax.grad` training step (SGD on the cross-entropy of a target answer) changes
its LM head, and `llm.update_weights(params)` hands the whole params tree to the engine
between generations: no restart, no recompile, the parameters never leave the device. Each
round prints the loss, the greedy answer, the compilations since warm-up and the process
RSS (flat across rounds: the old weights are dropped).

NOTE: only the LM head is trained: the hidden states come from the model's own paged
forward, whose attention (the XLA path's loop over KV blocks of a dynamic count) has no
reverse-mode derivative; a training program would use its own dense attention for the
trunk and hand the result to `update_weights` the same way.

Usage: python -m scripts.examples.rl_update_weights [--rounds 10] [--steps 5] [--lr 0.5]
       [--model PATH]  (whose tokenizer and architecture the tiny model takes; default:
                        the embedded SmolLM2)
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve import LLM, SamplingParams
from jaxserve.bench.scale import rss_mib
from jaxserve.utils import cdiv
from models.default_model import default_model_path
from models.linear import ServingChoice
from models.loaders import load_tokenizer, read_arch_config
from models.model import Model, random_params
from pallas_kernels import AttentionMetadata

PROMPT = "Question: what is the capital of France? Answer:"
ANSWER = " Paris is the capital of France."


def paged_forward(model: Model, params, ids, num=None, page_size: int = 16, **kwargs):
    """`model.forward` of one request of tokens `ids` (i32[L], padded past `num`: traced
    or None for all L) in a small pool of its own; `kwargs` go to `Model.forward`."""
    length = ids.shape[0]
    pages = cdiv(length, page_size)
    num = jnp.int32(length) if num is None else num
    md = AttentionMetadata(slot_mapping=jnp.arange(length, dtype=jnp.int32) + page_size,
                           block_tables=jnp.arange(1, pages + 1, dtype=jnp.int32)[None],
                           kv_lens=jnp.reshape(num, (1,)),
                           cu_q_lens=jnp.stack([jnp.int32(0), num]))
    kv = jnp.zeros(model.kv_pages_shape(pages + 1, page_size), model.dtype)
    return model.forward(params, jnp.asarray(ids, jnp.int32),
                         jnp.arange(length, dtype=jnp.int32), kv, md, **kwargs)


def answer_hidden(model: Model, params, ids: np.ndarray, num_prompt: int,
                  page_size: int = 16) -> jax.Array:
    """The final hidden states [len(answer), hidden] that predict each answer token,
    teacher-forced through the model's paged forward (one request in a small pool)."""
    _, hidden = paged_forward(model, params, ids, page_size=page_size)
    return hidden[num_prompt - 1:-1]


def main(argv: list[str] | None = None) -> None:
    """Trains the tiny model's LM head for `--rounds` rounds, handing the engine the new
    weights after each.

    Args:
        argv: Command-line arguments (default: `sys.argv[1:]`).
    """
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--steps", type=int, default=1, help="SGD steps per round")
    ap.add_argument("--lr", type=float, default=0.08)
    ap.add_argument("--model", default=None,
                    help="the model whose tokenizer and architecture to shrink (default: SmolLM2)")
    args = ap.parse_args(argv)

    path = args.model or default_model_path()
    tokenizer = load_tokenizer(path)
    cfg = dataclasses.replace(read_arch_config(path), hidden_size=64, intermediate_size=128,
                              num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                              layer_windows=(0, 0), tie_word_embeddings=False)
    model = Model(cfg, random_params(cfg, seed=0), source="tiny-random",
                  serving=ServingChoice("xla"))
    llm = LLM(model, tokenizer=tokenizer, attention_backend="xla", max_num_seqs=8,
              max_num_batched_tokens=16, max_model_len=128, num_kv_blocks=64)
    prompt_ids = tokenizer(PROMPT)["input_ids"]
    answer_ids = tokenizer(ANSWER)["input_ids"]
    ids = np.array(prompt_ids + answer_ids)
    hidden = jax.jit(lambda p: answer_hidden(model, p, ids, len(prompt_ids)))(model.params)
    targets = jnp.asarray(answer_ids, jnp.int32)

    def loss(head, params):
        logits = model.compute_logits({**params, "lm_head": head}, hidden)
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, targets[:, None], axis=-1))

    @jax.jit
    def train_step(params):
        value, grad = jax.value_and_grad(loss)(params["lm_head"], params)
        head = jax.tree_util.tree_map(lambda p, g: p - args.lr * g, params["lm_head"], grad)
        return {**params, "lm_head": head}, value

    params = model.params
    greedy = SamplingParams(temperature=0.0, max_tokens=len(answer_ids), ignore_eos=True)
    first = llm.generate(PROMPT, greedy, use_tqdm=False)[0].outputs[0].text
    print(f"target: {ANSWER!r}; before training: {first!r}")
    for r in range(args.rounds):
        for _ in range(args.steps):
            params, value = train_step(params)
        start = time.perf_counter()
        llm.update_weights(params)
        swap = time.perf_counter() - start
        text = llm.generate(PROMPT, greedy, use_tqdm=False)[0].outputs[0].text
        print(f"round {r}: loss {float(value):.3f}  update_weights {swap * 1e3:.1f} ms  "
              f"compiles {llm.engine.runner.num_compilations}  RSS {rss_mib():.0f} MiB  "
              f"-> {text!r}")


if __name__ == "__main__":
    main()
