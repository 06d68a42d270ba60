"""The one place that knows where potluck keeps files (XDG base directories).

Every location is a function that creates its directory on first use. Tests point
everything at a temporary folder with ``POTLUCK_HOME`` (or :func:`override_home`).
"""

from __future__ import annotations

import os
from pathlib import Path

_override: Path | None = None


def override_home(path: Path | None) -> None:
    """Route every location under ``path`` (tests); ``None`` restores XDG."""
    global _override
    _override = Path(path) if path is not None else None


def _base(env_var: str, fallback: str) -> Path:
    home = _override or (Path(os.environ["POTLUCK_HOME"]) if os.environ.get("POTLUCK_HOME") else None)
    if home is not None:  # one folder per kind: config, data, cache, state
        return home / env_var.removeprefix("XDG_").removesuffix("_HOME").lower()
    root = os.environ.get(env_var) or str(Path.home() / fallback)
    return Path(root) / "potluck"


def _ensure(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def config_dir() -> Path:
    return _ensure(_base("XDG_CONFIG_HOME", ".config"))


def data_dir() -> Path:
    return _ensure(_base("XDG_DATA_HOME", ".local/share"))


def cache_dir() -> Path:
    return _ensure(_base("XDG_CACHE_HOME", ".cache"))


def state_dir() -> Path:
    return _ensure(_base("XDG_STATE_HOME", ".local/state"))


def config_file() -> Path:
    return config_dir() / "config.toml"


def history_db() -> Path:
    return data_dir() / "history.sqlite3"


def log_file() -> Path:
    return state_dir() / "potluck.log"


def slices_dir() -> Path:
    """GGUF slices made by the head and model files received by a worker, by content hash."""
    return _ensure(cache_dir() / "slices")


def fixtures_dir() -> Path:
    """Synthetic benchmark targets built from the bundled model."""
    return _ensure(cache_dir() / "fixtures")


def exports_dir() -> Path:
    """Conversations exported as Markdown from the chat app."""
    return _ensure(data_dir() / "exports")
