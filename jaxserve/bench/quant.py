"""Accuracy, memory and speed of each weight / KV-cache format, measured in one run.

Accuracy is measured against float32 transformers on the same weights (the dequantized
GGUF file): teacher-forced logits of fixed prompts (max |diff| and KL(hf || mode)), and
perplexity of a fixed public-domain text. Greedy agreement compares 256-token greedy
continuations of 16 prompts with the float32 engine's, which the test suite holds
token-identical to transformers' greedy decoding.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import AttentionMetadata
from pallas_kernels.kv_quant import kv_pool_layout

# (name, load arguments, kv_cache_dtype): the modes of the table, the float32 baseline first.
MODES = [
    ("float32", {"quantization": "none"}, "auto"),
    ("gguf (as stored)", {"quantization": "gguf"}, "auto"),
    ("q8_0", {"quantization": "q8_0"}, "auto"),
    ("int8", {"quantization": "int8"}, "auto"),
    ("bfloat16", {"quantization": "none", "dtype": "bfloat16"}, "auto"),
    ("kv int8", {"quantization": "none"}, "int8"),
    ("kv fp8_e4m3", {"quantization": "none"}, "fp8_e4m3"),
    ("kv fp8_e5m2", {"quantization": "none"}, "fp8_e5m2"),
    ("gguf + kv int8", {"quantization": "gguf"}, "int8"),
]
LOGIT_PROMPTS = [
    "The history of the Roman Empire",
    "def quicksort(items):\n    ",
    "<|im_start|>user\nWhat is the boiling point of water?<|im_end|>\n<|im_start|>assistant\n",
    "In 1969, the first humans landed on",
]
# 16 chat prompts for the greedy-agreement column (ChatML, the default model's template).
GREEDY_QUESTIONS = [
    "Write a short story about a lighthouse keeper.", "Explain how a bicycle works.",
    "List five uses of vinegar at home.", "What causes the seasons on Earth?",
    "Describe the water cycle for a child.", "Give me a recipe for pancakes.",
    "Why is the sky blue?", "Write a poem about autumn leaves.",
    "How do vaccines train the immune system?", "Summarize the plot of Cinderella.",
    "What is a prime number? Give examples.", "Explain recursion in programming.",
    "Plan a one-day trip to a mountain lake.", "What are the planets of the solar system?",
    "How do I care for a cactus?", "Tell me about the history of tea.",
]
GREEDY_PROMPTS = [f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"
                  for q in GREEDY_QUESTIONS]
TEXT_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "tests", "data",
                         "pride_and_prejudice.txt")


def _teacher_forced(model, token_ids: list[int], kv_cache_dtype: str, page_size: int):
    """`params -> f32[T, vocab]` logits of one sequence in one step through a fresh page
    pool of the format (one compiled program for every `params` of the same shapes)."""
    t = len(token_ids)
    num_pages = -(-t // page_size) + 1
    shape, dtype = kv_pool_layout(model.kv_pages_shape(num_pages, page_size), model.kv_dtype,
                                  kv_cache_dtype)
    pages = np.arange(1, num_pages, dtype=np.int32)
    pos = np.arange(t, dtype=np.int32)
    md = AttentionMetadata(
        slot_mapping=jnp.asarray(pages[pos // page_size] * page_size + pos % page_size),
        block_tables=jnp.asarray(pages[None]), kv_lens=jnp.asarray([t], jnp.int32),
        cu_q_lens=jnp.asarray([0, t], jnp.int32))

    @jax.jit
    def run(params, ids, positions, kv, md):
        _, hidden = model.forward(params, ids, positions, kv, md)
        return model.compute_logits(params, hidden)

    ids, positions = jnp.asarray(token_ids, jnp.int32), jnp.asarray(pos)
    return lambda params: np.asarray(run(params, ids, positions, jnp.zeros(shape, dtype), md))


def teacher_forced_logits(model, token_ids: list[int], kv_cache_dtype: str = "auto",
                          page_size: int = 16) -> np.ndarray:
    """f32[T, vocab] logits of one sequence in one step through a page pool of the format."""
    return _teacher_forced(model, token_ids, kv_cache_dtype, page_size)(model.params)


def perplexity_draws(model, token_ids: list[int], kv_cache_dtype: str, draws: int,
                     noise: float = 1e-6, page_size: int = 16) -> list[float]:
    """Perplexities of `draws` teacher-forced runs: the weights as they are, then copies
    whose small float32 arrays (the norms) carry relative noise of `noise` (seeded; far
    below any weight format's rounding).

    NOTE: with an 8-bit KV cache the forward pass is chaotic: a code that rounds the other
    way moves the next layers' inputs by a rounding step, which flips more codes, so one
    run is one draw of the format's error. Measured on 192 tokens of the test text
    (float32 weights, 12 draws): fp8_e5m2 perplexity +1.8% on average, from -0.8% to
    +3.2% (sd 1.0%); fp8_e4m3 -0.2% (sd 0.3%). Their mean is the format's accuracy.
    """
    run = _teacher_forced(model, token_ids, kv_cache_dtype, page_size)
    leaves, tree = jax.tree.flatten(model.params)
    leaves = [np.asarray(x) for x in leaves]  # once, not per draw
    # NOTE: the noise goes on the small float32 leaves only (the norms: each under 1% of
    # the parameters), which feed every layer's projections, so it reaches the rounding
    # all the same. Noise on every weight cost ~4 s per draw on the default model (1 s for
    # the run itself), and gave the same spread (12 draws each: fp8_e5m2 +1.81% sd 0.56%
    # with all weights, +1.63% sd 0.48% with the norms; fp8_e4m3 -0.14% sd 0.22 / 0.28%;
    # int8 +0.16% / +0.21%, sd 0.10 / 0.11%).
    small = sum(x.size for x in leaves) // 100
    out = []
    for seed in range(draws):
        params = model.params
        if seed:
            rng = np.random.default_rng(seed)
            params = jax.tree.unflatten(tree, [
                x + x * (np.float32(noise) * rng.standard_normal(x.shape, np.float32))
                if x.dtype == np.float32 and x.size <= small else x for x in leaves])
        out.append(perplexity(run(params), token_ids))
    return out


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def perplexity(logits: np.ndarray, token_ids: list[int]) -> float:
    """exp(mean NLL) of tokens 1.. given their prefixes (row t predicts token t + 1)."""
    lp = log_softmax(logits[:-1])
    return float(np.exp(-lp[np.arange(len(token_ids) - 1), token_ids[1:]].mean()))


def logit_errors(ours: np.ndarray, ref: np.ndarray) -> tuple[float, float]:
    """(max |ours - ref|, mean KL(ref || ours)) over positions."""
    lr, lo = log_softmax(ref), log_softmax(ours)
    kl = (np.exp(lr) * (lr - lo)).sum(-1).mean()
    return float(np.abs(ours - ref).max()), float(kl)


def hf_reference(path, tokenizer, prompts_ids: list[list[int]], text_ids: list[int]) -> dict:
    """transformers float32 logits of each prompt and of the text."""
    import torch

    from jaxserve.bench.hf_baseline import load_hf_model

    hf = load_hf_model(path, "float32")
    with torch.no_grad():
        run = lambda ids: hf(torch.tensor([ids])).logits[0].float().numpy()
        return {"prompts": [run(ids) for ids in prompts_ids], "text": run(text_ids)}


def greedy_outputs(llm, prompts: list[str], max_tokens: int) -> list[list[int]]:
    from jaxserve.sampling_params import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]


def agreement(outs: list[list[int]], ref: list[list[int]]) -> tuple[float, float]:
    """(mean fraction of tokens before the first divergence, fraction of identical outputs)."""
    prefix = []
    for a, b in zip(outs, ref, strict=True):
        n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(b))
        prefix.append(n / len(b))
    return float(np.mean(prefix)), float(np.mean([a == b for a, b in zip(outs, ref,
                                                                           strict=True)]))


def _mode_engine(model, tok, load_args: dict, kv: str, batches, kv_gib: float,
                 warmup: bool = True):
    """The benchmark's `LLM` over `model` in one mode (sized for the largest batch)."""
    from jaxserve.bench.engine_run import make_llm

    return make_llm(model, tok, kv_cache_dtype=kv, max_num_seqs=max(batches),
                    max_num_batched_tokens=max(64, max(batches)), max_model_len=512,
                    kv_cache_memory_gib=kv_gib, dtype=load_args.get("dtype", "float32"),
                    warmup=warmup)


def _memory_and_speed(model, eng, batches, context: int, num_steps: int) -> dict:
    """Measured weight and KV bytes, KV capacity, decode tok/s per batch, load average."""
    from jaxserve.bench.roofline import measure_decode

    row = {"weight_mib": sum(x.nbytes for x in jax.tree_util.tree_leaves(model.params))
           / 2**20,
           "kv_bytes_per_token": eng.runner.kv_pages.nbytes
           / (eng.limits.num_pages * eng.config.cache.page_size),
           "kv_capacity_tokens": eng.kv_capacity_tokens}
    for b in batches:
        row[f"tok_s_b{b}"] = b / measure_decode(eng, b, context, num_steps)["step_s"]
    row["load_avg"] = os.getloadavg()[0]
    return row


def run_quant_bench(model_path, modes=MODES, *, greedy_prompts: int = 16,
                    greedy_tokens: int = 256, batches=(1, 32), context: int = 128,
                    kv_gib: float = 1.0, num_steps: int = 5,
                    speed_only: bool = False) -> list[dict]:
    """One row per mode: accuracy, measured bytes, KV capacity and decode speed.

    With `speed_only`, bytes, capacity and speed only (for modes too slow on this CPU for
    the accuracy passes), on engines that compile only the buckets the steps use.
    """
    from models.loaders import load_model, load_tokenizer

    tok = load_tokenizer(model_path)
    rows = []
    if speed_only:
        for name, load_args, kv in modes:
            model = load_model(model_path, **load_args)
            llm = _mode_engine(model, tok, load_args, kv, batches, kv_gib, warmup=False)
            rows.append({"mode": name, **_memory_and_speed(model, llm.engine, batches,
                                                           context, num_steps)})
            print(rows[-1], flush=True)
            del llm, model
        return rows
    with open(TEXT_PATH) as f:
        text_ids = tok.encode(f.read())
    prompts_ids = [tok.encode(p) for p in LOGIT_PROMPTS]
    ref = hf_reference(model_path, tok, prompts_ids, text_ids)
    ref_ppl = perplexity(ref["text"], text_ids)
    greedy = GREEDY_PROMPTS[:greedy_prompts]
    ref_greedy = None
    for name, load_args, kv in modes:
        model = load_model(model_path, **load_args)
        errs = [logit_errors(teacher_forced_logits(model, ids, kv), r)
                for ids, r in zip(prompts_ids, ref["prompts"], strict=True)]
        ppl = perplexity(teacher_forced_logits(model, text_ids, kv), text_ids)
        llm = _mode_engine(model, tok, load_args, kv, batches, kv_gib)
        outs = greedy_outputs(llm, greedy, greedy_tokens)
        ref_greedy = ref_greedy or outs
        agree, identical = agreement(outs, ref_greedy)
        rows.append({"mode": name, "max_abs_logit": max(e[0] for e in errs),
                     "kl": float(np.mean([e[1] for e in errs])), "ppl": ppl,
                     "ppl_ratio": ppl / ref_ppl, "ref_ppl": ref_ppl, "greedy_prefix": agree,
                     "greedy_identical": identical,
                     **_memory_and_speed(model, llm.engine, batches, context, num_steps)})
        print(rows[-1], flush=True)
        del llm, model
    return rows
