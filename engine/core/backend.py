"""llama.cpp's process-wide side: one backend initialisation, its log lines (the last errors
explain a failed load in one line), the CPU facts that choose defaults, and the first check
of a model path.

Facts this module relies on (docs/facts.md): CPUs with AMX crash inside ``llama_decode``
when llama.cpp uses its AMX "extra buffer type"; extra buffer types are therefore off by
default on such CPUs (§1).
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from pathlib import Path

import llama_cpp as ll

from .errors import ModelError

log = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"

_backend_lock = threading.Lock()
_backend_ready = False
_last_error_lines: list[str] = []


@ll.llama_log_callback
def _log_callback(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    msg = text.decode("utf-8", errors="replace").rstrip()
    if not msg:
        return
    if level in (3, 4):  # GGML_LOG_LEVEL_WARN, GGML_LOG_LEVEL_ERROR
        _last_error_lines.append(msg)
        del _last_error_lines[:-16]
    log.debug("llama.cpp: %s", msg)


def init_backend() -> None:
    """Initialise llama.cpp once per process and route its logs to :mod:`logging`."""
    global _backend_ready
    with _backend_lock:
        if _backend_ready:
            return
        ll.llama_log_set(_log_callback, ctypes.c_void_p(0))
        ll.llama_backend_init()
        _backend_ready = True


def clear_llama_errors() -> None:
    """Forget logged errors, so :func:`last_llama_error` speaks of what comes next."""
    _last_error_lines.clear()


def last_llama_error() -> str:
    """The most telling error llama.cpp logged since the last clear, without function prefixes."""
    lines = [ln.split("error loading model:", 1)[-1].strip() for ln in _last_error_lines]
    specific = [ln for ln in lines if "failed to load model" not in ln]
    line = (specific or lines or [""])[0]
    return line.split(": ", 1)[1] if ": " in line and " " not in line.split(": ", 1)[0] else line


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (``/proc/cpuinfo``; empty where there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_has_amx() -> bool:
    return any(flag.startswith("amx") for flag in cpu_flags())


def default_extra_bufts() -> bool:
    """Extra buffer types (repacking, AMX) unless the CPU has AMX; ``POTLUCK_EXTRA_BUFTS`` overrides."""
    env = os.environ.get("POTLUCK_EXTRA_BUFTS")
    if env is not None and env != "":
        return env.lower() in ("1", "true", "yes", "on")
    return not cpu_has_amx()


def check_gguf_file(path: Path) -> None:
    """Fail early, in one line, on the common ways a model path is wrong."""
    if not path.exists():
        raise ModelError(f"model file not found: {path} (pass an existing .gguf with -m)")
    if path.is_dir():
        raise ModelError(f"model path is a directory: {path} (pass a .gguf file with -m)")
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ModelError(f"cannot read model file {path}: {e.strerror}") from None
    if magic != GGUF_MAGIC:
        raise ModelError(f"not a GGUF model file: {path} (potluck loads llama.cpp GGUF files)")
