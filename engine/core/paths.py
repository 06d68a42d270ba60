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
    return private_dir(path)


def private_dir(path: Path) -> Path:
    """``path`` as a folder only its owner can enter (0700), created with that mode so it
    is never readable by others, even for an instant. An existing folder is tightened."""
    path = Path(path)
    if not path.is_dir():
        old = os.umask(0o077)
        try:
            path.mkdir(parents=True, exist_ok=True, mode=0o700)
        finally:
            os.umask(old)
    try:
        if path.stat().st_mode & 0o077:
            path.chmod(0o700)
    except OSError:
        pass
    return path


def write_private(path: Path, data: bytes) -> None:
    """Create ``path`` readable by its owner only (0600 from the first byte, never chmodded
    after the fact), replacing it atomically."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def check_private(path: Path) -> None:
    """Raise ``PermissionError`` if ``path`` (a secret) can be read or changed by others."""
    st = Path(path).stat()
    if st.st_mode & 0o077:
        raise PermissionError(
            f"{path} is accessible to other users (mode {st.st_mode & 0o777:o}); run `chmod 600 {path}`"
        )
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        raise PermissionError(f"{path} belongs to another user")


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


def screenshots_dir() -> Path:
    """The chat app's screenshots when there is no Downloads folder."""
    return _ensure(data_dir() / "screenshots")
