"""The adaptive speculation length moves toward the cheapest length and falls back to 0."""

from __future__ import annotations

import numpy as np

from potluck.engine.adaptive import LengthConfig, SpeculationLength


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
