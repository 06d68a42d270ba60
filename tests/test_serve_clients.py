"""`potluck serve` takes what real clients send (issue 44): the official openai client,
LangChain's ChatOpenAI and litellm send the fields llama.cpp's server accepts (a message name,
an assistant message with null content, reasoning_effort, zero penalties, unknown keys) and get
200 with exact greedy text; no max_tokens runs past 512; `--api-key`, `--max-queue`, CORS.
One real server started with `--api-key` on a small context."""

from __future__ import annotations

import http.client
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import urlsplit

import openai
import pytest

from potluck.app.serve.launch import RunningServer
from potluck.engine import EngineSpec, Finished, Message, SamplingParams, open_session

from .support.serving import serving

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm must not reach for the network

KEY = "clients-Hq4nWd7cRt2yLx6vMk9"
CTX = 768
ORIGIN = "http://notebook.example:8888"
HISTORY = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a fruit.", "name": "ann"},
    {"role": "assistant", "content": None},  # what clients send after a tool call
    {"role": "user", "content": "Name another one."},
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    config = f'[sampling]\ntemperature = 0.0\n[server]\nallowed_origins = ["{ORIGIN}"]\n'
    args = ["--api-key", KEY, "--ctx", str(CTX), "--max-queue", "12"]
    with serving(tmp_path_factory.mktemp("serve-clients"), config, args, api_key=KEY) as running:
        yield running


@pytest.fixture(scope="module")
def want() -> Iterator[Callable[[list[Message], int], str]]:
    """The greedy reply a fresh engine session gives (what `potluck generate --temp 0` gives)."""
    s = open_session(EngineSpec(n_ctx=CTX))

    def reply(messages: list[Message], max_tokens: int, sampling: SamplingParams = SamplingParams()) -> str:
        s.load_messages(messages)
        return [e for e in s.generate(None, sampling, max_tokens) if isinstance(e, Finished)][-1].text

    yield reply
    s.close()


def history_messages() -> list[Message]:
    return [Message(m["role"], m["content"] or "") for m in HISTORY]  # the name changes nothing in ChatML


def request(server: RunningServer, method: str, path: str, body: object = None,
            headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    url = urlsplit(server.base_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=300)
    try:
        conn.request(method, path, body=None if body is None else json.dumps(body), headers=headers or {})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.headers.items()}, r.read()
    finally:
        conn.close()


def test_the_openai_client_sends_harmless_fields(server: RunningServer, want: Callable[..., str]) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=KEY, max_retries=0, timeout=600)
    r = client.chat.completions.create(
        model="potluck", messages=HISTORY, max_tokens=12, temperature=0, frequency_penalty=0, presence_penalty=0,
        reasoning_effort="low", user="ann", metadata={"app": "test"}, store=False, service_tier="auto",
        prediction={"type": "content", "content": "Banana"}, parallel_tool_calls=False,
        extra_body={"some_future_option": {"x": 1}, "cache_prompt": True})
    assert r.choices[0].message.content == want(history_messages(), 12)


def test_frequency_and_presence_penalties_are_applied(server: RunningServer, want: Callable[..., str]) -> None:
    """The penalties reach the engine's sampler: greedy text equals the engine's with them, and
    differs from the text without them (a reply long enough to repeat itself)."""
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=KEY, max_retries=0, timeout=600)
    messages = [{"role": "user", "content": "List the days of the week, then list them again."}]
    penalised = SamplingParams(frequency_penalty=1.5, presence_penalty=0.5)
    r = client.chat.completions.create(model="potluck", messages=messages, max_tokens=40, temperature=0,
                                       frequency_penalty=1.5, presence_penalty=0.5)
    text = r.choices[0].message.content
    assert text == want([Message("user", messages[0]["content"])], 40, penalised)
    assert text != want([Message("user", messages[0]["content"])], 40)


def test_an_image_part_gets_a_400_saying_no_vision(server: RunningServer) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=KEY, max_retries=0, timeout=600)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="potluck", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "text", "text": "What is this?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}])
    assert "no vision" in e.value.body["message"] and e.value.body["param"] == "messages[0].content[1]"
    for field, value in [("tools", [{"type": "function", "function": {"name": "f"}}]), ("n", 2),
                         ("logprobs", True), ("response_format", {"type": "json_object"})]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="potluck", max_tokens=2, messages=HISTORY, **{field: value})
        assert e.value.body["param"] == field and field in e.value.body["message"]


def test_langchain_invoke_and_stream(server: RunningServer, want: Callable[..., str]) -> None:
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model="potluck", base_url=f"{server.base_url}/v1", api_key=KEY, temperature=0,
                     max_tokens=12, max_retries=0, frequency_penalty=0, presence_penalty=0, reasoning_effort="low",
                     model_kwargs={"user": "ann"}, extra_body={"cache_prompt": True})
    messages = [SystemMessage("You are terse."), HumanMessage("Name a fruit.", name="ann"), AIMessage(""),
                HumanMessage("Name another one.")]
    text = want([Message("system", "You are terse."), Message("user", "Name a fruit."), Message("assistant", ""),
                 Message("user", "Name another one.")], 12)
    assert llm.invoke(messages).content == text
    assert "".join(str(chunk.content) for chunk in llm.stream(messages)) == text


def test_litellm_completion(server: RunningServer, want: Callable[..., str]) -> None:
    import litellm

    r = litellm.completion(model="openai/potluck", api_base=f"{server.base_url}/v1", api_key=KEY, messages=HISTORY,
                           max_tokens=12, temperature=0, frequency_penalty=0, presence_penalty=0, user="ann",
                           num_retries=0)
    assert r.choices[0].message.content == want(history_messages(), 12)
    chunks = litellm.completion(model="openai/potluck", api_base=f"{server.base_url}/v1", api_key=KEY,
                                messages=HISTORY, max_tokens=12, temperature=0, stream=True, num_retries=0)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == r.choices[0].message.content


def test_no_max_tokens_runs_past_512_to_the_end(server: RunningServer) -> None:
    """aider sends no cap: its whole-file edits came back cut at 512 tokens."""
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=KEY, max_retries=0, timeout=900)
    r = client.chat.completions.create(model="potluck", messages=[
        {"role": "user", "content": "List the numbers from 1 to 1000, one per line, without skipping any."}])
    assert r.usage.completion_tokens > 512
    assert r.choices[0].finish_reason == "stop" or r.usage.total_tokens >= CTX - 1  # its end, or the context's


def test_api_key_option_and_max_queue(server: RunningServer) -> None:
    """`--api-key X` is the key (with the warning --token gives); `--max-queue 12` the queue."""
    assert "--api-key shows the key" in server.log()
    assert server.health()["queue"]["max"] == 12
    assert request(server, "GET", "/v1/models", headers={"Authorization": f"Bearer {KEY}"})[0] == 200
    assert request(server, "GET", "/v1/models", headers={"Authorization": "Bearer nope"})[0] == 401


def test_cors_preflights_and_headers(server: RunningServer) -> None:
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os"}
    status, headers, _ = request(server, "OPTIONS", "/v1/chat/completions", headers=preflight)
    assert status == 200 and headers["access-control-allow-origin"] == ORIGIN
    assert "authorization" in headers["access-control-allow-headers"] and "POST" in headers[
        "access-control-allow-methods"]
    loopback = {**preflight, "Origin": "http://localhost:3000"}
    assert request(server, "OPTIONS", "/v1/chat/completions", headers=loopback)[1][
        "access-control-allow-origin"] == "http://localhost:3000"
    foreign = {**preflight, "Origin": "http://attacker.example"}
    status, headers, _ = request(server, "OPTIONS", "/v1/chat/completions", headers=foreign)
    assert status == 403 and "access-control-allow-origin" not in headers
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    status, headers, _ = request(server, "POST", "/v1/chat/completions", body,
                                 {"Origin": ORIGIN, "Authorization": f"Bearer {KEY}"})
    assert status == 200 and headers["access-control-allow-origin"] == ORIGIN
    status, headers, _ = request(server, "POST", "/v1/chat/completions", body, {"Origin": ORIGIN})
    assert status == 401 and headers["access-control-allow-origin"] == ORIGIN  # the page can read why
    assert request(server, "POST", "/v1/chat/completions", body,
                   {"Origin": "http://attacker.example", "Authorization": f"Bearer {KEY}"})[0] == 403


def test_readme_lists_every_field() -> None:
    """The README's table says what serve does with each field it knows."""
    from potluck.app.serve.protocol import CHAT_FIELDS, COMPLETION_FIELDS, MESSAGE_FIELDS

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    missing = [f for f in {*CHAT_FIELDS, *COMPLETION_FIELDS, *MESSAGE_FIELDS} if f"`{f}`" not in readme]
    assert not missing, missing
