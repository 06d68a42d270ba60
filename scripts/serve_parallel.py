"""Several clients at once: `potluck serve` decoding their conversations together, side by side
with llama.cpp's `llama-server -np N` in one run, or over loopback workers (a benchmark, not a
test: its figures need a quiet machine).

One machine (the default): both servers get the same model, threads and context per
conversation (llama-server's ``-c`` is shared by its slots, so it gets N times potluck's
``--ctx``), flash attention on, greedy requests; llama-server keeps its own KV type (F16) unless
``--peer-kv bf16``, and its weight repacking is off (the AMX crash, docs/facts.md §1). Each
client sends ``--requests`` requests one after another, every request a prompt no other shares;
all clients start together. Aggregate tokens/s is every reply's tokens over the wall time.

``--cluster N``: N loopback workers (1 thread each) plus the head; potluck alone, with 1 and
``--clients`` clients, and the simulator's prediction beside (engine/lab/sim_lanes.py: this
machine's per-token cost with one thread, the head's share of the model, every stage sharing
its cores, the link latency fitted to the one-client figure).

Every potluck reply is checked against the engine alone (a fresh session, the same request)
after the servers are stopped; /health's batching counters say how many batches held several
conversations.

    python -m scripts.serve_parallel [--clients 1,4] [--requests 3] [--max-tokens 128] [--threads 2]
    python -m scripts.serve_parallel --cluster 2 [--clients 1,4]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from potluck.app.loopback import spawn_workers, stop_workers
from potluck.app.serve.launch import RunningServer, start_server, stop_server
from potluck.engine import EngineSpec, Finished, SamplingParams, default_threads, open_session, resolve_model
from potluck.engine.core.runtime import Model
from potluck.engine.lab.perf import measure as measure_perf
from potluck.engine.lab.sim_config import PerfTiming
from potluck.engine.lab.sim_lanes import simulate_lanes
from potluck.engine.lab.simulate import fit_latency

from .peers import free_port

PEERS = Path.home() / ".cache" / "potluck-peers" / "bin"
TOPICS = [
    "the history of the bicycle", "how bread rises", "why the sea is salty", "the life of bees",
    "how a compiler works", "the first moon landing", "how vaccines train the body", "the rules of chess",
    "how rainbows form", "the silk road", "how a refrigerator keeps food cold", "the story of paper money",
]
# the head computes the model's last layer and the output layer: SmolLM2-135M's output
# matrix (49152 x 576) and one layer are about this share of a token's work (as
# scripts/validate_simulator.py models it)
HEAD_SHARE = 0.235


@dataclass
class Load:
    """One server, ``clients`` clients at once."""

    server: str
    clients: int
    requests: int = 0
    tokens: int = 0
    wall_s: float = 0.0
    replies: dict[str, str] = field(default_factory=dict)  # prompt -> text (potluck's are checked)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else 0.0


def prompts_for(tag: str, clients: int, requests: int) -> list[list[str]]:
    """Distinct prompts: one list a client (the tag keeps runs apart: no prompt cache helps)."""
    return [[f"[{tag}-{c}-{r}] Write a few paragraphs about {TOPICS[(c * requests + r) % len(TOPICS)]}."
             for r in range(requests)] for c in range(clients)]


def post(base_url: str, prompt: str, max_tokens: int) -> tuple[str, int]:
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                       "temperature": 0}).encode()
    req = urllib.request.Request(f"{base_url}/v1/chat/completions", body, {"Content-Type": "application/json",
                                                                           "Authorization": "Bearer none"})
    with urllib.request.urlopen(req, timeout=3600) as r:
        out = json.loads(r.read())
    return out["choices"][0]["message"]["content"], int(out["usage"]["completion_tokens"])


def load(server: str, base_url: str, prompts: list[list[str]], max_tokens: int) -> Load:
    result = Load(server, len(prompts))
    lock = threading.Lock()
    errors: list[BaseException] = []

    def client(mine: list[str]) -> None:
        try:
            for p in mine:
                text, n = post(base_url, p, max_tokens)
                with lock:
                    result.requests += 1
                    result.tokens += n
                    result.replies[p] = text
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=client, args=(mine,)) for mine in prompts]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    result.wall_s = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return result


def potluck_server(home: Path, args: argparse.Namespace, extra: list[str]) -> RunningServer:
    (home / "config").mkdir(parents=True, exist_ok=True)
    (home / "config" / "config.toml").write_text(
        f'[model]\nstrategy = "{args.strategy}"\nn_ctx = {args.ctx}\nn_threads = {args.threads}\n'
        f'[sampling]\ntemperature = 0.0\n[server]\nparallel = {max(args.clients)}\nmax_queue = 64\n')
    env = {k: v for k, v in os.environ.items() if k != "POTLUCK_API_KEY"}
    return start_server(home, extra, env=env, timeout_s=600)


def llama_server(args: argparse.Namespace, model: Path) -> tuple[subprocess.Popen, str]:
    exe = PEERS / "llama-server"
    if not exe.exists():
        raise SystemExit(f"{exe} is missing: build llama.cpp's tools with ../shared/tools/build-llama-tools.sh")
    port = free_port()
    n = max(args.clients)
    cmd = [str(exe), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-t", str(args.threads),
           "-tb", str(args.threads), "-c", str(args.ctx * n), "-np", str(n), "-fa", "on", "--no-repack",
           "--no-webui", *(["-ctk", "bf16", "-ctv", "bf16"] if args.peer_kv == "bf16" else [])]
    log = open(Path(tempfile.gettempdir()) / "serve_parallel_llama_server.log", "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            urllib.request.urlopen(f"{url}/health", timeout=5).read()
            return proc, url
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise SystemExit(f"llama-server did not start (see {log.name})") from None
            time.sleep(0.5)


def check_exact(args: argparse.Namespace, runs: list[Load]) -> tuple[int, int]:
    """Each potluck reply against the engine alone (the server's own spec, a fresh session)."""
    spec = EngineSpec(strategy=args.strategy, n_ctx=args.ctx, n_threads=args.threads)
    session = open_session(spec)
    same = total = 0
    try:
        for run in runs:
            for prompt, text in run.replies.items():
                session.load_messages([])
                *_, fin = session.generate(prompt, SamplingParams(), args.max_tokens)
                assert isinstance(fin, Finished)
                same += fin.text == text
                total += 1
    finally:
        session.close()
    return same, total


def one_machine(args: argparse.Namespace) -> dict:
    model = resolve_model(None)
    runs: list[Load] = []
    counters = {}
    with tempfile.TemporaryDirectory() as home:
        pot = potluck_server(Path(home), args, [])
        peer, peer_url = llama_server(args, model)
        try:
            for base in (pot.base_url, peer_url):  # warm both
                post(base, "Say hi.", 8)
            for clients in args.clients:
                for rep in range(args.reps):
                    prompts = prompts_for(f"{clients}c{rep}", clients, args.requests)
                    runs.append(load("potluck", pot.base_url, prompts, args.max_tokens))
                    runs.append(load("llama-server", peer_url, prompts, args.max_tokens))
                    print_run(runs[-2], runs[-1])
            counters = pot.health()["batching"]
        finally:
            stop_server(pot.proc)
            peer.terminate()
            peer.wait(30)
    same, total = check_exact(args, [r for r in runs if r.server == "potluck"])
    return {"runs": [summary(r) for r in runs], "batching": counters, "exact": [same, total]}


def cluster(args: argparse.Namespace) -> dict:
    folder = Path(tempfile.mkdtemp(prefix="potluck-serve-parallel-"))
    token = secrets.token_urlsafe(32)
    procs = spawn_workers(folder / "workers", [f"w{i}" for i in range(args.cluster)], token)
    runs: list[Load] = []
    try:
        token_file = folder / "token"
        token_file.write_text(token)
        token_file.chmod(0o600)
        nodes = ",".join(p.address for p in procs)
        pot = potluck_server(folder / "home", args, ["--nodes", nodes, "--token-file", str(token_file)])
        try:
            post(pot.base_url, "Say hi.", 8)
            for clients in args.clients:
                for rep in range(args.reps):
                    runs.append(load("potluck", pot.base_url, prompts_for(f"{clients}c{rep}", clients, args.requests),
                                     args.max_tokens))
                    print_run(runs[-1])
            counters = pot.health()["batching"]
        finally:
            stop_server(pot.proc)
    finally:
        stop_workers([p.proc for p in procs])
        shutil.rmtree(folder, ignore_errors=True)
    same, total = check_exact(args, runs)
    one = max((r.tokens_per_s for r in runs if r.clients == 1), default=0.0)
    return {"runs": [summary(r) for r in runs], "batching": counters, "exact": [same, total],
            "simulated": simulated(args, one) if one else None}


def simulated(args: argparse.Namespace, one_client_tok_s: float) -> dict:
    """The simulator's prediction for the same pipeline, its latency fitted to one client."""
    with Model(resolve_model(None)) as model:
        report = measure_perf(model, n_threads=1, runs=3)
    perf = PerfTiming.from_report({**asdict(report), "batch_cost": report.batch_cost})
    n = args.cluster
    cfg = replace(perf.config(n), stage_ms=(perf.model_ms * (1 - HEAD_SHARE) / n,) * n,
                  head_ms=perf.model_ms * HEAD_SHARE, cores=os.cpu_count() or 1, tokens=args.max_tokens)
    fitted = fit_latency(cfg, one_client_tok_s)
    result = simulate_lanes(fitted, sorted(set(args.clients)))
    return {str(k): {"tok_s": v["tok_s"], "gain_vs_one": v["gain_vs_one"]} for k, v in result["results"].items()} \
        | {"latency_ms": fitted.latency_ms}


def summary(r: Load) -> dict:
    return {"server": r.server, "clients": r.clients, "requests": r.requests, "tokens": r.tokens,
            "wall_s": r.wall_s, "tokens_per_s": r.tokens_per_s}


def print_run(*loads: Load) -> None:
    cells = "   ".join(f"{r.server} {r.tokens_per_s:6.1f} tok/s ({r.tokens} tokens, {r.wall_s:.1f} s)" for r in loads)
    load_avg = open("/proc/loadavg").read().split()[0] if os.path.exists("/proc/loadavg") else "?"
    print(f"{loads[0].clients} client(s): {cells}   load {load_avg}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4])
    ap.add_argument("--requests", type=int, default=3, help="requests each client sends, one after another")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=1, help="repetitions of each client count, the servers interleaved")
    ap.add_argument("--threads", type=int, default=0, help="threads for both servers (0: all cores)")
    ap.add_argument("--ctx", type=int, default=2048, help="context per conversation")
    ap.add_argument("--strategy", default="plain", help="potluck's strategy (default plain: what llama-server does)")
    ap.add_argument("--peer-kv", choices=("f16", "bf16"), default="f16", help="llama-server's KV type")
    ap.add_argument("--cluster", type=int, default=0, metavar="N", help="N loopback workers plus the head")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    args.threads = args.threads or default_threads()
    result = cluster(args) if args.cluster else one_machine(args)
    if args.json:
        print(json.dumps(result))
        return 0
    by: dict[tuple[str, int], list[float]] = {}
    for r in result["runs"]:
        by.setdefault((r["server"], r["clients"]), []).append(r["tokens_per_s"])
    best = {k: max(v) for k, v in by.items()}
    print(f"\nbest of {args.reps}, {args.threads} thread(s), {args.max_tokens} tokens a reply, "
          f"{args.requests} requests a client")
    one = best.get(("potluck", 1))
    for clients in args.clients:
        pot = best[("potluck", clients)]
        line = f"{clients} client(s): potluck {pot:.1f} tok/s"
        if one:
            line += f" ({pot / one:.2f}x one client)"
        peer = best.get(("llama-server", clients))
        if peer:
            line += f", llama-server -np {max(args.clients)} {peer:.1f} tok/s, potluck/llama-server {pot / peer:.2f}"
        sim = (result.get("simulated") or {}).get(str(clients))
        if sim:
            line += f"; simulated {sim['tok_s']:.1f} tok/s ({sim['gain_vs_one']:.2f}x)"
        print(line)
    c = result["batching"]
    print(f"batching: {c['shared']} of {c['batches']} batches held several conversations (at most "
          f"{c['most_lanes']}), at most {c['most_in_flight']} in flight; exact replies "
          f"{result['exact'][0]}/{result['exact'][1]}")
    return 0 if result["exact"][0] == result["exact"][1] else 1


if __name__ == "__main__":
    sys.exit(main())
