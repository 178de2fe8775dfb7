"""Draft-model proposals: a smaller model with the target's vocabulary, its own page pool.

Before each step the draft catches up on the tokens each decoding request gained since it
last ran (the accepted proposals and the token after them; a whole prompt the first time),
then runs k - 1 more single-token steps, each taking its own argmax, in one jitted
program (a `fori_loop`, one compile per row bucket): k greedy proposals.
Greedy proposals are one-hot drafts, so the engine verifies them like n-gram ones (see
`speculator`): the output distribution is the target's whatever the draft's quality.

The draft's KV lives in its own pool (its layers and heads differ from the target's) with
its own page allocator, always as one KV cache group (the draft's steps are built here,
with one block table per request, whatever groups a hybrid target's pool has): a
request's draft pages hold the KV of its first `num_computed` tokens and are freed when
the request finishes. Tokens never change once known, so the draft's KV stays valid
across preemption (recompute or swap) of the target; the positions proposals were
written at are simply written again by the next catch-up.
The draft's catch-up runs through a `ModelRunner` of its own (the same buckets, warm-up
and compile counting as the target); its k - 1 single-token steps are one more program
per row bucket, compiled at warm-up too.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import SpeculativeConfig
from jaxserve.core.kv_page import KVPage
from jaxserve.core.page_pool import PagePool
from jaxserve.core.scheduler_output import ScheduledRequest, SchedulerOutput
from jaxserve.request import Request
from jaxserve.runner import compile_counter
from jaxserve.runner.buckets import pick_bucket
from jaxserve.runner.model_runner import ModelRunner
from jaxserve.sample.metadata import RowSpec, build_sampling_metadata
from jaxserve.sample.rowwise import argmax_rows
from jaxserve.sampling_params import SamplingParams
from jaxserve.spec_decode.speculator import Speculator
from jaxserve.utils import cdiv
from models.kv_groups import single_group
from pallas_kernels import AttentionMetadata

_GREEDY = SamplingParams(temperature=0.0)


def truncate_layers(model, num_layers: int):
    """A copy of `model` that keeps only its first `num_layers` decoder layers (same
    embeddings, final norm and LM head, the same weight form): a cheap draft for a
    benchmark or a test.

    Raises:
        ValueError: `num_layers` not in [1, the model's layers], or a model with
            linear-attention layers.
    """
    from models.mixed import first_layers
    from models.model import Model

    if not 1 <= num_layers <= model.cfg.num_layers:
        raise ValueError(f"num_layers must be in [1, {model.cfg.num_layers}], got {num_layers}")
    if model.cfg.has_linear_attention:  # NOTE: its mixer stacks would need cutting by kind
        raise ValueError(f"a truncated draft of {model.cfg.architecture} (linear_layers="
                         f"{list(model.cfg.linear_layers)}) is not built")
    if model.cfg.is_mixed:  # sparse and dense MLP stacks of their own lengths
        cfg, params = first_layers(model.cfg, model.params, num_layers)
    else:
        cfg = dataclasses.replace(model.cfg, num_layers=num_layers,
                                  layer_windows=model.cfg.layer_windows[:num_layers])
        params = _first_layers(model.params, num_layers)
    return Model(cfg, params, model.dtype, f"{model.source} (first {num_layers} layers)",
                 quant=model.quant, serving=model.serving)


def _first_layers(tree: dict, num_layers: int) -> dict:
    """`tree` with every stack of layer weights (a "layers" entry, in whichever variable
    collection) cut to its first `num_layers`."""
    return {k: jax.tree_util.tree_map(lambda x: x[:num_layers], v) if k == "layers"
            else _first_layers(v, num_layers) if isinstance(v, dict) else v
            for k, v in tree.items()}


def _propose_loop(model, num_steps: int, page_size: int, params, kv_pages, ids, positions,
                  tables, num_real):
    """`num_steps` greedy single-token steps of the draft, in one program.

    Args:
        ids: i32[R] each row's latest token (rows past `num_real` are padding).
        positions: i32[R] its position.
        tables: i32[R, max_pages_per_seq] the rows' draft block tables.
        num_real: i32[] real rows (the first ones).

    Returns:
        (kv_pages, i32[R, num_steps] the argmax after each step).
    """
    num_rows = ids.shape[0]
    rows = jnp.arange(num_rows, dtype=jnp.int32)  # i32[R]
    real = rows < num_real  # bool[R]
    cu_q_lens = jnp.minimum(jnp.arange(num_rows + 1, dtype=jnp.int32), num_real)  # i32[R+1]

    def step(j, carry):
        kv_pages, ids, out = carry
        pos = jnp.where(real, positions + j, 0)  # i32[R]
        page = tables[rows, pos // page_size]  # i32[R]
        md = AttentionMetadata(jnp.where(real, page * page_size + pos % page_size, 0), tables,
                               jnp.where(real, pos + 1, 0), cu_q_lens)
        kv_pages, hidden = model.forward(params, ids, pos, kv_pages, md)
        nxt = argmax_rows(model.compute_logits(params, hidden))  # i32[R]
        return kv_pages, nxt, out.at[:, j].set(nxt)

    out = jnp.zeros((num_rows, num_steps), jnp.int32)  # i32[R, num_steps]
    kv_pages, _, out = jax.lax.fori_loop(0, num_steps, step, (kv_pages, ids, out))
    return kv_pages, out


@dataclasses.dataclass
class _DraftSeq:
    """One request's state in the draft pool."""

    request: Request
    pages: list[KVPage]
    num_computed: int = 0  # leading tokens whose draft KV is in `pages`


class DraftModelSpeculator(Speculator):
    """Proposes with a draft model (see the module docstring).

    Args:
        config: `SpeculativeConfig` of method "draft_model" (`model`: path or `Model`).
        vocab_size: The target's vocabulary size (the draft's must equal it).
        dtype: Dtype to load a draft given by path in.
        backend: Attention backend of the draft.
        num_pages, page_size, max_model_len, max_num_seqs, max_num_batched_tokens: Sizes
            of the draft's pool and runner (the target's).
        target_params: The target's parameter count (the draft's relative cost, for the
            gate that pauses proposals while they do not pay).

    Raises:
        ValueError: The draft's vocabulary differs from the target's.
    """

    own_device_calls = True  # the draft's catch-up and proposal programs

    def __init__(self, config: SpeculativeConfig, *, vocab_size: int, dtype: str = "float32",
                 backend: str = "auto", num_pages: int, page_size: int, max_model_len: int,
                 max_num_seqs: int, max_num_batched_tokens: int, target_params: int = 0):
        draft = config.model
        if isinstance(draft, str):
            from models.linear import ServingChoice
            from models.loaders import load_model

            draft = load_model(draft, dtype, serving=ServingChoice(backend))
        if draft.cfg.vocab_size != vocab_size:
            raise ValueError(f"speculative_config.model: the draft's vocabulary has "
                             f"{draft.cfg.vocab_size} tokens, the target's {vocab_size}")
        super().__init__(config, draft_cost=min(1.0, draft.weight_bytes / target_params)
                         if target_params else 1.0)
        self.page_size = page_size
        self.max_model_len = max_model_len
        # NOTE: catch-up steps are requests of a few tokens each (short query tiles). One KV
        # cache group: the steps built here carry one block table per request.
        self.runner = ModelRunner(draft, num_pages, page_size, max_model_len, max_num_seqs,
                                  max_num_batched_tokens, short_tiles=True,
                                  kv_layout=single_group(draft.cfg.num_layers))
        self.model = self.runner.model
        self.pool = PagePool(num_pages, enable_caching=False)
        self.seqs: dict[str, _DraftSeq] = {}
        self.max_tokens_per_call = self.runner.buckets[-1]
        self.max_rows = max_num_seqs
        # Row buckets of the k - 1 step program (one compile each).
        self.row_buckets = [b for b in self.runner.buckets if b < max_num_seqs]
        self.row_buckets.append(pick_bucket(self.runner.buckets, max_num_seqs))
        self._loops: dict[int, object] = {}

    def warmup(self, make_dummy_sampling) -> float:
        seconds = self.runner.warmup(make_dummy_sampling)
        start = time.perf_counter()
        if self.k > 1:
            for num_rows in self.row_buckets:
                jax.block_until_ready(self._loop_call(num_rows, [], [], []))
        self.runner.num_compilations = 0
        return seconds + time.perf_counter() - start

    @property
    def num_compilations(self) -> int:
        return self.runner.num_compilations

    # ------------------------------------------------------------ propose
    def propose(self, requests: Iterable[Request]) -> dict[str, list[int]]:
        self._release_finished()
        seqs = [seq for request in requests if self.wants_proposals(request)
                and (seq := self._reserve(request)) is not None]
        if not seqs:
            return {}
        first = self._catch_up(seqs)  # {request_id: first proposal}
        firsts = [first[seq.request.request_id] for seq in seqs]
        rest = np.zeros((len(seqs), 0), np.int32)
        if self.k > 1:
            num_rows = pick_bucket(self.row_buckets, len(seqs))
            start = compile_counter.num_compilations()
            rest = np.asarray(self._loop_call(
                num_rows, firsts, [seq.request.num_tokens for seq in seqs],
                [[p.page_id for p in seq.pages] for seq in seqs]))[:len(seqs)]
            self.runner.num_compilations += compile_counter.num_compilations() - start
        return {seq.request.request_id: [token, *more.tolist()]
                for seq, token, more in zip(seqs, firsts, rest, strict=True)}

    def _loop_call(self, num_rows: int, ids, positions, tables) -> jax.Array:
        """Runs the k - 1 step program on `len(ids)` rows padded to `num_rows`; returns the
        device array i32[num_rows, k - 1] (the pool is updated in place)."""
        n, width = len(ids), self.runner.max_pages_per_seq
        ids_a = np.zeros(num_rows, np.int32)  # i32[R]
        ids_a[:n] = ids
        pos_a = np.zeros(num_rows, np.int32)  # i32[R]
        pos_a[:n] = positions
        tables_a = np.zeros((num_rows, width), np.int32)  # i32[R, max_pages_per_seq]
        for i, table in enumerate(tables):
            tables_a[i, :len(table)] = table
        fn = self._loops.get(num_rows)
        if fn is None:
            fn = self._loops[num_rows] = jax.jit(functools.partial(
                _propose_loop, self.model, self.k - 1, self.page_size), donate_argnums=1)
        self.runner.kv_pages, out = fn(self.model.params, self.runner.kv_pages, ids_a, pos_a,
                                       tables_a, np.int32(n))
        return out

    def _release_finished(self) -> None:
        for req_id in [i for i, s in self.seqs.items() if s.request.is_finished()]:
            self._free(req_id)

    def _free(self, req_id: str) -> None:
        seq = self.seqs.pop(req_id)
        self.pool.free_pages(reversed(seq.pages))

    def _reserve(self, request: Request) -> _DraftSeq | None:
        """The request's draft state with pages for its tokens and k - 1 proposals; None
        when the draft pool is out of pages or the proposals would pass max_model_len."""
        seq = self.seqs.get(request.request_id)
        if seq is not None and seq.request is not request:  # the id was reused
            self._free(request.request_id)
            seq = None
        if seq is None:
            seq = self.seqs[request.request_id] = _DraftSeq(request, [])
        length = request.num_tokens + self.k - 1
        if length > self.max_model_len:
            return None
        need = cdiv(length, self.page_size) - len(seq.pages)
        if need > self.pool.num_allocatable_pages:
            return None
        if need > 0:
            seq.pages.extend(self.pool.get_new_pages(need))
        return seq

    def _catch_up(self, seqs: list[_DraftSeq]) -> dict[str, int]:
        """Computes each request's missing draft KV, in steps of at most a bucket of
        tokens and `max_rows` requests; returns the draft's argmax after each last token."""
        first: dict[str, int] = {}
        todo = list(seqs)
        while todo:
            budget, entries, rest = self.max_tokens_per_call, [], []
            for seq in todo:
                request = seq.request
                # NOTE: at least the last token is recomputed: its logits make proposal 1.
                start = min(seq.num_computed, request.num_tokens - 1)
                n = min(request.num_tokens - start, budget)
                if n <= 0 or len(entries) == self.max_rows:
                    rest.append(seq)
                    continue
                done = start + n == request.num_tokens
                entries.append(ScheduledRequest(
                    request.request_id, request.all_token_ids[start:start + n], start,
                    [p.page_id for p in seq.pages], int(done)))
                budget -= n
                seq.num_computed = start + n
                if not done:
                    rest.append(seq)
            first.update(self._run(SchedulerOutput(scheduled=entries)))
            todo = rest
        return first

    def _run(self, out: SchedulerOutput) -> dict[str, int]:
        """One draft step: `{request_id: argmax}` of the entries that sample."""
        out.decodes_first()
        num_rows = self.runner.step_shape(out)[1]
        rows = [RowSpec(_GREEDY, (), (), 0, 0)] * sum(s.num_samples for s in out.scheduled)
        sampling = build_sampling_metadata(rows, num_rows, self.model.cfg.vocab_size)
        result = self.runner.execute(out, sampling)
        return {req_id: int(t) for req_id, t in zip(result.row_request_ids, result.token_ids,
                                                   strict=True)}
