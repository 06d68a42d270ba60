"""`potluck models`: what can be loaded (the bundled default and files given)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ...assets import DEFAULT_MODEL_NAME, default_model_path
from ...engine import PotluckError
from ...engine import describe_gguf as describe


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "models", help="list the bundled model and describe GGUF files (layers, experts, whether --nodes splits them, "
        "how long a verify batch stays exact)"
    )
    p.add_argument("files", nargs="*", type=Path, help="GGUF files to describe")
    p.add_argument("--json", action="store_true", help="one JSON object per line")


def run(args: argparse.Namespace) -> int:
    rows: list[dict[str, object]] = []
    bundled = default_model_path()
    if bundled is not None:
        rows.append({"name": DEFAULT_MODEL_NAME, "default": True, **describe(bundled)})
    for path in args.files:
        try:
            rows.append({"name": path.name, "default": False, **describe(path)})
        except PotluckError as e:
            rows.append({"name": path.name, "default": False, "path": str(path), "error": str(e)})
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return 0
    if not rows:
        print("no models: the bundled model is missing; pass GGUF files to describe them")
    for row in rows:
        mark = "*" if row["default"] else " "
        if "error" in row:
            print(f"{mark} {row['name']}: {row['error']}")
            continue
        experts = ""
        if row["n_expert"]:
            shared = f" + {row['n_expert_shared']} shared" if row["n_expert_shared"] else ""
            experts = f", {row['n_expert_used']} of {row['n_expert']} experts{shared} a token"
        why = row["split_problem"]
        split = "yes" if why is None else f"no: {why}"
        print(
            f"{mark} {row['name']}\n    {row['path']}\n"
            f"    arch {row['arch']}, {row['n_layer']} layers, n_embd {row['n_embd']}, "
            f"vocab {row['n_vocab']}, {row['size_mb']:.0f} MB{experts}\n"
            f"    split over machines (--nodes): {split}\n"
            f"    speculation: {row['speculation']}"
        )
    return 1 if any("error" in r for r in rows) else 0
