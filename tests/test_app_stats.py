"""The panels' figures are added up from a reply's events (pure: no Textual app, no model)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from potluck.app.tui.replies import Reply, ReplyFinished, reply_in_thread
from potluck.app.tui.stats import ReplyProgress, SpeedMeter
from potluck.engine.core.events import Event, Finished, NodeStatus, ReplyStarted, RoundStats, TokenText

from .app_fakes import ScriptedSession, Step


def fold(events: list[tuple[float, Event]], p: ReplyProgress | None = None) -> ReplyProgress:
    for at, event in events:
        p = (p or ReplyProgress()).after(event, at)
    assert p is not None
    return p


def finished(run_id: int, **kw: object) -> Finished:
    base: dict[str, object] = dict(
        reason="stop", text="abcdef", tokens=tuple(range(6)), prompt_tokens=50, prefill_tokens=20,
        ttft_s=0.25, prefill_s=0.1, decode_s=1.0, tokens_per_s=7.5, prefill_tokens_per_s=200.0,
        drafted=8, accepted=4, rounds=2, strategy="sd", n_past=56,
    )
    return Finished(run_id, **{**base, **kw})  # type: ignore[arg-type]


def test_live_figures_come_from_the_events_and_their_arrival_times() -> None:
    meter = SpeedMeter()
    p = fold([
        (100.0, ReplyStarted(1, "sd", prompt_tokens=50, prefill_tokens=20, n_ctx=1024)),
        (100.1, NodeStatus(1, "head", (0, 30), "ok")),  # no bearing on the figures
        (100.2, RoundStats(1, drafted=4, accepted=3, emitted=4, draft_len=4, draft_ms=1, verify_ms=2, n_past=54)),
        (100.2, TokenText(1, "abcd", (0, 1, 2, 3))),
    ])
    f = meter.sample(p, now=100.5)
    assert f.running and f.strategy == "sd"
    assert f.ttft_s == pytest.approx(0.2)
    assert f.acceptance_rate == 0.75 and f.mean_accepted_len == 3.0 and f.draft_len == 4
    assert (f.drafted, f.accepted, f.generated_tokens) == (4, 3, 4)
    assert f.tokens_per_s_now is None  # one sample is not a rate yet
    assert f.tokens_per_s_reply == pytest.approx(3 / 0.3)  # tokens after the first / time since it
    assert (f.prompt_tokens, f.n_past, f.n_ctx) == (50, 54, 1024)

    p = fold([
        (100.7, RoundStats(1, drafted=4, accepted=1, emitted=2, draft_len=5, draft_ms=1, verify_ms=2, n_past=56)),
        (100.7, TokenText(1, "ef", (4, 5))),
    ], p)
    f = meter.sample(p, now=101.0)
    assert f.tokens_per_s_now == pytest.approx(2 / 0.5)
    assert f.speed_series == pytest.approx((4.0,))
    assert f.acceptance_rate == 0.5 and f.mean_accepted_len == 2.0 and f.draft_len == 5
    assert (f.generated_tokens, f.n_past) == (6, 56)
    assert f.tokens_per_s_reply == pytest.approx(5 / 0.8)

    # Between replies: the Finished totals, the context from the last events, the series kept.
    p = fold([(101.1, finished(1, n_past=57))], p)
    f = meter.sample(p, now=105.0)
    assert not f.running and f.tokens_per_s_now is None
    assert (f.tokens_per_s_reply, f.ttft_s, f.acceptance_rate) == (7.5, 0.25, 0.5)
    assert (f.generated_tokens, f.n_past, f.n_ctx, f.draft_len) == (6, 57, 1024, 5)
    assert f.speed_series == pytest.approx((4.0,))

    # The next reply starts afresh.
    p = fold([(110.0, ReplyStarted(2, "sd", prompt_tokens=70, prefill_tokens=14, n_ctx=1024))], p)
    f = meter.sample(p, now=110.1)
    assert f.running and f.speed_series == () and f.ttft_s is None
    assert (f.generated_tokens, f.n_past, f.acceptance_rate) == (0, 56, None)  # the cache holds the rest


def test_first_token_time_is_when_the_first_token_arrived() -> None:
    p = fold([
        (5.0, ReplyStarted(3, "autoregressive", prompt_tokens=10, prefill_tokens=10, n_ctx=512)),
        (5.1, TokenText(3, "", ())),  # nothing decoded yet
        (5.4, TokenText(3, "", (7,))),  # an incomplete UTF-8 character is still a token
        (5.6, RoundStats(3, drafted=0, accepted=0, emitted=1, draft_len=0, draft_ms=0, verify_ms=1, n_past=11)),
    ])
    f = SpeedMeter().sample(p, now=6.0)
    assert f.ttft_s == pytest.approx(0.4)
    assert f.acceptance_rate is None and f.mean_accepted_len is None and f.draft_len is None  # plain decoding


def test_reply_thread_feeds_every_event_to_the_progress_with_the_clock() -> None:
    session = ScriptedSession([Step("one ", 4, 3, 4), Step("two", 4, 2, 5)], strategy="sd", n_ctx=2048)
    times: Iterator[float] = iter([1.0, 1.5, 1.5, 2.0, 2.0, 2.5])  # one per event, in order
    posted: list[object] = []
    reply = Reply(1, session, None, "hi")  # type: ignore[arg-type]  # the view is the UI's business
    idle = threading.Event()
    reply_in_thread(lambda m: posted.append(m) or True, reply, lambda: next(times), idle)

    assert idle.is_set() and [type(m) for m in posted] == [ReplyFinished]
    assert reply.take() == "one two"
    p = reply.progress
    assert not p.running and p.finished is not None and p.finished.run_id == p.run_id == 1
    assert (p.started_at, p.first_token_at) == (1.0, 1.5)
    assert (p.rounds, p.drafted, p.accepted, p.new_tokens, p.draft_len) == (2, 8, 5, 7, 5)
    assert (p.n_past, p.n_ctx) == (p.prompt_tokens + 7, 2048)


def test_esc_before_the_engine_starts_the_reply_still_stops_it() -> None:
    session = ScriptedSession([Step("never")])
    reply = Reply(1, session, None, "hi")  # type: ignore[arg-type]
    reply.cancel()  # the engine's own flag is reset when the run starts; the reply remembers
    posted: list[object] = []
    reply_in_thread(lambda m: posted.append(m) or True, reply, lambda: 0.0, threading.Event())
    (done,) = posted
    assert isinstance(done, ReplyFinished) and done.finished.reason == "cancelled"
    assert reply.take() == ""


def test_pearl_overlap_and_minions_drafters_reach_the_panel() -> None:
    from potluck.app.tui.widgets import StatsPanel  # noqa: F401  (the panel renders these rows)
    from potluck.engine.core.events import DrafterStanding

    meter = SpeedMeter()
    p = fold([
        (10.0, ReplyStarted(1, "pearl", prompt_tokens=10, prefill_tokens=10, n_ctx=512)),
        (10.2, RoundStats(1, drafted=3, accepted=2, emitted=3, draft_len=3, draft_ms=20, verify_ms=30,
                          n_past=13, overlap_ms=15)),
        (10.4, RoundStats(1, drafted=3, accepted=3, emitted=4, draft_len=3, draft_ms=20, verify_ms=30,
                          n_past=17, overlap_ms=20)),
    ])
    f = meter.sample(p, now=10.5)
    assert f.overlap_pct == pytest.approx(100 * 35 / 40)  # of the shorter busy time (drafting)
    assert f.drafters == ()

    votes = (DrafterStanding("ngram-5", 1.4, 0.6, True), DrafterStanding("lookup", 0.7, 0.2, False))
    p = fold([
        (20.0, ReplyStarted(2, "minions", prompt_tokens=10, prefill_tokens=10, n_ctx=512)),
        (20.1, RoundStats(2, drafted=2, accepted=1, emitted=2, draft_len=2, draft_ms=0.1, verify_ms=9,
                          n_past=12, drafters=votes)),
        (20.2, RoundStats(2, drafted=0, accepted=0, emitted=1, draft_len=0, draft_ms=0, verify_ms=8, n_past=13)),
    ])
    f = meter.sample(p, now=20.3)
    assert f.drafters == votes  # a plain round keeps the last standings on show
    assert f.overlap_pct is None  # nothing overlapped: no row rather than a misleading 0 %


def test_no_contradictory_figures_when_the_floor_stops_drafting() -> None:
    # 2 rounds drafted (3 of 4 each), then 40 plain rounds the floor kept plain (timed 10 ms).
    events: list[tuple[float, Event]] = [(0.0, ReplyStarted(1, "auto: anpd", 10, 10, 1024))]
    for i in range(2):
        events.append((0.1, RoundStats(1, 4, 3, 4, 4, 1.0, 20.0, 20 + 4 * i)))
    for i in range(40):
        events.append((0.2, RoundStats(1, 0, 0, 1, 0, 0.0, 10.0, 28 + i)))
    p = fold(events)
    f = SpeedMeter().sample(p, now=1.0)
    assert f.acceptance_rate == 0.75 and f.mean_accepted_len == 3.0  # per round that drafted
    assert f.draft_len is None  # not "draft length 0"
    assert f.gain == "drafting paused: did not pay"


def test_the_gain_line_compares_with_plain_decoding_measured_here() -> None:
    meter = SpeedMeter()
    plain = fold([(0.0, ReplyStarted(1, "plain", 10, 10, 1024)), (1.0, finished(1, drafted=0, accepted=0,
                                                                              strategy="plain", tokens_per_s=50.0))])
    assert meter.sample(plain, now=1.0).gain == "plain decoding"
    assert meter.plain_tok_s == 50.0
    sd = fold([(2.0, ReplyStarted(2, "sd", 10, 10, 1024)), (2.1, RoundStats(2, 4, 4, 5, 4, 1.0, 2.0, 15)),
               (3.0, finished(2, tokens_per_s=80.0))])
    assert meter.sample(sd, now=3.0).gain == "1.60× plain (50 tok/s here)"


def test_the_heads_own_stage_is_this_machine_and_layers_read_as_the_plan_writes_them() -> None:
    from potluck.app.tui.cluster import ClusterState, StageRow
    from potluck.app.tui.widgets import _plain, cluster_table

    state = ClusterState(stages=(
        StageRow("ebe6b179", "192.168.1.20:5733", (0, 14)),
        StageRow("5f0c1d2e", "127.0.0.1:40123", (14, 30)),  # the head's fallback worker joins on loopback
    ), head_layers=(30, 30))
    text = _plain(cluster_table(state, "ctrl+g"))
    assert "layers 0-14" in text and "layers 14-30" in text and "head: output layer" in text  # as `plan` prints
    assert "127.0.0.1:40123 (this machine)" in text and "192.168.1.20:5733 (this" not in text
