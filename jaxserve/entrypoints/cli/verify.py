"""`jaxserve verify`: runs a prompt set twice (each prompt alone vs in a crowded batch, or
on two attention backends) and classifies every divergence (`jaxserve.entrypoints.verify`);
exits 1 on a real difference (under --batch-invariant, on any difference)."""

from __future__ import annotations

import argparse
import dataclasses
import json

from jaxserve.entrypoints.cli.args import (
    add_engine_args,
    check_engine_args,
    engine_kwargs,
    quiet_start,
)

DEFAULTS = {"max_num_seqs": 16, "max_num_batched_tokens": 64, "warmup": False}


def _prompt_texts(path: str | None) -> list[str]:
    from jaxserve.entrypoints.verify import DEFAULT_PROMPTS

    if path is None:
        return list(DEFAULT_PROMPTS)
    try:
        with open(path, encoding="utf-8") as f:
            texts = [line.rstrip("\n") for line in f if line.strip()]
    except OSError as e:
        raise ValueError(f"cannot read the --prompts file {path}: {e.strerror}") from None
    if not texts:
        raise ValueError(f"the --prompts file {path} holds no prompt")
    return texts


def _backends(text: str | None) -> tuple[str, str] | None:
    from pallas_kernels import ATTENTION_BACKENDS

    if text is None:
        return None
    names = [b.strip() for b in text.split(",")]
    if len(names) != 2 or any(b not in ATTENTION_BACKENDS for b in names):
        raise ValueError(f"--backends takes two of {', '.join(ATTENTION_BACKENDS)} "
                         f"separated by a comma, got {text!r}")
    return names[0], names[1]


def run(args) -> int:
    # NOTE: every argument is checked before anything heavy is imported or loaded.
    for name in ("max_tokens", "crowd"):
        if getattr(args, name) < (1 if name == "max_tokens" else 0):
            raise ValueError(f"--{name.replace('_', '-')} must be "
                             f"{'positive' if name == 'max_tokens' else '>= 0'}, "
                             f"got {getattr(args, name)}")
    if args.epsilon < 0:
        raise ValueError(f"--epsilon must be >= 0, got {args.epsilon}")
    backends = _backends(args.backends)
    texts = _prompt_texts(args.prompts)
    kwargs = {**DEFAULTS, **engine_kwargs(args)}
    check_engine_args(kwargs)
    quiet_start()
    from jaxserve.engine.llm import LLM
    from jaxserve.entrypoints import verify as v

    params = v.greedy_params(args.max_tokens, args.logprobs)
    llm = LLM(**{**kwargs, **({"attention_backend": backends[0]} if backends else {})})
    model = llm.engine.model
    # The served weight format and its bytes, the checkpoint's beside them (issue 62).
    weights = {"format": model.quant.name, "device_bytes": model.weight_bytes,
               "checkpoint_bytes": model.checkpoint_bytes or None}
    report = model.weights_report()
    del model  # NOTE: the first engine's weights are freed before a second backend's load
    prompts = v.prompt_ids(llm.get_tokenizer(), texts)
    others = v.random_prompts(args.crowd, llm.get_tokenizer().vocab_size, args.crowd_seed)
    if backends:
        what = f"backend {backends[0]} vs {backends[1]}, in a batch of {args.crowd} others"
        ref = v.run_crowded(llm, prompts, others, params, args.crowd_seed)
        del llm
        other = LLM(**{**kwargs, "attention_backend": backends[1]})
        got = v.run_crowded(other, prompts, others, params, args.crowd_seed)
    else:
        what = f"alone vs in a batch of {args.crowd} others"
        ref = v.run_alone(llm, prompts, params)
        got = v.run_crowded(llm, prompts, others, params, args.crowd_seed)
    divergences = v.compare(ref, got, args.epsilon)
    strict = bool(kwargs.get("batch_invariant")) if args.strict is None else args.strict
    failed = v.failed(divergences, strict)
    if args.json:
        print(json.dumps({"what": what, "weights": weights, "strict": strict, "failed": failed,
                          "epsilon": args.epsilon,
                          "prompts": [dataclasses.asdict(d) for d in divergences]},
                         indent=1))
    else:
        print(f"weights {report}")
        print(v.summary(divergences, args.epsilon, what))
        print("FAILED" if failed else "OK", "(strict: any divergence fails)" if strict
              else "(real differences fail)")
    return 1 if failed else 0


def add_parser(sub) -> None:
    p = sub.add_parser(
        "verify", help="check that results do not depend on what shares a step",
        description="Runs a prompt set twice, each prompt alone and then among random "
                    "others in one batch (or, with --backends, on two attention backends), "
                    "greedy with raw logprobs, and classifies each divergence: near-tie "
                    "(a token flip where the top-2 logprobs were within --epsilon), "
                    "logprobs (same tokens, other bits) or real. Exits 1 on a real "
                    "difference; with --batch-invariant (or --strict) on any difference.")
    p.add_argument("--prompts", default=None,
                   help="a text file, one prompt per line ('chat:' first: through the chat "
                        "template); default: eight built-in prompts of different kinds")
    p.add_argument("--max-tokens", type=int, default=16, help="greedy tokens per prompt")
    p.add_argument("--logprobs", type=int, default=5, help="raw logprobs compared per token")
    p.add_argument("--crowd", type=int, default=31, help="random prompts sharing the batch")
    p.add_argument("--crowd-seed", type=int, default=0, help="seed of the crowd and its order")
    p.add_argument("--epsilon", type=float, default=1e-3,
                   help="top-2 logprob gap under which a token flip is a near-tie")
    p.add_argument("--backends", default=None,
                   help="compare two attention backends (e.g. xla,cpu) instead of alone vs "
                        "crowded")
    p.add_argument("--strict", action=argparse.BooleanOptionalAction, default=None,
                   help="fail on any divergence (default: on with --batch-invariant)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    add_engine_args(p, positional_model=True,
                    defaults={k: str(v).lower() for k, v in DEFAULTS.items()})
    p.set_defaults(handler=run)

