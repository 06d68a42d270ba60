"""Where a sampled token's extra time goes outside llama.cpp (issue 43's profile, docs/facts.md §34).

One plain reply per setting on the bundled model, greedy and sampled, and for each the CPU time
per token of the thread that runs the session (the sampler, the per-reply generator, the events:
all but the decode, which runs on the target's own thread), from ``time.thread_time`` so other
processes on a busy machine change it little. ``--profile`` adds cProfile's top functions (also
by thread CPU time). Run it on an older checkout with ``PYTHONPATH=<its package dir>`` to compare.

    python -m scripts.sampled_token_cost [--max-tokens 100] [--reps 2] [--threads 1] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

from potluck.engine import EngineSpec, SamplingParams, open_session
from potluck.engine.core.events import Finished

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
SETTINGS = {
    "greedy": SamplingParams(),
    "temperature 0.8, top-k 40, top-p 0.95, min-p 0.05": SamplingParams(
        temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=1
    ),
    "temperature 0.8 alone (the whole vocabulary)": SamplingParams(temperature=0.8, seed=1),
}


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-tokens", type=int, default=100)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="llama.cpp threads (1: no OpenMP team to wait on)")
    ap.add_argument("--profile", action="store_true", help="print cProfile's top functions of the last rep")
    args = ap.parse_args()
    session = open_session(EngineSpec(strategy="plain", n_threads=args.threads, n_ctx=4096))
    cpu: dict[str, list[float]] = {}
    print(f"load before: {load()}")
    try:
        for rep in range(args.reps):  # interleaved: every setting once a rep
            for name, params in SETTINGS.items():
                prof = cProfile.Profile(timer=time.thread_time) if args.profile and rep == args.reps - 1 else None
                start = time.thread_time()
                if prof:
                    prof.enable()
                events = list(session.generate(PROMPT, params, args.max_tokens))
                if prof:
                    prof.disable()
                spent = time.thread_time() - start
                session.messages.clear()
                n = len(next(e for e in reversed(events) if isinstance(e, Finished)).tokens)
                cpu.setdefault(name, []).append(1e3 * spent / n)
                if prof:
                    out = io.StringIO()
                    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(8)
                    print(f"-- {name}:\n" + "\n".join(ln for ln in out.getvalue().splitlines()[6:] if ln.strip()))
    finally:
        session.close()
    print(f"load after: {load()}\n\n| setting | session thread CPU, ms/token (each rep) |\n|---|---|")
    for name, runs in cpu.items():
        print(f"| {name} | {', '.join(f'{ms:.2f}' for ms in runs)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
