"""OpenAI's request and response shapes: a JSON body in, a checked request out, and the
response objects the official client parses.

Every option is either used, accepted because it changes nothing (``n`` = 1, zero penalties,
``user``), or refused with a 400 that names it: a silently dropped option would give a client
an answer to a question it did not ask. Values go through the engine's own checks
(``potluck.engine.validate``), the same as the CLI's and config.toml's.
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


@dataclass(frozen=True)
class GenerationRequest:
    """A checked chat or completions request (``messages`` for chat, ``prompt`` for completions)."""

    kind: str  # "chat" | "completion"
    sampling: SamplingParams
    max_tokens: int
    messages: tuple[Message, ...] = ()
    prompt: str = ""
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))


# Options that change nothing at these values: accepted, anything else refused by name.
_NEUTRAL: dict[str, tuple[object, ...]] = {
    "n": (None, 1),
    "best_of": (None, 1),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "suffix": (None, ""),
    "tools": (None, []),
    "functions": (None, []),
    "tool_choice": (None, "none"),
    "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "store": (None, False),
    "service_tier": (None, "auto", "default"),
    "typical_p": (None, 1, 1.0),
}
# Accepted with any value of the right type: they change nothing here.
_FREE = {"user": str, "metadata": dict, "parallel_tool_calls": bool, "cache_prompt": bool}
_SAMPLING = {"temperature", "top_p", "top_k", "min_p", "repeat_penalty", "seed"}
_COMMON = {"model", "stream", "stream_options", "stop", "max_tokens", *_SAMPLING, *_NEUTRAL, *_FREE}
CHAT_KEYS = frozenset({*_COMMON, "messages", "max_completion_tokens"})
COMPLETION_KEYS = frozenset({*_COMMON, "prompt"})
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def _number(body: dict[str, Any], key: str) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad(key, f"must be a number, got {value!r:.60}")
    return float(value)


def _whole(body: dict[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(key, f"must be an integer, got {value!r:.60}")
    return value


def _check_options(body: dict[str, Any], known: frozenset[str]) -> None:
    for key in body:
        if key not in known:
            raise bad(key, "is not supported by potluck serve (remove it)")
    for key, neutral in _NEUTRAL.items():
        if key in body and not any(body[key] == v and type(body[key]) is type(v) or
                                   (isinstance(v, (int, float)) and not isinstance(body[key], bool)
                                    and isinstance(body[key], (int, float)) and body[key] == v)
                                   for v in neutral):
            raise bad(key, f"is not supported with the value {body[key]!r:.60} (potluck serve accepts only "
                      f"{', '.join('null' if v is None else repr(v) for v in neutral)})")
    for key, kind in _FREE.items():
        if body.get(key) is not None and not isinstance(body[key], kind):
            raise bad(key, f"must be {kind.__name__}")
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise bad("model", "must be a string")


def _sampling(body: dict[str, Any], defaults: SamplingSettings) -> SamplingParams:
    """Omitted options take config.toml's [sampling] values; the engine's checks decide the rest."""
    given: dict[str, Any] = {}
    for key, name in (("temperature", "temperature"), ("top_p", "top_p"), ("min_p", "min_p"),
                      ("repeat_penalty", "repeat_penalty")):
        value = _number(body, key)
        if value is not None:
            given[name] = value
    for key in ("top_k", "seed"):
        value = _whole(body, key)
        if value is not None:
            given[key] = value
    if given.get("temperature", 0.0) > 2.0:
        raise bad("temperature", "must be from 0 to 2")
    try:
        return validate.sampling(replace(defaults.params(), **given))
    except PotluckError as e:  # its messages name the CLI flags: --top-p for top_p
        message = str(e)
        param = next((k for k in given if k.replace("_", "-") in message or k in message), None)
        raise ApiError(400, f"{param}: {message}" if param else message, param=param) from None


def sampling_fields(params: SamplingParams) -> dict[str, float | int]:
    """The sampling a reply runs with, by the request's field names, the filters left out when
    greedy and the penalties when off (the log line)."""
    out: dict[str, float | int] = {"temperature": params.temperature}
    if not params.greedy:
        out.update(top_k=params.top_k, top_p=params.top_p, min_p=params.min_p)
    for key, off in (("repeat_penalty", 1.0), ("frequency_penalty", 0.0), ("presence_penalty", 0.0)):
        if getattr(params, key) != off:
            out[key] = getattr(params, key)
    return out


def _max_tokens(body: dict[str, Any], defaults: SamplingSettings, keys: tuple[str, ...]) -> int:
    chosen = None
    for key in keys:
        value = _whole(body, key)
        if value is None:
            continue
        if chosen is not None and value != chosen[1]:
            raise bad(key, f"differs from {chosen[0]}; send one of them")
        chosen = (key, value)
    if chosen is None:
        return defaults.max_tokens
    try:
        return validate.max_tokens(chosen[1])
    except PotluckError as e:
        raise bad(chosen[0], str(e)) from None


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
    if not stream:
        raise bad("stream_options", "is only allowed with stream: true")
    if not isinstance(options, dict) or set(options) - {"include_usage"} or \
            not isinstance(options.get("include_usage", False), bool):
        raise bad("stream_options", 'takes only {"include_usage": true|false}')
    return True, bool(options.get("include_usage", False))


def _text(param: str, value: str) -> str:
    try:
        return validate.text(param, value)
    except PotluckError as e:
        raise bad(param, str(e)) from None


def _content(i: int, content: Any) -> str:
    where = f"messages[{i}].content"
    if isinstance(content, str):
        return _text(where, content)
    if not isinstance(content, list):
        raise bad(where, "must be a string or a list of text parts")
    parts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str) \
                or set(part) - {"type", "text"}:
            raise bad(f"{where}[{j}]", 'only text parts ({"type": "text", "text": "..."}) are supported')
        parts.append(_text(f"{where}[{j}].text", part["text"]))
    return "".join(parts)


def _messages(body: dict[str, Any]) -> tuple[Message, ...]:
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise bad("messages", "must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}]", "must be an object with role and content")
        extra = set(m) - {"role", "content"}
        if extra:
            raise bad(f"messages[{i}].{sorted(extra)[0]}", "is not supported (only role and content)")
        role = m.get("role")
        if role not in ROLES:
            raise bad(f"messages[{i}].role", f"must be one of {', '.join(ROLES)}, got {role!r:.40}")
        out.append(Message(ROLES[role], _content(i, m.get("content"))))
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


def parse_request(kind: str, body: object, defaults: SamplingSettings) -> GenerationRequest:
    """A chat (``kind`` "chat") or completions request from a parsed JSON body; :class:`ApiError` if bad."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    _check_options(body, CHAT_KEYS if kind == "chat" else COMPLETION_KEYS)
    stream, include_usage = _stream(body)
    keys = ("max_tokens", "max_completion_tokens") if kind == "chat" else ("max_tokens",)
    return GenerationRequest(
        kind=kind,
        sampling=_sampling(body, defaults),
        max_tokens=_max_tokens(body, defaults, keys),
        messages=_messages(body) if kind == "chat" else (),
        prompt=_prompt(body) if kind == "completion" else "",
        stop=_stop(body),
        stream=stream,
        include_usage=include_usage,
    )
