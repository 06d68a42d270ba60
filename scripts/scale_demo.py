"""A model bigger than either worker: a random-weight shape (default 8b, about 4.2 GB) split over
2 loopback workers, each in a memory cgroup capped below the model's size, the head vocab-only.

    sudo .venv/bin/python -m scripts.scale_demo --shape 8b --cap 0.6 --tokens 32
    sudo .venv/bin/python -m scripts.scale_demo --shape 1b --relay wifi   # workers behind link_relay
    sudo .venv/bin/python -m scripts.scale_demo --rpc ~/.cache/potluck-peers/bin  # and llama.cpp's RPC
    sudo .venv/bin/python -m scripts.scale_demo --shape gpt-oss-20b --rpc ~/.cache/potluck-peers/bin
    sudo .venv/bin/python -m scripts.scale_demo --shape gpt-oss-20b --layers 6   # fewer layers, same width
    sudo .venv/bin/python -m scripts.scale_demo --shape qwen35moe-35b-a3b --layers 16   # the hybrid

One run reports: greedy tokens against one uncapped process; the first load (slices streamed)
and the second (cached); TTFT and tokens/s of the synchronous pipeline and of pipeinfer; peak
RSS of the head, of each worker and of its llama.cpp child (VmHWM, file pages included, as
/usr/bin/time reports it); bytes per token from the last worker to the head; the planner's
predicted tokens/s (synchronous) beside the measured figure. The head and the
reference run in their own processes so that each peak is its own. With ``--rpc DIR`` (llama.cpp's
tools, built by ../shared/tools/build-llama-tools.sh) the same model, caps and split run on
llama.cpp's RPC too: ``ggml-rpc-server -t 1 -c`` twice, each in a capped group like a worker's,
and ``llama-bench --rpc`` with the layers split evenly (``-ts 1/1``), twice (the second run finds
the servers' tensor cache warm). Needs root for the cgroups
(cgroup v1 memory controller, as on this machine). The Llama shapes' vocabulary is the bundled
model's 49,152 tokens: a real Llama 3's output layer (128,256 tokens) is 2.6x larger, so the
head's memory here is smaller than it would be with a real 8B; the mixtures' shapes (gpt-oss-20b,
qwen3-30b-a3b) have their published vocabulary (the bundled tokenizer, padded), the hybrid's
(qwen35moe-35b-a3b) the bundled one. A slice of the hybrid holding one kind of layer only (three
Gated DeltaNet layers to one of attention) carries a layer of the other kind as zeros, as
llama.cpp needs both (engine/core/archs.py). Its router is F32, as in published GGUFs: pipeinfer's verify batches
then need not equal single steps (docs/facts.md §30), and the demo says so where they differ.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from potluck.app.loopback import spawn_worker, stop_worker
from potluck.discovery.auth import generate_token, keys_from_token
from potluck.engine.core import memory
from potluck.engine.core.errors import PotluckError
from potluck.engine.lab.shapes import SHAPE_NAMES, build_named_shape

from .peers import BENCH_ARGS, rpc_addresses, rpc_servers
from .procfs import process_tree

ROOT = Path(__file__).resolve().parents[1]

PROMPT = "Write a short story about a lighthouse keeper."


def peak_rss_mb(pid: int) -> float:
    """VmHWM: the process's peak resident set, file pages included (what /usr/bin/time reports)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


class PeakWatch:
    """Samples the worker process trees while heads run: a stage's llama.cpp child exits with
    its head, taking its VmHWM with it, so each pid's peak is read while it lives."""

    def __init__(self, roots: list[int]) -> None:
        self.roots = roots
        self.peaks: dict[int, dict[int, float]] = {r: {} for r in roots}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.25):
            for root in self.roots:
                for pid in process_tree(root):
                    try:
                        self.peaks[root][pid] = max(self.peaks[root].get(pid, 0.0), peak_rss_mb(pid))
                    except OSError:
                        pass

    def stop(self) -> dict[int, dict[int, float]]:
        self._stop.set()
        self._thread.join()
        return self.peaks


def capped_group(limit_bytes: int, name: str) -> Path:
    parent = next((d for v, d in memory.own_cgroup_dirs() if v == 1), None)
    if parent is None or os.geteuid() != 0:
        raise SystemExit("needs root and the cgroup v1 memory controller (see the docstring)")
    d = parent / f"potluck-demo-{name}-{os.getpid()}"
    d.mkdir(exist_ok=True)
    (d / "memory.limit_in_bytes").write_text(str(limit_bytes))
    return d


def reference_tokens(path: Path, n: int, n_ctx: int) -> list[int]:
    """Greedy tokens of one uncapped process holding the whole model (2 threads)."""
    from potluck.engine.core.plain import Plain
    from potluck.engine.core.runtime import ContextParams, Model
    from potluck.engine.core.sampling import SamplingParams
    from potluck.engine.core.session import Session
    from potluck.engine.core.target import LocalTarget

    with Model(path) as m:
        t = LocalTarget(m, ContextParams(n_ctx=n_ctx, n_threads=2))
        try:
            *_, fin = Session(m, t, Plain()).generate(PROMPT, SamplingParams(), n)
            return list(fin.tokens)
        finally:
            t.close()


def head_run(path: Path, addresses: list[str], token: str, n: int, n_ctx: int, n_batch: int,
             strategies: list[str]) -> dict:
    """One head: open the pipeline (timed), then each strategy's greedy reply."""
    from potluck.engine.cluster.head import open_pipeline
    from potluck.engine.core.events import Finished
    from potluck.engine.core.runtime import Model
    from potluck.engine.core.sampling import SamplingParams
    from potluck.engine.core.session import Session
    from potluck.engine.core.spec import ClusterSpec, EngineSpec
    from potluck.engine.speculation.strategies.registry import get_strategy_class

    keys = keys_from_token(token)
    out: dict[str, object] = {}
    with Model(path, vocab_only=True) as model:
        t0 = time.perf_counter()
        target = open_pipeline(path, addresses, keys, n_ctx=n_ctx, n_batch=n_batch, split=None)
        out["load_s"] = time.perf_counter() - t0
        out["sent_mb"] = target.transfer.bytes_sent / 1e6
        out["transfer_mb_per_s"] = target.transfer.mb_per_s
        out["plan"] = target.plan.describe()
        out["predicted_tokens_per_s"] = target.plan.predicted_tokens_per_s
        try:
            for name in strategies:
                cls = get_strategy_class(name)
                if cls.needs_exact_batches and not target.exact.speculates:  # as the CLI refuses it
                    out[name] = {"refused": target.exact.refusal(name)}
                    continue
                spec = EngineSpec(model=path, strategy=name, n_ctx=n_ctx, n_threads=1,
                                  cluster=ClusterSpec(tuple(addresses), keys))
                strategy = cls.build(model, spec)
                target.reset()
                bytes0, fed0 = target.links[-1].bytes_in, target.stats.tokens
                try:
                    session = Session(model, target, strategy)
                    *_, fin = session.generate(PROMPT, SamplingParams(), n)
                finally:
                    strategy.close()
                assert isinstance(fin, Finished)
                fed = target.stats.tokens - fed0
                out[name] = {"tokens": list(fin.tokens), "ttft_s": fin.ttft_s, "prompt_tokens": fin.prompt_tokens,
                             "tokens_per_s": (len(fin.tokens) - 1) / fin.decode_s if fin.decode_s else 0.0,
                             "last_hop_bytes_per_token": (target.links[-1].bytes_in - bytes0) / max(fed, 1)}
        finally:
            target.close()
    out["head_peak_rss_mb"] = peak_rss_mb(os.getpid())
    return out


def rpc_runs(bin_dir: Path, path: Path, groups: list[Path], n_tokens: int, n_prompt: int,
             cache: Path) -> None:
    """llama.cpp's RPC on the same model, caps and split: two servers (1 thread, tensor cache
    on), each in its own capped group; llama-bench twice, the second with a warm cache. Load
    time is the bench's wall time less its timed samples (model load and context set-up)."""
    with rpc_servers(
        bin_dir, len(groups), extra=["-c"], env=lambda i: dict(os.environ, LLAMA_CACHE=str(cache / f"s{i}")),
        preexec=lambda i: lambda: (groups[i] / "cgroup.procs").write_text(str(os.getpid())),
    ) as servers:
        watch = PeakWatch([s.proc.pid for s in servers])
        for label in ("first run", "second run (cache warm)"):
            cmd = ["/usr/bin/time", "-f", "maxrss_kb %M", str(bin_dir / "llama-bench"), "-m", str(path),
                   "--rpc", rpc_addresses(servers), "-ngl", "99", "-ts", "1/1", "-t", "1", *BENCH_ARGS,
                   "-p", str(n_prompt), "-n", str(n_tokens), "-r", "1", "--no-warmup", "-o", "json"]
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            wall = time.perf_counter() - t0
            if proc.returncode != 0:
                raise SystemExit(f"llama-bench --rpc failed:\n{proc.stderr[-3000:]}")
            rows = json.loads(proc.stdout)
            timed = sum(sum(r["samples_ns"]) for r in rows) / 1e9
            rss = next(int(x.split()[1]) for x in proc.stderr.splitlines() if x.startswith("maxrss_kb"))
            speeds = {("pp" if r["n_prompt"] else "tg"): r["avg_ts"] for r in rows}
            print(f"llama.cpp RPC, {label}: load {wall - timed:.1f} s, prompt {n_prompt} tokens at "
                  f"{speeds['pp']:.2f} tok/s (TTFT about {n_prompt / speeds['pp']:.2f} s), "
                  f"{speeds['tg']:.2f} tok/s decoding, head (llama-bench) peak RSS {rss / 1024:,.0f} MB")
        peaks = watch.stop()
        for i, s in enumerate(servers):
            print(f"rpc server {i}: peak RSS {max(peaks[s.proc.pid].values(), default=0.0):,.0f} MB (VmHWM)")


def _child(args: list[str]) -> dict:
    """Run this script's ``--as`` mode in a fresh process; its last line is JSON."""
    proc = subprocess.run([sys.executable, "-m", "scripts.scale_demo", *args], cwd=ROOT, capture_output=True,
                          text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{args[:2]} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="8b", choices=SHAPE_NAMES)
    p.add_argument("--layers", type=int, help="build the shape with this many layers (its width), not all")
    p.add_argument("--cap", type=float, default=0.6, help="each worker's memory limit, as a share of the model file")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--batch", type=int, default=128, help="n_batch: prompt chunk; the rows llama.cpp's buffers hold")
    p.add_argument("--relay", choices=["ethernet", "wifi"], help="put each worker behind scripts/link_relay.py")
    p.add_argument("--rpc", type=Path, metavar="DIR", help="llama.cpp's tools: also run its RPC on the same caps")
    p.add_argument("--as", dest="mode", choices=["reference", "head"], help=argparse.SUPPRESS)
    p.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--addresses", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.mode == "reference":
        print(json.dumps({"tokens": reference_tokens(args.model, args.tokens, args.ctx),
                          "peak_rss_mb": peak_rss_mb(os.getpid())}))
        return
    if args.mode == "head":
        try:
            run = head_run(args.model, args.addresses.split(","), os.environ["POTLUCK_TOKEN"],
                           args.tokens, args.ctx, args.batch, ["plain", "pipeinfer"])
        except PotluckError as e:  # a refused plan, an unreachable worker: one line, as the CLI says it
            raise SystemExit(f"potluck: error: {e}") from None
        print(json.dumps(run))
        return

    path = build_named_shape(args.shape, layers=args.layers)
    size = path.stat().st_size
    print(f"model {path.name}: {size / 1e9:.2f} GB; workers capped at {args.cap:.0%} = {args.cap * size / 1e9:.2f} GB")
    common = ["--model", str(path), "--tokens", str(args.tokens), "--ctx", str(args.ctx), "--batch", str(args.batch)]
    ref = _child(["--as", "reference", *common])
    print(f"one uncapped process: peak RSS {ref['peak_rss_mb']:,.0f} MB")
    token = generate_token()
    folder = Path(tempfile.mkdtemp(prefix="potluck-demo-"))
    groups = [capped_group(int(args.cap * size), f"w{i}") for i in range(2)]
    workers, relays = [], []
    try:
        for i, g in enumerate(groups):
            workers.append(spawn_worker(folder, f"w{i}", token, threads=1,
                                        preexec=lambda g=g: (g / "cgroup.procs").write_text(str(os.getpid()))))
        addresses = [w.address for w in workers]
        if args.relay:
            for i, w in enumerate(workers):
                r = subprocess.Popen([sys.executable, "-m", "scripts.link_relay", "--listen", "127.0.0.1:0",
                                      "--to", w.address, "--profile", args.relay], cwd=ROOT, stdout=subprocess.PIPE,
                                     text=True)
                relays.append(r)
                addresses[i] = r.stdout.readline().split()[1]  # "relay HOST:PORT -> ..."
        env = dict(os.environ, POTLUCK_TOKEN=token)
        watch = PeakWatch([w.proc.pid for w in workers])
        runs = []
        for label in ("first run", "second run (cached)"):
            proc = subprocess.run([sys.executable, "-m", "scripts.scale_demo", "--as", "head", *common,
                                   "--addresses", ",".join(addresses)], cwd=ROOT, capture_output=True, text=True,
                                  env=env, check=False)
            if proc.returncode != 0:
                last = proc.stderr.strip().splitlines()[-1:] or [""]
                raise SystemExit(last[0] if last[0].startswith("potluck: error:") else
                                 f"head failed:\n{proc.stderr[-3000:]}")
            run = json.loads(proc.stdout.strip().splitlines()[-1])
            if "plain" not in run:
                raise SystemExit(f"head output without replies: {proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
            runs.append(run)
            if label == "first run":
                print("\n".join(run["plan"]))
            print(f"{label}: load {run['load_s']:.1f} s, sent {run['sent_mb']:,.0f} MB "
                  f"({run['transfer_mb_per_s']:,.0f} MB/s), head peak RSS {run['head_peak_rss_mb']:,.0f} MB")
            predicted = run["predicted_tokens_per_s"]
            if predicted:
                measured = run["plain"]["tokens_per_s"]
                print(f"  planner: predicted {predicted:.2f} tok/s synchronous, measured {measured:.2f} "
                      f"({measured / predicted - 1:+.0%})")
            for name in ("plain", "pipeinfer"):
                r = run[name]
                if "refused" in r:
                    print(f"  {name:<15} refused: {r['refused']}")
                    continue
                first = next((i for i, (a, b) in enumerate(zip(r["tokens"], ref["tokens"])) if a != b), None)
                same = "True" if first is None else f"False (from token {first})"
                print(f"  {name:<15} identical {same}, TTFT {r['ttft_s']:.2f} s, {r['tokens_per_s']:.2f} tok/s, "
                      f"{r['last_hop_bytes_per_token']:,.0f} B/token from the last worker")
                if first is not None:  # for whoever looks into it: where the two replies part
                    print(f"    split {r['tokens'][first:first + 4]} ... "
                          f"one process {ref['tokens'][first:first + 4]} ...")
        peaks = watch.stop()
        for i, w in enumerate(workers):
            own = peaks[w.proc.pid].pop(w.proc.pid, 0.0)
            print(f"worker {i}: peak RSS {own:,.0f} MB, its llama.cpp stage processes "
                  f"{', '.join(f'{mb:,.0f}' for mb in peaks[w.proc.pid].values())} MB (VmHWM, file pages included); "
                  f"cgroup peak {int((groups[i] / 'memory.max_usage_in_bytes').read_text()) / 1e6:,.0f} MB "
                  "(page cache included)")
        if args.rpc:
            for w in workers:
                stop_worker(w.proc)
            n_prompt = runs[0]["plain"]["prompt_tokens"]
            rpc_runs(args.rpc.expanduser(), path, groups, args.tokens, n_prompt, folder / "rpc-cache")
    finally:
        for r in relays:
            r.terminate()
        for w in workers:
            stop_worker(w.proc)
        time.sleep(0.5)
        for g in groups:
            try:
                g.rmdir()
            except OSError:
                pass
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
