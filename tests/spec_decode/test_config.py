"""`SpeculativeConfig.from_dict`: vLLM's dict shape, defaults, and errors that name the field."""

from __future__ import annotations

import pytest

from jaxserve.config import SpeculativeConfig


def test_ngram_defaults_and_bounds():
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3})
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) \
        == ("ngram", 3, 2, 5)
    c = SpeculativeConfig.from_dict('{"method": "ngram", "num_speculative_tokens": 4, '
                                    '"prompt_lookup_max": 1}')
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (1, 1)
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2,
                                     "prompt_lookup_min": 7})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (7, 7)
    assert SpeculativeConfig.from_dict(None) is None
    assert SpeculativeConfig.from_dict(c) is c


def test_draft_model_needs_its_path():
    c = SpeculativeConfig.from_dict({"method": "draft_model", "model": "/m/draft.gguf",
                                     "num_speculative_tokens": 5})
    assert (c.method, c.model, c.num_speculative_tokens) == ("draft_model", "/m/draft.gguf", 5)


def test_eagle3_takes_a_head_and_its_layers():
    c = SpeculativeConfig.from_dict('{"method": "eagle3", "model": "/m/head", '
                                    '"num_speculative_tokens": 4, '
                                    '"eagle_aux_hidden_state_layer_ids": [1, 15, 27]}')
    assert (c.method, c.model, c.num_speculative_tokens, c.aux_layer_ids) == (
        "eagle3", "/m/head", 4, (1, 15, 27))
    c = SpeculativeConfig.from_dict({"method": "eagle3", "model": "/m/head",
                                     "num_speculative_tokens": 1})
    assert c.aux_layer_ids is None  # the head's own, else vLLM's default


@pytest.mark.parametrize("spec, field", [
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "medusa", "num_speculative_tokens": 2}, "method"),
    ({"num_speculative_tokens": 2}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0},
     "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
      "prompt_lookup_max": 3}, "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "model"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "model": "x",
      "prompt_lookup_max": 3}, "prompt_lookup"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "lookahead"),
    ({"method": "eagle3", "num_speculative_tokens": 2}, "model"),
    ({"method": "eagle3", "num_speculative_tokens": 0, "model": "x"}, "num_speculative_tokens"),
    ({"method": "eagle3", "num_speculative_tokens": 2, "model": "x",
      "eagle_aux_hidden_state_layer_ids": [1.5]}, "eagle_aux_hidden_state_layer_ids"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "model": "x",
      "eagle_aux_hidden_state_layer_ids": [1]}, "eagle_aux_hidden_state_layer_ids"),
    ("{not json", "JSON"),
    ([1, 2], "dict"),
])
def test_bad_configs_name_the_field(spec, field):
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig.from_dict(spec)


def test_make_speculator_picks_the_proposer():
    """Off is None, ngram proposes on the host; a draft model makes device calls of its own
    (which a multi-host follower could not replay)."""
    from jaxserve.spec_decode.draft import DraftModelSpeculator
    from jaxserve.spec_decode.factory import make_speculator
    from jaxserve.spec_decode.speculator import NgramSpeculator

    assert make_speculator(None) is None
    spec = make_speculator(SpeculativeConfig.from_dict({"method": "ngram",
                                                        "num_speculative_tokens": 2}))
    assert isinstance(spec, NgramSpeculator) and not spec.own_device_calls
    assert DraftModelSpeculator.own_device_calls
