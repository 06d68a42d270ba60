"""``--nodes auto`` with an attacker on the LAN (issue 20, finding 3): a script with a figure.

    .venv/bin/python -m scripts.nodes_auto_under_attack [--junk 10] [--silent 0] [--reps 3]

An attacker without the cluster token announces zeroconf records: a clone of a real worker's
record (same node id and instance name, at a dead address) and junk records with fresh node
ids. Dead addresses are loopback ports nobody listens on, or (``--silent N`` of the junk)
ports that take a TCP connection and never answer, like a host that is up but is no worker.
One real loopback worker advertises itself. The head then does what ``--nodes auto`` does
(:func:`potluck.discovery.lan.find_candidates`, then ``open_pipeline`` skipping candidates
that fail to join) and the script reports the time to browse, to join (until the plan) and
to load the chain, and the most silent-port connections open at once (all of them: the
candidates were tried in parallel). Everything is bound to 127.0.0.1 (docs/facts.md §10).
tests/test_trust_discovery.py runs the same scenario; both take it from potluck.discovery.lab.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from potluck.app.loopback import spawn_worker, stop_worker
from potluck.assets import default_model_path
from potluck.discovery.auth import generate_token
from potluck.discovery.lab import nodes_auto_under_attack
from potluck.engine.cluster.transfer import SliceCache


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--junk", type=int, default=10, help="junk records (default 10)")
    ap.add_argument("--silent", type=int, default=0, help="of them at ports that accept and stay silent (default 0)")
    ap.add_argument("--join-timeout", type=float, default=5.0, help="the joins' one deadline, s (default 5)")
    ap.add_argument("--browse", type=float, default=3.0, help="seconds to browse (default 3; the CLI's is 2)")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    if not 0 <= args.silent <= args.junk:
        ap.error("--silent must be 0..--junk")
    runs = []
    with tempfile.TemporaryDirectory(prefix="potluck-attack-") as tmp:
        token = generate_token()  # other loopback workers (another run's) hold other tokens
        real = spawn_worker(Path(tmp), "real", token, zeroconf=True)
        try:
            cache = SliceCache(Path(tmp) / "slices")
            for i in range(args.reps):
                run = nodes_auto_under_attack(
                    default_model_path(), real.node_id, token, cache, junk=args.junk, silent=args.silent,
                    browse_s=args.browse, join_timeout_s=args.join_timeout,
                )
                ok = run.joined == [run.real_id]
                print(f"rep {i}: {run.candidates} candidates; browse {run.browse_s:.1f} s, join {run.join_s:.2f} s, "
                      f"load {run.load_s:.1f} s; chain {'= the real worker' if ok else run.joined}; "
                      f"silent ports open at once {run.silent_peak}/{run.silent}", flush=True)
                runs.append((run, ok))
        finally:
            stop_worker(real.proc)
    joins = [r.join_s for r, _ in runs]
    print(f"join (until the plan), {args.junk} junk ({args.silent} silent) + 1 clone: "
          f"median {statistics.median(joins):.2f} s, max {max(joins):.2f} s over {len(runs)} runs")
    return 0 if all(ok for _, ok in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
