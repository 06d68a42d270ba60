"""The one configuration module: typed, frozen settings read from ``config.toml``.

Nothing is read at import time: callers load :class:`Settings` once (``load_settings``) and
pass it down, so tests build their own. The file is optional; every field has a default.
Unknown keys and wrong types are refused with a one-line :class:`PotluckError` that names
the key, because a silently ignored typo is worse than an error.

Example ``config.toml``::

    [model]
    path = "~/models/SmolLM2-1.7B-Instruct-Q4_K_M.gguf"
    draft = "~/models/SmolLM2-135M-Instruct-Q4_1.gguf"
    strategy = "sd"
    library = ["~/models"]

    [sampling]
    temperature = 0.7

    [ui]
    theme = "nord"

    [keys]
    regenerate = "ctrl+r"

    [cluster]
    join_timeout_s = 15  # workers on slow Wi-Fi or busy PCs
"""

from __future__ import annotations

import dataclasses
import math
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import engine  # the strategies and the loader load when a spec is made, not for `worker`
from ..engine import (
    DISCOVER_TIMEOUT_S,
    JOIN_TIMEOUT_S,
    EngineSpec,
    PotluckError,
    SamplingParams,
    paths,
    validate,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


@dataclass(frozen=True)
class ModelSettings:
    """Which model the chat opens and how it decodes."""

    path: str | None = None
    """Target GGUF file; unset means the bundled SmolLM2-135M."""
    draft: str | None = None
    """Draft GGUF for strategies that need one; it must share the target's vocabulary."""
    strategy: str = "auto"
    """Decoding strategy name (``potluck generate --help`` lists them); ``auto`` speculates with
    what is loaded (sd with a draft on a chat, N-grams otherwise), lossless like every strategy."""
    n_ctx: int = 4096
    """Context window in tokens."""
    n_threads: int = 0
    """CPU threads; 0 uses every core."""
    system: str | None = None
    """System prompt given to new conversations."""
    library: tuple[str, ...] = ()
    """Extra GGUF files or folders of them that the model picker offers."""


@dataclass(frozen=True)
class SamplingSettings:
    """How tokens are drawn; temperature 0 is greedy (exactly reproducible). The defaults are
    llama.cpp's: greedy decoding of small models loops (scripts/loop_count.py counts it)."""

    temperature: float = 0.8
    top_k: int = 40
    """Keep the k likeliest tokens; 0 turns the filter off."""
    top_p: float = 0.95
    """Nucleus mass; 1 turns the filter off."""
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    frequency_penalty: float = 0.0
    """Lower a token's logit by this for each time it occurs in the last 64 tokens (-2 to 2)."""
    presence_penalty: float = 0.0
    """Lower a token's logit by this once if it occurs in the last 64 tokens (-2 to 2)."""
    seed: int | None = None
    """RNG seed; unset draws a fresh one per reply."""
    max_tokens: int = 512
    """Longest reply in tokens."""

    def params(self) -> SamplingParams:
        """Checked by :mod:`.limits` (the seed mapped onto numpy's range)."""
        validate.max_tokens(self.max_tokens)
        return validate.sampling(
            SamplingParams(
                temperature=self.temperature,
                top_k=self.top_k,
                top_p=self.top_p,
                min_p=self.min_p,
                repeat_penalty=self.repeat_penalty,
                frequency_penalty=self.frequency_penalty,
                presence_penalty=self.presence_penalty,
                seed=self.seed,
            )
        )


@dataclass(frozen=True)
class UISettings:
    """Look and behaviour of the chat screen."""

    theme: str = "textual-dark"
    """Any Textual theme name (``textual-dark``, ``nord``, ``gruvbox``, ...)."""
    show_panels: bool = True
    """Show the live speed / acceptance panels at start (toggle with the ``toggle_panels`` key)."""
    stats_interval_s: float = 0.5
    """How often the panels sample the engine's counters; 0 stops the timer (tests). Each
    redraw costs the engine time on a small machine (docs/facts.md §26)."""
    cursor_blink: bool = True
    """Blinking input cursor; snapshot tests turn it off."""
    export_dir: str | None = None
    """Where exported conversations go; unset means ``potluck locate``'s exports folder."""


@dataclass(frozen=True)
class KeySettings:
    """Key map: one Textual key string per action (comma-separate alternatives)."""

    send: str = "enter"
    newline: str = "ctrl+j,shift+enter,alt+enter"
    """Insert a line break in the message (ctrl+j works in every terminal)."""
    stop: str = "escape"
    regenerate: str = "ctrl+r"
    new_conversation: str = "ctrl+n"
    rename_conversation: str = "f2"
    delete_conversation: str = "f8"
    previous_conversation: str = "ctrl+pageup,alt+up"
    next_conversation: str = "ctrl+pagedown,alt+down"
    system_prompt: str = "f4"
    picker: str = "ctrl+o"
    cluster: str = "f9"
    """Cluster picker: the workers found on the LAN (cluster mode)."""
    replan: str = "ctrl+g"
    """Cluster mode: reopen the session over the workers found now (after a loss)."""
    toggle_panels: str = "ctrl+t"
    copy_reply: str = "f3"
    copy_code: str = "f5"
    export: str = "ctrl+s"
    log: str = "ctrl+l"
    help: str = "f1"
    """The keys, and what the app can do (``?`` too, outside the input)."""
    settings: str = "f6"
    """This conversation's sampling, reply length, seed and strategy; the context size."""
    search: str = "ctrl+f"
    """Search every conversation."""
    previous_answer: str = "alt+left"
    """The last reply's earlier version (regenerated answers are kept); on a focused message, its own."""
    next_answer: str = "alt+right"
    edit_prompt: str = "alt+e"
    """Put the last prompt back in the input: sending it resends the conversation from there."""
    quit: str = "ctrl+q"

    def keymap(self) -> dict[str, str]:
        """Binding id -> keys, the form ``App.set_keymap`` takes."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@dataclass(frozen=True)
class ServerSettings:
    """`potluck serve`: where it listens and what one request may take. Omitted sampling options
    of a request take [sampling]'s values (temperature, top_p, max_tokens, ...)."""

    host: str = "127.0.0.1"
    """Address to bind; any non-loopback address needs an API key."""
    port: int = 8080
    api_key_file: str | None = None
    """File (mode 0600) holding the API keys clients send as ``Authorization: Bearer KEY``: one
    key, or one ``NAME KEY`` a line (each key's conversations are cached apart);
    ``$POTLUCK_API_KEY`` also works. Unset with neither: no key (loopback only)."""
    parallel: int = 4
    """Conversations decoded together, each in its own KV cache (llama-server's ``-np``); their
    steps share one batch. 1: one request at a time."""
    max_queue: int = 8
    """Requests waiting beside the running ones; past it a request gets 429 with Retry-After."""
    max_tokens: int | None = None
    """Longest reply when a request sets no max_tokens; unset: to the end of the reply or of
    the context (as OpenAI and llama.cpp's server do)."""
    max_body_kb: int = 1024
    """Largest request body."""
    body_timeout_s: float = 30.0
    """Longest wait for a request's body."""
    request_timeout_s: float = 600.0
    """Longest a request may wait and run before it is cancelled."""
    header_timeout_s: float = 10.0
    """Longest a connection may take to send a request's head (its first line and headers)."""
    max_connections: int = 512
    """Open connections at most (fewer if the open-file limit is lower)."""
    connections_per_address: int = 64
    """Open connections at most from one client address."""
    prompt_cache_mb: int = 1024
    """Memory for recent conversations' KV caches (at most a quarter of the free memory)."""
    cached_conversations: int = 16
    """Most conversations kept beside the one in the context."""
    allowed_hosts: tuple[str, ...] = ()
    """Host header names accepted besides localhost and the bind address (DNS-rebinding guard)."""
    allowed_origins: tuple[str, ...] = ()
    """Browser origins allowed besides loopback ones, e.g. "http://mybox:3000"."""
    reasoning: bool = True
    """Return a thinking model's ``<think>`` block as ``reasoning_content`` (false: left in the
    reply's content, as the model wrote it)."""


@dataclass(frozen=True)
class ClusterSettings:
    """Cluster mode (``--nodes`` or the cluster picker): how long to wait for the LAN."""

    discover_timeout_s: float = DISCOVER_TIMEOUT_S
    """Seconds to browse for workers (``--nodes auto``)."""
    join_timeout_s: float = JOIN_TIMEOUT_S
    """Seconds each worker has to accept us; slow or busy machines need longer."""

    def __post_init__(self) -> None:
        validate.discover_timeout(self.discover_timeout_s, "[cluster] discover_timeout_s")
        validate.join_timeout(self.join_timeout_s, "[cluster] join_timeout_s")


@dataclass(frozen=True)
class Settings:
    model: ModelSettings = field(default_factory=ModelSettings)
    sampling: SamplingSettings = field(default_factory=SamplingSettings)
    ui: UISettings = field(default_factory=UISettings)
    keys: KeySettings = field(default_factory=KeySettings)
    server: ServerSettings = field(default_factory=ServerSettings)
    cluster: ClusterSettings = field(default_factory=ClusterSettings)


_SECTIONS: dict[str, type] = {
    "model": ModelSettings,
    "sampling": SamplingSettings,
    "ui": UISettings,
    "keys": KeySettings,
    "server": ServerSettings,
    "cluster": ClusterSettings,
}


def _check(section: str, key: str, value: Any, hint: Any) -> Any:
    """Coerce a TOML value to the field's type or raise a one-line error naming the key."""
    args = typing.get_args(hint)
    optional = type(None) in args
    base = next((a for a in args if a is not type(None)), hint) if optional else hint
    where = f"[{section}] {key}"
    if typing.get_origin(base) is tuple:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(v, str) and "\x00" not in v for v in value):
            raise PotluckError(f"config: {where} must be a list of strings (without NUL characters)")
        return tuple(value)
    if base is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if (base is int and isinstance(value, bool)) or not isinstance(value, base):
        raise PotluckError(f"config: {where} must be {base.__name__}, got {value!r}")
    if isinstance(value, float) and not math.isfinite(value):  # TOML allows nan and inf
        raise PotluckError(f"config: {where} must be a finite number, got {value!r}")
    if isinstance(value, str) and "\x00" in value:  # TOML allows \u0000; no path or key may hold it
        raise PotluckError(f"config: {where} contains a NUL character")
    return value


def settings_from_dict(data: dict[str, Any]) -> Settings:
    """Build settings from parsed TOML, refusing unknown sections/keys and wrong types."""
    parts: dict[str, Any] = {}
    for section, table in data.items():
        cls = _SECTIONS.get(section)
        if cls is None:
            known = ", ".join(_SECTIONS)
            raise PotluckError(f"config: unknown section [{section}]; known: {known}")
        if not isinstance(table, dict):
            raise PotluckError(f"config: [{section}] must be a table")
        hints = typing.get_type_hints(cls)
        values = {}
        for key, value in table.items():
            if key not in hints:
                raise PotluckError(
                    f"config: unknown key {key!r} in [{section}]; known: {', '.join(hints)}"
                )
            values[key] = _check(section, key, value, hints[key])
        parts[section] = cls(**values)
    return Settings(**parts)


def settings_to_dict(settings: Settings) -> dict[str, Any]:
    """The TOML form: only values that differ from the defaults (TOML has no null)."""
    out: dict[str, Any] = {}
    for section in _SECTIONS:
        current, default = getattr(settings, section), getattr(Settings(), section)
        table = {
            f.name: list(v) if isinstance(v, tuple) else v
            for f in dataclasses.fields(current)
            if (v := getattr(current, f.name)) is not None and v != getattr(default, f.name)
        }
        if table:
            out[section] = table
    return out


def load_settings(path: Path | None = None) -> Settings:
    """Read ``path`` (default: ``paths.config_file()``); a missing file gives the defaults."""
    if path is None:
        path = paths.config_file()
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        return Settings()
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise PotluckError(f"config: {path} is not valid TOML ({e})") from None
    except OSError as e:
        raise PotluckError(f"config: cannot read {path} ({e.strerror or e})") from None
    return settings_from_dict(data)


def save_settings(settings: Settings, path: Path | None = None) -> Path:
    """Write what changed into config.toml, atomically (the picker and the settings dialog
    save their choices here). The file is the user's: tomlkit keeps its comments, layout and
    the keys it did not change; a key set back to "unset" is removed (TOML has no null)."""
    import tomlkit

    if path is None:
        path = paths.config_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        doc = tomlkit.parse(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        doc = tomlkit.document()
    except (tomlkit.exceptions.ParseError, UnicodeDecodeError) as e:
        raise PotluckError(f"config: {path} is not valid TOML ({e}); not overwriting it") from None
    defaults = Settings()
    for section in _SECTIONS:
        current, default = getattr(settings, section), getattr(defaults, section)
        table = doc.get(section)
        for f in dataclasses.fields(current):
            value = getattr(current, f.name)
            value = list(value) if isinstance(value, tuple) else value
            if table is not None and f.name in table:
                if value is None:
                    del table[f.name]
                elif table[f.name] != value:
                    table[f.name] = value
            elif value is not None and value != (list(d) if isinstance(d := getattr(default, f.name), tuple) else d):
                if table is None:
                    doc[section] = table = tomlkit.table()
                table[f.name] = value
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(tomlkit.dumps(doc), encoding="utf-8")
    tmp.replace(path)
    return path


def spec_from_settings(settings: Settings) -> EngineSpec:
    """The engine spec config.toml's [model] makes, for the chat and serve alike, checked by
    engine.limits (PotluckError: one line to show).

    The draft goes only to a strategy that uses one; config.toml keeps it for later picks."""
    m = settings.model
    cls = engine.get_strategy_class(m.strategy)  # an unknown name: one line
    draft = validate.path("[model] draft", m.draft) if cls.needs_draft or cls.accepts_draft else None
    return engine.checked_spec(
        EngineSpec(
            model=validate.path("[model] path", m.path),
            strategy=m.strategy,
            draft=draft,
            n_ctx=m.n_ctx,
            n_threads=m.n_threads,
            system=m.system or None,  # loading refuses one longer than the context
        )
    )
