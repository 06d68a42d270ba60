"""Where `potluck serve`'s CPU goes a token, thread by thread (docs/facts.md §34).

Starts `potluck serve` on the bundled model, streams REPS replies through the official client
and reads each thread's CPU time from /proc before and after: the main thread is the event
loop (HTTP, SSE), the two busiest are llama.cpp's (they spin between ops, so their CPU is close
to wall time), the rest are the engine's Python threads (the lane's session, the hub). Run it on
two trees to compare them: ``PYTHONPATH`` pointing at another checkout's package serves that
one (a folder holding a ``potluck`` link to the checkout).

    python -m scripts.serve_thread_cpu [--reps 6] [--max-tokens 200] [--temp 0.8] [--strategy plain]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from potluck.app.serve.launch import start_server, stop_server

from .procfs import thread_cpu_s
from .serve_vs_llama_server import PROMPTS, client_for, decode_rate, replies


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--temp", type=float, default=0.8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--strategy", default="plain")
    args = ap.parse_args()
    home = Path(tempfile.mkdtemp(prefix="potluck-thread-cpu-"))
    server = start_server(home, ["-t", str(args.threads), "--ctx", "4096", "--strategy", args.strategy])
    try:
        client = client_for(server.base_url)
        decode_rate(client, PROMPTS[0], 16, {"temperature": 0})  # warm, unmeasured
        before = thread_cpu_s(server.proc.pid)
        tokens, rates = replies(client, args.reps, args.max_tokens, args.temp)
        after = thread_cpu_s(server.proc.pid)
    finally:
        stop_server(server.proc)
    used = {tid: after[tid] - before.get(tid, 0.0) for tid in after}
    print(f"{tokens} tokens, {args.reps} replies at temperature {args.temp:g}, "
          f"{' '.join(f'{r:.0f}' for r in rates)} tok/s")
    for tid, s in sorted(used.items(), key=lambda kv: -kv[1]):
        if s * 1e3 / max(tokens, 1) >= 0.005:
            role = "event loop" if tid == server.proc.pid else ""
            print(f"  thread {tid:>7} {1e3 * s / tokens:7.3f} ms a token {role}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
