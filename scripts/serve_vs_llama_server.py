"""`potluck serve` against llama.cpp's `llama-server`, greedy and sampled (issue 43's table).

Both servers hold the bundled model with the same threads, context, flash attention, BF16 KV
cache and no weight repacking (llama.cpp's AMX repacking crashes on these CPUs, docs/facts.md
§1), and get the same streamed chat requests through the official `openai` client, one at a
time and interleaved (rep -> temperature -> server, the order flipped every rep) so that drift
on a shared machine hits both alike. Sampled requests send only `temperature` (and a seed), as
most clients do: each server fills in its defaults (potluck's are llama-server's). A third
potluck row sends llama-server's defaults explicitly, and ``--generate`` adds `potluck generate`
(its `--json` tokens_per_s) for the CLI's greedy/sampled ratio.

Speed is decode speed, measured by the client: (tokens - 1) / (last token - first token), so
prompt processing (both servers reuse the prompt's cached prefix) is left out.

    python -m scripts.serve_vs_llama_server [--reps 5] [--max-tokens 200] [--threads 2]
        [--ctx 4096] [--strategy auto] [--bin ~/.cache/potluck-peers/bin] [--generate] [--ref DIR] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import openai

from potluck.app.serve.launch import start_server, stop_server
from potluck.engine import resolve_model

from .peers import free_port

PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a bicycle works, part by part, for a curious ten-year-old.",
    "Describe a walk through a busy market in a city you invent.",
]
LLAMA_DEFAULTS = {"top_k": 40, "top_p": 0.95, "min_p": 0.05}  # llama-server's, sent explicitly in one row


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def start_llama_server(bin_dir: Path, model: Path, threads: int, ctx: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(
        [str(bin_dir / "llama-server"), "-m", str(model), "-t", str(threads), "-tb", str(threads), "-c", str(ctx),
         "-fa", "on", "-ctk", "bf16", "-ctv", "bf16", "--no-repack", "-np", "1", "--no-webui",
         "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"llama-server exited ({proc.returncode}); run it by hand to see why")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise SystemExit("llama-server was not ready within 120 s")


def client_for(base_url: str) -> openai.OpenAI:
    """The official client on a server's ``/v1``, one try, a reply's time to answer."""
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=600)


def decode_rate(client: openai.OpenAI, prompt: str, max_tokens: int, extra: dict[str, object]) -> tuple[float, int]:
    """(decode tokens/s, tokens) of one streamed reply, timed by the client."""
    times: list[float] = []
    usage = None
    for chunk in client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, stream=True,
        stream_options={"include_usage": True}, **extra,  # type: ignore[arg-type]
    ):
        if chunk.choices and chunk.choices[0].delta.content:
            times.append(time.perf_counter())
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
    n = usage or len(times)
    if len(times) < 2:
        return 0.0, n
    return (n - 1) / (times[-1] - times[0]), n


def replies(client: openai.OpenAI, reps: int, max_tokens: int, temp: float) -> tuple[int, list[float]]:
    """(tokens, each reply's tokens/s) of ``reps`` streamed replies, the prompts in turn, seed = rep."""
    tokens, rates = 0, []
    for rep in range(reps):
        rate, n = decode_rate(client, PROMPTS[rep % len(PROMPTS)], max_tokens, {"temperature": temp, "seed": rep})
        tokens, rates = tokens + n, [*rates, rate]
    return tokens, rates


def generate_rate(threads: int, ctx: int, strategy: str, prompt: str, max_tokens: int, temp: float, seed: int,
                  home: str) -> tuple[float, int]:
    args = [sys.executable, "-m", "potluck.app.cli", "generate", "--json", "--strategy", strategy, "-t", str(threads),
            "--ctx", str(ctx), "--max-tokens", str(max_tokens), "--temp", str(temp)]
    if temp > 0:
        args += ["--top-k", "40", "--top-p", "0.95", "--min-p", "0.05", "--seed", str(seed)]
    out = subprocess.run([*args, prompt], capture_output=True, text=True, check=True,
                         env={**os.environ, "POTLUCK_HOME": home})
    result = json.loads(out.stdout)
    return float(result["tokens_per_s"]), len(result["tokens"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--strategy", default="auto", help="potluck's strategy (default auto: what `potluck serve` runs)")
    ap.add_argument("--bin", type=Path, default=Path.home() / ".cache/potluck-peers/bin", help="llama-server's folder")
    ap.add_argument("--generate", action="store_true", help="add `potluck generate` rows (greedy, sampled)")
    ap.add_argument("--ref", type=Path, help="also `potluck serve` from another tree, interleaved with this one's: "
                    "a folder holding a `potluck` link to that checkout (its PYTHONPATH)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if not (args.bin / "llama-server").is_file():
        raise SystemExit(f"no llama-server in {args.bin} (build it with ../shared/tools/build-llama-tools.sh)")
    # a kill (timeout, kill PID) still stops both servers: they run in their own sessions
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    model = resolve_model(None)
    home = Path(tempfile.mkdtemp(prefix="potluck-vs-llama-"))
    print(f"load before: {load()}", file=sys.stderr)
    potluck = start_server(home / "serve", ["-t", str(args.threads), "--ctx", str(args.ctx),
                                            "--strategy", args.strategy])
    ref = start_server(home / "ref", ["-t", str(args.threads), "--ctx", str(args.ctx), "--strategy", args.strategy],
                       env={"PYTHONPATH": str(args.ref)}) if args.ref else None
    llama, llama_url = start_llama_server(args.bin, model, args.threads, args.ctx)
    clients = {
        "potluck serve": client_for(potluck.base_url),
        "llama-server": client_for(llama_url),
    }
    if ref is not None:
        clients["potluck serve (ref)"] = client_for(ref.base_url)
    runs: dict[str, list[float]] = {}
    tokens: dict[str, list[int]] = {}
    try:
        for client in clients.values():  # warm both (first-request costs), unmeasured
            decode_rate(client, PROMPTS[0], 16, {"temperature": 0})
        for rep in range(args.reps):
            prompt, seed = PROMPTS[rep % len(PROMPTS)], 1000 + rep
            order = list(clients) if rep % 2 == 0 else list(clients)[::-1]
            cases: list[tuple[str, str, dict[str, object], float]] = []  # (label, who, request fields, temp)
            for temp in (0.0, 0.8):
                sampled: dict[str, object] = {"temperature": temp, **({"seed": seed} if temp else {})}
                cases += [(f"{name}, temperature {temp:g}", name, sampled, temp) for name in order]
                if temp:
                    cases.append(("potluck serve, temperature 0.8 with top_k 40, top_p 0.95, min_p 0.05",
                                  "potluck serve", {**sampled, "extra_body": LLAMA_DEFAULTS}, temp))
                if args.generate:
                    cases.append((f"potluck generate --strategy {args.strategy}, temperature {temp:g}",
                                  "generate", {}, temp))
            for label, who, fields, temp in cases:
                if who == "generate":
                    rate, n = generate_rate(args.threads, args.ctx, args.strategy, prompt, args.max_tokens, temp,
                                            seed, str(home / "generate"))
                else:
                    rate, n = decode_rate(clients[who], prompt, args.max_tokens, fields)
                runs.setdefault(label, []).append(rate)
                tokens.setdefault(label, []).append(n)
                print(f"  rep {rep + 1}/{args.reps} {label}: {n} tokens, {rate:.1f} tok/s (load {load()})",
                      file=sys.stderr, flush=True)
    finally:
        stop_server(potluck.proc)
        if ref is not None:
            stop_server(ref.proc)
        llama.terminate()
        llama.wait(30)
    med = {label: statistics.median(r) for label, r in runs.items()}
    if args.json:
        print(json.dumps({"runs": runs, "tokens": tokens, "median": med, "load_after": load()}))
        return 0
    print(f"bundled model, {args.threads} threads, context {args.ctx}, up to {args.max_tokens} tokens a reply, "
          f"{args.reps} interleaved reps, potluck strategy {args.strategy}; load after: {load()}")
    print("\n| run | tokens/s (median) | min–max |\n|---|---|---|")
    for label, r in runs.items():
        print(f"| `{label}` | {med[label]:.1f} | {min(r):.1f}–{max(r):.1f} |")
    serve, llama_ = "potluck serve, temperature {}", "llama-server, temperature {}"
    ratios = [("serve sampled / llama-server sampled", serve.format("0.8"), llama_.format("0.8")),
              ("serve sampled / serve greedy", serve.format("0.8"), serve.format("0")),
              ("llama-server sampled / llama-server greedy", llama_.format("0.8"), llama_.format("0")),
              ("serve greedy / llama-server greedy", serve.format("0"), llama_.format("0"))]
    if ref is not None:
        ratios += [("serve / serve (ref), greedy", serve.format("0"), "potluck serve (ref), temperature 0"),
                   ("serve / serve (ref), sampled", serve.format("0.8"), "potluck serve (ref), temperature 0.8")]
    if args.generate:
        gen = f"potluck generate --strategy {args.strategy}, temperature {{}}"
        ratios.append(("generate sampled / generate greedy", gen.format("0.8"), gen.format("0")))
    print()
    for what, a, b in ratios:
        if med.get(b):
            print(f"{what}: {med[a] / med[b]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
