"""What drafting costs on this machine, kept across replies, conversations and runs.

The verify-cost line (:class:`~potluck.engine.speculation.adaptive.DraftBreakEven`) is a property of the
machine, the model, the thread count and the KV type, not of a conversation: relearning it
in every reply means drafting on a guess for the first rounds of each, which is where short
replies lose. It is kept in one JSON file in the cache directory, keyed by those properties,
and written when a reply ends. A missing, unreadable or foreign file only means starting
from the prior, never an error.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import threading
from pathlib import Path

from ..core import paths

log = logging.getLogger(__name__)

MAX_KEYS = 64  # machines x models x settings one user plausibly has; oldest dropped first


def cost_key(model_path: Path, n_threads: int, kv_type: int) -> str:
    """Identifies a cost line: model file (name and size), threads, KV type, CPU."""
    try:
        size = model_path.stat().st_size
    except OSError:
        size = 0
    return f"{model_path.name}:{size}|t{n_threads}|kv{kv_type}|{_cpu_name()}|{os.cpu_count()}"


def _cpu_name() -> str:
    """The CPU model (Linux names it in /proc/cpuinfo; elsewhere platform's best guess)."""
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


class CostBook:
    """Cost-line samples per key, read once and written back on :meth:`save`."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or paths.cache_dir() / "draft-costs.json"
        self._lines: dict[str, dict[str, list[float]]] = {}
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
            if isinstance(data, dict):
                self._lines = {k: v for k, v in data.items() if isinstance(v, dict)}
        except (OSError, ValueError):
            pass  # first run, or a damaged file: start from the prior

    def get(self, key: str) -> dict[int, list[float]]:
        out: dict[int, list[float]] = {}
        for size, times in self._lines.get(key, {}).items():
            if size.isdigit() and isinstance(times, list):
                out[int(size)] = [float(t) for t in times if isinstance(t, (int, float))]
        return out

    def put(self, key: str, samples: dict[int, list[float]]) -> None:
        self._lines.pop(key, None)  # re-insert: dict order is recency
        self._lines[key] = {str(size): [round(t, 4) for t in times] for size, times in samples.items()}
        while len(self._lines) > MAX_KEYS:
            self._lines.pop(next(iter(self._lines)))

    def save(self) -> None:
        """Write atomically; a failure costs only the learning, never the reply. The temporary
        file is this writer's own: the chat app and serve on one machine save the same book."""
        tmp = self.path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            tmp.write_text(json.dumps(self._lines), encoding="utf-8")
            os.replace(tmp, self.path)
        except OSError as e:
            log.warning("could not save draft costs to %s: %s", self.path, e)


class SavedLine:
    """One strategy's cost line in the book: restored when built, kept when a reply ends."""

    def __init__(self, book: CostBook, key: str) -> None:
        self.book, self.key = book, key

    def restore(self) -> dict[int, list[float]]:
        return self.book.get(self.key)

    def keep(self, samples: dict[int, list[float]]) -> None:
        self.book.put(self.key, samples)
        self.book.save()


def saved_line(model_path: Path, n_threads: int, kv_type: int, where: str = "local") -> SavedLine:
    """The book entry for a target; ``where`` tells a local target from a cluster's."""
    return SavedLine(CostBook(), f"{cost_key(model_path, n_threads, kv_type)}|{where}")
