"""`SpeculativeConfig`: vLLM's `speculative_config` (a dict or its JSON), parsed and checked."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jaxserve.utils import settings_dict

SPECULATIVE_METHODS = ("ngram", "draft_model", "eagle3", "mtp")
# vLLM's per-family names of the MTP method.
MTP_ALIASES = ("deepseek_mtp", "qwen3_next_mtp")
_SPECULATIVE_FIELDS = {"method", "num_speculative_tokens", "prompt_lookup_min",
                       "prompt_lookup_max", "model", "eagle_aux_hidden_state_layer_ids"}


@dataclass(frozen=True)
class SpeculativeConfig:
    """How proposals are made and how many each decoding request gets per step.

    Attributes:
        method: "ngram" (prompt lookup over the request's own tokens), "draft_model",
            "eagle3" (a draft head reading the target's hidden states: `spec_decode.eagle`)
            or "mtp" (the target checkpoint's own MTP layer: `spec_decode.mtp`; vLLM's
            "deepseek_mtp" and "qwen3_next_mtp" name it too).
        num_speculative_tokens: k, proposals per request per step (each step then
            computes up to 1 + k query tokens for a decoding request).
        prompt_lookup_min: Shortest suffix n-gram that may match (ngram).
        prompt_lookup_max: Longest suffix n-gram tried first (ngram).
        model: The draft model (draft_model): its path, or a loaded `models.model.Model`
            (Python API); same tokenizer and vocabulary as the target. For eagle3 the
            head's directory (or a loaded `models.loaders.eagle3.Eagle3Head`); for mtp the
            directory holding the MTP layer (None: the target's own; or a loaded
            `models.mtp.MtpHead`).
        aux_layer_ids: eagle3: the target layers whose input hidden states the head reads
            (`eagle_aux_hidden_state_layer_ids`); None: the head config's, else vLLM's
            default (2, L // 2, L - 3).
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: Any = None
    aux_layer_ids: tuple[int, ...] | None = None

    @classmethod
    def from_dict(cls, spec: dict[str, Any] | str | SpeculativeConfig | None
                  ) -> SpeculativeConfig | None:
        """Parses vLLM's dict (or its JSON, as `--speculative-config` takes it).

        For ngram, a missing `prompt_lookup_max` is 5 and a missing `prompt_lookup_min`
        is 2 (capped at the max); one given alone bounds the other.

        Raises:
            ValueError: Unknown keys or method, k < 1, bad lookup bounds, a draft model or
                head without `model`, aux layer ids off eagle3 or not a list of integers
                (each message names the field).
        """
        if spec is None or isinstance(spec, SpeculativeConfig):
            return spec
        spec = settings_dict(spec, "speculative_config", _SPECULATIVE_FIELDS,
                             '{"method": "ngram", "num_speculative_tokens": 3}')
        method = spec.get("method")
        method = "mtp" if method in MTP_ALIASES else method
        if method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config.method: {method!r} is not one of "
                             f"{SPECULATIVE_METHODS}")
        k = spec.get("num_speculative_tokens")
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError("speculative_config.num_speculative_tokens: must be an integer "
                             f">= 1, got {k!r}")
        lo, hi = spec.get("prompt_lookup_min"), spec.get("prompt_lookup_max")
        model = spec.get("model")
        if method == "ngram":
            for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
                if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                    raise ValueError(f"speculative_config.{name}: must be an integer >= 1, "
                                     f"got {v!r}")
            if hi is None:
                hi = max(5, lo or 0)
            if lo is None:
                lo = min(2, hi)
            if lo > hi:
                raise ValueError(f"speculative_config.prompt_lookup_min: {lo} exceeds "
                                 f"prompt_lookup_max={hi}")
            if model is not None:
                raise ValueError("speculative_config.model: only the draft_model method "
                                 "takes a model")
        else:
            loaded = hasattr(model, "params")  # a loaded Model or head
            if method == "mtp" and model is None:
                pass  # the target's own checkpoint
            elif not loaded and (not isinstance(model, str) or not model):
                raise ValueError(f"speculative_config.model: the {method} method needs "
                                 "the draft's path (or a loaded model)")
            if lo is not None or hi is not None:
                raise ValueError("speculative_config.prompt_lookup_min/max: only the ngram "
                                 "method takes them")
        ids = spec.get("eagle_aux_hidden_state_layer_ids")
        if ids is not None:
            if method != "eagle3":
                raise ValueError("speculative_config.eagle_aux_hidden_state_layer_ids: only "
                                 "the eagle3 method takes it")
            if not isinstance(ids, list | tuple) or not ids or any(
                    isinstance(i, bool) or not isinstance(i, int) for i in ids):
                raise ValueError("speculative_config.eagle_aux_hidden_state_layer_ids: must "
                                 f"be a list of layer indices, got {ids!r}")
            ids = tuple(ids)
        return cls(method, k, lo, hi, model, ids)
