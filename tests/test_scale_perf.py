"""`potluck perf` with its default thread count (it once failed with a traceback there)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from potluck.app.cli import main
from potluck.engine import default_threads


def test_perf_runs_with_default_threads(model_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["perf", "--runs", "1", "--json", "-m", str(model_path)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["threads"] == default_threads() and report["runs"] == 1
    assert report["decode_tokens_per_s"] > 0 and report["prefill_tokens_per_s"] > 0
    assert set(report["batch_cost"]) == {"1", "2", "4", "8", "16"} and report["batch_cost"]["1"] == 1.0
