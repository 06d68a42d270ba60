"""`potluck token`: make the secret that lets a head and its workers talk (CURVE keys derive from it)."""

from __future__ import annotations

import argparse
import sys

from ...discovery.auth import generate_token, read_token_file, save_token, token_file
from ..cli import COMMANDS


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "token", help=COMMANDS["token"],
        description="Generate and save a cluster token (256 random bits). Give it to every worker and head "
        "($POTLUCK_TOKEN or a 0600 --token-file): it keys all cluster traffic.",
    )
    p.add_argument("--show", action="store_true", help="print the saved token instead of making one")
    p.add_argument("--no-save", action="store_true", help="print a new token without saving it")


def run(args: argparse.Namespace) -> int:
    if args.show:
        path = token_file()
        if not path.exists():
            from ...engine import PotluckError

            raise PotluckError("no saved token; run `potluck token` to make one")
        print(read_token_file(path))
        return 0
    token = generate_token()
    if not args.no_save:
        path = save_token(token)
        print(f"saved to {path} (mode 600); give other machines the same token in $POTLUCK_TOKEN "
              "or a file passed with --token-file", file=sys.stderr)
    print(token)
    return 0
