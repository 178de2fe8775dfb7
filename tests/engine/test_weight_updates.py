"""New weights without a restart (`update_weights`), `reset_prefix_cache`, and `sleep` /
`wake_up` (whole, or per memory tag as vLLM's partial wake-up): outputs equal a fresh engine
built with the same weights, nothing recompiles, placed weights never go through the host,
and the page pool's memory is given back (and stays free while only the weights are awake)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from models.loaders import load_model
from models.model import Model, random_params
from tests.conftest import TINY_ENGINE

PROMPTS = ["The capital of France is", "Once upon a time, in a village by the sea,"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def tokens(llm, prompts=PROMPTS):
    return [list(o.outputs[0].token_ids)
            for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def sleep_state(llm) -> dict:
    """vLLM's `engine_sleep_state` gauge, by state."""
    return {k.split("=")[1][:-1]: v for k, v in llm.engine.get_metrics().items()
            if k.startswith("jaxserve:engine_sleep_state{")}


@pytest.fixture(scope="module")
def base_model(tiny_model_dir):
    return load_model(tiny_model_dir, "float32")


@pytest.fixture(scope="module")
def new_params(base_model):
    return random_params(base_model.cfg, seed=7)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(tiny_model_dir, **TINY_ENGINE)


@pytest.fixture(scope="module")
def expected_new(base_model, new_params, smollm2_tokenizer):
    """Greedy tokens of a fresh engine built with the new weights."""
    fresh = LLM(Model(base_model.cfg, new_params, source="new"), tokenizer=smollm2_tokenizer,
                warmup=False, **TINY_ENGINE)
    return tokens(fresh)


def test_new_weights_give_a_fresh_engines_outputs_without_compiling(llm, base_model,
                                                                     new_params, expected_new):
    before = tokens(llm)
    assert before != expected_new
    with jax.transfer_guard("disallow"):  # the leaves are already where they serve
        assert llm.update_weights(new_params) == []
    assert tokens(llm) == expected_new
    llm.update_weights(base_model.params)
    assert tokens(llm) == before
    assert llm.engine.runner.num_compilations == 0


def test_a_checkpoint_path_is_read_into_the_model(llm, tiny_model_dir, smollm2_tokenizer,
                                                  smollm2_path, tmp_path):
    from models.loaders.gguf_file import open_gguf
    from tests.conftest import write_tiny_hf_dir

    other = write_tiny_hf_dir(str(tmp_path / "other"), smollm2_tokenizer,
                              open_gguf(smollm2_path).hf_config(), seed=3)
    before = tokens(llm)
    llm.update_weights(other)
    want = tokens(LLM(other, warmup=False, **TINY_ENGINE))
    assert tokens(llm) == want != before
    llm.update_weights(tiny_model_dir)
    assert tokens(llm) == before
    wider = write_tiny_hf_dir(str(tmp_path / "wider"), smollm2_tokenizer,
                              open_gguf(smollm2_path).hf_config(), intermediate_size=96)
    with pytest.raises(ValueError, match="of another shape"):
        llm.update_weights(wider)


def test_running_requests_are_refused_or_aborted(llm, new_params, base_model):
    engine = llm.engine
    engine.add_request("r0", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=20))
    engine.step()
    with pytest.raises(ValueError, match=r"update_weights: 1 request\(s\) are unfinished "
                                         r"\(\['r0'\]\).*abort_running=True"):
        llm.update_weights(new_params)
    assert "r0" in engine.states  # refused: nothing changed
    aborted = llm.update_weights(new_params, abort_running=True)
    assert [o.request_id for o in aborted] == ["r0"]
    assert aborted[0].outputs[0].finish_reason == "abort"
    assert not engine.states and engine.kv.usage == 0
    llm.update_weights(base_model.params)


def test_weights_that_do_not_fit_are_refused_naming_the_leaf(llm, new_params):
    bad = jax.tree_util.tree_map(lambda x: x, new_params)
    bad["layers"]["self_attn"]["q_proj"]["kernel"] = bad["layers"]["self_attn"]["q_proj"][
        "kernel"][:, :, :-1]
    with pytest.raises(ValueError, match=r"leaf \['layers'\]\['self_attn'\]\['q_proj'\]"
                                         r"\['kernel'\] is float32\[2, 72, 143\]"):
        llm.update_weights(bad)
    missing = jax.tree_util.tree_map(lambda x: x, new_params)
    del missing["norm"]
    with pytest.raises(ValueError, match=r"missing \[\"\['norm'\]"):
        llm.update_weights(missing)
    with pytest.raises(ValueError, match="params tree"):
        llm.update_weights(42)


def test_reset_prefix_cache(llm):
    first = llm.generate(PROMPTS[1] * 4, GREEDY, use_tqdm=False)[0]
    again = llm.generate(PROMPTS[1] * 4, GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0
    assert llm.reset_prefix_cache()
    after = llm.generate(PROMPTS[1] * 4, GREEDY, use_tqdm=False)[0]
    assert after.num_cached_tokens == 0
    assert after.outputs[0].token_ids == first.outputs[0].token_ids
    llm.engine.add_request("holds", PROMPTS[0], GREEDY)
    llm.engine.step()
    assert not llm.reset_prefix_cache()  # pages in use: nothing done
    llm.engine.abort_request("holds")


def test_sleep_frees_the_pool_and_wake_up_serves_the_same(llm):
    before = tokens(llm)
    pool_bytes = llm.engine.runner.kv_pages.nbytes
    live = sum(x.nbytes for x in jax.live_arrays())
    assert llm.sleep(level=1) == pool_bytes
    assert llm.is_sleeping() and llm.engine.runner.kv_pages is None
    # vLLM's gauge
    assert sleep_state(llm) == {"awake": 0, "weights_offloaded": 1, "discard_all": 0}
    assert sum(x.nbytes for x in jax.live_arrays()) <= live - pool_bytes
    with pytest.raises(ValueError, match="sleeping"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.wake_up()
    assert not llm.is_sleeping() and tokens(llm) == before
    assert sleep_state(llm) == {"awake": 1, "weights_offloaded": 0, "discard_all": 0}
    assert llm.engine.runner.num_compilations == 0


def live_bytes() -> int:
    return sum(x.nbytes for x in jax.live_arrays())


def test_partial_wake_up_updates_the_weights_before_the_kv_cache(llm, base_model, new_params,
                                                                  expected_new):
    """vLLM's RL order: `wake_up(tags=["weights"])` leaves the engine asleep with the pool
    unallocated (no bytes added), new weights go in, `wake_up(tags=["kv_cache"])` ends the
    sleep; the tokens are a fresh engine's and nothing compiles."""
    runner = llm.engine.runner
    before = tokens(llm)
    pool_bytes = runner.kv_pages.nbytes
    llm.sleep(level=1)
    asleep = live_bytes()
    llm.wake_up(tags=["weights"])
    assert llm.is_sleeping() and runner.kv_pages is None and live_bytes() == asleep
    assert sleep_state(llm) == {"awake": 0, "weights_offloaded": 0, "discard_all": 0}
    with pytest.raises(ValueError, match="sleeping .*still asleep: kv_cache"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    with jax.transfer_guard("disallow"):
        llm.update_weights(new_params)
    assert llm.is_sleeping() and runner.kv_pages is None and live_bytes() <= asleep
    llm.wake_up(tags=["weights"])  # awake already: nothing to do
    llm.wake_up(tags=[])  # vLLM's empty list: nothing either
    assert llm.is_sleeping()
    llm.wake_up(tags=["kv_cache"])
    assert not llm.is_sleeping() and live_bytes() <= asleep + pool_bytes
    assert sleep_state(llm) == {"awake": 1, "weights_offloaded": 0, "discard_all": 0}
    assert tokens(llm) == expected_new
    llm.update_weights(base_model.params)
    assert tokens(llm) == before
    assert runner.num_compilations == 0


def test_unknown_wake_up_tags_are_refused_and_wake_nothing(llm):
    llm.sleep(level=1)
    for tags, match in ((["weights", "kv-cache"], r"unknown memory tag\(s\) \['kv-cache'\]"),
                        (["scheduling"], "unknown memory tag"),  # vLLM's level-0 tag
                        ("weights", "must be a list")):
        with pytest.raises(ValueError, match=match):
            llm.wake_up(tags=tags)
    assert llm.engine.weights.sleeping_tags == {"weights", "kv_cache"}
    llm.wake_up()
    assert not llm.is_sleeping() and llm.engine.runner.kv_pages is not None


def test_sleep_level_2_drops_the_weights_and_wake_up_reads_them_again(llm):
    before = tokens(llm)
    freed = llm.sleep(level=2)
    assert freed > llm.engine.limits.num_pages  # pool and weights
    assert llm.engine.runner.params is None
    assert sleep_state(llm) == {"awake": 0, "weights_offloaded": 0, "discard_all": 1}
    llm.wake_up(tags=["weights"])  # read again from the model's directory, pool still free
    assert llm.engine.runner.params is not None and llm.engine.runner.kv_pages is None
    assert llm.is_sleeping()
    llm.wake_up(tags=["kv_cache"])
    assert tokens(llm) == before


def test_sleep_level_2_takes_new_weights_before_waking(llm, base_model, new_params,
                                                       expected_new):
    """At level 2 an RL loop gives the new weights while asleep: waking the weights then
    reads nothing from disk (the given leaves are served as they are)."""
    before = tokens(llm)
    llm.sleep(level=2)
    llm.wake_up(tags=["kv_cache"])  # the pool first: the weights are still missing
    assert llm.engine.runner.kv_pages is not None and llm.engine.runner.params is None
    with pytest.raises(ValueError, match="still asleep: weights"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.update_weights(new_params)
    llm.wake_up(tags=["weights"])
    q = llm.engine.runner.params["layers"]["self_attn"]["q_proj"]["kernel"]
    assert q is new_params["layers"]["self_attn"]["q_proj"]["kernel"]
    assert not llm.is_sleeping() and tokens(llm) == expected_new
    llm.update_weights(base_model.params)
    assert tokens(llm) == before


def test_sleep_level_2_of_a_model_without_a_path(base_model, smollm2_tokenizer, new_params,
                                                 expected_new):
    llm = LLM(Model(base_model.cfg, base_model.params), tokenizer=smollm2_tokenizer,
              warmup=False, **TINY_ENGINE)
    llm.sleep(level=2)
    with pytest.raises(ValueError, match="update_weights"):
        llm.wake_up()
    llm.update_weights(new_params)
    llm.wake_up()
    assert tokens(llm) == expected_new
    with pytest.raises(ValueError, match="sleep level must be 1"):
        llm.sleep(level=3)


def test_float_weights_for_an_int8_model_are_quantized(tiny_model_dir, base_model, new_params,
                                                       smollm2_tokenizer):
    llm = LLM(tiny_model_dir, quantization="int8", warmup=False, **TINY_ENGINE)
    plan = llm.engine.model.quant
    fresh = LLM(Model(base_model.cfg, random_params(base_model.cfg, seed=7, quant=plan),
                      source="new", quant=plan),
                tokenizer=smollm2_tokenizer, quantization="int8", warmup=False, **TINY_ENGINE)
    llm.update_weights(new_params)
    assert tokens(llm) == tokens(fresh)


@pytest.mark.slow
def test_sharded_weights_update_in_place_over_a_mesh(tiny_model_dir, new_params,
                                                     expected_new):
    """Over three devices, weights already placed on the serving shardings are used as
    they are: no transfer of any kind."""
    llm = LLM(tiny_model_dir, tensor_parallel_size=3, warmup=False, **TINY_ENGINE)
    placed = llm.engine.layout.shard_params(new_params)
    with jax.transfer_guard("disallow"):
        llm.update_weights(placed)
    q = llm.engine.runner.params["layers"]["self_attn"]["q_proj"]["kernel"]
    assert q is placed["layers"]["self_attn"]["q_proj"]["kernel"]
    assert tokens(llm) == expected_new


def test_get_weights_of_the_packed_cpu_form_round_trips(tiny_model_dir, base_model):
    """The `cpu` backend serves packed panels; `get_weights` gives the standard layout back
    (the loaded weights exactly), which `update_weights` takes."""
    llm = LLM(tiny_model_dir, warmup=False, **{**TINY_ENGINE, "attention_backend": "cpu"})
    assert llm.engine.model.serving.panels
    got = llm.get_weights()
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_array_equal(a, b), got,
                           base_model.params)
    before = tokens(llm)
    llm.update_weights(jax.tree_util.tree_map(lambda x: x * 1.5, got))
    assert tokens(llm) != before
    llm.update_weights(got)
    assert tokens(llm) == before
