"""`potluck locate`: where potluck keeps its files (settings, history, log, exports, models)."""

from __future__ import annotations

import argparse
import json

from ...assets import default_model_path
from ...engine import paths
from ..cli import COMMANDS


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "locate", help=COMMANDS["locate"],
        description="Print where potluck keeps its settings (config.toml), chat history, log, exports "
        "and the bundled model; `potluck locate config` prints one path.",
    )
    p.add_argument(
        "what",
        nargs="?",
        choices=sorted(_locations()),
        help="print only this location (for scripts: $(potluck locate config))",
    )
    p.add_argument("--json", action="store_true", help="one JSON object")


def _locations() -> dict[str, str]:
    bundled = default_model_path()
    return {
        "config": str(paths.config_file()),
        "history": str(paths.history_db()),
        "log": str(paths.log_file()),
        "exports": str(paths.exports_dir()),
        "cache": str(paths.cache_dir()),
        "model": str(bundled) if bundled else "(bundled model missing)",
    }


def run(args: argparse.Namespace) -> int:
    where = _locations()
    if args.what:
        print(where[args.what])
    elif args.json:
        print(json.dumps(where))
    else:
        width = max(map(len, where))
        for name, path in where.items():
            print(f"{name:<{width}}  {path}")
    return 0
