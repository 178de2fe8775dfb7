"""`make_speculator`: the engine's speculator (n-gram, draft model, EAGLE-3, MTP) for its config."""

from __future__ import annotations

from jaxserve.config import SpeculativeConfig
from jaxserve.spec_decode.draft import DraftModelSpeculator
from jaxserve.spec_decode.eagle import Eagle3Speculator
from jaxserve.spec_decode.mtp import MtpSpeculator
from jaxserve.spec_decode.speculator import NgramSpeculator, Speculator


def make_speculator(config: SpeculativeConfig | None, **runner_args) -> Speculator | None:
    """The engine's speculator for `config` (None: speculation off).

    Args:
        config: The engine's `SpeculativeConfig`, or None.
        runner_args: For a draft model or head: the target's `vocab_size`, `dtype`,
            `backend`, `target_params` (its parameter count), the `target` model itself
            and the runner sizes (`num_pages`, `page_size`, `max_model_len`,
            `max_num_seqs`, `max_num_batched_tokens`); see `DraftModelSpeculator` and
            `Eagle3Speculator`.

    Returns:
        The speculator, or None when `config` is None.

    Raises:
        ValueError: A draft model or head that does not fit the target (another
            vocabulary, hidden size, layers).
    """
    if config is None:
        return None
    if config.method == "ngram":
        return NgramSpeculator(config)
    target = runner_args.pop("target", None)
    if config.method == "eagle3":
        return Eagle3Speculator(config, target=target, **runner_args)
    if config.method == "mtp":
        return MtpSpeculator(config, target=target, **runner_args)
    return DraftModelSpeculator(config, **runner_args)
