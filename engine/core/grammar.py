"""Grammars that constrain a reply: JSON schemas compiled within bounds, and a grammar's state
kept in step with the conversation.

- :class:`GrammarSpec` is a GBNF text, checked against the model's vocabulary by :func:`check`
  (off the engine thread: the server checks a request's grammar while it parses the request).
- :func:`json_schema_spec` turns a JSON schema (``response_format``, a tool's parameters) into
  one, with llama.cpp's converter as llama-cpp-python ships it (never a converter of our own).
  A schema is walked first, without recursion, and refused where it would make the converter or
  the grammar run away (deep nesting, huge enums, repetition counts, regular expressions that
  expand); every refusal names the field, as the client wrote it.
- :class:`ReplyGrammar` is the state a sampler asks: ``at(after)`` is the grammar after the
  conversation so far plus ``after`` (guessed tokens past it). It follows the conversation
  list the session extends, accepting each new token once; guesses are walked on one scratch
  copy, cloned again only when a pass goes back (one clone per verify round).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .errors import GrammarError
from .runtime import Grammar, Model, json_schema_grammar

# Bounds on what a JSON schema may ask for (each refusal names the field). The converter's
# output and llama.cpp's grammar grow with each of these; within them a schema converts in
# milliseconds and a grammar check stays microseconds a token (tests/test_grammar.py).
MAX_SCHEMA_NODES = 5000  # objects and arrays in the schema
MAX_SCHEMA_DEPTH = 48  # nesting of objects and arrays
MAX_ENUM = 1000  # values of one enum
MAX_LITERAL_CHARS = 65536  # characters of enum/const values, the whole schema
MAX_COUNT = 1000  # minItems, maxItems, minLength, maxLength, minProperties, maxProperties
MAX_PATTERN_CHARS = 1000
MAX_PATTERN_EXPANSION = 20000  # characters a pattern's counted repetitions may spell out
MAX_GRAMMAR_CHARS = 512 * 1024  # the GBNF text


@dataclass(frozen=True)
class GrammarSpec:
    """A GBNF grammar a reply must follow (``root`` is its top rule)."""

    text: str
    root: str = "root"


def check(model: Model, spec: GrammarSpec, field: str) -> None:
    """Refuse (GrammarError naming ``field``) a grammar llama.cpp cannot parse for ``model``."""
    if len(spec.text) > MAX_GRAMMAR_CHARS:
        raise GrammarError(f"{field}: the grammar is {len(spec.text)} characters, more than {MAX_GRAMMAR_CHARS}")
    try:
        Grammar(model, spec.text, spec.root).close()
    except GrammarError as e:
        raise GrammarError(f"{field}: {e}") from None


def json_schema_spec(schema: object, field: str) -> GrammarSpec:
    """The grammar of JSON values matching ``schema`` (a parsed JSON schema); ``field`` is where
    the client wrote it (``response_format.json_schema.schema``), for refusals."""
    if schema is True or schema == {}:
        schema = {}
    if not isinstance(schema, dict):
        raise GrammarError(f"{field} must be a JSON schema object")
    check_schema(schema, field)
    key = json.dumps(_integer_ranges(schema))  # property order is the output's order: kept
    return _converted(key, field)


MAX_RANGE_ENUM = 256  # integer ranges written out as enums (see _integer_ranges)


def _integer_ranges(node: object) -> object:
    """A copy of ``node`` with each integer range of at most ``MAX_RANGE_ENUM`` values written
    as the enum of its values: llama-cpp-python's converter ignores ``minimum`` and ``maximum``
    (its source leaves them unhandled), and an enum it does constrain. Wider ranges stay unconstrained
    (README: structured output). Called after :func:`check_schema`: the depth is bounded."""
    if isinstance(node, list):
        return [_integer_ranges(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: (v if k in ("enum", "const", "default", "examples") else _integer_ranges(v)) for k, v in node.items()}
    if out.get("type") == "integer" and "enum" not in out and "const" not in out:
        lo, hi = _bound(out, "minimum", "exclusiveMinimum", 1), _bound(out, "maximum", "exclusiveMaximum", -1)
        if lo is not None and hi is not None and 0 <= hi - lo < MAX_RANGE_ENUM:
            rest = {k: v for k, v in out.items() if k not in _RANGE_KEYS}
            return {**rest, "enum": list(range(lo, hi + 1))}
    return out


_RANGE_KEYS = ("type", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def _bound(node: dict, inclusive: str, exclusive: str, step: int) -> int | None:
    """The integer bound ``node`` sets on one side (the tighter of the two keywords), or None."""
    import math

    found = []
    for key, shift in ((inclusive, 0), (exclusive, step)):
        value = node.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            edge = math.ceil(value) if step > 0 else math.floor(value)
            if shift and edge == value:
                edge += shift
            found.append(int(edge))
    if not found:
        return None
    return max(found) if step > 0 else min(found)


@functools.lru_cache(maxsize=128)
def _converted(schema_json: str, field: str) -> GrammarSpec:
    try:
        text = json_schema_grammar(json.loads(schema_json))
    except RecursionError:
        raise GrammarError(f"{field}: its $refs nest too deeply to convert") from None
    except Exception as e:  # the converter raises ValueError, AssertionError, KeyError, ...
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise GrammarError(f"{field}: llama.cpp's JSON-schema converter cannot take it ({why[:200]})") from None
    if len(text) > MAX_GRAMMAR_CHARS:
        raise GrammarError(
            f"{field}: its grammar would be {len(text)} characters (at most {MAX_GRAMMAR_CHARS}); "
            "simplify the schema"
        )
    return GrammarSpec(text)


# JSON objects of any shape (``response_format: {"type": "json_object"}``), as llama-server
# builds it: the schema ``{"type": "object"}`` through the same converter.
def json_object_spec() -> GrammarSpec:
    return json_schema_spec({"type": "object"}, "response_format")


_COUNTS = ("minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties")


def check_schema(schema: dict, field: str) -> None:
    """Refuse, naming the field, a schema the converter or the grammar would choke on. Walks
    with an explicit stack: a schema nested a million deep is refused at depth 48, in time
    proportional to what was read."""
    nodes = 0
    literal_chars = 0
    stack: list[tuple[object, str, int]] = [(schema, field, 0)]
    while stack:
        node, path, depth = stack.pop()
        if isinstance(node, dict):
            nodes += 1
            if depth > MAX_SCHEMA_DEPTH:
                raise GrammarError(f"{path}: the schema nests deeper than {MAX_SCHEMA_DEPTH} levels")
            if nodes > MAX_SCHEMA_NODES:
                raise GrammarError(f"{field}: the schema has more than {MAX_SCHEMA_NODES} objects")
            for key in _COUNTS:
                if key in node:
                    value = node[key]
                    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                        raise GrammarError(f"{path}.{key} must be a whole number >= 0")
                    if value > MAX_COUNT:
                        raise GrammarError(f"{path}.{key} is {value}; at most {MAX_COUNT} can be constrained")
            if "enum" in node:
                values = node["enum"]
                if not isinstance(values, list):
                    raise GrammarError(f"{path}.enum must be an array")
                if len(values) > MAX_ENUM:
                    raise GrammarError(f"{path}.enum has {len(values)} values; at most {MAX_ENUM}")
                literal_chars += len(json.dumps(values))
            if "const" in node:
                literal_chars += len(json.dumps(node["const"]))
            if literal_chars > MAX_LITERAL_CHARS:
                raise GrammarError(f"{path}: enum and const values exceed {MAX_LITERAL_CHARS} characters")
            ref = node.get("$ref")
            if ref is not None and (not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/"))):
                raise GrammarError(f"{path}.$ref must point inside the schema (\"#/...\"), got {str(ref)[:80]!r}")
            pattern = node.get("pattern")
            if pattern is not None:
                _check_pattern(pattern, f"{path}.pattern")
            for key, value in node.items():
                if key in ("enum", "const", "default", "examples"):
                    continue  # values, not schemas
                if isinstance(value, (dict, list)):
                    stack.append((value, f"{path}.{key}", depth + 1))
        elif isinstance(node, list):
            nodes += 1
            if depth > MAX_SCHEMA_DEPTH:
                raise GrammarError(f"{path}: the schema nests deeper than {MAX_SCHEMA_DEPTH} levels")
            for i, value in enumerate(node):
                if isinstance(value, (dict, list)):
                    stack.append((value, f"{path}[{i}]", depth + 1))


def _check_pattern(pattern: object, field: str) -> None:
    """A regular expression the converter spells out into grammar text: refuse long ones and
    counted repetitions that multiply (``(a{100}){100}`` is 10,000 characters of grammar)."""
    if not isinstance(pattern, str):
        raise GrammarError(f"{field} must be a string")
    if len(pattern) > MAX_PATTERN_CHARS:
        raise GrammarError(f"{field} is {len(pattern)} characters; at most {MAX_PATTERN_CHARS}")
    if pattern_expansion(pattern) > MAX_PATTERN_EXPANSION:
        raise GrammarError(
            f"{field}: its counted repetitions spell out more than {MAX_PATTERN_EXPANSION} characters"
        )


def pattern_expansion(pattern: str) -> int:
    """An upper bound on the characters the converter writes for ``pattern``: each atom counts
    one, a group the sum of its parts, ``{n,m}`` multiplies what it follows by ``max(n, m)``."""
    sizes: list[int] = [0]  # size of the group being read, per nesting level
    last: list[int] = [0]  # size of the last atom or group at that level (what a quantifier repeats)
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            sizes[-1] += 1
            last[-1] = 1
            i += 2
            continue
        if c == "[":
            j = i + 1
            while j < len(pattern) and pattern[j] != "]":
                j += 2 if pattern[j] == "\\" else 1
            sizes[-1] += 1
            last[-1] = 1
            i = j + 1
            continue
        if c == "(":
            sizes.append(0)
            last.append(0)
        elif c == ")" and len(sizes) > 1:
            inner = sizes.pop()
            last.pop()
            sizes[-1] += inner
            last[-1] = inner
        elif c == "{":
            j = pattern.find("}", i)
            counts = pattern[i + 1 : j].split(",") if j > i else []
            if counts and all(x.strip().isdigit() or x.strip() == "" for x in counts):
                n = max(int(x) for x in counts if x.strip()) if any(x.strip() for x in counts) else 1
                sizes[-1] += last[-1] * max(0, n - 1)
                last[-1] *= max(1, n)
                i = j + 1
                continue
            sizes[-1] += 1
            last[-1] = 1
        elif c not in "|*+?^$":
            sizes[-1] += 1
            last[-1] = 1
        i += 1
        if sizes[-1] > 10 * MAX_PATTERN_EXPANSION:
            return sizes[-1]
    return sum(sizes)


class ReplyGrammar:
    """A grammar over one reply, kept in step with the conversation (see the module docstring).

    ``history`` is the conversation list the session extends as rounds are accepted; the
    grammar starts after its current end. Only tokens a sampler drew under this grammar may
    reach it: llama.cpp aborts the process on a refused token, so each is checked first.
    """

    def __init__(self, grammar: Grammar, history: list[int]) -> None:
        self._base = grammar
        self._history = history
        self._synced = len(history)  # history[:_synced] is in _base
        self._scratch: Grammar | None = None
        self._scratch_from = -1  # _synced when the scratch copy was cloned
        self._path: list[int] = []  # guesses accepted into the scratch copy

    @classmethod
    def open(cls, model: Model, spec: GrammarSpec, history: list[int]) -> ReplyGrammar:
        return cls(Grammar(model, spec.text, spec.root), history)

    def at(self, after: Sequence[int] = ()) -> Grammar:
        """The grammar after the conversation and ``after`` (tokens it allowed)."""
        self._sync()
        if not after:
            return self._base
        n = len(self._path)
        reusable = self._scratch is not None and self._scratch_from == self._synced
        if not (reusable and n <= len(after) and list(after[:n]) == self._path):
            self._drop_scratch()
            self._scratch = self._base.clone()
            self._scratch_from = self._synced
            self._path = []
        scratch = self._scratch
        assert scratch is not None
        for token in after[len(self._path) :]:
            _accept_checked(scratch, token)
            self._path.append(token)
        return scratch

    def allowed_run(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens`` (guesses after the conversation) the grammar allows in a row."""
        self._sync()
        walk = self._base.clone()
        try:
            for i, token in enumerate(tokens):
                if not walk.allows(np.array([token]))[0]:
                    return i
                walk.accept(token)
            return len(tokens)
        finally:
            walk.close()

    def fork(self) -> Grammar:
        """A copy of the state after the conversation, for a drafter to walk on its own."""
        self._sync()
        return self._base.clone()

    def _sync(self) -> None:
        history = self._history
        while self._synced < len(history):
            _accept_checked(self._base, history[self._synced])
            self._synced += 1

    def _drop_scratch(self) -> None:
        if self._scratch is not None:
            self._scratch.close()
            self._scratch = None

    def close(self) -> None:
        self._drop_scratch()
        self._base.close()


def _accept_checked(grammar: Grammar, token: int) -> None:
    if not grammar.allows(np.array([token]))[0]:
        raise GrammarError(f"token {token} reached a reply its grammar refuses (a bug: please report it)")
    grammar.accept(token)
