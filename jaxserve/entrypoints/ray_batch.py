"""Batch inference on a Ray cluster: an OpenAI batch file, or a Ray Dataset of prompts,
through a pool of Ray Data actors, one engine (`LLM`) per actor.

Ray is an optional extra (`pip install 'jaxserve[ray]'`). Ray Data hands each actor batches
of lines; an actor answers a batch concurrently (one continuous batch) through the same
handlers as `jaxserve run-batch` and the server, so a record is what a one-process run
writes. When an actor dies, Ray restarts it and reruns its unfinished batches
(`max_restarts`/`max_task_retries` -1, Ray Data's default for actor pools): no result is
lost. The driver writes records as batches arrive (the same resumable file as
`run-batch`), shows a progress bar, and reports requests, tokens and tok/s per actor.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import socket
import sys
import time

import numpy as np
from tqdm import tqdm

RAY_HINT = "Ray batch inference needs Ray: pip install 'jaxserve[ray]'"
MAX_RETRIES = 3  # restarts of an actor, and reruns of a batch, before the run fails
ACTOR_START_SECONDS = 900  # the longest wait for the actor pool to start


def _ray():
    try:
        import ray
        import ray.data  # noqa: F401 - the extra installs both
    except ImportError as e:
        raise ImportError(RAY_HINT) from e
    return ray


def connect(address: str | None = None, timeout: float = 30.0, num_cpus: int | None = None):
    """Joins a Ray cluster, or starts a local one (`address` None or "local").

    Args:
        address: "host:port" of a running cluster's head (or "ray://host:port" for Ray
            Client), "local", or None.
        timeout: Seconds to wait for the head to answer.
        num_cpus: CPUs a local cluster offers (default: what Ray detects).

    Raises:
        ValueError: A malformed address, or a head that does not answer within `timeout`.
        ImportError: Ray is not installed.
    """
    from jaxserve.utils import split_host_port, wait_for_listener

    ray = _ray()
    # NOTE: jaxserve's own bar and report replace Ray Data's progress bars and log lines.
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.wait_for_min_actors_s = ACTOR_START_SECONDS  # Ray's default waits forever
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    if ray.is_initialized():
        return
    if address in (None, "local"):
        ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
        return
    host_port = split_host_port(address.removeprefix("ray://"))
    if host_port is None:
        raise ValueError(f"ray address must be host:port, ray://host:port or 'local', got "
                         f"{address!r}")
    wait_for_listener(*host_port, timeout, "ray address",
                      "start the cluster (ray start --head) or check the address")
    ray.init(address=address, log_to_driver=False)


class LineWorker:
    """A Ray Data actor: one engine answering batches of batch-file lines.

    Args:
        engine_kwargs: `LLM` arguments (the model among them).
        served_names: Names a line's `model` may use.
    """

    def __init__(self, engine_kwargs: dict, served_names: list[str]):
        from jaxserve.engine.async_llm import AsyncLLM
        from jaxserve.entrypoints.run_batch import BatchRunner

        self.llm = AsyncLLM.from_engine_args(log_interval=0, **engine_kwargs)
        self.runner = BatchRunner(self.llm, served_names)
        self.name = f"{socket.gethostname()}:{os.getpid()}"

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, list]:
        start = time.perf_counter()

        async def answer():
            return await asyncio.gather(*(self.runner.run_line(str(line), int(lineno))
                                          for line, lineno in zip(batch["line"],
                                                                  batch["lineno"],
                                                                  strict=True)))

        records = asyncio.run(answer())
        seconds = time.perf_counter() - start
        n = len(records)
        return {"index": list(batch["index"]), "record": [json.dumps(r) for r in records],
                "tokens": [_completion_tokens(r) for r in records], "actor": [self.name] * n,
                "seconds": [seconds / n] * n}  # the batch's time, shared by its rows


def _completion_tokens(record: dict) -> int:
    body = (record.get("response") or {}).get("body")
    usage = body.get("usage") if isinstance(body, dict) else None
    return int(usage.get("completion_tokens", 0)) if isinstance(usage, dict) else 0


def _actor_options(num_actors: int, num_cpus: float, num_gpus: float,
                   resources: dict | None) -> dict:
    if num_actors < 1:
        raise ValueError(f"num_actors must be at least 1, got {num_actors}")
    if num_cpus < 0 or num_gpus < 0:
        raise ValueError("num_cpus and num_gpus per actor must be >= 0")
    # NOTE: a dead actor is restarted and its batches rerun, a few times (Ray Data's
    # default, forever, would loop on a batch that kills every actor that runs it).
    options = {"compute": _ray().data.ActorPoolStrategy(size=num_actors), "num_cpus": num_cpus,
               "max_restarts": MAX_RETRIES, "max_task_retries": MAX_RETRIES}
    if num_gpus:
        options["num_gpus"] = num_gpus
    if resources:
        options["resources"] = dict(resources)
    return options


def run_batch_file(input_path: str, output_path: str, engine_kwargs: dict,
                   served_names: list[str] | None = None, *, address: str | None = None,
                   num_actors: int = 2, batch_size: int = 32, num_cpus: float = 1,
                   num_gpus: float = 0, resources: dict | None = None, resume: bool = False,
                   use_tqdm: bool = True, timeout: float = 30.0) -> dict:
    """Runs an OpenAI batch file on a Ray cluster; the output is `run-batch`'s.

    Args:
        input_path: Batch input JSONL.
        output_path: Results JSONL (one record per non-blank line, input order at the end).
        engine_kwargs: `LLM` arguments for every actor (the model among them).
        served_names: Names the lines' `model` may use (default: from the model path).
        address: The cluster (see `connect`); None starts a local one.
        num_actors: Actors, one engine each.
        batch_size: Lines per Ray Data batch (the unit an actor answers, and reruns).
        num_cpus: CPUs each actor reserves.
        num_gpus: GPUs each actor reserves.
        resources: Other Ray resources each actor reserves (e.g. {"TPU": 4}).
        resume: Keep the output file's finished records; run only the other lines.
        use_tqdm: Show a progress bar.
        timeout: Seconds to wait for the cluster to answer.

    Returns:
        The report: `total`, `succeeded`, `failed`, `skipped`, `tokens`, `seconds`,
        `tokens_per_second`, and `actors` ({name: {requests, tokens, seconds,
        tokens_per_second}}).

    Raises:
        ValueError: Bad paths, options or engine arguments, or an unreachable cluster.
        RuntimeError: An actor could not build its engine (the message gives its error).
    """
    from jaxserve.config import EngineConfig
    from jaxserve.entrypoints.cli.args import check_engine_args
    from jaxserve.entrypoints.openai.serving_base import default_model_name
    from jaxserve.entrypoints.run_batch import (
        BatchOutput,
        check_paths,
        count_records,
        plan_lines,
        read_lines,
    )
    from models.default_model import default_model_path

    check_paths(input_path, output_path, resume)
    if address in (None, "local"):
        check_engine_args(engine_kwargs)  # here, not in every actor
    else:  # the model path may exist on the workers only
        EngineConfig.from_kwargs(**engine_kwargs)
    if output_path == "-":
        raise ValueError("Ray batch runs write a file (output '-' is not supported)")
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    options = _actor_options(num_actors, num_cpus, num_gpus, resources)
    names = served_names or [default_model_name(engine_kwargs.get("model")
                                                or default_model_path())]
    lines = read_lines(input_path)
    out = BatchOutput(output_path, resume, defer=True)  # untouched until records arrive
    todo = plan_lines(lines, out)
    start = time.perf_counter()
    actors: dict[str, dict] = {}
    try:
        if todo:
            ray = _ray()
            local_cpus = None if address not in (None, "local") else max(
                os.cpu_count() or 1, int(num_actors * num_cpus) + 1)
            connect(address, timeout, local_cpus)
            _check_resources(ray.cluster_resources(), num_cpus, num_gpus, resources)
            ds = ray.data.from_items([{"index": i, "lineno": n, "line": line}
                                      for i, n, line in todo])
            ds = ds.map_batches(LineWorker, fn_constructor_kwargs={
                "engine_kwargs": engine_kwargs, "served_names": names},
                batch_size=batch_size, batch_format="numpy", **options)
            bar = tqdm(total=len(out.records), initial=len(out.records) - len(todo),
                       desc="Running batch (ray)", unit="req", disable=not use_tqdm)
            try:
                batches = _iter_batches(ds)
                for batch in batches:
                    out.open()
                    for i, rec, tok, actor, sec in zip(batch["index"], batch["record"],
                                                       batch["tokens"], batch["actor"],
                                                       batch["seconds"], strict=True):
                        if out.records[int(i)] is None:  # a rerun batch may repeat one
                            out.put(int(i), json.loads(str(rec)))
                            stats = actors.setdefault(str(actor), {
                                "requests": 0, "tokens": 0, "seconds": 0.0})
                            stats["requests"] += 1
                            stats["tokens"] += int(tok)
                            stats["seconds"] += float(sec)
                            bar.update(1)
            finally:
                bar.close()
    finally:
        out.close()
    missing = [i for i, r in enumerate(out.records) if r is None]
    if missing:
        raise RuntimeError(f"{len(missing)} lines got no record (first: index {missing[0]})")
    out.finish()
    seconds = time.perf_counter() - start
    tokens = sum(a["tokens"] for a in actors.values())
    for a in actors.values():
        a["tokens_per_second"] = a["tokens"] / a["seconds"] if a["seconds"] else 0.0
    return {**count_records(out), "tokens": tokens, "seconds": seconds,
            "tokens_per_second": tokens / seconds if seconds else 0.0, "actors": actors}


def _check_resources(cluster: dict, num_cpus: float, num_gpus: float,
                     resources: dict | None) -> None:
    """Raises ValueError when no node could ever hold one actor (Ray would wait)."""
    need = {"CPU": num_cpus, "GPU": num_gpus, **(resources or {})}
    for name, amount in need.items():
        if amount and cluster.get(name, 0) < amount:
            raise ValueError(f"each actor needs {amount:g} {name}; the cluster has "
                             f"{cluster.get(name, 0):g}")


def _iter_batches(ds):
    """The mapped dataset's batches; an actor whose engine cannot start is a RuntimeError
    naming the engine's own error (not Ray's wrapped traceback)."""
    ray = _ray()
    try:
        yield from ds.iter_batches(batch_size=None, batch_format="numpy")
    except ray.exceptions.ActorDiedError as e:
        if "creation task" not in str(e):
            raise
        causes = re.findall(r"^(\w+(?:Error|Exception): .*)$", str(e), re.MULTILINE)
        raise RuntimeError("an actor could not start its engine: "
                           + (causes[-1] if causes else str(e).splitlines()[0])) from None


def print_report(report: dict, file=sys.stderr) -> None:
    """The final report of `run_batch_file`, one line per actor."""
    print(f"[jaxserve] {report['total']} requests: {report['succeeded']} succeeded, "
          f"{report['failed']} failed, {report['skipped']} skipped; {report['tokens']} "
          f"tokens in {report['seconds']:.1f} s ({report['tokens_per_second']:.1f} tok/s)",
          file=file)
    for name, a in sorted(report["actors"].items()):
        print(f"[jaxserve]   actor {name}: {a['requests']} requests, {a['tokens']} tokens, "
              f"{a['tokens_per_second']:.1f} tok/s", file=file)


class PromptWorker:
    """A Ray Data actor generating text for a Dataset's prompt column (see `generate`)."""

    def __init__(self, engine_kwargs: dict, sampling: dict, column: str):
        from jaxserve import LLM, SamplingParams

        self.llm = LLM(**engine_kwargs)
        self.params = SamplingParams(**sampling)
        self.column = column

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        outs = self.llm.generate([str(p) for p in batch[self.column]], self.params,
                                 use_tqdm=False)
        return {**batch, "generated_text": np.array([o.outputs[0].text for o in outs], object),
                "num_generated_tokens": np.array([len(o.outputs[0].token_ids) for o in outs])}


def generate(ds, engine_kwargs: dict, sampling: dict | None = None, *,
             prompt_column: str = "prompt", num_actors: int = 2, batch_size: int = 32,
             num_cpus: float = 1, num_gpus: float = 0, resources: dict | None = None):
    """A Ray Dataset of prompts through a pool of engines (lazy, like any Ray Data map).

    Args:
        ds: A `ray.data.Dataset` with a `prompt_column` of strings.
        engine_kwargs: `LLM` arguments for every actor.
        sampling: `SamplingParams` arguments (default: SamplingParams()).
        prompt_column: The column holding prompts.
        num_actors, batch_size, num_cpus, num_gpus, resources: As in `run_batch_file`.

    Returns:
        The dataset with `generated_text` and `num_generated_tokens` columns added.
    """
    from jaxserve import SamplingParams

    sampling = dict(sampling or {})
    SamplingParams(**sampling)  # a ValueError here, not in an actor
    if prompt_column not in ds.columns():
        raise ValueError(f"prompt_column {prompt_column!r} is not a column of the dataset "
                         f"(columns: {ds.columns()})")
    return ds.map_batches(PromptWorker, fn_constructor_kwargs={
        "engine_kwargs": engine_kwargs, "sampling": sampling, "column": prompt_column},
        batch_size=batch_size, batch_format="numpy",
        **_actor_options(num_actors, num_cpus, num_gpus, resources))
