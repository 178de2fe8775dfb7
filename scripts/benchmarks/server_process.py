"""A `jaxserve serve` child process for the scripts that load a real server (the starvation
benchmark, the soak, the memory and one-user comparisons): start it, wait until it is
ready, read its memory and metrics, stop it; and llama.cpp's `llama-server` as their peer."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port() -> int:
    """A free loopback port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def await_health(server, what: str, log_path: str, ready_timeout: float) -> None:
    """Returns once `server.url`'s `/health` answers 200; RuntimeError (the server stopped)
    if `server.proc` exits first or `ready_timeout` seconds pass."""
    deadline = time.time() + ready_timeout
    while True:
        if server.proc.poll() is not None:
            raise RuntimeError(f"{what} exited during start-up (see {log_path})")
        if time.time() > deadline:
            server.stop()
            raise RuntimeError(f"{what} was not ready in {ready_timeout:.0f} s")
        try:
            if httpx.get(f"{server.url}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)


class ServerProcess:
    """`python -m jaxserve.entrypoints.cli serve ARGS` on a free port, log to `log_path`.

    Args:
        args: Flags after `serve` (the port is added).
        log_path: Where its stdout and stderr go.
        ready_timeout: Seconds to wait for `/health` to answer 200.
        repo: The jaxserve tree it runs, also its working directory (which `python -m`
            puts first on the import path; default: this tree).
        extra_env: Environment variables set for it on top of this process's.
    """

    def __init__(self, args: list[str], log_path: str, ready_timeout: float = 600.0,
                 repo: str = REPO, extra_env: dict[str, str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, **(extra_env or {}), "PYTHONPATH": os.pathsep.join(
            p for p in (repo, os.environ.get("PYTHONPATH")) if p)}
        self.log = open(log_path, "w")  # noqa: SIM115 - closed by stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jaxserve.entrypoints.cli", "serve", "--port",
             str(self.port), "--uvicorn-log-level", "warning", *args],
            stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=repo)
        await_health(self, "the server", log_path, ready_timeout)

    def rss_mb(self) -> float:
        """The server's resident memory in MB."""
        with open(f"/proc/{self.proc.pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6

    def metrics(self) -> dict[str, float]:
        """`/metrics` as `{name{labels but model_name}: value}`."""
        from prometheus_client.parser import text_string_to_metric_families

        values = {}
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                extra = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())
                                 if k != "model_name")
                values[s.name + (f"{{{extra}}}" if extra else "")] = s.value
        return values

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM (the server drains), SIGKILL after `timeout`; the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


class LlamaServer:
    """`llama-server -m MODEL -c CTX [EXTRA_ARGS]` on a free port (its defaults otherwise):
    llama.cpp's server as a benchmark's peer, never a dependency."""

    def __init__(self, binary: str, model: str, ctx: int, log_path: str,
                 extra_args: tuple[str, ...] = (), ready_timeout: float = 300.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_path, "w")  # noqa: SIM115 - closed by stop()
        self.proc = subprocess.Popen(
            [binary, "-m", model, "-c", str(ctx), "--port", str(self.port), *extra_args],
            stdout=self.log, stderr=subprocess.STDOUT)
        await_health(self, "llama-server", log_path, ready_timeout)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
