"""On-device sampling from per-row arrays: metadata builder, sampler, logprobs."""

from jaxserve.sample.filters import apply_filters
from jaxserve.sample.logprobs import PromptLogprobs, compute_prompt_logprobs, gather_logprobs
from jaxserve.sample.metadata import (
    MAX_LOGPROBS,
    RowSpec,
    SamplingMetadata,
    build_sampling_metadata,
    logprobs_bucket,
    logprobs_widths,
    padded_len,
)
from jaxserve.sample.sampler import (
    SamplerOutput,
    apply_penalties,
    random_sample,
    sample,
)

__all__ = [
    "MAX_LOGPROBS",
    "PromptLogprobs",
    "RowSpec",
    "SamplerOutput",
    "SamplingMetadata",
    "apply_filters",
    "apply_penalties",
    "build_sampling_metadata",
    "compute_prompt_logprobs",
    "gather_logprobs",
    "logprobs_bucket",
    "logprobs_widths",
    "padded_len",
    "random_sample",
    "sample",
]
