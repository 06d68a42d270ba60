"""The chat app's speed in a real terminal (issue 22): tmux, a fixed pane, timed from Enter
until the whole reply is visible in `tmux capture-pane`, against `potluck generate`.

    .venv/bin/python -m scripts.chat_tmux_speed --reps 3 [--max-tokens 300] [--load] [--ref COMMIT]

Each rep runs `potluck generate --json` (greedy, plain, the same prompt) for its own time (time
to first token + decode), then the real chat app in a detached tmux session at 120x40 with a
throwaway POTLUCK_HOME, typing the prompt and pressing Enter. The reply is over when the
status line, having said "generating", no longer does: the app sets it back only once the
reply is stored and drawn in full. The app's own reply (from its history, not generate's: the
app renders the prompt through its chat template and replies differently) must then show its
last words, in order, on the captured screen (the chat scrolls with the reply), and its token
count is the app's. The pane is captured every ``--poll-ms`` through one tmux client in
control mode: a `tmux capture-pane` process per poll (fork, exec, connect) took 5-13 % of a
2-core machine's decode speed from whatever it measured, this about 1 % (``--poll-cost``
measures it on `generate`). ``--load`` repeats all with one process spinning a core. Prints
one JSON line; the ratio is app / generate, both end to end (prompt + reply);
``app_engine_decode_tok_s`` (the app's own decode speed, as its history stores it)
against ``generate_decode_tok_s`` separates the engine's slowdown from the app's fixed costs.
``--ref COMMIT`` runs the app at that commit too (a git worktree on this venv), each rep
alternating which app goes first: ``after_over_before`` is this tree's app against it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from potluck.app.store import Store, StoredMessage
from potluck.app.tui.parity import PROMPT, one_core_busy
from potluck.engine import paths

PANE = (120, 40)
TAIL_WORDS = 8


def words(text: str) -> list[str]:
    """Lower-case alphanumeric runs: what survives Markdown rendering and line wrapping."""
    return re.findall(r"[a-z0-9]+", text.lower())


def generate(prompt: str, max_tokens: int, threads: int) -> dict:
    argv = [sys.executable, "-m", "potluck.app.cli", "generate", "--json", "--strategy", "plain",
            "--temp", "0", "--max-tokens", str(max_tokens), "--threads", str(threads), prompt]
    out = subprocess.run(argv, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def tmux(*args: str) -> str:
    return subprocess.run(["tmux", *args], capture_output=True, text=True, check=True).stdout


class TmuxControl:
    """One tmux client in control mode (``tmux -C``) attached to a session: each command is a
    line on its stdin and its reply the lines between ``%begin`` and ``%end``, with no process
    started per command. ``no-output`` spares it the pane's output; ``ignore-size`` leaves
    the pane at the size the session was made with."""

    def __init__(self, session: str) -> None:
        self.session = session
        self.proc = subprocess.Popen(
            ["tmux", "-C", "attach-session", "-f", "no-output,ignore-size", "-t", session],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
        )
        # Attaching answers with a block of its own: read up to a marker, so that each
        # command's reply is the next block after it.
        marker = f"potluck-sync-{os.getpid()}"
        self._send(f"display-message -p {marker}")
        while self._reply() != marker:
            pass

    def command(self, line: str) -> str:
        self._send(line)
        return self._reply(line)

    def _send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def _reply(self, line: str = "") -> str:
        """The next block answering a command of ours (``%begin TIME NUMBER 1``; the attach
        itself answers with flags 0, sometimes after our first command's block)."""
        assert self.proc.stdout is not None
        out: list[str] = []
        block: str | None = None  # the flags of the block being read; None outside one
        while True:
            got = self.proc.stdout.readline()
            if not got:
                raise RuntimeError(f"tmux control client for {self.session} closed")
            got = got.rstrip("\n")
            if block is None:
                if got.startswith("%begin"):
                    block = got.split()[-1]
                    out = []
                continue  # outside a block: notifications
            if got.startswith(("%end", "%error")):
                if block == "1":
                    if got.startswith("%error"):
                        raise RuntimeError(f"tmux {line!r}: {' '.join(out)}")
                    return "\n".join(out)
                block = None
            else:
                out.append(got)

    def capture(self) -> str:
        return self.command(f"capture-pane -p -t {self.session}")

    def enter(self) -> None:
        self.command(f"send-keys -t {self.session} Enter")

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def app_reply(prompt: str, max_tokens: int, threads: int, poll_s: float,
              timeout_s: float = 300.0, pythonpath: Path | None = None) -> tuple[float, int, float]:
    """(seconds from Enter until the reply is stored and drawn, its tokens, the engine's own
    decode speed as the app stored it), in the real app under tmux; ``pythonpath``: the app of
    another tree (``--ref``)."""
    name = f"potluck-speed-{os.getpid()}"
    with tempfile.TemporaryDirectory(prefix="potluck-tmux-") as home:
        where = f"PYTHONPATH={pythonpath} " if pythonpath else ""
        cmd = (f"{where}POTLUCK_HOME={home} {sys.executable} -m potluck.app.cli chat --strategy plain --temp 0 "
               f"--max-tokens {max_tokens} --threads {threads}")
        tmux("new-session", "-d", "-s", name, "-x", str(PANE[0]), "-y", str(PANE[1]), cmd)
        ctl = TmuxControl(name)
        try:
            deadline = time.monotonic() + timeout_s
            while "ready" not in ctl.capture():
                if time.monotonic() > deadline:
                    raise TimeoutError("the chat app did not get ready")
                time.sleep(0.2)
            tmux("send-keys", "-t", name, "-l", prompt)  # a process of its own: before the clock
            time.sleep(0.5)  # the typed text lands before the clock starts
            t0 = time.monotonic()
            ctl.enter()
            started = False
            while True:
                raw = ctl.capture()
                if "generating" in raw:
                    started = True
                elif started:
                    seconds = time.monotonic() - t0
                    break
                if time.monotonic() - t0 > timeout_s:
                    raise TimeoutError("the reply never ended on screen")
                time.sleep(poll_s)
        finally:
            ctl.close()
            subprocess.run(["tmux", "kill-session", "-t", name], capture_output=True, check=False)
        reply = stored_reply(Path(home))
    tail = words(reply.content)[-TAIL_WORDS:]
    screen = words(raw)
    if not any(screen[i:i + len(tail)] == tail for i in range(len(screen) - len(tail) + 1)):
        raise RuntimeError("the reply's last words were not on screen when the status said it was over")
    return seconds, int(reply.n_tokens or 0), float(reply.tokens_per_s or 0.0)


def poll_cost(prompt: str, max_tokens: int, threads: int, poll_s: float, reps: int) -> dict:
    """`generate`'s decode speed alone and while a control client captures an idle pane at
    the poll rate, interleaved: what the measurement itself takes from what it measures."""
    name = f"potluck-pollcost-{os.getpid()}"
    tmux("new-session", "-d", "-s", name, "-x", str(PANE[0]), "-y", str(PANE[1]), "sleep 3600")
    ctl = TmuxControl(name)
    stop = threading.Event()

    def poll() -> None:
        while not stop.wait(poll_s):
            ctl.capture()

    quiet, polled = [], []
    try:
        for _ in range(reps):
            quiet.append(generate(prompt, max_tokens, threads)["tokens_per_s"])
            stop.clear()
            poller = threading.Thread(target=poll)
            poller.start()
            try:
                polled.append(generate(prompt, max_tokens, threads)["tokens_per_s"])
            finally:
                stop.set()
                poller.join()
    finally:
        ctl.close()
        subprocess.run(["tmux", "kill-session", "-t", name], capture_output=True, check=False)
    q, p = statistics.median(quiet), statistics.median(polled)
    return {"generate_decode_tok_s": round(q, 1), "while_polled_tok_s": round(p, 1), "ratio": round(p / q, 3),
            "quiet_runs": [round(r, 1) for r in quiet], "polled_runs": [round(r, 1) for r in polled]}


def stored_reply(home: Path) -> StoredMessage:
    """The app's reply, as its history holds it."""
    paths.override_home(home)
    try:
        store = Store.open(paths.history_db())
    finally:
        paths.override_home(None)
    try:
        conv = store.conversations()[0]
        return [m for m in store.messages(conv.id) if m.role == "assistant"][-1]
    finally:
        store.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=300)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--poll-ms", type=float, default=50.0)
    ap.add_argument("--load", action="store_true", help="also with one core busy")
    ap.add_argument("--poll-cost", action="store_true",
                    help="only measure what polling the pane takes from `generate` (no app)")
    ap.add_argument("--ref", help="also the app at this earlier commit, interleaved with this tree's "
                    "(before and after in one run)")
    args = ap.parse_args()
    if shutil.which("tmux") is None:
        print("chat_tmux_speed: tmux is not installed; install it to measure the app in a terminal", file=sys.stderr)
        return 2
    if args.poll_cost:
        print(json.dumps(poll_cost(args.prompt, args.max_tokens, args.threads, args.poll_ms / 1000, args.reps)))
        return 0
    with tempfile.TemporaryDirectory(prefix="potluck-speed-ref-") as tmp:
        before = earlier_tree(args.ref, Path(tmp)) if args.ref else None
        try:
            rows = measure(args, before)
        finally:
            if args.ref:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(Path(tmp) / "tree")],
                               capture_output=True, check=False)
    print(json.dumps({"pane": f"{PANE[0]}x{PANE[1]}", "reps": args.reps, "ref": args.ref, "rows": rows}))
    return 0


ROOT = Path(__file__).resolve().parents[1]


def earlier_tree(ref: str, work: Path) -> Path:
    """A PYTHONPATH folder whose ``potluck`` is ``ref``'s tree (a git worktree), with this venv."""
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(work / "tree"), ref],
                   check=True, capture_output=True)
    pkg = work / "path" / "potluck"
    pkg.mkdir(parents=True)
    for name in ("app", "engine", "discovery", "assets"):
        (pkg / name).symlink_to(work / "tree" / name)
    return work / "path"


def measure(args: argparse.Namespace, before: Path | None) -> list[dict]:
    """Per load: generate, then the app (and the earlier app, in alternating order), ``reps`` times."""
    rows = []
    poll_s = args.poll_ms / 1000
    for busy in (False, True) if args.load else (False,):
        app_rates, gen_rates, gen_decode, app_decode, before_rates, before_decode = [], [], [], [], [], []
        with one_core_busy(busy):
            for rep in range(args.reps):
                ref = generate(args.prompt, args.max_tokens, args.threads)
                n = len(ref["tokens"])
                gen_rates.append(n / (ref["ttft_s"] + ref["decode_s"]))
                gen_decode.append(ref["tokens_per_s"])
                sides = [None, before] if before is not None else [None]
                for side in sides if rep % 2 == 0 else sides[::-1]:
                    seconds, n_app, engine_rate = app_reply(
                        args.prompt, args.max_tokens, args.threads, poll_s, pythonpath=side
                    )
                    (app_rates if side is None else before_rates).append(n_app / seconds)
                    (app_decode if side is None else before_decode).append(engine_rate)
        app, gen = statistics.median(app_rates), statistics.median(gen_rates)
        row = {"load": "one core busy" if busy else "quiet", "tokens": n,
               "app_tok_s": round(app, 1), "generate_tok_s": round(gen, 1),
               "generate_decode_tok_s": round(statistics.median(gen_decode), 1),
               "app_engine_decode_tok_s": round(statistics.median(app_decode), 1),
               "ratio": round(app / gen, 3), "app_runs": [round(r, 1) for r in app_rates],
               "generate_runs": [round(r, 1) for r in gen_rates]}
        if before_rates:
            old = statistics.median(before_rates)
            row.update({"before_app_tok_s": round(old, 1), "before_ratio": round(old / gen, 3),
                        "before_engine_decode_tok_s": round(statistics.median(before_decode), 1),
                        "after_over_before": round(app / old, 3), "before_runs": [round(r, 1) for r in before_rates]})
        rows.append(row)
    return rows


if __name__ == "__main__":
    sys.exit(main())
