"""Chat messages to token ids, safe against hostile request templates, kwargs and messages:
a dry run in the hardened sandbox (`template_sandbox`), then transformers' own render
under a deadline."""

from __future__ import annotations

import inspect
import re
import sys
import time
from contextlib import contextmanager

from jinja2.exceptions import SecurityError, TemplateError

from jaxserve.entrypoints.template_sandbox import (
    BUILT,
    TemplateLimits,
    TemplateTimeout,
    compile_request_template,
    refuse,
)


class ChatTemplateError(ValueError):
    """The request can't be rendered (a 400); `param` names the request field at fault."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


# chat_template_kwargs: these override the arguments; apply_chat_template's other parameters
# are options, not template variables, and the rest are names it binds itself.
_OVERRIDABLE = {"add_generation_prompt": bool, "continue_final_message": bool,
                "tools": list, "documents": list}
_RESERVED = frozenset({"messages", "conversation", "conversations", "chat_template", "self",
                       "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length",
                       "return_tensors", "return_dict", "return_assistant_tokens_mask",
                       "tokenizer_kwargs"})
_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' mark on a continued message
_QUALIFIED = re.compile(r"(?<![\w.])(?:(?:[a-z_]\w*|<locals>)\.){2,}(?=[A-Za-z_])")


class _Budget:
    """A template's time budget: `seconds` of its own thread's CPU time (waiting for the GIL
    or for a core under load does not count, so an ordinary template is not refused on a
    busy machine), and at most `WALL_FACTOR` times that of wall-clock time (a thread that
    stalls is freed). `spent` reads the CPU clock only once the wall clock says it may be
    spent."""

    WALL_FACTOR = 4

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.cpu_start = time.thread_time()
        now = time.monotonic()
        self.wall_end = now + self.WALL_FACTOR * seconds
        self.check_at = now + seconds

    def spent(self) -> bool:
        """Whether the budget is used up (call it from the thread it was made in)."""
        now = time.monotonic()
        if now <= self.check_at:
            return False
        if now > self.wall_end:
            return True
        used = time.thread_time() - self.cpu_start
        if used > self.seconds:
            return True
        self.check_at = now + (self.seconds - used)
        return False


@contextmanager
def _deadline(budget: _Budget, everywhere: bool):
    """Raises `TemplateTimeout` in this thread once `budget` is spent: checked on each call
    (`everywhere`, or only from and in compiled templates) and each line of a template."""

    def on_line(frame, event, arg):
        if budget.spent():
            raise TemplateTimeout
        return on_line

    def on_call(frame, event, arg):
        template = frame.f_code.co_filename == "<template>"
        if (everywhere or template or frame.f_back and frame.f_back.f_code.co_filename
                == "<template>") and budget.spent():
            raise TemplateTimeout
        return on_line if template else None

    previous = sys.gettrace()
    sys.settrace(on_call)
    try:
        yield
    finally:
        sys.settrace(previous)


def _json_like(value) -> bool:
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, dict) and all(isinstance(k, str) for k in v):
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
        elif v is not None and type(v) not in (str, int, float, bool):
            return False
    return True


def _describe(e: BaseException) -> str:
    """The exception as plain text: its type without module path, at most 300 characters."""
    text = str(e) or type(e).__name__
    if type(e) not in (ValueError, TemplateError) and not isinstance(e, SecurityError):
        text = f"{type(e).__name__}: {text}"
    text = _QUALIFIED.sub("", text)
    return text if len(text) <= 300 else text[:297] + "..."


def _template_variables(tokenizer, template_kwargs) -> dict:
    """Validated `chat_template_kwargs` (the policy is in `render_chat`)."""
    if not isinstance(template_kwargs, dict | None):
        raise ChatTemplateError("chat_template_kwargs must be an object", "chat_template_kwargs")
    params = inspect.signature(type(tokenizer).apply_chat_template).parameters.values()
    reserved = (_RESERVED | {p.name for p in params if p.kind != p.VAR_KEYWORD}) - {*_OVERRIDABLE}
    for key, value in (template_kwargs or {}).items():
        kind = _OVERRIDABLE.get(key)
        if not isinstance(key, str) or not key.isidentifier() or key in reserved:
            problem = "is not a template variable (an option or a name the template binds)"
        elif (kind and value is not None and not isinstance(value, kind)) or not _json_like(value):
            problem = "has a value of the wrong type"
        else:
            continue
        raise ChatTemplateError(f"chat_template_kwargs: {key!r} {problem}", "chat_template_kwargs")
    return dict(template_kwargs or {})


def _dry_run(source: str, messages: list[dict], call: dict, variables: dict,
             limits: TemplateLimits) -> None:
    """Renders a request's template in the hardened sandbox with what transformers passes it."""
    if len(source) > limits.max_chars:
        refuse(f"the template exceeds the {limits.max_chars} character limit")
    template, chat = compile_request_template(limits, source), []
    for message in messages:  # as transformers: None values dropped, reasoning fields aliased
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in ("reasoning_content", "thinking", "reasoning")
                          if k in message), None)
        chat.append(message if reasoning is None else
                    {"thinking": reasoning, **message, "reasoning_content": reasoning})
    content = chat[-1].get("content")
    if call["continue_final_message"] and isinstance(content, str):
        chat[-1]["content"] = content + _TAG
    elif call["continue_final_message"] and isinstance(content, list):
        blocks = chat[-1]["content"] = list(content)
        for i in reversed(range(len(blocks))):
            if isinstance(blocks[i], dict) and isinstance(blocks[i].get("text"), str):
                blocks[i] = {**blocks[i], "text": blocks[i]["text"] + _TAG}
                break
    size, token = 0, BUILT.set([0])
    try:
        for chunk in template.generate(messages=chat, tools=call["tools"],
                                       documents=call["documents"],
                                       add_generation_prompt=call["add_generation_prompt"],
                                       **variables):
            size += len(chunk)  # streamed: stops as soon as the output passes the cap
            if size > limits.max_chars:
                refuse(f"the rendered prompt exceeds the {limits.max_chars} character limit")
    finally:
        BUILT.reset(token)


def render_chat(tokenizer, messages: list[dict], *, chat_template: str | None = None,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                tools: list[dict] | None = None, template_kwargs: dict | None = None,
                trusted: bool = False, limits: TemplateLimits | None = None,
                tokenize: bool = True) -> list[int] | str:
    """Token ids (or the text) of `messages` through the chat template, by
    `tokenizer.apply_chat_template`.

    Blocking and thread-safe: run it in a worker thread. The template runs under a deadline (a
    tracer in this thread); a request's own template is first dry-rendered in a hardened
    sandbox that caps every value it builds, its output and its time.

    Args:
        tokenizer: A transformers tokenizer.
        messages: The conversation: JSON objects with `role`, `content`...
        chat_template: The request's template, or the name of one of the tokenizer's; None:
            the tokenizer's own.
        add_generation_prompt: End with the assistant's header.
        continue_final_message: Leave the final message open (needs no generation prompt).
        tools: Tool JSON schemas for the template.
        template_kwargs: Template variables (`chat_template_kwargs`), JSON values. The keys
            `add_generation_prompt`, `continue_final_message`, `tools` and `documents` override
            the arguments; apply_chat_template's options (`tokenize`, `return_tensors`, ...),
            `messages`, `conversation`, `chat_template` and non-identifiers are refused.
        trusted: `chat_template` is the operator's: no dry run.
        limits: The deadline and size cap (default: `TemplateLimits()`).
        tokenize: Return token ids; False: the rendered text (an image prompt, whose markers
            the engine expands before tokenizing).

    Returns:
        The token ids, or the text.

    Raises:
        ChatTemplateError: For anything wrong in the request, naming the field (`messages`,
            `chat_template`, `chat_template_kwargs` or `tools`).
    """
    limits = limits or TemplateLimits()
    if not (isinstance(messages, list) and messages and _json_like(messages)
            and all(isinstance(m, dict) for m in messages)):
        raise ChatTemplateError("messages must be a non-empty list of JSON objects", "messages")
    if not isinstance(chat_template, str | None):
        raise ChatTemplateError("chat_template must be a string", "chat_template")
    if tools is not None and not (isinstance(tools, list) and _json_like(tools)):
        raise ChatTemplateError("tools must be a list of JSON objects", "tools")
    variables = _template_variables(tokenizer, template_kwargs)
    call = {"add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message, "tools": tools, "documents": None}
    overridden = {k: variables.pop(k) for k in _OVERRIDABLE if k in variables}
    call.update(overridden)
    if call["add_generation_prompt"] and call["continue_final_message"]:
        from_kwargs = {"add_generation_prompt", "continue_final_message"} & overridden.keys()
        raise ChatTemplateError("continue_final_message needs add_generation_prompt=false",
                                "chat_template_kwargs" if from_kwargs else "messages")
    named = isinstance(tokenizer.chat_template, dict) and chat_template in tokenizer.chat_template
    untrusted = chat_template is not None and not trusted and not named
    budget = _Budget(limits.deadline_s)
    try:
        if untrusted:
            try:
                with _deadline(budget, everywhere=True):
                    _dry_run(chat_template, messages, call,
                             {**tokenizer.special_tokens_map, **variables}, limits)
            except Exception as e:  # noqa: BLE001 - the request's template is at fault
                if type(e) is TemplateError:  # raise_exception(): the template's message
                    raise ChatTemplateError(_describe(e), "messages") from None
                raise ChatTemplateError(f"invalid chat template: {_describe(e)}",
                                        "chat_template") from None
        try:
            with _deadline(budget, everywhere=False):
                ids = tokenizer.apply_chat_template(messages, chat_template=chat_template,
                                                    tokenize=tokenize, return_dict=False,
                                                    **call, **variables)
        except Exception as e:  # noqa: BLE001 - the conversation doesn't suit the template
            if type(e) is TemplateError:
                raise ChatTemplateError(_describe(e), "messages") from None
            raise ChatTemplateError(f"cannot apply the chat template: {_describe(e)}",
                                    "messages") from None
    except TemplateTimeout:
        raise ChatTemplateError(f"chat template rendering took longer than {limits.deadline_s:g} s "
                                "of CPU time",
                                "chat_template" if untrusted else "messages") from None
    return [int(i) for i in ids] if tokenize else ids
