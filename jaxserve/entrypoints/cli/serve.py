"""`jaxserve serve`: the OpenAI-compatible HTTP server (listening at once, warm-up behind it)."""

from __future__ import annotations

import logging
import os

from jaxserve.entrypoints.cli.args import (
    add_distributed_args,
    add_engine_args,
    add_lora_args,
    check_engine_args,
    engine_kwargs,
    init_distributed,
    print_backend,
    quiet_start,
)
from jaxserve.entrypoints.cli.engine import add_serving_args, served_names, serving_models
from jaxserve.entrypoints.openai.reasoning import REASONING_PARSERS
from jaxserve.entrypoints.openai.tool_parsers import TOOL_PARSERS

TOOL_PARSER_NAMES = tuple(TOOL_PARSERS)
REASONING_PARSER_NAMES = tuple(REASONING_PARSERS)


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server",
                       description="OpenAI-compatible HTTP server. It listens at once; "
                                   "/health answers 503 with the warm-up progress until the "
                                   "engine is ready.")
    add_engine_args(p)
    add_lora_args(p, runtime_updating=True)
    add_distributed_args(p)
    add_serving_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    p.add_argument("--api-key", default=os.environ.get("JAXSERVE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize, "
                        "/detokenize, /invocations and /tokenizer_info (default: the "
                        "JAXSERVE_API_KEY environment variable, which keeps the key out of "
                        "the process list)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests may take to finish after SIGTERM; the "
                        "rest end with an error (default: 30)")
    p.add_argument("--max-request-body-bytes", type=int, default=8 * 1024 * 1024,
                   help="largest request body; larger ones get a 413 (default: 8 MiB)")
    p.add_argument("--max-prompts-per-request", type=int, default=256,
                   help="most prompts one completion request may carry (default: 256)")
    p.add_argument("--max-tokenize-tokens", type=int, default=None,
                   help="most token ids /tokenize returns and /detokenize takes; more is a "
                        "400 (default: 4 x max-model-len)")
    p.add_argument("--max-stop-strings", type=int, default=64,
                   help="most stop strings one request may give; each is searched for after "
                        "every token, on the host (default: 64)")
    p.add_argument("--heavy-request-bytes", type=int, default=256 * 1024,
                   help="request bodies larger than this, and requests with their own "
                        "chat_template, are prepared in the heavy lane (default: 262144)")
    p.add_argument("--heavy-prepare-workers", type=int, default=1,
                   help="heavy requests parsed, tokenized or templated at once (default: 1)")
    p.add_argument("--heavy-prepare-queue", type=int, default=16,
                   help="heavy requests that may wait for a worker; more get a 429 "
                        "(default: 16)")
    p.add_argument("--heavy-prepare-share", type=float, default=0.5,
                   help="most of the time the heavy workers may be busy, in (0, 1]; heavy "
                        "requests wait in the queue for the rest (default: 0.5)")
    p.add_argument("--disable-fastapi-docs", action="store_true",
                   help="serve no /docs, /redoc or /openapi.json (they need no key otherwise)")
    p.add_argument("--enable-server-load-tracking", action="store_true",
                   help="GET /load reports the completion and chat requests being answered "
                        "(otherwise 0)")
    p.add_argument("--metric-name-prefix", choices=["jaxserve", "vllm"], default="jaxserve",
                   help="prefix of the /metrics names; 'vllm' exports vLLM's own names, so "
                        "existing vLLM dashboards work unchanged (default: jaxserve)")
    p.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                   help="serve GET /tokenizer_info (the tokenizer's configuration and chat "
                        "template)")
    p.add_argument("--server-dev-mode", action="store_true",
                   help="serve vLLM's development endpoints POST /sleep?level=1|2, POST "
                        "/wake_up, GET /is_sleeping, POST /reset_prefix_cache (also on with "
                        "VLLM_SERVER_DEV_MODE=1)")
    p.add_argument("--tool-call-parser", default="hermes",
                   choices=[*TOOL_PARSER_NAMES, "none"],
                   help="how chat replies to requests with tools (tool_choice 'auto') are "
                        "read for tool calls, vLLM's names: 'hermes' (<tool_call>{json}"
                        "</tool_call>), 'llama3_json', 'mistral', 'openai' (gpt-oss's harmony "
                        "calls), 'pythonic', 'qwen3_coder', or 'none' (the reply stays content) "
                        "(default: hermes)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted for vLLM's command lines: tool_choice 'auto' is read by "
                        "--tool-call-parser whenever one is set")
    p.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSER_NAMES,
                   help="split a chat reply's <think>...</think> into the message's "
                        "reasoning (and reasoning_content), vLLM's names: 'qwen3', "
                        "'deepseek_r1', or 'openai_gptoss' (gpt-oss's harmony analysis "
                        "channel) (default: no split)")
    p.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="usage.prompt_tokens_details.cached_tokens (prefix-cache hits) in "
                        "responses whose prompts hit the cache, as vLLM's flag (null otherwise)")
    p.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="logprob tokens as 'token_id:N' strings, so clients map them to ids "
                        "without the tokenizer, as vLLM's flag (a request's "
                        "return_tokens_as_token_ids overrides it)")
    p.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"],
                   help="(default: info)")
    p.set_defaults(handler=run)


def serving_limits(args, multimodal=None):
    """The server's `ServingLimits` from its flags (ValueError naming a bad parser name),
    with the engine's `MultiModalConfig` (`multimodal`; None: the defaults)."""
    from jaxserve.entrypoints.openai.serving_base import ServingLimits
    from jaxserve.multimodal.config import MultiModalConfig

    return ServingLimits(multimodal=multimodal or MultiModalConfig(),
                         max_prompts_per_request=args.max_prompts_per_request,
                         tool_call_parser=None if args.tool_call_parser == "none"
                         else args.tool_call_parser,
                         reasoning_parser=args.reasoning_parser,
                         max_tokenize_tokens=args.max_tokenize_tokens,
                         max_stop_strings=args.max_stop_strings,
                         enable_prompt_tokens_details=args.enable_prompt_tokens_details,
                         return_tokens_as_token_ids=args.return_tokens_as_token_ids)


def run(args) -> int:
    kwargs = engine_kwargs(args)
    check_engine_args(kwargs)
    for name in ("max_request_body_bytes", "max_prompts_per_request", "port",
                 "max_tokenize_tokens", "max_stop_strings", "heavy_request_bytes",
                 "heavy_prepare_workers", "heavy_prepare_queue"):
        value, least = getattr(args, name), 0 if name == "heavy_prepare_queue" else 1
        if value is not None and value < least:
            raise ValueError(f"--{name.replace('_', '-')} must be at least {least}, got "
                             f"{value}")
    if not 0 < args.heavy_prepare_share <= 1:
        raise ValueError(f"--heavy-prepare-share must be in (0, 1], got "
                         f"{args.heavy_prepare_share}")
    names = served_names(args, kwargs)
    models = serving_models(args, names)
    if args.allow_runtime_lora_updating and not kwargs.get("enable_lora"):
        raise ValueError("--allow-runtime-lora-updating needs --enable-lora")
    quiet_start(verbose=True)
    from jaxserve.engine.async_llm import AsyncLLM
    from jaxserve.engine.llm import LLM
    from jaxserve.entrypoints.openai.admission import PrepareLimits
    from jaxserve.entrypoints.openai.api_server import (
        build_app,
        make_server,
        start_in_background,
    )
    from jaxserve.entrypoints.openai.dev_routes import dev_mode_from_env
    from jaxserve.entrypoints.openai.serving_models import (
        load_static_loras,
        runtime_lora_updating_from_env,
    )
    from jaxserve.metrics import ServerMetrics

    init_distributed(args)
    print_backend()
    if getattr(args, "coordinator_address", None) and args.process_id != 0:
        return _follow(kwargs)
    from jaxserve.config import EngineConfig

    limits = serving_limits(args, EngineConfig.from_kwargs(**kwargs).multimodal)
    lanes = PrepareLimits(heavy_body_bytes=args.heavy_request_bytes,
                          heavy_workers=args.heavy_prepare_workers,
                          heavy_queue=args.heavy_prepare_queue,
                          heavy_share=args.heavy_prepare_share)
    app = build_app(None, names, api_key=args.api_key, limits=limits,
                    max_body_bytes=args.max_request_body_bytes, prepare_limits=lanes,
                    disable_docs=args.disable_fastapi_docs,
                    enable_server_load_tracking=args.enable_server_load_tracking,
                    enable_tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint,
                    models=models,
                    allow_runtime_lora_updating=args.allow_runtime_lora_updating
                    or runtime_lora_updating_from_env(),
                    server_dev_mode=args.server_dev_mode or dev_mode_from_env())
    server = make_server(app, args.host, args.port, args.shutdown_timeout,
                         args.uvicorn_log_level)

    multihost = bool(getattr(args, "coordinator_address", None))
    channels = []  # process 0 of several: the channel to the others, once the engine exists

    def build(startup):
        # NOTE: the server listens while the model loads and warms up: /health answers
        # 503 with the progress, /v1/* a 503 error, until the engine is attached.
        warmup = kwargs.pop("warmup", True)
        engine = LLM(**kwargs, warmup=False).engine
        if multihost:
            from jaxserve.parallel.step_channel import lead

            channels.append(lead(engine))
        startup.engine = engine
        if models.lora_requests:
            startup.phase = "loading LoRA adapters"
            load_static_loras(engine, models)  # a bad adapter fails start-up, named
        if warmup:
            startup.phase = "warm-up"
            engine.warmup()
        return AsyncLLM(engine, ServerMetrics(names[0], args.metric_name_prefix),
                        args.log_interval)

    def failed(_):
        server.should_exit = True

    starting = start_in_background(app, build, on_error=failed)
    logging.getLogger("jaxserve").info("jaxserve: serving %s on http://%s:%d (starting)",
                                       names[0], args.host, args.port)
    try:
        server.run()
    finally:
        if multihost:
            # NOTE: the followers wait in the channel's collective until told to stop:
            # after the start-up (load, warm-up) and the engine thread sent their last
            # call. A start-up that failed sends nothing (the followers failed alike, or
            # the runtime stops them when this process exits).
            starting.join()
        if app.state.llm is not None:
            app.state.llm.shutdown()
        if channels and not (app.state.llm is not None and app.state.llm.thread_alive):
            channels[0].close()
    return 1 if app.state.startup.error else 0


def _follow(kwargs) -> int:
    """Processes 1..N-1 of a multi-host server: no HTTP, the same engine, replaying the
    device calls process 0 sends (`jaxserve.parallel.step_channel`)."""
    from jaxserve.engine.llm import LLM
    from jaxserve.parallel.step_channel import follow

    kwargs.pop("warmup", None)
    follow(LLM(**kwargs, warmup=False).engine)
    return 0
