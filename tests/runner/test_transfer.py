"""`transfer.pack`/`unpack`: one int32 buffer per step, bit-exact round trips, refused dtypes."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxserve.runner.transfer import Layout, pack, unpack
from jaxserve.sample.metadata import SamplingMetadata

unpack_jit = jax.jit(unpack, static_argnums=1)


def round_trip(tree):
    buf, layout = pack(tree)
    return buf, layout, jax.tree.map(np.asarray, unpack_jit(jax.device_put(buf), layout))


def test_mixed_dtypes_shapes_and_none_leaves_round_trip_bit_exactly():
    f = np.array([[1.5, -0.0, np.inf], [np.nan, -np.inf, 3e-38]], np.float32)  # f32[2, 3]
    tree = {"ids": np.arange(12, dtype=np.int32).reshape(3, 4) - 5,  # i32[3, 4]
            "seeds": np.array([0, 2**31, 2**32 - 1], np.uint32),  # u32[3], past int32 range
            "nested": (f, [np.float32(0.25), None]),  # f32[] scalar and a None leaf
            "empty": np.zeros((2, 0), np.int32),  # i32[2, 0]
            "none": None}
    buf, layout, back = round_trip(tree)
    assert buf.dtype == np.int32 and buf.shape == (layout.size,) == (12 + 3 + 6 + 1,)
    assert back["none"] is None and back["nested"][1][1] is None
    np.testing.assert_array_equal(back["ids"], tree["ids"])
    assert back["seeds"].dtype == np.uint32
    np.testing.assert_array_equal(back["seeds"], tree["seeds"])
    # Bit patterns, not values: NaN, -0.0 and a tiny float survive.
    assert back["nested"][0].dtype == np.float32 and back["nested"][0].shape == (2, 3)
    np.testing.assert_array_equal(back["nested"][0].view(np.int32), f.view(np.int32))
    assert back["nested"][1][0].shape == () and back["nested"][1][0] == np.float32(0.25)
    assert back["empty"].shape == (2, 0) and back["empty"].dtype == np.int32


def test_buffer_is_the_leaves_raw_words_in_tree_order():
    buf, layout = pack({"b": np.array([1.0], np.float32), "a": np.array([7, 8], np.int32)})
    # dict leaves flatten in sorted key order: "a" then "b".
    assert buf.tolist() == [7, 8, 0x3F800000]
    assert layout.shapes == ((2,), (1,)) and layout.dtypes == ("int32", "float32")


def test_bools_are_packed_as_int32():
    buf, layout, back = round_trip({"mask": np.array([True, False, True])})
    assert layout.dtypes == ("int32",) and buf.tolist() == [1, 0, 1]
    assert back["mask"].dtype == np.int32 and back["mask"].tolist() == [1, 0, 1]


def test_sampling_metadata_round_trips_with_its_static_fields():
    md = SamplingMetadata(
        temperature=np.array([0.0, 0.7], np.float32), top_k=np.array([0, 5], np.int32),
        top_p=np.array([1.0, 0.9], np.float32), min_p=np.zeros(2, np.float32),
        presence_penalty=np.zeros(2, np.float32), frequency_penalty=np.zeros(2, np.float32),
        repetition_penalty=np.ones(2, np.float32), seeds=np.array([0, 4000000000], np.uint32),
        counters=np.array([3, 9], np.int32), all_greedy=False, needs_filtering=True)
    _, layout, back = round_trip(md)
    assert isinstance(back, SamplingMetadata) and back.prompt_token_ids is None
    assert (back.all_greedy, back.needs_filtering, back.max_num_logprobs) == (False, True, 0)
    assert back.seeds.tolist() == [0, 4000000000] and back.top_p.tolist() == md.top_p.tolist()


def test_layout_depends_on_structure_not_values():
    a = pack({"x": np.zeros(4, np.int32), "y": np.ones(2, np.float32)})[1]
    b = pack({"x": np.full(4, 9, np.int32), "y": np.full(2, 5.0, np.float32)})[1]
    assert a == b and hash(a) == hash(b) and isinstance(a, Layout)
    assert a != pack({"x": np.zeros(5, np.int32), "y": np.ones(2, np.float32)})[1]
    assert a != pack({"x": np.zeros(4, np.uint32), "y": np.ones(2, np.float32)})[1]
    assert a != pack([np.zeros(4, np.int32), np.ones(2, np.float32)])[1]


def test_empty_tree_packs_to_an_empty_buffer():
    buf, layout, back = round_trip({})
    assert buf.shape == (0,) and buf.dtype == np.int32 and layout.size == 0 and back == {}


@pytest.mark.parametrize("leaf", [np.zeros(2, np.float64), np.zeros(2, np.int64),
                                  np.zeros(2, np.float16), np.zeros(2, np.int8),
                                  np.zeros(2, np.uint16), 3, 2.5])
def test_refuses_other_dtypes(leaf):
    # NOTE: Python scalars are int64/float64 to NumPy, so they are refused too.
    with pytest.raises(ValueError, match="cannot pack dtype"):
        pack({"ok": np.zeros(3, np.int32), "bad": leaf})
