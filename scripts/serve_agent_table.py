"""Issue 42's table: what llama.cpp's llama-server (--jinja) and potluck serve answer to the
requests agents send, each cell filled by a request against both servers on the same model.

    python -m scripts.serve_agent_table [--bin ~/.cache/potluck-peers/bin] [--model M] [--samples 3]

Each row is one kind of request; a cell is the HTTP status and what the reply held (a tool
call came back, the JSON parsed and matched the schema, how many logprobs, ...). ``--samples``
repeats each sampled row with that many seeds (temperature 0.8) and counts the replies that
passed. Both servers run on loopback with the same threads and context.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import jsonschema

from potluck.app.serve.launch import start_server, stop_server
from potluck.assets import default_model_path

from .peers import free_port

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}}, "required": ["city"]}}}
MAX_TOKENS = 64  # a reply cut here is counted as failing its check
ASK_JSON = [{"role": "user", "content": "Describe a person named Ada as JSON."}]
ASK_TOOL = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOL_RESULT = [*ASK_TOOL, {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 24 C"}]


def post(base: str, path: str, body: dict | None = None) -> tuple[int, object]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            raw = r.read().decode()
            status = r.status
    except urllib.error.HTTPError as e:
        raw, status = e.read().decode(errors="replace"), e.code
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw


def calls(reply: object) -> list[dict]:
    return (reply["choices"][0]["message"].get("tool_calls") or []) if isinstance(reply, dict) else []


def parses(reply: object, schema: dict | None) -> bool:
    try:
        value = json.loads(reply["choices"][0]["message"]["content"])  # type: ignore[index]
        jsonschema.validate(value, schema or {"type": "object"})
        return True
    except (ValueError, TypeError, KeyError, jsonschema.ValidationError):
        return False


def streamed_tool_calls(base: str, body: dict) -> tuple[int, int]:
    """(status, tool-call deltas) of a streamed request."""
    req = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            n = 0
            for line in r:
                text = line.decode().strip()
                if text.startswith("data: {"):
                    chunk = json.loads(text[6:])
                    for choice in chunk.get("choices", []):
                        n += len(choice.get("delta", {}).get("tool_calls") or [])
            return r.status, n
    except urllib.error.HTTPError as e:
        return e.code, 0


def chat(body: dict) -> Callable[[str, int], tuple[int, object]]:
    return lambda base, seed: post(base, "/v1/chat/completions", {"max_tokens": MAX_TOKENS, "seed": seed, **body})


def rows(samples: int) -> list[tuple[str, Callable[[str], str]]]:
    def sampled(body: dict, ok: Callable[[object], bool], what: str) -> Callable[[str], str]:
        def cell(base: str) -> str:
            results = [chat({**body, "temperature": 0.8})(base, seed) for seed in range(1, samples + 1)]
            greedy = chat({**body, "temperature": 0})(base, 0)
            statuses = {s for s, _ in [*results, greedy]}
            if statuses != {200}:
                return f"{'/'.join(map(str, sorted(statuses)))}: {_error(greedy[1])}"
            good = sum(ok(r) for _, r in results)
            return f"200; greedy {what}: {'yes' if ok(greedy[1]) else 'no'}; sampled {good}/{samples}"
        return cell

    def status(f: Callable[[str], tuple[int, object]], describe: Callable[[object], str]) -> Callable[[str], str]:
        def cell(base: str) -> str:
            code, reply = f(base)
            return f"{code}: {describe(reply)}" if code == 200 else f"{code}: {_error(reply)}"
        return cell

    def stream_cell(base: str) -> str:
        code, n = streamed_tool_calls(base, {"messages": ASK_TOOL, "max_tokens": MAX_TOKENS, "temperature": 0,
                                             "tools": [WEATHER], "tool_choice": "required"})
        return f"{code}: {n} tool-call deltas"

    return [
        ("tools, tool_choice auto", sampled({"messages": ASK_TOOL, "tools": [WEATHER]}, lambda r: bool(calls(r)),
                                            "tool_calls")),
        ("tools, tool_choice required", sampled({"messages": ASK_TOOL, "tools": [WEATHER], "tool_choice": "required"},
                                                lambda r: bool(calls(r)), "tool_calls")),
        ("tools, a named tool_choice", sampled({"messages": ASK_TOOL, "tools": [WEATHER], "tool_choice": {
            "type": "function", "function": {"name": "get_weather"}}}, lambda r: bool(calls(r)), "tool_calls")),
        ("tool_calls streamed (required)", stream_cell),
        ("a role tool result", status(lambda b: chat({"messages": TOOL_RESULT, "tools": [WEATHER],
                                                      "temperature": 0})(b, 0),
                                      lambda r: f"{len(r['choices'][0]['message'].get('content') or '')} chars")),
        ("response_format json_object", sampled({"messages": ASK_JSON, "response_format": {"type": "json_object"}},
                                                lambda r: parses(r, None), "parses")),
        ("response_format json_schema", sampled({"messages": ASK_JSON, "response_format": {
            "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}},
            lambda r: parses(r, PERSON), "validates")),
        ("logprobs, top_logprobs 5", status(lambda b: chat({"messages": ASK_JSON, "logprobs": True, "top_logprobs": 5,
                                                            "max_tokens": 8, "temperature": 0})(b, 0),
                                            lambda r: f"{len(_logprobs(r))} tokens with logprobs")),
        ("n = 2", status(lambda b: chat({"messages": ASK_JSON, "n": 2, "max_tokens": 8})(b, 1),
                         lambda r: f"{len(r['choices'])} choices")),
        ("/metrics", status(lambda b: _get(b, "/metrics"), lambda r: f"{len(str(r).splitlines())} lines")),
        ("/v1/embeddings", status(lambda b: post(b, "/v1/embeddings", {"input": "hello"}), lambda r: "vectors")),
    ]


def _logprobs(reply: object) -> list:
    return (reply["choices"][0].get("logprobs") or {}).get("content") or []  # type: ignore[index]


def _get(base: str, path: str) -> tuple[int, object]:
    try:
        with urllib.request.urlopen(base + path, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    except OSError as e:  # not listening yet
        return 0, str(e)


def _error(reply: object) -> str:
    if isinstance(reply, dict) and isinstance(reply.get("error"), dict):
        return str(reply["error"].get("message", ""))[:80]
    return str(reply)[:80]


def llama_server(bin_dir: Path, model: Path, ctx: int, threads: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([str(bin_dir / "llama-server"), "-m", str(model), "--jinja", "--host", "127.0.0.1",
                             "--port", str(port), "-c", str(ctx), "-t", str(threads), "--metrics", "-np", "1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            if _get(base, "/health")[0] == 200:
                return proc, base
            if proc.poll() is not None:
                raise SystemExit(f"llama-server exited ({proc.returncode})")
            time.sleep(0.5)
        raise SystemExit("llama-server was not ready within 120 s")
    except BaseException:
        proc.kill()
        proc.wait()
        raise


def main() -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout still stops both servers
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bin", type=Path, default=Path.home() / ".cache/potluck-peers/bin")
    p.add_argument("--model", type=Path, default=None, help="GGUF (default: the bundled model)")
    p.add_argument("--samples", type=int, default=3, help="seeds per sampled row")
    p.add_argument("--only", choices=["llama-server", "potluck"], help="fill one column")
    p.add_argument("--ctx", type=int, default=2048)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = p.parse_args()
    model = args.model or default_model_path()
    table = {name: {} for name, _ in rows(args.samples)}
    if args.only != "potluck":
        proc, base = llama_server(args.bin, model, args.ctx, args.threads)
        try:
            for name, cell in rows(args.samples):
                table[name]["llama-server"] = cell(base)
                print(f"llama-server | {name} | {table[name]['llama-server']}", file=sys.stderr, flush=True)
        finally:
            proc.kill()
            proc.wait()
    if args.only == "llama-server":
        return _print(table, model, args)
    with tempfile.TemporaryDirectory() as home:
        (Path(home) / "config").mkdir()
        (Path(home) / "config" / "config.toml").write_text(f"[model]\nn_threads = {args.threads}\n")
        running = start_server(Path(home), ["-m", str(model), "--ctx", str(args.ctx)])
        try:
            for name, cell in rows(args.samples):
                table[name]["potluck serve"] = cell(running.base_url)
                print(f"potluck | {name} | {table[name]['potluck serve']}", file=sys.stderr, flush=True)
        finally:
            stop_server(running.proc)
    return _print(table, model, args)


def _print(table: dict[str, dict[str, str]], model: Path, args: argparse.Namespace) -> int:
    print(f"model {model.name}, ctx {args.ctx}, threads {args.threads}, {args.samples} seeds per sampled row\n")
    print("| request | llama-server --jinja | potluck serve |\n|---|---|---|")
    for name, cells in table.items():
        print(f"| {name} | {cells.get('llama-server', '-')} | {cells.get('potluck serve', '-')} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
