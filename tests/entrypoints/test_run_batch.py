"""`run-batch` (every line answered, in order, reproducibly; SIGKILL then `--resume`) and `chat`."""

from __future__ import annotations

import asyncio
import io
import json
import os
import subprocess
import sys
import time

import pytest

from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.entrypoints.chat_cli import chat_loop
from jaxserve.entrypoints.run_batch import run_batch_file
from jaxserve.sampling_params import SamplingParams
from tests.entrypoints.conftest import MODEL_NAME


def line(custom_id, url="/v1/completions", **body):
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url,
                       "body": {"model": MODEL_NAME, "max_tokens": 6, "temperature": 0, **body}})


LINES = [
    line("c1", prompt="Once upon a time"),
    line("chat1", url="/v1/chat/completions", messages=[{"role": "user", "content": "Hi"}]),
    "{not json",
    "",
    line("c2", prompt=["The sky is", "Water is"]),
    json.dumps({"custom_id": "no-url", "method": "POST", "body": {}}),
    line("bad-url", url="/v1/embeddings", input="x"),
    line("neg", max_tokens=-1, prompt="x"),
    line("who", model="other-model", prompt="x"),
    line("c3", prompt="1, 2, 3,", stream=True),
]


@pytest.fixture(scope="module")
def llm(server) -> AsyncLLM:
    """The shared server's engine: `AsyncLLM` serves any number of event loops."""
    return server.llm


def run(llm, tmp_path, name):
    src, dst = tmp_path / "in.jsonl", tmp_path / f"{name}.jsonl"
    src.write_text("\n".join(LINES) + "\n")
    counts = run_batch_file(llm, [MODEL_NAME], str(src), str(dst), use_tqdm=False)
    return counts, [json.loads(x) for x in dst.read_text().splitlines()]


def test_every_line_gets_a_record_in_order_and_reruns_agree(llm, tmp_path):
    counts, records = run(llm, tmp_path, "first")
    assert counts == {"total": 9, "succeeded": 4, "failed": 5, "skipped": 0}
    assert [r["custom_id"] for r in records] == [
        "c1", "chat1", None, "c2", "no-url", "bad-url", "neg", "who", "c3"]
    by_id = {r["custom_id"]: r for r in records}
    for cid in ("c1", "chat1", "c2", "c3"):
        response = by_id[cid]["response"]
        assert by_id[cid]["error"] is None and response["status_code"] == 200
        assert response["request_id"] and response["body"]["usage"]["completion_tokens"] > 0
    assert by_id["c1"]["response"]["body"]["choices"][0]["text"].startswith(", the city of")
    assert len(by_id["c2"]["response"]["body"]["choices"]) == 2
    assert records[2]["error"]["code"] == "invalid_json" and records[2]["response"] is None
    assert records[2]["error"]["message"].startswith("line 3:")
    assert by_id["no-url"]["error"]["code"] == "invalid_request"
    assert by_id["bad-url"]["error"]["code"] == "invalid_url"
    assert by_id["neg"]["response"]["status_code"] == 400
    assert by_id["neg"]["response"]["body"]["error"]["param"] == "max_tokens"
    assert by_id["who"]["response"]["status_code"] == 404
    assert len({r["id"] for r in records}) == len(records)

    def texts(recs):
        out = []
        for r in recs:
            body = (r["response"] or {}).get("body", {})
            out.append([c.get("text", c.get("message")) for c in body.get("choices", [])])
        return out

    _, again = run(llm, tmp_path, "second")
    assert texts(again) == texts(records)


def test_poison_line_beside_eight_good_ones(llm, tmp_path):
    # Issue 12 item 1: a top_k beyond int32 (or a stop id beyond int32 with min_tokens)
    # failed every line running beside it; now it is refused alone, the rest unchanged.
    good = [line(f"g{i}", prompt=f"Item {i}: the weather today is", max_tokens=8,
                 ignore_eos=True) for i in range(8)]
    poison = [line("p1", prompt="Hello", temperature=1.0, top_k=2**40),
              line("p2", prompt="Hello", stop_token_ids=[2**40], min_tokens=1)]

    def texts(lines, name):
        src, dst = tmp_path / f"{name}.in", tmp_path / f"{name}.out"
        src.write_text("\n".join(lines) + "\n")
        run_batch_file(llm, [MODEL_NAME], str(src), str(dst), use_tqdm=False)
        records = {r["custom_id"]: r for r in map(json.loads, dst.read_text().splitlines())}
        return records, [records[f"g{i}"]["response"]["body"]["choices"][0]["text"]
                         for i in range(8)]

    _, clean = texts(good, "clean")
    records, mixed = texts(good[:4] + poison + good[4:], "mixed")
    assert mixed == clean
    for cid, param in (("p1", "top_k"), ("p2", "stop_token_ids")):
        response = records[cid]["response"]
        assert response["status_code"] == 400
        assert response["body"]["error"]["param"] == param


def test_chat_loop_streams_replies_and_keeps_history(llm):
    stdin = io.StringIO("Hi!\n\n/reset\nWhat is 2+2?\n/exit\nnever read\n")
    stdout = io.StringIO()
    replies = asyncio.run(chat_loop(llm, SamplingParams(max_tokens=5, temperature=0),
                                    stdin=stdin, stdout=stdout))
    assert replies == 2
    text = stdout.getvalue()
    assert "[conversation cleared]" in text and len(text.strip().splitlines()) == 3


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CACHE_DIR = os.environ.get("JAXSERVE_TEST_CACHE", os.path.join(REPO, ".jax_cache"))
# NOTE: the sizes of tests/e2e/test_logit_controls.py's engine over the same tiny model, so
# warm-up's programs come from the (shared) compilation cache.
TINY_LIMITS = dict(max_model_len=128, max_num_batched_tokens=64, max_num_seqs=8,
                   num_kv_blocks=64)
CLI_LIMITS = [*(f"--{k.replace('_', '-')}={v}" for k, v in TINY_LIMITS.items()),
              "--compilation-cache-dir", CACHE_DIR, "--served-model-name", MODEL_NAME,
              "--no-progress", "--log-interval", "0"]


def kill_batch() -> list[str]:
    """24 greedy lines of varied lengths (some finish early), completions and chat. The
    longer ones keep the run going for many steps after the first lines are written."""
    lines = []
    for i in range(24):
        body = {"max_tokens": [2, 3, 4, 16, 32, 48][i % 6], "ignore_eos": True}
        if i % 4 == 3:
            lines.append(line(f"r{i}", url="/v1/chat/completions", **body,
                              messages=[{"role": "user", "content": f"Count to {i}."}]))
        else:
            lines.append(line(f"r{i}", prompt=f"Story {i}: once upon a time", **body))
    return lines


def comparable(records) -> list:
    """Order, status, choices (text or message, finish_reason) and token counts of records."""
    out = []
    for r in records:
        body = r["response"]["body"]
        out.append((r["custom_id"], r["response"]["status_code"],
                    [(c.get("text", c.get("message")), c["finish_reason"])
                     for c in body["choices"]],
                    body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"]))
    return out


@pytest.mark.slow
def test_sigkill_midway_keeps_finished_lines_and_resume_completes_them(tiny_model_dir,
                                                                     tmp_path):
    # NOTE: the tiny random model (SmolLM2's tokenizer) stands in for the default one: the
    # kill, the resume and the output file are checked, not the text (loading the 135M GGUF
    # cost ~12 s in each of the two processes).
    src, dst, ref = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "ref.jsonl"
    src.write_text("\n".join(kill_batch()) + "\n")
    cmd = [sys.executable, "-m", "jaxserve.entrypoints.cli", "run-batch", "-i", str(src),
           "-o", str(dst), "--model", tiny_model_dir, *CLI_LIMITS]
    with open(tmp_path / "killed.log", "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.time() + 300
            while proc.poll() is None and time.time() < deadline:
                if dst.exists() and dst.read_bytes().count(b"\n") >= 4:
                    break
                time.sleep(0.1)
        finally:
            proc.kill()  # SIGKILL: no handler, no cleanup
            proc.wait(60)
    assert proc.returncode == -9, (tmp_path / "killed.log").read_text()[-3000:]
    left = [json.loads(x) for x in dst.read_bytes().split(b"\n")[:-1]]  # each one whole JSON
    assert 4 <= len(left) < 24 and dst.read_bytes().endswith(b"\n")

    done = subprocess.run(cmd + ["--resume"], cwd=REPO, capture_output=True, text=True,
                          timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"24 requests: 24 succeeded, 0 failed, {len(left)} skipped" in done.stderr
    resumed = [json.loads(x) for x in dst.read_text().splitlines()]

    uninterrupted = AsyncLLM.from_engine_args(tiny_model_dir, log_interval=0, **TINY_LIMITS)
    try:
        run_batch_file(uninterrupted, [MODEL_NAME], str(src), str(ref), use_tqdm=False)
    finally:
        uninterrupted.shutdown()
    reference = [json.loads(x) for x in ref.read_text().splitlines()]
    assert [r["custom_id"] for r in resumed] == [f"r{i}" for i in range(24)]
    assert comparable(resumed) == comparable(reference)
    ids = {r["custom_id"]: r["id"] for r in resumed}
    assert all(ids[r["custom_id"]] == r["id"] for r in left)  # kept, not rerun
