"""`jaxserve serve` as a real process: default served name, the stat log line, SIGTERM drain."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx

from tests.entrypoints.conftest import MODEL_NAME, free_port, sse_events

CACHE_DIR = os.environ.get("JAXSERVE_TEST_CACHE", os.path.join(
    os.path.dirname(__file__), "..", "..", ".jax_cache"))


def test_serve_process_drains_on_sigterm(tmp_path, smollm2_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "serve.log", "w+")  # read back after the process ends
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxserve.entrypoints.cli", "serve", "--port", str(port),
         # NOTE: no warm-up (tests/entrypoints/test_server_lifecycle.py covers it): the
         # stream runs the one token bucket it uses; loading still answers 503. The sizes
         # of the serving tests' server (tests/entrypoints/conftest.py), whose warm-up put
         # that bucket's programs in the compilation cache.
         "--no-warmup",
         "--max-model-len", "256", "--max-num-batched-tokens", "64", "--max-num-seqs", "8",
         "--num-kv-blocks", "64", "--compilation-cache-dir", CACHE_DIR, "--log-interval", "1",
         "--uvicorn-log-level", "warning"], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 240
        saw_starting = False
        while True:
            assert proc.poll() is None, "the server exited during start-up"
            assert time.time() < deadline, "the server did not come up"
            try:
                health = httpx.get(f"{url}/health", timeout=2)
                if health.status_code == 200:
                    break
                # Listening during start-up: 503 with the progress (issue 19).
                assert health.status_code == 503 and health.json()["status"] == "starting"
                saw_starting = True
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        models = httpx.get(f"{url}/v1/models").json()["data"]
        assert [m["id"] for m in models] == [MODEL_NAME]

        events, started = [], threading.Event()
        # NOTE: long enough to outlast a --log-interval of 1 s (16 tokens took under 1 s
        # once the CPU decode step got faster, and no stat line was logged).
        body = {"prompt": "Once upon a time", "max_tokens": 96, "temperature": 0,
                "ignore_eos": True, "stream": True}

        def stream():
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    started.set()
                    events.append(line)

        worker = threading.Thread(target=stream)
        worker.start()
        assert started.wait(60)
        proc.send_signal(signal.SIGTERM)
        worker.join(120)
        assert proc.wait(120) == 0  # drained, then a normal exit (was 143)
    finally:
        if proc.poll() is None:
            proc.kill()
    parsed = sse_events(httpx.Response(200, text="\n".join(events)))
    assert parsed[-1] == "[DONE]" and parsed[-2]["choices"][0]["finish_reason"] == "length"
    assert "".join(e["choices"][0]["text"] for e in parsed[:-1]).startswith(", the city of")
    log.seek(0)
    text = log.read()
    log.close()
    assert saw_starting
    assert "generation throughput" in text and "KV cache usage" in text
    assert "SIGTERM" in text
