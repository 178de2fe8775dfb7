"""`jaxserve run-batch`: an OpenAI batch file (JSONL) through one engine, one result line per input.

Every non-blank input line yields exactly one output line, in input order: a response
(with the endpoint's status code and body, errors included) or, for a line that is not
a valid batch request, an `error` record.
"""

from __future__ import annotations

import asyncio
import json
import sys

from pydantic import ValidationError
from tqdm import tqdm

from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.entrypoints.openai.protocol import BatchRequestInput
from jaxserve.entrypoints.openai.serving_chat import OpenAIServingChat
from jaxserve.entrypoints.openai.serving_completion import OpenAIServingCompletion
from jaxserve.entrypoints.openai.serving_engine import OpenAIError, error_body, random_id


def _record(custom_id, response=None, error=None) -> dict:
    return {"id": random_id("batch_req"), "custom_id": custom_id, "response": response,
            "error": error}


class BatchRunner:
    """Runs batch lines concurrently through the completions and chat handlers.

    Args:
        llm: The async engine.
        served_model_names: Names the lines' `model` may use.
    """

    def __init__(self, llm: AsyncLLM, served_model_names: list[str]):
        self.handlers = {"/v1/completions": OpenAIServingCompletion(llm, served_model_names),
                         "/v1/chat/completions": OpenAIServingChat(llm, served_model_names)}

    async def run_line(self, line: str, lineno: int = 0) -> dict:
        """The output record of one input line (never raises); `lineno` labels errors."""
        try:
            data = json.loads(line)
        except ValueError as e:
            return _record(None, error={"code": "invalid_json",
                                        "message": f"line {lineno}: not JSON: {e}"})
        custom_id = data.get("custom_id") if isinstance(data, dict) else None
        try:
            req = BatchRequestInput.model_validate(data)
        except ValidationError as e:
            err = e.errors()[0]
            where = ".".join(str(p) for p in err.get("loc", ()))
            return _record(custom_id if isinstance(custom_id, str) else None, error={
                "code": "invalid_request", "message": f"line {lineno}: {where}: {err['msg']}"})
        handler = self.handlers.get(req.url)
        if handler is None:
            return _record(req.custom_id, error={
                "code": "invalid_url", "message": f"url {req.url!r} is not supported; use one "
                                                  f"of {sorted(self.handlers)}"})
        request_id = random_id("batch")
        body = {**req.body, "stream": False}
        try:
            result = await handler.create(body)
            response = {"status_code": 200, "request_id": request_id, "body": result}
        except OpenAIError as e:
            response = {"status_code": e.status, "request_id": request_id, "body": e.body()}
        except Exception as e:  # noqa: BLE001 - a line's failure is its record, not the batch's
            response = {"status_code": 500, "request_id": request_id,
                        "body": error_body(500, f"{type(e).__name__}: {e}")}
        return _record(req.custom_id, response=response)

    async def run(self, lines: list[str], use_tqdm: bool = True) -> list[dict]:
        """Records for `lines` (blank lines skipped), in order, all run concurrently."""
        numbered = [(n, ln) for n, ln in enumerate(lines, start=1) if ln.strip()]
        bar = tqdm(total=len(numbered), desc="Running batch", unit="req", disable=not use_tqdm)

        async def one(lineno, line):
            try:
                return await self.run_line(line, lineno)
            finally:
                bar.update(1)

        try:
            return list(await asyncio.gather(*(one(n, ln) for n, ln in numbered)))
        finally:
            bar.close()


def run_batch_file(llm: AsyncLLM, served_model_names: list[str], input_path: str,
                   output_path: str, use_tqdm: bool = True) -> dict[str, int]:
    """Reads `input_path` (`-` for stdin), writes `output_path` (`-` for stdout).

    Returns:
        Counts: `total`, `succeeded` (status 200) and `failed` lines.
    """
    if input_path == "-":
        lines = sys.stdin.read().splitlines()
    else:
        with open(input_path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    records = asyncio.run(BatchRunner(llm, served_model_names).run(lines, use_tqdm))
    text = "".join(json.dumps(r) + "\n" for r in records)
    if output_path == "-":
        sys.stdout.write(text)
    else:
        with open(output_path, "w", encoding="utf-8") as f:
            f.write(text)
    ok = sum(1 for r in records if r["response"] and r["response"]["status_code"] == 200)
    return {"total": len(records), "succeeded": ok, "failed": len(records) - ok}
