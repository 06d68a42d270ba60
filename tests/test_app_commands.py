"""`potluck locate`, and `potluck` alone meaning `potluck chat`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from potluck.app.cli import build_parser, main, with_default_command


def test_locate_prints_every_path(tmp_home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["locate", "--json"]) == 0
    where = json.loads(capsys.readouterr().out)
    assert set(where) >= {"config", "history", "log", "exports", "model"}
    assert where["config"].startswith(str(tmp_home)) and where["config"].endswith("config.toml")
    assert main(["locate", "history"]) == 0
    assert capsys.readouterr().out.strip() == where["history"]


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ([], ["chat"]),
        (["-m", "x.gguf"], ["chat", "-m", "x.gguf"]),
        (["-v", "--strategy", "sd"], ["-v", "chat", "--strategy", "sd"]),
        (["generate", "hi"], ["generate", "hi"]),
        (["-v", "models"], ["-v", "models"]),
        (["--help"], ["--help"]),
    ],
)
def test_no_command_means_chat(argv: list[str], expected: list[str]) -> None:
    assert with_default_command(argv) == expected


def test_chat_options_default_to_the_settings() -> None:
    args = build_parser().parse_args(["chat", "--temp", "0.5"])
    assert args.temp == 0.5 and args.strategy is None and args.ctx is None and args.model is None


def test_bad_config_is_a_one_line_error(tmp_home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from potluck.engine.core import paths

    paths.config_file().write_text("[ui]\nthme = 'x'\n")
    assert main(["chat"]) == 2
    assert "unknown key 'thme'" in capsys.readouterr().err
