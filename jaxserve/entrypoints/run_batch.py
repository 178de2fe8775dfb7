"""`jaxserve run-batch`: an OpenAI batch file (JSONL) through one engine, resumable.

Every non-blank input line yields exactly one output line, whatever it holds: a response
(the endpoint's status code and body, errors included) or an `error` record. Records are
appended as lines finish, one `os.write` of a whole ASCII line each, so a killed run leaves
whole lines only. Without `resume` the output is truncated first; with it the whole records
of an earlier run are kept (by `custom_id`) and their lines skipped. At the end the file is
rewritten in input order (temp file, fsync, `os.replace`): an interrupted and resumed run
gives the same file as an uninterrupted one. Output to `-` (stdout) streams in input order
(each record once all before it are in) and cannot be resumed.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile

from pydantic import ValidationError
from tqdm import tqdm

from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.entrypoints.openai.errors import OpenAIError, error_body
from jaxserve.entrypoints.openai.protocol import BatchRequestInput
from jaxserve.entrypoints.openai.serving_base import random_id
from jaxserve.entrypoints.openai.serving_chat import OpenAIServingChat
from jaxserve.entrypoints.openai.serving_completion import OpenAIServingCompletion
from jaxserve.entrypoints.openai.serving_embedding import OpenAIServingEmbedding
from jaxserve.entrypoints.openai.serving_models import OpenAIServingModels
from jaxserve.entrypoints.openai.serving_score import OpenAIServingRerank, OpenAIServingScore

DUPLICATE = "duplicate_custom_id"


def _record(custom_id, response=None, error=None) -> dict:
    return {"id": random_id("batch_req"), "custom_id": custom_id, "response": response,
            "error": error}


def _error(custom_id, code: str, message: str) -> dict:
    return _record(custom_id, error={"code": code, "message": message})


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def encode_record(record: dict) -> bytes:
    """One output line: ASCII JSON (lone surrogates escaped) and a newline; never raises."""
    try:
        text = json.dumps(record, ensure_ascii=True)
    except Exception as e:  # noqa: BLE001 - e.g. RecursionError: the line still gets a record
        cid = record.get("custom_id")
        text = json.dumps(_error(cid if isinstance(cid, str) else None,
                                 "unserializable_result", _describe(e)), ensure_ascii=True)
    return (text + "\n").encode("ascii")


def line_key(line: str) -> str | None:
    """The `custom_id` of an input line when it is a JSON object with a string one, else None."""
    try:
        line.encode("utf-8")
        data = json.loads(line)
    except Exception:  # noqa: BLE001 - RecursionError, bad UTF-8, not JSON: no key
        return None
    cid = data.get("custom_id") if isinstance(data, dict) else None
    return cid if isinstance(cid, str) else None


def read_records(path: str) -> dict[str, dict]:
    """The whole records of an earlier run's output file (if any), by `custom_id`.

    Dropped: a trailing line without its newline (a partial write), lines that are not
    JSON objects with a string `custom_id`, and `duplicate_custom_id` errors (rebuilt).
    """
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return {}
    records: dict[str, dict] = {}
    for raw in data.split(b"\n")[:-1]:
        try:
            rec = json.loads(raw)
        except Exception:  # noqa: BLE001 - a damaged line: that line is rerun
            continue
        if not isinstance(rec, dict) or not isinstance(rec.get("custom_id"), str):
            continue
        error = rec.get("error")
        if isinstance(error, dict) and error.get("code") == DUPLICATE:
            continue
        records.setdefault(rec["custom_id"], rec)
    return records


def write_atomic(path: str, lines: list[bytes]) -> None:
    """Replaces `path` by `lines` atomically: a temp file beside it, fsync, `os.replace`."""
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.exists(path):  # keep the permissions (mkstemp's are 0o600)
        mode = os.stat(path).st_mode & 0o777
    else:
        umask = os.umask(0o022)
        os.umask(umask)
        mode = 0o666 & ~umask
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.",
                               suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(fd, mode)
            f.writelines(lines)
            f.flush()
            os.fsync(fd)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def check_paths(input_path: str, output_path: str, resume: bool = False) -> None:
    """Raises ValueError for paths run-batch cannot use (checked before loading a model)."""
    if resume and output_path == "-":
        raise ValueError("--resume needs an output file: stdout cannot be resumed")
    if input_path != "-" and not os.path.isfile(input_path):
        raise ValueError(f"input file {input_path!r} does not exist")
    if output_path == "-":
        return
    if not os.path.isdir(os.path.dirname(os.path.realpath(output_path))):
        raise ValueError(f"the directory of output file {output_path!r} does not exist")
    if os.path.exists(output_path) and not os.path.isfile(output_path):
        raise ValueError(f"output {output_path!r} is not a regular file (use - for stdout)")
    if input_path != "-" and os.path.exists(output_path) \
            and os.path.samefile(input_path, output_path):
        raise ValueError("the output file must not be the input file")


def read_lines(input_path: str) -> list[str]:
    """Input lines (`-`: stdin), split on newlines only; undecodable bytes kept as escapes."""
    if input_path == "-":
        stream = getattr(sys.stdin, "buffer", None)
        data = stream.read() if stream is not None else sys.stdin.read().encode("utf-8")
    else:
        with open(input_path, "rb") as f:
            data = f.read()
    data = data.removeprefix(b"\xef\xbb\xbf")
    return [ln.decode("utf-8", "surrogateescape").removesuffix("\r")
            for ln in data.split(b"\n")]


class BatchRunner:
    """Runs batch lines concurrently through the engine's runner's handlers, as the server
    does: completions and chat (generate), or embeddings, score and rerank (pooling; the
    server's paths, `serving_score`'s); another URL is the line's `invalid_url` error.

    Args:
        llm: The async engine.
        served_model_names: Names the lines' `model` may use.
        models: The base names and the LoRA adapters a line's `model` may name (None:
            `served_model_names`, no adapters); an unknown name is that line's 404.
    """

    def __init__(self, llm: AsyncLLM, served_model_names: list[str],
                 models: OpenAIServingModels | None = None):
        models = models or OpenAIServingModels(served_model_names)
        names = served_model_names
        if llm.engine.runner_type == "pooling":
            score = OpenAIServingScore(llm, names, models=models)
            rerank = OpenAIServingRerank(llm, names, models=models)
            self.handlers = {"/v1/embeddings": OpenAIServingEmbedding(llm, names, models=models),
                             "/v1/score": score, "/score": score, "/v1/rerank": rerank,
                             "/rerank": rerank, "/v2/rerank": rerank}
            return
        self.handlers = {
            "/v1/completions": OpenAIServingCompletion(llm, names, models=models),
            "/v1/chat/completions": OpenAIServingChat(llm, names, models=models)}

    async def run_line(self, line: str, lineno: int = 0) -> dict:
        """The output record of one input line (never raises); `lineno` labels errors."""
        try:
            return await self._run_line(line, lineno)
        except Exception as e:  # noqa: BLE001 - a line's failure is its record, not the batch's
            return _error(line_key(line), "internal_error", f"line {lineno}: {_describe(e)}")

    async def _run_line(self, line: str, lineno: int) -> dict:
        where = f"line {lineno}"
        try:
            line.encode("utf-8")
        except UnicodeEncodeError:
            return _error(None, "invalid_json", f"{where}: not valid UTF-8")
        try:
            data = json.loads(line)
        except RecursionError:
            return _error(None, "invalid_json", f"{where}: JSON nested too deeply")
        except ValueError as e:
            return _error(None, "invalid_json", f"{where}: not JSON: {e}")
        if not isinstance(data, dict):
            return _error(None, "invalid_request",
                          f"{where}: a batch request is a JSON object, not {type(data).__name__}")
        try:
            req = BatchRequestInput.model_validate(data)
        except ValidationError as e:
            err = e.errors()[0]
            loc = ".".join(str(p) for p in err.get("loc", ()))
            return _error(line_key(line), "invalid_request", f"{where}: {loc}: {err['msg']}")
        handler = self.handlers.get(req.url)
        if handler is None:
            return _error(req.custom_id, "invalid_url", f"url {req.url!r} is not supported; "
                                                        f"use one of {sorted(self.handlers)}")
        request_id = random_id("batch")
        body = {**req.body, "stream": False}
        try:
            result = await handler.create(body)
            response = {"status_code": 200, "request_id": request_id, "body": result}
        except OpenAIError as e:
            response = {"status_code": e.status, "request_id": request_id, "body": e.body()}
        except Exception as e:  # noqa: BLE001 - a line's failure is its record, not the batch's
            response = {"status_code": 500, "request_id": request_id,
                        "body": error_body(500, _describe(e))}
        return _record(req.custom_id, response=response)


class BatchOutput:
    """Where records go: appended to a file as they finish, or streamed to stdout in order.

    Args:
        path: Output file, or `-` for stdout.
        resume: Keep the file's whole records (see `read_records`) instead of truncating it.
        defer: Leave the file as it is until `open()` (records put before are written
            then): a run whose workers fail to start does not wipe an earlier output.
    """

    def __init__(self, path: str, resume: bool = False, defer: bool = False):
        self.stream = path == "-"
        # realpath: the rewrites replace a link's target, not the link.
        self.path = path if self.stream else os.path.realpath(path)
        self.records: list[dict | None] = []
        self.skipped = self._next = 0
        self._fd = None
        self._resume = resume
        self._unwritten: list[int] = []  # records put before the file was opened
        self.done: dict[str, dict] = read_records(self.path) if resume and not self.stream else {}
        if not defer:
            self.open()

    def open(self) -> None:
        """Truncates the file (or, resuming, keeps its whole records) and writes what was
        put so far; then every `put` appends (idempotent)."""
        if self.stream or self._fd is not None:
            return
        if self._resume:  # only whole records: a partial last line must not merge with the next
            write_atomic(self.path, [encode_record(r) for r in self.done.values()])
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT
                           | (0 if self._resume else os.O_TRUNC), 0o666)
        for index in self._unwritten:
            self._write(self.records[index])
        self._unwritten = []

    def _write(self, record: dict) -> None:
        data = encode_record(record)
        written = os.write(self._fd, data)  # one write: a kill leaves whole lines only
        while written < len(data):  # a short write (e.g. disk full) raises on the rest
            written += os.write(self._fd, data[written:])

    def put(self, index: int, record: dict, new: bool = True) -> None:
        """Record `index` (input order) is final: write it now (file) or in turn (stdout)."""
        self.records[index] = record
        if not self.stream and new:
            if self._fd is None:
                self._unwritten.append(index)
            else:
                self._write(record)
        elif self.stream:
            while self._next < len(self.records) and self.records[self._next] is not None:
                sys.stdout.write(encode_record(self.records[self._next]).decode("ascii"))
                self._next += 1
            sys.stdout.flush()

    def finish(self) -> None:
        """Every record is in: rewrite the file in input order, durably."""
        self.close()
        if not self.stream:
            write_atomic(self.path, [encode_record(r) for r in self.records])

    def close(self) -> None:
        """Closes the append descriptor (the file keeps every record written so far)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def plan_lines(lines: list[str], out: BatchOutput) -> list[tuple[int, int, str]]:
    """Sizes `out` to the non-blank lines and fills in what needs no engine: records of an
    earlier run (`out.done`) and `duplicate_custom_id` errors (with a warning on stderr).

    Returns:
        The lines to run: (output index, line number, line).
    """
    numbered = [(n, ln) for n, ln in enumerate(lines, start=1) if ln.strip()]
    out.records = [None] * len(numbered)
    first: dict[str, int] = {}
    todo = []
    for index, (lineno, line) in enumerate(numbered):
        key = line_key(line)
        if key is not None and key in first:
            print(f"jaxserve: warning: line {lineno}: custom_id {ascii(key)} repeats line "
                  f"{first[key]}; answered with a {DUPLICATE} error", file=sys.stderr)
            out.put(index, _error(key, DUPLICATE, f"line {lineno}: custom_id {key!r} was "
                                                  f"already used on line {first[key]}"))
            continue
        if key is not None:
            first[key] = lineno
            if key in out.done:
                out.put(index, out.done[key], new=False)
                out.skipped += 1
                continue
        todo.append((index, lineno, line))
    return todo


async def run_lines(runner: BatchRunner, lines: list[str], out: BatchOutput,
                    use_tqdm: bool = True) -> None:
    """Answers every non-blank line into `out`, skipping the ones `out.done` already holds.

    Repeated `custom_id`s get a `duplicate_custom_id` error (and a warning on stderr).
    """
    todo = plan_lines(lines, out)
    bar = tqdm(total=len(out.records), initial=len(out.records) - len(todo),
               desc="Running batch", unit="req", disable=not use_tqdm)

    async def one(index, lineno, line):
        record = await runner.run_line(line, lineno)
        out.put(index, record)
        bar.update(1)

    try:
        await asyncio.gather(*(one(*item) for item in todo))
    finally:
        bar.close()


def run_batch_file(llm: AsyncLLM, served_model_names: list[str], input_path: str,
                   output_path: str, use_tqdm: bool = True, resume: bool = False,
                   models: OpenAIServingModels | None = None) -> dict[str, int]:
    """Reads `input_path` (`-` for stdin), writes `output_path` (`-` for stdout).

    Args:
        llm: The async engine.
        served_model_names: Names the lines' `model` may use.
        input_path: Batch input JSONL.
        output_path: Results JSONL, one line per non-blank input line.
        use_tqdm: Show a progress bar.
        resume: Keep the output file's finished records and run only the other lines.
        models: LoRA adapters a line's `body.model` may name (loaded in the engine
            already: `cli.engine.start_engine`); None: the base model only.

    Returns:
        Counts: `total`, `succeeded` (status 200), `failed` (the rest) and `skipped`
        (taken from an earlier run's output, also counted in `succeeded`/`failed`).

    Raises:
        ValueError: Unusable paths (see `check_paths`).
    """
    check_paths(input_path, output_path, resume)
    lines = read_lines(input_path)
    out = BatchOutput(output_path, resume)
    try:
        asyncio.run(run_lines(BatchRunner(llm, served_model_names, models), lines, out,
                              use_tqdm))
    finally:
        out.close()
    out.finish()
    return count_records(out)


def count_records(out: BatchOutput) -> dict[str, int]:
    """`total`, `succeeded` (status 200), `failed` and `skipped` records of a finished run."""
    ok = sum(1 for r in out.records
             if isinstance(r.get("response"), dict) and r["response"].get("status_code") == 200)
    return {"total": len(out.records), "succeeded": ok, "failed": len(out.records) - ok,
            "skipped": out.skipped}
