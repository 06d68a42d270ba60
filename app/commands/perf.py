"""`potluck perf`: decode and prompt-processing speed of a model here, and its batch-cost curve."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from ...engine.loader import resolve_model
from ...engine.perf import measure
from ...engine.runtime import Model, default_threads
from .common import positive_int


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("perf", help="measure plain decode / prompt speed and the batch-cost curve")
    p.add_argument("-m", "--model", type=Path, help="GGUF model (default: the bundled one)")
    p.add_argument("-t", "--threads", type=int, default=0, help="CPU threads (default: all cores)")
    p.add_argument("--runs", type=positive_int, default=5, help="repetitions; medians are reported")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    with Model(resolve_model(args.model)) as model:
        report = measure(model, n_threads=args.threads, runs=args.runs)
    if args.json:
        print(json.dumps({**asdict(report), "batch_cost": report.batch_cost}))
        return 0
    print(f"model {report.model}, {args.threads or default_threads()} threads, median of {report.runs} runs")
    print(f"decode   {report.decode_tokens_per_s:8.1f} tokens/s (single-token steps)")
    print(f"prompt   {report.prefill_tokens_per_s:8.1f} tokens/s ({report.prefill_tokens}-token prompt)")
    print("batch cost (time of a k-token decode / 1-token decode):")
    for k, cost in report.batch_cost.items():
        print(f"  k={k:<3d} {report.batch_ms[k]:7.2f} ms  x{cost:.2f}")
    return 0
