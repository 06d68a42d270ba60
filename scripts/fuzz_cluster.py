"""Fuzz the cluster both ways on loopback (not CI: tests run a few hundred cases). The
campaigns are engine/lab/cluster_fuzz.py's; prints one JSON report, exit status 0 only if
every check held.

    nice -n 19 .venv/bin/python scripts/fuzz_cluster.py --as-head 100000 --as-worker 100000
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from contextlib import AbstractContextManager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from potluck.app.loopback import LoopbackWorker, running_worker  # noqa: E402
from potluck.discovery.auth import keys_from_token  # noqa: E402
from potluck.engine.core.runtime import Model  # noqa: E402
from potluck.engine.lab.cluster_fuzz import fuzz_as_head, fuzz_as_worker  # noqa: E402
from potluck.engine.loader import resolve_model  # noqa: E402

TOKEN = "potluck-fuzz-Q7vX2mLp9RkT4wZcH8sN3bYd"


def fuzz_worker(folder: Path) -> AbstractContextManager[LoopbackWorker]:
    """A worker of the fuzz token with a small cache quota, stopped when the block ends."""
    return running_worker(folder, "w", TOKEN, extra_args=["--cache-quota-mb", "512"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--as-head", type=int, default=0, metavar="N", help="cases as the authenticated upstream head")
    p.add_argument("--as-worker", type=int, default=0, metavar="N", help="cases as a malicious worker")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    model_path = resolve_model(None)
    keys = keys_from_token(TOKEN)
    report: dict[str, object] = {"seed": args.seed}
    with tempfile.TemporaryDirectory(prefix="potluck-fuzz-") as d, Model(model_path) as model:
        tmp = Path(d)
        t0 = time.monotonic()
        if args.as_head:
            report["as_head"] = fuzz_as_head(args.as_head, args.seed, model, model_path, tmp, keys, fuzz_worker)
        if args.as_worker:
            report["as_worker"] = fuzz_as_worker(args.as_worker, args.seed, model, model_path, tmp, keys, fuzz_worker)
        report["seconds"] = round(time.monotonic() - t0, 1)
    ok = all(r["ok"] for r in report.values() if isinstance(r, dict))
    report["ok"] = ok
    print(json.dumps(report, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
