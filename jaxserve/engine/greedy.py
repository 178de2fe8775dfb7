"""A first end-to-end generator: one request, greedy decoding over a paged KV cache.

NOTE: this is the foundation's stand-in; the continuous-batching engine replaces it. It
already uses the final contracts: a page pool with a null page 0, a block table, slot
mappings, a token-count bucket for the prefill and a donated pool in a jitted step.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from models.model import Model
from pallas_kernels import AttentionMetadata


def prefill_bucket(num_tokens: int, minimum: int = 16) -> int:
    """Smallest power of two >= num_tokens (at least `minimum`): the padded prefill size."""
    return max(minimum, 1 << (num_tokens - 1).bit_length())


class GreedyGenerator:
    """Greedy decoding of a single request through the paged model.

    Args:
        model: The loaded model.
        page_size: Slots per KV page.
        max_model_len: Longest prompt + generation this generator accepts.
    """

    def __init__(self, model: Model, page_size: int = 16, max_model_len: int = 2048):
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        self.model = model
        self.page_size = page_size
        self.max_model_len = min(max_model_len, model.cfg.max_position_embeddings)
        self._step = jax.jit(functools.partial(_step, model), donate_argnums=(1,))
        self.stats: dict[str, float] = {}

    def generate(self, prompt_ids: Sequence[int], max_tokens: int,
                 stop_token_ids: Sequence[int] = ()) -> list[int]:
        """Returns up to `max_tokens` greedily chosen ids (stopping after a stop id).

        Raises:
            ValueError: Empty prompt, non-positive `max_tokens`, ids outside the vocabulary,
                or prompt + max_tokens longer than `max_model_len`.
        """
        prompt = [int(t) for t in prompt_ids]
        vocab = self.model.cfg.vocab_size
        if not prompt:
            raise ValueError("prompt is empty: give at least one token")
        if max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, got {max_tokens}")
        if any(t < 0 or t >= vocab for t in prompt):
            raise ValueError(f"prompt token ids must lie in [0, {vocab})")
        total = len(prompt) + max_tokens
        if total > self.max_model_len:
            raise ValueError(f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) = "
                             f"{total} exceeds max_model_len {self.max_model_len}")

        num_pages = -(-total // self.page_size)
        # Page 0 is the null page; this request owns pages 1..num_pages. The table width is
        # bucketed too, so requests of similar length share compiled steps.
        width = prefill_bucket(num_pages, minimum=4)
        block_table = np.zeros((1, width), np.int32)  # i32[1, width]
        block_table[0, :num_pages] = np.arange(1, num_pages + 1)
        kv_pages = jnp.zeros(self.model.kv_pages_shape(num_pages + 1, self.page_size),
                             self.model.dtype)

        start = time.perf_counter()
        bucket = prefill_bucket(len(prompt))
        kv_pages, token = self._run(kv_pages, block_table, prompt, 0, bucket)
        out = [token]
        first = time.perf_counter()
        stops = set(stop_token_ids)
        while len(out) < max_tokens and out[-1] not in stops:
            pos = len(prompt) + len(out) - 1
            kv_pages, token = self._run(kv_pages, block_table, [out[-1]], pos, 1)
            out.append(token)
        end = time.perf_counter()
        self.stats = {"ttft_s": first - start, "decode_s": end - first,
                      "decode_tokens": len(out) - 1}
        return out

    def _run(self, kv_pages, block_table, tokens: list[int], start_pos: int, bucket: int):
        """One step over `tokens` at positions start_pos.., padded to `bucket` tokens."""
        n = len(tokens)
        ids = np.zeros(bucket, np.int32)  # i32[bucket]
        ids[:n] = tokens
        positions = np.zeros(bucket, np.int32)  # i32[bucket]
        positions[:n] = np.arange(start_pos, start_pos + n)
        pages = block_table[0, positions[:n] // self.page_size]
        slots = np.zeros(bucket, np.int32)  # i32[bucket]; padding writes to the null page
        slots[:n] = pages * self.page_size + positions[:n] % self.page_size
        md = AttentionMetadata(slot_mapping=slots, block_tables=block_table,
                               kv_lens=np.array([start_pos + n], np.int32),
                               cu_q_lens=np.array([0, n], np.int32), decode_only=bucket == 1)
        kv_pages, token = self._step(self.model.params, kv_pages, ids, positions, md,
                                     np.int32(n - 1))
        return kv_pages, int(token)


def _step(model: Model, params, kv_pages, ids, positions, md, last):
    kv_pages, hidden = model.forward(params, ids, positions, kv_pages, md)
    logits = model.compute_logits(params, hidden[last][None])  # f32[1, vocab]
    return kv_pages, jnp.argmax(logits[0]).astype(jnp.int32)
