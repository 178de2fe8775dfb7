"""`scripts/benchmarks/rss_vs_llama.py`: its memory reading against the kernel's own accounting of a
file this test maps, and its llama-server side (flags, readiness, the batch) against a
stand-in server; bad arguments are refused by name."""

import mmap
import os
import sys
import textwrap

import pytest


@pytest.fixture(scope="module")
def script():
    from scripts.benchmarks import rss_vs_llama

    return rss_vs_llama


def test_memory_counts_a_mapped_file(script, tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(os.urandom(8 << 20))
    before = script.memory_mb(os.getpid(), str(path))
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        sum(m[i] for i in range(0, len(m), 4096))  # touch every page
        during = script.memory_mb(os.getpid(), str(path))
    assert before["model_map"] == 0
    assert 8.3 <= during["model_map"] <= 8.4  # 8 MiB in MB
    assert during["RssFile"] - before["RssFile"] >= 8.3
    assert during["VmRSS"] >= during["RssAnon"] + during["RssFile"] - 0.1
    assert during["VmHWM"] >= during["VmRSS"]


FAKE_SERVER = textwrap.dedent("""
    import json, sys
    from http.server import BaseHTTPRequestHandler, HTTPServer
    args = sys.argv[1:]
    class H(BaseHTTPRequestHandler):
        def _send(self, body):
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        def do_GET(self):
            self._send({"data": [{"id": "m"}]} if self.path == "/v1/models" else {})
        def do_POST(self):
            n = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["max_tokens"]
            self._send({"usage": {"completion_tokens": n}})
        def log_message(self, *a):
            pass
    HTTPServer(("127.0.0.1", int(args[args.index("--port") + 1])), H).serve_forever()
""")


def test_llama_side_against_a_stand_in(script, tmp_path):
    """The llama-server form starts the binary with the model and the KV tokens it was
    given (`-c`), waits for /health, sends the batch and reads the process's memory."""
    binary = tmp_path / "llama-server"
    binary.write_text(f"#!{sys.executable}\n{FAKE_SERVER}")
    binary.chmod(0o755)
    args = script.argparse.Namespace(llama_server=str(binary), prompts=3, max_tokens=5)
    server = script.LlamaServer(str(binary), "model.gguf", 1234, str(tmp_path / "log"))
    try:
        assert script.run_batch(server.url, 3, 5) == 15
        m = script.memory_mb(server.proc.pid, "model.gguf")
        assert m["VmRSS"] > 1 and m["model_map"] == 0
        with open(f"/proc/{server.proc.pid}/cmdline") as f:
            cmdline = f.read().split("\0")
        assert cmdline[cmdline.index("-m") + 1] == "model.gguf"
        assert cmdline[cmdline.index("-c") + 1] == "1234"
    finally:
        server.stop()
    rows, tokens = script.measure("llama", args, "model.gguf", 777, str(tmp_path))
    assert tokens == 777 and [r[1] for r in rows] == ["start-up", "after 3 x 5 tokens"]
    assert server.proc.poll() is not None


@pytest.mark.parametrize("argv, message", [
    (["--forms", "jaxserve,vllm"], "unknown form 'vllm'"),
    (["--forms", "llama", "--llama-server", "/nonexistent/llama-server"],
     "no llama-server at /nonexistent/llama-server"),
])
def test_bad_arguments(script, argv, message):
    with pytest.raises(ValueError, match=message):
        script.main(argv)


def test_llama_needs_a_jaxserve_form_first(script, tmp_path):
    args = script.argparse.Namespace(llama_server="/bin/true", prompts=1, max_tokens=1)
    with pytest.raises(ValueError, match="needs a jaxserve form before it"):
        script.measure("llama", args, "m.gguf", None, str(tmp_path))
    with pytest.raises(ValueError, match="names a jaxserve tree"):
        script.measure("llama@/tmp", args, "m.gguf", 5, str(tmp_path))


def test_accounting_ledger_sees_a_phase_that_allocates():
    """`scripts/benchmarks/rss_accounting.py`'s ledger: a phase that touches 64 MiB shows
    ~67 MB added (anonymous), the table holds every phase."""
    import mmap

    import numpy as np

    from scripts.benchmarks import rss_accounting as accounting

    ledger = accounting.Ledger()
    ledger.mark("start")
    # NOTE: fresh private anonymous pages, not `np.ones`: in a test worker that has freed
    # arrays before, malloc hands a 64 MiB request chunks that are resident already
    # (CI saw +0 MB).
    held = mmap.mmap(-1, 64 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    pages = np.frombuffer(held, np.uint8)
    pages[:] = 1  # every page touched
    ledger.mark("64 MiB of ones")
    added = ledger.rows[1][2]["VmRSS"] - ledger.rows[0][2]["VmRSS"]
    anon = ledger.rows[1][2]["RssAnon"] - ledger.rows[0][2]["RssAnon"]
    assert 60 < added < 80 and 60 < anon < 80, (added, anon)
    table = ledger.table().splitlines()
    assert len(table) == 4 and table[3].startswith("| 64 MiB of ones |")
    assert pages.sum() == 64 << 20
