"""Process trees from Linux /proc, for the scripts that watch worker processes."""

from __future__ import annotations

import os
from pathlib import Path


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its live descendants (a worker and its llama.cpp child); [] once gone."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            children = [int(c) for task in Path(f"/proc/{p}/task").iterdir()
                        for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue
        out.append(p)
        todo += children
    return out


def thread_cpu_s(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) each live thread of ``pid`` has used, by thread id."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue  # ended meanwhile
        fields = stat[stat.rindex(")") + 2:].split()
        out[int(task.name)] = (int(fields[11]) + int(fields[12])) / tick
    return out
