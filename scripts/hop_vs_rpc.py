"""The synchronous pipeline against llama.cpp's RPC on the bundled model, interleaved (issue 21's
per-hop target): 2 loopback workers at 1 thread each against 2 ``ggml-rpc-server -t 1``.

    .venv/bin/python -m scripts.hop_vs_rpc --bin ~/.cache/potluck-peers/bin [--rounds 2] [--max-tokens 128]

Each round runs ``potluck bench --cluster 2 --variants pipeline --families chat`` (its own
loopback workers, greedy, one rep) and then ``llama-bench --rpc A,B -ngl 99 -ts 1/1 -t 1 -fa on
-ctk bf16 -ctv bf16 --repack 0 -p 0 -n N -r 3`` on the same model (tools built by
../shared/tools/build-llama-tools.sh). This VM's speed drifts by a third within minutes, so
only rounds side by side compare. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from potluck.assets import default_model_path

from .peers import BENCH_ARGS, rpc_addresses, rpc_servers


def pipeline_tok_s(max_tokens: int) -> float:
    out = subprocess.run(
        [sys.executable, "-m", "potluck.app.cli", "bench", "--cluster", "2", "--variants", "pipeline",
         "--families", "chat", "--max-tokens", str(max_tokens), "--reps", "1", "--json"],
        capture_output=True, text=True, check=True,
    ).stdout
    rows = [r for r in json.loads(out) if r["variant"] == "pipeline"]
    return statistics.median(float(r["tokens_per_s"]) for r in rows)


def rpc_tok_s(bin_dir: Path, model: Path, max_tokens: int) -> float:
    with rpc_servers(bin_dir, 2) as servers:
        proc = subprocess.run(
            [str(bin_dir / "llama-bench"), "-m", str(model), "--rpc", rpc_addresses(servers), "-ngl", "99",
             "-ts", "1/1", "-t", "1", *BENCH_ARGS, "-p", "0", "-n", str(max_tokens), "-r", "3", "-o", "json"],
            capture_output=True, text=True,
        )
    if proc.returncode != 0:
        raise SystemExit(f"llama-bench --rpc failed:\n{proc.stderr[-2000:]}")
    return float(json.loads(proc.stdout)[0]["avg_ts"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin", type=Path, required=True, help="llama.cpp's tools (ggml-rpc-server, llama-bench)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    model = default_model_path()
    if model is None:
        raise SystemExit("hop_vs_rpc: the bundled model is missing; reinstall potluck")
    pipe, rpc = [], []
    for _ in range(args.rounds):
        pipe.append(round(pipeline_tok_s(args.max_tokens), 1))
        rpc.append(round(rpc_tok_s(args.bin, model, args.max_tokens), 1))
    ratios = [round(p / r, 3) for p, r in zip(pipe, rpc)]
    print(json.dumps({"pipeline_tok_s": pipe, "rpc_tok_s": rpc, "ratio_per_round": ratios,
                      "ratio_median": statistics.median(ratios)}))


if __name__ == "__main__":
    main()
