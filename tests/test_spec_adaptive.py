"""The adaptive speculation length moves toward the cheapest length and falls back to 0."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from potluck.engine.speculation.adaptive import (
    DraftBreakEven,
    DraftGate,
    LengthConfig,
    SampledReplies,
    SpeculationLength,
)
from potluck.engine.speculation.costs import CostBook, SavedLine


def simulate(
    alpha: float, draft_ms: float, rounds: int = 600, seed: int = 0
) -> tuple[SpeculationLength, list[int]]:
    """A synthetic machine: batch cost grows like docs/facts.md §6, acceptance is i.i.d.

    Returns the controller and the length used in every round.
    """
    rng = np.random.default_rng(seed)
    ctl = SpeculationLength(LengthConfig(s_init=4, s_max=12))
    used: list[int] = []
    for _ in range(rounds):
        k = ctl.length()
        used.append(k)
        accepted = 0
        while accepted < k and rng.random() < alpha:
            accepted += 1
        verify_ms = 10.0 * (1 + 0.45 * k) * rng.uniform(0.95, 1.05)
        ctl.record(accepted + 1, draft_ms * k, verify_ms)
    return ctl, used


def expected_cost_per_token(alpha: float, draft_ms: float, k: int) -> float:
    tokens = sum(alpha**i for i in range(k + 1))
    return (10.0 * (1 + 0.45 * k) + draft_ms * k) / tokens


def test_good_drafts_settle_near_the_best_length() -> None:
    costs = [expected_cost_per_token(0.9, 0.05, k) for k in range(13)]
    for seed in range(3):
        recent = simulate(alpha=0.9, draft_ms=0.05, seed=seed)[1][-300:]
        # a hill climber on a flat optimum wanders around it; it must not wander off:
        # the lengths it picks cost at most 15 % more per token than the best length
        assert np.mean([costs[s] for s in recent]) <= 1.15 * min(costs), recent
        assert recent.count(0) <= 30


def test_bad_drafts_fall_back_to_plain_decoding() -> None:
    ctl, used = simulate(alpha=0.1, draft_ms=2.0, rounds=1500)
    # most rounds at s = 0, with rare probes of s = 1 whose back-off keeps growing
    tail = used[-500:]
    assert tail.count(0) >= 450 and max(tail) <= 1
    plain = expected_cost_per_token(0.1, 2.0, 0)
    assert np.mean([expected_cost_per_token(0.1, 2.0, s) for s in tail]) <= 1.05 * plain
    assert ctl._wait > ctl.config.decision_threshold


def test_zero_emitted_rounds_are_ignored() -> None:
    ctl = SpeculationLength(LengthConfig(s_init=3, s_max=5, decision_threshold=2))
    ctl.record(0, 1.0, 1.0)
    assert ctl.decisions == [] and ctl.length() == 3


# --------------------------------------------------------------------------- break-even


def test_break_even_recovers_a_known_cost_line() -> None:
    """Verify ms = a + m * (k - 1) with noise: the fitted line and threshold are the true ones."""
    a, m = 12.0, 9.0  # compute-bound box: each extra row costs 0.75 of a plain step
    rng = np.random.default_rng(1)
    be = DraftBreakEven()
    assert be.line() is None and be.threshold() == be.prior  # nothing measured: the prior
    for _ in range(200):
        k = int(rng.integers(1, 9))
        be.record(k, (a + m * (k - 1)) * rng.uniform(0.98, 1.02))
    fit = be.line()
    assert fit is not None
    assert abs(fit[0] - a) < 0.5 and abs(fit[1] - m) < 0.3
    assert abs(be.threshold() - m / a) < 0.03
    # a draft model's own step cost adds to what one more token must pay for
    assert abs(be.threshold(draft_step_ms=3.0) - (m + 3.0) / a) < 0.03
    assert be.threshold(draft_step_ms=50.0) == 1.0  # never pays: capped at certainty


def test_break_even_flat_curve_drafts_freely() -> None:
    be = DraftBreakEven()
    for k in (1, 2, 4, 8) * 10:
        be.record(k, 20.0)  # memory-bound: a batch costs what one token costs
    assert be.threshold() < 0.01


def test_break_even_keeps_multi_token_samples_through_long_plain_runs() -> None:
    be = DraftBreakEven()
    for k in (1, 2, 3, 4):
        be.record(k, 10.0 + 7.0 * (k - 1))
    for _ in range(1000):
        be.record(1, 10.0)  # a long stretch of plain decoding
    assert be.line() is not None and abs(be.threshold() - 0.7) < 0.02


def test_break_even_ignores_timings_of_a_busy_moment() -> None:
    """A kept line measured while another program took a core (batches 10-100x slower) must
    not forbid drafting for good: one normal timing per size restores the line."""
    be = DraftBreakEven()
    be.load({1: [10.0] * 12, 2: [300.0] * 12, 4: [900.0] * 12, 7: [1400.0] * 12})
    assert be.threshold() == 1.0  # the busy moment's line: nothing pays
    for k in (2, 4, 7):
        be.record(k, 10.0 + 2.0 * (k - 1))  # quiet again: extra rows cost 2 ms
    assert abs(be.threshold() - 0.2) < 0.02


def test_break_even_follows_the_measured_curve_not_a_line() -> None:
    """Q4_0's dip (4 rows cost less than 2, docs/facts.md §20) and a mixture's concave curve
    (the first extra rows read new experts, later ones share them, §33): what k drafts cost
    is read off the curve, between measured sizes and past the largest."""
    dip = DraftBreakEven()
    for k, ms in ((1, 10.0), (2, 17.0), (4, 13.0), (8, 25.0)):
        dip.record(k, ms)
    assert dip.threshold(k=1) == pytest.approx(0.7)  # a 2-row batch: 7 ms more
    assert dip.threshold(k=3) == pytest.approx(0.1)  # 3 drafts fill the cheap 4-row batch
    assert dip.cost_ms(3) == pytest.approx(15.0)  # between the measured 2 and 4
    assert dip.cost_ms(12) == pytest.approx(25.0 + 4 * dip.line()[1])  # past 8: the line's slope
    moe = DraftBreakEven()
    for k, ms in ((1, 10.0), (2, 16.0), (4, 22.0), (8, 28.0)):
        moe.record(k, ms)
    assert moe.threshold(k=1) == pytest.approx(0.6) and moe.threshold(k=7) == pytest.approx(18 / 7 / 10)
    assert moe.row_ms(7) == pytest.approx(18 / 7)
    assert moe.threshold(draft_step_ms=5.0, k=7) == pytest.approx((18 / 7 + 5.0) / 10)


def test_cost_line_is_kept_across_runs(tmp_path: Path) -> None:
    path = tmp_path / "costs.json"
    be = DraftBreakEven()
    for k in (1, 2, 3, 4) * 3:
        be.record(k, 10.0 + 7.0 * (k - 1))
    SavedLine(CostBook(path), "m|t2").keep(be.samples())
    again = DraftBreakEven()
    again.load(SavedLine(CostBook(path), "m|t2").restore())
    assert again.line() == pytest.approx(be.line())
    assert SavedLine(CostBook(path), "other").restore() == {}  # keyed by machine and model
    path.write_text("{not json")
    assert CostBook(path).get("m|t2") == {}  # a damaged file only means starting over


def test_two_writers_saving_at_once_each_write_their_own_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The chat app and serve on one machine save the same book: the other's save lands while
    this one's file waits to be moved into place. Each moves its own whole file."""
    import os
    import threading

    from potluck.engine.speculation import costs

    path = tmp_path / "costs.json"
    mine, theirs = CostBook(path), CostBook(path)
    mine.put("mine", {1: [1.0]})
    theirs.put("theirs", {1: [2.0]})
    replace = os.replace
    interleaved = []

    def other_writer_first(src: str, dst: str) -> None:
        if not interleaved:
            interleaved.append(src)
            other = threading.Thread(target=theirs.save)  # another writer (a process, a thread)
            other.start()
            other.join()  # their whole save, between our write and our move
        replace(src, dst)

    monkeypatch.setattr(costs.os, "replace", other_writer_first)
    mine.save()
    assert interleaved and not caplog.records  # both saves moved a file
    assert CostBook(path).get("mine") == {1: [1.0]}  # the last to land is whole
    assert not list(tmp_path.glob("*.tmp"))


# --------------------------------------------------------------------------- the floor


def run_gate(
    alpha: float, rounds: int, seed: int = 0, k_max: int = 7, row_ms: float = 7.5
) -> tuple[DraftGate, float, float]:
    """A synthetic reply under the gate: returns (gate, ms spent, ms plain would have spent).

    Plain step 10 ms; each drafted row adds ``row_ms`` (7.5: compute-bound, docs/facts.md
    §6); each draft token is accepted with probability ``alpha`` (a chain stops at the first
    rejection).
    """
    rng = np.random.default_rng(seed)
    gate = DraftGate()
    gate.new_reply()
    spent = 0.0
    emitted_total = 0
    while emitted_total < rounds:
        k = gate.draft_cap(k_max, row_ms)
        accepted = 0
        while accepted < k and rng.random() < alpha:
            accepted += 1
        ms = 10.0 + row_ms * k  # pending token + k drafts
        spent += ms
        emitted_total += accepted + 1
        gate.record(k, accepted + 1, ms)
    return gate, spent, 10.0 * emitted_total


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.5, 0.7, 0.9])
def test_gate_keeps_losing_drafts_within_the_floor(alpha: float) -> None:
    """Drafts that do not pay: whole replies, short and long, stay >= 0.95x plain."""
    for n in (30, 100, 400, 2000):
        for seed in range(5):
            gate, spent, plain = run_gate(alpha, n, seed)
            assert plain / spent >= 0.95, (alpha, n, seed, plain / spent)
    assert gate.closures > 0  # the path ran: the gate closed on these replies


def test_gate_stays_open_when_drafts_pay() -> None:
    """Flat batch costs (long contexts: reading the KV cache dominates) and good drafts."""
    for seed in range(5):
        gate, spent, plain = run_gate(0.9, 400, seed, row_ms=2.5)
        # an unlucky first probe may close it once; it reopens and stays open
        assert gate.closures <= 1 and plain / spent > 1.5, (seed, gate.closures, plain / spent)


def test_gate_ignores_rounds_before_a_plain_cost_is_known() -> None:
    gate = DraftGate()
    gate.record(4, 1, 100.0)  # a drafting round, but no plain round measured yet
    assert gate.is_open() and gate.plain_ms is None


def test_gate_books_each_replys_savings_for_the_next_reply_to_read() -> None:
    """The ledger SampledReplies reads: uncapped savings of this reply's drafting rounds."""
    gate, _, _ = run_gate(0.0, 60, 0)
    assert gate.reply_saved_ms < 0  # every draft rejected: each drafting round cost more than a step
    gate.new_reply()
    assert gate.reply_saved_ms == 0.0


def test_sampled_replies_back_off_while_drafts_save_nothing_and_reset_when_they_pay() -> None:
    floor = SampledReplies(max_skip=4)
    picks = []
    for saved_ms, accepted in [(-5.0, 0), (-1.0, 3), (40.0, 0), (-2.0, 1), (30.0, 12), (-1.0, 0)]:
        while not floor.speculate():
            picks.append("plain")
        picks.append("speculate")
        floor.record(saved_ms, accepted)
    # a loss skips 1, 2, 4, 4 replies (no passed draft is a loss whatever the clock says); a win resets
    assert picks == ["speculate", "plain", "speculate", "plain", "plain", "speculate", *["plain"] * 4,
                     "speculate", *["plain"] * 4, "speculate", "speculate"]
    assert floor.plain_replies == 11 and floor.backoff == 2
