"""Resident memory of `jaxserve serve` beside llama.cpp's `llama-server`, interleaved.

Issue 49 item 2: per round, each form is started as a fresh server on the same GGUF file
(the embedded SmolLM2 unless --model says otherwise), measured once ready ("start-up")
and again after a batch of concurrent completions ("after batch"), then stopped; the
forms run one after the other (A, B, C, A, B, C, ...) with the load average beside each
figure. llama-server gets the KV capacity in tokens of the jaxserve server measured just
before it (`-c`, read from jaxserve's `cache_config_info` metric), so both hold the same
number of tokens (jaxserve's default pool for a GGUF's blocks on the CPU in float16, as
llama.cpp's default; `jaxserve-kv-f32` keeps float32 pages, half the tokens in the same
`--kv-cache-memory-gib`; `jaxserve-23k` a float16 pool of the float32 pool's tokens).

Per figure: VmRSS, its anonymous and file-backed parts (RssAnon, RssFile; the GGUF file's
mapped pages are in RssFile, and llama.cpp serves its weights from that mapping), the
model file's own mapped pages (from /proc/PID/smaps), and the peak (VmHWM).

Usage:
    python -m scripts.benchmarks.rss_vs_llama [--rounds 2] [--prompts 8] [--max-tokens 32]
        [--forms jaxserve,jaxserve-gguf,llama] [--llama-server PATH] [--jaxserve-args "..."]
"""

from __future__ import annotations

import argparse
import os
import shlex
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from scripts.benchmarks.server_process import REPO, LlamaServer, ServerProcess

LLAMA_SERVER = ("/tmp/s30/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-server")
# form -> extra `jaxserve serve` flags (None: llama-server).
FORMS = {"jaxserve": [], "jaxserve-gguf": ["--quantization", "gguf"],
         "jaxserve-kv-f32": ["--kv-cache-dtype", "float32"],
         # the 1457 pages of the float32 pool above, in float16 (0.5 GiB)
         "jaxserve-23k": ["--num-kv-blocks", "1457"],
         "jaxserve-gguf-no-warmup": ["--quantization", "gguf", "--no-warmup"],
         # the same 1457 pages as the default pool, as int8 codes (XLA attention)
         "jaxserve-gguf-kv-int8": ["--quantization", "gguf", "--kv-cache-dtype", "int8",
                                   "--num-kv-blocks", "1457"],
         "jaxserve-gguf-kv-int8-no-warmup": ["--quantization", "gguf", "--kv-cache-dtype",
                                            "int8", "--num-kv-blocks", "1457", "--no-warmup"],
         "jaxserve-gguf-arena2": ["--quantization", "gguf"],
         "llama": None}
# form -> environment variables of its server (glibc's arenas: one per thread by default).
FORM_ENV = {"jaxserve-gguf-arena2": {"MALLOC_ARENA_MAX": "2"}}


def memory_mb(pid: int, model_path: str) -> dict[str, float]:
    """VmRSS, RssAnon, RssFile, VmHWM of `pid` and the Rss of its mappings of
    `model_path`, in MB."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
                out[key] = int(rest.split()[0]) * 1024 / 1e6  # kB (KiB) -> MB
    model_kb, current = 0, None
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            first = line.split(maxsplit=1)[0]
            if "-" in first and not first.endswith(":"):  # a mapping's header line
                current = line.split()[-1] if len(line.split()) >= 6 else None
            elif first == "Rss:" and current == os.path.realpath(model_path):
                model_kb += int(line.split()[1])
    out["model_map"] = model_kb * 1024 / 1e6
    return out


def load_avg() -> float:
    return os.getloadavg()[0]


def prompts(n: int) -> list[str]:
    return [f"Request {i}: write a short story about the number {i}." for i in range(n)]


def run_batch(url: str, n: int, max_tokens: int) -> int:
    """`n` concurrent one-prompt completions (greedy); the tokens generated."""
    name = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]

    def one(prompt: str) -> int:
        r = httpx.post(f"{url}/v1/completions", timeout=600, json={
            "model": name, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0.0})
        r.raise_for_status()
        return int(r.json()["usage"]["completion_tokens"])

    with ThreadPoolExecutor(n) as pool:
        return sum(pool.map(one, prompts(n)))


def kv_tokens(server: ServerProcess) -> int:
    """Tokens the jaxserve server's KV pool holds (its pages but the null page)."""
    for name in server.metrics():
        if "cache_config_info{" in name:
            labels = dict(kv.split("=", 1) for kv in name[name.index("{") + 1:-1].split(","))
            return (int(labels["num_gpu_blocks"]) - 1) * int(labels["block_size"])
    raise RuntimeError("the server's /metrics has no cache_config_info")


def measure(form: str, args, model: str, ctx: int | None, log_dir: str):
    """(rows, KV tokens) of one fresh server of `form` (`FORMS[base]` or `base@TREE`, a
    jaxserve form run from another checkout): start-up and after the batch."""
    form, _, tree = form.partition("@")
    log = os.path.join(log_dir, f"{len(os.listdir(log_dir))}-{form}.log")
    t0 = time.perf_counter()
    if FORMS[form] is None:
        if tree:
            raise ValueError("a checkout (@TREE) names a jaxserve tree, not llama-server's")
        if ctx is None:
            raise ValueError("llama-server needs a jaxserve form before it (its KV tokens)")
        server = LlamaServer(args.llama_server, model, ctx, log)
        tokens, pid = ctx, server.proc.pid
    else:
        flags = [*([] if args.default_model else ["--model", model]), *FORMS[form],
                 *shlex.split(args.jaxserve_args)]
        server = ServerProcess(flags, log, repo=tree or REPO, extra_env=FORM_ENV.get(form))
        tokens, pid = kv_tokens(server), server.proc.pid
    ready_s = time.perf_counter() - t0
    rows = []
    try:
        form = f"{form}@{tree}" if tree else form
        rows.append((form, "start-up", ready_s, load_avg(), memory_mb(pid, model)))
        t0 = time.perf_counter()
        run_batch(server.url, args.prompts, args.max_tokens)
        rows.append((form, f"after {args.prompts} x {args.max_tokens} tokens",
                     time.perf_counter() - t0, load_avg(), memory_mb(pid, model)))
    finally:
        server.stop()
    return rows, tokens


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF file (default: embedded SmolLM2)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=8, help="concurrent requests")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--forms", default=",".join(FORMS),
                        help=f"comma-separated, in order per round, of {', '.join(FORMS)}; "
                             "a jaxserve form may name another checkout: jaxserve@/path")
    parser.add_argument("--llama-server", default=LLAMA_SERVER)
    parser.add_argument("--jaxserve-args", default="", help="extra `jaxserve serve` flags")
    parser.add_argument("--log-dir", default=None, help="keep the servers' logs here")
    args = parser.parse_args(argv)
    forms = args.forms.split(",")
    for form in forms:
        if form.partition("@")[0] not in FORMS:
            raise ValueError(f"unknown form {form!r}; expected one of {', '.join(FORMS)}")
    if "llama" in forms and not os.access(args.llama_server, os.X_OK):
        raise ValueError(f"no llama-server at {args.llama_server} (--llama-server)")
    args.default_model = args.model is None
    if args.default_model:
        from models.default_model import default_model_path
        args.model = default_model_path()

    print("| round | server | when | s | load avg | RSS MB | anon MB | file MB | "
          "GGUF mapped MB | peak MB | KV tokens |")
    print("|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|", flush=True)
    ctx = None
    with tempfile.TemporaryDirectory() as tmp:
        log_dir = args.log_dir or tmp
        os.makedirs(log_dir, exist_ok=True)
        for r in range(1, args.rounds + 1):
            for form in forms:
                rows, tokens = measure(form, args, args.model, ctx, log_dir)
                if FORMS[form.partition("@")[0]] is not None:
                    ctx = tokens
                for name, when, secs, load, m in rows:
                    print(f"| {r} | {name} | {when} | {secs:.1f} | {load:.2f} | "
                          f"{m['VmRSS']:.0f} | {m['RssAnon']:.0f} | {m['RssFile']:.0f} | "
                          f"{m['model_map']:.0f} | {m['VmHWM']:.0f} | {tokens} |", flush=True)


if __name__ == "__main__":
    main()
