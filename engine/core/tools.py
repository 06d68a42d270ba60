"""Tool calling in the formats chat templates imply: rendering, forcing and parsing calls.

The model's own template renders the tools where it can (as llama.cpp's server does with
``--jinja``), and the format of a call follows from the template:

- ``hermes``: Hermes, Qwen 2.5/3 and others write ``<tool_call>{"name", "arguments"}</tool_call>``;
- ``llama3``: Llama 3.1+ writes ``{"name", "parameters"}`` as the whole reply;
- ``generic``: a template that knows no tools (the bundled SmolLM2's ChatML): the tools are
  described in the system message and a call is the JSON object ``{"tool_calls": [...]}``,
  as llama.cpp's generic format; a template that renders tools in a format not listed here
  is parsed the same way (a JSON object, the generic fallback).

- ``harmony``: gpt-oss writes a call as a message on its commentary channel, to
  ``functions.NAME``, between control tokens; :mod:`.harmony` reads such replies.

``tool_choice`` required, or naming a function, becomes a grammar (:func:`call_grammar`) so a
call always comes back, even from a model that would answer in prose. A reply that does not
parse as calls to the tools given is text (:class:`CallScanner`), never an error.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from .chat import Message, ToolCall
from .grammar import GrammarError, GrammarSpec, json_schema_spec

HERMES, LLAMA3, GENERIC, HARMONY = "hermes", "llama3", "generic", "harmony"
MAX_TOOLS = 128
MAX_PARALLEL_CALLS = 4  # calls one forced reply may hold (a small model repeats calls forever)


@dataclass(frozen=True)
class Tool:
    """A function the model may call; ``parameters`` is its JSON schema."""

    name: str
    description: str = ""
    parameters: dict | None = None

    def openai(self) -> dict[str, object]:
        """OpenAI's definition, as templates read it."""
        function: dict[str, object] = {"name": self.name}
        if self.description:
            function["description"] = self.description
        function["parameters"] = self.parameters if self.parameters is not None else {"type": "object",
                                                                                          "properties": {}}
        return {"type": "function", "function": function}


def tool_format(template: str) -> str:
    """The call format a chat template implies (the module docstring)."""
    if "<|channel|>" in template:
        return HARMONY
    if "<tool_call>" in template:
        return HERMES
    if "<|python_tag|>" in template or ("ipython" in template and '"parameters"' in template):
        return LLAMA3
    return GENERIC


def renders_tools(template: str) -> bool:
    """Whether the template renders the ``tools`` it is given (else they go in the system message)."""
    return "tools" in template


def conversation(messages: Sequence[Message], tools: Sequence[Tool], template: str) -> list[Message]:
    """``messages`` as the template can take them: for a template that knows no tools, the tools
    described in the system message, calls written as the JSON the model is asked for, and tool
    results as user messages (llama.cpp's polyfills do the same)."""
    if renders_tools(template):
        return list(messages)
    out = []
    for m in messages:
        if m.role == "assistant" and m.tool_calls:
            calls = [{"name": c.name, "arguments": _object(c.arguments), "id": c.id} for c in m.tool_calls]
            out.append(Message("assistant", json.dumps({"tool_calls": calls}, ensure_ascii=False)))
        elif m.role == "tool":
            result = {"tool_response": {"tool_call_id": m.tool_call_id, "content": m.content}}
            out.append(Message("user", json.dumps(result, ensure_ascii=False)))
        else:
            out.append(m)
    if tools:
        guide = generic_guide(tools)
        if out and out[0].role == "system":
            out[0] = Message("system", out[0].content + "\n\n" + guide, out[0].name)
        else:
            out.insert(0, Message("system", guide))
    return out


def generic_guide(tools: Sequence[Tool]) -> str:
    listed = json.dumps([t.openai()["function"] for t in tools], indent=2, ensure_ascii=False)
    return ("You can call these tools:\n" + listed + "\n\nTo call tools, reply with only a JSON object: "
            '{"tool_calls": [{"name": <the tool\'s name>, "arguments": <its arguments as an object>}]}. '
            "Otherwise reply to the user as usual.")


def _object(text: str) -> object:
    try:
        return json.loads(text)
    except ValueError:
        return text


def call_grammar(fmt: str, tools: Sequence[Tool], parallel: bool = True) -> GrammarSpec:
    """A grammar whose every reply is one call (up to MAX_PARALLEL_CALLS with ``parallel``) to one of ``tools``,
    in ``fmt``; refusals (GrammarError) name the tool's parameters as the client wrote them."""
    if fmt == HARMONY:
        return harmony_call_grammar(tools, parallel)
    key = "parameters" if fmt == LLAMA3 else "arguments"
    calls = []
    for t in tools:
        params = t.parameters if t.parameters is not None else {"type": "object"}
        calls.append({"type": "object", "properties": {"name": {"const": t.name}, key: params},
                      "required": ["name", key], "additionalProperties": False})
    one = calls[0] if len(calls) == 1 else {"anyOf": calls}
    where = "tools[].function.parameters"
    if fmt == GENERIC:
        schema = {"type": "object", "properties": {"tool_calls": {
            "type": "array", "items": one, "minItems": 1, "maxItems": MAX_PARALLEL_CALLS if parallel else 1}},
            "required": ["tool_calls"], "additionalProperties": False}
        return json_schema_spec(schema, where)
    spec = json_schema_spec(one, where)
    if fmt == LLAMA3:
        return spec
    # hermes: the object inside its tags, once or (parallel) up to MAX_PARALLEL_CALLS times
    repeat = ' ("\\n" call-block' * (MAX_PARALLEL_CALLS - 1) + ")?" * (MAX_PARALLEL_CALLS - 1) if parallel else ""
    text = spec.text + '\ncall-block ::= "<tool_call>\\n" root "\\n</tool_call>"\ntool-root ::= call-block' + repeat
    return GrammarSpec(text, root="tool-root")


def harmony_call_grammar(tools: Sequence[Tool], parallel: bool = True) -> GrammarSpec:
    """A grammar whose reply is one call to one of ``tools`` on the commentary channel, as gpt-oss
    writes it (its control tokens as tokens), its arguments matching that tool's schema; with
    ``parallel``, more calls may follow, each its own message."""
    schemas = [t.parameters if t.parameters is not None else {"type": "object"} for t in tools]
    spec = json_schema_spec({"anyOf": schemas}, "tools[].function.parameters")
    for i in range(len(tools)):
        if not re.search(rf"^alternative-{i} ::=", spec.text, re.M):
            raise GrammarError("tools[].function.parameters: llama.cpp's JSON-schema converter named its "
                               "rules unexpectedly")
    calls = " | ".join(f'"{t.name}" " " <|constrain|> "json" <|message|> alternative-{i}'
                       for i, t in enumerate(tools))
    # parallel: up to MAX_PARALLEL_CALLS messages (a small model forced to call repeats calls)
    more = ' (<|end|> <|start|> "assistant" call-message' * (MAX_PARALLEL_CALLS - 1) + ")?" * (
        MAX_PARALLEL_CALLS - 1) if parallel else ""
    return GrammarSpec(
        spec.text
        + f'\ncall-message ::= <|channel|> "commentary to=functions." ({calls})'
        + f"\nharmony-root ::= call-message{more}",
        root="harmony-root",
    )


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


def parse_calls(fmt: str, text: str, tools: Sequence[Tool]) -> tuple[str, tuple[ToolCall, ...]]:
    """(the reply's text outside calls, its calls); a reply that is not well-formed calls to
    ``tools`` comes back whole as text with no calls."""
    names = {t.name for t in tools}
    if fmt == HERMES and "<tool_call>" in text:
        found = []
        for body in _HERMES_CALL.findall(text):
            call = _call(body, names, ("arguments", "parameters"))
            if call is None:
                return text, ()
            found.append(call)
        return text[: text.index("<tool_call>")].rstrip(), tuple(found)
    stripped = text.strip()
    if not stripped.startswith(("{", "[")):
        return text, ()
    try:
        value = json.loads(stripped)
    except ValueError:
        return text, ()
    if isinstance(value, dict) and isinstance(value.get("response"), str) and len(value) == 1:
        return value["response"], ()  # the generic format's plain answer
    items = value.get("tool_calls", value.get("tool_call")) if isinstance(value, dict) else value
    if isinstance(value, dict) and items is None:
        items = value  # one call: {"name", "arguments"}
    items = items if isinstance(items, list) else [items]
    calls = [_call(item, names, ("arguments", "parameters")) for item in items]
    if not calls or any(c is None for c in calls):
        return text, ()
    return "", tuple(c for c in calls if c is not None)


def _call(item: object, names: set[str], keys: tuple[str, ...]) -> ToolCall | None:
    if isinstance(item, str):
        try:
            item = json.loads(item)
        except ValueError:
            return None
    if not isinstance(item, dict):
        return None
    if isinstance(item.get("function"), dict):  # OpenAI's own shape
        item = item["function"]
    name = item.get("name")
    arguments = next((item[k] for k in keys if k in item), {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if name not in names or not isinstance(arguments, dict):
        return None
    return ToolCall(new_call_id(), name, json.dumps(arguments, ensure_ascii=False))


@dataclass(frozen=True)
class CallPart:
    """A piece of a streamed call (OpenAI's streamed ``tool_calls`` delta): the first piece of
    call ``index`` carries its id and name, each piece the next text of its arguments' JSON."""

    index: int
    arguments: str
    id: str = ""
    name: str = ""


# Where a call's arguments begin, in every format's call object: its name comes first (the
# call grammar's order). Tool names are [A-Za-z0-9_-] (serve's protocol checks them).
_CALL_HEAD = re.compile(r'\{\s*"name"\s*:\s*"([A-Za-z0-9_-]*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)')


class CallScanner:
    """Streams a reply's text while it may hold tool calls: text that may start a call is held
    back until the reply ends, then parsed (:meth:`finish`).

    ``stream_calls``: the reply follows :func:`call_grammar`, so it is calls and nothing else,
    well-formed but for a cut at max_tokens; then each call streams as it is written
    (:meth:`parts`), as OpenAI streams them. A call the model may make unforced comes whole at
    the end: had it streamed and then not parsed, it could no longer come back as text.
    """

    def __init__(self, fmt: str, tools: Sequence[Tool], stream_calls: bool = False) -> None:
        self.fmt = fmt
        self.tools = tools
        self.sent = ""  # text already given out
        self.held = ""  # text that may be (the start of) calls
        self.stream_calls = stream_calls
        self._parts: list[CallPart] = []
        self._streamed: list[str] = []  # the ids of the calls begun
        self._looked = 0  # where the next call's head is looked for in ``held``
        self._args_at: int | None = None  # where the arguments of the call being streamed are up to
        self._depth = 0
        self._in_string = self._escaped = False

    def parts(self) -> list[CallPart]:
        """The pieces of calls written since the last look (``stream_calls``)."""
        out, self._parts = self._parts, []
        return out

    def _scan(self) -> None:
        """Stream the arguments written so far, each call's JSON value up to its closing brace."""
        held = self.held
        while True:
            if self._args_at is None:
                head = _CALL_HEAD.search(held, self._looked)
                if head is None:
                    return
                self._streamed.append(new_call_id())
                self._parts.append(CallPart(len(self._streamed) - 1, "", self._streamed[-1], head.group(1)))
                self._args_at, self._depth = head.end(), 0
            start, at = self._args_at, self._args_at
            while at < len(held):
                ch = held[at]
                at += 1
                if self._in_string:
                    if self._escaped:
                        self._escaped = False
                    elif ch == "\\":
                        self._escaped = True
                    elif ch == '"':
                        self._in_string = False
                elif ch == '"':
                    self._in_string = True
                elif ch in "{[":
                    self._depth += 1
                elif ch in "}]":
                    self._depth -= 1
                    if self._depth == 0:
                        break
            if at > start:
                self._parts.append(CallPart(len(self._streamed) - 1, held[start:at]))
            if self._depth > 0 or at == start:
                self._args_at = at  # the arguments go on in the next text
                return
            self._args_at, self._looked = None, at

    def feed(self, text: str) -> str:
        """Text safe to send now."""
        self.held += text
        if self.stream_calls:
            self._scan()
            return ""
        if self.fmt == HERMES:
            at = self.held.find("<tool_call>")
            if at >= 0:
                out, self.held = self.held[:at], self.held[at:]
            else:
                keep = next((k for k in range(min(len(self.held), 10), 0, -1)
                             if "<tool_call>".startswith(self.held[-k:])), 0)
                out, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep :]
        elif self.sent.strip() or (self.held.strip() and not self.held.lstrip().startswith(("{", "["))):
            out, self.held = self.held, ""  # prose: a call is the whole reply or nothing
        else:
            out = ""
        self.sent += out
        return out

    def finish(self) -> tuple[str, tuple[ToolCall, ...]]:
        """(the rest of the text, the calls) once the reply ended. Streamed calls keep the ids
        they were streamed with; a streamed reply cut short leaves no text (it was shown as
        calls, and ends as "length")."""
        held, self.held = self.held, ""
        if self.stream_calls:
            _, calls = parse_calls(self.fmt, held, self.tools)
            if len(calls) != len(self._streamed):
                return "", ()
            return "", tuple(ToolCall(i, c.name, c.arguments) for i, c in zip(self._streamed, calls))
        if not held:
            return "", ()
        if self.fmt == HERMES:
            content, calls = parse_calls(self.fmt, held, self.tools)
            return (content, calls) if calls else (held, ())
        if self.sent.strip():
            return held, ()
        whole = self.sent + held
        content, calls = parse_calls(self.fmt, whole, self.tools)
        return (held if content == whole else content), calls
