"""The command line as a user meets it: real processes, stdout/stderr and exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

POTLUCK = [sys.executable, "-m", "potluck.app.cli"]


def run(args: list[str], tmp_path: Path, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "POTLUCK_HOME": str(tmp_path / "home")}
    return subprocess.run(
        POTLUCK + args, input=stdin, capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path
    )


def test_version(tmp_path: Path) -> None:
    out = run(["--version"], tmp_path)
    assert out.returncode == 0
    assert out.stdout.startswith("potluck ")


_IMPORTED_AFTER = """
import sys
from potluck.app.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as e:
    code = e.code
print(code, *sorted(m for m in sys.modules if m.split(".")[0] in ("numba", "textual", "potluck")), file=sys.stderr)
"""


@pytest.mark.parametrize(
    ("args", "absent"),
    [
        (["--version"], ["potluck.app.commands.chat", "potluck.engine.loader", "numba"]),
        (["--help"], ["potluck.app.commands", "potluck.engine.loader", "numba"]),  # ~0.15 s, was ~2 s
        (["chat", "--ctx", "0"], ["textual", "potluck.app.tui"]),  # refused before the screen loads
        (["worker", "--help"], ["potluck.engine.speculation.strategies.registry", "potluck.engine.loader"]),
    ],
)
def test_a_command_imports_only_what_it_runs(args: list[str], absent: list[str], tmp_path: Path) -> None:
    """`potluck --version` wires no command, `potluck --help` lists them without importing one, a
    refusal comes before the chat app's Textual, and the worker command's module loads no
    strategy: each cost ~0.5-2 s of CPU."""
    env = {**os.environ, "POTLUCK_HOME": str(tmp_path / "home")}
    out = subprocess.run([sys.executable, "-c", _IMPORTED_AFTER, *args], capture_output=True, text=True,
                         timeout=120, env=env, cwd=tmp_path)
    code, *modules = out.stderr.strip().splitlines()[-1].split()
    assert code in ("0", "2"), out.stderr
    assert "potluck.app.cli" in modules  # the report ran
    assert not [m for m in modules if any(m == a or m.startswith(a + ".") for a in absent)], modules


def test_generate_json_is_one_object_and_greedy_repeats(tmp_path: Path) -> None:
    results = []
    for _ in range(2):
        out = run(["generate", "--json", "--max-tokens", "16", "--temp", "0"], tmp_path, stdin="Name a planet.")
        assert out.returncode == 0, out.stderr
        lines = out.stdout.strip().splitlines()
        assert len(lines) == 1
        results.append(json.loads(lines[0]))
    first = results[0]
    for key in ("text", "tokens", "tokens_per_s", "prompt_tokens", "ttft_s"):
        assert key in first
    assert 0 < len(first["tokens"]) <= 16
    assert first["tokens"] == results[1]["tokens"]
    assert first["text"] and first["prompt_tokens"] > 5


def test_generate_streams_text(tmp_path: Path) -> None:
    out = run(["generate", "--max-tokens", "8", "Say hello."], tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip()


def test_models_lists_bundled_default(tmp_path: Path) -> None:
    out = run(["models"], tmp_path)
    assert out.returncode == 0
    assert "SmolLM2-135M" in out.stdout and "30 layers" in out.stdout


def _truncated(model_path: Path, tmp_path: Path, n_bytes: int) -> Path:
    dst = tmp_path / f"truncated-{n_bytes}.gguf"
    with open(model_path, "rb") as f:
        dst.write_bytes(f.read(n_bytes))
    return dst


@pytest.mark.parametrize(
    "case",
    ["missing", "not-gguf", "truncated-data", "truncated-header", "max-tokens-0", "max-tokens-negative",
     "prompt-too-long", "unknown-strategy", "empty-stdin"],
)
def test_bad_input_is_one_line_exit_2(case: str, tmp_path: Path, model_path: Path) -> None:
    stdin = None
    if case == "missing":
        args, expect = ["-m", str(tmp_path / "nope.gguf"), "hi"], "not found"
    elif case == "not-gguf":
        bad = tmp_path / "notes.gguf"
        bad.write_text("just some text\n")
        args, expect = ["-m", str(bad), "hi"], "not a GGUF"
    elif case == "truncated-data":
        args, expect = ["-m", str(_truncated(model_path, tmp_path, 5_000_000)), "hi"], "truncated"
    elif case == "truncated-header":
        args, expect = ["-m", str(_truncated(model_path, tmp_path, 100)), "hi"], "truncated"
    elif case == "max-tokens-0":
        args, expect = ["--max-tokens", "0", "hi"], "--max-tokens"
    elif case == "max-tokens-negative":
        args, expect = ["--max-tokens", "-5", "hi"], "--max-tokens"
    elif case == "prompt-too-long":
        args, expect, stdin = ["--ctx", "256"], "context holds 256", "word " * 400
    elif case == "unknown-strategy":
        args, expect = ["--strategy", "bogus", "hi"], "unknown strategy"
    else:
        args, expect, stdin = [], "empty", "   \n"
    out = run(["generate", *args], tmp_path, stdin=stdin)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("potluck: error: ") and expect in lines[0]


@pytest.mark.parametrize(
    "args,expect",
    [
        (["--split", "0,10,30"], "--split only applies to --cluster or --nodes"),
        (["--cluster", "2", "--nodes", "127.0.0.1:1"], "not both"),
        (["--cluster", "2", "--variants", "bogus"], "no cluster bench variant 'bogus'"),
        (["--cluster", "2", "--variants", "anpd", "--option", "cancel=false"],
         "no chosen variant takes the option 'cancel'"),
    ],
)
def test_cluster_bench_bad_flags_are_one_line(args: list[str], expect: str, tmp_path: Path) -> None:
    """Refused before any worker starts or model loads (the variant check comes before joining)."""
    out = run(["bench", *args], tmp_path)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert expect in lines[0]
