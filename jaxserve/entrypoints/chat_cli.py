"""`jaxserve chat`: an interactive conversation on stdin/stdout, replies streamed as generated."""

from __future__ import annotations

import asyncio
import itertools
import sys
from typing import TextIO

from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.entrypoints.openai.serving_engine import visible_text
from jaxserve.sampling_params import SamplingParams

HELP = "Type a message and press Enter. /reset clears the conversation, /exit (or EOF) quits."


async def chat_loop(llm: AsyncLLM, params: SamplingParams, *, system_prompt: str | None = None,
                    stdin: TextIO | None = None, stdout: TextIO | None = None) -> int:
    """Reads user turns line by line until EOF or `/exit`; prints each streamed reply.

    Args:
        llm: The async engine.
        params: Sampling settings of every reply.
        system_prompt: Optional system message heading the conversation.
        stdin: Where turns come from (default: sys.stdin).
        stdout: Where replies go (default: sys.stdout).

    Returns:
        The number of replies given.
    """
    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    interactive = stdin.isatty()
    system = [{"role": "system", "content": system_prompt}] if system_prompt else []
    history: list[dict] = list(system)
    replies = 0
    if interactive:
        print(HELP, file=stdout)
    for turn in itertools.count():
        if interactive:
            stdout.write("> ")
            stdout.flush()
        line = await asyncio.to_thread(stdin.readline)
        if not line:
            break
        text = line.rstrip("\n")
        if text.strip() in ("/exit", "/quit"):
            break
        if text.strip() == "/reset":
            history = list(system)
            print("[conversation cleared]", file=stdout)
            continue
        if not text.strip():
            continue
        history.append({"role": "user", "content": text})
        ids = llm.tokenizer.apply_chat_template(history, add_generation_prompt=True,
                                                tokenize=True, return_dict=False)
        sent, reply = 0, ""
        try:
            async for out in llm.generate({"prompt_token_ids": list(ids)}, params,
                                          f"chat-{turn}"):
                reply = visible_text(out.outputs[0], params)
                stdout.write(reply[sent:])
                stdout.flush()
                sent = len(reply)
        except ValueError as e:  # e.g. the conversation outgrew max_model_len
            history.pop()
            print(f"\n[error: {e}; try /reset]", file=stdout)
            continue
        stdout.write("\n")
        stdout.flush()
        history.append({"role": "assistant", "content": reply})
        replies += 1
    return replies
