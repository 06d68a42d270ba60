"""Command line entry point: parses arguments and hands off to one command module.

Each command lives in its own module (``app/commands/*.py``) exposing ``add_parser`` and
``run``; this file only wires them. User-facing errors become one line on stderr and exit
code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from importlib import import_module
from importlib.metadata import PackageNotFoundError, version
from typing import NoReturn

from ..engine import PotluckError, PrintableFormatter, printable

# Each command and its line in `potluck --help`, in that order; the first runs when no command
# is given. The lines live here so that `potluck --help` imports no command module (each imports
# what it runs: the loader, every strategy, the chat app).
COMMANDS = {
    "chat": "open the chat app (the default command)",
    "generate": "generate one reply to PROMPT (or stdin) and print it",
    "serve": "serve the model over an OpenAI-compatible HTTP API",
    "models": "list the models on this machine and describe GGUF files (layers, experts, whether --nodes splits "
    "them, how long a verify batch stays exact)",
    "pull": "download a GGUF model from Hugging Face",
    "perf": "measure plain decode / prompt speed and the batch-cost curve",
    "locate": "print where settings, history, log and exports live",
    "worker": "serve model layers to a head on the LAN (one per spare PC)",
    "nodes": "list potluck workers found on the LAN (zeroconf)",
    "token": "generate a cluster token (pass it to every worker and head)",
    "bench": "benchmark decoding strategies against plain decoding and llama-cpp-python's prompt lookup",
    "simulate": "model the cluster pipeline: iterative, speculative, pipelined and PipeInfer decoding",
}


def potluck_version() -> str:
    try:
        return version("potluck")
    except PackageNotFoundError:  # running from a source tree
        return "0+unknown"


def one_line(message: str) -> str:
    """A message that may quote user input (a path with a newline) as exactly one line."""
    return " ".join(message.splitlines())


class OneLineParser(argparse.ArgumentParser):
    """argparse's errors (bad numbers, unknown options) as one line and exit code 2, like
    every other refusal; its default prints the usage block first. Subcommands inherit it."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        # no prefix matching: `serve --api-key X` once meant --api-key-file X
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {one_line(message)} (see {self.prog} --help)\n")


def build_parser(commands: Sequence[str] = tuple(COMMANDS), *, listed: bool = False) -> argparse.ArgumentParser:
    """The command line with ``commands`` wired in: all of them, or only the one that runs, since
    each command module imports what it runs (the loader, every strategy) and a worker, a stage
    or ``potluck --version`` (none at all) should not. ``listed``: every command by its line in
    :data:`COMMANDS` only, for ``potluck --help``."""
    parser = OneLineParser(
        prog="potluck",
        description="Chat with local LLMs: lossless speculative decoding, LAN layer split.",
    )
    parser.add_argument("--version", action="version", version=f"potluck {potluck_version()}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="log to stderr (-vv: debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in commands:
        if listed:
            sub.add_parser(name, help=COMMANDS[name])
        else:
            import_module(f"potluck.app.commands.{name}").add_parser(sub)
    return parser


_VERBOSE = ("-v", "-vv", "-vvv", "--verbose")


def with_default_command(argv: list[str]) -> list[str]:
    """``potluck [-v] [chat options]`` means ``potluck [-v] chat [chat options]``."""
    rest = [a for a in argv if a not in _VERBOSE]
    if (rest and rest[0] in COMMANDS) or rest in (["-h"], ["--help"], ["--version"]):
        return argv
    return [*(a for a in argv if a in _VERBOSE), next(iter(COMMANDS)), *rest]


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("NUMBA_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "potluck", "numba"))
    argv = with_default_command(list(sys.argv[1:] if argv is None else argv))
    named = [a for a in argv if a not in _VERBOSE][:1]
    wired = [] if named == ["--version"] else [n for n in named if n in COMMANDS] or list(COMMANDS)
    args = build_parser(wired, listed=named in (["-h"], ["--help"])).parse_args(argv)
    level = logging.WARNING if args.verbose == 0 else (logging.INFO if args.verbose == 1 else logging.DEBUG)
    handler = logging.StreamHandler()
    handler.setFormatter(PrintableFormatter("%(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level, handlers=[handler])
    command = args.command
    module = import_module(f"potluck.app.commands.{command}")
    try:
        return int(module.run(args) or 0)
    except PotluckError as e:
        # printable: the message may quote another party (a worker's refusal, a record's text)
        print(f"potluck: error: {printable(one_line(str(e)))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("potluck: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
