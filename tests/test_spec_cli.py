"""Bad input gives one clear line and exit code 2; `generate --strategy` and `bench` work."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from potluck.app.cli import main
from potluck.app.commands.bench import format_table
from potluck.engine.core.errors import PotluckError
from potluck.engine.core.runtime import Model
from potluck.engine.lab.benchmark import BenchRow, load_prompts, ngram_scaling
from potluck.engine.lab.fixtures import build_fixture

from .conftest import flat_cost_line
from .support.templated import with_metadata


def write_foreign_vocab(src: Path, dst: Path) -> Path:
    """A copy of ``src`` whose tokenizer spells two tokens differently (same vocab size)."""

    def swap(key: str, value: object) -> object:
        if key != "tokenizer.ggml.tokens":
            return value
        tokens = list(value)  # type: ignore[call-overload]
        tokens[1000], tokens[1001] = tokens[1001], tokens[1000]
        return tokens

    return with_metadata(src, dst, swap)


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_line_error(rc: int, err: str, *needles: str) -> None:
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("potluck: error:"), err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def test_sd_without_draft(capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = run_cli(capsys, "generate", "--strategy", "sd", "--max-tokens", "4", "hi")
    assert_one_line_error(rc, err, "--draft")


def test_unknown_strategy(capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = run_cli(capsys, "generate", "--strategy", "warp-drive", "hi")
    assert_one_line_error(rc, err, "warp-drive", "anpd", "sd")


def test_draft_with_another_vocabulary(
    capsys: pytest.CaptureFixture[str], model_path: Path, tmp_path: Path
) -> None:
    foreign = write_foreign_vocab(model_path, tmp_path / "foreign-vocab.gguf")
    with Model(foreign) as m:  # it is a loadable model: only the vocabulary differs
        assert m.n_vocab > 1001
    rc, _, err = run_cli(
        capsys, "generate", "--strategy", "sd", "--draft", str(foreign), "-t", "1", "hi"
    )
    assert_one_line_error(rc, err, "foreign-vocab.gguf", model_path.name, "vocabulary")


def test_generate_anpd_json_reports_speculation(capsys: pytest.CaptureFixture[str], model: Model) -> None:
    prompt = load_prompts("code_editing")[0]  # the reply copies the code: drafts match
    flat_cost_line(model, 1)  # a line an earlier test kept on a busy moment must not forbid drafting
    rc, out, _ = run_cli(
        capsys, "generate", "--strategy", "anpd", "--json", "--max-tokens", "48", "-t", "1", prompt
    )
    assert rc == 0
    d = json.loads(out)
    assert d["strategy"] == "anpd"
    assert d["drafted"] > 0 and 0 <= d["accepted"] <= d["drafted"]
    for key in ("acceptance_rate", "mean_accepted_len"):
        assert key in d


def test_bench_json_and_table(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run_cli(
        capsys, "bench", "--families", "chat", "--strategies", "anpd,pearl,minions,peer",
        "--max-tokens", "6", "--reps", "1", "-t", "1", "--json",
    )  # fmt: skip
    assert rc == 0
    rows = json.loads(out)
    assert [(r["family"], r["strategy"]) for r in rows] == [
        ("chat", "plain"),
        ("chat", "anpd"),
        ("chat", "pearl"),
        ("chat", "minions"),
        ("chat", "prompt-lookup"),  # asked for by its old name, 'peer'
    ]
    base = rows[0]
    assert base["speedup"] == 1.0 and base["identical_to_ar"] is True
    assert all(r["identical_to_ar"] for r in rows[1:4])  # lossless
    for r in rows:
        assert r["tokens_per_s"] > 0 and r["prompts"] == len(load_prompts("chat"))
        assert "identical_to_ar" in r and "acceptance_rate" in r and "overlap_ms_per_token" in r
    table = format_table([BenchRow(**r) for r in rows])
    assert "speedup" in table and "prompt-lookup" in table


def test_sampled_bench_seeds_every_strategy_alike(capsys: pytest.CaptureFixture[str]) -> None:
    """--temp: sampled replies, one seed per prompt for every strategy; 'identical' is n/a and the
    greedy-only prompt-lookup baseline is refused in one line."""
    rc, out, _ = run_cli(capsys, "bench", "--families", "chat", "--strategies", "anpd", "--temp", "0.8",
                         "--max-tokens", "6", "--reps", "1", "-t", "1", "--json")
    assert rc == 0
    rows = json.loads(out)
    assert [r["strategy"] for r in rows] == ["plain", "anpd"]
    assert all(r["identical_to_ar"] is None and r["temperature"] == 0.8 for r in rows)
    assert "temperature 0.8" in format_table([BenchRow(**r) for r in rows])
    rc, _, err = run_cli(capsys, "bench", "--families", "chat", "--strategies", "peer", "--temp", "0.8")
    assert_one_line_error(rc, err, "greedily")


def test_bench_bad_family(capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = run_cli(capsys, "bench", "--families", "poetry", "--reps", "1")
    assert_one_line_error(rc, err, "poetry")


def test_fixture_recipe_builds_a_loadable_deeper_model(tmp_home: Path) -> None:
    fx = build_fixture("0-1,0-2")  # tiny recipe: the same code path as 0-29x2
    assert fx.n_layer == 5 and fx.path.parent.is_relative_to(tmp_home)
    with Model(fx.path) as m:
        assert m.n_layer == 5
    assert build_fixture("0-1,0-2").path == fx.path  # reused, not rebuilt


def test_ngram_cost_scaling_runs() -> None:
    rows = ngram_scaling(sizes=(500, 5000), steps=200)
    assert [r["context_tokens"] for r in rows] == [500, 5000]
    assert all(r["us_per_token"] > 0 for r in rows)


def test_bench_takes_a_file_of_own_prompts(tmp_path: Path) -> None:
    f = tmp_path / "mine.txt"
    f.write_text("# my prompts\nFirst prompt\nover two lines\n%%\nSecond prompt\n", encoding="utf-8")
    assert load_prompts(str(f)) == ["First prompt\nover two lines", "Second prompt"]
    with pytest.raises(PotluckError, match="unknown prompt family"):
        load_prompts(str(tmp_path / "missing.txt"))
