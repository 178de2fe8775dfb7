"""`jaxserve diagnose`: which scheduling mechanism limits a serving configuration."""

from __future__ import annotations

import json

from jaxserve.entrypoints.cli.args import add_engine_args, check_engine_args, engine_kwargs


def _read(path: str, what: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"cannot read the {what} file {path}: {e.strerror}") from None


def _json(path: str, what: str):
    try:
        return json.loads(_read(path, what))
    except json.JSONDecodeError as e:
        raise ValueError(f"the {what} file {path} is not valid JSON: {e}") from None


def run(args) -> int:
    from jaxserve.bench.diagnose import diagnose, format_diagnosis, load_observations

    config = {}
    if args.config:
        config = _json(args.config, "--config")
        if not isinstance(config, dict):
            raise ValueError(f"the --config file {args.config} must hold a JSON object")
        config = config.get("engine_args", config)
    given = {k: v for k, v in engine_kwargs(args).items() if k != "model"}
    check_engine_args({k: v for k, v in {**config, **given}.items()
                       if k not in ("model", "attention_backend")})
    config.update(given)
    metrics = _read(args.metrics, "--metrics") if args.metrics else None
    result = _json(args.result, "--result") if args.result else None
    try:
        obs = load_observations(metrics, result, config.get("scheduling_mode"))
    except ValueError as e:
        raise ValueError(f"cannot read the observations: {e}") from None
    d = diagnose(config, obs, mean_prompt_len=args.mean_prompt_len,
                 mean_output_len=args.mean_output_len)
    print(json.dumps(d, indent=1) if args.json else format_diagnosis(d))
    return 0


def add_parser(sub) -> None:
    dg = sub.add_parser("diagnose", help="which scheduling mechanism limits a serving config",
                        description="Names the mechanism (KV pages, token budget and batch "
                                    "size, chunk size) that limits a serving configuration, "
                                    "from the config alone or with observed metrics.")
    dg.add_argument("--config", default=None,
                    help="engine args as JSON (a bench --output-json file works too)")
    dg.add_argument("--metrics", default=None,
                    help="metrics snapshot: get_metrics() JSON or a Prometheus /metrics dump")
    dg.add_argument("--result", default=None, help="a benchmark or simulator result JSON")
    dg.add_argument("--mean-prompt-len", type=float, default=None,
                    help="the workload's mean prompt tokens (default: from --result, else 512)")
    dg.add_argument("--mean-output-len", type=float, default=None,
                    help="the workload's mean output tokens (default: from --result, else 128)")
    dg.add_argument("--json", action="store_true", help="print the diagnosis as JSON")
    add_engine_args(dg, positional_model=False)
    dg.set_defaults(handler=run)
