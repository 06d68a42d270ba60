"""Structured output: replies under a grammar (a JSON schema, JSON objects) are exact with
every strategy, parse and validate; the target's logprobs are plain decoding's; ``n`` replies
share the prompt's cache.

Greedy: each strategy's tokens equal plain decoding's under the same grammar (the grammar is a
function of the conversation, applied to the same target rows). Sampled: every seeded reply of
every strategy validates against its schema (the distribution itself is checked in
tests/test_sampled_strategies.py). The schemas' repeated keys give N-gram drafters guesses, and
the draft is weak, so drafts are both kept and rejected: counters prove the verifier ran.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest

from potluck.engine.core.chat import Message
from potluck.engine.core.events import Finished, TokenText
from potluck.engine.core.grammar import GrammarSpec, json_object_spec, json_schema_spec
from potluck.engine.core.plain import Plain
from potluck.engine.core.runtime import ContextParams, Model
from potluck.engine.core.sampling import SamplingParams
from potluck.engine.core.sampling import logprobs as raw_logprobs
from potluck.engine.core.session import Session
from potluck.engine.core.spec import EngineSpec
from potluck.engine.core.strategy import Strategy
from potluck.engine.core.target import LocalTarget, Target
from potluck.engine.speculation.strategies.pipeinfer import PipeInfer
from potluck.engine.speculation.strategies.registry import get_strategy_class
from potluck.engine.speculation.strategies.triforce import TriForce

from .support.breadth import beyond
from .support.split_target import SplitTarget

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
    },
    "required": ["name", "age", "hobbies"],
    "additionalProperties": False,
}
BASKET = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "minItems": 2,
            "maxItems": 4,
            "items": {
                "type": "object",
                "properties": {
                    "fruit": {"enum": ["apple", "pear", "plum", "cherry"]},
                    "count": {"type": "integer", "minimum": 1, "maximum": 9},
                },
                "required": ["fruit", "count"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["items"],
    "additionalProperties": False,
}
# (prompt, schema; None: any JSON object)
CASES = [
    ("Describe a person named Ada as JSON.", PERSON),
    ("Fill a basket with fruits and say how many of each, as JSON.", BASKET),
    ("Reply with a JSON object holding your name.", None),
]
MAX_TOKENS = 96
N_CTX = 2048
THREADS = {"pearl": 2}  # PEARL runs the draft and the target on a core each
TRIFORCE_OPTIONS = {"min_context": 32, "budget": 16, "chunk": 8, "sinks": 4, "recent": 16, "gamma1": 2}
# name: (options, uses the weak draft); fixed draft lengths: drafts every round, whatever they cost
STRATEGIES: dict[str, tuple[dict[str, object], bool]] = {
    "anpd": ({"max_draft": 4}, False),
    "sd": ({"max_draft": 3}, True),
    "pearl": ({}, True),
    "minions": ({"max_draft": 3, "ahead": False}, True),
    "triforce": ({"max_draft": 3, **TRIFORCE_OPTIONS}, False),
    "pipeinfer": ({}, False),
}


def spec_of(schema: dict | None) -> GrammarSpec:
    return json_object_spec() if schema is None else json_schema_spec(schema, "schema")


def validate(text: str, schema: dict | None) -> None:
    value = json.loads(text)
    jsonschema.validate(value, schema if schema is not None else {"type": "object"})


def target_for(model: Model, name: str, stages: list[Model]) -> Target:
    if name == "pipeinfer":  # its pipelined path: two stages in this process
        return SplitTarget(stages, ContextParams(n_ctx=N_CTX, n_threads=1))
    if name == "triforce":  # a second KV stream for the retrieval cache, and the keys it scores
        return LocalTarget(model, ContextParams(n_ctx=N_CTX, n_threads=1, n_seq_max=2, kv_unified=False,
                                                observe=TriForce.observed_tensors(model)))
    return LocalTarget(model, ContextParams(n_ctx=N_CTX, n_threads=THREADS.get(name, 1)))


def build(model: Model, name: str, weak_draft: Path) -> Strategy:
    options, draft = STRATEGIES[name]
    spec = EngineSpec(strategy=name, draft=weak_draft if draft else None, n_ctx=N_CTX,
                      n_threads=THREADS.get(name, 1), strategy_options={**options, "adaptive": False})
    return get_strategy_class(name).build(model, spec)


def answers(session: Session, sampling: SamplingParams, logprobs: int | None = None) -> Iterator[Finished]:
    for prompt, schema in CASES:
        events = list(session.answer(session.prompt_for([Message("user", prompt)]), sampling, MAX_TOKENS,
                                     grammar=spec_of(schema), logprobs=logprobs))
        fin = events[-1]
        assert isinstance(fin, Finished)
        fin.extra["logprobs"] = [lp for e in events if isinstance(e, TokenText) for lp in e.logprobs]  # type: ignore[assignment]
        yield fin


@pytest.fixture(scope="module")
def stages(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Model]]:
    from potluck.engine.core.gguf_tools import slice_layers

    tmp = tmp_path_factory.mktemp("structured-slices")
    models = [Model(slice_layers(model_path, tmp / f"{lo}.gguf", lo, hi)) for lo, hi in [(0, 15), (15, 30)]]
    yield models
    for m in models:
        m.close()


@pytest.fixture(scope="module")
def plain(model: Model) -> list[Finished]:
    """Plain decoding's greedy replies under each grammar, with logprobs."""
    session = Session(model, LocalTarget(model, ContextParams(n_ctx=N_CTX, n_threads=1)), Plain())
    try:
        return list(answers(session, SamplingParams(), logprobs=3))
    finally:
        session.close()


def test_plain_replies_under_a_grammar_validate(plain: list[Finished]) -> None:
    for fin, (_, schema) in zip(plain, CASES):
        assert fin.reason == "stop", fin.text  # the grammar closed the object, then only the end came
        validate(fin.text, schema)


@pytest.mark.parametrize("name", beyond(STRATEGIES, keep=["anpd", "sd", "triforce"]))
def test_greedy_under_a_grammar_equals_plain_decoding(
    name: str, model: Model, weak_draft: Path, stages: list[Model], plain: list[Finished]
) -> None:
    """Same tokens as plain decoding under the grammar, and the same logprobs (the target's
    rows of a verify batch are plain decoding's, bit for bit)."""
    strategy = build(model, name, weak_draft)
    session = Session(model, target_for(model, name, stages), strategy)
    try:
        got = list(answers(session, SamplingParams(), logprobs=3))
        if isinstance(strategy, PipeInfer):  # its pipelined path: micro-batches in flight over the stages
            assert session.target.n_stages == 2 and strategy.counters.speculative_runs > 0
    finally:
        session.close()
    for fin, ref in zip(got, plain):
        assert fin.tokens == ref.tokens, (name, fin.text, ref.text)
        assert fin.extra["logprobs"] == ref.extra["logprobs"]
    drafted, accepted = sum(f.drafted for f in got), sum(f.accepted for f in got)
    assert drafted > accepted > 0, (name, drafted, accepted)


@pytest.mark.parametrize("name", beyond(["plain", *STRATEGIES], keep=["plain", "anpd"]))
def test_sampled_replies_under_a_grammar_validate(
    name: str, model: Model, weak_draft: Path, stages: list[Model]
) -> None:
    strategy = Plain() if name == "plain" else build(model, name, weak_draft)
    session = Session(model, target_for(model, name, stages), strategy)
    try:
        for seed in (1, 2):
            sampling = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=seed)
            for fin, (_, schema) in zip(answers(session, sampling), CASES):
                if fin.reason == "stop":
                    validate(fin.text, schema)
                else:  # cut by max_tokens: still a prefix the grammar allows
                    assert fin.reason == "length" and fin.text.lstrip().startswith("{")
    finally:
        session.close()


def test_sampled_logprobs_are_the_target_rows_of_plain_steps(model: Model, weak_draft: Path) -> None:
    """A sampled sd reply's logprobs equal those of its tokens fed to the target one by one."""
    session = Session(model, LocalTarget(model, ContextParams(n_ctx=N_CTX, n_threads=1)),
                      build(model, "sd", weak_draft))
    prompt = session.prompt_for([Message("user", "Name three colors.")])
    events = list(session.answer(prompt, SamplingParams(temperature=0.8, top_k=40, seed=5), 32, logprobs=2))
    fin = events[-1]
    assert isinstance(fin, Finished) and fin.drafted > 0
    reported = [lp for e in events if isinstance(e, TokenText) for lp in e.logprobs]
    assert [lp.token for lp in reported] == list(fin.tokens)
    session.close()
    target = LocalTarget(model, ContextParams(n_ctx=N_CTX, n_threads=1))
    row = target.decode(prompt.tokens())[-1]
    for lp in reported:
        value, top = raw_logprobs(row, lp.token, 2)
        assert (value, tuple(top)) == (lp.logprob, lp.top)
        row = target.decode([lp.token])[-1]
    target.close()


def test_n_replies_share_the_prompt(model: Model) -> None:
    """Three sampled replies: the prompt is processed once, the first reply is what the same
    request with n = 1 gets, the others differ; greedy replies are all the same."""
    target = LocalTarget(model, ContextParams(n_ctx=N_CTX, n_threads=1))
    session = Session(model, target, Plain())
    prompt = session.prompt_for([Message("user", "Tell me a short story.")])
    sampling = SamplingParams(temperature=1.0, top_k=40, seed=11)
    alone = list(session.answer(prompt, sampling, 16))[-1]
    session.load_messages([])
    target.reset()
    events = list(session.answer(prompt, sampling, 16, n=3))
    fins = [e for e in events if isinstance(e, Finished)]
    assert [f.choice for f in fins] == [0, 1, 2]
    assert fins[0].prefill_tokens == len(prompt.tokens()) and [f.prefill_tokens for f in fins[1:]] == [0, 0]
    assert isinstance(alone, Finished) and fins[0].tokens == alone.tokens
    assert len({f.tokens for f in fins}) == 3
    texts = {c: "".join(e.text for e in events if isinstance(e, TokenText) and e.choice == c) for c in range(3)}
    assert [texts[c] for c in range(3)] == [f.text for f in fins]
    assert session.messages[-1].content == fins[-1].text and len(session.messages) == 2
    greedy = [e for e in session.answer(prompt, SamplingParams(), 8, n=2) if isinstance(e, Finished)]
    assert greedy[0].tokens == greedy[1].tokens
    session.close()
