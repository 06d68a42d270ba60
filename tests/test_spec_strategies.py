"""`sd` and `anpd` are lossless: greedy output equals plain decoding token for token (sampled
output keeps the target's distribution: tests/test_sampled_strategies.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from potluck.engine.core.events import Finished, RoundStats
from potluck.engine.core.runtime import ContextParams, Model
from potluck.engine.core.sampling import SamplingParams
from potluck.engine.core.session import Session
from potluck.engine.core.spec import EngineSpec
from potluck.engine.core.strategy import Strategy
from potluck.engine.core.target import MAX_EXACT_BATCH, LocalTarget
from potluck.engine.speculation.strategies.registry import get_strategy_class

from .conftest import flat_cost_line
from .support.breadth import beyond
from .support.prompts import LONG_PROMPTS, RAW_PROMPTS, TURNS
from .support.references import plain_conversation, plain_reply
from .support.sampled import generation, next_round

MAX_TOKENS = 256
# One thread: this box has 2 cores shared with other jobs, and two spinning threads on a
# busy box run 4x slower. Exactness holds for any thread count as long as it is the same.
THREADS = 1
TURN_TOKENS = 64


def build(name: str, model: Model, draft: Path | None = None, **options: object) -> Strategy:
    spec = EngineSpec(
        strategy=name, draft=draft, n_ctx=2048, n_threads=THREADS, strategy_options=dict(options)
    )
    return get_strategy_class(name).build(model, spec)


def make_session(model: Model, strategy: Strategy) -> Session:
    return Session(model, LocalTarget(model, ContextParams(n_ctx=2048, n_threads=THREADS)), strategy)


def reply(session: Session, prompt: str, max_tokens: int = MAX_TOKENS) -> tuple[list[int], list]:
    rounds: list[RoundStats] = []
    for ev in session.generate(prompt, SamplingParams(), max_tokens):
        if isinstance(ev, RoundStats):
            rounds.append(ev)
        elif isinstance(ev, Finished):
            return list(ev.tokens), rounds
    raise AssertionError("no Finished event")


class References(dict[str, list[int]]):
    """Plain decoding's greedy replies, each decoded when a test first asks for it (a prompt
    alone, or ``turnN``: turn N of one multi-turn conversation), so a module run without its
    slow tests decodes only what its other tests compare with."""

    def __init__(self, model: Model) -> None:
        super().__init__()
        self.model = model

    def __missing__(self, key: str) -> list[int]:
        if key.startswith("turn"):
            for i, tokens in enumerate(plain_conversation(self.model, TURNS, TURN_TOKENS)):
                self[f"turn{i}"] = tokens
        else:
            self[key] = plain_reply(self.model, key, MAX_TOKENS)
        return self[key]


@pytest.fixture(scope="module")
def reference(model: Model) -> References:
    return References(model)


def spec_sessions(model: Model, weak_draft: Path, only: str | None = None) -> Iterator[tuple[str, Strategy]]:
    # Fixed lengths: the adaptive path stops drafting whenever drafting loses on this box
    # (the floor), and this test must exercise rejected drafts whatever the machine's load.
    if only in (None, "anpd"):
        yield "anpd", build("anpd", model, adaptive=False)
    if only in (None, "sd"):
        yield "sd", build("sd", model, weak_draft, adaptive=False, max_draft=2)


def test_adaptive_anpd_equals_plain_decoding(model: Model, reference: dict[str, list[int]]) -> None:
    """Default options (adaptive length, break-even, the floor's gate), with a kept cost line
    that lets drafts through: probes draft, the gate judges them on real timings."""
    flat_cost_line(model, THREADS)
    strategy = build("anpd", model)
    drafted = 0
    for prompt in LONG_PROMPTS[:3]:
        session = make_session(model, strategy)
        tokens, rounds = reply(session, prompt)
        session.target.close()
        assert tokens == reference[prompt], prompt[:30]
        drafted += sum(r.drafted for r in rounds)
    assert drafted > 0
    assert max(len(reference[p]) for p in LONG_PROMPTS[:3]) == MAX_TOKENS  # a long reply among them
    strategy.close()


def test_a_cost_line_that_forbids_drafting_is_probed_again(
    model: Model, reference: dict[str, list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A line kept from a busy moment says no draft can pay: every PROBE_EVERY rounds a short
    draft re-measures a batch, and the fresh timing lets drafting back in."""
    from potluck.engine.speculation.adaptive import DraftBreakEven
    from potluck.engine.speculation.strategies import speculative
    from potluck.engine.speculation.strategies.speculative import Speculative

    monkeypatch.setattr(speculative, "PROBE_EVERY", 16)  # the reply is shorter than 64 rounds
    strategy = build("anpd", model)
    assert isinstance(strategy, Speculative)
    strategy.costs = None  # keep the poisoned line out of the shared cost file
    strategy.break_even = DraftBreakEven()
    strategy.break_even.load({1: [10.0] * 12, 2: [3000.0] * 12, 4: [9000.0] * 12})
    assert strategy.break_even.threshold() == 1.0
    prompt = LONG_PROMPTS[1]  # the code rewrite: the N-gram tables have guesses
    session = make_session(model, strategy)
    tokens, rounds = reply(session, prompt)
    session.target.close()
    assert tokens == reference[prompt]
    assert len(rounds) > 16 and sum(r.drafted for r in rounds) > 0
    assert strategy.break_even.threshold() < 1.0  # the probe's timing replaced the stale line
    strategy.close()


@pytest.mark.slow  # each strategy with fixed drafts by default: test_batch_exact (every strategy), test_structured
def test_greedy_equals_plain_decoding(  # (sd, anpd) and anpd's adaptive and multi-turn replies below
    model: Model, weak_draft: Path, reference: dict[str, list[int]]
) -> None:
    """Every prompt. `sd` stops at 128 tokens: its 20-layer draft makes a token cost about
    5 plain steps, and 4 x 128 tokens already hold about 60 rejections."""
    for name, strategy in spec_sessions(model, weak_draft):
        drafted = accepted = 0
        limit = MAX_TOKENS if name == "anpd" else 128
        for prompt in LONG_PROMPTS:
            session = make_session(model, strategy)
            draft_ctx = getattr(strategy.drafter, "ctx", None)  # type: ignore[attr-defined]
            if draft_ctx is not None:
                draft_ctx.compute_threads.clear()
            tokens, rounds = reply(session, prompt, limit)
            if draft_ctx is not None:  # one thread computes both models (one OpenMP team)
                computed = session.target.stage.ctx.compute_threads  # type: ignore[attr-defined]
                assert draft_ctx.compute_threads == computed and len(computed) == 1
            session.target.close()
            assert tokens == reference[prompt][:limit], f"{name} differs on {prompt[:30]!r}"
            drafted += sum(r.drafted for r in rounds)
            accepted += sum(r.accepted for r in rounds)
            assert all(r.draft_len + 1 <= MAX_EXACT_BATCH for r in rounds)
        assert drafted > 0 and 0 < accepted < drafted, (name, drafted, accepted)
        strategy.close()


@pytest.mark.parametrize("only", beyond(["anpd", "sd"], keep=["anpd"]))
def test_multi_turn_greedy_equals_plain_decoding(
    only: str, model: Model, weak_draft: Path, reference: dict[str, list[int]]
) -> None:
    for name, strategy in spec_sessions(model, weak_draft, only):
        session = make_session(model, strategy)
        for i, turn in enumerate(TURNS):
            assert reply(session, turn, TURN_TOKENS)[0] == reference[f"turn{i}"], f"{name} turn {i}"
        session.close()


@pytest.mark.slow  # the largest exact batch by default: test_batch_exact
def test_long_fixed_drafts_stay_exact(model: Model, reference: dict[str, list[int]]) -> None:
    """Speculation length fixed at the largest exact batch: 47 drafts + the pending token."""
    strategy = build("anpd", model, max_draft=MAX_EXACT_BATCH - 1, adaptive=False)
    session = make_session(model, strategy)
    prompt = LONG_PROMPTS[1]  # code editing: long n-gram matches
    tokens, rounds = reply(session, prompt, 128)
    assert tokens == reference[prompt][:128]
    assert max(r.drafted for r in rounds) > 10
    assert max(r.draft_len for r in rounds) <= MAX_EXACT_BATCH - 1
    session.close()


# --------------------------------------------------------------------------- the first token


@pytest.mark.parametrize("name", ["sd", "pearl"])
def test_the_first_token_does_not_wait_for_the_draft_model(name: str, model: Model, weak_draft: Path) -> None:
    """The first token is sampled from the prompt's own logits before the draft model reads
    the prompt (its prefill added 50-60 % to the time to first token); it catches up after."""
    spec = EngineSpec(strategy=name, draft=weak_draft, n_ctx=2048, n_threads=2,  # PEARL needs 2
                      strategy_options={"max_draft": 2, "adaptive": False})
    strategy = get_strategy_class(name).build(model, spec)
    target = LocalTarget(model, ContextParams(n_ctx=256, n_threads=THREADS))
    prompt = model.tokenize(RAW_PROMPTS["sd"], add_special=True)
    g = generation(target, prompt, target.decode(prompt)[-1].copy(), 0, model)
    strategy.prepare(g)
    drafter = strategy.drafter  # type: ignore[attr-defined]
    rounds = strategy.run(g)
    first = next_round(g, rounds)
    assert first.drafted == 0 and drafter.tokens == []  # out before the draft read anything
    second = next_round(g, rounds)
    assert second.drafted > 0 and drafter.tokens[: len(prompt) + 1] == g.history[: len(prompt) + 1]
    assert first.prompt_ms == 0.0 and second.prompt_ms > 0.0  # its prefill, counted as prompt processing
    rounds.close()
    target.close()
    strategy.close()


def test_plain_decoding_answers_to_its_former_name() -> None:
    """config.toml files and scripts written before the rename say 'autoregressive'."""
    plain = get_strategy_class("plain")
    assert plain.name == "plain" and get_strategy_class("autoregressive") is plain
