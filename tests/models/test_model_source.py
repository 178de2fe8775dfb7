"""Models by name: a Hugging Face hub id through a hub cache the test lays out (offline, as
`snapshot_download` reads it), an fsspec URL through fsspec's memory filesystem standing in
for a bucket, and the errors that name what was tried."""

from __future__ import annotations

import importlib.util
import os
import uuid
from types import SimpleNamespace

import fsspec
import pytest

from jaxserve.config import EngineConfig
from jaxserve.entrypoints.cli import build_parser
from jaxserve.entrypoints.cli.args import check_engine_args, engine_kwargs
from jaxserve.entrypoints.openai.serving_base import default_model_name
from jaxserve.runner.worker import Worker
from models.loaders import resolve_model
from models.loaders.model_source import check_model_name, local_model_path

MAIN, V2 = "a" * 40, "b" * 40  # commits of the laid-out repository
SIZES = dict(max_num_seqs=16, max_num_batched_tokens=64, max_model_len=256, num_kv_blocks=65,
             attention_backend="xla", warmup=False)


def lay_out_hub_cache(cache, repo_id: str, source: str, refs: dict[str, str]) -> dict:
    """A hub cache as huggingface_hub writes it: models--org--name/snapshots/<commit>/ (files
    linked to `source`'s) and refs/<name> holding a commit; {commit: snapshot dir}."""
    repo = os.path.join(cache, "models--" + repo_id.replace("/", "--"))
    snapshots = {}
    for ref, commit in refs.items():
        snap = os.path.join(repo, "snapshots", commit)
        if commit not in snapshots:
            os.makedirs(snap)
            for name in os.listdir(source):
                os.symlink(os.path.join(source, name), os.path.join(snap, name))
            snapshots[commit] = snap
        os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
        with open(os.path.join(repo, "refs", ref), "w") as f:
            f.write(commit)
    return snapshots


@pytest.fixture(scope="module")
def hub(tiny_model_dir, tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("hub"))
    snaps = lay_out_hub_cache(cache, "org/tiny", tiny_model_dir, {"main": MAIN, "v2": V2})
    return SimpleNamespace(cache=cache, main=snaps[MAIN], v2=snaps[V2])


@pytest.fixture
def offline(hub, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", hub.cache)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return hub


@pytest.fixture
def bucket(tiny_model_dir):
    """The tiny model at memory://<bucket>/tiny (removed after the test)."""
    fs = fsspec.filesystem("memory")
    name = f"bucket-{uuid.uuid4().hex[:8]}"
    for f in os.listdir(tiny_model_dir):
        fs.put_file(os.path.join(tiny_model_dir, f), f"/{name}/tiny/{f}")
    yield SimpleNamespace(fs=fs, url=f"memory://{name}/tiny", root=f"/{name}")
    fs.rm(f"/{name}", recursive=True)


# ------------------------------------------------------------------------------ the hub


def test_a_hub_id_resolves_from_the_cache_offline(offline):
    assert local_model_path("org/tiny") == offline.main
    assert local_model_path("org/tiny", revision="v2") == offline.v2
    assert local_model_path("org/tiny", revision=V2) == offline.v2  # a commit
    assert resolve_model("org/tiny") == ("hf", offline.main)


def test_online_the_hub_is_asked_for_the_model_files_with_the_token(monkeypatch, tmp_path):
    import huggingface_hub

    calls = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download",
                        lambda repo_id, **kw: calls.append((repo_id, kw)) or str(tmp_path))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    assert local_model_path("Qwen/Qwen3-0.6B", "v1", "/d") == str(tmp_path)
    (repo_id, kw), = calls
    assert repo_id == "Qwen/Qwen3-0.6B" and kw["revision"] == "v1" and kw["cache_dir"] == "/d"
    assert kw["token"] == "hf_secret" and kw["local_files_only"] is False
    assert {"*.json", "*.safetensors"} <= set(kw["allow_patterns"])
    assert "consolidated*.safetensors" in kw["ignore_patterns"]


def test_download_dir_is_the_hub_cache(hub, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert local_model_path("org/tiny", download_dir=hub.cache) == hub.main


def test_the_engine_loads_a_hub_id_at_its_revisions(offline):
    w = Worker(EngineConfig.from_kwargs(model="org/tiny", revision="v2",
                                        tokenizer_revision=MAIN, **SIZES))
    assert w.config.model.model == offline.v2 and w.model.source == offline.v2
    assert w.model.cfg.hidden_size == 72
    assert w.tokenizer.name_or_path == offline.main  # tokenizer_revision
    assert w.tokenizer.decode(w.tokenizer.encode("Hello there")) == "Hello there"


def test_the_data_parallel_engine_fetches_once_for_its_replicas(offline):
    from jaxserve.engine.data_parallel import DataParallelEngine

    dp = DataParallelEngine(EngineConfig.from_kwargs(
        model="org/tiny", revision="v2", tokenizer_revision=MAIN, data_parallel_size=2,
        **SIZES))
    assert dp.config.model.model == offline.v2
    assert all(r.model.source == offline.v2 for r in dp.replicas)
    assert dp.tokenizer.name_or_path == offline.main


@pytest.mark.parametrize("name, revision, message", [
    ("org/missing", None, "model 'org/missing': no local file or directory of that name, and "
                          "the Hugging Face hub cache ({cache}; HF_HUB_OFFLINE is set) could "
                          "not provide it: "),
    ("org/tiny", "nope", "could not provide it at revision 'nope': "),
])
def test_an_id_the_cache_lacks_is_named_with_the_reason(offline, name, revision, message):
    with pytest.raises(ValueError) as e:
        local_model_path(name, revision=revision)
    assert message.format(cache=offline.cache) in str(e.value)
    assert "Error" in str(e.value).rpartition("provide it")[2]  # the hub's own reason


@pytest.mark.parametrize("name", ["./no/such/model", "/no/such/model", "no-such.gguf",
                                  "a/b/c"])
def test_a_name_that_is_no_path_id_or_url_is_refused_without_the_hub(name):
    message = (f"model path {name} does not exist (and it is neither a Hugging Face hub id "
               "such as Qwen/Qwen3-0.6B nor a URL such as gs://bucket/model)")
    with pytest.raises(ValueError) as e:
        local_model_path(name)
    assert str(e.value) == message
    with pytest.raises(ValueError, match="neither a Hugging Face hub id"):
        check_engine_args({"model": name})


# ------------------------------------------------------------------------- fsspec URLs


def test_a_url_is_copied_once_and_again_when_it_changes(bucket, tmp_path, tiny_model_dir,
                                                        monkeypatch):
    local = local_model_path(bucket.url, download_dir=str(tmp_path))
    assert local.startswith(str(tmp_path)) and os.path.basename(local).startswith("tiny-")
    assert sorted(f for f in os.listdir(local) if not f.startswith(".")) == \
        sorted(os.listdir(tiny_model_dir))
    with open(os.path.join(local, "config.json"), "rb") as f, \
            open(os.path.join(tiny_model_dir, "config.json"), "rb") as g:
        assert f.read() == g.read()
    copy = bucket.fs.get_file
    monkeypatch.setattr(type(bucket.fs), "get_file", lambda *a, **k: pytest.fail("copied"))
    assert local_model_path(bucket.url, download_dir=str(tmp_path)) == local  # cached
    monkeypatch.setattr(type(bucket.fs), "get_file", copy)
    bucket.fs.pipe_file(f"{bucket.root}/tiny/extra.json", b"{}")  # the bucket changed
    assert local_model_path(bucket.url, download_dir=str(tmp_path)) == local
    assert os.path.exists(os.path.join(local, "extra.json"))


def test_a_url_of_one_file(bucket, tmp_path):
    bucket.fs.pipe_file(f"{bucket.root}/m/model.gguf", b"GGUF...")
    local = local_model_path(f"memory:/{bucket.root}/m/model.gguf", download_dir=str(tmp_path))
    assert os.path.basename(local) == "model.gguf"
    with open(local, "rb") as f:
        assert f.read() == b"GGUF..."


def test_the_engine_loads_from_a_url(bucket, tmp_path):
    w = Worker(EngineConfig.from_kwargs(model=bucket.url, download_dir=str(tmp_path), **SIZES))
    assert w.model.source.startswith(str(tmp_path)) and w.model.cfg.num_layers == 2


@pytest.mark.parametrize("url, message", [
    ("memory://no-such-bucket/model", "model 'memory://no-such-bucket/model': nothing at "
                                      "this URL"),
    ("nosuch://bucket/model", "model 'nosuch://bucket/model': fsspec cannot open this URL "
                              "(Protocol not known: nosuch)"),
])
def test_bad_urls_are_named(url, message, tmp_path):
    with pytest.raises(ValueError) as e:
        local_model_path(url, download_dir=str(tmp_path))
    assert str(e.value) == message


@pytest.mark.skipif(importlib.util.find_spec("gcsfs") is not None,
                    reason="gcsfs is installed: gs:// opens")
def test_a_failed_copy_is_named_and_leaves_nothing_behind(bucket, tmp_path, monkeypatch):
    def broken(self, rpath, lpath, **kw):
        raise PermissionError(f"403 on {rpath}")

    monkeypatch.setattr(type(bucket.fs), "get_file", broken)
    with pytest.raises(ValueError, match=r"model 'memory://bucket-\w+/tiny': copying it to "
                                         r".*/tiny-\w+ failed \(PermissionError: 403 on"):
        local_model_path(bucket.url, download_dir=str(tmp_path))
    assert os.listdir(tmp_path) == []  # no partial copy, no marker

    def denied(self, path, **kw):
        raise PermissionError("401: no credentials")

    monkeypatch.setattr(type(bucket.fs), "info", denied)
    with pytest.raises(ValueError, match=r"tiny': cannot list it \(PermissionError: 401: no "
                                         r"credentials\)"):
        local_model_path(bucket.url, download_dir=str(tmp_path))


def test_a_bucket_without_its_filesystem_names_the_package(tmp_path):
    with pytest.raises(ValueError, match="fsspec cannot open this URL .*gcsfs"):
        local_model_path("gs://bucket/model", download_dir=str(tmp_path))


# --------------------------------------------------------------------------- the CLI


def test_the_cli_takes_a_hub_id_revision_and_download_dir(tmp_path):
    args = build_parser().parse_args(["serve", "Qwen/Qwen3-0.6B", "--revision", "v2",
                                      "--tokenizer-revision", "v1",
                                      "--download-dir", str(tmp_path)])
    kwargs = engine_kwargs(args)
    assert kwargs["model"] == "Qwen/Qwen3-0.6B" and kwargs["revision"] == "v2"
    assert kwargs["tokenizer_revision"] == "v1"
    assert kwargs["download_dir"] == str(tmp_path)
    check_engine_args(kwargs)  # its form is checked, nothing is fetched
    check_model_name("gs://bucket/model")
    config = EngineConfig.from_kwargs(**kwargs)
    assert (config.model.revision, config.model.download_dir) == ("v2", str(tmp_path))


def test_served_names_of_hub_ids_and_urls_are_the_names_given(tiny_model_dir):
    from jaxserve.entrypoints.cli.engine import served_names

    args = build_parser().parse_args(["serve", "Qwen/Qwen3-0.6B"])
    assert served_names(args, engine_kwargs(args)) == ["Qwen/Qwen3-0.6B"]  # as vLLM
    assert default_model_name("Qwen/Qwen3-0.6B") == "Qwen/Qwen3-0.6B"
    assert default_model_name("gs://bucket/models/m") == "gs://bucket/models/m"
    assert default_model_name(tiny_model_dir) == "tiny-llama"  # a local path: its name
