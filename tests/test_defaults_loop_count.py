"""The loop rule of scripts/loop_count.py (engine/lab/loop_count.py) on hand-made token lists, and
the count end to end in small, with the chat app's defaults."""

from __future__ import annotations

from dataclasses import replace

from potluck.app.config import Settings
from potluck.engine.lab.loop_count import count_loops, loops


def test_a_loop_is_an_8_token_sequence_seen_3_times() -> None:
    phrase = list(range(8))
    assert loops(phrase * 3)
    assert not loops(phrase * 2 + list(range(100, 120)))  # twice is not a loop
    assert not loops(list(range(7)) * 3 + [99])  # a 7-token cycle repeated 3 times holds no 8-gram 3 times
    assert loops([5] * 10)  # one token 10 times: the 8-gram of 5s occurs 3 times (overlapping)
    assert not loops([5] * 9)
    assert not loops([])


def test_loops_are_counted_in_greedy_and_sampled_replies() -> None:
    defaults = Settings()
    r = count_loops(None, ["Give me three tips for learning to juggle."], [1, 2], 12, defaults.model.strategy,
                    lambda seed: replace(defaults.sampling, seed=seed).params(), n_threads=2)
    assert r.replies == 2
    assert r.greedy_loops in (0, 2) and 0 <= r.sampled_loops <= 2  # 12 tokens rarely loop; the counts add up
