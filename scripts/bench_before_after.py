"""The same ``potluck bench`` at an earlier commit and at this tree, interleaved (issue 19's check
that a restructuring changed no speed).

    .venv/bin/python -m scripts.bench_before_after --ref 5d7d51b --kind strategies
    .venv/bin/python -m scripts.bench_before_after --ref 5d7d51b --kind cluster
    .venv/bin/python -m scripts.bench_before_after --ref 5d7d51b --kind paired [--pairs 6]

``strategies`` runs ``bench --strategies anpd,pearl,minions --reps 3``; ``cluster`` runs
``bench --cluster 2 --reps 1``. The earlier commit is checked out in a git worktree and
imported through ``PYTHONPATH`` over a folder that maps ``potluck.*`` to its folders, with
this checkout's virtual environment (so both use the same llama.cpp build). Each side gets
its own POTLUCK_HOME. Runs go before, after, after, before, before, after, so a machine that
drifts during the hour weighs on both sides alike. The table gives medians per strategy and
prompt family and the ratio after/before. Keep the machine quiet meanwhile: one command
beside it moves a run by 10 % or more.

``paired`` answers the same question where the machine drifts faster than a bench run lasts
(seconds against minutes): one ``generate --temp 0 --max-tokens 200 --json`` reply per side,
before and after in turn, ``--pairs`` times per strategy (plain, anpd, pearl) on one prompt
that copies its input, and the median tokens/s of each side.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("app", "engine", "discovery", "assets")
ARGS = {
    "strategies": ["bench", "--strategies", "anpd,pearl,minions", "--reps", "3", "--json"],
    "cluster": ["bench", "--cluster", "2", "--reps", "1", "--json"],
}
PAIRED_STRATEGIES = ("autoregressive", "anpd", "pearl")  # "autoregressive": plain, under a name both know
PAIRED_PROMPT = ("Rewrite this function with the variable total renamed to running_sum: def add_all(xs):\n"
                 "    total = 0\n    for x in xs:\n        total += x\n    return total")
RENAMED = {"autoregressive": "plain"}  # the plain baseline's former name
RUN = "import sys; from potluck.app.cli import main; sys.argv = ['potluck'] + sys.argv[1:]; sys.exit(main())"


def package_root(tree: Path, folder: Path) -> Path:
    """A folder whose ``potluck/`` maps each subpackage to ``tree``'s (as pyproject's package-dir does)."""
    pkg = folder / "potluck"
    pkg.mkdir(parents=True, exist_ok=True)
    for name in PACKAGES:
        (pkg / name).symlink_to(tree / name)
    return folder


def potluck_json(args: list[str], pythonpath: Path, home: Path) -> Any:
    """``potluck ARGS`` from the tree under ``pythonpath``, its JSON output."""
    env = dict(os.environ, PYTHONPATH=str(pythonpath), POTLUCK_HOME=str(home))
    done = subprocess.run([sys.executable, "-c", RUN, *args], env=env, cwd=tempfile.gettempdir(),
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def reply_speed(strategy: str, pythonpath: Path, home: Path) -> float:
    args = ["generate", "--strategy", strategy, "--temp", "0", "--max-tokens", "200", "--json", PAIRED_PROMPT]
    return float(potluck_json(args, pythonpath, home)["tokens_per_s"])


def paired(paths: dict[str, Path], work: Path, pairs: int) -> str:
    out = [f"{'strategy':14s} {'before (median)':>16s} {'after (median)':>15s} ratio"]
    for strategy in PAIRED_STRATEGIES:
        speeds: dict[str, list[float]] = {"before": [], "after": []}
        for _ in range(pairs):
            for side in ("before", "after"):
                speeds[side].append(reply_speed(strategy, paths[side], work / f"home-{side}"))
        before, after = statistics.median(speeds["before"]), statistics.median(speeds["after"])
        out.append(f"{RENAMED.get(strategy, strategy):14s} {before:16.1f} {after:15.1f} {after / before:.3f}")
    return "\n".join(out)


def table(runs: dict[str, list[list[dict]]]) -> str:
    rows: dict[tuple[str, str], dict[str, list[float]]] = {}
    for side, side_runs in runs.items():
        for run in side_runs:
            for r in run:
                name = r.get("variant") or r["strategy"]
                rows.setdefault((RENAMED.get(name, name), r["family"]), {"before": [], "after": []})[side].append(
                    r["tokens_per_s"])
    out = [f"{'variant':26s} {'family':14s} {'before: median [runs]':32s} {'after':32s} ratio"]
    worst = 0.0
    for (name, family), d in rows.items():
        before, after = statistics.median(d["before"]), statistics.median(d["after"])
        worst = max(worst, abs(after / before - 1))
        cells = [f"{statistics.median(xs):6.1f} [" + ", ".join(f"{x:.1f}" for x in xs) + "]"
                 for xs in (d["before"], d["after"])]
        out.append(f"{name:26s} {family:14s} {cells[0]:32s} {cells[1]:32s} {after / before:.3f}")
    out.append(f"largest deviation of medians {worst * 100:.1f} %")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ref", required=True, help="the earlier commit")
    ap.add_argument("--kind", choices=[*ARGS, "paired"], required=True)
    ap.add_argument("--pairs", type=int, default=6, help="with --kind paired: replies per side and strategy")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="potluck-before-after-") as tmp:
        work = Path(tmp)
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(work / "tree"), args.ref],
                       check=True, capture_output=True)
        try:
            paths = {"before": package_root(work / "tree", work / "before"),
                     "after": package_root(ROOT, work / "after")}
            if args.kind == "paired":
                print(paired(paths, work, args.pairs))
                return 0
            runs: dict[str, list[list[dict]]] = {"before": [], "after": []}
            for i, side in enumerate(("before", "after", "after", "before", "before", "after"), 1):
                runs[side].append(potluck_json(ARGS[args.kind], paths[side], work / f"home-{side}"))
                print(f"run {i}/6 ({side}) done", file=sys.stderr, flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(work / "tree")],
                           capture_output=True)
    print(table(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
