"""Pooling settings in vLLM's shape: the engine's `PoolerConfig`, a request's `PoolingParams`."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass

import numpy as np

from jaxserve.utils import settings_dict

# How a prompt's final-normed hidden states become one vector: the last token's, their
# mean, or the first token's (vLLM's sequence pooling types).
POOLING_TYPES = ("LAST", "MEAN", "CLS")
RUNNERS = ("generate", "pooling")
# vLLM's older `task` argument: the runner each value means.
TASKS = {"generate": "generate", "embed": "pooling"}
# What a pooling request asks for (vLLM's pooling tasks): a vector, class probabilities, or
# a cross-encoder's score of a pair.
POOLING_TASKS = ("embed", "classify", "score")


@dataclass(frozen=True)
class PoolerConfig:
    """The engine's pooler (vLLM's `PoolerConfig`).

    Attributes:
        pooling_type: "LAST" (default, as vLLM's for decoder-only models), "MEAN" or "CLS".
        normalize: L2-normalize embeddings unless a request says otherwise (default True).
        dimensions: Matryoshka truncation for requests that give none (None: full size).
    """

    pooling_type: str = "LAST"
    normalize: bool = True
    dimensions: int | None = None

    def __post_init__(self):
        if isinstance(self.pooling_type, str):
            object.__setattr__(self, "pooling_type", self.pooling_type.upper())
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {POOLING_TYPES}, got "
                             f"{self.pooling_type!r}")
        if not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be True or False, got {self.normalize!r}")
        _check_dimensions(self.dimensions)

    @classmethod
    def parse(cls, value) -> PoolerConfig:
        """A `PoolerConfig` from one, a dict of its fields, a JSON object, or None.

        Raises:
            ValueError: Unknown fields (named) or bad values.
        """
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        value = settings_dict(value, "pooler_config", [f.name for f in dataclasses.fields(cls)],
                              '{"pooling_type": "MEAN", "normalize": true}')
        return cls(**{k: v for k, v in value.items() if v is not None})


# sentence-transformers' pooling modes (`1_Pooling/config.json`) the runner serves.
ST_POOLING_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN",
                    "pooling_mode_cls_token": "CLS"}


def sentence_transformers_pooler(directory: str | None) -> PoolerConfig | None:
    """The pooler a sentence-transformers model directory declares (`modules.json`: its
    `Pooling` module's mode, and whether a `Normalize` module follows, as vLLM reads them);
    None where there is no such file.

    Raises:
        ValueError: A pooling mode the runner does not serve (max, weighted mean, ...), or
            none or several of them set.
    """
    modules_path = os.path.join(directory or "", "modules.json")
    if not directory or not os.path.isfile(modules_path):
        return None
    with open(modules_path) as f:
        modules = json.load(f)
    kinds = {m.get("type", "").rsplit(".", 1)[-1]: m for m in modules}
    if "Pooling" not in kinds:
        return None
    with open(os.path.join(directory, kinds["Pooling"].get("path", ""), "config.json")) as f:
        pooling = json.load(f)
    modes = sorted(k for k, v in pooling.items() if k.startswith("pooling_mode_") and v)
    if len(modes) != 1 or modes[0] not in ST_POOLING_MODES:
        raise ValueError(f"pooler_config: {modules_path} declares pooling {modes or 'none'}; "
                         f"served: one of {sorted(ST_POOLING_MODES)} (give pooler_config to "
                         "choose another)")
    return PoolerConfig(ST_POOLING_MODES[modes[0]], normalize="Normalize" in kinds)


def _check_dimensions(dimensions) -> None:
    if dimensions is not None and (not isinstance(dimensions, int)
                                   or isinstance(dimensions, bool) or dimensions < 1):
        raise ValueError(f"dimensions must be a positive integer, got {dimensions!r}")


@dataclass(frozen=True)
class PoolingParams:
    """One embedding request's settings (vLLM's `PoolingParams`).

    Attributes:
        dimensions: Keep the first this many values (Matryoshka), then normalize; None:
            the pooler's default (the full hidden size). Above the hidden size: an error.
        normalize: L2-normalize the vector; None: the pooler's setting.
        task: One of `POOLING_TASKS`: "embed" (an embedding model's vector), "classify"
            (a sequence classifier's class probabilities) or "score" (a cross-encoder's
            score of a pair packed as one prompt).
        use_activation: Apply the classifier's activation (`ClassifierHead.activate`);
            None: yes (vLLM's default). False returns the raw logits.
    """

    dimensions: int | None = None
    normalize: bool | None = None
    task: str = "embed"
    use_activation: bool | None = None

    def __post_init__(self):
        _check_dimensions(self.dimensions)
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be True, False or None, got {self.normalize!r}")
        if self.task not in POOLING_TASKS:
            raise ValueError(f"task must be one of {POOLING_TASKS}, got {self.task!r}")
        if self.use_activation is not None and not isinstance(self.use_activation, bool):
            raise ValueError(f"use_activation must be True, False or None, got "
                             f"{self.use_activation!r}")
        if self.task != "embed" and (self.dimensions is not None or self.normalize is not None):
            raise ValueError(f"dimensions and normalize apply to embeddings, not task="
                             f"{self.task!r}")

    def verify(self, hidden_size: int) -> None:
        """Raises a ValueError naming `dimensions` when it exceeds the model's width."""
        if self.dimensions is not None and self.dimensions > hidden_size:
            raise ValueError(f"dimensions={self.dimensions} exceeds the model's hidden size "
                             f"{hidden_size}")

    def finish(self, pooled: np.ndarray, pooler: PoolerConfig) -> list[float]:
        """The embedding of a pooled vector (f32[hidden]): truncated to `dimensions`,
        then normalized, as the request or else the pooler says."""
        dims = self.dimensions if self.dimensions is not None else pooler.dimensions
        vec = np.asarray(pooled, np.float64)[:dims]  # f64[dims]
        normalize = pooler.normalize if self.normalize is None else self.normalize
        if normalize:
            vec = vec / max(float(np.linalg.norm(vec)), 1e-12)
        return vec.astype(np.float32).tolist()


@dataclass(frozen=True)
class ClassifierHead:
    """What a sequence classifier's class logits mean, for their activation (vLLM's
    `PoolerClassify` and the cross-encoder activation).

    Attributes:
        num_labels: Classes.
        problem_type: transformers' `problem_type` (None, "regression",
            "single_label_classification", "multi_label_classification").
        score_activation: A sentence-transformers cross-encoder's "sigmoid" or "identity";
            None: as `classify` does.
    """

    num_labels: int
    problem_type: str | None = None
    score_activation: str | None = None

    def activate(self, logits: np.ndarray, task: str) -> np.ndarray:
        """The activated f64[num_labels] of f32[num_labels] logits for `task` ("classify"
        or "score"): identity for a regression, a sigmoid for one class or a multi-label
        problem, else the softmax. A score takes the cross-encoder's own activation, else
        the sigmoid or softmax by the class count (`problem_type` aside, as vLLM's)."""
        x = np.asarray(logits, np.float64)
        default = "sigmoid" if self.num_labels < 2 else "softmax"
        if task == "score":
            kind = self.score_activation or default
        else:
            kind = {"regression": "identity", "multi_label_classification": "sigmoid"}.get(
                self.problem_type, default)
        if kind == "sigmoid":
            return 1.0 / (1.0 + np.exp(-x))
        if kind == "softmax":
            e = np.exp(x - x.max())
            return e / e.sum()
        return x
