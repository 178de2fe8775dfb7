"""A worked example: several LoRA adapters served per request by one engine, beside the base.

The engine is built with `enable_lora=True`; each request names its adapter with a
`LoRARequest` (or none, for the base model), and requests with different adapters share
the same steps: nothing recompiles when an adapter is loaded or evicted. Adapters are PEFT
directories (`adapter_config.json` + `adapter_model.safetensors`); given none, this writes
two random ones for the model (`jaxserve.bench.lora_adapters.write_random_adapter`: random
A and B on every projection, so each changes the greedy text, meaninglessly). Printed: each
request's adapter and text, and the compilations after warm-up (0).

Usage: python -m scripts.examples.lora_adapters [--model PATH] [--adapter NAME=DIR ...]
       [--max-tokens 12]
"""

from __future__ import annotations

import argparse
import os
import tempfile

from jaxserve import LLM, SamplingParams
from jaxserve.bench.lora_adapters import write_random_adapter
from jaxserve.lora import LoRARequest
from models.default_model import default_model_path
from models.loaders import read_arch_config

PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):"]
RANK = 8


def main(argv: list[str] | None = None) -> list[tuple[str, str]]:
    """Generates every prompt on the base model and on each adapter, in one batch.

    Args:
        argv: Command-line arguments (default: `sys.argv[1:]`).

    Returns:
        (adapter name or "base", generated text) for every request, in order.
    """
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="base model (default: SmolLM2)")
    ap.add_argument("--adapter", action="append", default=[], metavar="NAME=DIR",
                    help="a PEFT adapter directory (repeatable; default: two random ones)")
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--attention-backend", default="auto")
    args = ap.parse_args(argv)

    model = args.model or default_model_path()
    adapters = dict(a.split("=", 1) for a in args.adapter)
    if not adapters:
        tmp = tempfile.mkdtemp(prefix="lora_example_")
        cfg = read_arch_config(model)
        adapters = {name: write_random_adapter(os.path.join(tmp, name), cfg, RANK, seed=i)
                    for i, name in enumerate(("sql", "poems"))}
    # Up to 4 adapters in one step (more wait for a slot), ranks up to 16; small engine
    # sizes: a demo of a few requests.
    llm = LLM(model, enable_lora=True, max_loras=4, max_lora_rank=16,
              max_num_seqs=16, max_num_batched_tokens=64, max_model_len=256,
              num_kv_blocks=256, attention_backend=args.attention_backend)
    loras = [None] + [LoRARequest(name, i + 1, path)
                      for i, (name, path) in enumerate(adapters.items())]
    # One batch: every prompt on the base model and on each adapter (one LoRARequest, or
    # None, per prompt).
    prompts = [p for _ in loras for p in PROMPTS]
    per_prompt = [lora for lora in loras for _ in PROMPTS]
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    outs = llm.generate(prompts, greedy, lora_request=per_prompt, use_tqdm=False)
    rows = [(lora.lora_name if lora else "base", out.outputs[0].text)
            for lora, out in zip(per_prompt, outs, strict=True)]
    for (name, text), prompt in zip(rows, prompts, strict=True):
        print(f"[{name:>6}] {prompt!r} -> {text!r}")
    print(f"compilations after warm-up: {llm.get_metrics()['jaxserve:num_compilations']:.0f}")
    return rows


if __name__ == "__main__":
    main()
