"""The hardened jinja sandbox for request-supplied chat templates: size caps on every
operation that can grow a value, constant folding checked at compile time, and
refusal of whatever would differ between a dry run and the real render."""

from __future__ import annotations

import copy
import functools
import json
import re
import string
import types
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime

from jinja2 import Undefined, nodes
from jinja2.compiler import CodeGenerator
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace


@dataclass(frozen=True)
class TemplateLimits:
    """Bounds on one `render_chat` call.

    Attributes:
        deadline_s: CPU-time budget of the template's execution, dry run and render (not of
            the tokenizer, whose input the request or `max_chars` bounds), on the rendering
            thread's own clock, so a busy machine or GIL contention does not spend it; four
            times it of wall-clock time frees a thread that stalls. Real templates run in
            milliseconds.
        max_chars: Cap on the rendered prompt and on every value a request template builds
            (strings by length, containers by items plus contents). 2,000,000 chars is ~500k
            tokens, more than any context window served; a value is then at most 2-8 MB.
        max_total_chars: Cap on all a request template builds and prints, summed: bounds the
            memory its variables can hold (32-128 MB). Real templates build a few times their
            output: 16 times the largest output.
    """

    deadline_s: float = 2.0
    max_chars: int = 2_000_000
    max_total_chars: int = 32_000_000


_MAX_INT_BITS = 1 << 16
# Filters whose input may be an iterator: they iterate it rather than print it.
_ITERATING = frozenset({"list", "first", "last", "length", "count", "sort", "unique", "min", "max",
                        "batch", "slice", "groupby", "reverse", "map", "select", "reject",
                        "selectattr", "rejectattr", "dictsort", "items", "default", "d", "attr",
                        "tojson"})
# Filters / str methods whose output grows with an argument: a width or filler once ("") or per
# line or tab, or a string per character (None).
_AMPLIFIERS = {"center": "", "ljust": "", "rjust": "", "zfill": "", "round": "", "batch": "",
               "slice": "", "indent": "\n", "expandtabs": "\t", "translate": None,
               "wordwrap": None, "urlize": None}
_PRINTF = re.compile(r"%(?:\([^)]*\))?([^a-zA-Z%]*)")
_DATE_ONLY = re.compile(r"(?:[^%]|%%|%-?[aAbBdejmyY])*")
# Expressions that make a constant-looking one not constant (slices: harmless; a slice's parts
# are checked on their own); constants need no check.
_NOT_CONSTANT = (nodes.Name, nodes.NSRef, nodes.Call, nodes.Slice, nodes.ContextReference,
                 nodes.DerivedContextReference, nodes.EnvironmentAttribute,
                 nodes.ExtensionAttribute, nodes.ImportedName, nodes.InternalName)
_UNCHECKED = (*_NOT_CONSTANT, nodes.Const, nodes.TemplateData)
# Per dry run: the characters built and printed so far.
BUILT: ContextVar[list[int] | None] = ContextVar("BUILT", default=None)


class TemplateTimeout(BaseException):
    """From the tracer; a BaseException so that no `except Exception` on the way stops it."""


class _LimitError(SecurityError):
    """A limit of the hardened sandbox."""


def refuse(message: str):
    raise _LimitError(message)


def _random(*args, **kwargs):  # `lipsum()` and `|random`: they would differ between renders
    refuse("lipsum() and the random filter are not allowed in a chat template")


def _raise_exception(message):
    raise TemplateError(message)  # as transformers': the template's own message for the user


def _weight(value, cap: int, strict: bool = False) -> int:
    """Size of `value` as text (string lengths, one per item), counted until it passes `cap`.

    `strict` refuses objects printed as an address or a class name (functions, generators...):
    they differ between this sandbox and transformers', so a template could tell them apart.
    """
    total, stack = 0, [value]
    while stack and total <= cap:
        v = stack.pop()
        if isinstance(v, str):
            total += len(v)
        elif isinstance(v, int) and not isinstance(v, bool):
            total += v.bit_length() // 3 + 1
        elif isinstance(v, (list, tuple, dict, Namespace)):
            items = v._Namespace__attrs if isinstance(v, Namespace) else v
            total += len(items) + 1
            if total <= cap:
                stack.extend(items.items() if isinstance(items, dict) else items)
        elif v is None or isinstance(v, (bool, float, Undefined, range)) or not strict:
            total += 1
        else:
            refuse(f"a {type(v).__name__} cannot be turned into text in a chat template")
    return total


def _spec_size(specs) -> int:
    """Sum of the widths and precisions in format specs; computed ones (`*`, `{}`) refused."""
    specs = list(specs)
    if any("*" in spec or "{" in spec for spec in specs):
        refuse("computed field widths are not allowed in a chat template")
    return sum(int(n) for spec in specs for n in re.findall(r"\d+", spec))


def _strftime_now(fmt):
    if not isinstance(fmt, str) or not _DATE_ONLY.fullmatch(fmt):  # the time would differ
        refuse("strftime_now() only takes date directives (%Y %y %m %b %B %d %e %a %A %j)")
    return datetime.now().strftime(fmt)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    if (isinstance(indent, int) and indent > 16) or _weight((indent, separators), 64) > 16:
        refuse("tojson(): indent and separators are limited to 16 characters")
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


class _TemplateDict:
    """transformers' `dict` global: calling it and `fromkeys` only."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _Generation(Extension):
    """transformers' `{% generation %}...{% endgeneration %}`, rendering its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("body"), [], [], body).set_lineno(lineno)

    def body(self, caller):
        return caller()


class _GuardedCodeGenerator(CodeGenerator):
    """Routes `~` and list/tuple/dict literals through the environment's size checks."""

    def visit_Concat(self, node, frame):
        self.write("environment.concat_values((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")

    def _checked(self, visit, node, frame):
        self.write("environment.checked(")
        visit(node, frame)
        self.write(")")

    def visit_List(self, node, frame):
        self._checked(super().visit_List, node, frame)

    def visit_Dict(self, node, frame):
        self._checked(super().visit_Dict, node, frame)

    def visit_Tuple(self, node, frame):
        if node.ctx != "load":  # an assignment target
            return super().visit_Tuple(node, frame)
        self._checked(super().visit_Tuple, node, frame)


class _HardenedEnvironment(ImmutableSandboxedEnvironment):
    """transformers' chat template sandbox, plus size checks on every value a template builds."""

    code_generator_class = _GuardedCodeGenerator
    intercepted_binops = frozenset({"*", "**", "%", "+"})

    def __init__(self, limits: TemplateLimits):
        self.cap, self.total = limits.max_chars, limits.max_total_chars
        super().__init__(trim_blocks=True, lstrip_blocks=True, finalize=self.finalize_output,
                         extensions=[loopcontrols, _Generation])
        filters = {**self.filters, "tojson": _tojson, "random": _random}
        self.filters = {name: self._guard_filter(name, f) for name, f in filters.items()}
        self.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now,
                            dict=_TemplateDict(), lipsum=_random)

    def checked(self, value, size=None, strict=False):
        """`value`, once its size is within the cap and the render's total."""
        size = _weight(value, self.cap, strict) if size is None else size
        if size > self.cap:
            refuse(f"a value exceeds the {self.cap} character limit")
        if (built := BUILT.get()) is not None:
            built[0] += size
            if built[0] > self.total:
                refuse(f"the template builds more than {self.total} characters in all")
        return value

    def finalize_output(self, value):  # `{{ value }}`, in macros and blocks too
        return self.checked(value, strict=True)

    def concat(self, parts):  # the output of a macro or a block
        parts = list(parts)
        return "".join(self.checked(parts, sum(map(len, parts))))

    def concat_values(self, parts):  # `a ~ b`
        self.checked(parts, sum(_weight(p, self.cap, strict=True) for p in parts))
        return "".join(map(str, parts))

    def call_binop(self, context, operator, left, right):
        cap = self.cap
        if isinstance(left, int) and isinstance(right, int):  # bits of the result
            bits = {"**": right * left.bit_length() if abs(left) > 1 else 0,
                    "*": left.bit_length() + right.bit_length()}.get(operator, 0)
            if bits > _MAX_INT_BITS:
                refuse("a number is too large")
        if operator == "*" and any(isinstance(s, (str, list, tuple)) and isinstance(n, int)
                                   and n > 0 and _weight(s, cap) * n > cap
                                   for s, n in ((left, right), (right, left))):
            refuse(f"a repetition exceeds the {cap} character limit")
        if operator == "+" and _weight(left, cap) + _weight(right, cap) > cap:
            refuse(f"a sum exceeds the {cap} character limit")
        if operator == "%" and isinstance(left, str) and len(left) + _weight(right, cap, True) \
                + _spec_size(m.group(1) for m in _PRINTF.finditer(left)) > cap:
            refuse(f"a % format exceeds the {cap} character limit")
        return self.checked(super().call_binop(context, operator, left, right))

    def call(self, context, obj, /, *args, **kwargs):
        plain = {k: v for k, v in kwargs.items() if k not in ("_loop_vars", "_block_vars")}
        owner = getattr(obj, "__self__", None)
        if not (isinstance(owner, str) and isinstance(obj, types.BuiltinMethodType)):
            self._precheck(None, None, args, plain, False)
        elif obj.__name__ == "join" and len(args) == 1:  # sep.join(items)
            args = (self._precheck("join", args[0], (owner,), {}, True),)
        else:
            self._precheck(obj.__name__, owner, args, plain, True)
        return self.checked(super().call(context, obj, *args, **kwargs))

    def wrap_str_format(self, value):
        if (wrapper := super().wrap_str_format(value)) is None:
            return None

        def checked_format(*args, **kwargs):
            fmt = value.__self__
            specs = (spec or "" for _, _, spec, _ in string.Formatter().parse(fmt))
            if len(fmt) + _spec_size(specs) + _weight((args, kwargs), self.cap, True) > self.cap:
                refuse(f"a str.format() exceeds the {self.cap} character limit")
            return wrapper(*args, **kwargs)

        return checked_format

    def _guard_filter(self, name, f):
        skip = 1 if hasattr(f, "jinja_pass_arg") else 0  # a context or environment comes first

        @functools.wraps(f)
        def guarded(*args, **kwargs):
            value = self._precheck(name, args[skip], args[skip + 1:], kwargs, True)
            return self.checked(f(*args[:skip], value, *args[skip + 1:], **kwargs))

        return guarded

    def _precheck(self, name, subject, rest, kwargs, strict):
        """Refuses a call whose result would pass the cap; returns `subject` (an iterator to
        join or sum as a list)."""
        cap = self.cap
        if name in ("join", "sum") and not isinstance(subject, (str, list, tuple, dict)):
            subject = list(subject)
        own = _weight(subject, cap, strict and name not in _ITERATING)
        size = own + (others := _weight((rest, kwargs), cap, strict))
        big = max((abs(a) for a in (*rest, *kwargs.values()) if isinstance(a, int)), default=0)
        estimate = max(size, big)
        if name == "replace" and len(rest) >= 2:
            text = str(subject)
            estimate = len(text) + text.count(str(rest[0])) * len(str(rest[1]))
        elif name == "join":
            estimate = size + len(str(rest[0] if rest else kwargs.get("d", ""))) * len(subject)
        elif name == "sum" and any(isinstance(x, (list, tuple)) for x in subject):
            estimate = size * len(subject)  # each step copies the sequence so far
        elif _AMPLIFIERS.get(name, 0) is None:  # wrap strings, link attributes, a table
            estimate = own * (1 + others)
        elif name in _AMPLIFIERS:  # widths and fillers
            unit, text = _AMPLIFIERS[name], subject if isinstance(subject, str) else ""
            estimate = own + (1 + (text.count(unit) if unit else 0)) * (big + others)
        if estimate > cap:
            refuse(f"{name or 'a call'}() would exceed the {cap} character limit")
        return subject


@functools.lru_cache(maxsize=8)
def _environment(limits: TemplateLimits) -> _HardenedEnvironment:
    return _HardenedEnvironment(limits)


@functools.lru_cache(maxsize=64)
def compile_request_template(limits: TemplateLimits, source: str):
    """The request's template, compiled in the hardened sandbox.

    transformers' jinja evaluates constant expressions at compile time, even in branches never
    taken (`{% if false %}{{ 'x' * 10**10 }}{% endif %}`): each is evaluated here first, under
    the checks, as jinja would (on an error, its parts one by one); together they fit the cap.
    """
    env, cap, folded = _environment(limits), limits.max_chars, 0
    todo = list(env.parse(source).iter_child_nodes())
    while todo:
        node = todo.pop()
        if isinstance(node, nodes.Expr) and not isinstance(node, _UNCHECKED) \
                and not any(node.find_all(_NOT_CONSTANT)):
            body = [nodes.Assign(nodes.Name("value", "store", lineno=1),
                                 copy.deepcopy(node, {id(env): env}), lineno=1)]
            try:
                module = env.from_string(nodes.Template(body, lineno=1).set_environment(env))
                folded += _weight(module.module.value, cap)
                continue
            except _LimitError:
                raise
            except Exception:  # noqa: BLE001 - jinja leaves it to runtime
                pass
        todo.extend(node.iter_child_nodes())
    if folded > cap:
        refuse(f"the template's constants exceed the {cap} character limit")
    return env.from_string(source)

