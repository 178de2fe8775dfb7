"""`StructuredOutputsParams` validation and the grammar compiler's cache (no engine)."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve import SamplingParams, StructuredOutputsParams
from jaxserve.structured import GrammarCompiler


@pytest.mark.parametrize("kwargs, words", [
    ({}, "exactly one"),
    (dict(regex="a", choice=["a"]), "exactly one"),
    (dict(json="{not json"), "not valid JSON"),
    (dict(json="[1, 2]"), "JSON schema"),
    (dict(regex=""), "non-empty string"),
    (dict(choice="yes"), "non-empty list"),
    (dict(choice=["a", 1]), "non-empty list"),
    (dict(json_object="yes"), "must be a bool"),
    (dict(regex="a", disable_any_whitespace=1), "must be a bool"),
])
def test_bad_params_name_the_field(kwargs, words):
    with pytest.raises(ValueError, match=words):
        StructuredOutputsParams(**kwargs)


def test_sampling_params_takes_a_dict_and_checks_it():
    p = SamplingParams(structured_outputs={"choice": ["x", "y"]})
    assert p.structured_outputs == StructuredOutputsParams(choice=("x", "y"))
    assert p.needs_output_history  # its next mask follows the previous token
    with pytest.raises(ValueError, match="unknown field"):
        SamplingParams(structured_outputs={"choices": ["x"]})


@pytest.fixture(scope="module")
def compiler(smollm2_tokenizer):
    return GrammarCompiler(smollm2_tokenizer, 49152, cache_size=2)


def test_compiles_once_per_constraint_lru(compiler):
    a, b, c = (StructuredOutputsParams(regex=r) for r in ("a+", "b+", "c+"))
    base = compiler.num_compiled
    compiler.compile(a), compiler.compile(a), compiler.compile(b)
    assert compiler.num_compiled == base + 2
    compiler.compile(c)  # evicts a (least recently used)
    compiler.compile(b)
    assert compiler.num_compiled == base + 3
    compiler.compile(a)
    assert compiler.num_compiled == base + 4
    # the same schema as a dict or as its JSON text is one grammar; json_object another
    key = StructuredOutputsParams(json={"type": "object", "required": []}).cache_key()
    assert key == StructuredOutputsParams(json='{"required": [], "type": "object"}').cache_key()
    assert key != StructuredOutputsParams(json_object=True).cache_key()


@pytest.mark.parametrize("bad", [dict(grammar='root ::= "a'), dict(grammar="start: nope"),
                                 dict(regex="(a"), dict(json={"type": "strin"})])
def test_compile_errors_are_value_errors(compiler, bad):
    with pytest.raises(ValueError, match="does not compile|Invalid type"):
        compiler.compile(StructuredOutputsParams(**bad))


def test_disable_additional_properties_closes_schemas_only():
    from jaxserve.structured.grammar import _close_objects

    schema = {"type": "object", "properties": {
        "properties": {"type": "object", "properties": {"a": {"type": "string"}}},
        "c": {"const": {"properties": {}}}},
        "$defs": {"d": {"type": "object", "properties": {}}}}
    out = _close_objects(schema)
    assert out["additionalProperties"] is False
    assert out["properties"]["properties"]["additionalProperties"] is False
    assert out["properties"]["c"] == {"const": {"properties": {}}}  # a value, not a schema
    assert out["$defs"]["d"]["additionalProperties"] is False


def allowed(mask: np.ndarray) -> np.ndarray:
    return np.nonzero(np.unpackbits(mask.view(np.uint8), bitorder="little"))[0]


def test_matcher_follows_tokens_rolls_back_and_masks(compiler, smollm2_tokenizer):
    tok = smollm2_tokenizer
    m = compiler.matcher(StructuredOutputsParams(choice=["yes", "no"]))
    first = allowed(m.bitmask([]))
    texts = {tok.decode([t]) for t in first}
    assert texts and all("yes".startswith(t) or "no".startswith(t) for t in texts)
    yes = tok.encode("yes", add_special_tokens=False)
    after = allowed(m.bitmask(yes))
    assert list(after) == [tok.eos_token_id]  # complete: only EOS may follow
    assert m.is_stopped
    # a shorter token list rolls the matcher back
    assert set(allowed(m.bitmask([]))) == set(first)
    # proposals are checked, then rolled back; a rejected one allows everything
    assert list(allowed(m.bitmask([], proposals=yes))) == [tok.eos_token_id]
    bad = tok.encode("maybe", add_special_tokens=False)
    assert len(allowed(m.bitmask([], proposals=bad))) == 49152
    assert set(allowed(m.bitmask([]))) == set(first)
    with pytest.raises(ValueError, match="does not follow the grammar"):
        m.bitmask(bad)
    child = m.fork()
    assert set(allowed(child.bitmask([]))) == set(first)
    # ignore_eos: after the grammar completed, more EOS tokens are followed, not refused
    eos = [tok.eos_token_id] * 3
    assert list(allowed(child.bitmask(yes + eos))) == [tok.eos_token_id]
    assert set(allowed(child.bitmask([]))) == set(first)  # and rolled back through them


def test_batched_fill_equals_one_by_one(compiler, smollm2_tokenizer):
    """`fill_bitmasks` (one parallel llguidance call, the engine's path) gives each row the
    mask `RequestGrammar.bitmask` gives: after its proposals, all ones past a rejected one,
    the same mask on every row of a fan-out; and leaves the matchers where they were."""
    from jaxserve.structured import fill_bitmasks

    tok = smollm2_tokenizer
    enc = lambda t: tok.encode(t, add_special_tokens=False)  # noqa: E731
    json_p = StructuredOutputsParams(json={"type": "object", "properties": {
        "a": {"type": "string"}}, "required": ["a"]}, disable_any_whitespace=True)
    regex_p = StructuredOutputsParams(regex="[a-z]{2,6}")
    items = [
        (compiler.matcher(json_p), enc('{"a":"'), enc("hello"), 6),  # proposals held
        (compiler.matcher(regex_p), enc("ab"), enc("c!d"), 4),  # a proposal is rejected
        (compiler.matcher(json_p), [], [], 3),  # n = 3 fan-out
    ]
    masks, errors = fill_bitmasks(items, 49152)
    assert not errors
    for (grammar, outputs, proposals, rows), got in zip(items, masks, strict=True):
        ref = compiler.matcher(json_p if rows != 4 else regex_p)
        for k in range(rows):
            want = ref.bitmask(outputs, proposals[:min(k, len(proposals))])
            assert (got[k] == want).all(), (outputs, k)
        assert (grammar.bitmask(outputs) == ref.bitmask(outputs)).all()  # not moved
    rejected = np.where([(m == -1).all() for m in masks[1]])[0]
    assert len(rejected) and len(rejected) < 4  # some rows follow a rejected proposal
    bad = compiler.matcher(regex_p)
    masks, errors = fill_bitmasks([(bad, enc("A"), [], 1), items[2]], 49152)
    assert masks[0] is None and "does not follow" in str(errors[0]) and masks[1] is not None


def test_schemas_are_strict_by_default_and_whitespace_is_bounded(compiler, smollm2_tokenizer):
    """By default an object takes only the properties its schema lists (vLLM's default
    backend; `disable_additional_properties=False` opens it again, an explicit
    `additionalProperties` wins), and the whitespace between JSON tokens is one space or a
    newline and an indent: no runs of tabs, no blank lines."""
    tok = smollm2_tokenizer
    enc = lambda t: tok.encode(t, add_special_tokens=False)  # noqa: E731
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}

    def texts_after(params, prefix):
        m = compiler.matcher(params)
        return {tok.decode([t]) for t in allowed(m.bitmask(enc(prefix)))}

    strict = texts_after(StructuredOutputsParams(json=schema), '{"a": "x"')
    assert "," not in strict and "}" in strict  # no second property
    assert StructuredOutputsParams(json=schema).closes_objects
    opened = StructuredOutputsParams(json=schema, disable_additional_properties=False)
    assert not opened.closes_objects and "," in texts_after(opened, '{"a": "x"')
    explicit = {**schema, "additionalProperties": {"type": "integer"}}
    assert "," in texts_after(StructuredOutputsParams(json=explicit), '{"a": "x"')
    gap = texts_after(StructuredOutputsParams(json=schema), "{\n")
    assert not any("\t\t\t\t\t\t\t" in t or "\n\n" in t for t in gap)
    assert all(t.strip(" \t\n") == "" or t.lstrip(" \t\n").startswith('"') for t in gap)
    with pytest.raises(ValueError, match="disable_additional_properties must be a bool"):
        StructuredOutputsParams(json=schema, disable_additional_properties="no")
