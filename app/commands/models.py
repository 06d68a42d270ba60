"""`potluck models`: what can be loaded: the bundled default, files given, and the GGUFs on
this machine (`potluck pull`'s downloads, LM Studio's and ollama's models)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ...assets import DEFAULT_MODEL_NAME, default_model_path
from ...engine import PotluckError
from ...engine import describe_gguf as describe
from ..cli import COMMANDS
from ..model_files import models_on_disk


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "models",
        help=COMMANDS["models"],
        description="List the bundled model, the GGUFs in the Hugging Face cache (potluck pull), "
        "LM Studio's and ollama's models, or describe the GGUF files given: their layers, experts, and whether "
        "--nodes can split them (and why not), and how long a verify batch stays exact.",
    )
    p.add_argument("files", nargs="*", type=Path, help="GGUF files to describe")
    p.add_argument("--json", action="store_true", help="one JSON object per line")


def run(args: argparse.Namespace) -> int:
    rows: list[dict[str, object]] = []
    bundled = default_model_path()
    if bundled is not None:
        rows.append({"name": DEFAULT_MODEL_NAME, "default": True, **describe(bundled)})
    named = [(path, path.name, "") for path in args.files]
    if not args.files:  # what other tools left on this machine
        named = [(f.path, f.name, f.source) for f in models_on_disk()]
    for path, name, source in named:
        where = {"source": source} if source else {}
        try:
            rows.append({"name": name, "default": False, **where, **describe(path)})
        except PotluckError as e:
            rows.append({"name": name, "default": False, **where, "path": str(path), "error": str(e)})
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return 0
    if not rows:
        print("no models: the bundled model is missing; pass GGUF files to describe them")
    for row in rows:
        mark = "*" if row["default"] else " "
        source = f" ({row['source']})" if row.get("source") else ""
        if "error" in row:
            print(f"{mark} {row['name']}{source}: {row['error']}")
            continue
        experts = ""
        if row["n_expert"]:
            shared = f" + {row['n_expert_shared']} shared" if row["n_expert_shared"] else ""
            experts = f", {row['n_expert_used']} of {row['n_expert']} experts{shared} a token"
        if row["cache"] not in (None, "kv"):  # a hybrid's recurrent state beside its KV cells
            experts += f", cache {row['cache']}"
        why = row["split_problem"]
        split = "yes" if why is None else f"no: {why}"
        print(
            f"{mark} {row['name']}{source}\n    {row['path']}\n"
            f"    arch {row['arch']}, {row['n_layer']} layers, n_embd {row['n_embd']}, "
            f"vocab {row['n_vocab']}, {row['size_mb']:.0f} MB{experts}\n"
            f"    split over machines (--nodes): {split}\n"
            f"    speculation: {row['speculation']}"
        )
    if not args.files and len(rows) <= 1:
        print("  (no other GGUF found: `potluck pull ORG/REPO-GGUF` downloads one)")
    return 1 if any("error" in r for r in rows) and args.files else 0
