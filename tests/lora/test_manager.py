"""`LoRAManager`: the host LRU of loaded adapters and the slot assignment of each step (kept
slots stay, new adapters take the least recently used free slot), and its errors."""

from __future__ import annotations

import pytest

from jaxserve.bench.lora_adapters import write_random_adapter
from jaxserve.config import LoRAConfig
from jaxserve.lora import LoRARequest
from jaxserve.lora.manager import LoRAManager
from models.config import ArchConfig

CFG = ArchConfig(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=16,
                 intermediate_size=24, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8)


@pytest.fixture(scope="module")
def loras(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return [LoRARequest(f"a{i}", i, write_random_adapter(str(root / f"a{i}"), CFG, rank=4,
                                                         seed=i)) for i in range(1, 6)]


def test_slots_stay_and_new_adapters_take_the_least_recently_used(loras):
    m = LoRAManager(LoRAConfig(enable_lora=True, max_loras=2, max_lora_rank=8), CFG)
    a1, a2, a3, *_ = loras
    slot_of, writes = m.assign([a1, a2, a1])
    assert slot_of == {1: 0, 2: 1} and [s for s, _ in writes] == [0, 1]
    slot_of, writes = m.assign([a2])
    assert slot_of == {2: 1} and writes == []  # kept: nothing written
    slot_of, writes = m.assign([a2, a3])  # slot 0 (adapter 1) is the one to reuse
    assert slot_of == {2: 1, 3: 0} and [s for s, _ in writes] == [0]
    assert m.slots == [3, 2]
    with pytest.raises(ValueError, match="a step runs 3 LoRA adapters; max_loras is 2"):
        m.assign([a1, a2, a3])


def test_the_host_lru_evicts_and_reloads_from_the_path(loras):
    m = LoRAManager(LoRAConfig(enable_lora=True, max_loras=2, max_cpu_loras=3,
                               max_lora_rank=8), CFG)
    for lora in loras[:4]:
        m.add(lora)
    assert m.loaded_ids == [2, 3, 4] and m.num_loads == 4
    m.add(loras[1])  # a hit moves it to the back
    assert m.loaded_ids == [3, 4, 2] and m.num_loads == 4
    m.assign([loras[0]])  # evicted: read again
    assert m.num_loads == 5 and m.loaded_ids == [4, 2, 1]


def test_remove_empties_the_slot_and_an_id_is_one_adapter(loras):
    m = LoRAManager(LoRAConfig(enable_lora=True, max_loras=2, max_lora_rank=8), CFG)
    m.assign([loras[0]])
    with pytest.raises(ValueError, match="already loaded from"):
        m.add(LoRARequest("other", 1, loras[1].lora_path))
    assert m.remove(1) and not m.remove(1)
    assert m.slots == [0, 0]
    slot_of, writes = m.assign([LoRARequest("other", 1, loras[1].lora_path)])
    assert len(writes) == 1  # the new weights are written, not the old slot reused


def test_targets_a_mixture_of_experts_does_not_adapt_are_refused(loras, tmp_path):
    import dataclasses

    moe = dataclasses.replace(CFG, architecture="Qwen3MoeForCausalLM", num_experts=4,
                              num_experts_per_tok=2, moe_intermediate_size=24)
    m = LoRAManager(LoRAConfig(enable_lora=True, max_lora_rank=8), moe)
    with pytest.raises(ValueError, match="targets gate_proj, up_proj, down_proj, which this "
                                         "model does not adapt"):
        m.add(loras[0])  # written for the dense model: MLP targets too
    with pytest.raises(ValueError, match="must be a LoRARequest"):
        m.add("a1")
