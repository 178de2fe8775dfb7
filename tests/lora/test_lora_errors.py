"""Bad adapters and bad LoRA settings are ValueErrors naming the problem (vLLM's wording and,
for a path with no adapter, vLLM's `LoRAAdapterNotFoundError`), and the requests already
running keep running with their own adapters; adapters also serve over the `cpu` backend's
packed weights and over an int8 base."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.lora import LoRAAdapterNotFoundError, LoRARequest
from tests.conftest import TINY_ENGINE
from tests.lora.adapters import hf_greedy, load_hf, make_adapters, write_adapter

pytest.importorskip("peft")

PROMPT = "The capital of France is"
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def base(tiny_model_dir):
    return load_hf(tiny_model_dir)


@pytest.fixture(scope="module")
def good(base, tmp_path_factory):
    return make_adapters(base, str(tmp_path_factory.mktemp("good")),
                         {"qv": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])})["qv"]


@pytest.fixture(scope="module")
def bad_dirs(base, good, tmp_path_factory):
    """name -> (adapter directory, a phrase its error must hold)."""
    root = tmp_path_factory.mktemp("bad")
    out = {}
    missing = root / "missing-weights"
    shutil.copytree(good.path, missing)
    os.remove(missing / "adapter_model.safetensors")
    out["missing file"] = (str(missing), "has no adapter_model.safetensors")
    not_peft = root / "not-peft"
    not_peft.mkdir()
    (not_peft / "config.json").write_text("{}")
    out["not a PEFT dir"] = (str(not_peft), f"Loading lora bad failed: No adapter found for "
                                            f"{not_peft}")
    high = root / "rank-32"
    write_adapter(base, str(high), seed=3, r=32, lora_alpha=32, target_modules=["q_proj"])
    out["rank above max"] = (str(high), "LoRA rank 32 is greater than max_lora_rank 16.")
    head = root / "lm-head"
    write_adapter(base, str(head), seed=4, r=4, lora_alpha=8, target_modules=["lm_head"])
    out["module the layers lack"] = (str(head), "lm_head")
    shapes = root / "bad-shapes"
    shutil.copytree(good.path, shapes)
    _shrink_a_tensor(shapes / "adapter_model.safetensors")
    out["shapes that do not fit"] = (str(shapes), "do not fit the base")
    # vLLM's config refusals (its test_lora_adapters cases): the config's `r` counts even
    # though the tensors are rank 4.
    for case, change, phrase in (
            ("DoRA", {"use_dora": True}, "does not yet support DoRA"),
            ("config rank above max", {"r": 1024}, "is greater than max_lora_rank"),
            ("bias", {"bias": "all"}, "Adapter bias cannot be used without bias_enabled"),
            ("modules_to_save", {"modules_to_save": ["lm_head"]},
             "only supports modules_to_save being None")):
        edited = root / case.replace(" ", "-")
        shutil.copytree(good.path, edited)
        cfg = json.loads((edited / "adapter_config.json").read_text())
        (edited / "adapter_config.json").write_text(json.dumps({**cfg, **change}))
        out[case] = (str(edited), phrase)
    out["no such path"] = (str(root / "nowhere"), "Loading lora bad failed: No adapter found "
                                                  f"for {root / 'nowhere'}")
    out["a file"] = (str(root / "not-peft" / "config.json"), "is not a directory")
    return out


def _shrink_a_tensor(path):
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(path))
    name = next(k for k in tensors if "lora_A" in k)
    tensors[name] = tensors[name][:, :-1]  # [r, in - 1]
    save_file(tensors, str(path))


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(tiny_model_dir, enable_lora=True, max_loras=2, max_lora_rank=16,
               warmup=False, **TINY_ENGINE)


NOT_FOUND = ("not a PEFT dir", "no such path")  # vLLM's LoRAAdapterNotFoundError


@pytest.mark.parametrize("case", ["missing file", "not a PEFT dir", "rank above max",
                                  "module the layers lack", "shapes that do not fit", "DoRA",
                                  "config rank above max", "bias", "modules_to_save",
                                  "no such path", "a file"])
def test_a_bad_adapter_fails_its_request_only(llm, good, bad_dirs, base, smollm2_tokenizer,
                                              case):
    """The bad adapter's request is refused at add time with the problem named; a request
    already running with a good adapter finishes with its merged model's tokens."""
    engine = llm.engine
    engine.add_request("running", PROMPT, GREEDY, lora_request=good.request())
    engine.step()
    path, phrase = bad_dirs[case]
    error = LoRAAdapterNotFoundError if case in NOT_FOUND else ValueError
    with pytest.raises(error, match=re.escape(phrase)) as raised:
        engine.add_request("bad", PROMPT, GREEDY, lora_request=LoRARequest("bad", 99, path))
    assert isinstance(raised.value, LoRAAdapterNotFoundError) == (case in NOT_FOUND)
    assert "bad" not in engine.states and 99 not in engine.list_loras()
    tokens = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens = list(out.outputs[0].token_ids)
    assert tokens == hf_greedy(good.merged, smollm2_tokenizer, PROMPT, 6)
    assert engine.kv.usage == 0


def test_generate_with_a_bad_adapter_leaves_nothing_queued(llm, good, bad_dirs):
    path, _ = bad_dirs["rank above max"]
    with pytest.raises(ValueError, match="rank 32"):
        llm.generate([PROMPT, PROMPT], GREEDY, use_tqdm=False,
                     lora_request=[good.request(), LoRARequest("high", 98, path)])
    assert not llm.engine.has_unfinished_requests()


def test_lora_settings_and_requests_are_checked(tiny_model_dir, llm, good):
    with pytest.raises(ValueError, match="max_cpu_loras"):
        LLM(tiny_model_dir, enable_lora=True, max_loras=4, max_cpu_loras=2)
    with pytest.raises(ValueError, match="max_lora_rank"):
        LLM(tiny_model_dir, enable_lora=True, max_lora_rank=0)
    with pytest.raises(ValueError, match="lora_int_id must be a positive integer"):
        LoRARequest("x", 0, good.path)
    with pytest.raises(ValueError, match="lora_request must be a LoRARequest"):
        llm.generate(PROMPT, GREEDY, use_tqdm=False, lora_request="qv")
    with pytest.raises(ValueError, match="already loaded from"):
        llm.generate(PROMPT, GREEDY, use_tqdm=False,
                     lora_request=LoRARequest("other", good.lora_int_id, good.path + "/.."))
    with pytest.raises(ValueError, match="got 1 lora_requests for 2 prompts"):
        llm.generate([PROMPT, PROMPT], GREEDY, use_tqdm=False, lora_request=[good.request()])
    assert not llm.engine.has_unfinished_requests()


def test_lora_request_without_enable_lora_is_refused(tiny_model_dir, good):
    plain = LLM(tiny_model_dir, warmup=False, **TINY_ENGINE)
    with pytest.raises(ValueError, match="enable_lora=True"):
        plain.generate(PROMPT, GREEDY, use_tqdm=False, lora_request=good.request())
    assert not plain.engine.has_unfinished_requests()


def test_packed_cpu_weights_serve_adapters(tiny_model_dir, good, smollm2_tokenizer):
    """The default backend on this CPU packs the float weights for its matmul kernel; the
    adapters' updates add to the packed projections' outputs all the same."""
    llm = LLM(tiny_model_dir, enable_lora=True, warmup=False,
              **{**TINY_ENGINE, "attention_backend": "cpu"})
    assert llm.engine.model.serving.panels
    out = llm.generate([PROMPT, PROMPT], GREEDY, use_tqdm=False,
                       lora_request=[good.request(), None])
    assert list(out[0].outputs[0].token_ids) == hf_greedy(good.merged, smollm2_tokenizer,
                                                          PROMPT, 6)


def test_an_int8_base_serves_adapters_in_the_compute_dtype(tiny_model_dir, good, base,
                                                            smollm2_tokenizer):
    """Over int8 base weights the adapters stay float32 (the compute dtype) and add to the
    quantized projections: on this prompt the int8 error moves no greedy token, so each
    request's tokens equal its float merged model's."""
    llm = LLM(tiny_model_dir, enable_lora=True, quantization="int8", warmup=False,
              **TINY_ENGINE)
    stacks = llm.engine.runner.lora.stacks["layers"]
    assert stacks["self_attn"]["q_proj"]["a"].dtype == "float32"
    assert llm.engine.model.quant.name == "int8"
    out = llm.generate([PROMPT, PROMPT], GREEDY, use_tqdm=False,
                       lora_request=[good.request(), None])
    got = [list(o.outputs[0].token_ids) for o in out]
    want = [hf_greedy(m, smollm2_tokenizer, PROMPT, 6) for m in (good.merged, base)]
    assert got == want
