"""`LLM`'s pooling methods in vLLM's shape (`embed`, `classify`, `score`, `encode`, `reward`),
over the engine's pooling requests (`jaxserve.engine.pooling`)."""

from __future__ import annotations

from collections.abc import Sequence

from jaxserve.engine.scoring import (
    check_truncation,
    cosine_scores,
    score_pairs,
    score_prompt,
    truncated,
)
from jaxserve.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    ScoringRequestOutput,
)
from jaxserve.pooling_params import PoolingParams

# `LLM.encode`'s pooling tasks: a sequence's vector ("embed") or class values ("classify").
# vLLM's per-token tasks ("token_embed", "token_classify") are not built.
ENCODE_TASKS = ("embed", "classify")


def as_prompt_list(prompts) -> list:
    """One prompt (text, ids, dict) or a list of them, as a list."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # a single prompt given as token ids
    return prompts


def as_pooling_output(out) -> PoolingRequestOutput:
    """An embedding's or a classification's output as a `PoolingRequestOutput` (its
    vector or class values in `outputs.data`; empty when the request failed)."""
    inner = out.outputs
    data = getattr(inner, "embedding", None) if isinstance(out, EmbeddingRequestOutput) \
        else getattr(inner, "probs", None)
    return PoolingRequestOutput(out.request_id, PoolingOutput(list(data or [])),
                                out.prompt_token_ids, out.finished, out.metrics, out.error)


class LLMPooling:
    """The pooling runner's methods of `jaxserve.LLM` (which provides `engine`,
    `get_tokenizer`, `_run` and the request counter)."""

    def embed(self, prompts, pooling_params: PoolingParams | Sequence[PoolingParams]
              | None = None, *, truncate_prompt_tokens: int | None = None,
              use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """Embeds every prompt (an engine built with `runner="pooling"`); returns the
        outputs in the prompts' order, each `.outputs.embedding` a list of floats.

        Args:
            prompts: A prompt or a list of prompts; each text, token ids, or
                `{"prompt_token_ids": [...]}`.
            pooling_params: One for all prompts, or one per prompt (default:
                `PoolingParams()`: the pooler's `dimensions` and `normalize`).
            truncate_prompt_tokens: Keep this many tokens of each prompt (a text cut by
                its tokenizer, token ids to their last ones; -1: the longest the engine
                takes); None: a prompt over `max_model_len` is refused, never cut.
            use_tqdm: Show a progress bar.

        Raises:
            ValueError: A generate engine, a classifier, a bad prompt, bad `dimensions` or
                `truncate_prompt_tokens` (no request of the batch is left queued).
        """
        return self._pool(prompts, pooling_params, "embed", "embd", truncate_prompt_tokens,
                          use_tqdm)

    def classify(self, prompts, pooling_params: PoolingParams | Sequence[PoolingParams]
                 | None = None, *, truncate_prompt_tokens: int | None = None,
                 use_tqdm: bool = True) -> list[ClassificationRequestOutput]:
        """Classifies every prompt with a sequence classifier (`BertForSequenceClassification`,
        `XLMRobertaForSequenceClassification`); each output's `.outputs.probs` holds the
        class probabilities (`jaxserve.pooling_params.ClassifierHead.activate`; the raw
        logits with `PoolingParams(task="classify", use_activation=False)`).

        Args:
            prompts: As `embed`'s.
            pooling_params: One for all prompts or one per prompt (task "classify").
            truncate_prompt_tokens: As `embed`'s.
            use_tqdm: Show a progress bar.

        Raises:
            ValueError: A generate engine, a model without a classification head, a bad
                prompt or `truncate_prompt_tokens`.
        """
        return self._pool(prompts, pooling_params, "classify", "classify",
                          truncate_prompt_tokens, use_tqdm)

    def score(self, data_1, data_2, *, truncate_prompt_tokens: int | None = None,
              use_tqdm: bool = True) -> list[ScoringRequestOutput]:
        """Scores text pairs as vLLM's `LLM.score`: `data_1` one text (against each of
        `data_2`) or as many texts as `data_2` (pairwise). A cross-encoder (a classifier of
        one class) reads each pair packed as one prompt (`jaxserve.engine.scoring.score_prompt`:
        the pair encoding, or an LLM reranker's two texts concatenated)
        and scores it by its activation; an embedding model scores the cosine of the two
        texts' embeddings. Each output's `.outputs.score` is a float.

        Raises:
            ValueError: Bad pairs (`score_pairs`), a classifier of several classes, a text
                holding the separator token, or a bad `truncate_prompt_tokens`.
        """
        pairs = score_pairs(data_1, data_2)
        keep = check_truncation(truncate_prompt_tokens, self.engine.limits.max_model_len)
        pooler = self.engine.pooler
        if pooler is None or pooler.head is None:
            firsts, seconds = [a for a, _ in pairs], [b for _, b in pairs]
            one = all(a is firsts[0] for a in firsts)  # 1 to N: the first text embedded once
            outs = self.embed(firsts[:1] + seconds if one else firsts + seconds,
                              truncate_prompt_tokens=truncate_prompt_tokens, use_tqdm=use_tqdm)
            left = outs[:1] * len(pairs) if one else outs[:len(pairs)]
            return cosine_scores(list(zip(left, outs[-len(pairs):], strict=True)))
        prompts = [score_prompt(self.get_tokenizer(), self.engine.model, a, b, keep)
                   for a, b in pairs]
        return self._pool(prompts, PoolingParams(task="score"), "score", "score", None,
                          use_tqdm)

    def encode(self, prompts, pooling_params: PoolingParams | Sequence[PoolingParams]
               | None = None, *, pooling_task: str | None = None,
               truncate_prompt_tokens: int | None = None, use_tqdm: bool = True
               ) -> list[PoolingRequestOutput]:
        """vLLM's `LLM.encode`: each prompt's pooled values as a `PoolingRequestOutput`
        (`.outputs.data`): an embedding (`pooling_task="embed"`, as `embed`) or a
        classifier's class values ("classify", as `classify`).

        Raises:
            ValueError: No `pooling_task` (vLLM asks for one), a task not in `ENCODE_TASKS`
                (the per-token tasks are not built) or one the model does not serve, and
                `embed`'s or `classify`'s errors.
        """
        if pooling_task is None:
            raise ValueError(f"pooling_task: LLM.encode needs one of {ENCODE_TASKS} (or use "
                             "LLM.embed / LLM.classify)")
        if pooling_task not in ENCODE_TASKS:
            raise ValueError(f"pooling_task={pooling_task!r}: one of {ENCODE_TASKS} (per-token "
                             "pooling, token_embed and token_classify, is not built)")
        outs = self._pool(prompts, pooling_params, pooling_task,
                          "embd" if pooling_task == "embed" else "classify",
                          truncate_prompt_tokens, use_tqdm)
        return [as_pooling_output(out) for out in outs]

    def reward(self, prompts, *, truncate_prompt_tokens: int | None = None,
               use_tqdm: bool = True) -> list[PoolingRequestOutput]:
        """A reward model's rewards (a `*ForSequenceClassification` of one class, such as
        Skywork-Reward): each prompt's raw class logits at its last token, no activation (as
        vLLM's reward models), in `.outputs.data`. vLLM's per-token rewards (ALL pooling,
        process reward models) are not built.

        Raises:
            ValueError: A model without a classification head, `classify`'s errors.
        """
        return self.encode(prompts, PoolingParams(task="classify", use_activation=False),
                           pooling_task="classify",
                           truncate_prompt_tokens=truncate_prompt_tokens, use_tqdm=use_tqdm)

    def _pool(self, prompts, pooling_params, task: str, prefix: str, truncate_prompt_tokens,
              use_tqdm: bool) -> list:
        """Adds each prompt as a pooling request of `task` (ids `{prefix}-N`) and runs them."""
        prompts = as_prompt_list(prompts)
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            params = [pooling_params or PoolingParams(task=task)] * len(prompts)
        else:
            params = list(pooling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} pooling_params for {len(prompts)} prompts")
        bad = [p.task for p in params if isinstance(p, PoolingParams) and p.task != task]
        if bad:
            raise ValueError(f"pooling_params: task={bad[0]!r} given to LLM.{task}")
        keep = check_truncation(truncate_prompt_tokens, self.engine.limits.max_model_len)
        prompts = [truncated(self.get_tokenizer(), p, keep) for p in prompts]
        ids = []
        try:
            for prompt, pp in zip(prompts, params, strict=True):
                ids.append(f"{prefix}-{self._counter}")
                self._counter += 1
                self.engine.add_request(ids[-1], prompt, pp)
        except BaseException:
            self.engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm)

