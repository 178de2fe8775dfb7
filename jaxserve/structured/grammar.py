"""Grammar compilation (llguidance, LRU-cached) and the per-request matcher that builds
each step's token bitmask."""

from __future__ import annotations

import collections
import json
import threading

import numpy as np

from jaxserve.structured.params import StructuredOutputsParams

# Whitespace allowed between JSON tokens unless the request says otherwise: one space, or
# one newline and an indent (up to 24 spaces or 6 tabs: pretty-printed JSON 12 levels deep),
# so that a gap is at most two tokens and a model cannot fill its budget with blank runs.
WHITESPACE = r"\x20|\x0A(\x20{0,24}|\x09{0,6})"


def bitmask_width(vocab_size: int) -> int:
    """Int32 words of one row's token bitmask (bit `t % 32` of word `t // 32` is token t)."""
    return (int(vocab_size) + 31) // 32


# JSON-schema keywords whose value is a schema, a list of schemas, or a map of them.
_SCHEMA_VALUED = {"items", "additionalProperties", "not", "if", "then", "else", "contains",
                  "propertyNames", "unevaluatedProperties", "unevaluatedItems"}
_SCHEMA_LISTS = {"anyOf", "oneOf", "allOf", "prefixItems"}
_SCHEMA_MAPS = {"properties", "patternProperties", "$defs", "definitions",
                "dependentSchemas"}


def _close_objects(schema):
    """`schema` with `additionalProperties: false` on every object that lists properties
    and says nothing about extra ones (vLLM's `disable_additional_properties`); only
    schema-valued keywords are walked (never `const`, `enum` or `default` values)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key, value in schema.items():
        if key in _SCHEMA_VALUED:
            out[key] = _close_objects(value)
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            out[key] = [_close_objects(v) for v in value]
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {k: _close_objects(v) for k, v in value.items()}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


_EXECUTOR = None  # llguidance's thread pool for batched mask fills, made on first use


def fill_bitmasks(items, vocab_size: int) -> tuple[list, dict[int, Exception]]:
    """The token bitmasks of a step's constrained requests, computed by llguidance's thread
    pool (one call for rows without proposals, one for rows with them).

    Args:
        items: Per request `(grammar, output_token_ids, proposals, num_rows)`: its
            `RequestGrammar`, its output so far, its speculative proposals (may be empty)
            and how many sampling rows it has this step. Row k gets the mask after
            proposals[:k] (k <= len(proposals)); a request that fans out (n > 1, no
            proposals) gets the same mask on every row.
        vocab_size: V.

    Returns:
        (masks, errors): per item an i32[num_rows, ceil(V / 32)] array (None for an item
        in `errors`, `{item index: exception}`: an output token the grammar rejects).
        Rows after a proposal the grammar rejects allow every token: the masked sample
        before them cannot equal that proposal, so they are never kept.
    """
    global _EXECUTOR
    import llguidance
    import llguidance.numpy as llnp

    width = bitmask_width(vocab_size)
    plan, starts, errors = [], [], {}
    offset = 0
    for i, (grammar, outputs, proposals, _) in enumerate(items):
        try:
            grammar.sync(outputs)
        except ValueError as e:
            errors[i] = e
            starts.append(None)
            continue
        drafts = [int(t) for t in proposals]
        drafts = drafts[:grammar.matcher.validate_tokens(drafts)] if drafts else []
        plan.append((grammar.matcher, offset, drafts))
        starts.append((offset, len(drafts)))
        offset += len(drafts) + 1
    if not plan:
        return [None] * len(items), errors
    if _EXECUTOR is None:
        _EXECUTOR = llguidance.LLExecutor()
    n_vocab = items[0][0].compiler.lltokenizer.vocab_size
    buf = llnp.allocate_token_bitmask(offset, n_vocab)  # i32[positions, ceil(n_vocab / 32)]
    plain = [(m, start) for m, start, drafts in plan if not drafts]
    drafted = [entry for entry in plan if entry[2]]  # llguidance refuses empty drafts
    if plain:
        llnp.fill_next_token_bitmask_par(_EXECUTOR, plain, buf)
    if drafted:
        llnp.fill_next_token_bitmask_par_with_draft_tokens(_EXECUTOR, drafted, buf)
    buf = buf[:, :width]
    extra = width * 32 - vocab_size
    if extra:  # ids past V do not exist in the model
        buf[:, -1] &= np.array([(1 << (32 - extra)) - 1], np.uint32).view(np.int32)[0]
    masks = []
    for i, (grammar, _, proposals, num_rows) in enumerate(items):
        if starts[i] is None:
            masks.append(None)
            continue
        start, valid = starts[i]
        out = np.full((num_rows, width), -1, np.int32)  # i32[num_rows, W]
        for k in range(num_rows):
            pos = min(k, len(proposals))
            if pos <= valid:
                out[k] = buf[start + pos]
        masks.append(out)
        if grammar.matcher.is_error():
            errors[i] = ValueError(f"structured output: {grammar.matcher.get_error()}")
            masks[-1] = None
    return masks, errors


def row_bitmasks(constrained: list, vocab_size: int, failed: dict) -> dict[int, np.ndarray]:
    """The token bitmask of each sampling row of the constrained requests (one batched
    `fill_bitmasks`); a request whose mask cannot be built fails alone (no rows).

    Args:
        constrained: `(first row, request, scheduled entry)` of each constrained request
            that samples this step.
        vocab_size: V.
        failed: `{request_id: exception}`, added to.

    Returns:
        `{row: i32[ceil(V / 32)]}`.
    """
    items = [(req.grammar, req.output_token_ids, s.spec_token_ids[:s.num_spec_tokens],
              s.num_samples + s.num_spec_tokens) for _, req, s in constrained]
    try:
        masks, errors = fill_bitmasks(items, vocab_size)
    except Exception as e:  # noqa: BLE001 - the constrained requests fail, not the step
        masks, errors = [None] * len(items), dict.fromkeys(range(len(items)), e)
    out: dict[int, np.ndarray] = {}
    for i, ((first, req, _), mask) in enumerate(zip(constrained, masks, strict=True)):
        if i in errors:
            failed.setdefault(req.request_id, errors[i])
        else:
            out.update(zip(range(first, first + items[i][3]), mask, strict=True))
    return out


class GrammarCompiler:
    """Turns `StructuredOutputsParams` into validated llguidance grammars for one tokenizer.

    The llguidance tokenizer (about 1 s to build) is made on first use, so engines that
    never see a constrained request never pay for it. Compiled grammars are kept in an LRU
    cache keyed by the constraint.

    Args:
        tokenizer: The model's (fast) Hugging Face tokenizer.
        vocab_size: The model's vocabulary size V: masks cover ids [0, V).
        cache_size: Grammars kept in the cache.
    """

    def __init__(self, tokenizer, vocab_size: int, cache_size: int = 256):
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self.cache_size = cache_size
        self._lltokenizer = None
        # key -> [grammar text, a fresh matcher to copy (made on the engine thread)]
        self._cache: collections.OrderedDict[str, list] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0  # grammars compiled (cache misses)

    @property
    def lltokenizer(self):
        """llguidance's view of the tokenizer, over max(V, len(tokenizer)) ids."""
        with self._lock:
            if self._lltokenizer is None:
                import llguidance.hf

                self._lltokenizer = llguidance.hf.from_tokenizer(
                    self.tokenizer, n_vocab=max(self.vocab_size, len(self.tokenizer)))
            return self._lltokenizer

    def compile(self, params: StructuredOutputsParams) -> str:
        """The validated llguidance grammar of `params` (from the cache when seen before).

        Raises:
            ValueError: The schema, regex or grammar does not compile (or uses a feature
                llguidance does not implement); the message names the field.
        """
        return self._entry(params)[0]

    def matcher(self, params: StructuredOutputsParams) -> RequestGrammar:
        """A fresh matcher of the (compiled) constraint `params`: a copy of one kept with
        the grammar, so a parser is built once per constraint, not per request."""
        import llguidance

        entry = self._entry(params)
        if entry[1] is None:  # NOTE: an evicted entry's list is still ours to fill
            entry[1] = llguidance.LLMatcher(self.lltokenizer, entry[0], log_level=0)
        return RequestGrammar(self, entry[0], entry[1])

    def _entry(self, params: StructuredOutputsParams) -> list:
        """The cache entry `[grammar text, matcher to copy or None]` of `params`, compiled
        and validated on a miss."""
        key = params.cache_key()
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        text = self._grammar_text(params)
        import llguidance

        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            text, self.lltokenizer)
        if is_error:
            raise ValueError(f"structured_outputs.{params.kind} does not compile: "
                             f"{messages[0] if messages else 'unknown error'}")
        with self._lock:
            self.num_compiled += 1
            entry = self._cache.setdefault(key, [text, None])
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return entry

    def _grammar_text(self, p: StructuredOutputsParams) -> str:
        import llguidance

        kind = p.kind
        try:
            if kind in ("json", "json_object"):
                schema = {"type": "object"} if kind == "json_object" else p.json
                if isinstance(schema, str):
                    schema = json.loads(schema)
                if p.closes_objects:
                    schema = _close_objects(schema)
                options = {"whitespace_pattern": p.whitespace_pattern or WHITESPACE}
                if p.disable_any_whitespace:
                    options = {"whitespace_flexible": False}
                return llguidance.LLMatcher.grammar_from_json_schema(schema,
                                                                     defaults=options or None)
            if kind == "regex":
                return llguidance.LLMatcher.grammar_from_regex(p.regex)
            if kind == "choice":
                # NOTE: JSON string literals are valid Lark literals (same escapes).
                return llguidance.LLMatcher.grammar_from_lark(
                    "start: " + " | ".join(json.dumps(c) for c in p.choice))
            from llguidance.gbnf_to_lark import any_to_lark

            # NOTE: GBNF / EBNF rules (`name ::= ...`) become Lark; Lark stays as is.
            return llguidance.LLMatcher.grammar_from_lark(any_to_lark(p.grammar))
        except Exception as e:  # noqa: BLE001 - GBNF syntax errors are plain Exceptions
            raise ValueError(f"structured_outputs.{kind} does not compile: {e}") from None


class RequestGrammar:
    """One request's grammar state: follows its output tokens and masks its next token.

    The matcher is synchronised lazily with the tokens it is given (outputs only grow; a
    shorter or different list rolls back), so preemption, which keeps a request's tokens,
    needs nothing, and speculative proposals are consumed for one mask and rolled back.

    Args:
        compiler: The compiler that made `grammar` (its tokenizer and vocabulary).
        grammar: A validated llguidance grammar.
    """

    def __init__(self, compiler: GrammarCompiler, grammar: str, prototype=None):
        import llguidance

        self.compiler = compiler
        self.grammar = grammar
        self._prototype = prototype if prototype is not None else llguidance.LLMatcher(
            compiler.lltokenizer, grammar, log_level=0)
        self._matcher = self._prototype.deep_copy()
        self._tokens: list[int] = []  # the output tokens the matcher has followed
        # How many of them it consumed: tokens after the grammar completed (EOS sampled
        # again under ignore_eos) are kept without being consumed.
        self._consumed = 0

    def fork(self) -> RequestGrammar:
        """A matcher of the same grammar for a forked request (n > 1)."""
        return RequestGrammar(self.compiler, self.grammar, self._prototype)

    @property
    def is_stopped(self) -> bool:
        """Whether the grammar is complete (only EOS can follow)."""
        return self._matcher.is_stopped()

    @property
    def matcher(self):
        """The llguidance `LLMatcher` that follows the tokens given to `sync` (its masks
        are those of the next token after them)."""
        return self._matcher

    def sync(self, tokens) -> None:
        """Makes the matcher follow exactly `tokens` (the request's output so far): new
        tokens are consumed, a shorter or different list rolls back first.

        Raises:
            ValueError: A token does not follow the grammar (those before it are kept), or
                the matcher cannot roll back that far.
        """
        done = self._tokens
        n = len(done)
        if len(tokens) < n or (n and tokens[n - 1] != done[-1]):
            common = next((i for i, (a, b) in enumerate(zip(done, tokens, strict=False))
                           if a != b), min(n, len(tokens)))
            back = max(0, self._consumed - common)
            if back and not self._matcher.rollback(back):
                raise ValueError(f"structured output: cannot roll back {back} tokens: "
                                 f"{self._matcher.get_error()}")
            self._consumed -= back
            del done[common:]
            n = common
        new = [int(t) for t in tokens[n:]]
        if not new:
            return
        taken = self._matcher.try_consume_tokens(new) if self._consumed == n else 0
        self._consumed += taken
        if taken < len(new) and self._matcher.is_stopped() and not self._matcher.is_error():
            # the grammar is complete: only EOS may follow (ignore_eos samples it again)
            eos = set(self.compiler.lltokenizer.eos_tokens)
            taken += next((i for i, t in enumerate(new[taken:]) if t not in eos),
                          len(new) - taken)
        if taken < len(new):
            done.extend(new[:taken])
            raise ValueError(f"structured output: token {new[taken]} at output position "
                             f"{n + taken} does not follow the grammar "
                             f"({self._matcher.get_error() or 'rejected'})")
        done.extend(new)

    def bitmask(self, output_token_ids, proposals=()) -> np.ndarray:
        """The allowed next tokens after `output_token_ids` (+ `proposals`), as bits: one
        row of `fill_bitmasks` (the engine builds a whole step's rows in one call).

        Args:
            output_token_ids: The request's output so far.
            proposals: Speculative tokens assumed to follow it (rolled back afterwards).
                If the grammar rejects one, the row's token is never kept (the target's
                masked sample cannot equal the rejected proposal), so every id is allowed.

        Returns:
            i32[ceil(V / 32)]: bit `t % 32` of word `t // 32` set when token t is allowed.

        Raises:
            ValueError: An output token does not follow the grammar.
        """
        masks, errors = fill_bitmasks(
            [(self, output_token_ids, list(proposals), len(proposals) + 1)],
            self.compiler.vocab_size)
        if errors:
            raise errors[0]
        return masks[0][-1]
