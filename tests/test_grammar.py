"""JSON schemas become grammars within bounds: a schema that would make the converter or the
grammar run away is refused quickly, naming the field; integer ranges the converter ignores
are enforced as enums; a grammar llama.cpp cannot parse is refused by name."""

from __future__ import annotations

import time

import numpy as np
import pytest

from potluck.engine.core.errors import GrammarError
from potluck.engine.core.grammar import (
    MAX_PATTERN_EXPANSION,
    GrammarSpec,
    check,
    json_schema_spec,
    pattern_expansion,
)
from potluck.engine.core.runtime import Grammar, Model

F = "response_format.json_schema.schema"


def deep(n: int) -> dict:
    node: dict = {"type": "string"}
    for _ in range(n):
        node = {"type": "array", "items": node}
    return node


@pytest.mark.parametrize(("schema", "words"), [
    (deep(200_000), f"{F}" + ".items" * 49),  # refused at depth 48 by an explicit stack, no recursion
    ({"enum": list(range(100_000))}, f"{F}.enum has 100000 values"),
    ({"type": "string", "maxLength": 10**9}, f"{F}.maxLength is 1000000000"),
    ({"type": "string", "pattern": "(((a{100}){100}){100})"}, f"{F}.pattern: its counted repetitions"),
    ({"$ref": "https://example.com/schema.json"}, f"{F}.$ref must point inside the schema"),
    ({"type": "object", "properties": {"a": {"minItems": -1}}}, f"{F}.properties.a.minItems must be"),
    ({"enum": ["x" * 70_000]}, "exceed 65536 characters"),
    ("not a schema", f"{F} must be a JSON schema object"),
])
def test_runaway_schemas_are_refused_quickly_by_field(schema: object, words: str) -> None:
    started = time.perf_counter()
    with pytest.raises(GrammarError) as e:
        json_schema_spec(schema, F)
    assert time.perf_counter() - started < 2.0
    assert words in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_pattern_expansion_bounds() -> None:
    assert pattern_expansion("[a-z]{3}-\\d{2}") == 6
    assert pattern_expansion("(ab){10}") == 20
    assert pattern_expansion("((a{100}){100}){100}") > MAX_PATTERN_EXPANSION


def test_recursive_refs_convert(model: Model) -> None:
    tree = {"$defs": {"node": {"type": "object", "properties": {"kids": {"type": "array", "items": {
        "$ref": "#/$defs/node"}, "maxItems": 2}}, "additionalProperties": False}},
        "type": "object", "properties": {"tree": {"$ref": "#/$defs/node"}}}  # as pydantic writes nested models
    check(model, json_schema_spec(tree, F), F)


def test_integer_ranges_are_enforced(model: Model) -> None:
    """The converter ignores minimum/maximum: small ranges become enums, so 7 passes where 150
    does not."""
    spec = json_schema_spec({"type": "integer", "minimum": 1, "exclusiveMaximum": 10}, F)
    for text, allowed in [("7", True), ("9", True), ("10", False), ("0", False), ("150", False)]:
        g = Grammar(model, spec.text, spec.root)
        tokens = model.tokenize(text, add_special=False, parse_special=False)
        ok = True
        for t in tokens:
            if not g.allows(np.array([t]))[0]:
                ok = False
                break
            g.accept(t)
        ok = ok and bool(g.allows(np.array([model.eos]))[0])
        g.close()
        assert ok == allowed, text


def test_a_grammar_llama_cpp_cannot_parse_is_refused_by_name(model: Model) -> None:
    with pytest.raises(GrammarError) as e:
        check(model, GrammarSpec('root ::= "a" undefined-rule'), "grammar")
    assert str(e.value).startswith("grammar: ")
