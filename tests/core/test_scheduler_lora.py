"""The scheduler's LoRA rules (no JAX): at most `max_loras` adapters among the running
requests, a request whose adapter would be one too many waits while the ones behind it go
first, and the adapter's id keys the request's prefix-cache pages."""

from __future__ import annotations

from jaxserve.config import SchedulerConfig
from jaxserve.core.kv_cache_manager import KVCacheManager
from jaxserve.core.prefix_cache import extra_keys_for_page, update_page_hashes
from jaxserve.core.scheduler import Scheduler
from jaxserve.lora import LoRARequest
from tests.core.scheduler_harness import HOST_PAGE_BYTES, PS, Harness, make_request, scheduled


def lora_scheduler(max_loras: int, num_pages: int = 65, budget: int = 64, **config):
    kv = KVCacheManager(num_pages, PS, enable_prefix_caching=True, watermark=0.0,
                        swap_space=0.0, bytes_per_page=HOST_PAGE_BYTES, max_model_len=64,
                        max_chunk_tokens=budget)
    return Scheduler(SchedulerConfig(**config), kv, 64, budget, max_loras=max_loras)


def with_lora(request, lora_id: int | None):
    if lora_id is not None:
        request.lora_request = LoRARequest(f"a{lora_id}", lora_id, f"/adapters/{lora_id}")
    return request


def test_a_third_adapter_waits_and_the_requests_behind_it_go_first():
    h = Harness(lora_scheduler(max_loras=2))
    h.add(with_lora(make_request("a", 4, max_tokens=6, arrival=0), 1),
          with_lora(make_request("b", 4, max_tokens=12, arrival=1), 2),
          with_lora(make_request("c", 4, max_tokens=4, arrival=2), 3),
          with_lora(make_request("d", 4, max_tokens=4, arrival=3), 1),
          make_request("e", 4, max_tokens=4, arrival=4))
    first, _ = h.step()
    assert list(scheduled(first)) == ["a", "b", "d", "e"]  # c's adapter would be a third
    seen_c = False
    while h.sched.has_unfinished_requests():
        out, _ = h.step()
        running = {r.lora_id for r in h.sched.running if r.lora_id}
        assert len(running) <= 2
        if "c" in scheduled(out):
            assert "a" not in scheduled(out) and "d" not in scheduled(out)  # adapter 1 gone
            seen_c = True
    assert seen_c


def test_without_max_loras_adapters_are_not_limited():
    h = Harness(lora_scheduler(max_loras=None))
    h.add(*(with_lora(make_request(f"r{i}", 4, arrival=i), i + 1) for i in range(5)))
    out, _ = h.step()
    assert len(scheduled(out)) == 5


def test_the_adapter_keys_the_first_page_hash():
    plain = make_request("p", 2 * PS)
    one = with_lora(make_request("p", 2 * PS), 1)
    two = with_lora(make_request("p", 2 * PS), 2)
    assert one.prompt_token_ids == plain.prompt_token_ids == two.prompt_token_ids
    assert extra_keys_for_page(one, 0) == ("lora", 1) and extra_keys_for_page(one, 1) == ()
    assert extra_keys_for_page(plain, 0) == ()
    hashes = [update_page_hashes(r, PS) for r in (plain, one, two)]
    assert len({h[0] for h in hashes}) == 3 and len({h[1] for h in hashes}) == 3
