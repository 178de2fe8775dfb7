"""`jaxserve chat`'s loop over a fake engine: /help, Ctrl-C during a reply returns to the
prompt, Ctrl-C at the prompt and EOF end the session cleanly; no HTTP server imported."""

from __future__ import annotations

import asyncio
import io
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.entrypoints.chat_cli import HELP, chat_loop
from jaxserve.sampling_params import SamplingParams
from tests.entrypoints.fake_engine import FakeEngine


class ChatTokenizer:
    """What the chat loop needs of a tokenizer: a template giving token ids."""

    eos_token_id = None

    def apply_chat_template(self, messages, **kwargs):
        return [1] * len(messages)


class SlowLines(io.StringIO):
    """stdin whose lines come only when the test releases them (like a person typing)."""

    def __init__(self):
        super().__init__()
        self.queue: list[str] = []
        self.ready = threading.Condition()

    def feed(self, line: str) -> None:
        with self.ready:
            self.queue.append(line)
            self.ready.notify()

    def readline(self, *args):
        with self.ready:
            self.ready.wait_for(lambda: self.queue)
            return self.queue.pop(0)


@pytest.fixture
def llm():
    engine = FakeEngine(step_seconds=0.02)
    engine.tokenizer = ChatTokenizer()
    llm = AsyncLLM(engine, log_interval=0)
    yield llm
    llm.shutdown()


def test_help_reset_and_eof(llm):
    stdin, stdout = io.StringIO("/help\nhello\n/reset\n\nbye\n"), io.StringIO()
    replies = asyncio.run(chat_loop(llm, SamplingParams(max_tokens=3), stdin=stdin,
                                    stdout=stdout))
    text = stdout.getvalue()
    assert replies == 2 and HELP in text and "[conversation cleared]" in text
    assert text.count("t0 t1 t2 ") == 2  # "/help" was not sent to the model


def test_ctrl_c_stops_the_reply_then_ctrl_c_at_the_prompt_exits(llm):
    stdin, stdout = SlowLines(), io.StringIO()

    async def main():
        loop = asyncio.get_running_loop()
        session = asyncio.ensure_future(chat_loop(llm, SamplingParams(max_tokens=10_000),
                                                  stdin=stdin, stdout=stdout))
        stdin.feed("tell me everything\n")
        while "t3 " not in stdout.getvalue():  # the reply is streaming
            await asyncio.sleep(0.01)
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C: stop the reply, not the session
        while "[stopped]" not in stdout.getvalue():
            await asyncio.sleep(0.01)
        stdin.feed("second question\n")
        while stdout.getvalue().count("[stopped]") == 1 and "t2 " not in \
                stdout.getvalue().split("[stopped]")[-1]:
            await asyncio.sleep(0.01)
        os.kill(os.getpid(), signal.SIGINT)  # stops the second reply
        while stdout.getvalue().count("[stopped]") < 2:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)  # at the prompt: end the session
        replies = await asyncio.wait_for(session, 10)
        assert loop.is_running()
        return replies

    assert asyncio.run(main()) == 2
    deadline = time.time() + 5
    while llm.engine.running and time.time() < deadline:
        time.sleep(0.01)
    assert not llm.engine.running and len(llm.engine.aborted) == 2  # both replies aborted


def test_chat_command_does_not_import_the_http_server():
    code = ("import sys; from jaxserve.entrypoints.cli import build_parser, chat; "
            "import jaxserve.entrypoints.chat_cli; "
            "print('fastapi' in sys.modules, 'uvicorn' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]
