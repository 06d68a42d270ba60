"""A fresh cgroup v1 memory group for the tests that need a real limit (root only)."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from potluck.engine.core import memory


@contextlib.contextmanager
def v1_memory_group(name: str, limit_bytes: int) -> Iterator[Path]:
    """A group of ``limit_bytes`` under this process's own memory cgroup, removed afterwards
    (skips the test without root or a writable v1 memory controller). Move a child in with
    ``preexec_fn=lambda: (group / "cgroup.procs").write_text(str(os.getpid()))``."""
    parent = next((d for version, d in memory.own_cgroup_dirs() if version == 1), None)
    if os.geteuid() != 0 or parent is None or not os.access(parent, os.W_OK):
        pytest.skip("needs root and a writable cgroup v1 memory controller")
    d = parent / f"potluck-{name}-{os.getpid()}"
    d.mkdir()
    try:
        (d / "memory.limit_in_bytes").write_text(str(limit_bytes))
        yield d
    finally:
        for _ in range(100):  # processes leave the group a moment after they exit
            try:
                d.rmdir()
                break
            except OSError:
                time.sleep(0.1)
