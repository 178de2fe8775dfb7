"""Prometheus export of engine metrics (vLLM's names, types, labels, buckets and counting
rules; `jaxserve:` prefix or vLLM's own) and a periodic stat log. docs/openai_api.md has the
table of every family against vLLM's definition."""

from __future__ import annotations

import logging
import re
import time

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jaxserve.outputs import RequestOutput

logger = logging.getLogger("jaxserve")

# Engine figures that only grow: exported as Prometheus counters (`..._total`).
COUNTERS = frozenset({
    "jaxserve:prefix_cache_queries", "jaxserve:prefix_cache_hits", "jaxserve:num_preemptions",
    "jaxserve:prompt_tokens", "jaxserve:generation_tokens", "jaxserve:request_success",
    "jaxserve:num_cow_copies", "jaxserve:num_swap_outs", "jaxserve:num_swap_ins",
    # Speculative decoding (only in snapshots of a speculating engine); the per-position
    # one carries a `position` label.
    "jaxserve:spec_decode_num_drafts", "jaxserve:spec_decode_num_draft_tokens",
    "jaxserve:spec_decode_num_accepted_tokens",
    "jaxserve:spec_decode_num_accepted_tokens_per_pos",
    # The encoder cache (only in snapshots of an engine taking images).
    "jaxserve:mm_cache_queries", "jaxserve:mm_cache_hits", "jaxserve:encoder_cache_misses",
    "jaxserve:encoder_cache_evictions",
})
# vLLM's bucket edges (seconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# Tokens per engine iteration (vLLM's edges).
ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)
# Every family's labels (vLLM's; one engine per server here, so `engine` is "0").
LABELS = ("model_name", "engine")
ENGINE = "0"


def buckets_1_2_5(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value` (vLLM's token-count edges, the model's
    context length being `max_value`)."""
    edges, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(edges)
            edges.append(m * scale)
        scale *= 10


TOKEN_BUCKETS = buckets_1_2_5(100_000)  # until `ServerMetrics.configure` names the length
METRIC_PREFIXES = ("jaxserve", "vllm")
_LABELED = re.compile(r"^(?P<name>[^{]+)\{(?P<labels>[^}]*)\}$")


def split_name(key: str) -> tuple[str, dict[str, str]]:
    """`'a{k=v,k2=v2}'` as `('a', {'k': 'v', 'k2': 'v2'})`; a plain name has no labels."""
    m = _LABELED.match(key)
    if m is None:
        return key, {}
    labels = dict(part.split("=", 1) for part in m["labels"].split(",") if "=" in part)
    return m["name"], {k.strip(): v.strip().strip('"') for k, v in labels.items()}


class _SnapshotCollector:
    """Yields the latest `engine.get_metrics()` snapshot as counters and gauges."""

    def __init__(self, server_metrics: ServerMetrics):
        self.server_metrics = server_metrics

    def describe(self):
        return []

    def collect(self):
        model = self.server_metrics.model_name
        prefix = self.server_metrics.prefix
        families: dict[str, CounterMetricFamily | GaugeMetricFamily] = {}
        for key, value in sorted(self.server_metrics.snapshot.items()):
            name, labels = split_name(key)
            kind = CounterMetricFamily if name in COUNTERS else GaugeMetricFamily
            name = prefix + name[len("jaxserve"):] if name.startswith("jaxserve:") else name
            family = families.get(name)
            if family is None:
                family = kind(name, f"{name} (from the engine)",
                              labels=[*LABELS, *sorted(labels)])
                families[name] = family
            family.add_metric([model, ENGINE, *(labels[k] for k in sorted(labels))],
                              float(value))
        info = self.server_metrics.cache_config
        if info:
            info = {**info, "engine": ENGINE}
            family = GaugeMetricFamily(f"{prefix}:cache_config_info",
                                       "Information of the KV cache configuration",
                                       labels=sorted(info))
            family.add_metric([str(info[k]) for k in sorted(info)], 1.0)
            families["cache_config_info"] = family
        yield from families.values()


class ServerMetrics:
    """One server's metrics: its own registry, engine snapshot and latency histograms.

    The engine thread calls `update_snapshot`, `on_added`, `observe` and `observe_step`;
    `/metrics` renders `registry`.

    Args:
        model_name: Value of the `model_name` label.
        prefix: Metric name prefix: "jaxserve", or "vllm" for vLLM's own names (existing
            vLLM dashboards then work unchanged).
    """

    def __init__(self, model_name: str, prefix: str = "jaxserve"):
        if prefix not in METRIC_PREFIXES:
            raise ValueError(f"prefix must be one of {METRIC_PREFIXES}, got {prefix!r}")
        self.model_name, self.prefix = model_name, prefix
        self.registry = CollectorRegistry()
        self.snapshot: dict[str, float] = {}
        self.cache_config: dict[str, object] = {}  # labels of cache_config_info
        self.registry.register(_SnapshotCollector(self))

        self._token_families: list[Histogram] = []

        hist = self._histogram
        self.ttft = hist("time_to_first_token_seconds", "Time to first token, from arrival",
                         TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds",
                        "Time between a request's consecutive token steps", ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to finish of a request",
                        REQUEST_BUCKETS)
        self.queue = hist("request_queue_time_seconds", "Arrival to first scheduled step",
                          REQUEST_BUCKETS)
        self.inference = hist("request_inference_time_seconds",
                              "First scheduled step to finish of a request", REQUEST_BUCKETS)
        self.prefill = hist("request_prefill_time_seconds",
                            "First scheduled step to first token", REQUEST_BUCKETS)
        self.decode = hist("request_decode_time_seconds", "First token to finish",
                           REQUEST_BUCKETS)
        self.tpot = hist("request_time_per_output_token_seconds", "A finished request's "
                         "decode time per output token after the first", ITL_BUCKETS)
        self.params_n = hist("request_params_n", "The n parameter of finished requests",
                             N_BUCKETS)
        self.iteration_tokens = hist("iteration_tokens_total", "Prompt tokens of requests "
                                     "that got their first token plus tokens generated, per "
                                     "engine iteration", ITERATION_BUCKETS)
        self.configure(None)
        self._last_token_time: dict[str, float] = {}
        self._params: dict[str, tuple[int, int | None]] = {}  # request id -> (n, max_tokens)

    def _histogram(self, name: str, doc: str, buckets, keep: list | None = None) -> Histogram:
        """The family `name`'s series for this server (its family appended to `keep`)."""
        family = Histogram(f"{self.prefix}:{name}", doc, list(LABELS), buckets=buckets,
                           registry=self.registry)
        if keep is not None:
            keep.append(family)
        return family.labels(self.model_name, ENGINE)

    def configure(self, max_model_len: int | None) -> None:
        """(Re)builds the token-count histograms with edges up to `max_model_len` (vLLM's
        1-2-5 series up to the model's context length; None: up to 100,000). Their counts
        start again: call it before the server takes requests."""
        for family in self._token_families:
            self.registry.unregister(family)
        self._token_families = []
        edges = TOKEN_BUCKETS if max_model_len is None else buckets_1_2_5(max_model_len)
        hist = lambda name, doc, edges: self._histogram(name, doc, edges, self._token_families)
        self.prompt_tokens = hist("request_prompt_tokens", "Prompt tokens of a finished "
                                  "request (each completion)", edges)
        self.generation_tokens = hist("request_generation_tokens", "Tokens a finished "
                                      "completion generated", edges)
        self.max_generation_tokens = hist("request_max_num_generation_tokens", "The most "
                                          "tokens one completion of a finished request "
                                          "generated", edges)
        self.params_max_tokens = hist("request_params_max_tokens", "The max_tokens "
                                      "parameter of finished requests", edges)

    def on_added(self, request_id: str, params) -> None:
        """Remembers a request's `n` and `max_tokens` for the finish histograms."""
        self._params[request_id] = (params.n, params.max_tokens)

    def observe_step(self, num_tokens: int) -> None:
        """Records the tokens one engine iteration processed, as vLLM counts them (the
        prompt of each request that got its first token, plus every token generated); an
        iteration that processed none (a chunk of a prompt only) is not recorded."""
        if num_tokens > 0:
            self.iteration_tokens.observe(num_tokens)

    def update_snapshot(self, snapshot: dict[str, float]) -> None:
        """Replaces the engine figures (a fresh dict each time, so readers never see a mix)."""
        self.snapshot = dict(snapshot)

    def observe(self, out: RequestOutput, now: float | None = None) -> None:
        """Records latencies from one output of a request (called once per step per request)."""
        m = out.metrics
        prev = self._last_token_time.get(out.request_id)
        if m.first_token_time is not None and prev is None:
            self.ttft.observe(max(0.0, m.first_token_time - m.arrival_time))
            if m.first_scheduled_time is not None:
                self.queue.observe(max(0.0, m.first_scheduled_time - m.arrival_time))
        elif prev is not None and m.last_token_time is not None and m.last_token_time > prev:
            self.itl.observe(m.last_token_time - prev)
        if m.last_token_time is not None:
            self._last_token_time[out.request_id] = m.last_token_time
        if out.finished:
            n, max_tokens = self._params.get(out.request_id, (len(out.outputs), None))
            self.forget(out.request_id)
            end = m.finished_time or now or time.time()
            self.e2e.observe(max(0.0, end - m.arrival_time))
            self._observe_finished(out, end, n, max_tokens)

    def _observe_finished(self, out: RequestOutput, end: float, n: int,
                          max_tokens: int | None) -> None:
        m = out.metrics
        if m.first_scheduled_time is not None:
            self.inference.observe(max(0.0, end - m.first_scheduled_time))
            if m.first_token_time is not None:
                self.prefill.observe(max(0.0, m.first_token_time - m.first_scheduled_time))
        if m.first_token_time is not None:
            self.decode.observe(max(0.0, end - m.first_token_time))
        counts = [len(c.token_ids) for c in out.outputs]
        for count in counts:  # vLLM observes each completion of an n > 1 request
            self.prompt_tokens.observe(len(out.prompt_token_ids or []))
            self.generation_tokens.observe(count)
        self.max_generation_tokens.observe(max(counts, default=0))
        total = sum(counts)
        if m.first_token_time is not None and total > len(counts):
            self.tpot.observe(max(0.0, end - m.first_token_time) / (total - len(counts)))
        self.params_n.observe(n)
        if max_tokens is not None:
            self.params_max_tokens.observe(max_tokens)

    def forget(self, request_id: str) -> None:
        """Drops per-request state (finished or aborted request)."""
        self._last_token_time.pop(request_id, None)
        self._params.pop(request_id, None)


class StatLogger:
    """Logs one line of throughput and KV usage every `interval` seconds while busy.

    Args:
        interval: Seconds between lines.
    """

    def __init__(self, interval: float = 10.0):
        self.interval = interval
        self._last_time = time.monotonic()
        self._last: dict[str, float] = {}

    def maybe_log(self, snapshot: dict[str, float]) -> str | None:
        """Logs (and returns) a line if `interval` passed and anything happened since."""
        now = time.monotonic()
        if now - self._last_time < self.interval:
            return None
        elapsed, self._last_time = now - self._last_time, now
        get = lambda k: float(snapshot.get(f"jaxserve:{k}", 0.0))
        prev = lambda k: float(self._last.get(f"jaxserve:{k}", 0.0))
        prompt = get("prompt_tokens") - prev("prompt_tokens")
        gen = get("generation_tokens") - prev("generation_tokens")
        busy = get("num_requests_running") + get("num_requests_waiting")
        self._last = dict(snapshot)
        if not (prompt or gen or busy):
            return None
        queries = get("prefix_cache_queries")
        hit_rate = get("prefix_cache_hits") / queries if queries else 0.0
        line = (f"jaxserve: prompt throughput {prompt / elapsed:.1f} tok/s, generation "
                f"throughput {gen / elapsed:.1f} tok/s, running {get('num_requests_running'):.0f}"
                f", waiting {get('num_requests_waiting'):.0f}, swapped "
                f"{get('num_requests_swapped'):.0f}, KV cache usage "
                f"{100 * get('kv_cache_usage_perc'):.1f}%, prefix cache hit rate "
                f"{100 * hit_rate:.1f}%, preemptions {get('num_preemptions'):.0f}")
        logger.info(line)
        return line
