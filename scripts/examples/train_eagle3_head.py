"""A worked example: train an EAGLE-3 draft head for a model on its own generations.

1. The target (default: the embedded SmolLM2) answers a few hundred chat prompts, greedy,
   through the engine (`LLM.generate`).
2. Each conversation (prompt and answer) goes through the target's paged forward once more
   with `aux_layers`: the residual stream entering its low, middle and high layers
   (vLLM's default `(2, L // 2, L - 3)`) at every position.
3. The draft vocabulary is the answers' most frequent tokens (`d2t` maps it into the
   target's); a one-layer head (the target's widths) is trained with optax on the answer
   positions: teacher forcing plus unrolled draft steps (`eagle3_training`).
4. The head is saved in the EAGLE-3 layout: serve it with
   `speculative_config={"method": "eagle3", "model": OUT, "num_speculative_tokens": 3}`.

Each epoch prints the loss and every unrolled step's top-1 accuracy on held-out
conversations: the acceptance rate to expect at each draft position.

Usage: python -m scripts.examples.train_eagle3_head [--out DIR] [--prompts 320]
       [--answer-tokens 192] [--epochs 6] [--draft-vocab 2048] [--steps 3] [--model PATH]
       [--aux-layers 2,15,27] [--intermediate-size N]
"""

from __future__ import annotations

import argparse
import itertools
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxserve import LLM, SamplingParams
from jaxserve.spec_decode.eagle_setup import target_embedding
from jaxserve.utils import cdiv
from models.default_model import default_model_path
from models.eagle3 import Eagle3Config, default_aux_layers
from models.loaders import load_model, load_tokenizer
from models.loaders.eagle3 import llama_layer_config, save_eagle3
from models.registry import arch_config_from_hf
from scripts.examples import eagle3_training
from scripts.examples.rl_update_weights import paged_forward

TOPICS = ["gardening", "the ocean", "electric cars", "coffee", "the moon", "chess",
          "volcanoes", "bicycles", "machine learning", "the Roman Empire", "baking bread",
          "photography", "climate change", "honeybees", "jazz music", "mountains",
          "the internet", "sleep", "soccer", "recycling", "dinosaurs", "space travel",
          "libraries", "rain forests", "cats", "the human heart", "solar energy", "trains",
          "ancient Egypt", "friendship", "vaccines", "the stock market", "dogs", "rivers",
          "smartphones", "yoga", "pizza", "the French Revolution", "earthquakes", "deserts",
          "airplanes", "video games", "the immune system", "wind turbines", "museums",
          "birds", "chocolate", "the Olympic Games", "black holes", "forests", "painting",
          "robots", "public transport", "nutrition", "the Renaissance", "glaciers",
          "cryptography", "board games", "tigers", "learning a language", "camping",
          "the printing press", "music festivals", "rice", "electricity", "whales",
          "meditation", "bridges", "the Vikings", "hurricanes", "cheese", "astronomy",
          "running shoes", "democracy", "mushrooms", "skyscrapers", "the brain",
          "social media", "islands", "ballet", "batteries", "wolves", "knitting",
          "the Silk Road", "tornadoes", "spices", "telescopes", "opera", "bees and flowers",
          "cloud computing", "rainbows", "horses", "architecture", "fairy tales", "ants",
          "the Industrial Revolution"]
TEMPLATES = ["Explain {} to a beginner.", "Write a short story about {}.",
             "What are the advantages and disadvantages of {}?", "Give me three tips about {}.",
             "Write a short poem about {}.", "Summarize the history of {}.",
             "How does {} work?", "Write an email to a friend about {}.",
             "List five facts about {}.", "Why do people care about {}?",
             "Describe {} in one paragraph.", "What are common misconceptions about {}?",
             "Write a dialogue between two people about {}.",
             "Teach a child about {} in simple words."]


def chat_prompts(tokenizer, topics=TOPICS, templates=TEMPLATES, limit: int | None = None
                 ) -> list[list[int]]:
    """Token ids of every (template, topic) chat prompt, templates varying fastest."""
    texts = [t.format(topic) for topic, t in itertools.product(topics, templates)][:limit]
    return [list(tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                               add_generation_prompt=True, tokenize=True,
                                               return_dict=False)) for text in texts]


def aux_states_fn(model, layers: tuple[int, ...]):
    """Jitted `(params, i32[L] ids padded, i32[] length) -> [L, n, H]`: the residual stream
    entering `layers` at each position, from the model's paged forward (one request)."""
    @jax.jit
    def fn(params, ids, num):
        return paged_forward(model, params, ids, num, aux_layers=layers)[2]
    return fn


def head_layer(cfg, intermediate_size: int | None = None):
    """The head's decoder layer: one Llama layer of the target's widths (`cfg`), its MLP
    `intermediate_size` wide (default: the target's), as `save_eagle3` writes it."""
    hf = llama_layer_config(cfg, cfg.vocab_size)
    return arch_config_from_hf({**hf, "intermediate_size": intermediate_size
                                or cfg.intermediate_size})


def _padded(seq: list[int], length: int) -> np.ndarray:
    """i32[length] the tokens, zeros after them."""
    out = np.zeros(length, np.int32)
    out[:len(seq)] = seq
    return out


def _next_tokens(seq: list[int], length: int) -> np.ndarray:
    """i32[length] the token after each position (0 past the end)."""
    out = np.zeros(length, np.int32)
    out[:len(seq) - 1] = seq[1:]
    return out


def draft_vocabulary(answers: list[list[int]], size: int) -> np.ndarray:
    """i64[size] the `size` most frequent answer tokens, ascending (ties: smaller id)."""
    counts = np.bincount(np.concatenate([np.asarray(a, np.int64) for a in answers]))
    order = np.lexsort((np.arange(len(counts)), -counts))[:size]
    return np.sort(order)


def main(argv: list[str] | None = None) -> dict:
    """Generates, collects the target's states, trains and saves a head.

    Args:
        argv: Command-line arguments (default: `sys.argv[1:]`).

    Returns:
        {"out": the head's directory, "accuracy": f32[steps] held-out top-1 accuracy per
        unrolled step after the last epoch, "coverage": the answers' share of tokens in the
        draft vocabulary}.
    """
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="the target (default: SmolLM2)")
    ap.add_argument("--out", default="eagle3-head")
    ap.add_argument("--prompts", type=int, default=320)
    ap.add_argument("--answer-tokens", type=int, default=192)
    ap.add_argument("--draft-vocab", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=3, help="unrolled draft steps in training")
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--batch", type=int, default=8, help="conversations per optimizer step")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--held-out", type=float, default=0.1, help="share kept for evaluation")
    ap.add_argument("--intermediate-size", type=int, default=None,
                    help="the head's MLP width (default: the target's; narrower drafts faster)")
    ap.add_argument("--aux-layers", default=None,
                    help="target layers the head reads, e.g. 2,15,27 (default: vLLM's)")
    args = ap.parse_args(argv)

    path = args.model or default_model_path()
    tokenizer, model = load_tokenizer(path), load_model(path)
    cfg = model.cfg
    prompts = chat_prompts(tokenizer, limit=args.prompts)
    length = max(map(len, prompts)) + args.answer_tokens
    length = cdiv(length, 64) * 64
    t0 = time.perf_counter()
    llm = LLM(model, tokenizer=tokenizer, max_num_seqs=64, max_model_len=length,
              max_num_batched_tokens=256)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=args.answer_tokens),
                        use_tqdm=False)
    answers = [list(o.outputs[0].token_ids) for o in outs]
    del llm
    print(f"generated {sum(map(len, answers))} tokens for {len(prompts)} prompts in "
          f"{time.perf_counter() - t0:.0f} s")

    layers = tuple(sorted(int(i) for i in args.aux_layers.split(","))) if args.aux_layers \
        else default_aux_layers(cfg.num_layers)
    t0 = time.perf_counter()
    seqs = [p + a for p, a in zip(prompts, answers, strict=True)]
    aux_of = aux_states_fn(model, layers)
    aux = np.stack([np.asarray(aux_of(model.params, _padded(s, length), np.int32(len(s))),
                               np.float32) for s in seqs])  # [N, L, n, H]
    embed = jax.jit(target_embedding(model))
    embeds = np.stack([np.asarray(embed(model.params, _next_tokens(s, length)), np.float32)
                       for s in seqs])  # [N, L, H]: the token after each position
    print(f"target states of {len(seqs)} conversations in {time.perf_counter() - t0:.0f} s")

    vocab = draft_vocabulary(answers, min(args.draft_vocab, cfg.vocab_size))
    to_draft = np.full(cfg.vocab_size, -1, np.int64)
    to_draft[vocab] = np.arange(len(vocab))
    labels = np.full((len(seqs), length), -1, np.int32)  # the draft id of the token at r + 2
    for i, (p, s) in enumerate(zip(prompts, seqs, strict=True)):
        r = np.arange(len(p) - 2, len(s) - 2)  # positions whose r + 2 is an answer token
        labels[i, r] = to_draft[np.asarray(s)[r + 2]]
    coverage = float(np.mean(np.concatenate([to_draft[a] >= 0 for a in answers])))
    print(f"draft vocabulary: {len(vocab)} tokens cover {coverage:.1%} of the answers")

    head_cfg = Eagle3Config(head_layer(cfg, args.intermediate_size), cfg.vocab_size,
                            len(vocab), cfg.hidden_size, layers)
    rows = np.asarray(embed(model.params, vocab.astype(np.int32)), np.float32) \
        if cfg.tie_word_embeddings else None
    params = jax.tree_util.tree_map(jnp.asarray, eagle3_training.init_params(head_cfg, rows))
    trained = train(head_cfg, params, aux, embeds, labels, args)
    params = {**trained["params"], "d2t": vocab - np.arange(len(vocab))}
    save_eagle3(args.out, head_cfg, params)
    print(f"saved the head to {args.out}")
    return {"out": args.out, "accuracy": trained["accuracy"], "coverage": coverage}


def train(cfg: Eagle3Config, params: dict, aux: np.ndarray, embeds: np.ndarray,
          labels: np.ndarray, args) -> dict:
    """AdamW (warm-up, cosine decay, clipping) over shuffled batches of conversations; the
    last `args.held_out` of them are kept out and scored after each epoch.

    Returns:
        {"params": the trained weights (NumPy), "accuracy": f32[steps] held-out top-1
        accuracy of each unrolled step after the last epoch}.
    """
    n = len(labels)
    held = max(1, int(round(n * args.held_out)))
    train_idx, eval_idx = np.arange(n - held), np.arange(n - held, n)
    per_epoch = cdiv(len(train_idx), args.batch)
    total = per_epoch * args.epochs
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, max(1, total // 20), total,
                                                  args.lr / 20)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.0))
    state = opt.init(params)
    weights = tuple(0.8 ** s for s in range(args.steps))

    def loss_fn(p, a, e, lab):
        return eagle3_training.loss_and_accuracy(cfg, p, a, e, lab, weights, args.steps)

    @jax.jit
    def step(p, st, a, e, lab):
        (loss, acc), grads = jax.value_and_grad(loss_fn, has_aux=True)(p, a, e, lab)
        updates, st = opt.update(grads, st, p)
        return optax.apply_updates(p, updates), st, loss, acc

    evaluate = jax.jit(loss_fn)
    rng = np.random.default_rng(0)
    accuracy = None
    for epoch in range(args.epochs):
        t0, losses = time.perf_counter(), []
        order = rng.permutation(train_idx)
        for i in range(per_epoch):
            idx = order[i * args.batch:(i + 1) * args.batch]
            idx = np.resize(idx, args.batch)  # the last batch repeats some (one shape)
            params, state, loss, _ = step(params, state, aux[idx], embeds[idx], labels[idx])
            losses.append(float(loss))
        results = [evaluate(params, aux[i:i + 1], embeds[i:i + 1], labels[i:i + 1])
                   for i in eval_idx]
        mask = np.array([(labels[i] >= 0).sum() for i in eval_idx], np.float64)
        accuracy = np.sum([np.asarray(a) * m for (_, a), m in zip(results, mask,
                                                                   strict=True)], 0) / mask.sum()
        print(f"epoch {epoch}: train loss {np.mean(losses):.3f}  held-out loss "
              f"{np.mean([float(x) for x, _ in results]):.3f}  top-1 per step "
              f"{' '.join(f'{a:.3f}' for a in accuracy)}  ({time.perf_counter() - t0:.0f} s)")
    return {"params": jax.tree_util.tree_map(np.asarray, params), "accuracy": accuracy}


if __name__ == "__main__":
    main()
