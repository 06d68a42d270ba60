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


def test_counters_count_when_drafting() -> None:
    # Fixed-length drafting (adaptive off) on a repetitive reply: the drafter must draft, and
    # the same result_json that `generate --json` prints carries the counts.
    from potluck.app.commands.generate import result_json
    from potluck.engine.core.events import Finished
    from potluck.engine.core.sampling import SamplingParams
    from potluck.engine.core.spec import EngineSpec
    from potluck.engine.loader import open_session

    session = open_session(EngineSpec(strategy="anpd", n_ctx=512, strategy_options={"adaptive": False}))
    try:
        events = list(session.generate(
            "Repeat exactly, ten times: red green blue red green blue red green blue", SamplingParams(), 48
        ))
    finally:
        session.close()
    out = result_json(next(e for e in events if isinstance(e, Finished)))
    assert out["drafted"] > 0 and 0 <= out["accepted"] <= out["drafted"]  # type: ignore[operator]
    assert out["acceptance_rate"] == round(out["accepted"] / out["drafted"], 4)  # type: ignore[operator]


def test_plain_decoding_has_no_counters(capsys: pytest.CaptureFixture[str]) -> None:
    out = run_json(capsys, "--max-tokens", "2", "Hi")
    assert out["strategy"] == "plain"
    assert not set(COUNTERS) & set(out)
