"""A `potluck serve` process for a test module: its home's config.toml written, started on a
loopback port the OS picks, stopped at the end, its log free of tracebacks."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from potluck.app.serve.launch import RunningServer, start_server, stop_server


@contextmanager
def serving(home: Path, config: str, args: Sequence[str] = (), **options: object) -> Iterator[RunningServer]:
    (home / "config").mkdir(parents=True, exist_ok=True)
    (home / "config" / "config.toml").write_text(config)
    running = start_server(home, args, **options)  # type: ignore[arg-type]
    try:
        yield running
    finally:
        stop_server(running.proc)
    assert "Traceback" not in running.log()
