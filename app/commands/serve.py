"""`potluck serve`: an OpenAI-compatible HTTP server (Starlette on uvicorn) over lanes of sessions
that decode their conversations together.

Settings come from config.toml ([model], [sampling] for omitted request options, [server]);
the options given here override them for this run. Everything that can be checked without the
model is checked before the port is bound (one line, exit code 2); the model then loads on the
engine thread while /health answers "loading".
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys
import threading
from dataclasses import replace
from pathlib import Path

from ...engine import Lanes, PotluckError, PromptCache, check_gguf_file, open_lanes, resolve_model, validate
from ..cli import COMMANDS
from ..serve.connections import ConnectionGate, connection_budget, gated_protocol, listening_socket
from ..serve.engine_thread import EngineThread
from ..serve.guard import Guard, read_api_keys
from ..serve.http import ServeState, build_app
from .common import CLUSTER_OVERRIDES, add_cluster_args, check_cluster_args, settings_with_overrides, with_cluster

log = logging.getLogger("potluck.serve")

MAX_PARALLEL = 64  # lanes: llama.cpp keeps at most 256 sequences in a context, and each lane's KV cache is whole

# argument dest -> (settings section, field); None-valued arguments keep the setting.
_OVERRIDES = {
    "model": ("model", "path"),
    "draft": ("model", "draft"),
    "strategy": ("model", "strategy"),
    "ctx": ("model", "n_ctx"),
    "threads": ("model", "n_threads"),
    "host": ("server", "host"),
    "port": ("server", "port"),
    "api_key_file": ("server", "api_key_file"),
    "parallel": ("server", "parallel"),
    "max_queue": ("server", "max_queue"),
    **CLUSTER_OVERRIDES,
}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve", help=COMMANDS["serve"],
        description="Serve the model over an OpenAI-compatible HTTP API (/v1/chat/completions, "
        "/v1/completions, /v1/models, /health). Defaults come from config.toml ([model], [sampling], [server], "
        "[cluster]).",
    )
    p.add_argument("-m", "--model", type=Path, help="target GGUF model (default: [model] path or the bundled one)")
    p.add_argument("--strategy", help="decoding strategy (default: [model] strategy)")
    p.add_argument("--draft", type=Path, help="draft GGUF model for strategies that use one")
    p.add_argument("--ctx", type=int, help="context size in tokens (default: [model] n_ctx)")
    p.add_argument("-t", "--threads", type=int, help="CPU threads (default: [model] n_threads)")
    p.add_argument("--host", help="address to bind (default 127.0.0.1; any other needs an API key)")
    p.add_argument("--port", type=int, help="TCP port (default 8080; 0: any free port)")
    p.add_argument("--api-key-file", help="file (mode 0600) with the API key clients must send, or one NAME KEY "
                   "a line (each key's conversations cached apart); or $POTLUCK_API_KEY")
    p.add_argument("--api-key", help="the API key (shown to every user of this machine by ps: prefer "
                   "$POTLUCK_API_KEY or --api-key-file)")
    p.add_argument("--max-queue", type=int, help="requests waiting beside the running ones before 429 (default 8)")
    p.add_argument("-np", "--parallel", type=int,
                   help="conversations decoded together in one batch (default: [server] parallel, 4; 1: one at a time)")
    add_cluster_args(p)
    p.set_defaults(**dict.fromkeys(_OVERRIDES))


def run(args: argparse.Namespace) -> int:
    from ..config import spec_from_settings  # the chat's spec rules: one copy

    check_cluster_args(args)  # before the options become settings: its errors name the options
    settings = settings_with_overrides(args, _OVERRIDES)
    server = settings.server
    settings.sampling.params()  # omitted request options take these: refuse bad ones now
    if not 0 <= server.port <= 65535:
        raise PotluckError(f"--port must be 0..65535, got {server.port}")
    if server.max_queue < 1 or server.max_body_kb < 1 or server.body_timeout_s <= 0 \
            or server.request_timeout_s <= 0 or server.header_timeout_s <= 0 or server.prompt_cache_mb < 0 \
            or server.cached_conversations < 1 or server.max_connections < 1 or server.connections_per_address < 1:
        raise PotluckError("config: [server] max_queue (--max-queue), max_body_kb, cached_conversations, "
                           "max_connections, connections_per_address and the timeouts must be positive, "
                           "prompt_cache_mb at least 0")
    if server.max_tokens is not None:
        validate.max_tokens(server.max_tokens)
    if not 1 <= server.parallel <= MAX_PARALLEL:
        raise PotluckError(f"--parallel ([server] parallel) must be 1..{MAX_PARALLEL}, got {server.parallel}")
    if server.cached_conversations > PromptCache.MAX_CONVERSATIONS:
        raise PotluckError(f"config: [server] cached_conversations must be at most {PromptCache.MAX_CONVERSATIONS}, "
                           f"got {server.cached_conversations}")
    guard = Guard(server.host, read_api_keys(server.api_key_file, args.api_key), server.allowed_hosts,
                  server.allowed_origins)
    # No hidden system prompt: a request's messages are the whole conversation.
    spec = spec_from_settings(replace(settings, model=replace(settings.model, system=None)))
    model_path = resolve_model(spec.model)
    for path in (model_path, spec.draft):
        if path is not None:
            check_gguf_file(path)
    sock = _bind(server.host, server.port)

    cache = PromptCache.within_free_memory(server.prompt_cache_mb * 1_000_000, server.cached_conversations)

    def opener() -> Lanes:  # on the engine thread: in cluster mode the sockets belong to it
        # fewer lanes where the strategy, the cache type or the model cannot share batches (logged)
        lanes = open_lanes(with_cluster(spec, args, settings.cluster), server.parallel)
        for session in lanes.sessions:
            session.use_prompt_cache(cache)  # in cluster mode within what the workers can keep
        return lanes

    engine = EngineThread(opener, server.max_queue)
    state = ServeState(engine, model_path.stem, spec.n_ctx, settings.sampling, server)
    gate = ConnectionGate(connection_budget(server.max_connections), server.connections_per_address,
                          server.header_timeout_s)
    return _serve(build_app(state, guard), sock, engine, state, gate)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = listening_socket(family)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise PotluckError(f"cannot listen on {host}:{port} ({e.strerror or e}); pick another --port or --host") \
            from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def _serve(app: object, sock: socket.socket, engine: EngineThread, state: ServeState, gate: ConnectionGate) -> int:
    import asyncio

    import uvicorn

    logging.getLogger("potluck.serve").setLevel(logging.INFO)  # the per-request lines
    host, port = sock.getsockname()[:2]
    # log_config=None: uvicorn's own loggers go through potluck's handler (PrintableFormatter)
    config = uvicorn.Config(app, log_level="warning", log_config=None, access_log=False, lifespan="off",
                            server_header=False, http=gated_protocol(gate), timeout_keep_alive=5,
                            timeout_graceful_shutdown=5, h11_max_incomplete_event_size=65536)

    class Server(uvicorn.Server):
        async def serve(self, sockets: list[socket.socket] | None = None) -> None:
            asyncio.get_running_loop().set_exception_handler(gate.accept_error_handler)
            await super().serve(sockets)

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            engine.drain()  # open requests end now (503 or cancelled), within the graceful timeout
            await super().shutdown(sockets)

    server = Server(config)

    def stop_if_load_fails() -> None:
        engine.loaded.wait()
        if engine.state == "failed":
            server.should_exit = True
        else:
            print("potluck serve: ready", file=sys.stderr, flush=True)

    engine.start()
    threading.Thread(target=stop_if_load_fails, name="potluck-load-watch", daemon=True).start()
    shown = f"[{host}]" if ":" in host else host
    print(f"potluck serve: http://{shown}:{port}/v1 (model {state.model_id}; loading)", file=sys.stderr, flush=True)
    try:
        server.run(sockets=[sock])
    finally:
        engine.stop()
        state.tokenizer.shutdown(wait=False, cancel_futures=True)
        sock.close()
    if engine.state == "failed":
        raise PotluckError(engine.error)
    return 0
