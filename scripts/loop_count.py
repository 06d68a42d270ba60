"""How often replies loop: greedy decoding against the chat app's sampling defaults.

    .venv/bin/python -m scripts.loop_count [--max-tokens 200] [--seeds 1,2,3] [--json]

20 varied chat prompts (fixed here, written before any tuning) are answered by the bundled
model (or ``-m``), once greedily (plain decoding: deterministic, so each seed would repeat
the same reply) and once per seed with the chat app's [sampling] defaults under its default
strategy (``auto``). A reply *loops* when some 8-token sequence occurs 3 times or more in
it (engine/lab/loop_count.py). The report gives both counts over 60 replies
(20 prompts x 3 seeds; a greedy loop counts once per seed) and the prompts that looped.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from potluck.app.config import Settings
from potluck.engine.lab.loop_count import NGRAM, TIMES, count_loops

PROMPTS = [
    "Give me three tips for learning to juggle.",
    "What should I pack for a weekend hiking trip?",
    "Write a short poem about autumn leaves.",
    "How do I make a good cup of coffee at home?",
    "Explain why the sky is blue to a ten-year-old.",
    "What are some fun things to do on a rainy day?",
    "Suggest a name for my new grey kitten and say why.",
    "How can I sleep better at night?",
    "Tell me a short story about a dragon who is afraid of the dark.",
    "What is the difference between weather and climate?",
    "Give me a simple recipe for pancakes.",
    "How do I start learning to play the guitar?",
    "Write a friendly message inviting my neighbours to a barbecue.",
    "What are the benefits of regular exercise?",
    "Describe a perfect day at the beach.",
    "How do plants make their food?",
    "I feel nervous before a job interview. Any advice?",
    "List some good habits for saving money.",
    "Why do cats purr?",
    "Plan a three-day trip to Rome for me.",
]
SEEDS = (1, 2, 3)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", type=Path, help="GGUF model (default: the bundled one)")
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--seeds", default=",".join(map(str, SEEDS)), help="comma-separated sampling seeds")
    ap.add_argument("--prompts", type=int, default=len(PROMPTS), help="use the first N prompts")
    ap.add_argument("-t", "--threads", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    defaults = Settings()
    r = count_loops(args.model, PROMPTS[: args.prompts], seeds, args.max_tokens, defaults.model.strategy,
                    lambda seed: replace(defaults.sampling, seed=seed).params(), args.threads)
    if args.json:
        print(json.dumps(r.__dict__))
        return 0
    print(f"replies per mode: {r.replies} ({args.prompts} prompts x {len(seeds)} seeds, {args.max_tokens} tokens)")
    print(f"looping ({NGRAM}-token sequence {TIMES}+ times): greedy {r.greedy_loops}, defaults {r.sampled_loops}")
    for p in r.greedy_looped:
        print(f"  greedy loops: {p}")
    for p, seed in r.sampled_looped:
        print(f"  sampled loops (seed {seed}): {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
