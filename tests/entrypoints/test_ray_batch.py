"""Batch inference on a local Ray cluster (`jaxserve.entrypoints.ray_batch`, `run-batch
--ray`): two CPU actors answer 64 batch lines as one process does, a killed actor loses no
result, runs resume, a Dataset of prompts maps through the pool, and bad set-ups fail fast
(all but the option checks in the slow tier)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

pytest.importorskip("ray")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENGINE = dict(max_model_len=256, max_num_seqs=16, max_num_batched_tokens=64, warmup=False)
FLAGS = ["--served-model-name", "tiny", "--max-model-len", "256", "--max-num-seqs", "16",
         "--max-num-batched-tokens", "64", "--no-warmup", "--no-progress"]


def batch_lines(n: int = 64) -> list[str]:
    """Completion and chat lines of different lengths, all greedy."""
    lines = []
    for i in range(n):
        if i % 2:
            url, body = "/v1/chat/completions", {"messages": [
                {"role": "user", "content": f"Question {i}: tell me about number {i}"}],
                "max_tokens": 6 + i % 5}
        else:
            url, body = "/v1/completions", {"prompt": f"Story {i}: once upon a time "
                                            * (1 + i % 4), "max_tokens": 6 + i % 7}
        lines.append(json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": url,
                                 "body": {"model": "tiny", "temperature": 0, **body}}))
    return lines


def answers(path) -> dict[str, tuple]:
    """custom_id -> (choices, token counts) of an output file, in file order (ids, times
    and prefix-cache hits differ between runs)."""
    out = {}
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            body = r["response"]["body"]
            usage = body["usage"]
            out[r["custom_id"]] = (body["choices"], usage["prompt_tokens"],
                                   usage["completion_tokens"])
    return out


@pytest.fixture(scope="module")
def batch(tiny_model_dir, tmp_path_factory):
    """(input path, one-process output path) of the 64-line batch."""
    from jaxserve.engine.async_llm import AsyncLLM
    from jaxserve.entrypoints.run_batch import run_batch_file

    d = tmp_path_factory.mktemp("ray_batch")
    src, ref = d / "in.jsonl", d / "one_process.jsonl"
    src.write_text("\n".join(batch_lines()) + "\n")
    llm = AsyncLLM.from_engine_args(tiny_model_dir, log_interval=0, **ENGINE)
    try:
        counts = run_batch_file(llm, ["tiny"], str(src), str(ref), use_tqdm=False)
    finally:
        llm.shutdown()
    assert counts["succeeded"] == 64
    return src, ref


def ray_run(model_dir: str, args: list[str]) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.Popen([sys.executable, "-m", "jaxserve.entrypoints.cli", "run-batch",
                             "--model", model_dir, *FLAGS, *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def actor_pids() -> list[int]:
    out = subprocess.run(["pgrep", "-f", "LineWorker"], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


@pytest.mark.slow
def test_two_actors_match_one_process_through_a_killed_actor(tiny_model_dir, batch, tmp_path):
    src, ref = batch
    dst = tmp_path / "ray.jsonl"
    proc = ray_run(tiny_model_dir, ["-i", str(src), "-o", str(dst), "--ray", "local",
                                    "--num-actors", "2", "--ray-batch-size", "4"])
    killed, lines_then = None, None
    deadline = time.monotonic() + 600
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            done = len(dst.read_text().splitlines()) if dst.exists() else 0
            pids = actor_pids()
            if killed is None and done >= 4 and len(pids) >= 2:
                killed, lines_then = pids[0], done
                os.kill(killed, signal.SIGKILL)  # mid-run: Ray restarts it, reruns its batch
            time.sleep(0.2)
        out, _ = proc.communicate(timeout=max(1, deadline - time.monotonic()))
    finally:
        proc.kill()
    assert proc.returncode == 0, out[-3000:]
    assert killed is not None and lines_then < 64  # the kill happened while lines remained
    assert "64 requests: 64 succeeded, 0 failed" in out
    assert len([ln for ln in out.splitlines() if "  actor " in ln]) >= 2  # per-actor figures
    got, want = answers(dst), answers(ref)
    assert list(got) == list(want)  # every custom_id once, in input order
    assert got == want


@pytest.fixture
def local_ray():
    import ray

    from jaxserve.entrypoints.ray_batch import connect

    connect("local", num_cpus=3)
    yield ray
    ray.shutdown()


@pytest.mark.slow
def test_resume_and_a_dataset_of_prompts(tiny_model_dir, batch, tmp_path, local_ray):
    from jaxserve import LLM, SamplingParams
    from jaxserve.entrypoints.ray_batch import generate, run_batch_file

    src, ref = batch
    dst = tmp_path / "resumed.jsonl"
    done = ref.read_text().splitlines()[:60]
    dst.write_text("\n".join(done[:59]) + "\n" + done[59][:20])  # 59 whole, 1 torn
    report = run_batch_file(str(src), str(dst), {"model": tiny_model_dir, **ENGINE}, ["tiny"],
                            address="local", num_actors=1, resume=True, use_tqdm=False)
    assert (report["total"], report["skipped"], report["succeeded"]) == (64, 59, 64)
    assert sum(a["requests"] for a in report["actors"].values()) == 5
    assert answers(dst) == answers(ref)

    prompts = [f"Prompt number {i} is about" for i in range(6)]
    ds = local_ray.data.from_items([{"prompt": p, "key": i} for i, p in enumerate(prompts)])
    rows = generate(ds, {"model": tiny_model_dir, **ENGINE}, {"temperature": 0, "max_tokens": 5},
                    num_actors=1, batch_size=4).take_all()
    llm = LLM(tiny_model_dir, **ENGINE)
    want = [o.outputs[0].text for o in llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)]
    assert sorted((r["key"], r["generated_text"]) for r in rows) == list(enumerate(want))
    assert all(r["num_generated_tokens"] == 5 for r in rows)

    # An engine that fails in the actors (the driver cannot see the model's limit): an
    # error naming it, in bounded time, and an earlier output file is left as it was.
    earlier = tmp_path / "earlier.jsonl"
    earlier.write_text("an earlier run's results\n")
    with pytest.raises(RuntimeError, match="could not start its engine: ValueError: "
                                           "max_model_len=100000 exceeds"):
        run_batch_file(str(src), str(earlier),
                       {"model": tiny_model_dir, **ENGINE, "max_model_len": 100000}, ["tiny"],
                       address="local", num_actors=1, use_tqdm=False)
    assert earlier.read_text() == "an earlier run's results\n"
    # Resources no node has: an error at once, not a wait.
    with pytest.raises(ValueError, match="each actor needs 1 GPU; the cluster has 0"):
        run_batch_file(str(src), str(earlier), {"model": tiny_model_dir, **ENGINE}, ["tiny"],
                       address="local", num_actors=1, num_gpus=1, use_tqdm=False)
    assert earlier.read_text() == "an earlier run's results\n"


@pytest.mark.slow
def test_unreachable_ray_address_fails_fast(tiny_model_dir, batch, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    proc = ray_run(tiny_model_dir, ["-i", str(batch[0]), "-o", str(tmp_path / "o.jsonl"),
                                    "--ray", f"127.0.0.1:{port}", "--ray-timeout", "2"])
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2, out[-2000:]
    assert f"ray address 127.0.0.1:{port} did not answer within 2 s" in out
    assert time.monotonic() - start < 120


def test_bad_options_are_value_errors(tmp_path, monkeypatch):
    from jaxserve.entrypoints import ray_batch

    src = tmp_path / "in.jsonl"
    src.write_text(batch_lines(1)[0] + "\n")
    with pytest.raises(ValueError, match="num_actors must be at least 1"):
        ray_batch.run_batch_file(str(src), str(tmp_path / "o.jsonl"), {}, ["tiny"],
                                 num_actors=0)
    with pytest.raises(ValueError, match="output '-' is not supported"):
        ray_batch.run_batch_file(str(src), "-", {}, ["tiny"])
    with pytest.raises(ValueError, match="model path /no/such/model does not exist"):
        ray_batch.run_batch_file(str(src), str(tmp_path / "o.jsonl"),
                                 {"model": "/no/such/model"}, ["tiny"])
    with pytest.raises(ValueError, match="ray address must be host:port"):
        ray_batch.connect("nowhere", timeout=1)
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(ImportError, match=r"pip install 'jaxserve\[ray\]'"):
        ray_batch.connect("local")
