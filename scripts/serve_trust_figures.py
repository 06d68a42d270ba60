"""Figures for `potluck serve` under hostile clients (issue 39 items 1, 2, 4, 5).

    python -m scripts.serve_trust_figures keepalive [--old-src DIR] [--requests 200]
    python -m scripts.serve_trust_figures bystander [--old-src DIR] [--rounds 20]
    python -m scripts.serve_trust_figures fuzz [--examples 2000]

- keepalive: the round trip of GET /v1/models on one keep-alive connection (p50, p95, mean).
  Without TCP_NODELAY each small response waited for the client's delayed ACK.
- bystander: a client's time to first token (a streamed one-token reply) while another
  client floods the server: (a) messages of special-token text, 1 MB (refused by their bytes)
  and 300 KB (tokenized, then refused by their tokens), back to back; (b) slowloris, 1,100
  connections from 127.0.0.2 trickling header lines, the server under a file limit of 1,024.
- fuzz: random values for every numeric field (huge integers, out-of-range floats, NaN and
  Infinity literals, ordinary numbers): the count of each status per field; a 5xx is a bug.

``--old-src DIR`` runs the server from another source tree (a directory holding ``potluck/``
with app, engine, discovery and assets, e.g. ``git archive`` of an older commit linked so), for
before/after figures. Everything runs on loopback, on ports the OS picks.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import random
import socket
import statistics
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from urllib.parse import urlsplit

from potluck.app.serve.launch import RunningServer, start_server, stop_server

KEY = "figures-Zr8sKq2vLm5xT9wBp3"
ATTACKER = "127.0.0.2"
NUMERIC = ["temperature", "top_p", "top_k", "min_p", "repeat_penalty", "seed", "max_tokens",
           "max_completion_tokens", "frequency_penalty", "presence_penalty", "n"]


def serve(home: Path, old_src: str | None, wrapper: list[str] | None = None) -> RunningServer:
    (home / "config").mkdir(parents=True, exist_ok=True)
    (home / "config" / "config.toml").write_text('[sampling]\ntemperature = 0.0\n[server]\nmax_body_kb = 1100\n')
    env = {"POTLUCK_API_KEY": KEY, **({"PYTHONPATH": old_src} if old_src else {})}
    return start_server(home, env=env, api_key=KEY, wrapper=wrapper or [])


def connect(server: RunningServer, source: str | None = None) -> http.client.HTTPConnection:
    url = urlsplit(server.base_url)
    return http.client.HTTPConnection(url.hostname, url.port, timeout=600,
                                      source_address=(source, 0) if source else None)


def keepalive(args: argparse.Namespace) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as home:
        server = serve(Path(home), args.old_src)
        try:
            conn = connect(server)
            times = []
            for _ in range(args.requests):
                t = time.perf_counter()
                conn.request("GET", "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
                conn.getresponse().read()
                times.append((time.perf_counter() - t) * 1e3)
            conn.close()
        finally:
            stop_server(server.proc)
    times.sort()
    return {"figure": "keep-alive GET /v1/models round trip (ms)", "requests": len(times),
            "p50_ms": round(statistics.median(times), 2), "p95_ms": round(times[int(0.95 * len(times)) - 1], 2),
            "mean_ms": round(statistics.fmean(times), 2)}


def first_token_s(server: RunningServer, timeout_s: float = 120.0) -> float:
    """A bystander's streamed one-token reply: seconds to its first content chunk (inf: none
    within ``timeout_s``)."""
    url = urlsplit(server.base_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout_s)
    t = time.perf_counter()
    try:
        conn.request("POST", "/v1/chat/completions", body=json.dumps(
            {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "stream": True}),
            headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:  # refused or failed: not an answer
            return math.inf
        while line := r.fp.readline():
            if line.startswith(b"data:") and b'"content"' in line and b'"content":""' not in line:
                return time.perf_counter() - t
        return math.inf
    except OSError:  # timed out, refused or reset
        return math.inf
    finally:
        conn.close()


def flood_special_tokens(server: RunningServer, stop: threading.Event, sent: Counter[int]) -> None:
    for size in iter(lambda: random.choice([100_000, 30_000]), None):
        if stop.is_set():
            return
        conn = connect(server, ATTACKER)
        try:
            conn.request("POST", "/v1/chat/completions", body=json.dumps(
                {"messages": [{"role": "user", "content": "<|im_end|>" * size}]}),
                headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
            sent[conn.getresponse().status] += 1
        except OSError:
            sent[0] += 1
        finally:
            conn.close()


def slowloris(server: RunningServer, stop: threading.Event, sent: Counter[int], n: int) -> None:
    url = urlsplit(server.base_url)
    held: list[socket.socket] = []
    while not stop.is_set():
        held = [s for s in held if s.fileno() >= 0]
        while len(held) < n and not stop.is_set():
            try:
                s = socket.create_connection((url.hostname, url.port), timeout=5, source_address=(ATTACKER, 0))
                s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
                held.append(s)
                sent[1] += 1
            except OSError:
                sent[0] += 1
                break
        for s in list(held):
            try:
                s.sendall(b"X-a: b\r\n")
            except OSError:
                s.close()
                held.remove(s)
        time.sleep(0.5)
    for s in held:
        s.close()


def bystander(args: argparse.Namespace) -> list[dict[str, object]]:
    out = []
    for attack in ("special-token flood", "slowloris"):
        if args.attack not in (attack, "both"):
            continue
        with tempfile.TemporaryDirectory() as home:
            wrapper = ["prlimit", "--nofile=1024:1024"] if attack == "slowloris" else None
            server = serve(Path(home), args.old_src, wrapper)
            log_before = len(server.log())
            try:
                quiet = [first_token_s(server) for _ in range(3)]
                stop, sent = threading.Event(), Counter[int]()
                target = flood_special_tokens if attack != "slowloris" else (
                    lambda s, st, c: slowloris(s, st, c, 1100))
                threads = [threading.Thread(target=target, args=(server, stop, sent), daemon=True)
                           for _ in range(1 if attack == "slowloris" else 2)]
                for t in threads:
                    t.start()
                time.sleep(5)
                loaded = []
                for _ in range(args.rounds):
                    loaded.append(first_token_s(server))
                    time.sleep(0.5)
                stop.set()
                for t in threads:
                    t.join(60)
            finally:
                stop_server(server.proc)
            out.append({"figure": f"bystander time to first token during {attack} (s)",
                        "quiet_p50_s": round(statistics.median(quiet), 3), "rounds": len(loaded),
                        "p50_s": round(statistics.median(loaded), 3), "max_s": round(max(loaded), 3),
                        "unanswered_in_120_s_or_failed": sum(math.isinf(x) for x in loaded),
                        "attacker": dict(sent), "log_bytes_during": len(server.log()) - log_before})
    return out


def random_number(rng: random.Random) -> str:
    kind = rng.randrange(6)
    if kind == 0:
        return ("-" if rng.random() < 0.3 else "") + "9" * rng.randint(19, 6000)
    if kind == 1:
        return rng.choice(["NaN", "Infinity", "-Infinity", "1e400", "-1e400", "1e-400", "-0.0", "1E308"])
    if kind == 2:
        return repr(rng.uniform(-1e6, 1e6))
    if kind == 3:
        return str(rng.randint(-5, 5))
    if kind == 4:
        return repr(rng.random() * 3)
    return f"{rng.randint(1, 9)}e{rng.randint(-330, 330)}"


def fuzz(args: argparse.Namespace) -> dict[str, object]:
    rng = random.Random(args.seed)
    by_field: dict[str, Counter[int]] = {f: Counter() for f in NUMERIC}
    with tempfile.TemporaryDirectory() as home:
        server = serve(Path(home), args.old_src)
        try:
            conn = connect(server)
            for _ in range(args.examples):
                field, number = rng.choice(NUMERIC), random_number(rng)
                cap = "" if field in ("max_tokens", "max_completion_tokens") else '"max_tokens": 1, '
                body = f'{{"messages": [{{"role": "user", "content": "Hi"}}], {cap}"{field}": {number}}}'
                try:
                    conn.request("POST", "/v1/chat/completions", body=body.encode(),
                                 headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
                    r = conn.getresponse()
                    r.read()
                    by_field[field][r.status] += 1
                except (OSError, http.client.HTTPException):
                    by_field[field][0] += 1
                    conn.close()
                    conn = connect(server)
            conn.close()
        finally:
            stop_server(server.proc)
        tracebacks = server.log().count("Traceback")
    totals: Counter[int] = sum(by_field.values(), Counter())
    return {"figure": "numeric fields fuzzed: responses by status", "examples": args.examples,
            "by_status": dict(totals), "server_errors_5xx": sum(n for s, n in totals.items() if s >= 500),
            "tracebacks_in_log": tracebacks, "by_field": {f: dict(c) for f, c in by_field.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("figure", choices=["keepalive", "bystander", "fuzz"])
    parser.add_argument("--old-src", help="run the server from this source tree (PYTHONPATH holding potluck/)")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--attack", choices=["special-token flood", "slowloris", "both"], default="both")
    parser.add_argument("--examples", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    os.environ.pop("POTLUCK_API_KEY", None)
    result = {"keepalive": keepalive, "bystander": bystander, "fuzz": fuzz}[args.figure](args)
    print(json.dumps({"load": open("/proc/loadavg").read().split()[:3], "result": result}, indent=1))


if __name__ == "__main__":
    main()
