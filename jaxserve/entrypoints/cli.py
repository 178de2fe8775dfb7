"""The `jaxserve` command line: `generate` and `convert` (serving commands come later)."""

from __future__ import annotations

import argparse
import sys
import time


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="GGUF file, Hugging Face directory or jaxserve checkpoint "
                        "(default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="parameter and activation dtype (default: float32)")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    parser = argparse.ArgumentParser(prog="jaxserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="greedy continuation of one prompt")
    gen.add_argument("prompt", help="text to continue")
    _add_model_args(gen)
    gen.add_argument("--max-tokens", type=int, default=32, help="tokens to generate")
    gen.add_argument("--chat", action="store_true",
                     help="wrap the prompt as a user message in the model's chat template")
    gen.add_argument("--block-size", type=int, default=16, help="KV page size in tokens")
    gen.add_argument("--max-model-len", type=int, default=2048,
                     help="longest prompt + generation accepted")

    conv = sub.add_parser("convert", help="convert a model to a jaxserve (orbax) checkpoint")
    conv.add_argument("src", nargs="?", default=None,
                      help="GGUF file or Hugging Face directory (default: embedded model)")
    conv.add_argument("dst", help="new directory to write")
    conv.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    return parser


def cmd_generate(args) -> int:
    from jaxserve.compilation_cache import enable_compilation_cache
    from jaxserve.engine.greedy import GreedyGenerator
    from models.loaders import load_model, load_tokenizer

    enable_compilation_cache()
    t0 = time.perf_counter()
    model = load_model(args.model, args.dtype)
    tokenizer = load_tokenizer(args.model)
    t_load = time.perf_counter() - t0
    if args.chat:
        prompt_ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": args.prompt}], add_generation_prompt=True,
            tokenize=True, return_dict=False)
    else:
        prompt_ids = tokenizer(args.prompt).input_ids
    gen = GreedyGenerator(model, page_size=args.block_size, max_model_len=args.max_model_len)
    stops = list(model.cfg.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        stops.append(tokenizer.eos_token_id)
    out = gen.generate(prompt_ids, args.max_tokens, stop_token_ids=stops)
    text = tokenizer.decode([t for t in out if t not in stops], skip_special_tokens=False)
    print(text if args.chat else args.prompt + text)
    s = gen.stats
    rate = s["decode_tokens"] / s["decode_s"] if s["decode_s"] else float("nan")
    print(f"[jaxserve] load {t_load:.1f}s, prompt {len(prompt_ids)} tok, "
          f"first token {s['ttft_s'] * 1000:.0f} ms, {len(out)} tokens, "
          f"decode {rate:.1f} tok/s", file=sys.stderr)
    return 0


def cmd_convert(args) -> int:
    from models.loaders import convert

    t0 = time.perf_counter()
    model = convert(args.src, args.dst, args.dtype)
    print(f"wrote {args.dst} ({model.cfg.architecture}, {args.dtype}) in "
          f"{time.perf_counter() - t0:.1f}s")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `jaxserve` console script."""
    args = build_parser().parse_args(argv)
    handlers = {"generate": cmd_generate, "convert": cmd_convert}
    try:
        return handlers[args.command](args)
    except ValueError as e:
        print(f"jaxserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
