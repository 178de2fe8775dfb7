"""`LLM`: the offline API in vLLM's shape (`generate`, `chat`, `get_metrics`; the pooling
runner's `embed`, `classify`, `score`, `encode` and `reward` from `LLMPooling`)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from tqdm import tqdm

from jaxserve.config import EngineConfig
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine.llm_pooling import LLMPooling, as_prompt_list
from jaxserve.multimodal.chat import OFFLINE_IMAGE_PARTS, chat_prompt, has_image_parts
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import RequestOutputKind, SamplingParams


def per_prompt_loras(lora_request, num_prompts: int) -> list:
    """`lora_request` (None, one `LoRARequest` for every prompt, or a list of one per
    prompt, None entries allowed) as a list of one per prompt.

    Raises:
        ValueError: A list of another length than the prompts.
    """
    if lora_request is None or not isinstance(lora_request, (list, tuple)):
        return [lora_request] * num_prompts
    if len(lora_request) != num_prompts:
        raise ValueError(f"got {len(lora_request)} lora_requests for {num_prompts} prompts")
    return list(lora_request)


def _final_only(params: list) -> list:
    """`params` as FINAL_ONLY copies (one per distinct object; others left for add_request
    to refuse)."""
    copies: dict[int, SamplingParams] = {}
    out = []
    for sp in params:
        if isinstance(sp, SamplingParams) and sp.output_kind != RequestOutputKind.FINAL_ONLY:
            if id(sp) not in copies:
                copies[id(sp)] = sp.clone(output_kind=RequestOutputKind.FINAL_ONLY)
            sp = copies[id(sp)]
        out.append(sp)
    return out


class LLM(LLMPooling):
    """Runs a model over batches of prompts with continuous batching.

    Args:
        model: GGUF file, HF directory, jaxserve checkpoint, None for the embedded
            SmolLM2-135M-Instruct, or an already loaded `models.model.Model`.
        tokenizer: The tokenizer to use with a loaded model (default: load it).
        **engine_args: vLLM-style engine arguments (`block_size`, `max_num_seqs`,
            `max_num_batched_tokens`, `max_model_len`, `enable_chunked_prefill`,
            `enable_prefix_caching`, `swap_space`, `dtype`, `quantization`,
            `kv_cache_dtype`, `seed`,
            `gpu_memory_utilization`, `num_kv_blocks`, `attention_backend`,
            `preemption_mode`, `scheduling_policy`, `long_prefill_token_threshold`,
            `scheduling_mode`, `enable_lora`, `max_loras`, `max_lora_rank`,
            `max_cpu_loras`, ...).

    Raises:
        ValueError: An unknown argument or a value out of range, naming it.
    """

    def __init__(self, model=None, *, tokenizer=None, **engine_args):
        from models.model import Model

        # NOTE: an already loaded `Model` (and tokenizer) may be passed to skip loading,
        # e.g. to build several engines over one set of weights.
        loaded = model if isinstance(model, Model) else None
        config = EngineConfig.from_kwargs(model=None if loaded else model, **engine_args)
        if loaded is not None and config.model.dtype not in ("auto",
                                                             np.dtype(loaded.dtype).name):
            raise ValueError(f"dtype={config.model.dtype!r} differs from the loaded model's "
                             f"{loaded.dtype}")
        if loaded is not None and config.model.quantization not in (None, loaded.quant.name):
            raise ValueError(f"quantization={config.model.quantization!r} differs from the "
                             f"loaded model's {loaded.quant.name!r}")
        if config.parallel.data_parallel_size > 1:
            from jaxserve.engine.data_parallel import DataParallelEngine

            self.engine = DataParallelEngine(config, model=loaded, tokenizer=tokenizer)
        else:
            self.engine = LLMEngine(config, model=loaded, tokenizer=tokenizer)
        self.multimodal = config.multimodal  # the images `chat` takes
        self.model_dir = config.model.model  # its config.json names the image marker
        self._counter = 0

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_metrics(self) -> dict[str, float]:
        """Counters and gauges by name, e.g. `jaxserve:num_preemptions`."""
        return self.engine.get_metrics()

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams]
                 | None = None, *, use_tqdm: bool = True,
                 priority: Sequence[int] | None = None, lora_request=None
                 ) -> list[RequestOutput]:
        """Generates completions for every prompt; returns them in the prompts' order.

        Args:
            prompts: A prompt or a list of prompts; each text, token ids, or
                `{"prompt_token_ids": [...]}`.
            sampling_params: One for all prompts, or one per prompt (default: greedy-free
                `SamplingParams()`, as in vLLM).
            use_tqdm: Show a progress bar.
            priority: Per-prompt priority (scheduling_policy="priority"; lower runs first).
            lora_request: A `jaxserve.lora.LoRARequest` for every prompt, or a list of one
                per prompt (None entries: the base model); needs `enable_lora`.

        Raises:
            ValueError: A bad prompt or parameters (no request of the batch is left queued).
        """
        prompts = as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts")
        # NOTE: only final outputs are read here, so (as vLLM's LLM does) requests emit
        # nothing until they finish; the engine then skips per-step output building.
        params = _final_only(params)
        loras = per_prompt_loras(lora_request, len(prompts))
        ids = []
        try:
            for i, (prompt, sp) in enumerate(zip(prompts, params, strict=True)):
                request_id = f"llm-{self._counter}"
                self._counter += 1
                ids.append(request_id)  # before adding: aborting an unknown id is a no-op
                self.engine.add_request(request_id, prompt, sp,
                                        priority=priority[i] if priority else 0,
                                        lora_request=loras[i])
        except BaseException:
            # NOTE: whatever failed (a ValueError, a TypeError, Ctrl-C), no request of this
            # batch stays queued to run silently inside the next call.
            self.engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages, sampling_params: SamplingParams | None = None, *,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template: str | None = None, lora_request=None) -> list[RequestOutput]:
        """Generates replies to one conversation or a list of conversations.

        Each conversation is a list of `{"role": ..., "content": ...}` messages rendered
        through the tokenizer's chat template. A content list may hold images (vLLM's
        parts `{"type": "image_url", "image_url": {"url": ...}}`, `{"type": "image_pil",
        "image_pil": img}`, `{"type": "image", "image": img or url}`): such a conversation
        is rendered to text with one image marker per image and sent with its images
        (`jaxserve.multimodal.chat.chat_prompt`), within `limit_mm_per_prompt` and the
        media limits.

        Raises:
            ValueError: A bad image or too many, naming the content part
                (`messages[i].content[j]`), or a bad prompt or parameters.
        """
        if messages and isinstance(messages[0], dict):
            messages = [messages]
        prompts = []
        for conversation in messages:
            if has_image_parts(conversation, OFFLINE_IMAGE_PARTS):
                mm = self.multimodal
                prompts.append(chat_prompt(
                    self.engine.tokenizer, conversation, mm.media_limits(), mm.max_images,
                    chat_template=chat_template, add_generation_prompt=add_generation_prompt,
                    model_dir=self.model_dir if isinstance(self.model_dir, str) else None))
                continue
            ids = self.engine.tokenizer.apply_chat_template(
                conversation, add_generation_prompt=add_generation_prompt, tokenize=True,
                chat_template=chat_template, return_dict=False)
            prompts.append({"prompt_token_ids": list(ids)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm,
                             lora_request=lora_request)

    def beam_search(self, prompts, params, lora_request=None):
        """Beam search over forked requests (see `jaxserve.engine.beam_search`).

        Args:
            prompts: A prompt or a list of prompts (text, ids, or a prompt dict).
            params: A `BeamSearchParams`.
            lora_request: An adapter for every prompt, or one per prompt (see
                `generate`).

        Returns:
            One `BeamSearchOutput` per prompt, its sequences best first.
        """
        from jaxserve.engine.beam_search import beam_search

        if not isinstance(self.engine, LLMEngine):
            raise ValueError("beam_search runs on one engine; use data_parallel_size=1")
        prompts = as_prompt_list(prompts)
        return beam_search(self.engine, prompts, params,
                           per_prompt_loras(lora_request, len(prompts)))

    # ------------------------------------------------ weights, cache, sleep
    def update_weights(self, weights, abort_running: bool = False) -> list[RequestOutput]:
        """Serves new weights without a restart or a recompile (a params tree in the
        model's layout, or a checkpoint path); see
        `jaxserve.engine.weight_control.WeightControl.update_weights`."""
        return self.engine.update_weights(weights, abort_running)

    def get_weights(self) -> dict:
        """The served weights in the model's standard layout (`update_weights`'s input)."""
        return self.engine.get_weights()

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix; False while requests hold pages."""
        return self.engine.reset_prefix_cache()

    def sleep(self, level: int = 1) -> int:
        """Frees the KV cache (level 2: the weights too) until `wake_up`; bytes freed."""
        return self.engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Allocates again what `sleep` freed: every memory tag, or those in `tags`
        ("weights", "kv_cache"; vLLM's partial wake-up); see
        `jaxserve.engine.weight_control.WeightControl.wake_up`."""
        self.engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        """Whether any memory tag still sleeps (requests are refused until all are awake)."""
        return self.engine.is_sleeping()

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        wanted = set(request_ids)
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm)
        try:
            while len(finished) < len(wanted) and self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished and out.request_id in wanted:
                        finished[out.request_id] = out
                        bar.update(1)
        except BaseException:
            # NOTE: a failed step (or Ctrl-C) must not leave this call's requests queued,
            # holding pages and failing again in the next call.
            self.engine.abort_request(request_ids)
            raise
        finally:
            bar.close()
        return [finished[r] for r in request_ids if r in finished]
