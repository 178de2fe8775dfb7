"""LoRA adapters over HTTP (the official `openai` client) and in run-batch, on the tiny model: a
request's `model` picks an adapter and gets the PEFT-merged model's greedy tokens
(transformers), `/v1/models` lists adapters with their parent, vLLM's runtime load/unload
endpoints and their errors, an unload while a request streams, and `--lora-modules`."""

from __future__ import annotations

import concurrent.futures
import json

import httpx
import numpy as np
import openai
import pytest

from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.entrypoints import cli
from jaxserve.entrypoints.openai.api_server import build_app
from jaxserve.entrypoints.openai.serving_models import (
    LoRAModulePath,
    OpenAIServingModels,
    load_static_loras,
    parse_lora_module,
    runtime_lora_updating_from_env,
)
from jaxserve.entrypoints.run_batch import run_batch_file
from jaxserve.metrics import ServerMetrics
from tests.conftest import TINY_ENGINE
from tests.entrypoints.conftest import running_server
from tests.lora.adapters import ADAPTER_CONFIGS, hf_greedy, load_hf, make_adapters

BASE = "tiny-llama"  # the served name `jaxserve` gives the tiny model's directory
LORA_ENGINE = dict(TINY_ENGINE, enable_lora=True, max_loras=2, max_lora_rank=8)
USED = ("qv8", "mlp4")
PROMPT = "The capital of France is"
GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def lora_setup(tiny_model_dir, tmp_path_factory):
    """The base (transformers) and two adapters written as PEFT directories, with their
    merged models (the oracle)."""
    base = load_hf(tiny_model_dir)
    root = str(tmp_path_factory.mktemp("adapters"))
    adapters = make_adapters(base, root, {k: ADAPTER_CONFIGS[k] for k in USED})
    return base, adapters


@pytest.fixture(scope="module")
def served(tiny_model_dir, lora_setup):
    """One tiny-model engine with both adapters from the start (`--lora-modules`), served with
    runtime updating on: yields (url, AsyncLLM, OpenAIServingModels)."""
    from jaxserve.engine.llm import LLM

    _, adapters = lora_setup
    models = OpenAIServingModels([BASE], [LoRAModulePath(a.name, a.path) for a in
                                          adapters.values()])
    engine = LLM(tiny_model_dir, warmup=False, **LORA_ENGINE).engine
    load_static_loras(engine, models)
    llm = AsyncLLM(engine, ServerMetrics(BASE), log_interval=0)
    app = build_app(llm, [BASE], models=models, allow_runtime_lora_updating=True)
    with running_server(app) as (_, url):
        yield url, llm, models


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served[0]}/v1", api_key="unused", max_retries=0,
                         timeout=300)


def oracle_text(model, tokenizer, prompt: str, max_tokens: int) -> str:
    return tokenizer.decode(hf_greedy(model, tokenizer, prompt, max_tokens),
                            skip_special_tokens=True)


def oracle_ids(model, ids: list[int], max_tokens: int) -> list[int]:
    """transformers' greedy continuation of token ids (exactly `max_tokens`)."""
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens,
                             min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
    return np.asarray(out[0, len(ids):]).tolist()


def post(url: str, path: str, body) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=120)


def test_each_adapter_by_name_gives_its_merged_models_tokens(client, lora_setup,
                                                             smollm2_tokenizer):
    base, adapters = lora_setup
    oracles = {BASE: base, **{name: a.merged for name, a in adapters.items()}}
    want = {name: oracle_text(m, smollm2_tokenizer, PROMPT, 8) for name, m in oracles.items()}
    assert len(set(want.values())) == 3  # each adapter changes the greedy tokens

    def one(name):  # all three at once: base and adapters share steps
        return client.completions.create(model=name, prompt=PROMPT, max_tokens=8, **GREEDY)

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        replies = dict(zip(want, pool.map(one, want), strict=True))
    for name, r in replies.items():
        assert r.model == name
        assert r.choices[0].text == want[name], name


def test_chat_reaches_an_adapter(client, served, lora_setup, smollm2_tokenizer):
    _, adapters = lora_setup
    messages = [{"role": "user", "content": "Name a colour."}]
    ids = post(served[0], "/tokenize", {"model": "mlp4", "messages": messages}).json()["tokens"]
    want = smollm2_tokenizer.decode(oracle_ids(adapters["mlp4"].merged, ids, 6),
                                    skip_special_tokens=True)
    r = client.chat.completions.create(model="mlp4", messages=messages, max_tokens=6, **GREEDY)
    assert r.model == "mlp4" and r.choices[0].message.content == want


def test_beam_search_runs_with_the_adapter(client, lora_setup, smollm2_tokenizer):
    base, adapters = lora_setup
    want = oracle_text(adapters["qv8"].merged, smollm2_tokenizer, PROMPT, 4)
    assert want != oracle_text(base, smollm2_tokenizer, PROMPT, 4)
    r = client.completions.create(model="qv8", prompt=PROMPT, max_tokens=4, n=1,
                                  extra_body={"use_beam_search": True, "ignore_eos": True})
    assert r.choices[0].text == want  # width 1: the greedy tokens


def test_models_lists_adapters_with_their_parent(client, lora_setup):
    _, adapters = lora_setup
    cards = {m.id: m for m in client.models.list().data}
    assert list(cards)[:3] == [BASE, *USED]
    assert cards[BASE].parent is None
    for name in USED:
        assert cards[name].parent == BASE and cards[name].root == adapters[name].path


def test_unknown_model_is_a_404_naming_it(client):
    with pytest.raises(openai.NotFoundError, match="The model `no-such-adapter` does not exist"):
        client.completions.create(model="no-such-adapter", prompt=PROMPT, max_tokens=2)
    with pytest.raises(openai.NotFoundError, match="no-such-adapter"):
        client.chat.completions.create(model="no-such-adapter", max_tokens=2,
                                       messages=[{"role": "user", "content": "Hi"}])


def test_load_use_and_unload_at_runtime(client, served, lora_setup, smollm2_tokenizer):
    url, _, models = served
    _, adapters = lora_setup
    qv8 = adapters["qv8"]
    r = post(url, "/v1/load_lora_adapter", {"lora_name": "qv8-rt", "lora_path": qv8.path})
    assert r.status_code == 200 and "qv8-rt" in r.text
    assert "qv8-rt" in [m.id for m in client.models.list().data]
    out = client.completions.create(model="qv8-rt", prompt=PROMPT, max_tokens=8, **GREEDY)
    assert out.choices[0].text == oracle_text(qv8.merged, smollm2_tokenizer, PROMPT, 8)
    assert models.lora_requests["qv8-rt"].lora_int_id not in (1, 2)  # never reused

    again = post(url, "/v1/load_lora_adapter", {"lora_name": "qv8-rt", "lora_path": qv8.path})
    assert again.status_code == 400 and "qv8-rt" in again.json()["error"]["message"]
    r = post(url, "/v1/unload_lora_adapter", {"lora_name": "qv8-rt"})
    assert r.status_code == 200 and "qv8-rt" in r.text
    with pytest.raises(openai.NotFoundError, match="qv8-rt"):
        client.completions.create(model="qv8-rt", prompt=PROMPT, max_tokens=2)
    assert "qv8-rt" not in [m.id for m in client.models.list().data]

    # vLLM's other unload field: the adapter's id.
    post(url, "/v1/load_lora_adapter", {"lora_name": "by-id", "lora_path": qv8.path})
    lora_id = models.lora_requests["by-id"].lora_int_id
    assert post(url, "/v1/unload_lora_adapter", {"lora_int_id": lora_id}).status_code == 200
    assert "by-id" not in models.lora_requests


def test_runtime_lora_errors_name_the_adapter(served, tmp_path):
    url = served[0]
    (tmp_path / "adapter_config.json").write_text("{}")
    bad = post(url, "/v1/load_lora_adapter", {"lora_name": "broken", "lora_path": str(tmp_path)})
    assert bad.status_code == 400
    assert bad.json()["error"]["message"].startswith("LoRA adapter 'broken': ")
    missing = post(url, "/v1/load_lora_adapter", {"lora_name": "nothing",
                                                  "lora_path": str(tmp_path / "absent")})
    assert missing.status_code == 404  # vLLM's NotFoundError, with its message
    assert missing.json()["error"]["message"] == (f"Loading lora nothing failed: No adapter "
                                                  f"found for {tmp_path / 'absent'}")
    no_path = post(url, "/v1/load_lora_adapter", {"lora_name": "x"})
    assert no_path.status_code == 400 and no_path.json()["error"]["param"] == "lora_path"
    base = post(url, "/v1/load_lora_adapter", {"lora_name": BASE, "lora_path": str(tmp_path)})
    assert base.status_code == 400 and BASE in base.json()["error"]["message"]
    gone = post(url, "/v1/unload_lora_adapter", {"lora_name": "never-loaded"})
    assert gone.status_code == 404 and "never-loaded" in gone.json()["error"]["message"]
    neither = post(url, "/v1/unload_lora_adapter", {})
    assert neither.status_code == 400
    mismatch = post(url, "/v1/unload_lora_adapter", {"lora_name": "qv8", "lora_int_id": 999})
    assert mismatch.status_code == 404
    assert mismatch.json()["error"]["message"] == ("The lora adapter 'qv8' with id 999 "
                                                   "cannot be found.")
    assert "broken" not in [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]]


# vLLM's own test cases for refused adapter configs (tests/entrypoints/openai/
# test_lora_adapters.py, BADREQUEST_CASES): the change to a good adapter's config and the
# words its BadRequestError must hold.
BAD_CONFIGS = [({"r": 1024}, "is greater than max_lora_rank"),
               ({"bias": "all"}, "Adapter bias cannot be used without bias_enabled"),
               ({"use_dora": True}, "does not yet support DoRA"),
               ({"modules_to_save": ["lm_head"]}, "only supports modules_to_save being None")]


def test_load_errors_are_vllms_for_the_official_client(client, lora_setup, tmp_path,
                                                       smollm2_tokenizer):
    """A path with no adapter is the client's `NotFoundError` (a 404, which clients suppress
    as vLLM's tests do), refused configs its `BadRequestError`; the engine goes on serving
    the adapters it has (a refused adapter never reaches a request, so it holds no page:
    `tests/lora/test_lora_errors.py` checks the pool after such refusals)."""
    import shutil

    _, adapters = lora_setup
    with pytest.raises(openai.NotFoundError, match="No adapter found for /not/an/adapter"):
        client.post("load_lora_adapter", cast_to=str,
                    body={"lora_name": "notfound", "lora_path": "/not/an/adapter"})
    empty = tmp_path / "empty"
    empty.mkdir()  # a directory without adapter_config.json: also not found, as in vLLM
    with pytest.raises(openai.NotFoundError, match="No adapter found"):
        client.post("load_lora_adapter", cast_to=str,
                    body={"lora_name": "empty", "lora_path": str(empty)})
    for i, (change, words) in enumerate(BAD_CONFIGS):
        bad = tmp_path / f"bad{i}"
        shutil.copytree(adapters["qv8"].path, bad)
        config = json.loads((bad / "adapter_config.json").read_text())
        (bad / "adapter_config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(openai.BadRequestError, match=words):
            client.post("load_lora_adapter", cast_to=str,
                        body={"lora_name": f"bad{i}", "lora_path": str(bad)})
    names = [m.id for m in client.models.list().data]
    assert not {"notfound", "empty", "bad0", "bad1", "bad2", "bad3"} & set(names)
    qv8 = adapters["qv8"]
    got = client.completions.create(model="qv8", prompt=PROMPT, max_tokens=8, **GREEDY)
    assert got.choices[0].text == oracle_text(qv8.merged, smollm2_tokenizer, PROMPT, 8)


def test_runtime_endpoints_absent_without_the_flag(served):
    _, llm, models = served
    app = build_app(llm, [BASE], models=models, shutdown_engine=False)
    with running_server(app) as (_, url):
        for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            r = post(url, path, {"lora_name": "qv8", "lora_path": "/tmp"})
            assert r.status_code == 404 and r.json()["error"]["code"] == 404
        assert post(url, "/v1/completions", {"model": "qv8", "prompt": PROMPT,
                                             "max_tokens": 1, "temperature": 0}
                    ).status_code == 200


def test_unload_while_streaming_finishes_with_the_adapter(client, served, lora_setup,
                                                          smollm2_tokenizer):
    url, llm, _ = served
    _, adapters = lora_setup
    mlp4 = adapters["mlp4"]
    assert post(url, "/v1/load_lora_adapter", {"lora_name": "mlp4-rt",
                                               "lora_path": mlp4.path}).status_code == 200
    manager = llm.engine.runner.lora.manager
    stream = client.completions.create(model="mlp4-rt", prompt=PROMPT, max_tokens=96,
                                       stream=True, **GREEDY)
    chunks = [next(stream)]
    loads = manager.num_loads
    assert post(url, "/v1/unload_lora_adapter", {"lora_name": "mlp4-rt"}).status_code == 200
    chunks += list(stream)
    text = "".join(c.choices[0].text for c in chunks)
    assert text == oracle_text(mlp4.merged, smollm2_tokenizer, PROMPT, 96)
    assert chunks[-1].choices[0].finish_reason == "length"
    # The request outlived the unload: it read the adapter again from its path.
    assert manager.num_loads > loads
    with pytest.raises(openai.NotFoundError, match="mlp4-rt"):
        client.completions.create(model="mlp4-rt", prompt=PROMPT, max_tokens=2)


def test_run_batch_lines_pick_adapters(served, lora_setup, smollm2_tokenizer, tmp_path):
    _, llm, models = served
    base, adapters = lora_setup

    def line(cid, model):
        return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/completions",
                           "body": {"model": model, "prompt": PROMPT, "max_tokens": 6,
                                    "temperature": 0, "ignore_eos": True}})

    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join([line("b", BASE), line("a", "qv8"), line("u", "nope")]) + "\n")
    counts = run_batch_file(llm, [BASE], str(src), str(dst), use_tqdm=False, models=models)
    assert counts["succeeded"] == 2 and counts["failed"] == 1
    records = {r["custom_id"]: r["response"] for r in map(json.loads, dst.read_text().splitlines())}
    for cid, model in (("b", base), ("a", adapters["qv8"].merged)):
        body = records[cid]["body"]
        assert body["choices"][0]["text"] == oracle_text(model, smollm2_tokenizer, PROMPT, 6)
    assert records["a"]["body"]["model"] == "qv8"
    assert records["u"]["status_code"] == 404
    assert "`nope`" in records["u"]["body"]["error"]["message"]


# ------------------------------------------------------------------ the command line
def test_lora_modules_both_forms():
    assert parse_lora_module("sql=/adapters/sql") == LoRAModulePath("sql", "/adapters/sql")
    entry = '{"name": "sql", "path": "/a/sql", "base_model_name": "b"}'
    assert parse_lora_module(entry) == LoRAModulePath("sql", "/a/sql", "b")
    args = cli.build_parser().parse_args(["serve", "--enable-lora", "--max-loras", "3",
                                          "--lora-modules", "a=/x", entry])
    assert args.lora_modules == ["a=/x", entry] and args.max_loras == 3
    assert cli.engine_kwargs(args)["enable_lora"] is True


@pytest.mark.parametrize("entry, message", [
    ("just-a-name", "neither name=path nor a JSON object"),
    ("=/path", "non-empty name and path"),
    ('{"name": "x"', "not valid JSON"),
    ('{"name": "x", "path": "/p", "rank": 8}', "unknown key(s) rank"),
    ('{"name": "x", "path": 3}', "string values"),
])
def test_bad_lora_module_is_a_clear_error(entry, message):
    with pytest.raises(ValueError, match="--lora-modules: ") as e:
        parse_lora_module(entry)
    assert message in str(e.value)


def test_cli_refuses_bad_lora_flags_before_loading(tmp_path, capsys):
    adapter = str(tmp_path)
    cases = [
        (["--enable-lora", "--lora-modules", "x"], "'x' is neither name=path"),
        (["--lora-modules", f"a={adapter}"], "--lora-modules needs --enable-lora"),
        (["--enable-lora", "--lora-modules", f"a={tmp_path / 'absent'}"],
         "adapter 'a': "),
        (["--enable-lora", "--lora-modules", f"a={adapter}", f"a={adapter}"],
         "'a' has already been loaded"),
        (["--allow-runtime-lora-updating"], "needs --enable-lora"),
    ]
    for flags, message in cases:
        assert cli.main(["serve", *flags]) == 2, flags
        assert message in capsys.readouterr().err, flags


def test_run_batch_on_ray_refuses_lora_modules(tmp_path, capsys):
    (tmp_path / "in.jsonl").write_text("\n")
    code = cli.main(["run-batch", "-i", str(tmp_path / "in.jsonl"), "-o",
                     str(tmp_path / "out.jsonl"), "--ray", "local", "--enable-lora",
                     "--lora-modules", f"a={tmp_path}"])
    assert code == 2 and "--lora-modules is not supported with --ray" in capsys.readouterr().err


def test_runtime_updating_env_var():
    assert runtime_lora_updating_from_env({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
    assert runtime_lora_updating_from_env({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"})
    assert not runtime_lora_updating_from_env({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "0"})
    assert not runtime_lora_updating_from_env({})


def test_run_batch_cli_fails_start_up_naming_a_bad_adapter(tiny_model_dir, tmp_path, capsys):
    (tmp_path / "in.jsonl").write_text("\n")
    (tmp_path / "bad").mkdir()
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in LORA_ENGINE.items()
             if k != "enable_lora"]
    code = cli.main(["run-batch", "-i", str(tmp_path / "in.jsonl"), "-o",
                     str(tmp_path / "out.jsonl"), "--model", tiny_model_dir, "--no-warmup",
                     "--no-progress", *flags, "--enable-lora", "--lora-modules",
                     f"broken={tmp_path / 'bad'}"])
    assert code == 2
    assert "adapter 'broken'" in capsys.readouterr().err
