"""What every `jaxserve` command shares: one definition of the engine arguments (vLLM's
spellings, defaults shown), their validation before anything loads, and quiet start-up."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from jaxserve.config import (
    DTYPES,
    KV_CACHE_DTYPES,
    LOGPROBS_MODES,
    PREEMPTION_MODES,
    SCHEDULING_MODES,
    SCHEDULING_POLICIES,
)
from jaxserve.pooling_params import RUNNERS, TASKS
from models.quant import QUANTIZATIONS
from pallas_kernels.ops import ATTENTION_BACKENDS

# (flag, type or "bool" for --x/--no-x or "json" for a JSON object, choices, default as shown,
# help). The defaults are EngineConfig's; flags left unset keep them (None is never passed on).
ENGINE_ARGS = [
    ("--dtype", str, DTYPES, "auto",
     "parameter, activation and KV dtype (auto: float32 on the CPU, else the checkpoint's, "
     "bfloat16 for most)"),
    ("--revision", str, None, "main",
     "the Hugging Face hub revision (branch, tag or commit) of a hub id MODEL"),
    ("--tokenizer-revision", str, None, "--revision",
     "the hub revision of a hub id MODEL's tokenizer"),
    ("--download-dir", str, None, "the hub's cache (HF_HUB_CACHE); for URLs "
     "~/.cache/jaxserve/models", "where hub models are cached and bucket URLs copied"),
    ("--quantization", str, QUANTIZATIONS,
     "the model's own (GGUF: kept quantized; on the CPU where its kernel reads it, "
     "else dequantized)",
     "weight format on the device"),
    ("--kv-cache-dtype", str, KV_CACHE_DTYPES, "auto",
     "KV page dtype (8-bit: a float32 scale per token and head)"),
    ("--max-model-len", int, None,
     "the model's context length, or what the KV pool holds when less",
     "longest prompt + output"),
    ("--max-num-seqs", int, None, "64", "most requests in one step"),
    ("--max-num-batched-tokens", int, None, "512 with chunked prefill, else max-model-len",
     "token budget of one step; warm-up compiles one program per bucket up to it"),
    ("--block-size", int, (8, 16, 32, 64, 128), "16", "tokens per KV page"),
    ("--num-kv-blocks", int, None, "sized from memory", "fix the KV page count"),
    ("--gpu-memory-utilization", float, None, "0.9",
     "fraction of accelerator memory for weights + KV"),
    ("--kv-cache-memory-gib", float, None, "1.0",
     "KV budget in GiB where the device reports no memory (the CPU)"),
    ("--swap-space", float, None, "4", "host swap space in GiB for --preemption-mode swap"),
    ("--enable-prefix-caching", "bool", None, "on", "reuse KV pages of shared prefixes"),
    ("--num-state-snapshots", int, None, "--max-num-seqs",
     "linear-attention models: state slots kept for prefix caching's snapshots (0: no prefix "
     "caching for them)"),
    ("--disable-hybrid-kv-cache-manager", "bool", None, "off",
     "one block table for sliding-window and full-attention layers alike (Gemma 2/3: "
     "sliding layers then keep their whole context)"),
    ("--enable-chunked-prefill", "bool", None, "on", "split long prompts across steps"),
    ("--long-prefill-token-threshold", int, None, "0 (no cap)",
     "cap on one request's prefill chunk"),
    ("--preemption-mode", str, PREEMPTION_MODES, "recompute", "what preemption does"),
    ("--scheduling-policy", str, SCHEDULING_POLICIES, "fcfs", "which request runs first"),
    ("--scheduling-mode", str, SCHEDULING_MODES, "continuous+chunked",
     "the others exist for benchmarks"),
    ("--async-scheduling", "bool", None, "on",
     "schedule each step while the previous one runs on the device"),
    ("--attention-backend", str, ATTENTION_BACKENDS, "auto", "attention kernels"),
    ("--seed", int, None, "0", "seed of the engine's random stream"),
    ("--runner", str, RUNNERS, "generate",
     "pooling: serve embeddings (/v1/embeddings) instead of completions"),
    ("--task", str, tuple(TASKS), "generate", "vLLM's older spelling: embed = --runner pooling"),
    ("--pooler-config", "json", None, '{"pooling_type": "LAST", "normalize": true}',
     'the pooling runner\'s pooler, vLLM\'s JSON object, e.g. \'{"pooling_type": "MEAN"}\' '
     "(LAST, MEAN or CLS; normalize; dimensions)"),
    ("--hf-overrides", "json", None, "none",
     'fields merged into config.json, e.g. Qwen3-Reranker\'s \'{"architectures": '
     '["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"], '
     '"is_original_qwen3_reranker": true}\''),
    ("--convert", str, ("auto", "none", "embed", "classify"), "auto",
     "classify: serve a *ForCausalLM as its *ForSequenceClassification; embed: the reverse"),
    ("--max-logprobs", int, None, "20",
     "most logprobs / prompt_logprobs a request may ask for (-1: the whole vocabulary; above "
     "20 warm-up compiles one more width)"),
    ("--logprobs-mode", str, LOGPROBS_MODES, "raw_logprobs",
     "what sample logprobs hold: log-softmax or logits, before (raw) or after (processed) "
     "penalties, temperature and top-k/top-p/min-p"),
    ("--batch-invariant", "bool", None, "off",
     "every request's logits bit-for-bit the same whatever shares its step (xla/cpu)"),
    ("--enable-return-routed-experts", "bool", None, "off",
     "mixture of experts: every completion carries its tokens' routed experts per layer"),
    ("--limit-mm-per-prompt", "json", None, '{"image": 999}',
     'most images in one prompt, vLLM\'s JSON object, e.g. \'{"image": 2}\' (0: no images)'),
    ("--allowed-local-media-path", str, None, "none: file:// URLs refused",
     "a directory whose files image parts may name as file:// URLs"),
    ("--max-image-pixels", int, None, "40000000", "largest decoded image (width x height)"),
    ("--max-image-bytes", int, None, "20 MiB",
     "largest encoded image (data URL payload, file or download)"),
    ("--image-fetch-timeout", float, None, "10", "seconds an http(s) image download may take"),
    ("--allow-http-images", "bool", None, "on",
     "fetch http(s) image URLs (--no-allow-http-images: refuse them, e.g. without a network)"),
    ("--tensor-parallel-size", int, None, "1", "devices one model is split over"),
    ("--enable-expert-parallel", "bool", None, "off",
     "mixture of experts: split the experts over the tensor-parallel devices (whole experts "
     "per device) instead of each expert's width"),
    ("--expert-parallel-size", int, None, "1",
     "mixture of experts: devices of an expert axis in front of the tensor-parallel ones "
     "(experts split over it; attention replicated over it)"),
    ("--enable-dp-attention", "bool", None, "off",
     "mixture of experts: the expert axis's devices also split the requests' attention and "
     "the page pool (data-parallel attention; needs --expert-parallel-size > 1)"),
    ("--data-parallel-size", int, None, "1", "engine replicas on disjoint devices"),
    ("--warmup", "bool", None, "on",
     "precompile every bucket at start-up (--no-warmup: compile on first use instead)"),
    ("--compilation-cache-dir", str, None, "~/.cache/jaxserve/jax",
     "JAX persistent compilation cache (later starts reuse compiled programs)"),
    ("--speculative-config", "json", None, "off",
     'speculative decoding, vLLM\'s JSON object, e.g. \'{"method": "ngram", '
     '"num_speculative_tokens": 3}\' (optional: prompt_lookup_min, prompt_lookup_max)'),
]
# The LoRA engine flags (vLLM's), on the commands that can name an adapter (`serve`,
# `run-batch`), with `--lora-modules` beside them (`add_lora_args`).
LORA_ARGS = [
    ("--enable-lora", "bool", None, "off",
     "serve LoRA adapters (PEFT directories) on top of the base model, per request"),
    ("--max-loras", int, None, "1", "adapters one step may run (the device's adapter slots)"),
    ("--max-lora-rank", int, None, "16", "largest adapter rank served"),
    ("--max-cpu-loras", int, None, "max-loras", "adapters kept loaded on the host (an LRU)"),
]
MODEL_HELP = ("GGUF file, Hugging Face directory, jaxserve checkpoint, Hugging Face hub id "
              "(Qwen/Qwen3-0.6B: its cache, HF_HUB_OFFLINE, HF_TOKEN) or fsspec URL "
              "(gs://bucket/model) (default: the embedded SmolLM2-135M-Instruct)")


class Parser(argparse.ArgumentParser):
    """argparse without abbreviations (`--max-token` is an error, not `--max-tokens`), that
    knows its subcommands (`command_parser`)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self.subcommands = None  # what `add_subparsers` returned, if it was called

    def add_subparsers(self, **kwargs):
        """argparse's `add_subparsers`, remembered as `subcommands`."""
        self.subcommands = super().add_subparsers(**kwargs)
        return self.subcommands

    def command_parser(self, args: argparse.Namespace) -> argparse.ArgumentParser:
        """The parser of the innermost (sub)command `args` chose (for its usage line)."""
        action = self.subcommands
        chosen = None if action is None else action.choices.get(getattr(args, action.dest,
                                                                          None))
        if isinstance(chosen, Parser):
            return chosen.command_parser(args)
        return self if chosen is None else chosen


def add_engine_args(p: argparse.ArgumentParser, positional_model: bool = True,
                    defaults: dict | None = None) -> None:
    """Adds the model (positional MODEL and/or `--model`) and the engine flags.

    Args:
        p: The command's parser.
        positional_model: Also accept the model as a positional MODEL.
        defaults: Command-specific defaults to show instead of EngineConfig's (e.g. the
            benchmarks'), by destination name.
    """
    if positional_model:
        p.add_argument("model_pos", nargs="?", metavar="MODEL", default=None, help=MODEL_HELP)
        p.add_argument("--model", default=None, help="the model, as an option (same as MODEL)")
    else:
        p.add_argument("--model", default=None, help=MODEL_HELP)
    _add_flags(p.add_argument_group("engine arguments"), ENGINE_ARGS, defaults)


def add_lora_args(p: argparse.ArgumentParser, runtime_updating: bool = False) -> None:
    """Adds the LoRA engine flags (`LORA_ARGS`) and `--lora-modules` (read by
    `cli.engine.serving_models`).

    Args:
        p: The command's parser.
        runtime_updating: Also add `--allow-runtime-lora-updating` (the server's).
    """
    group = p.add_argument_group("LoRA adapters")
    _add_flags(group, LORA_ARGS, None)
    group.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                       help="adapters served from the start, each 'name=path' or vLLM's JSON "
                            '\'{"name": "x", "path": "/adapters/x", "base_model_name": "b"}\' '
                            "(a request's model field picks one by name; needs --enable-lora)")
    if runtime_updating:
        group.add_argument("--allow-runtime-lora-updating", action="store_true",
                           help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter "
                                "(any client with the key may then load adapter directories "
                                "of this host; also on with "
                                "VLLM_ALLOW_RUNTIME_LORA_UPDATING=true; needs --enable-lora)")


def _add_flags(group, specs: list, defaults: dict | None) -> None:
    for flag, kind, choices, shown, text in specs:
        dest = flag[2:].replace("-", "_")
        shown = (defaults or {}).get(dest, shown)
        help_text = f"{text} (default: {shown})"
        if kind == "bool":
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None,
                               help=help_text)
        elif kind == "json":
            group.add_argument(flag, type=str, default=None, help=help_text, metavar="JSON")
        else:
            group.add_argument(flag, type=kind, choices=choices, default=None, help=help_text,
                               metavar=None if choices else dest.upper())


def engine_kwargs(args) -> dict:
    """`EngineConfig.from_kwargs` arguments from parsed flags (only those given).

    A JSON flag (`--speculative-config`) becomes the object it spells, as vLLM's engine
    arguments hold it; its fields are checked by `check_engine_args`.

    Raises:
        ValueError: A JSON flag's text is not JSON (the message names the argument).
    """
    kwargs = {}
    for flag, kind, *_ in ENGINE_ARGS + LORA_ARGS:
        dest = flag[2:].replace("-", "_")
        value = getattr(args, dest, None)
        if value is not None and kind == "json":
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"{dest}: not valid JSON ({e})") from None
        if value is not None:
            kwargs[dest] = value
    return {"model": getattr(args, "model_pos", None) or getattr(args, "model", None), **kwargs}


def check_engine_args(kwargs: dict) -> None:
    """Validates engine arguments and the model path before anything heavy loads.

    `speculative_config` (vLLM's dict or its JSON) is parsed by `SpeculativeConfig.from_dict`
    and must name a method the engine runs.

    A hub id or URL is only checked for its form here (it is fetched when the engine loads).

    Raises:
        ValueError: A value out of range (naming it), a model path that does not exist (and
            is no hub id or URL), or a bad `speculative_config` (the message names the
            field).
    """
    from jaxserve.config import EngineConfig
    from models.loaders.model_source import check_model_name

    config = EngineConfig.from_kwargs(**kwargs)  # parses speculative_config (from_dict)
    spec = config.speculative_config
    if spec is not None and isinstance(spec.model, str):
        try:
            check_model_name(spec.model)
        except ValueError as e:
            raise ValueError(f"speculative_config.model: {str(e).removeprefix('model ')}"
                             ) from None
    check_model_name(kwargs.get("model"))


def add_distributed_args(p: argparse.ArgumentParser) -> None:
    """Flags of a multi-host start (one process per host; see the README)."""
    group = p.add_argument_group("multi-host (jax.distributed)")
    group.add_argument("--coordinator-address", default=None,
                       help="host:port of process 0, the same on every host")
    group.add_argument("--num-processes", type=int, default=None, help="processes in all")
    group.add_argument("--process-id", type=int, default=None, help="this process's index")
    group.add_argument("--distributed-timeout", type=int, default=60,
                       help="seconds to wait for every process to join, and after which a "
                            "process that stopped answering takes the others down "
                            "(default: 60)")


def init_distributed(args) -> None:
    """Calls `jax.distributed.initialize` when a coordinator address was given."""
    if getattr(args, "coordinator_address", None):
        from jaxserve.parallel.multihost import initialize

        initialize(args.coordinator_address, args.num_processes, args.process_id,
                   getattr(args, "distributed_timeout", 60))


def quiet_start(verbose: bool = False) -> None:
    """Silences start-up noise that suggests breakage where there is none.

    transformers' "PyTorch was not found" advice (jaxserve never needs torch to serve) and
    JAX's probing of absent TPU/GPU plugins ("Unable to initialize backend 'tpu'") are
    dropped; jaxserve's own log lines stay at INFO when `verbose`.
    """
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    logging.basicConfig(level=logging.WARNING,
                        format="%(levelname)s %(asctime)s %(message)s")
    for name in ("jax._src.xla_bridge", "jax._src.compiler", "absl"):
        logging.getLogger(name).setLevel(logging.ERROR)
    logging.getLogger("jaxserve").setLevel(logging.INFO if verbose else logging.WARNING)


def print_backend(file=sys.stderr) -> None:
    """One line naming the JAX backend and devices in use."""
    import jax

    devices = jax.devices()
    kinds = sorted({d.device_kind for d in devices})
    print(f"[jaxserve] JAX {jax.__version__} on {jax.default_backend()}: {len(devices)} "
          f"device(s) ({', '.join(kinds)})", file=file)
