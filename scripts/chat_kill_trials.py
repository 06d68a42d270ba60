"""kill -9 trials for the chat app's history (a script with a report, not a test).

    .venv/bin/python -m scripts.chat_kill_trials --trials 50

Each trial starts the real chat app (headless Textual, the real engine and bundled model,
the real SQLite history file shared by every trial) in a child process, opens a new
conversation, sends a prompt, and at a random moment while the reply streams sends the
child SIGKILL. The child records each piece of streamed text with its time in an
append-only file (the page cache keeps it across the kill). Then the parent checks:

- ``PRAGMA integrity_check`` is ``ok`` (the history is never corrupt);
- the saved reply is a prefix of the uninterrupted reply (a calibration run first);
- every character streamed more than 1 s before the kill is saved (at most 1 s lost);
- reopening the store marks the reply interrupted and keeps its text.

Exit status 0 only if every trial passes.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."
MAX_TOKENS = 400
LOSS_LIMIT_S = 1.0


# --------------------------------------------------------------------------- child: the app


class TeeSession:
    """The engine session, with every streamed text appended to ``fd`` as "time length"."""

    def __init__(self, session, fd: int) -> None:  # noqa: ANN001 - the engine Session
        self._session = session
        self._fd = fd

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self._session, name)

    def generate(self, user, sampling, max_tokens):  # noqa: ANN001, ANN201
        from potluck.engine.core.events import TokenText

        streamed = 0
        for event in self._session.generate(user, sampling, max_tokens):
            if isinstance(event, TokenText) and event.text:
                streamed += len(event.text)
                os.write(self._fd, f"{time.time():.6f} {streamed}\n".encode())
            yield event


async def run_child(db: Path, events: Path, threads: int) -> None:
    from potluck.app.config import ModelSettings, SamplingSettings, Settings, UISettings
    from potluck.app.tui import build_app
    from potluck.engine.loader import open_session

    fd = os.open(events, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    settings = Settings(
        model=ModelSettings(n_ctx=2048, n_threads=threads),
        sampling=SamplingSettings(max_tokens=MAX_TOKENS),
        ui=UISettings(cursor_blink=False),
    )
    app = build_app(settings=settings, session_factory=lambda spec: TeeSession(open_session(spec), fd),
                    history_path=db, export_dir=db.parent / "exports", copy_fallback=lambda text: "")
    async with app.run_test(headless=True, size=(100, 30)) as pilot:
        while app.session is None or app.loading:
            await asyncio.sleep(0.05)
        await app.action_new_conversation()
        app.input.text = PROMPT
        await pilot.press("enter")
        while app.reply is None:
            await asyncio.sleep(0.01)
        while app.reply is not None:
            await asyncio.sleep(0.05)
    os.write(fd, b"done\n")


# --------------------------------------------------------------------------- parent: trials


@dataclass
class Outcome:
    ok: bool
    saved: int  # characters in the history
    streamed: int  # characters streamed before the kill
    lost_s: float  # how old the newest unsaved character was at the kill
    detail: str = ""


def child_cmd(db: Path, events: Path, threads: int) -> list[str]:
    return [sys.executable, "-m", "scripts.chat_kill_trials", "--child", str(db), str(events),
            "--threads", str(threads)]


def read_events(path: Path) -> Iterator[tuple[float, int]]:
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 2:
            yield float(parts[0]), int(parts[1])


def newest_reply(db: Path) -> tuple[str, str | None]:
    with sqlite3.connect(db) as conn:
        conv = conn.execute("SELECT id FROM conversations ORDER BY id DESC").fetchone()
        row = conn.execute(
            "SELECT content, finish_reason FROM messages WHERE conversation_id = ? AND role = 'assistant' "
            "ORDER BY id DESC", (conv[0],)
        ).fetchone()
    return (row[0], row[1]) if row else ("", None)


def calibrate(tmp: Path, threads: int) -> tuple[str, float]:
    """The uninterrupted reply and how long it streams."""
    db, events = tmp / "calibration.sqlite3", tmp / "calibration.events"
    subprocess.run(child_cmd(db, events, threads), check=True, timeout=600)
    times = [t for t, _ in read_events(events)]
    text, reason = newest_reply(db)
    if reason not in ("stop", "length") or not times:
        raise SystemExit(f"calibration run did not finish a reply ({reason!r})")
    return text, times[-1] - times[0]


def trial(
    rng: random.Random, db: Path, events: Path, reference: str, duration_s: float, threads: int
) -> Outcome | None:
    events.unlink(missing_ok=True)
    proc = subprocess.Popen(child_cmd(db, events, threads), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while not (events.exists() and events.stat().st_size) and time.monotonic() < deadline:
            if proc.poll() is not None:
                return Outcome(False, 0, 0, 0.0, f"the app exited ({proc.returncode}) before streaming")
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 0.9 * duration_s))
        os.kill(proc.pid, signal.SIGKILL)
        killed_at = time.time()
    finally:
        proc.wait()
    with sqlite3.connect(db) as conn:
        check = conn.execute("PRAGMA integrity_check").fetchone()[0]
    if check != "ok":
        return Outcome(False, 0, 0, 0.0, f"integrity_check: {check}")
    stream = [(t, n) for t, n in read_events(events) if t <= killed_at]
    streamed = stream[-1][1] if stream else 0
    text, reason = newest_reply(db)
    if reason not in ("partial", None):
        return None  # the reply ended before the kill: nothing was at stake, run it again
    saved = len(text)
    unsaved = [t for t, n in stream if n > saved]
    lost_s = killed_at - unsaved[0] if unsaved else 0.0
    must_have = max((n for t, n in stream if t <= killed_at - LOSS_LIMIT_S), default=0)
    if not reference.startswith(text):
        return Outcome(False, saved, streamed, lost_s, "the saved text is not a prefix of the reply")
    if saved < must_have:
        return Outcome(False, saved, streamed, lost_s, f"{must_have - saved} characters older than 1 s were lost")
    # The next start marks it interrupted and keeps the text.
    from potluck.app.store import Store

    store = Store.open(db)
    store.close()
    text_after, reason_after = newest_reply(db)
    if saved and (reason_after != "interrupted" or text_after != text):
        return Outcome(False, saved, streamed, lost_s, f"reopened as {reason_after!r}, not interrupted")
    return Outcome(True, saved, streamed, lost_s)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="engine threads of the chat app")
    ap.add_argument("--child", nargs=2, metavar=("DB", "EVENTS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        asyncio.run(run_child(Path(args.child[0]), Path(args.child[1]), args.threads))
        return 0
    logging.basicConfig(level=logging.ERROR)
    rng = random.Random(args.seed)
    outcomes: list[Outcome] = []
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        reference, duration_s = calibrate(tmp, args.threads)
        print(f"uninterrupted reply: {len(reference)} characters streamed over {duration_s:.1f} s")
        db = tmp / "history.sqlite3"
        missed = 0
        while len(outcomes) < args.trials:
            o = trial(rng, db, tmp / "trial.events", reference, duration_s, args.threads)
            if o is None:
                missed += 1
                continue
            outcomes.append(o)
            print(f"{'ok  ' if o.ok else 'FAIL'} trial {len(outcomes):3d}: {o.saved}/{o.streamed} characters "
                  f"saved, oldest unsaved {o.lost_s:.2f} s old {o.detail}", flush=True)
        with sqlite3.connect(db) as conn:
            final_check = conn.execute("PRAGMA integrity_check").fetchone()[0]
            n_interrupted = conn.execute(
                "SELECT count(*) FROM messages WHERE finish_reason = 'interrupted'").fetchone()[0]
    ok = [o for o in outcomes if o.ok]
    lost = [o.lost_s for o in outcomes]
    print()
    print(f"chat kill trials: {len(ok)}/{len(outcomes)} passed (history integrity at the end: {final_check}, "
          f"{n_interrupted} replies marked interrupted; {missed} missed: the reply ended first, re-run)")
    if lost:
        print(f"  unsaved text at the kill, age of its oldest character: median {statistics.median(lost):.2f} s, "
              f"max {max(lost):.2f} s (limit {LOSS_LIMIT_S:g} s)")
    return 0 if len(ok) == len(outcomes) and final_check == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
