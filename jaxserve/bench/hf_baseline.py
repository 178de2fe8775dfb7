"""Baseline: transformers' `generate` on static, padded batches (PyTorch), timed per token.

Requests are taken in trace order in batches of `batch_size`; each batch is left-padded
to its longest prompt and generates greedily for its longest output (EOS suppressed), as
a classic static-batching server would. Only each request's own `output_len` tokens
count as useful output; the padding and the extra tokens are the waste static batching
pays. A logits processor stamps the time of every generation step, which gives each
request's token times (TTFT, ITL) on the same clock as the engine runs.
"""

from __future__ import annotations

import os
import time

from jaxserve.bench.stats import RequestTiming, summarize
from jaxserve.bench.workloads import TraceRequest


def torch_missing() -> str | None:
    """Why the transformers baseline cannot run here (one line with the fix), or None."""
    import importlib.util

    missing = [m for m in ("torch", "accelerate") if importlib.util.find_spec(m) is None]
    if not missing:
        return None
    return (f"{' and '.join(missing)} not installed (pip install {' '.join(missing)}; on a "
            "CPU machine: pip install torch --index-url https://download.pytorch.org/whl/cpu)")


def load_hf_model(path: str, dtype: str = "float32"):
    """transformers' model from the same weights the engine loads (as tests/conftest.py).

    Args:
        path: A GGUF file or a Hugging Face directory (what `models.loaders.resolve_model`
            accepts, the embedded default included).

    Raises:
        ValueError: `path` is a jaxserve (orbax) checkpoint, which transformers cannot read.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from models.loaders import resolve_model

    kind, path = resolve_model(path)
    if kind == "jaxserve":
        raise ValueError(f"{path} is a jaxserve checkpoint, which transformers cannot load; "
                         "give the GGUF file or Hugging Face directory it came from, or "
                         "--baseline none")
    if kind == "gguf":
        directory, name = os.path.split(path)
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name,
                                                     dtype=getattr(torch, dtype))
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    model.eval()
    return model


def run_hf_static(model, trace: list[TraceRequest], token_ids: list[list[int]], *,
                  batch_size: int = 16, pad_token_id: int = 0,
                  sampling: dict | None = None) -> dict:
    """Runs the trace through `model.generate` in static padded batches.

    Args:
        sampling: temperature / top_p / top_k as the engine gets them; greedy without
            (or at temperature 0).

    Returns:
        The `summarize` fields over useful tokens (all requests arrive at time 0), plus
        `padded_prompt_tokens` and `generated_tokens` (useful or not) for the waste.
    """
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    class Stamp(LogitsProcessor):
        def __init__(self):
            self.times: list[float] = []

        def __call__(self, input_ids, scores):
            self.times.append(time.perf_counter())
            return scores

    def batch(idx):
        width = max(len(token_ids[i]) for i in idx)
        ids = torch.full((len(idx), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        for row, i in enumerate(idx):
            p = token_ids[i]
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        return ids, mask

    opts = {"do_sample": False}
    if sampling and sampling.get("temperature", 0.0) > 0:
        opts = {"do_sample": True, "temperature": sampling["temperature"],
                "top_p": sampling.get("top_p", 1.0), "top_k": sampling.get("top_k", 0) or 0}

    def generate(ids, mask, new, processors):
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                           min_new_tokens=new, pad_token_id=pad_token_id,
                           logits_processor=LogitsProcessorList(processors), **opts)

    # NOTE: PyTorch's first generate call in a process is several times slower than later
    # ones (allocator and kernel set-up); a short call at the batch size warms it, as the
    # engine's own warm-up is excluded from its timings.
    ids, mask = batch(list(range(min(batch_size, len(trace)))))
    generate(ids[:, -16:], mask[:, -16:], 4, [])
    timings = [RequestTiming(0.0, r.prompt_len) for r in trace]
    padded = generated = 0
    start = time.perf_counter()
    for b in range(0, len(trace), batch_size):
        idx = list(range(b, min(b + batch_size, len(trace))))
        ids, mask = batch(idx)
        width = ids.shape[1]
        new = max(trace[i].output_len for i in idx)
        stamp = Stamp()
        generate(ids, mask, new, [stamp])
        padded += len(idx) * width
        generated += len(idx) * new
        for i in idx:
            timings[i].token_times = [t - start for t in stamp.times[:trace[i].output_len]]
    duration = time.perf_counter() - start
    res = summarize(timings, duration)
    res.update({"padded_prompt_tokens": padded, "generated_tokens": generated,
                "batch_size": batch_size})
    return res
