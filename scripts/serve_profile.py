"""Where `potluck serve`'s Python time goes, function by function, on the lane's thread (the
session: sampling, events) and on the event loop (HTTP, SSE): docs/facts.md §34.

Starts `potluck serve` through this module (``--serve``), which wraps each request's run on
its lane (``EngineThread._run``) and the main thread in cProfile before it runs the CLI, streams
REPS replies through the official client, then has the server write its profiles (SIGUSR1)
and prints each thread's top functions a token. The profiler slows every Python call, so the
figures are for comparing functions and trees, not absolute; wall time in a C call (a lock, a
socket write, a ctypes call) includes waiting for the GIL afterwards.

    python -m scripts.serve_profile [--reps 4] [--max-tokens 200] [--temp 0.8] [--top 15]
        [--strategy plain] [--only sampling]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import runpy
import signal
import sys
import tempfile
import time
from pathlib import Path

from potluck.app.serve.launch import start_server, stop_server

from .serve_vs_llama_server import PROMPTS, client_for, decode_rate, replies

PROFILES = "POTLUCK_PROFILE_DIR"  # where the server writes main.prof and lanes.prof


def serve_profiled(argv: list[str]) -> None:
    """The server's side: ``argv`` is the command start_server would run (python -m
    potluck.app.cli serve ...); run it here, profiled."""
    from potluck.app.serve import engine_thread

    out = Path(os.environ[PROFILES])
    main, lanes = cProfile.Profile(), pstats.Stats()
    run = engine_thread.EngineThread._run

    def profiled_run(self: engine_thread.EngineThread, session: object, job: object) -> None:
        profile = cProfile.Profile()
        profile.enable()
        try:
            run(self, session, job)  # type: ignore[arg-type]
        finally:
            profile.disable()
            lanes.add(profile)

    def dump(*_: object) -> None:
        main.disable()
        main.dump_stats(out / "main.prof")
        lanes.dump_stats(out / "lanes.prof")
        (out / "done").touch()

    engine_thread.EngineThread._run = profiled_run  # type: ignore[method-assign]
    signal.signal(signal.SIGUSR1, dump)
    sys.argv = ["potluck", *argv[argv.index("potluck.app.cli") + 1:]]
    main.enable()
    runpy.run_module("potluck.app.cli", run_name="__main__", alter_sys=True)


def report(path: Path, title: str, tokens: int, top: int, only: str) -> None:
    stats = pstats.Stats(str(path))
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])  # type: ignore[attr-defined]
    print(f"\n{title}: ms a token (tottime; cumtime), calls a token")
    shown = 0
    for (file, line, name), (_, calls, tottime, cumtime, _) in rows:
        where = f"{Path(file).name}:{line}({name})" if line else name
        if only and only not in where:
            continue
        print(f"  {1e3 * tottime / tokens:8.3f} {1e3 * cumtime / tokens:8.3f} {calls / tokens:6.2f}  {where}")
        shown += 1
        if shown >= top:
            break


def main() -> int:
    if sys.argv[1:2] == ["--serve"]:
        serve_profiled(sys.argv[2:])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--temp", type=float, default=0.8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--strategy", default="plain")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--only", default="", help="only functions whose place contains this (a file's name, say)")
    args = ap.parse_args()
    home = Path(tempfile.mkdtemp(prefix="potluck-profile-"))
    server = start_server(home, ["-t", str(args.threads), "--ctx", "4096", "--strategy", args.strategy],
                          env={PROFILES: str(home)}, wrapper=[sys.executable, "-m", "scripts.serve_profile", "--serve"])
    try:
        client = client_for(server.base_url)
        decode_rate(client, PROMPTS[0], 16, {"temperature": 0})  # warm: its run is profiled too, 16 tokens
        tokens, rates = replies(client, args.reps, args.max_tokens, args.temp)
        tokens += 16
        os.kill(server.proc.pid, signal.SIGUSR1)
        deadline = time.monotonic() + 30
        while not (home / "done").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        stop_server(server.proc)
    if not (home / "done").exists():
        raise SystemExit(f"the server wrote no profile (its log: {home / 'serve.log'})")
    print(f"{tokens} tokens, {args.reps} replies at temperature {args.temp:g} (and a 16-token warm-up), "
          f"{' '.join(f'{r:.0f}' for r in rates)} tok/s under the profiler")
    report(home / "lanes.prof", "the lane's thread", tokens, args.top, args.only)
    report(home / "main.prof", "the event loop (and the server's start)", tokens, args.top, args.only)
    return 0


if __name__ == "__main__":
    sys.exit(main())
