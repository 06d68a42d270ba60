"""``auto`` picks by what is loaded and how long the conversation is (anpd on a short chat,
sd with a draft model, anpd on a long document), names its pick in the events the panel
shows, and the picked path runs (drafted > 0) with plain decoding's greedy output; sampled
replies whose drafts never pass are followed by plain ones."""

from __future__ import annotations

from pathlib import Path

import pytest

from potluck.engine.core.events import Finished, ReplyStarted
from potluck.engine.core.runtime import Model
from potluck.engine.core.sampling import SamplingParams
from potluck.engine.core.session import Session
from potluck.engine.core.spec import EngineSpec
from potluck.engine.loader import open_session
from potluck.engine.speculation.strategies import auto

from .support.prompts import LONG_PROMPTS, PROMPTS
from .support.references import plain_conversation

N_CTX, THREADS, N_NEW = 2048, 2, 32
PINNED = {"adaptive": False}  # draft every round whatever this machine's load: drafted > 0 is certain


def auto_session(model_path: Path, draft: Path | None) -> Session:
    return open_session(EngineSpec(model=model_path, strategy="auto", draft=draft, n_ctx=N_CTX,
                                   n_threads=THREADS, strategy_options=PINNED))


def reply(session: Session, prompt: str) -> tuple[str, Finished]:
    events = list(session.generate(prompt, SamplingParams(), N_NEW))
    started, fin = events[0], events[-1]
    assert isinstance(started, ReplyStarted) and isinstance(fin, Finished)
    assert started.strategy == fin.strategy  # the panel shows the pick from the start
    return fin.strategy, fin


def test_short_chat_without_a_draft_uses_ngrams(model: Model, model_path: Path) -> None:
    prompt = LONG_PROMPTS[1]  # a code edit: the reply copies the prompt, so N-grams draft
    session = auto_session(model_path, None)
    try:
        shown, fin = reply(session, prompt)
    finally:
        session.close()
    assert shown == "auto: anpd"
    assert fin.drafted > 0
    assert list(fin.tokens) == plain_conversation(model, [prompt], N_NEW, n_ctx=N_CTX)[0]


@pytest.mark.slow
def test_a_draft_model_drafts_a_chat_then_ngrams_take_a_long_document(
    model: Model, model_path: Path, weak_draft: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One conversation: a short first turn goes to sd; pasting a document makes it long, and
    the next reply goes to anpd (the threshold is lowered so the document stays cheap)."""
    monkeypatch.setattr(auto, "LONG_DOCUMENT_TOKENS", 120)
    turns = [PROMPTS[0], LONG_PROMPTS[2]]
    session = auto_session(model_path, weak_draft)
    try:
        picks = [reply(session, t) for t in turns]
    finally:
        session.close()
    assert picks[0][1].prompt_tokens < 120 <= picks[1][1].prompt_tokens
    assert [shown for shown, _ in picks] == ["auto: sd", "auto: anpd"]
    assert all(fin.drafted > 0 for _, fin in picks)
    want = plain_conversation(model, turns, N_NEW, n_ctx=N_CTX)
    assert [list(fin.tokens) for _, fin in picks] == want


def test_a_long_document_goes_to_ngrams_even_with_a_draft(
    model: Model, model_path: Path, weak_draft: Path, tmp_home: Path
) -> None:
    """Nothing measured (a home of its own: earlier tests' verify costs, learnt on a busy
    machine, may say a draft model cannot pay): the length alone decides."""
    strategy = auto.Auto.build(model, EngineSpec(model=model_path, strategy="auto", draft=weak_draft,
                                                 n_ctx=N_CTX, n_threads=THREADS))
    try:
        greedy = SamplingParams()
        assert strategy.pick_for_reply(auto.LONG_DOCUMENT_TOKENS - 1, greedy) == "auto: sd"
        assert strategy.pick_for_reply(auto.LONG_DOCUMENT_TOKENS, greedy) == "auto: anpd"
        assert strategy.pick_for_reply(4450, greedy) == "auto: anpd"
    finally:
        strategy.close()


def test_auto_takes_only_the_length_options(model_path: Path) -> None:
    from potluck.engine.core.errors import PotluckError

    with pytest.raises(PotluckError, match="has no option 'ngram_max'"):
        open_session(EngineSpec(model=model_path, strategy="auto", strategy_options={"ngram_max": 4}))


def test_a_draft_model_is_left_out_where_the_measured_curve_says_it_cannot_pay(
    model: Model, weak_draft: Path, tmp_home: Path
) -> None:
    """A verify batch that costs more per extra row than a plain step (a mixture of experts
    on a compute-bound CPU can): no acceptance makes a draft model pay, so auto takes anpd."""
    strategy = auto.Auto.build(model, EngineSpec(strategy="auto", draft=weak_draft, n_ctx=N_CTX, n_threads=THREADS))
    try:
        assert isinstance(strategy, auto.Auto) and strategy.draft is not None
        assert strategy.choose(100) is strategy.draft  # nothing measured yet: the draft model
        strategy.draft.break_even.load({1: [10.0] * 4, 2: [21.0] * 4, 4: [44.0] * 4, 8: [90.0] * 4})
        assert not strategy.draft.sure_draft_pays()
        assert strategy.choose(100) is strategy.ngram
    finally:
        strategy.close()


def test_sampled_drafts_that_never_pass_send_the_next_sampled_replies_to_plain(
    model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """N-gram guesses replaced by a token the filters always remove (p = 0: never kept). The
    first sampled reply speculates and none of its drafts passes, so the next sampled reply runs
    plain, the one after probes again, then two run plain; greedy replies keep speculating."""
    from potluck.engine.speculation.drafters import Draft
    from potluck.engine.speculation.drafters.ngram import NgramDrafter

    never = 49151  # the last token of the vocabulary: far outside any top-40
    monkeypatch.setattr(NgramDrafter, "draft", lambda self, req: Draft([never] * min(2, req.max_tokens)))
    session = open_session(EngineSpec(model=model_path, strategy="auto", n_ctx=N_CTX, n_threads=1))
    sampled = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=3)
    try:
        picks = []
        for i, params in enumerate([sampled, sampled, SamplingParams(), sampled, sampled, sampled]):
            session.messages.clear()
            fin = [e for e in session.generate(PROMPTS[i % len(PROMPTS)], params, 12) if isinstance(e, Finished)][-1]
            assert fin.accepted == 0  # no draft ever passes
            picks.append(fin.strategy)
        floor = session.strategy.sampled  # type: ignore[attr-defined]
    finally:
        session.close()
    assert picks == ["auto: anpd", "auto: plain", "auto: anpd", "auto: anpd", "auto: plain", "auto: plain"]
    assert floor.plain_replies == 3 and floor.backoff == 4
