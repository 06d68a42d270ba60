"""`potluck serve` measured through the official `openai` client, and the same requests against
llama-cpp-python's own server (``python -m llama_cpp.server``) when a Python that has it is given.

- time to first token on turns 1, 5 and 10 of one conversation, with prefix reuse (the history
  as the conversation went) and without it (the same history behind a system line that differs
  per request, so no prefix is shared);
- aggregate tokens/s and p50/p95 latency with 1, 2 and 4 concurrent clients.

Both servers get the same model, threads, context, flash attention and KV type (BF16), greedy
requests. llama.cpp's extra buffer types are turned off in the baseline (its AMX repacking
crashes on these CPUs, docs/facts.md §1), as potluck does.

    python -m scripts.serve_bench [--baseline-python /tmp/lcpp/bin/python] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from pathlib import Path

import openai

from potluck.app.serve.launch import start_server, stop_server
from potluck.engine import default_threads, resolve_model

from .peers import free_port

QUESTIONS = [
    "Hi! Who are you?", "What is the capital of France?", "Tell me about its history.",
    "What food is it famous for?", "Give me a recipe for one of them.", "How long does it take?",
    "What wine goes with it?", "Where is that wine made?", "What is the weather like there?",
    "Thanks! Summarize our chat in one line.",
]
N_CTX = 4096
GGML_TYPE_BF16 = 30

# llama-cpp-python's server, with llama.cpp's extra buffer types off (the high-level class cannot set it)
BASELINE = """
import runpy, sys
import llama_cpp.llama_cpp as lc
original = lc.llama_model_default_params
def no_extra_bufts():
    p = original()
    p.use_extra_bufts = False
    return p
lc.llama_model_default_params = no_extra_bufts
sys.argv = ["llama_cpp.server", *sys.argv[1:]]
runpy.run_module("llama_cpp.server", run_name="__main__")
"""


def first_token_s(client: openai.OpenAI, messages: list[dict[str, str]], max_tokens: int) -> tuple[float, str]:
    """Seconds to the first text chunk, and the whole reply."""
    start = time.perf_counter()
    ttft = None
    parts = []
    for chunk in client.chat.completions.create(model="m", messages=messages, max_tokens=max_tokens,
                                                temperature=0, stream=True):
        text = chunk.choices[0].delta.content if chunk.choices else None
        if text:
            ttft = ttft or time.perf_counter() - start
            parts.append(text)
    return (ttft or time.perf_counter() - start), "".join(parts)


def conversation_ttft(client: openai.OpenAI, turns: int, max_tokens: int) -> dict[str, dict[int, float]]:
    history: list[dict[str, str]] = []
    reused: dict[int, float] = {}
    for i, question in enumerate(QUESTIONS[:turns], 1):
        history.append({"role": "user", "content": question})
        reused[i], reply = first_token_s(client, history, max_tokens)
        history.append({"role": "assistant", "content": reply})
    fresh = {}
    for n in (1, 5, 10):
        if n <= turns:
            nonce = [{"role": "system", "content": f"Session {uuid.uuid4().hex}. You are a helpful assistant."}]
            fresh[n] = first_token_s(client, nonce + history[: 2 * n - 1], 1)[0]
    return {"with_reuse": {n: reused[n] for n in fresh}, "without_reuse": fresh}


def concurrent(client: openai.OpenAI, clients: int, requests: int, max_tokens: int) -> dict[str, float]:
    latencies: list[float] = []
    tokens = 0
    lock = threading.Lock()
    tag = uuid.uuid4().hex[:6]

    def run(c: int) -> None:
        nonlocal tokens
        for r in range(requests):
            start = time.perf_counter()
            out = client.chat.completions.create(
                model="m", temperature=0, max_tokens=max_tokens,
                messages=[{"role": "user", "content": f"({tag}-{c}-{r}) Write a paragraph about {QUESTIONS[r]}"}])
            with lock:
                latencies.append(time.perf_counter() - start)
                tokens += out.usage.completion_tokens

    wall = time.perf_counter()
    threads = [threading.Thread(target=run, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - wall
    q = statistics.quantiles(latencies, n=20, method="inclusive")
    return {"clients": clients, "requests": len(latencies), "tokens_per_s": tokens / wall,
            "p50_s": statistics.median(latencies), "p95_s": q[18]}


def measure(base_url: str, key: str, args: argparse.Namespace) -> dict[str, object]:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=key, max_retries=0, timeout=1200)
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "warm up"}], max_tokens=4)
    return {"ttft": conversation_ttft(client, args.turns, args.max_tokens),
            "load": [concurrent(client, c, args.requests, args.max_tokens) for c in args.clients]}


def run_baseline(python: str, model: Path, threads: int, args: argparse.Namespace) -> dict[str, object]:
    port = free_port()
    cmd = [python, "-c", BASELINE, "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
           "--n_ctx", str(N_CTX), "--n_threads", str(threads), "--n_threads_batch", str(threads),
           "--flash_attn", "true", "--type_k", str(GGML_TYPE_BF16), "--type_v", str(GGML_TYPE_BF16)]
    log = open(Path(tempfile.gettempdir()) / "serve_bench_baseline.log", "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"{url}/v1/models", timeout=5).read()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"llama_cpp.server did not start (see {log.name})") from None
                time.sleep(0.5)
        return measure(url, "none", args)
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def table(name: str, result: dict[str, object]) -> list[str]:
    ttft = result["ttft"]
    lines = [f"{name}", "  TTFT (s)       " + "  ".join(f"turn {n:>2}" for n in ttft["with_reuse"])]
    for kind in ("with_reuse", "without_reuse"):
        lines.append(f"  {kind:<14} " + "  ".join(f"{v:7.3f}" for v in ttft[kind].values()))
    lines.append("  clients  requests  tok/s   p50 s   p95 s")
    for row in result["load"]:
        lines.append(f"  {row['clients']:>7}  {row['requests']:>8}  {row['tokens_per_s']:5.1f}  "
                     f"{row['p50_s']:6.2f}  {row['p95_s']:6.2f}")
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--clients", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4])
    p.add_argument("--requests", type=int, default=4, help="requests per client")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=0, help="threads for both servers (0: all cores)")
    p.add_argument("--baseline-python", help="a Python with llama-cpp-python[server] (a scratch venv)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    threads = args.threads or default_threads()
    def report(name: str, result: dict[str, object]) -> None:  # as soon as one server is measured
        print(json.dumps({name: result}) if args.json else "\n".join(table(name, result)), flush=True)

    with tempfile.TemporaryDirectory() as home:
        config = Path(home) / "config"
        config.mkdir()
        (config / "config.toml").write_text(
            f'[model]\nstrategy = "plain"\nn_ctx = {N_CTX}\nn_threads = {threads}\n'
            '[sampling]\ntemperature = 0.0\n[server]\nmax_queue = 16\n')
        server = start_server(Path(home), env={k: v for k, v in os.environ.items() if k != "POTLUCK_API_KEY"})
        try:
            report("potluck", measure(server.base_url, "none", args))
        finally:
            stop_server(server.proc)
    if args.baseline_python:
        report("llama-cpp-python", run_baseline(args.baseline_python, resolve_model(None), threads, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
