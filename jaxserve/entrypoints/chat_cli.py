"""`jaxserve chat`: an interactive conversation on stdin/stdout, replies streamed as generated.

Ctrl-C during a reply stops it and returns to the prompt; Ctrl-C at the prompt, Ctrl-D or
`/exit` ends the session.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import signal
import sys
import threading
from typing import TextIO

from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.entrypoints.openai.serving_engine import visible_text
from jaxserve.sampling_params import SamplingParams

HELP = """Type a message and press Enter; the reply streams back.
Commands:
  /help          this text
  /reset         start a new conversation (the system prompt stays)
  /exit, /quit   end the session (also Ctrl-D, or Ctrl-C at the prompt)
Ctrl-C while a reply streams stops the reply and returns to the prompt."""


def _line_reader(stream: TextIO, loop: asyncio.AbstractEventLoop) -> asyncio.Queue:
    """Lines of `stream` read by a daemon thread ("" at EOF), so that leaving the loop never
    waits for a blocked `readline`."""
    lines: asyncio.Queue = asyncio.Queue()

    def read():
        while True:
            line = stream.readline()
            with contextlib.suppress(RuntimeError):  # the loop is gone: nobody listens
                loop.call_soon_threadsafe(lines.put_nowait, line)
            if not line:
                return

    threading.Thread(target=read, name="jaxserve-chat-stdin", daemon=True).start()
    return lines


class _Interrupts:
    """SIGINT on the loop: cancels the reply in flight, or (at the prompt) asks to quit."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.reply, self.quit = loop, None, asyncio.Event()
        try:
            loop.add_signal_handler(signal.SIGINT, self._on_sigint)
            self.installed = True
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread
            self.installed = False

    def _on_sigint(self) -> None:
        if self.reply is not None and not self.reply.done():
            self.reply.cancel()
        else:
            self.quit.set()

    def close(self) -> None:
        if self.installed:
            self.loop.remove_signal_handler(signal.SIGINT)


async def _next_line(lines: asyncio.Queue, quit_event: asyncio.Event) -> str | None:
    """The next input line, or None on Ctrl-C at the prompt."""
    get = asyncio.ensure_future(lines.get())
    stop = asyncio.ensure_future(quit_event.wait())
    done, pending = await asyncio.wait({get, stop}, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
    return get.result() if get in done else None


async def chat_loop(llm: AsyncLLM, params: SamplingParams, *, system_prompt: str | None = None,
                    stdin: TextIO | None = None, stdout: TextIO | None = None) -> int:
    """Reads user turns line by line until EOF, `/exit` or Ctrl-C at the prompt; prints each
    streamed reply.

    Args:
        llm: The async engine.
        params: Sampling settings of every reply.
        system_prompt: Optional system message heading the conversation.
        stdin: Where turns come from (default: sys.stdin).
        stdout: Where replies go (default: sys.stdout).

    Returns:
        The number of replies given (a stopped reply counts).
    """
    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    interactive = stdin.isatty()
    system = [{"role": "system", "content": system_prompt}] if system_prompt else []
    history: list[dict] = list(system)
    replies = 0
    loop = asyncio.get_running_loop()
    lines, interrupts = _line_reader(stdin, loop), _Interrupts(loop)
    if interactive:
        print("Type /help for the commands.", file=stdout)
    try:
        for turn in itertools.count():
            if interactive:
                stdout.write("> ")
                stdout.flush()
            line = await _next_line(lines, interrupts.quit)
            if not line:  # EOF or Ctrl-C at the prompt
                if interactive:
                    stdout.write("\n")
                break
            text = line.rstrip("\n").strip()
            if text in ("/exit", "/quit"):
                break
            if text == "/help":
                print(HELP, file=stdout)
                continue
            if text == "/reset":
                history = list(system)
                print("[conversation cleared]", file=stdout)
                continue
            if not text:
                continue
            history.append({"role": "user", "content": line.rstrip("\n")})
            partial = [""]
            interrupts.reply = asyncio.ensure_future(
                _reply(llm, params, history, turn, stdout, partial))
            try:
                reply = await interrupts.reply
            except asyncio.CancelledError:
                if not interrupts.reply.cancelled():
                    raise  # the loop itself is being cancelled
                reply = partial[0]
                print("\n[stopped]", file=stdout)
            except ValueError as e:  # e.g. the conversation outgrew max_model_len
                history.pop()
                print(f"\n[error: {e}; try /reset]", file=stdout)
                continue
            stdout.write("\n")
            stdout.flush()
            history.append({"role": "assistant", "content": reply})
            replies += 1
    finally:
        interrupts.close()
    return replies


async def _reply(llm: AsyncLLM, params: SamplingParams, history: list[dict], turn: int,
                 stdout: TextIO, partial: list[str]) -> str:
    """Streams one reply to `stdout`; returns its text (leaving early aborts the request).

    `partial[0]` holds the text shown so far (what a Ctrl-C keeps in the history).
    """
    ids = llm.tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=True,
                                            return_dict=False)
    sent = 0
    async for out in llm.generate({"prompt_token_ids": list(ids)}, params, f"chat-{turn}"):
        partial[0] = visible_text(out.outputs[0], params)
        stdout.write(partial[0][sent:])
        stdout.flush()
        sent = len(partial[0])
    return partial[0]
