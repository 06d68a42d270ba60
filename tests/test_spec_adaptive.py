"""The adaptive speculation length moves toward the cheapest length and falls back to 0."""

from __future__ import annotations

import numpy as np

from potluck.engine.adaptive import LengthConfig, SpeculationLength


def simulate(alpha: float, draft_ms: float, rounds: int = 600, seed: int = 0) -> SpeculationLength:
    """A synthetic machine: batch cost grows like DESIGN.md fact 5, acceptance is i.i.d."""
    rng = np.random.default_rng(seed)
    ctl = SpeculationLength(LengthConfig(s_init=4, s_max=12))
    for _ in range(rounds):
        k = ctl.length()
        accepted = 0
        while accepted < k and rng.random() < alpha:
            accepted += 1
        verify_ms = 10.0 * (1 + 0.45 * k) * rng.uniform(0.95, 1.05)
        ctl.record(accepted + 1, draft_ms * k, verify_ms)
    return ctl


def expected_cost_per_token(alpha: float, draft_ms: float, k: int) -> float:
    tokens = sum(alpha**i for i in range(k + 1))
    return (10.0 * (1 + 0.45 * k) + draft_ms * k) / tokens


def test_good_drafts_settle_near_the_best_length() -> None:
    best = min(range(13), key=lambda k: expected_cost_per_token(0.9, 0.05, k))
    for seed in range(3):
        recent = simulate(alpha=0.9, draft_ms=0.05, seed=seed).decisions[-30:]
        # a hill climber on a flat optimum wanders around it; it must not wander off
        assert abs(float(np.median(recent)) - best) <= 2, (best, recent)
        assert recent.count(0) <= 2


def test_bad_drafts_fall_back_to_plain_decoding() -> None:
    ctl = simulate(alpha=0.1, draft_ms=2.0, rounds=1500)
    # most rounds at s = 0, with rare probes of s = 1 whose back-off keeps growing
    tail = ctl.decisions[-10:]
    assert tail.count(0) >= 4 and max(tail) <= 1
    assert ctl._wait > ctl.config.decision_threshold


def test_zero_emitted_rounds_are_ignored() -> None:
    ctl = SpeculationLength(LengthConfig(s_init=3, s_max=5, decision_threshold=2))
    ctl.record(0, 1.0, 1.0)
    assert ctl.decisions == [] and ctl.length() == 3
