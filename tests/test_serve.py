"""`potluck serve` against the official `openai` client: one real server (the bundled model) on
a loopback port the OS picks, shared by the module; answers checked token for token against
the engine's own sessions (the same as `potluck generate --temp 0` and the chat app's turns)."""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import urlsplit

import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from potluck.app.serve.launch import RunningServer
from potluck.engine import EngineSpec, Finished, Message, SamplingParams, Session, open_session

from .support.conversations import interleave_turns
from .support.serving import ask_at_once, serving

KEY = "potluck-test-Zr8sKq2vLm5xT9wB"
MAX_QUEUE = 3
SYSTEM = "You are terse."


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    home = tmp_path_factory.mktemp("serve-home")
    key_file = home / "api-key"
    key_file.write_text(KEY)
    key_file.chmod(0o600)
    config = (  # greedy unless a request asks otherwise (the shipped default is llama.cpp's 0.8)
        '[sampling]\ntemperature = 0.0\n'
        f'[server]\napi_key_file = "{key_file}"\nmax_queue = {MAX_QUEUE}\nmax_body_kb = 256\n'
        'allowed_origins = ["http://notebook.example:8888"]\n'
    )
    with serving(home, config, api_key=KEY) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=KEY, max_retries=0, timeout=600)


@pytest.fixture(scope="module")
def reference() -> Iterator[Callable[[], Session]]:
    """Fresh engine sessions as `potluck generate` opens them (the server's spec: no system prompt)."""
    opened: list[Session] = []

    def fresh() -> Session:
        if opened:
            opened.pop().close()
        opened.append(open_session(EngineSpec()))
        return opened[-1]

    yield fresh
    for s in opened:
        s.close()


def finished(events: Iterator[object]) -> Finished:
    return [e for e in events if isinstance(e, Finished)][-1]


def wait_for(check: Callable[[], bool], timeout_s: float = 120.0, show: Callable[[], object] | None = None) -> None:
    """Until ``check()`` holds (a bound for a stalled machine, not a timing goal); on failure
    the message carries ``show()`` (say, the server's /health) for the next engineer."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"condition not reached: {show() if show else ''}"
        time.sleep(0.05)


def raw_request(server: RunningServer, body: bytes, *, path: str = "/v1/chat/completions",
                headers: dict[str, str] | None = None) -> tuple[int, dict[str, object], http.client.HTTPMessage]:
    url = urlsplit(server.base_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=300)
    try:
        conn.request("POST", path, body=body, headers={"Authorization": f"Bearer {KEY}",
                                                       "Content-Type": "application/json", **(headers or {})})
        r = conn.getresponse()
        return r.status, json.loads(r.read()), r.headers
    finally:
        conn.close()


def open_stream(server: RunningServer, body: dict[str, object]) -> tuple[http.client.HTTPConnection,
                                                                         http.client.HTTPResponse]:
    url = urlsplit(server.base_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=300)
    conn.request("POST", "/v1/chat/completions", body=json.dumps({**body, "stream": True}),
                 headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200
    return conn, r


def hang_up(conn: http.client.HTTPConnection) -> None:
    assert conn.sock is not None
    conn.sock.shutdown(2)
    conn.close()


# -- answers


def test_one_turn_equals_generate_and_usage(client: openai.OpenAI, reference: Callable[[], Session]) -> None:
    r = client.chat.completions.create(
        model="any", temperature=0, max_tokens=24,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Why is the sky blue?"}])
    s = reference()
    s.set_system(SYSTEM)
    want = finished(s.generate("Why is the sky blue?", SamplingParams(), 24))
    choice = r.choices[0]
    assert choice.message.content == want.text and choice.message.role == "assistant"
    assert choice.finish_reason == ("length" if want.reason == "length" else "stop")
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.usage.prompt_tokens == want.prompt_tokens
    assert r.usage.completion_tokens == len(want.tokens)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    extra = r.model_extra["potluck"]
    assert extra["strategy"] == "auto: anpd" and extra["drafted"] >= 0 and extra["tokens_per_s"] > 0


def test_equals_the_generate_command(client: openai.OpenAI) -> None:
    """The real CLI, once: the same text for the same message and system prompt."""
    cli = subprocess.run([sys.executable, "-m", "potluck.app.cli", "generate", "--temp", "0", "--max-tokens", "20",
                          "-s", SYSTEM, "--json", "Name three colours."], capture_output=True, text=True,
                         timeout=300, check=True)
    r = client.chat.completions.create(
        model="any", messages=[{"role": "system", "content": SYSTEM},
                               {"role": "user", "content": [{"type": "text", "text": "Name three "},
                                                            {"type": "text", "text": "colours."}]}],
        max_completion_tokens=20)  # temperature omitted: config.toml's default, 0
    assert r.choices[0].message.content == json.loads(cli.stdout)["text"]


def test_streaming_and_include_usage(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Tell me about cats."}]
    whole = client.chat.completions.create(model="any", messages=messages, max_tokens=16)
    chunks = list(client.chat.completions.create(model="any", messages=messages, max_tokens=16, stream=True))
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.usage is None for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content

    with_usage = list(client.chat.completions.create(model="any", messages=messages, max_tokens=16, stream=True,
                                                     stream_options={"include_usage": True}))
    assert with_usage[-1].choices == [] and with_usage[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None and c.choices for c in with_usage[:-1])
    assert with_usage[-2].choices[0].finish_reason is not None


def test_replies_stream_from_uvloop(server: RunningServer, client: openai.OpenAI) -> None:
    """uvicorn runs serve on uvloop, a dependency: ~0.2 ms less CPU a streamed token than
    asyncio's loop, CPU the two llama.cpp threads would lose (docs/facts.md §34)."""
    chunks = list(client.chat.completions.create(model="any", messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=4, stream=True))
    assert chunks[-1].choices[0].finish_reason is not None
    assert "/uvloop/loop." in Path(f"/proc/{server.proc.pid}/maps").read_text()


def test_stop_strings_are_cut_and_not_included(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Count from one to ten in words."}]
    full = client.chat.completions.create(model="any", messages=messages, max_tokens=40).choices[0].message.content
    words = full.split()
    assert len(words) > 4
    stop = words[3]
    cut = full[: full.index(stop)]
    r = client.chat.completions.create(model="any", messages=messages, max_tokens=40, stop=[stop, "zzzz"])
    assert r.choices[0].message.content == cut and r.choices[0].finish_reason == "stop"
    streamed = client.chat.completions.create(model="any", messages=messages, max_tokens=40, stop=stop, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == cut


def test_seeded_sampled_request_repeats(client: openai.OpenAI) -> None:
    ask = {"model": "any", "messages": [{"role": "user", "content": "Write a short poem."}], "max_tokens": 24,
           "temperature": 0.9, "top_p": 0.95}
    a = client.chat.completions.create(**ask, seed=1234).choices[0].message.content
    b = client.chat.completions.create(**ask, seed=1234).choices[0].message.content
    other = client.chat.completions.create(**ask, seed=99).choices[0].message.content
    assert a == b != other


def test_a_client_sending_only_temperature_gets_llama_servers_filters(server: RunningServer,
                                                                       client: openai.OpenAI) -> None:
    """/health shows what omitted options take (config.toml sets only temperature here: the rest
    are the shipped defaults, llama-server's), and the log line the sampling a request ran with."""
    defaults = server.health()["sampling_defaults"]
    assert defaults == {"temperature": 0.0, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "repeat_penalty": 1.0,
                        "frequency_penalty": 0.0, "presence_penalty": 0.0, "seed": None, "max_tokens": 512}
    client.chat.completions.create(model="any", messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                   temperature=0.7)
    wait_for(lambda: "temperature=0.7 top_k=40 top_p=0.95 min_p=0.05" in server.log(), show=server.log)
    client.chat.completions.create(model="any", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    wait_for(lambda: server.log().rstrip().endswith("temperature=0"), show=server.log)


def test_four_clients_at_once_each_exact(server: RunningServer, client: openai.OpenAI,
                                         reference: Callable[[], Session]) -> None:
    """Four official clients at once: their steps share batches (the counters say so) and
    each gets exactly the text it gets alone."""
    prompts = ["What is a cat?", "Say hello.", "What is 2+2?", "Name a planet."]
    before = server.health()["batching"]
    got = ask_at_once(client, prompts, 32)
    after = server.health()["batching"]
    for p in prompts:
        assert got[p] == finished(reference().generate(p, SamplingParams(), 32)).text
    assert after["shared"] > before["shared"] and after["most_lanes"] >= 2


def test_completions_endpoint_takes_raw_text(server: RunningServer, client: openai.OpenAI,
                                             reference: Callable[[], Session]) -> None:
    prompt = "The capital of France is"
    r = client.completions.create(model="any", prompt=prompt, max_tokens=12, temperature=0)
    assert r.object == "text_completion"
    assert r.choices[0].text == finished(reference().complete(prompt, SamplingParams(), 12)).text
    streamed = client.completions.create(model="any", prompt=prompt, max_tokens=12, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == r.choices[0].text


def test_models_and_health(server: RunningServer, client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert len(models) == 1 and models[0].owned_by == "potluck" and models[0].model_extra["context_length"] == 4096
    health = server.health()
    assert health["status"] == "ready" and health["queue"]["max"] == MAX_QUEUE


# -- conversations


def test_turn_two_reuses_the_prefix_with_the_chat_sessions_text(client: openai.OpenAI,
                                                                reference: Callable[[], Session]) -> None:
    turns = ["Hi! Who are you?", "What can you do?", "Thanks, bye."]
    chat = reference()  # the chat app's way: one session, turn by turn
    want = [finished(chat.generate(t, SamplingParams(), 20)).text for t in turns]
    history: list[dict[str, str]] = []
    previous_prompt = 0
    for i, turn in enumerate(turns):
        history.append({"role": "user", "content": turn})
        r = client.chat.completions.create(model="any", messages=history, max_tokens=20)
        assert r.choices[0].message.content == want[i]
        reused = r.model_extra["potluck"]["reused_tokens"]
        assert r.usage.prompt_tokens_details.cached_tokens == reused
        if i:  # the previous turn's prompt and reply come from the cache
            assert reused >= previous_prompt
        previous_prompt = r.usage.prompt_tokens
        history.append({"role": "assistant", "content": r.choices[0].message.content})


def test_interleaved_conversations_each_reuse_their_prefix(server: RunningServer, client: openai.OpenAI,
                                                          reference: Callable[[], Session]) -> None:
    convs = {"a": ["Name a fruit.", "Another one?"], "b": ["Name a river.", "How long is it?"]}
    want = {}
    for name, turns in convs.items():
        s = reference()
        want[name] = [finished(s.generate(t, SamplingParams(), 16)).text for t in turns]
    restored = server.health()["prompt_cache"]["restored"]
    interleave_turns(client, convs, want, max_tokens=16)
    assert server.health()["prompt_cache"]["restored"] >= restored + 2


def test_a_cache_miss_equals_a_fresh_session_given_that_history(client: openai.OpenAI,
                                                                reference: Callable[[], Session]) -> None:
    history = [Message("user", "What is the tallest mountain?"), Message("assistant", "Mount Everest, I believe."),
               Message("user", "How tall is it?")]
    s = reference()
    s.load_messages(history)
    want = finished(s.generate(None, SamplingParams(), 16)).text
    r = client.chat.completions.create(
        model="any", messages=[{"role": m.role, "content": m.content} for m in history], max_tokens=16)
    assert r.choices[0].message.content == want


# -- hang-ups and the queue


def test_hang_up_mid_stream_cancels_and_the_next_request_runs(server: RunningServer, client: openai.OpenAI) -> None:
    before = server.counters()
    conn, r = open_stream(server, {"messages": [{"role": "user", "content": "Write a long story about a dragon."}],
                                   "max_tokens": 2000})
    lines = 0
    while lines < 4:  # a few chunks have arrived: the reply is decoding
        lines += r.fp.readline().startswith(b"data:")
    hang_up(conn)
    wait_for(lambda: server.counters()["cancelled_running"] == before["cancelled_running"] + 1)
    after = server.counters()
    assert after["completion_tokens"] - before["completion_tokens"] < 2000
    assert server.health()["queue"] == {"running": False, "waiting": 0, "max": MAX_QUEUE}
    r2 = client.chat.completions.create(model="any", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert r2.choices[0].message.content


def test_hang_up_during_a_long_prompt_is_noticed_before_decoding(server: RunningServer) -> None:
    before = server.counters()
    words = " ".join(uuid.uuid4().hex[:6] for _ in range(350))  # ~2100 tokens, never cached
    conn, _ = open_stream(server, {"messages": [{"role": "user", "content": f"Summarize: {words}"}], "max_tokens": 50})
    wait_for(lambda: server.health()["queue"]["running"])
    hang_up(conn)
    # seen once in a full run (2026-11-25): not reached in 120 s, cause not found; /health says more
    wait_for(lambda: server.counters()["cancelled_running"] == before["cancelled_running"] + 1,
             show=lambda: (before, server.health()))
    after = server.counters()
    # no token decoded: the prompt's batches were aborted, not run to the end first
    assert after["cancelled_before_decoding"] == before["cancelled_before_decoding"] + 1
    assert after["completion_tokens"] == before["completion_tokens"]


def test_past_the_queue_a_request_gets_429_with_retry_after(server: RunningServer, client: openai.OpenAI) -> None:
    lanes = server.health()["lanes"]
    assert lanes == 4  # [server] parallel's default
    busy = []
    for i in range(lanes):  # every lane decodes a long reply
        conn, r = open_stream(server, {"messages": [{"role": "user", "content": f"Write a long story, part {i}."}],
                                       "max_tokens": 2000})
        r.fp.readline()
        busy.append(conn)
    wait_for(lambda: server.health()["queue"]["running"] == lanes)
    results: list[str] = []
    waiting = [threading.Thread(target=lambda: results.append(client.chat.completions.create(
        model="any", messages=[{"role": "user", "content": "Hi"}], max_tokens=2).choices[0].finish_reason))
        for _ in range(MAX_QUEUE)]
    for t in waiting:
        t.start()
    wait_for(lambda: server.health()["queue"]["waiting"] == MAX_QUEUE)
    status, body, headers = raw_request(server, json.dumps(
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}).encode())
    assert status == 429 and int(headers["Retry-After"]) >= 1 and body["error"]["type"] == "rate_limit_error"
    for conn in busy:
        hang_up(conn)
    for t in waiting:
        t.join(600)
    assert len(results) == MAX_QUEUE


# -- bad input


def test_refused_options_are_named(client: openai.OpenAI) -> None:
    base = {"model": "any", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    for extra, name in [({"n": 17}, "n"), ({"presence_penalty": 2.5}, "presence_penalty"),
                        ({"logprobs": 1}, "logprobs"), ({"response_format": {"type": "xml"}},
                                                        "response_format.type"),
                        ({"tool_choice": "required"}, "tool_choice")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(**base, **extra)
        assert e.value.status_code == 400 and e.value.body["param"] == name and name in e.value.body["message"]
    # options that change nothing are accepted
    r = client.chat.completions.create(**base, n=1, presence_penalty=0, frequency_penalty=0.0, user="u",
                                       extra_body={"top_k": 40, "min_p": 0.0, "repeat_penalty": 1.0})
    assert r.choices[0].message.content is not None


_valid = {"model": "any", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
_anything = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                         lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                     max_size=3), max_leaves=8)
_bad_fields = st.one_of(
    st.tuples(st.just("messages"), st.none() | st.integers() | st.text() | st.just([]) | st.lists(
        st.integers() | st.fixed_dictionaries({"role": st.text(max_size=6).filter(
            lambda r: r not in ("system", "user", "assistant", "developer"))}), min_size=1, max_size=2)),
    st.tuples(st.just("temperature"), st.text() | st.booleans() | st.floats(min_value=2.001)
              | st.floats(max_value=-0.001) | st.integers(min_value=3)),
    st.tuples(st.just("max_tokens"), st.integers(max_value=0) | st.floats() | st.text() | st.booleans()),
    st.tuples(st.just("top_p"), st.floats(min_value=1.001) | st.floats(max_value=0.0) | st.text()),
    st.tuples(st.just("n"), st.integers(min_value=17) | st.integers(max_value=0)),
    st.tuples(st.just("seed"), st.text() | st.floats() | st.lists(st.integers(), max_size=2)),
    st.tuples(st.just("stop"), st.integers() | st.just("") | st.lists(st.integers(), min_size=1, max_size=2)
              | st.lists(st.text(min_size=1, max_size=3), min_size=17, max_size=18)),
    st.tuples(st.just("stream"), st.integers() | st.text()),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fields=st.lists(_bad_fields, min_size=1, max_size=3), drop_messages=st.booleans())
def test_bad_json_bodies_get_4xx_json_errors(server: RunningServer, fields: list[tuple[str, object]],
                                            drop_messages: bool) -> None:
    body = dict(_valid)
    if drop_messages:
        del body["messages"]
    body.update(dict(fields))
    status, reply, _ = raw_request(server, json.dumps(body).encode())
    assert 400 <= status < 500, (body, reply)
    assert set(reply["error"]) == {"message", "type", "param", "code"} and reply["error"]["message"]


def test_raw_bad_bodies_get_4xx_and_the_server_lives(server: RunningServer) -> None:
    good = json.dumps(_valid).encode()
    for body, status in [(b"\xff\xfe{}", 400), (good[:-5], 400), (b"", 400), (b"[1, 2]", 400),
                         (b'{"messages": NaN}', 400), (b"[" * 100_000, 400), (b"x" * (300 * 1024), 413)]:
        got, reply, _ = raw_request(server, body)
        assert got == status, (body[:40], reply)
        assert reply["error"]["message"]
    assert raw_request(server, b"{}", path="/v1/nothing")[0] == 404
    assert server.health()["status"] == "ready" and server.proc.poll() is None


# -- the guard


def test_requests_without_the_key_are_refused(server: RunningServer) -> None:
    no_key = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="wrong-key-" + "x" * 20, max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        no_key.models.list()
    status, body, _ = raw_request(server, json.dumps(_valid).encode(), headers={"Authorization": ""})
    assert status == 401 and body["error"]["code"] == "invalid_api_key"


def test_host_and_origin_are_checked(server: RunningServer) -> None:
    body = json.dumps(_valid).encode()
    assert raw_request(server, body, headers={"Host": "attacker.example"})[0] == 403  # DNS rebinding
    assert raw_request(server, body, headers={"Origin": "http://attacker.example"})[0] == 403
    assert raw_request(server, body, headers={"Origin": "http://notebook.example:8888"})[0] == 200  # configured
    assert raw_request(server, body, headers={"Origin": "http://localhost:3000"})[0] == 200


def test_a_non_loopback_bind_needs_a_key(tmp_path: Path) -> None:
    env = {**os.environ, "POTLUCK_HOME": str(tmp_path)}
    env.pop("POTLUCK_API_KEY", None)
    r = subprocess.run([sys.executable, "-m", "potluck.app.cli", "serve", "--host", "0.0.0.0", "--port", "0"],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 2 and "API key" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    loose = tmp_path / "key"
    loose.write_text(KEY)
    loose.chmod(0o644)
    r = subprocess.run([sys.executable, "-m", "potluck.app.cli", "serve", "--api-key-file", str(loose)],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 2 and "chmod 600" in r.stderr


def test_more_kept_conversations_than_a_stage_keeps_are_refused(tmp_path: Path) -> None:
    """Every stage (a cluster's workers too) keeps at most 64: asking for more is one line at
    start, not a pipeline that breaks on the 65th conversation."""
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "config.toml").write_text("[server]\ncached_conversations = 65\n")
    env = {**os.environ, "POTLUCK_HOME": str(tmp_path)}
    r = subprocess.run([sys.executable, "-m", "potluck.app.cli", "serve", "--port", "0"],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 2 and "cached_conversations must be at most 64" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_a_request_past_its_time_is_cancelled_with_504_whole_and_streamed(tmp_path: Path) -> None:
    """``request_timeout_s`` bounds a request however many tokens it streams: one timer a request
    cancels the run and ends the answer with 504, whole or as the stream's error event."""
    config = "[sampling]\ntemperature = 0.0\n[server]\nrequest_timeout_s = 1.0\n"
    # a schema that takes thousands of tokens to fill: longer than a second on any machine
    schema = {"type": "array", "items": {"type": "integer"}, "minItems": 1000}
    long = {"messages": [{"role": "user", "content": "Count."}], "max_tokens": 4000,
            "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}}
    with serving(tmp_path, config) as running:
        url = urlsplit(running.base_url)
        conn = http.client.HTTPConnection(url.hostname, url.port, timeout=120)
        conn.request("POST", "/v1/chat/completions", body=json.dumps(long),
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        body = json.loads(r.read())
        conn.close()
        assert r.status == 504 and "request_timeout_s (1 s)" in body["error"]["message"]
        c = openai.OpenAI(base_url=f"{running.base_url}/v1", api_key="none", max_retries=0, timeout=120)
        streamed = ""
        with pytest.raises(openai.APIError, match="request_timeout_s"):
            for chunk in c.chat.completions.create(model="m", stream=True, **long):  # type: ignore[call-overload]
                streamed += chunk.choices[0].delta.content or "" if chunk.choices else ""
        assert streamed  # it streamed before its time ran out
        deadline = time.monotonic() + 60  # the second run's cancel reaches the engine thread in its time
        while time.monotonic() < deadline:
            counters = running.counters()
            if counters["cancelled_running"] + counters["cancelled_before_decoding"] >= 2:
                break
            time.sleep(0.1)
        assert counters["cancelled_running"] + counters["cancelled_before_decoding"] >= 2  # the runs were stopped
        assert running.log().count("(timed out)") == 2
