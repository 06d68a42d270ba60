"""scripts/loop_count.py: its loop test on hand-made token lists, and the script end to end in small."""

from __future__ import annotations

import json

import pytest

from scripts.loop_count import loops, main


def test_a_loop_is_an_8_token_sequence_seen_3_times() -> None:
    phrase = list(range(8))
    assert loops(phrase * 3)
    assert not loops(phrase * 2 + list(range(100, 120)))  # twice is not a loop
    assert not loops(list(range(7)) * 3 + [99])  # a 7-token cycle repeated 3 times holds no 8-gram 3 times
    assert loops([5] * 10)  # one token 10 times: the 8-gram of 5s occurs 3 times (overlapping)
    assert not loops([5] * 9)
    assert not loops([])


def test_the_script_counts_greedy_and_sampled_replies(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--prompts", "1", "--seeds", "1,2", "--max-tokens", "12", "-t", "2", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["replies"] == 2
    assert r["greedy_loops"] in (0, 2) and 0 <= r["sampled_loops"] <= 2  # 12 tokens rarely loop; the counts add up
