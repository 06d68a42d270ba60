"""OpenAI's request and response shapes: a JSON body in, a checked request out.

OpenAI's own rule decides what happens to each field a client sends (:data:`CHAT_FIELDS`,
:data:`COMPLETION_FIELDS`, :data:`MESSAGE_FIELDS`; the README lists them):
- *used*: honoured (sampling, stop strings, streaming, ``reasoning_effort`` for templates that
  read it, a message's ``name``);
- *ignored*: accepted with any value because it cannot change the reply (``user``,
  ``metadata``, ``store``, ``prediction``, and any key potluck does not know, as llama.cpp's
  server does);
- *neutral only*: accepted at the value that changes nothing (``n`` = 1, no tools, no logprobs)
  and refused otherwise with a 400 that names the field, because ignoring it would give the
  client a silently wrong answer. A feature that lands (tools, structured output, logprobs,
  several choices) moves its fields from here to *used*.
Values go through the engine's own checks (``potluck.engine.validate``), the same as the CLI's
and config.toml's; numbers of any size, NaN and Infinity are refused by name, never a 500.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

from ...engine import Message, PotluckError, SamplingParams, validate
from ..config import SamplingSettings

MAX_STOPS = 16
MAX_STOP_CHARS = 256
MAX_NAME_CHARS = 256
COMPLETION_MAX_TOKENS = 16  # the completions API's default reply length, as OpenAI's
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")


class ApiError(Exception):
    """An error answered as OpenAI's error JSON with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param)


MAX_INT_DIGITS = 1000
"""Longer integers in a body are not read (Python refuses past 4,300 digits): they stay a
:class:`HugeInteger`, refused by the field that holds one."""


@dataclass(frozen=True)
class HugeInteger:
    digits: int

    def __str__(self) -> str:
        return f"an integer of {self.digits} digits"


@dataclass(frozen=True)
class GenerationRequest:
    """A checked chat or completions request (``messages`` for chat, ``prompt`` for completions)."""

    kind: str  # "chat" | "completion"
    sampling: SamplingParams
    max_tokens: int | None  # None: to the end of the reply or of the context
    messages: tuple[Message, ...] = ()
    prompt: str = ""
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    variables: tuple[tuple[str, str], ...] = ()  # extra names for the chat template (reasoning_effort)
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))


# -- the fields


@dataclass(frozen=True)
class Neutral:
    """A field accepted only at values that change nothing; ``why`` says why others are refused."""

    values: tuple[object, ...]
    why: str


IGNORED = "ignored"  # any value: it cannot change the reply
USED = "used"  # read by parse_request

_NO_TOOLS = "tools are not supported yet"
_ONE_CHOICE = "potluck serve answers with one choice"
_NO_LOGPROBS = "logprobs are not supported yet"

# Fields both endpoints share, by name: USED, IGNORED or Neutral(...).
_COMMON: dict[str, object] = {
    "model": USED,  # any name: the server holds one model
    "stream": USED, "stream_options": USED, "stop": USED, "max_tokens": USED, "seed": USED,
    "temperature": USED, "top_p": USED, "top_k": USED, "min_p": USED, "repeat_penalty": USED,
    "frequency_penalty": USED, "presence_penalty": USED,
    "n": Neutral((1,), _ONE_CHOICE),
    "best_of": Neutral((1,), _ONE_CHOICE),
    "logprobs": Neutral((False, 0), _NO_LOGPROBS),
    "top_logprobs": Neutral((0,), _NO_LOGPROBS),
    "n_probs": Neutral((0,), _NO_LOGPROBS),
    "logit_bias": Neutral(({},), "logit biases are not supported"),
    "typical_p": Neutral((1,), "typical sampling is not supported"),
    "mirostat": Neutral((0,), "mirostat sampling is not supported"),
    "grammar": Neutral(("",), "grammars are not supported yet"),
    "json_schema": Neutral(({},), "structured output is not supported yet"),
    "ignore_eos": Neutral((False,), "replies always end at the model's end of turn"),
    "user": IGNORED, "metadata": IGNORED, "store": IGNORED, "service_tier": IGNORED,
    "cache_prompt": IGNORED, "safety_identifier": IGNORED, "prompt_cache_key": IGNORED,
}
CHAT_FIELDS: dict[str, object] = {
    **_COMMON,
    "messages": USED, "max_completion_tokens": USED, "reasoning_effort": USED,
    "tools": Neutral(([],), _NO_TOOLS),
    "functions": Neutral(([],), _NO_TOOLS),
    "tool_choice": Neutral(("none", "auto"), _NO_TOOLS),
    "function_call": Neutral(("none",), _NO_TOOLS),
    "parallel_tool_calls": IGNORED,  # means nothing without tools
    "response_format": Neutral(({"type": "text"},), "structured output is not supported yet"),
    "modalities": Neutral((["text"],), "the model answers in text only"),
    "audio": Neutral((), "the model answers in text only"),
    "web_search_options": Neutral((), "potluck serve cannot search the web"),
    "prediction": IGNORED,  # a guess at the reply: never changes it
    "verbosity": IGNORED,  # a hint this model cannot take; the reply is what it writes
}
COMPLETION_FIELDS: dict[str, object] = {
    **_COMMON,
    "prompt": USED,
    "echo": Neutral((False,), "echo is not supported"),
    "suffix": Neutral(("",), "suffixes (fill in the middle) are not supported"),
}
MESSAGE_FIELDS: dict[str, object] = {
    "role": USED, "content": USED, "name": USED,
    "tool_calls": Neutral(([],), _NO_TOOLS),
    "function_call": Neutral((), _NO_TOOLS),
    "tool_call_id": Neutral((), _NO_TOOLS),
    "audio": Neutral((), "the model answers in text only"),
    "refusal": IGNORED, "reasoning_content": IGNORED,
}
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
NOT_A_MODEL_INPUT = {
    "image_url": "the model has no vision: send text only",
    "input_image": "the model has no vision: send text only",
    "input_audio": "the model has no audio input: send text only",
    "file": "files are not supported: send their text",
}


def _same(value: object, neutral: object) -> bool:
    """``value`` equals ``neutral`` without bool/number confusion (False is not 0 here, except
    where both are listed)."""
    if isinstance(neutral, bool) or isinstance(value, bool):
        return value is neutral
    if isinstance(neutral, (int, float)):
        return isinstance(value, (int, float)) and value == neutral
    return type(value) is type(neutral) and value == neutral


def _check_fields(body: dict[str, Any], fields: dict[str, object], where: str = "") -> None:
    """Refuse a neutral-only field away from its neutral value; the rest pass (unknown ones too)."""
    for key, rule in fields.items():
        if isinstance(rule, Neutral) and body.get(key) is not None \
                and not any(_same(body[key], v) for v in rule.values):
            raise bad(where + key, f"{rule.why}; send it as "
                      f"{' or '.join(_json(v) for v in rule.values) or 'null'} or leave it out")


def _json(value: object) -> str:
    return {True: "true", False: "false"}.get(value, repr(value)) if isinstance(value, bool) else \
        str(value).replace("'", '"')


# -- values


def _number(body: dict[str, Any], key: str) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, HugeInteger):
        raise bad(key, f"is out of range ({value})")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad(key, f"must be a number, got {_short(value)}")
    try:
        number = float(value)
    except OverflowError:  # an integer beyond any float
        raise bad(key, f"is out of range ({_short(value)})") from None
    if not math.isfinite(number):
        raise bad(key, f"must be a finite number, got {_short(value)}")
    return number


def _whole(body: dict[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, HugeInteger):
        raise bad(key, f"is out of range ({value})")
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(key, f"must be an integer, got {_short(value)}")
    return value


def _short(value: object) -> str:
    """A value for an error message: a 5,000-digit integer as its size, anything else cut."""
    if isinstance(value, HugeInteger):
        return str(value)
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**18:
        return f"an integer of {len(str(abs(value)))} digits"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _sampling(body: dict[str, Any], defaults: SamplingSettings) -> SamplingParams:
    """Omitted options take config.toml's [sampling] values; the engine's checks decide the rest."""
    given: dict[str, Any] = {}
    for key in ("temperature", "top_p", "min_p", "repeat_penalty", "frequency_penalty", "presence_penalty"):
        value = _number(body, key)
        if value is not None:
            given[key] = value
    for key in ("top_k", "seed"):
        value = _whole(body, key)
        if value is not None:
            given[key] = value
    if given.get("temperature", 0.0) > 2.0:
        raise bad("temperature", "must be from 0 to 2")
    if not 0 <= given.get("top_k", 0) <= 1 << 31:
        raise bad("top_k", f"must be from 0 (off) to the vocabulary's size, got {_short(given['top_k'])}")
    try:
        return validate.sampling(replace(defaults.params(), **given))
    except PotluckError as e:  # its messages name the CLI flags: --top-p for top_p
        message = str(e)
        param = next((k for k in given if k.replace("_", "-") in message or k in message), None)
        raise ApiError(400, f"{param}: {message}" if param else message, param=param) from None


def _max_tokens(body: dict[str, Any], default: int | None, keys: tuple[str, ...]) -> int | None:
    chosen = None
    for key in keys:
        value = _whole(body, key)
        if value is None:
            continue
        if chosen is not None and value != chosen[1]:
            raise bad(key, f"differs from {chosen[0]}; send one of them")
        chosen = (key, value)
    if chosen is None:
        return default
    if chosen[1] <= 0:
        raise bad(chosen[0], f"must be a positive integer, got {_short(chosen[1])}")
    return chosen[1]


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad("stop", "must be a string or a list of strings")
    if len(stops) > MAX_STOPS or any(not s or len(s) > MAX_STOP_CHARS for s in stops):
        raise bad("stop", f"takes at most {MAX_STOPS} non-empty strings of at most {MAX_STOP_CHARS} characters")
    return tuple(_text("stop", s) for s in stops)


def _stream(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise bad("stream", "must be true or false")
    options = body.get("stream_options")
    if options is None:
        return bool(stream), False
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise bad("stream_options", 'must be an object like {"include_usage": true}')
    # OpenAI refuses stream_options without stream; clients send both from one config, so the
    # options only apply when streaming (llama.cpp's server does the same)
    return bool(stream), bool(stream) and bool(options.get("include_usage", False))


def _text(param: str, value: str) -> str:
    try:
        return validate.text(param, value)
    except PotluckError as e:
        raise bad(param, str(e)) from None


def _content(where: str, role: str, content: Any) -> str:
    if content is None and role == "assistant":  # what clients send after a tool call
        return ""
    if isinstance(content, str):
        return _text(where, content)
    if not isinstance(content, list):
        raise bad(where, "must be a string or a list of text parts")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in NOT_A_MODEL_INPUT:
            raise bad(f"{where}[{j}]", NOT_A_MODEL_INPUT[kind])
        if kind == "refusal" and role == "assistant":
            continue  # the assistant declined: nothing the model wrote to read again
        if kind != "text" or not isinstance(part.get("text"), str):
            raise bad(f"{where}[{j}]", 'only text parts ({"type": "text", "text": "..."}) are supported')
        parts.append(_text(f"{where}[{j}].text", part["text"]))
    return "".join(parts)


def _messages(body: dict[str, Any]) -> tuple[Message, ...]:
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise bad("messages", "must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(where, "must be an object with role and content")
        role = m.get("role")
        if role in ("tool", "function"):
            raise bad(f"{where}.role", f"{_NO_TOOLS}; {role} messages cannot be answered")
        if role not in ROLES:
            raise bad(f"{where}.role", f"must be one of {', '.join(ROLES)}, got {_short(role)}")
        _check_fields(m, MESSAGE_FIELDS, f"{where}.")
        name = m.get("name")
        if name is not None and (not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS):
            raise bad(f"{where}.name", f"must be a string of 1 to {MAX_NAME_CHARS} characters")
        out.append(Message(ROLES[role], _content(f"{where}.content", role, m.get("content")),
                           _text(f"{where}.name", name) if name else None))
    return tuple(out)


def _prompt(body: dict[str, Any]) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise bad("prompt", "must be a string (or a list of one string)")
    if not prompt:
        raise bad("prompt", "is empty")
    return _text("prompt", prompt)


def _variables(body: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    """Names the chat template may read: reasoning models' templates take ``reasoning_effort``."""
    effort = body.get("reasoning_effort")
    if effort is None:
        return ()
    if effort not in REASONING_EFFORTS:
        raise bad("reasoning_effort", f"must be one of {', '.join(REASONING_EFFORTS)}")
    return (("reasoning_effort", effort),)


def parse_request(kind: str, body: object, defaults: SamplingSettings,
                  max_tokens: int | None = None) -> GenerationRequest:
    """A chat (``kind`` "chat") or completions request from a parsed JSON body; :class:`ApiError`
    if bad. ``max_tokens``: the reply's length when the request sets none (None: to its end)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    _check_fields(body, CHAT_FIELDS if kind == "chat" else COMPLETION_FIELDS)
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise bad("model", "must be a string")
    stream, include_usage = _stream(body)
    keys = ("max_tokens", "max_completion_tokens") if kind == "chat" else ("max_tokens",)
    if kind == "completion" and max_tokens is None:
        max_tokens = COMPLETION_MAX_TOKENS  # raw text seldom ends: OpenAI's legacy default
    return GenerationRequest(
        kind=kind,
        sampling=_sampling(body, defaults),
        max_tokens=_max_tokens(body, max_tokens, keys),
        messages=_messages(body) if kind == "chat" else (),
        prompt=_prompt(body) if kind == "completion" else "",
        stop=_stop(body),
        stream=stream,
        include_usage=include_usage,
        variables=_variables(body) if kind == "chat" else (),
    )
