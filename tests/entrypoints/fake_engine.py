"""A JAX-free stand-in for `LLMEngine`: one token per request per step, for fast async tests."""

from __future__ import annotations

import time
from types import SimpleNamespace

from jaxserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jaxserve.sampling_params import SamplingParams, check_num_logprobs


class FakeEngine:
    """Emits token `i` as text `"t{i} "` per step until `max_tokens`; records aborts.

    Args:
        step_seconds: Time one `step()` blocks, like a jitted step.
        fail_on: Prompt that makes `step()` raise.
        stall_on: Prompt token ids whose requests get no token (as if waiting for a slot).
    """

    def __init__(self, step_seconds: float = 0.01, fail_on: str | None = None,
                 stall_on: list[int] | None = None):
        self.tokenizer = SimpleNamespace(eos_token_id=None)
        self.limits = SimpleNamespace(max_model_len=64)
        self.step_seconds = step_seconds
        self.fail_on = fail_on
        self.stall_on = stall_on
        self.running: dict[str, tuple] = {}
        self.aborted: list[str] = []
        self.added_at_step: dict[str, int] = {}  # steps run before each request came in
        self.num_steps = 0
        self.runner_type = "generate"  # `EngineClient.runner_type`: it serves completions
        self.quantization = "none"  # `EngineClient.quantization`: no weights at all
        self.classifier_head = None  # `EngineClient.classifier_head`: no pooler
        self.model_source = ""  # `EngineClient.model_source`: no weights

    def add_request(self, request_id, prompt, params, *, priority=0, cache_salt=None,
                    arrival_time=None, lora_request=None):
        if lora_request is not None:  # as an engine built without enable_lora
            raise ValueError("lora_request given, but the engine serves no LoRA adapters "
                             "(build it with enable_lora=True)")
        if request_id in self.running:
            raise ValueError(f"request id {request_id!r} is already in use")
        if prompt == "":
            raise ValueError("prompt is empty: it must hold at least one token")
        # NOTE: the real engine's default limit over the default model's vocabulary.
        params = check_num_logprobs(params, SamplingParams.MAX_LOGPROBS, 49152)
        metrics = RequestMetrics(arrival_time=arrival_time or time.time())
        self.running[request_id] = (prompt, params, [], metrics)
        self.added_at_step[request_id] = self.num_steps

    def add_lora(self, lora_request):  # as an engine built without enable_lora
        raise ValueError("lora_request given, but the engine serves no LoRA adapters "
                         "(build it with enable_lora=True)")

    def remove_lora(self, lora_id):
        return False

    def sleep(self, level=1):
        self.sleeping = level
        return 0

    def wake_up(self, tags=None):
        self.sleeping = 0

    def is_sleeping(self):
        return bool(getattr(self, "sleeping", 0))

    def reset_prefix_cache(self):
        return True

    def abort_request(self, request_ids):
        outputs = []
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            entry = self.running.pop(rid, None)
            if entry is not None:
                self.aborted.append(rid)
                prompt, _, tokens, metrics = entry
                comp = CompletionOutput(0, "".join(f"t{t} " for t in tokens), list(tokens),
                                        finish_reason="abort")
                outputs.append(RequestOutput(rid, prompt, [1, 2], [comp], True, metrics))
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self.running)

    # The rest of the `EngineClient` interface.
    max_model_len = property(lambda self: self.limits.max_model_len)
    vocab_size = None  # unknown: the engine checks ids itself
    eos_token_ids = property(lambda self: tuple(
        [] if self.tokenizer.eos_token_id is None else [self.tokenizer.eos_token_id]))
    num_scheduled_tokens = property(lambda self: 0)
    num_iteration_tokens = property(lambda self: 0)
    warmup_progress = (0, 0)

    def check_constraint(self, structured_outputs) -> None:
        pass  # no grammars: nothing to compile

    def cache_config_info(self) -> dict:
        return {}

    def step(self) -> list[RequestOutput]:
        time.sleep(self.step_seconds)
        self.num_steps += 1
        outputs = []
        now = time.time()
        for rid, (prompt, params, tokens, metrics) in list(self.running.items()):
            if prompt == self.fail_on:
                raise RuntimeError("boom")
            if isinstance(prompt, dict) and prompt.get("prompt_token_ids") == self.stall_on:
                continue
            tokens.append(len(tokens))
            metrics.first_scheduled_time = metrics.first_scheduled_time or now
            metrics.first_token_time = metrics.first_token_time or now
            metrics.last_token_time = now
            done = len(tokens) >= params.max_tokens
            if done:
                metrics.finished_time = now
                del self.running[rid]
            text = "".join(f"t{t} " for t in tokens)
            comp = CompletionOutput(0, text, list(tokens),
                                    finish_reason="length" if done else None)
            outputs.append(RequestOutput(rid, prompt, [1, 2], [comp], done, metrics))
        return outputs

    def get_metrics(self) -> dict[str, float]:
        return {"jaxserve:num_requests_running": len(self.running),
                "jaxserve:kv_cache_usage_perc": 0.1 * len(self.running),
                "jaxserve:generation_tokens": self.num_steps}


class ScriptedEngine(FakeEngine):
    """A `FakeEngine` whose replies are picked by their prompt: each request gets the entry
    of `replies` whose name appears in its decoded prompt as `[name]` (the longest such
    name), queued as `(script(reply), decoded prompt)` for a subclass's `step` to play;
    keeps the decoded prompts (a text prompt as it came), each prompt's `multi_modal_data`
    (None without) and the parameters.

    Args:
        tokenizer: Decodes the prompts (and, for subclasses, the replies' tokens).
        replies: Reply by name.
        skip_special_tokens: How the prompts are decoded.
    """

    def __init__(self, tokenizer, replies: dict, skip_special_tokens: bool = True):
        super().__init__(step_seconds=0.001)
        self.tokenizer, self.limits.max_model_len = tokenizer, 4096
        self.replies, self.skip_special_tokens = replies, skip_special_tokens
        self.prompts: list[str] = []
        self.multi_modal_data: list[dict | None] = []
        self.params = []

    def script(self, reply):
        """What `step` plays of a reply (the reply itself; subclasses may tokenize it)."""
        return reply

    def add_request(self, request_id, prompt, params, **kwargs):
        text = prompt["prompt"] if "prompt_token_ids" not in prompt else self.tokenizer.decode(
            prompt["prompt_token_ids"], skip_special_tokens=self.skip_special_tokens)
        self.prompts.append(text)
        self.multi_modal_data.append(prompt.get("multi_modal_data"))
        self.params.append(params)
        reply = self.replies[max((k for k in self.replies if f"[{k}]" in text), key=len)]
        super().add_request(request_id, (self.script(reply), text), params, **kwargs)
