"""`run-batch` over a fake engine: one record per line, incremental writes, resume, CLI."""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from types import SimpleNamespace

import pytest

from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.entrypoints import cli
from jaxserve.entrypoints.cli import run_batch as cli_run_batch
from jaxserve.entrypoints.run_batch import (
    check_paths,
    encode_record,
    read_records,
    run_batch_file,
)
from tests.entrypoints.fake_engine import FakeEngine

MODEL = "fake-model"


class CountingEngine(FakeEngine):
    """`FakeEngine` with a real tokenizer for the handlers; remembers each added request."""

    def __init__(self, tokenizer, step_seconds: float = 0.001):
        super().__init__(step_seconds=step_seconds)
        self.tokenizer = tokenizer
        self.model = SimpleNamespace(cfg=SimpleNamespace(vocab_size=len(tokenizer)))
        self.added: list[str] = []

    def add_request(self, request_id, prompt, params, **kwargs):
        super().add_request(request_id, prompt, params, **kwargs)
        self.added.append(request_id)


def make_llm(tokenizer, step_seconds: float = 0.001) -> AsyncLLM:
    return AsyncLLM(CountingEngine(tokenizer, step_seconds), log_interval=0)


@pytest.fixture
def llm(smollm2_tokenizer):
    llm = make_llm(smollm2_tokenizer)
    yield llm
    llm.shutdown()


def req(custom_id, url="/v1/completions", **body) -> str:
    body = {"model": MODEL, "max_tokens": 3, "temperature": 0, **body}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def batch(n: int) -> list[str]:
    """`n` completion lines whose lengths vary, so they finish out of input order."""
    return [req(f"r{i}", prompt=f"p{i}", max_tokens=[9, 2, 5, 1, 7][i % 5]) for i in range(n)]


def run(llm, tmp_path, lines, name="out.jsonl", **kwargs):
    src, dst = tmp_path / "in.jsonl", tmp_path / name
    src.write_text("\n".join(lines) + "\n", encoding="utf-8", errors="surrogatepass")
    counts = run_batch_file(llm, [MODEL], str(src), str(dst), use_tqdm=False, **kwargs)
    return counts, [json.loads(x) for x in dst.read_text().splitlines()]


def comparable(records) -> list:
    """What must agree between runs: order, status, choices and token counts (no ids/times)."""
    out = []
    for r in records:
        resp = r["response"] or {}
        body = resp.get("body", {})
        use = body.get("usage", {})
        out.append((r["custom_id"], (r["error"] or {}).get("code"), resp.get("status_code"),
                    body.get("choices"), body.get("error"),
                    [use.get(k) for k in ("prompt_tokens", "completion_tokens")]))
    return out


def test_every_non_blank_line_gets_exactly_one_record(llm, tmp_path):
    deep_body = '{"custom_id": "deep-body", "method": "POST", "url": "/v1/completions", ' \
                '"body": {"prompt": ' + "[" * 900 + "]" * 900 + "}}"
    lines = [
        req("ok", prompt="hello"),
        "[" * 100000,
        req("surrogate", prompt="a\ud800b"),
        req("chat-surrogate", url="/v1/chat/completions",
            messages=[{"role": "user", "content": "\udfff"}]),
        req("\ud800-id", prompt="x"),
        "",
        "[1, 2]", "42", "null", '"text"',
        json.dumps({"custom_id": "missing"}),
        json.dumps({"custom_id": 7, "method": "POST", "url": "/v1/completions", "body": {}}),
        req("where", url="/v1/embeddings", input="x"),
        req("ok", prompt="again"),
        "{not json",
        "   ",
        req("sep\u2028arated", prompt="line\u2028separator\x85inside"),
        deep_body,
        req("chat", url="/v1/chat/completions", messages=[{"role": "user", "content": "Hi"}]),
    ]
    counts, records = run(llm, tmp_path, lines)
    assert len(records) == len([ln for ln in lines if ln.strip()]) == 17
    assert counts == {"total": 17, "succeeded": 4, "failed": 13, "skipped": 0}
    codes = [(r["custom_id"], (r["error"] or {}).get("code"),
              (r["response"] or {}).get("status_code")) for r in records]
    assert codes == [
        ("ok", None, 200), (None, "invalid_json", None), ("surrogate", None, codes[2][2]),
        ("chat-surrogate", None, codes[3][2]), ("\ud800-id", None, 200),
        (None, "invalid_request", None), (None, "invalid_request", None),
        (None, "invalid_request", None), (None, "invalid_request", None),
        ("missing", "invalid_request", None), (None, "invalid_request", None),
        ("where", "invalid_url", None), ("ok", "duplicate_custom_id", None),
        (None, "invalid_json", None), ("sep\u2028arated", None, 200),
        ("deep-body", codes[15][1], codes[15][2]), ("chat", None, 200)]
    assert "nested too deeply" in records[1]["error"]["message"]
    assert records[1]["error"]["message"].startswith("line 2:")
    assert "line 14" in records[12]["error"]["message"]
    assert records[0]["response"]["body"]["choices"][0]["text"] == "t0 t1 t2 "
    assert codes[2][2] in (400, 500) and codes[3][2] in (400, 500)  # a 400 or 500, no crash
    assert codes[15][1] is not None or codes[15][2] is not None
    assert len(llm.engine.added) == 4  # the duplicate was not run


def test_writer_and_reader_survive_lone_surrogates_and_damage(tmp_path):
    rec = {"id": "x", "custom_id": "\ud800", "response": None, "error": {"message": "\udfff"}}
    line = encode_record(rec)
    assert line.endswith(b"\n") and line.count(b"\n") == 1 and line.isascii()
    assert json.loads(line) == rec
    bad = json.loads(encode_record({"custom_id": "c", "response": object()}))
    assert bad["custom_id"] == "c" and bad["error"]["code"] == "unserializable_result"
    path = tmp_path / "out.jsonl"
    path.write_bytes(b"".join([
        encode_record({"custom_id": "a", "response": {"status_code": 200}}),
        b"garbage\n", b"[1]\n", encode_record({"custom_id": None, "error": {}}),
        encode_record({"custom_id": "b", "error": {"code": "duplicate_custom_id"}}),
        encode_record({"custom_id": "a", "response": {"status_code": 500}}),
        encode_record(rec), encode_record({"custom_id": "cut", "error": None})[:-9]]))
    records = read_records(str(path))
    assert list(records) == ["a", "\ud800"]
    assert records["a"]["response"]["status_code"] == 200
    assert read_records(str(tmp_path / "missing.jsonl")) == {}


def test_records_are_appended_as_lines_finish(smollm2_tokenizer, tmp_path):
    llm = make_llm(smollm2_tokenizer, step_seconds=0.03)
    lines = [req(f"r{i}", prompt=f"p{i}", max_tokens=1 if i < 4 else 40) for i in range(8)]
    dst = tmp_path / "out.jsonl"
    dst.write_text("stale line from an earlier run\n")
    seen = []
    try:
        worker = threading.Thread(target=lambda: seen.append(run(llm, tmp_path, lines)))
        worker.start()
        partial = None
        while worker.is_alive():
            text = dst.read_text()
            if text.count("\n") >= 4 and worker.is_alive():
                partial = [json.loads(x) for x in text.splitlines()]
                break
            time.sleep(0.01)
        worker.join(30)
    finally:
        llm.shutdown()
    assert partial is not None, "no finished line was written before the run ended"
    assert 4 <= len(partial) < 8 and "stale" not in dst.read_text()
    assert {r["custom_id"] for r in partial[:4]} == {"r0", "r1", "r2", "r3"}
    (counts, records), = seen
    assert [r["custom_id"] for r in records] == [f"r{i}" for i in range(8)]
    assert counts["succeeded"] == 8


def test_resume_keeps_whole_records_and_matches_an_uninterrupted_run(llm, tmp_path):
    lines = batch(12) + ["{broken", req("r3", prompt="dup")]
    _, reference = run(llm, tmp_path, lines, "reference.jsonl")
    assert len(llm.engine.added) == 12
    # What a killed run leaves: some records in finish order, a partial last line.
    kept = random.Random(0).sample(reference[:12], 5)
    dst = tmp_path / "out.jsonl"
    dst.write_bytes(b"".join(encode_record(r) for r in kept) + b'{"id": "batch_req-x", "cust')
    llm.engine.added.clear()
    counts, resumed = run(llm, tmp_path, lines, resume=True)
    assert counts == {"total": 14, "succeeded": 12, "failed": 2, "skipped": 5}
    assert len(llm.engine.added) == 7
    assert comparable(resumed) == comparable(reference)
    kept_ids = {r["custom_id"]: r["id"] for r in kept}
    assert all(r["id"] == kept_ids[r["custom_id"]] for r in resumed if r["custom_id"] in kept_ids)
    # Resuming a complete file runs nothing and keeps its records (the cheap error lines
    # are answered again).
    llm.engine.added.clear()
    counts, again = run(llm, tmp_path, lines, resume=True)
    assert counts["skipped"] == 12 and llm.engine.added == []
    assert [r["id"] for r in again[:12]] == [r["id"] for r in resumed[:12]]
    assert comparable(again) == comparable(reference)
    # Without --resume the same file is started afresh.
    counts, fresh = run(llm, tmp_path, lines)
    assert counts["skipped"] == 0 and len(llm.engine.added) == 12
    assert comparable(fresh) == comparable(reference)


def test_stdout_streams_in_input_order_and_cannot_resume(llm, tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(batch(6)) + "\n")
    counts = run_batch_file(llm, [MODEL], str(src), "-", use_tqdm=False)
    records = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [r["custom_id"] for r in records] == [f"r{i}" for i in range(6)]
    assert counts == {"total": 6, "succeeded": 6, "failed": 0, "skipped": 0}
    with pytest.raises(ValueError, match="stdout"):
        run_batch_file(llm, [MODEL], str(src), "-", resume=True)


def test_unusable_paths_are_refused_before_anything_runs(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text(req("a", prompt="x") + "\n")
    with pytest.raises(ValueError, match="must not be the input"):
        check_paths(str(src), str(src))
    with pytest.raises(ValueError, match="does not exist"):
        check_paths(str(tmp_path / "nope.jsonl"), str(tmp_path / "out.jsonl"))
    with pytest.raises(ValueError, match="directory"):
        check_paths(str(src), str(tmp_path / "no" / "out.jsonl"))
    with pytest.raises(ValueError, match="regular file"):
        check_paths(str(src), str(tmp_path))
    # The CLI says so (exit 2) without loading a model.
    assert cli.main(["run-batch", "-i", str(src), "-o", "-", "--resume"]) == 2


def test_cli_reports_counts_and_stops_cleanly_on_sigterm(smollm2_tokenizer, tmp_path, monkeypatch,
                                                          capsys):
    engines = []

    def fake_start(args, verbose=True, models=None):
        engines.append(make_llm(smollm2_tokenizer, step_seconds=0.04))
        return engines[-1], [MODEL]

    monkeypatch.setattr(cli_run_batch, "start_engine", fake_start)
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(batch(5) + ["oops"]) + "\n")
    args = ["run-batch", "-i", str(src), "-o", str(dst), "--no-progress",
            "--served-model-name", MODEL]
    assert cli.main(args) == 0
    err = capsys.readouterr().err
    assert "6 requests: 5 succeeded, 1 failed, 0 skipped" in err and str(dst) in err
    assert not engines[-1].is_running
    assert cli.build_parser().parse_args(args + ["--resume"]).resume

    src.write_text("\n".join(req(f"s{i}", prompt="p", max_tokens=1 if i < 2 else 50)
                             for i in range(6)) + "\n")

    def terminate_once_a_line_is_written():
        deadline = time.time() + 30
        while time.time() < deadline:
            if dst.exists() and dst.read_text().count("\n") >= 2:
                os.kill(os.getpid(), signal.SIGTERM)
                return
            time.sleep(0.01)

    # A SIGTERM that came too late must fail the test, not kill pytest.
    ignore = lambda signum, frame: None  # noqa: E731
    previous = signal.signal(signal.SIGTERM, ignore)
    dst.unlink()
    killer = threading.Thread(target=terminate_once_a_line_is_written)
    try:
        killer.start()
        assert cli.main(args) == 128 + signal.SIGTERM
        killer.join()
        assert signal.getsignal(signal.SIGTERM) is ignore
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert "rerun with --resume" in capsys.readouterr().err
    left = [json.loads(x) for x in dst.read_text().splitlines()]
    assert 2 <= len(left) < 6 and not engines[-1].is_running
    assert cli.main(args + ["--resume"]) == 0
    assert f"6 requests: 6 succeeded, 0 failed, {len(left)} skipped" in capsys.readouterr().err
    assert [json.loads(x)["custom_id"] for x in dst.read_text().splitlines()] == [
        f"s{i}" for i in range(6)]
