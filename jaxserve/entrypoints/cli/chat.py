"""`jaxserve chat`: an interactive conversation in the terminal (no HTTP server involved)."""

from __future__ import annotations

from jaxserve.entrypoints.cli.args import add_engine_args
from jaxserve.entrypoints.cli.engine import start_engine


def add_parser(sub) -> None:
    p = sub.add_parser("chat", help="interactive chat on stdin/stdout",
                       description="Interactive chat. /help lists the commands; Ctrl-C stops "
                                   "a reply, Ctrl-D (or Ctrl-C at the prompt) exits.")
    add_engine_args(p)
    p.add_argument("--system-prompt", default=None, help="system message (default: none)")
    p.add_argument("--max-tokens", type=int, default=512,
                   help="longest reply in tokens (default: 512)")
    p.add_argument("--temperature", type=float, default=0.7,
                   help="sampling temperature, 0 is greedy (default: 0.7)")
    p.add_argument("--top-p", type=float, default=0.9, help="nucleus sampling mass (default: 0.9)")
    p.set_defaults(handler=run)


def run(args) -> int:
    import asyncio

    from jaxserve.sampling_params import SamplingParams

    args.served_model_name, args.log_interval = None, 0
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, seed=args.seed)
    llm, _ = start_engine(args, verbose=False)
    from jaxserve.entrypoints.chat_cli import chat_loop

    try:
        asyncio.run(chat_loop(llm, params, system_prompt=args.system_prompt))
    finally:
        llm.shutdown()
    return 0
