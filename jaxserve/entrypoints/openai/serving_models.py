"""The models a server answers for (vLLM's `OpenAIServingModels`): the base model's names, the
LoRA adapters a request's `model` picks by name, `/v1/models`, and runtime adapter loading."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import threading
import uuid

from jaxserve.entrypoints.openai.errors import OpenAIError
from jaxserve.lora import LoRAAdapterNotFoundError, LoRARequest

# vLLM's switch for `/v1/load_lora_adapter` and `/v1/unload_lora_adapter` (read as vLLM does:
# "1" or "true", any case); `jaxserve serve --allow-runtime-lora-updating` is the same.
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_lora_updating_from_env(environ=os.environ) -> bool:
    """Whether `VLLM_ALLOW_RUNTIME_LORA_UPDATING` turns runtime adapter loading on."""
    return environ.get(RUNTIME_LORA_ENV, "0").strip().lower() in ("1", "true")


@dataclasses.dataclass(frozen=True)
class LoRAModulePath:
    """One `--lora-modules` entry (vLLM's `LoRAModulePath`).

    Attributes:
        name: The name requests give as `model`.
        path: The PEFT adapter directory.
        base_model_name: The base model it was trained on (`/v1/models` lists it as the
            adapter's `parent`; None: the served base name).
    """

    name: str
    path: str
    base_model_name: str | None = None


def model_permission(now: int) -> dict:
    """A model card's `permission` entry as vLLM sends it (its `ModelPermission` defaults)."""
    return {"id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission",
            "created": now, "allow_create_engine": False, "allow_sampling": True,
            "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
            "allow_fine_tuning": False, "organization": "*", "group": None,
            "is_blocking": False}


def parse_lora_module(text: str) -> LoRAModulePath:
    """Parses a `--lora-modules` entry: `name=path`, or vLLM's JSON object
    `{"name": ..., "path": ..., "base_model_name": ...}` (`base_model_name` optional).

    Raises:
        ValueError: Neither form, an empty name or path, or JSON with other keys or
            non-string values (the message quotes the entry).
    """
    text = text.strip()
    if text.startswith("{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--lora-modules: {text!r} is not valid JSON ({e})") from None
        if not isinstance(data, dict):
            raise ValueError(f"--lora-modules: {text!r} must be a JSON object")
        unknown = sorted(set(data) - {"name", "path", "base_model_name"})
        if unknown:
            raise ValueError(f"--lora-modules: {text!r} has unknown key(s) "
                             f"{', '.join(unknown)} (known: name, path, base_model_name)")
        name, path, base = data.get("name"), data.get("path"), data.get("base_model_name")
        if not all(isinstance(v, str) for v in (name, path)) or not (
                base is None or isinstance(base, str)):
            raise ValueError(f"--lora-modules: {text!r} needs string values for name and "
                             "path (and base_model_name, if given)")
    else:
        name, sep, path = text.partition("=")
        base = None
        if not sep:
            raise ValueError(f"--lora-modules: {text!r} is neither name=path nor a JSON "
                             'object like {"name": "x", "path": "/adapters/x"}')
    if not name.strip() or not path.strip():
        raise ValueError(f"--lora-modules: {text!r} needs a non-empty name and path")
    return LoRAModulePath(name.strip(), path.strip(), base)


class OpenAIServingModels:
    """The base model's served names and the LoRA adapters, by name.

    The server assigns each adapter its `lora_int_id` from a counter (1, 2, ...), never
    reusing one, so an adapter loaded again after an unload never meets the old one's
    weights or prefix-cache pages. The names are read from prepare threads and written on
    the event loop: a lock guards them.

    Args:
        base_model_names: Names of the base model; the first is reported.
        lora_modules: Adapters served from the start (`--lora-modules`).

    Raises:
        ValueError: An adapter name given twice or equal to a base model's name.
    """

    def __init__(self, base_model_names: list[str],
                 lora_modules: list[LoRAModulePath] | tuple = ()):
        self.base_model_names = list(base_model_names)
        self.lora_requests: dict[str, LoRARequest] = {}
        self._next_id = 1
        self._names = threading.Lock()
        self._updates: asyncio.Lock | None = None  # made on the event loop, on first use
        for module in lora_modules:
            self._check_new_name(module.name, ValueError)
            self.lora_requests[module.name] = LoRARequest(
                module.name, self._take_id(), module.path, module.base_model_name)

    @property
    def model_name(self) -> str:
        """The name responses report for the base model."""
        return self.base_model_names[0]

    def _take_id(self) -> int:
        lora_id, self._next_id = self._next_id, self._next_id + 1
        return lora_id

    def _check_new_name(self, name: str, error) -> None:
        if name in self.base_model_names:
            raise error(f"The lora adapter '{name}' has the base model's name.")
        if name in self.lora_requests:
            raise error(f"The lora adapter '{name}' has already been loaded.")

    def lora_request(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names (None for the base model or no model).

        Raises:
            OpenAIError: 404 naming a model that is neither the base nor an adapter.
        """
        if model is None or model in self.base_model_names:
            return None
        with self._names:
            lora = self.lora_requests.get(model)
        if lora is None:
            raise OpenAIError(404, f"The model `{model}` does not exist.", "model")
        return lora

    def response_name(self, lora: LoRARequest | None) -> str:
        """The `model` a response reports: the adapter's name, else the base's."""
        return lora.lora_name if lora is not None else self.model_name

    def cards(self, max_model_len: int, now: int, quantization: str | None = None) -> dict:
        """`/v1/models`: the base model's names (no file system paths), then each adapter
        with `root` its path and `parent` its base model; each card with vLLM's keys (one
        `permission` entry, vLLM's defaults)."""
        base = [{"id": name, "object": "model", "created": now, "owned_by": "jaxserve",
                 "root": self.model_name, "parent": None, "max_model_len": max_model_len,
                 "permission": [model_permission(now)], "quantization": quantization}
                for name in self.base_model_names]
        with self._names:
            loras = list(self.lora_requests.values())
        adapters = [{"id": lo.lora_name, "object": "model", "created": now,
                     "owned_by": "jaxserve", "root": lo.lora_path,
                     "parent": lo.base_model_name or self.model_name,
                     "max_model_len": max_model_len, "permission": [model_permission(now)],
                     "quantization": quantization} for lo in loras]
        return {"object": "list", "data": base + adapters}

    def _lock(self) -> asyncio.Lock:
        if self._updates is None:
            self._updates = asyncio.Lock()
        return self._updates

    async def load_lora_adapter(self, llm, lora_name: str, lora_path: str) -> str:
        """Loads an adapter on the engine and serves it under `lora_name`.

        Args:
            llm: The `AsyncLLM` (its `add_lora` reads the adapter on the engine thread).
            lora_name: The name requests will give as `model`.
            lora_path: The PEFT adapter directory.

        Returns:
            vLLM's success text.

        Raises:
            OpenAIError: 404 when no adapter is at the path (vLLM's "No adapter found"); 400
                for an empty field, a name already served, or an adapter that does not load
                (the engine's message, naming the adapter).
        """
        if not lora_name or not lora_path:
            raise OpenAIError(400, "Both 'lora_name' and 'lora_path' must be provided.",
                              "lora_name" if not lora_name else "lora_path")
        async with self._lock():
            with self._names:
                self._check_new_name(lora_name, lambda m: OpenAIError(400, m, "lora_name"))
                lora = LoRARequest(lora_name, self._take_id(), lora_path)
            try:
                await llm.add_lora(lora)
            except LoRAAdapterNotFoundError as e:  # vLLM's NotFoundError: its own message
                raise OpenAIError(404, str(e), "lora_path") from None
            except ValueError as e:
                raise OpenAIError(400, f"LoRA adapter '{lora_name}': {e}", "lora_path") \
                    from None
            with self._names:
                self.lora_requests[lora_name] = lora
        return f"Success: LoRA adapter '{lora_name}' added successfully."

    async def unload_lora_adapter(self, llm, lora_name: str | None,
                                  lora_int_id: int | None = None) -> str:
        """Stops serving an adapter: new requests naming it get a 404; requests already
        running it finish with it (the engine reloads it from their `LoRARequest` if it
        must).

        Args:
            llm: The `AsyncLLM`.
            lora_name: The adapter's name (or None with `lora_int_id`).
            lora_int_id: The adapter's id (vLLM's alternative field); with a name, both
                must name the same adapter.

        Returns:
            vLLM's success text.

        Raises:
            OpenAIError: 400 when neither field is given, 404 for an adapter not served.
        """
        if not lora_name and lora_int_id is None:
            raise OpenAIError(400, "either 'lora_name' and 'lora_int_id' needs to be "
                                   "provided.", "lora_name")
        async with self._lock():
            with self._names:
                found = [lo for lo in self.lora_requests.values()
                         if (not lora_name or lo.lora_name == lora_name)
                         and (lora_int_id is None or lo.lora_int_id == lora_int_id)]
                if not found:
                    what = " ".join(([f"'{lora_name}'"] if lora_name else [])
                                    + ([f"with id {lora_int_id}"] if lora_int_id is not None
                                       else []))
                    raise OpenAIError(404, f"The lora adapter {what} cannot be found.",
                                      "lora_name" if lora_name else "lora_int_id")
                lora = self.lora_requests.pop(found[0].lora_name)
            await llm.remove_lora(lora.lora_int_id)
        return f"Success: LoRA adapter '{lora.lora_name}' removed successfully."


def load_static_loras(engine, models: OpenAIServingModels) -> None:
    """Loads every `--lora-modules` adapter into an engine at start-up (before it serves).

    Raises:
        ValueError: An adapter that does not load, named with its path (start-up fails).
    """
    for lora in models.lora_requests.values():
        try:
            engine.add_lora(lora)
        except ValueError as e:
            raise ValueError(f"--lora-modules: adapter {lora.lora_name!r} "
                             f"({lora.lora_path}): {e}") from None
