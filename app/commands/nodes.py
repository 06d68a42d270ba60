"""`potluck nodes`: list the workers advertising themselves on the LAN, with their figures."""

from __future__ import annotations

import argparse
import time
from collections import Counter
from pathlib import Path

from ...discovery.lan import DiscoveredNode, Membership
from ...engine import PotluckError, default_threads, measure_profile, preview_plan, printable, resolve_model
from ..cli import COMMANDS
from .common import positive_int


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "nodes", help=COMMANDS["nodes"],
        description="List the potluck workers found on the LAN (zeroconf): node, address, cores, free "
        "memory and speed; --watch keeps the list live.",
    )
    p.add_argument("--timeout", type=float, default=2.0, help="seconds to listen (default 2)")
    p.add_argument("--watch", action="store_true", help="keep listening; print nodes as they come and go")
    p.add_argument(
        "--interface", action="append", help="browse only on this interface address (repeatable)"
    )
    p.add_argument(
        "-m", "--model", type=Path,
        help="also print the split --nodes auto would plan for this GGUF over the workers found "
        "(their free memory and speed; layers, memory, and a mixture's experts)",
    )
    p.add_argument("--ctx", type=positive_int, default=4096, help="with -m: the context to plan for (4096)")


def _row(n: DiscoveredNode, twins: int = 1) -> str:
    """One node's line. Everything in it is what a record claims, and anyone on the LAN may
    announce one without the token: its text is shown escaped (an ``ESC ]52;`` would write the
    clipboard, ``ESC [2J`` clear the screen), one line, cut to its column's worth."""
    flag = "" if n.compatible else f"  (protocol {n.protocol}: incompatible)"
    if twins > 1:  # a worker with several addresses, or a clone: joining tells (the token proves it)
        flag += f"  (id advertised at {twins} addresses)"
    node_id, address = printable(n.node_id, limit=40), printable(n.address, limit=60)
    return (
        f"{node_id:<14}{address:<24}{n.cores:>6}{n.free_mb:>10}{n.speed:>9g}  {printable(n.version, limit=40)}{flag}"
    )


HEADER = f"{'NODE':<14}{'ADDRESS':<24}{'CORES':>6}{'FREE MB':>10}{'SPEED':>9}  VERSION"


def run(args: argparse.Namespace) -> int:
    if args.watch:
        print(HEADER, flush=True)
        m = Membership(
            interfaces=args.interface,
            on_change=lambda kind, n: print(("+ " if kind == "added" else "- ") + _row(n), flush=True),
        )
        try:
            while True:
                time.sleep(1)
        except KeyboardInterrupt:
            return 0
        finally:
            m.close()
    m = Membership(interfaces=args.interface)
    try:
        time.sleep(args.timeout)
        nodes = m.nodes()
    finally:
        m.close()
    if not nodes:
        print("no potluck workers found (start `potluck worker` on a PC of this LAN, or use --nodes)")
        return 1
    print(HEADER)
    ids = Counter(n.node_id for n in nodes)
    for n in nodes:
        print(_row(n, ids[n.node_id]))
    return _print_plan(args, nodes) if args.model else 0


def _print_plan(args: argparse.Namespace, nodes: list[DiscoveredNode]) -> int:
    """The plan over the compatible workers found, each once, with this machine as the head
    (links are timed only at join, so its prediction leaves hops out)."""
    seen: dict[str, DiscoveredNode] = {}
    for n in nodes:
        if n.compatible:
            seen.setdefault(n.node_id, n)
    try:
        found = [(n.node_id, n.address, n.free_mb, n.speed) for n in seen.values()]
        head_speed = measure_profile(default_threads()).speed  # this machine computes the last layers
        plan = preview_plan(resolve_model(args.model), found, args.ctx, head_speed=head_speed)
    except PotluckError as e:
        print(f"no plan for {args.model.name}: {e}")
        return 1
    print()
    print("\n".join(plan.describe()))
    return 0
