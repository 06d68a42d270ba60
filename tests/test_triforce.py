"""TriForce: greedy output equals plain decoding on a long conversation at 2 threads (past
512 KV cells, so the per-sequence KV streams and the whole-sequence copy are exercised),
every level of the hierarchy ran, and short conversations switch to anpd; on a mixture of
experts too (slow)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from potluck.engine.core.errors import PotluckError
from potluck.engine.core.events import Finished
from potluck.engine.core.runtime import Model
from potluck.engine.core.spec import EngineSpec
from potluck.engine.core.strategy import Strategy
from potluck.engine.lab.benchmark import load_prompts
from potluck.engine.lab.fixtures import build_shape
from potluck.engine.loader import open_session
from potluck.engine.speculation.adaptive import DraftBreakEven
from potluck.engine.speculation.strategies.triforce import TriForce

N_CTX = 4096
THREADS = 2


def _middle_half(document: str) -> str:
    """The benchmark's 2K-token chronicle cut to its middle paragraphs (~1.1K tokens, the answer
    kept): still past 512 cells with a retrieval cache under a quarter of the context, at half
    the prefill time (three prefills are most of this module's time)."""
    intro, *paragraphs, question = document.split("\n\n")
    n = len(paragraphs)
    return "\n\n".join([intro, *paragraphs[n // 4 : n - n // 4], question])


LONG_TURNS = (_middle_half(load_prompts("long")[1]), "Now answer again in one short sentence.")  # then a follow-up
SHORT_TURNS = ("Summarize in one sentence: the cat sat on the mat all day.",)


def _replies(strategy: str, turns: tuple[str, ...], options: dict[str, object] | None = None,
             max_tokens: int = 48, before_turn: Callable[[int, Strategy], None] | None = None,
             model: Path | None = None) -> tuple[list[tuple[int, ...]], object, object]:
    """The replies' tokens, the strategy (its counters) and the staged prefill's counters."""
    spec = EngineSpec(model=model, strategy=strategy, n_ctx=N_CTX, n_threads=THREADS,
                      strategy_options=options or {})
    session = open_session(spec)
    try:
        out = []
        for i, turn in enumerate(turns):
            if before_turn is not None:
                before_turn(i, session.strategy)
            done = [ev for ev in session.generate(turn, max_tokens=max_tokens) if isinstance(ev, Finished)]
            assert done[0].reason in ("stop", "length")
            out.append(done[0].tokens)
        prefill = session.target.stage.prefill  # type: ignore[attr-defined]
        return out, session.strategy, prefill.counters if prefill is not None else None
    finally:
        session.close()


@pytest.fixture(scope="module")
def plain_long() -> list[tuple[int, ...]]:
    return _replies("plain", LONG_TURNS)[0]


def test_long_multi_turn_equals_plain(plain_long: list[tuple[int, ...]]) -> None:
    """Fixed drafting (no adaptation) and a short stride: both levels draft every round, the
    full cache rejects some retrieval drafts, and the cache is rebuilt several times."""
    options = {"adaptive": False, "max_draft": 4, "stride": 8, "budget": 128}
    got, strategy, prefill = _replies("triforce", LONG_TURNS, options)
    assert got == plain_long
    # the prompt prefilled in the F16 twin (past 512 cells) and decoded in BF16 after the hand-over
    assert prefill.staged_jobs >= 2 and prefill.handovers >= 1  # type: ignore[attr-defined]
    c = strategy.counters  # type: ignore[attr-defined]
    assert c.long_replies == 2 and c.short_replies == 0
    assert c.retrieval_drafted > c.retrieval_accepted > 0  # accepted and rejected at level 2
    assert c.ngram_drafted > 0 and c.retrieval_steps > 0  # level 1 ran
    assert c.rebuilds >= 4  # once per reply plus the stride
    assert 0 < c.budget < c.context / 4  # the retrieval cache really is sparse


@pytest.mark.slow
def test_long_default_settings_equal_plain(plain_long: list[tuple[int, ...]]) -> None:
    """The defaults (adaptive lengths, the gate). Before the second turn the verify-cost line
    says an extra row is nearly free but a retrieval step (measured in the first turn) costs
    more than a whole plain step: rounds then skip the retrieval level and verify N-gram
    drafts directly."""

    def cheap_rows(turn: int, strategy: Strategy) -> None:
        if turn == 1:
            line = DraftBreakEven()
            line.load({1: [10.0] * 12, 2: [10.5] * 12})
            strategy.break_even = line  # type: ignore[attr-defined]
            strategy.retrieval.step_ms = max(strategy.retrieval.step_ms, 20.0)  # type: ignore[attr-defined]

    got, strategy, _ = _replies("triforce", LONG_TURNS, before_turn=cheap_rows)
    assert got == plain_long
    c = strategy.counters  # type: ignore[attr-defined]
    assert c.long_replies == 2 and c.rebuilds >= 1
    assert c.direct_drafted > 0


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["gpt-oss-small", "gemma4-small"])
def test_a_mixture_of_experts_equals_plain(shape: str) -> None:
    """gpt-oss-small (sliding-window layers, attention sinks, routed experts) and gemma4-small
    (sliding and global layers of different head widths and KV heads): the retrieval level
    drafts over a subset of its attention cells, mostly wrong, and the target's verify batches
    keep the reply plain decoding's."""
    path = build_shape(shape)
    options = {"adaptive": False, "max_draft": 4, "stride": 8, "budget": 128}
    want = _replies("plain", LONG_TURNS[:1], max_tokens=32, model=path)[0]
    got, strategy, _ = _replies("triforce", LONG_TURNS[:1], options, max_tokens=32, model=path)
    assert got == want
    c = strategy.counters  # type: ignore[attr-defined]
    assert c.long_replies == 1 and c.retrieval_drafted > c.retrieval_accepted and c.rebuilds >= 1


def test_short_conversation_runs_as_anpd() -> None:
    want = _replies("plain", SHORT_TURNS)[0]
    got, strategy, _ = _replies("triforce", SHORT_TURNS)
    assert got == want
    c = strategy.counters  # type: ignore[attr-defined]
    assert c.short_replies == 1 and c.long_replies == 0 and c.rebuilds == 0


def test_option_errors(model: Model) -> None:
    with pytest.raises(PotluckError, match="has no option 'budgets'"):
        TriForce.build(model, EngineSpec(strategy="triforce", strategy_options={"budgets": 4}))
    with pytest.raises(PotluckError, match="chunk must be a whole number"):
        TriForce.build(model, EngineSpec(strategy="triforce", strategy_options={"chunk": 0}))


def test_observes_two_layers_of_queries_and_keys(model: Model) -> None:
    names = TriForce.observed_tensors(model)
    assert len(names) == 4 and {n.split("-")[0] for n in names} == {"Qcur", "Kcur"}
