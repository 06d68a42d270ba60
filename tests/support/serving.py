"""A `potluck serve` process for a test module: its home's config.toml written, started on a
loopback port the OS picks, stopped at the end, its log free of tracebacks. It computes on one
thread unless the test says otherwise: beside the other test process, two llama.cpp threads
decode ~1.6x slower than one (their OpenMP barriers sleep, docs/facts.md §14), and replies are
the same at any thread count (§3)."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from potluck.app.serve.launch import RunningServer, start_server, stop_server


@contextmanager
def serving(home: Path, config: str, args: Sequence[str] = (), **options: object) -> Iterator[RunningServer]:
    (home / "config").mkdir(parents=True, exist_ok=True)
    (home / "config" / "config.toml").write_text(config)
    if not any(a in ("-t", "--threads") or a.startswith(("-t", "--threads=")) for a in args):
        args = [*args, "-t", "1"]
    running = start_server(home, args, **options)  # type: ignore[arg-type]
    try:
        yield running
    finally:
        stop_server(running.proc)
    assert "Traceback" not in running.log()


def ask_at_once(client: Any, prompts: Sequence[str], max_tokens: int) -> dict[str, str]:
    """Each prompt sent by its own thread through the official ``client``, all at once; the
    text each got."""
    got: dict[str, str] = {}

    def ask(p: str) -> None:
        r = client.chat.completions.create(model="any", messages=[{"role": "user", "content": p}],
                                           max_tokens=max_tokens)
        got[p] = r.choices[0].message.content

    threads = [threading.Thread(target=ask, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    return got
