"""`jaxserve serve` over two processes of four CPU devices each (one tp=8 mesh spanning both,
loopback only): process 0 answers HTTP and sends each step to process 1. Answers equal
one process's; shutdown and a dying process reach the other; bad set-ups fail fast."""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.conftest import write_tiny_hf_dir

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# 7 usable pages of 16 tokens for 4 running requests: preemption, by swapping to host
# memory (each process swaps the KV heads it holds).
ENGINE_ARGS = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32,
                   num_kv_blocks=8, preemption_mode="swap", swap_space=0.01)
ENGINE = [x for k, v in ENGINE_ARGS.items() for x in (f"--{k.replace('_', '-')}", str(v))]
PROMPTS = ["The capital of France is", "Once upon a time there was a little", "1, 2, 3, 4,",
           "def fib(n):" * 8, "Hello", "A long prompt " * 12]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tp8_model_dir(smollm2_path, smollm2_tokenizer, tmp_path_factory) -> str:
    """A tiny random Llama whose 8 query and 8 KV heads split over 8 devices."""
    from models.loaders.gguf_file import open_gguf

    directory = str(tmp_path_factory.mktemp("tp8") / "tiny-llama-tp8")
    return write_tiny_hf_dir(directory, smollm2_tokenizer, open_gguf(smollm2_path).hf_config(),
                             hidden_size=64, intermediate_size=128, num_attention_heads=8,
                             num_key_value_heads=8, head_dim=8)


def launch(model_dir: str, tmp_path, process_ids=(0, 1), tp: int = 8, timeout: int = 30,
           coordinator: int | None = None):
    """Starts `jaxserve serve` processes; returns (processes, log paths, http port)."""
    coordinator = coordinator or free_port()
    port = free_port()
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    procs, logs = [], []
    for i in process_ids:
        log = tmp_path / f"process{i}.log"
        cmd = [sys.executable, "-m", "jaxserve.entrypoints.cli", "serve", model_dir,
               "--tensor-parallel-size", str(tp), "--coordinator-address",
               f"127.0.0.1:{coordinator}", "--num-processes", "2", "--process-id", str(i),
               "--distributed-timeout", str(timeout), "--port", str(port), *ENGINE]
        with open(log, "w") as f:
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f,
                                          stderr=subprocess.STDOUT))
        logs.append(log)
    return procs, logs, port


def wait_ready(port: int, procs, logs, limit: float = 400) -> None:
    import httpx

    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        for p, log in zip(procs, logs, strict=True):
            assert p.poll() is None, log.read_text()[-3000:]
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise AssertionError("server not ready: " + logs[0].read_text()[-3000:])


def wait_exit(procs, limit: float) -> list[int]:
    deadline = time.monotonic() + limit
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError(f"process {p.args} still running after {limit} s") from None
    return [p.returncode for p in procs]


def complete(port: int, prompt: str, stream: bool = False) -> str:
    from openai import OpenAI

    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    res = client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0,
                                    stream=stream)
    if stream:
        return "".join(chunk.choices[0].text for chunk in res if chunk.choices)
    return res.choices[0].text


def one_process_texts(model_dir: str) -> list[str]:
    from jaxserve import LLM, SamplingParams

    llm = LLM(model_dir, warmup=False, **ENGINE_ARGS)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    return [o.outputs[0].text for o in outs]


@pytest.mark.slow
def test_two_process_server_matches_one_process(tp8_model_dir, tmp_path):
    import httpx

    procs, logs, port = launch(tp8_model_dir, tmp_path)
    try:
        wait_ready(port, procs, logs)
        with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:  # concurrent: one batch
            got = list(pool.map(lambda ip: complete(port, ip[1], stream=ip[0] % 2 == 1),
                                enumerate(PROMPTS)))
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        os.kill(procs[0].pid, signal.SIGTERM)  # the leader drains and tells process 1
        codes = wait_exit(procs, 60)
    finally:
        for p in procs:
            p.kill()
    assert got == one_process_texts(tp8_model_dir)
    swap_outs = [ln for ln in metrics.splitlines() if ln.startswith("jaxserve:num_swap_outs")]
    assert float(swap_outs[0].split()[-1]) > 0, swap_outs  # the swap path ran on both
    assert codes == [0, 0], [log.read_text()[-2000:] for log in logs]
    assert "follower 1 stopping" in logs[1].read_text()


@pytest.mark.slow
def test_a_dying_process_takes_the_other_down(tp8_model_dir, tmp_path):
    from openai import APIError

    procs, logs, port = launch(tp8_model_dir, tmp_path, timeout=10)
    try:
        wait_ready(port, procs, logs)
        procs[1].kill()
        with pytest.raises(APIError):  # the step's collective fails: an error, no hang
            complete(port, PROMPTS[0])
        codes = wait_exit(procs[:1], 60)  # the leader is stopped by the runtime
    finally:
        for p in procs:
            p.kill()
    assert codes[0] != 0


def test_tp_not_a_multiple_of_processes_fails_fast(tp8_model_dir, tmp_path):
    procs, logs, _ = launch(tp8_model_dir, tmp_path, tp=1)
    try:
        codes = wait_exit(procs, 120)
    finally:
        for p in procs:
            p.kill()
    assert codes[0] != 0 and codes[1] == 2
    for log in logs:
        assert "tensor_parallel_size=1 must be a multiple of the 2 processes" in log.read_text()


def test_unreachable_coordinator_fails_fast(tp8_model_dir, tmp_path):
    start = time.monotonic()
    procs, logs, _ = launch(tp8_model_dir, tmp_path, process_ids=(1,), timeout=3)
    codes = wait_exit(procs, 90)
    assert codes == [2]
    assert "did not answer within 3 s" in logs[0].read_text()
    assert time.monotonic() - start < 90


@pytest.mark.parametrize("args, message", [
    (("127.0.0.1:1", None, 0), "--num-processes and --process-id are required"),
    (("127.0.0.1:1", 2, 2), r"process_id must be in \[0, num_processes=2\), got 2"),
    (("host0", 2, 1), "coordinator_address must be host:port, got 'host0'"),
    (("[::1]:x", 2, 1), "coordinator_address must be host:port"),
])
def test_initialize_rejects_bad_arguments(args, message):
    from jaxserve.parallel.multihost import initialize

    with pytest.raises(ValueError, match=message):  # before joining anything
        initialize(*args)
    with pytest.raises(ValueError, match="distributed timeout must be at least 1 s"):
        initialize("127.0.0.1:1", 2, 1, timeout=0)


def test_split_host_port():
    from jaxserve.utils import split_host_port

    assert split_host_port("host0:12345") == ("host0", 12345)
    assert split_host_port("[::1]:6379") == ("::1", 6379)
    assert split_host_port("host0") is None and split_host_port(":80") is None
