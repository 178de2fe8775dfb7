"""SamplingParams: vLLM defaults, normalisation, and a ValueError naming each bad field."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.sampling_params import SamplingParams, SamplingType


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.seed is None and p.stop == [] and p.stop_token_ids == []
    assert p.max_tokens == 16 and p.min_tokens == 0
    assert p.logprobs is None and p.prompt_logprobs is None
    assert p.skip_special_tokens and p.spaces_between_special_tokens and p.detokenize
    assert not p.include_stop_str_in_output and not p.ignore_eos
    assert p.sampling_type == SamplingType.RANDOM and not p.is_greedy
    assert not p.needs_filtering and not p.has_penalties
    assert SamplingParams.MAX_LOGPROBS == 20


def test_logprobs_counts_allowed_up_to_the_engine():
    """-1 (the whole vocabulary) and any count pass here, as in vLLM: the engine checks them
    against its max_logprobs when the request is added (tests/e2e/test_engine_errors.py)."""
    p = SamplingParams(logprobs=-1, prompt_logprobs=-1)
    assert (p.logprobs, p.prompt_logprobs) == (-1, -1)
    assert SamplingParams(logprobs=21, prompt_logprobs=100).logprobs == 21
    with pytest.raises(ValueError, match=r"^logprobs must be non-negative or -1, got -2$"):
        SamplingParams(logprobs=-2)


def test_normalisation():
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "bc")).stop == ["a", "bc"]
    assert SamplingParams(stop_token_ids=(np.int64(3), 7)).stop_token_ids == [3, 7]
    assert SamplingParams(max_tokens=None).max_tokens is None
    assert SamplingParams(seed=np.int32(5), temperature=0.5).sampling_type == (
        SamplingType.RANDOM_SEED)
    assert isinstance(SamplingParams(temperature=1).temperature, float)


def test_greedy_resets_filters():
    p = SamplingParams(temperature=0.0, top_k=5, top_p=0.5, min_p=0.3)
    assert p.is_greedy and p.sampling_type == SamplingType.GREEDY
    assert (p.top_k, p.top_p, p.min_p) == (0, 1.0, 0.0) and not p.needs_filtering
    assert SamplingParams(temperature=9e-6).is_greedy
    assert not SamplingParams(temperature=1e-5).is_greedy


def test_helpers():
    p = SamplingParams(stop=["ab", "xyz"], stop_token_ids=[5])
    assert p.output_text_buffer_length == 2
    assert SamplingParams(stop=["xyz"], include_stop_str_in_output=True
                          ).output_text_buffer_length == 0
    assert p.all_stop_token_ids(2) == {2, 5}
    assert SamplingParams(ignore_eos=True, stop_token_ids=[5]).all_stop_token_ids(2) == {5}
    child = p.clone(seed=7)
    assert child.seed == 7 and child.stop == p.stop and p.seed is None
    with pytest.raises(ValueError, match="top_p"):
        p.clone(top_p=0.0)
    assert SamplingParams(top_k=3).needs_filtering
    assert SamplingParams(repetition_penalty=1.1).has_penalties


@pytest.mark.parametrize("kwargs, field", [
    ({"n": 0}, "n"),
    ({"n": 1.5}, "n"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"presence_penalty": -2.1}, "presence_penalty"),
    ({"frequency_penalty": 3}, "frequency_penalty"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"temperature": -1}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": float("inf")}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 2.5}, "top_k"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_p": 1.5}, "min_p"),
    ({"seed": 1.5}, "seed"),
    ({"seed": "42"}, "seed"),
    ({"seed": True}, "seed"),
    ({"stop": ["ok", ""]}, "stop"),
    ({"stop": [3]}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": ["a"]}, "stop_token_ids"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 17}, "min_tokens"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ({"logprobs": -2}, "logprobs"),
    ({"logprobs": 2**31}, "logprobs"),
    ({"logprobs": 1.5}, "logprobs"),
    ({"prompt_logprobs": -2}, "prompt_logprobs"),
    ({"ignore_eos": 1}, "ignore_eos"),
    ({"stop": "x", "detokenize": False}, "stop"),
    # Beyond the device's int32 (issue 12: a top_k of 2**40 failed every request in the step).
    ({"top_k": 2**40}, "top_k"),
    ({"n": 2**31}, "n"),
    ({"max_tokens": 2**31}, "max_tokens"),
    ({"min_tokens": 2**31, "max_tokens": None}, "min_tokens"),
    ({"stop_token_ids": [2**31]}, "stop_token_ids"),
    ({"stop_token_ids": 7}, "stop_token_ids"),
    ({"seed": -(2**63) - 1}, "seed"),
    ({"seed": 2**64}, "seed"),
    ({"stop": 3}, "stop"),
    ({"temperature": 1e308}, "temperature"),  # infinite once in float32 on the device
])
def test_invalid_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field) as info:
        SamplingParams(**kwargs)
    value = next(iter(kwargs.values()))
    assert repr(value) in str(info.value) or str(value) in str(info.value)


def test_too_many_stop_token_ids_is_refused():
    with pytest.raises(ValueError, match="stop_token_ids may hold at most 1024 ids, got 1025"):
        SamplingParams(stop_token_ids=list(range(1025)))


def test_revalidated_copy_catches_fields_mutated_after_construction():
    params = SamplingParams(temperature=1.0)
    params.top_k = 2**40  # dataclass fields can be set after __post_init__ ran
    with pytest.raises(ValueError, match="top_k"):
        params.clone()


def test_valid_edges():
    SamplingParams(presence_penalty=-2, frequency_penalty=2, top_p=1.0, min_p=1.0,
                   logprobs=20, prompt_logprobs=0, min_tokens=16, top_k=1)
    SamplingParams(min_tokens=100, max_tokens=None)


def test_unknown_keyword_is_type_error():
    with pytest.raises(TypeError):
        SamplingParams(best_off=2)


@pytest.mark.parametrize("bad", [3, -1, "delta", True, None])
def test_output_kind_must_be_a_request_output_kind(bad):
    with pytest.raises(ValueError, match="output_kind must be a RequestOutputKind"):
        SamplingParams(output_kind=bad)


def test_output_kind_from_its_value():
    from jaxserve.sampling_params import RequestOutputKind

    assert SamplingParams(output_kind=1).output_kind is RequestOutputKind.DELTA
    assert SamplingParams().clone(output_kind=2).output_kind is RequestOutputKind.FINAL_ONLY


def test_any_signed_64_bit_seed_is_taken_and_keeps_its_own_device_stream():
    from jaxserve.sampling_params import SEED_MAX, SEED_MIN, device_seed

    assert SamplingParams(seed=SEED_MIN).seed == -(2**63)  # vLLM's torch.long range
    assert SamplingParams(seed=-1).seed == -1 and SamplingParams(seed=SEED_MAX).seed == SEED_MAX
    # Seeds the device key holds as they are keep their streams; the others are mixed from
    # all 64 bits instead of keeping their low 32 (which would make -1 the seed 2**32 - 1,
    # and 2**32 + 5 the seed 5).
    assert [device_seed(s) for s in (0, 5, 2**32 - 1)] == [0, 5, 2**32 - 1]
    wide = [-1, -(2**63), 2**32, 2**32 + 5, 2**63 - 1, 2**64 - 2]
    mapped = [device_seed(s) for s in wide]
    assert mapped == [device_seed(s) for s in wide]  # deterministic
    assert all(0 <= m < 2**32 for m in mapped) and len(set(mapped)) == len(wide)
    assert device_seed(2**32 + 5) != 5 and device_seed(-1) != 2**32 - 1
    assert device_seed(-1) == device_seed(2**64 - 1)  # one 64-bit pattern, one stream
