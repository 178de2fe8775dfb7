"""Where a model name points: a local path, a Hugging Face hub id (fetched through
`huggingface_hub`'s cache) or an fsspec URL such as `gs://bucket/path` (copied to a local
cache directory keyed by the URL); every loader then reads a local path.

The hub honours `HF_HUB_OFFLINE` (cache only), `HF_HUB_CACHE` / `HF_HOME` (where the cache
is; `download_dir` overrides it, vLLM's `--download-dir`), `HF_TOKEN` (gated and private
repositories) and a `revision` (branch, tag or commit). Only what loading a Hugging Face
directory reads is downloaded (config, tokenizer, safetensors weights).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile

from models import default_model

logger = logging.getLogger("jaxserve")
# The files a Hugging Face model directory is loaded from (weights, config, tokenizer,
# chat template, generation config, sentence-transformers pooling).
HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken",
                "1_Pooling/*"]
# Files of those patterns the loaders never read: Mistral's single-file copy of the
# weights beside the sharded ones, Meta's original checkpoint.
HUB_IGNORED = ["consolidated*.safetensors", "original/*"]
# What a tokenizer alone is loaded from (`tokenizer_revision`).
TOKENIZER_PATTERNS = ["*.json", "*.jinja", "*.txt", "*.model", "*.tiktoken"]
# Where fsspec URLs are copied to when no `download_dir` is given.
MODEL_CACHE_ENV = "JAXSERVE_MODEL_CACHE"
_DEFAULT_MODEL_CACHE = os.path.join("~", ".cache", "jaxserve", "models")
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_MARKER = ".jaxserve-source.json"


def is_url(name: str) -> bool:
    """Whether `name` is a URL (`scheme://...`), read through fsspec."""
    return bool(_URL.match(name))


def is_hub_id(name: str) -> bool:
    """Whether `name` can be a Hugging Face hub repository id (`name` or `org/name`)."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if name.endswith(".gguf") or name.startswith((".", "~")):
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def check_model_name(model: str | None) -> None:
    """Refuses, without any download, a name that is neither an existing path nor a hub id
    nor a URL (for the CLI's checks before anything loads).

    Raises:
        ValueError: "model path X does not exist", saying what else it could have been.
    """
    if model is None or os.path.exists(model) or is_url(model) or is_hub_id(model):
        return
    raise ValueError(f"model path {model} does not exist (and it is neither a Hugging Face "
                     "hub id such as Qwen/Qwen3-0.6B nor a URL such as gs://bucket/model)")


def local_model_path(model: str | None, revision: str | None = None,
                     download_dir: str | None = None) -> str:
    """The local file or directory `model` names, fetched first when it is remote.

    Args:
        model: None (the embedded default model), a local path, a hub id, or an fsspec URL.
        revision: The hub revision (branch, tag or commit; default: main).
        download_dir: The hub cache directory, or where URLs are copied (default: the
            hub's cache; `$JAXSERVE_MODEL_CACHE` or ~/.cache/jaxserve/models for URLs).

    Raises:
        ValueError: Nothing of that name: the message names what was tried (the local
            path, the hub or the URL) and why each failed.
    """
    if model is None:
        return default_model.default_model_path()
    if os.path.exists(model):
        return model
    if is_url(model):
        return fetch_url(model, download_dir)
    check_model_name(model)
    return fetch_hub(model, revision, download_dir)


def local_tokenizer_path(model: str | None, tokenizer_revision: str | None,
                         download_dir: str | None = None) -> str | None:
    """The tokenizer files of hub id `model` at `tokenizer_revision` (vLLM's argument:
    the tokenizer from another revision than the weights), fetched alone; None when no
    such revision is given or `model` is not a hub id (a local path or URL has one
    tokenizer, beside its weights).

    Raises:
        ValueError: As `fetch_hub`.
    """
    if (tokenizer_revision is None or model is None or os.path.exists(model)
            or is_url(model) or not is_hub_id(model)):
        return None
    return fetch_hub(model, tokenizer_revision, download_dir, TOKENIZER_PATTERNS)


def fetch_hub(repo_id: str, revision: str | None = None, download_dir: str | None = None,
              patterns: list[str] | None = None) -> str:
    """The local snapshot directory of a hub repository (`snapshot_download` of `patterns`,
    default `HUB_PATTERNS`: files already in the cache are not downloaded again; offline,
    only the cache is read).

    Raises:
        ValueError: The hub (or, offline, the cache) has no such repository or revision, or
            could not be reached; the message names the id, the cache and the reason.
    """
    from huggingface_hub import constants, snapshot_download

    # NOTE: read at each call (huggingface_hub reads them once, at import).
    offline = constants.HF_HUB_OFFLINE or _env_flag("HF_HUB_OFFLINE")
    cache_dir = download_dir or os.environ.get("HF_HUB_CACHE") or None
    try:
        path = snapshot_download(repo_id, revision=revision, cache_dir=cache_dir,
                                 local_files_only=offline, allow_patterns=patterns or HUB_PATTERNS,
                                 ignore_patterns=HUB_IGNORED,
                                 token=os.environ.get("HF_TOKEN") or None)
    except Exception as e:  # noqa: BLE001 - every failure becomes the one clear error
        where = (f"the Hugging Face hub cache ({cache_dir or constants.HF_HUB_CACHE}; "
                 "HF_HUB_OFFLINE is set)" if offline else
                 f"the Hugging Face hub (cache {cache_dir or constants.HF_HUB_CACHE})")
        at = f" at revision {revision!r}" if revision else ""
        reason = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ValueError(f"model {repo_id!r}: no local file or directory of that name, and "
                         f"{where} could not provide it{at}: {type(e).__name__}: "
                         f"{reason}") from None
    logger.info("jaxserve: model %s%s from %s", repo_id,
                f"@{revision}" if revision else "", path)
    return path


def fetch_url(url: str, download_dir: str | None = None) -> str:
    """A local copy of the file or directory at an fsspec URL (`gs://`, `s3://`, `file://`,
    `memory://`, ...), kept in a cache directory keyed by the URL and copied again when
    the listing (names, sizes, versions) changes.

    Raises:
        ValueError: No filesystem for the scheme (its package is named: gcsfs for gs://),
            or nothing at the URL.
    """
    import fsspec

    try:
        fs, root = fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as e:
        raise ValueError(f"model {url!r}: fsspec cannot open this URL ({e})") from None
    root = root.rstrip("/")
    try:
        files = _listing(fs, root)
    except FileNotFoundError:
        raise ValueError(f"model {url!r}: nothing at this URL") from None
    except Exception as e:  # noqa: BLE001 - credentials, network: one clear error
        raise ValueError(f"model {url!r}: cannot list it ({type(e).__name__}: {e})") from None
    cache = os.path.expanduser(download_dir or os.environ.get(MODEL_CACHE_ENV)
                               or _DEFAULT_MODEL_CACHE)
    name = os.path.basename(root) or "model"
    key = hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16]
    dest = os.path.join(cache, f"{name}-{key}")
    manifest = json.dumps({"url": url, "files": files}, sort_keys=True)
    local = os.path.join(dest, name) if "" in files else dest
    if _read(os.path.join(dest, _MARKER)) == manifest:
        return local
    os.makedirs(cache, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{name}-", dir=cache)
    try:
        for rel in files:
            target = os.path.join(tmp, rel or name)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            fs.get_file(f"{root}/{rel}" if rel else root, target)
        with open(os.path.join(tmp, _MARKER), "w") as f:
            f.write(manifest)
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(tmp, dest)
    except Exception as e:  # noqa: BLE001
        # NOTE: another process that copied the same listing first is a success.
        if _read(os.path.join(dest, _MARKER)) != manifest:
            raise ValueError(f"model {url!r}: copying it to {dest} failed "
                             f"({type(e).__name__}: {e})") from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already when the copy landed
    logger.info("jaxserve: model %s copied to %s", url, dest)
    return local


def _listing(fs, root: str) -> dict[str, str]:
    """{path relative to `root` ("" for a single file): "size version"} of the URL's files."""
    def version(info: dict) -> str:
        for k in ("etag", "md5Hash", "ETag", "generation", "mtime", "updated", "created"):
            if info.get(k) is not None:
                return str(info[k])
        return ""

    info = fs.info(root)
    if info["type"] != "directory":
        return {"": f"{info.get('size')} {version(info)}"}
    out = {}
    for path, meta in fs.find(root, detail=True).items():
        rel = path.rstrip("/")[len(root.rstrip("/")):].lstrip("/")
        if rel and meta.get("type") != "directory":
            out[rel] = f"{meta.get('size')} {version(meta)}"
    if not out:
        raise FileNotFoundError(root)
    return out


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")
