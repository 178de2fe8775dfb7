"""Do heavy requests starve ordinary ones? (issue 50 item 2.) A real `jaxserve serve` answers a
stream of 2-token completions while eight clients send heavy preparations without pause
(6 MB /tokenize bodies, the costliest /tokenize the cap lets through, 2-second looping chat
templates); the completions' latency is printed beside the idle figure of the same server in
the same run. Then six maximal /tokenize bodies at once, with the server's RSS before/after.

    python -m scripts.benchmarks.bench_prepare_starvation   # the lanes, then one shared pool
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import tempfile
import threading
import time
from collections import Counter

import httpx

from scripts.benchmarks.server_process import ServerProcess

PROBE = {"prompt": "Hello, my name is", "max_tokens": 2, "temperature": 0}
LOOP = ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}")
CONFIGS = {
    "lanes": [],  # the defaults: 1 heavy worker, 16 queued, bodies over 256 KiB are heavy
    # Every request heavy, one pool of 6 threads: the shared default pool of before.
    "shared pool": ["--heavy-request-bytes", "1", "--heavy-prepare-workers", "6",
                    "--heavy-prepare-queue", "100000"],
}


def heavy_bodies(max_model_len: int) -> dict[str, tuple[str, bytes]]:
    """(path, body) of each heavy kind."""
    cap, per_token = 4 * max_model_len, 81  # the default cap; SmolLM2's longest token
    return {
        "tokenize 6 MB": ("/tokenize", b'{"prompt": "' + b"hello " * 1_000_000 + b'"}'),
        # The longest text the cap lets through to the tokenizer: 2 tokens per character.
        "tokenize at the cap": ("/tokenize", ('{"prompt": "' + "\U0001f642" * (cap * per_token)
                                              + '"}').encode()),
        "template 2 s": ("/v1/chat/completions", (
            '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, '
            f'"chat_template": "{LOOP}"}}').encode()),
    }


def probe_latencies(url: str, seconds: float | None = None, count: int | None = None,
                    gap: float = 0.05) -> list[float]:
    """Seconds of each 2-token completion sent one after another."""
    out, end = [], time.time() + (seconds or 1e9)
    with httpx.Client(base_url=url, timeout=300) as c:
        while time.time() < end and (count is None or len(out) < count):
            start = time.perf_counter()
            r = c.post("/v1/completions", json=PROBE)
            assert r.status_code == 200, r.text
            out.append(time.perf_counter() - start)
            time.sleep(gap)
    return out


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def loaded(url: str, path: str, body: bytes, clients: int, seconds: float):
    """Probe latencies while `clients` threads send `body` back to back; their statuses."""
    stop, statuses, lock = threading.Event(), Counter(), threading.Lock()

    def hammer():
        with httpx.Client(base_url=url, timeout=600) as c:
            while not stop.is_set():
                r = c.post(path, content=body, headers={"Content-Type": "application/json"})
                with lock:
                    statuses[r.status_code] += 1

    threads = [threading.Thread(target=hammer) for _ in range(clients)]
    for t in threads:
        t.start()
    time.sleep(1.0)  # let the heavy requests arrive first
    lat = probe_latencies(url, seconds)
    stop.set()
    for t in threads:
        t.join()
    return lat, statuses


def six_at_once(server: ServerProcess, body: bytes) -> tuple[Counter, float, float]:
    """Six concurrent /tokenize of `body`: statuses, RSS MB before and after."""
    before = server.rss_mb()

    def post(_):
        return httpx.post(f"{server.url}/tokenize", content=body, timeout=600,
                          headers={"Content-Type": "application/json"}).status_code

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        statuses = Counter(pool.map(post, range(6)))
    time.sleep(1.0)
    return statuses, before, server.rss_mb()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=20.0, help="probing time per heavy kind")
    p.add_argument("--idle-probes", type=int, default=60)
    p.add_argument("--clients", type=int, default=8, help="concurrent heavy clients")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--configs", default=",".join(CONFIGS), help="which server configs")
    p.add_argument("--kinds", default=None, help="heavy kinds (comma-separated)")
    args = p.parse_args()
    bodies = heavy_bodies(args.max_model_len)
    kinds = args.kinds.split(",") if args.kinds else list(bodies)
    common = ["--max-model-len", str(args.max_model_len), "--max-num-seqs", "8",
              "--max-num-batched-tokens", "64", "--log-interval", "0"]
    print(f"load average at start {os.getloadavg()[0]:.2f}; {args.clients} heavy clients, "
          f"{args.seconds:.0f} s per kind")
    print("| server | load | P50 s | P99 s | P50 vs idle | P99 vs idle | heavy answers |")
    print("|---|---|---|---|---|---|---|")
    memory = []
    for name in args.configs.split(","):
        log = os.path.join(tempfile.gettempdir(), f"bench_starvation_{name.replace(' ', '_')}"
                                                  ".log")
        server = ServerProcess(common + CONFIGS[name], log)
        try:
            probe_latencies(server.url, count=5)  # first requests after warm-up
            idle = probe_latencies(server.url, count=args.idle_probes)
            p50, p99 = pct(idle, 0.5), pct(idle, 0.99)
            print(f"| {name}: idle | {os.getloadavg()[0]:.1f} | {p50:.3f} | {p99:.3f} | 1.00x "
                  f"| 1.00x | |", flush=True)
            for kind in kinds:
                path, body = bodies[kind]
                lat, statuses = loaded(server.url, path, body, args.clients, args.seconds)
                answers = ", ".join(f"{n} x {s}" for s, n in sorted(statuses.items()))
                print(f"| {name}: {kind} | {os.getloadavg()[0]:.1f} | {pct(lat, 0.5):.3f} | "
                      f"{pct(lat, 0.99):.3f} | {pct(lat, 0.5) / p50:.2f}x | "
                      f"{pct(lat, 0.99) / p99:.2f}x | {answers} |", flush=True)
            for kind in ("tokenize 6 MB", "tokenize at the cap"):
                statuses, before, after = six_at_once(server, bodies[kind][1])
                memory.append((name, kind, statuses, before, after))
        finally:
            server.stop()
    print("\n| server | six at once | answers | RSS before MB | after MB | change MB |")
    print("|---|---|---|---|---|---|")
    for name, kind, statuses, before, after in memory:
        answers = ", ".join(f"{n} x {s}" for s, n in sorted(statuses.items()))
        print(f"| {name} | {kind} | {answers} | {before:.0f} | {after:.0f} | "
              f"{after - before:+.0f} |")


if __name__ == "__main__":
    main()
