"""Input processing: a prompt and its sampling parameters to a validated, tokenized request.

Everything a request brings is checked here, when it is added (a `ValueError` naming the
field), so nothing invalid reaches a step that other requests share.
"""

from __future__ import annotations

import dataclasses
import operator

import numpy as np

from jaxserve.engine.output_processor import RequestState
from jaxserve.request import Request
from jaxserve.sample.metadata import MAX_BANNED_TOKEN_IDS, RowSpec, build_sampling_metadata
from jaxserve.sampling_params import SamplingParams, check_num_logprobs, device_seed
from jaxserve.structured import GrammarCompiler


class InputProcessor:
    """Validates and tokenizes new requests for one engine.

    Args:
        tokenizer: The model's tokenizer.
        vocab_size: The model's vocabulary size (token ids must lie below it).
        max_model_len: Longest prompt + output.
        max_num_seqs: Most sequences in a step (bounds `n`).
        eos_token_ids: The model's and tokenizer's EOS ids (the first is the sampler's).
        seed: Seed of the stream that seeds requests given without one.
        max_logprobs: Most `logprobs` / `prompt_logprobs` a request may ask for (-1: the
            whole vocabulary), the engine argument.
        images: How the model takes images (`jaxserve.multimodal.support.ImageSupport`);
            None: prompts with `multi_modal_data` are refused.
    """

    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, max_num_seqs: int,
                 eos_token_ids: tuple[int, ...], seed: int = 0,
                 max_logprobs: int = SamplingParams.MAX_LOGPROBS, images=None):
        self.images = images
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_logprobs = max_logprobs
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.eos_token_ids = eos_token_ids
        self.rng = np.random.default_rng(seed)
        # Structured-output grammars (llguidance's tokenizer is built on first use).
        self.grammars = GrammarCompiler(tokenizer, vocab_size)

    def tokenize(self, prompt) -> tuple[str | None, list[int]]:
        """(text, ids) of a prompt given as text, a list of ids or {"prompt_token_ids": [...]}.

        Raises:
            ValueError: Empty prompt, ids outside the vocabulary, or an unsupported type.
        """
        vocab = self.vocab_size
        text = None
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer(prompt).input_ids
        elif isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids, text = prompt["prompt_token_ids"], prompt.get("prompt")
            elif "prompt" in prompt:
                return self.tokenize(prompt["prompt"])
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids', got keys "
                                 f"{sorted(prompt)}")
        elif isinstance(prompt, (list, tuple, np.ndarray)):
            ids = prompt
        else:
            raise ValueError(f"prompt must be a string, token ids or a dict, got "
                             f"{type(prompt).__name__}")
        if text is not None and not isinstance(text, str):
            raise ValueError(f"prompt must be a string, got {type(text).__name__}")
        try:
            ids = [operator.index(t) for t in ids]
        except TypeError:
            raise ValueError("prompt: prompt_token_ids must be a list of integers") from None
        if not ids:
            raise ValueError("prompt is empty: it must hold at least one token")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt: prompt_token_ids hold ids outside [0, {vocab}): {bad[:5]}")
        return text, ids

    def process(self, request_id: str, prompt, params: SamplingParams, *, priority: int = 0,
                cache_salt: str | None = None, arrival_time: float | None = None,
                lora_request=None) -> RequestState:
        """Validates and tokenizes a new request; returns its state (root request inside).

        Raises:
            ValueError: Anything wrong with the request, naming the field.
        """
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got "
                             f"{type(params).__name__}")
        # NOTE: a validated copy: fields set after construction are checked again here, at
        # add time, so nothing invalid reaches a step that other requests share.
        params = self.check_logprobs(params.clone())
        if isinstance(priority, bool) or not isinstance(priority, int) \
                or not -2**63 <= priority < 2**63:
            raise ValueError(f"priority must be a 64-bit integer, got {priority!r}")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError(f"cache_salt must be a string, got {type(cache_salt).__name__}")
        vocab = self.vocab_size
        for name, ids_ in (("stop_token_ids", params.stop_token_ids),
                           ("logit_bias", list(params.logit_bias or ())),
                           ("allowed_token_ids", params.allowed_token_ids or ())):
            bad = [t for t in ids_ if t >= vocab]
            if bad:
                raise ValueError(f"{name} hold ids outside [0, {vocab}): {bad[:5]}")
        items = ()
        if isinstance(prompt, dict) and prompt.get("multi_modal_data") is not None:
            text, ids, items = self.tokenize_images(prompt)
        else:
            text, ids = self.tokenize(prompt)
        max_len = self.max_model_len
        if len(ids) >= max_len:
            raise ValueError(f"prompt has {len(ids)} tokens; max_model_len is {max_len}, which "
                             "leaves no room to generate")
        if params.n > self.max_num_seqs:
            raise ValueError(f"n={params.n} exceeds max_num_seqs={self.max_num_seqs}")
        if params.max_tokens is None:
            params = dataclasses.replace(params, max_tokens=max_len - len(ids))
        base = int(params.seed) if params.seed is not None else int(self.rng.integers(2**31))
        # NOTE: completion i of a seeded request gets its own stream, derived from the seed
        # (a negative seed enters SeedSequence as its 64-bit two's complement).
        seeds = [device_seed(base)] + [int(x) for x in np.random.SeedSequence(
            [base % 2**64, params.n]).generate_state(params.n - 1)]
        root = Request(request_id, ids, cache_salt=cache_salt, arrival_time=arrival_time,
                       lora_request=lora_request, mm_items=items,
                       sampling_params=params, priority=priority, eos_token_ids=self.eos_token_ids,
                       seeds=tuple(seeds))
        if items:  # a multimodal rotary's rows (Qwen2-VL); None for other families
            rope = self.images.rope_positions(ids, items)
            if rope is not None:
                root.rope_positions, root.rope_delta = rope
        state = RequestState(self.tokenizer, root, text, params)
        extra_eos = [e for e in self.eos_token_ids[1:] if e not in (params.stop_token_ids or [])]
        if params.min_tokens and not params.ignore_eos and extra_eos:
            # NOTE: the sampler bans `stop_token_ids` and one EOS id below min_tokens; a model
            # with several EOS ids needs the others banned too.
            state.row_params = params.clone(
                stop_token_ids=[*(params.stop_token_ids or []), *extra_eos])
        if params.bad_words:
            state.row_params = state.row_params.clone()
            state.row_params.bad_words_token_ids = self.bad_words_token_ids(params.bad_words)
        check_sampling_row(state.row_params, ids, seeds[0], vocab, self.eos_token_ids)
        if params.structured_outputs is not None:
            root.grammar = self.grammars.matcher(params.structured_outputs)
        return state

    def tokenize_images(self, prompt: dict) -> tuple[str | None, list[int], list]:
        """(text, ids, image items) of a prompt dict with `multi_modal_data` ({"image": an
        image or a list: PIL images or URLs}): each image preprocessed and its marker
        expanded into its placeholders (`jaxserve.multimodal.support.ImageSupport`).

        Raises:
            ValueError: A model that takes no images, another modality, a bad image or
                markers that do not match the images (named).
        """
        data = prompt["multi_modal_data"]
        if self.images is None:
            raise ValueError("multi_modal_data: this model takes no images (a text model, or "
                             "a family whose images are not served)")
        if not isinstance(data, dict) or set(data) - {"image"}:
            raise ValueError(f"multi_modal_data must be {{'image': ...}}, got "
                             f"{sorted(data) if isinstance(data, dict) else type(data).__name__}")
        text, ids = self.tokenize({k: v for k, v in prompt.items() if k != "multi_modal_data"})
        source = text if "prompt_token_ids" not in prompt else ids
        ids, items = self.images.prompt_items(source, data.get("image", []),
                                              lambda t: self.tokenizer(t).input_ids)
        return text, ids, items

    def check_logprobs(self, params: SamplingParams) -> SamplingParams:
        """`check_num_logprobs` against this engine's `max_logprobs` and vocabulary."""
        return check_num_logprobs(params, self.max_logprobs, self.vocab_size)

    def bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word's token ids alone and after a space (how it appears mid-text), as
        vLLM tokenizes them."""
        seqs: list[list[int]] = []
        for word in words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = list(self.tokenizer.encode(text, add_special_tokens=False))
                if ids and ids not in seqs:
                    seqs.append(ids)
        return seqs


def check_sampling_row(params: SamplingParams, prompt_ids: list[int], seed: int, vocab: int,
                       eos_token_ids: tuple[int, ...]) -> None:
    """Builds this request's sampling row alone, as a step would, so that whatever cannot
    go into a step's arrays is refused now (ValueError) instead of failing the step.

    Raises:
        ValueError: The row cannot be built, or it bans more tokens below `min_tokens`
            than the width the sampler was compiled for.
    """
    num_bad = len(params.bad_words_token_ids or ())
    if num_bad > MAX_BANNED_TOKEN_IDS:
        raise ValueError(f"bad_words make {num_bad} token sequences, more than the "
                         f"{MAX_BANNED_TOKEN_IDS} the sampler can ban per step")
    if params.min_tokens:
        banned = params.all_stop_token_ids(eos_token_ids[0] if eos_token_ids else None)
        if len(banned) + num_bad > MAX_BANNED_TOKEN_IDS:
            if num_bad:
                raise ValueError(f"bad_words ({num_bad} token sequences) and stop_token_ids "
                                 f"with EOS ({len(banned)} ids, banned until min_tokens) "
                                 f"exceed the {MAX_BANNED_TOKEN_IDS} ids the sampler can ban "
                                 "per step")
            raise ValueError(
                f"stop_token_ids may hold at most {MAX_BANNED_TOKEN_IDS - len(eos_token_ids)} "
                f"ids when min_tokens > 0 (they are banned on the device until min_tokens), "
                f"got {len(params.stop_token_ids)}")
    if params.allowed_token_ids is not None and params.min_tokens:
        banned = params.all_stop_token_ids(eos_token_ids[0] if eos_token_ids else None)
        banned |= set(eos_token_ids) if not params.ignore_eos else set()
        if set(params.allowed_token_ids) <= banned:
            raise ValueError("allowed_token_ids are all stop or EOS ids, banned until "
                             "min_tokens: nothing could be sampled")
    try:
        build_sampling_metadata([RowSpec(params, prompt_ids, (), seed, 0)], 1, vocab,
                                eos_token_id=eos_token_ids[0] if eos_token_ids else None)
    except (ValueError, TypeError, OverflowError) as e:
        raise ValueError(f"sampling parameters cannot be used: {e}") from None


