"""What `potluck --help` and each command's help tell a newcomer, and perf's progress."""

from __future__ import annotations

from pathlib import Path

import pytest

from potluck.app.cli import COMMANDS, build_parser
from potluck.engine.core.runtime import Model


def command_help(name: str) -> str:
    sub = build_parser([name])._subparsers._group_actions[0].choices[name]  # type: ignore[union-attr]
    return sub.format_help()


@pytest.mark.parametrize("name", COMMANDS)
def test_every_command_has_a_description_and_cites_no_internal_file(name: str) -> None:
    text = command_help(name)
    usage, _, rest = text.partition("\n\n")
    assert rest and rest[0].isupper(), f"{name} --help has no description line"
    for internal in (".py", "facts.md", "§"):
        assert internal not in text, f"{name} --help cites {internal}"


def test_potluck_help_lists_every_command_by_the_line_its_own_parser_has() -> None:
    listed = build_parser(listed=True)._subparsers._group_actions[0]  # type: ignore[union-attr]
    wired = build_parser()._subparsers._group_actions[0]  # type: ignore[union-attr]
    lines = {a.dest: a.help for a in listed._choices_actions}
    assert list(lines) == list(COMMANDS)
    assert lines == {a.dest: a.help for a in wired._choices_actions}


def test_the_kv_help_agrees_with_the_readme() -> None:
    for name in ("generate", "bench"):
        text = " ".join(command_help(name).split())
        assert "2x faster" not in text and "F16's speed" in text


def test_perf_says_where_it_is(model_path: Path) -> None:
    from potluck.engine.lab.perf import measure

    lines: list[str] = []
    with Model(model_path) as model:
        measure(model, n_threads=1, runs=2, decode_tokens=2, prefill_tokens=8, ks=(1, 2), progress=lines.append)
    assert lines == [f"run {i} of 2: a 8-token prompt, 2 decode steps, batches of 1, 2" for i in (1, 2)]
