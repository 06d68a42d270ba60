"""`generate --json`: the speculative counters are always there for speculative strategies."""

from __future__ import annotations

import json

import pytest

from potluck.app.cli import main

COUNTERS = ("drafted", "accepted", "acceptance_rate", "mean_accepted_len")


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, object]:
    assert main(["generate", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_counters_present_at_zero_when_nothing_was_drafted(capsys: pytest.CaptureFixture[str]) -> None:
    # One token comes from the prompt's logits alone: the N-gram drafter never gets a round.
    out = run_json(capsys, "--strategy", "anpd", "--max-tokens", "1", "Hi")
    assert out["strategy"] == "anpd" and len(out["tokens"]) == 1  # type: ignore[arg-type]
    assert {k: out[k] for k in COUNTERS} == {
        "drafted": 0, "accepted": 0, "acceptance_rate": 0.0, "mean_accepted_len": 0.0
    }


def test_counters_count_when_drafting(capsys: pytest.CaptureFixture[str]) -> None:
    # A repetitive continuation: the N-gram drafter finds matches and drafts.
    out = run_json(capsys, "--strategy", "anpd", "--max-tokens", "48",
                   "Repeat exactly, ten times: red green blue red green blue red green blue")
    assert out["drafted"] > 0  # type: ignore[operator]
    assert 0.0 <= out["acceptance_rate"] <= 1.0  # type: ignore[operator]


def test_plain_decoding_has_no_counters(capsys: pytest.CaptureFixture[str]) -> None:
    out = run_json(capsys, "--max-tokens", "2", "Hi")
    assert out["strategy"] == "autoregressive"
    assert not set(COUNTERS) & set(out)
