"""`jaxserve generate`: one prompt through `LLM` (greedy by default, sampling flags optional)."""

from __future__ import annotations

import sys
import time

from jaxserve.entrypoints.cli.args import (
    add_engine_args,
    check_engine_args,
    engine_kwargs,
    print_backend,
    quiet_start,
)

# One prompt needs no warm-up of every bucket: without it only the two or three programs
# this run uses compile (on first use; the persistent cache keeps them for the next run).
# Flags override these.
GENERATE_DEFAULTS = {"max_num_seqs": 16, "max_num_batched_tokens": 256, "warmup": False}


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="complete one prompt (greedy unless sampling flags)",
                       description="Complete one prompt with the engine (LLM.generate).")
    p.add_argument("prompt", help="text to continue")
    p.add_argument("--max-tokens", type=int, default=32,
                   help="tokens to generate (default: 32)")
    p.add_argument("--chat", action="store_true",
                   help="wrap the prompt as a user message in the model's chat template")
    g = p.add_argument_group("sampling (vLLM's SamplingParams)")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="0 is greedy (default: 0)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus mass (default: 1.0)")
    g.add_argument("--top-k", type=int, default=0, help="0 is off (default: 0)")
    g.add_argument("--min-p", type=float, default=0.0, help="0 is off (default: 0)")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="(default: 1.0)")
    g.add_argument("--n", type=int, default=1, help="completions to sample (default: 1)")
    g.add_argument("--sampling-seed", type=int, default=None,
                   help="seed of this request's samples (default: drawn from --seed)")
    g.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep going past EOS")
    add_engine_args(p, positional_model=False,
                    defaults={"max_num_seqs": "16", "max_num_batched_tokens": "256",
                              "warmup": "off"})
    p.set_defaults(handler=run)


def sampling_params(args):
    """The request's `SamplingParams` (raises ValueError naming a bad flag)."""
    from jaxserve.sampling_params import SamplingParams

    return SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p,
                          repetition_penalty=args.repetition_penalty,
                          seed=args.sampling_seed, stop=args.stop, ignore_eos=args.ignore_eos,
                          max_tokens=args.max_tokens)


def run(args) -> int:
    # NOTE: every argument is checked before anything heavy is imported or loaded.
    if not args.prompt.strip():
        raise ValueError("prompt is empty: give the text to continue")
    params = sampling_params(args)
    kwargs = {**GENERATE_DEFAULTS, **engine_kwargs(args)}
    check_engine_args(kwargs)
    quiet_start()
    from jaxserve.engine.llm import LLM

    print_backend()
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    t_load = time.perf_counter() - t0
    if args.chat:
        outs = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)
    else:
        outs = llm.generate([args.prompt], params, use_tqdm=False)
    out = outs[0]
    for comp in out.outputs:
        if params.n > 1:
            print(f"--- completion {comp.index} ({comp.finish_reason})")
        print(comp.text if args.chat else args.prompt + comp.text)
    m = out.metrics
    ttft = (m.first_token_time - m.arrival_time) * 1000 if m.first_token_time else float("nan")
    num_out = sum(len(c.token_ids) for c in out.outputs)
    decode = (m.finished_time or m.last_token_time) - (m.first_token_time or m.arrival_time)
    rate = (num_out - params.n) / decode if decode > 0 else float("nan")
    print(f"[jaxserve] load + warm-up {t_load:.1f}s, prompt {len(out.prompt_token_ids)} tok, "
          f"first token {ttft:.0f} ms, {num_out} tokens, decode {rate:.1f} tok/s",
          file=sys.stderr)
    return 0
