"""How many of this machine's cores other processes leave free, so a stage computes on those.

llama.cpp's CPU threads meet at a barrier after every op, so one thread that another process
keeps off its core stalls them all: on this 2-core machine, with one core spun by another
process, 2 threads decoded 35-39 tok/s against 120-131 idle (docs/facts.md §6), worse than
one thread on the core left free. A stage whose thread count was not chosen by the user
(``ContextParams.follow_load``) therefore runs on the cores the others leave it.

Outside load is the machine's busy time over the cores this process may use (/proc/stat,
steal included: another VM on the same host) minus this process's own (/proc/self/stat, every
thread of ours). The chat app's UI thread, a drafter or the socket thread are ours and never
count as outside load; another potluck process (a worker beside its head) does.

:class:`ThreadFollower` applies it to one llama.cpp context: a stage runner's, or a draft
model's (which runs beside the target in the same process).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

log = logging.getLogger(__name__)

PROC = Path("/proc")
INTERVAL_S = 1.0  # how often a running stage looks again: two reads of /proc, ~50 µs
TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01
# /proc/stat's cpu columns: user nice system idle iowait irq softirq steal (guest time is
# already inside user and nice). Busy: all but idle and iowait.
_BUSY_COLUMNS = (0, 1, 2, 5, 6, 7)


@dataclass(frozen=True)
class CpuTimes:
    machine_busy_s: float  # busy time summed over the cores we may use
    own_s: float  # this process's CPU time, every thread


def usable_cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def default_threads() -> int:
    """Threads when none were chosen: one a core this process may use."""
    return max(1, len(usable_cpus()))


def read_times(cpus: list[int], proc: Path = PROC) -> CpuTimes | None:
    """Now's counters; None where /proc does not have them (not Linux)."""
    try:
        stat = (proc / "stat").read_text()
        own = (proc / "self" / "stat").read_text()
    except OSError:
        return None
    wanted = {f"cpu{i}" for i in cpus}
    busy = 0
    for line in stat.splitlines():
        name, _, rest = line.partition(" ")
        if name in wanted:
            cols = rest.split()
            busy += sum(int(cols[i]) for i in _BUSY_COLUMNS if i < len(cols))
    # the fields after the command name (which may hold spaces): utime and stime are 14 and 15
    fields = own.rpartition(")")[2].split()
    return CpuTimes(busy * TICK_S, (int(fields[11]) + int(fields[12])) * TICK_S)


def threads_for(wanted: int, free_cores: float) -> int:
    """Threads on the cores left free: a core counts when three quarters of it are free (a
    thread that waits for its core a quarter of the time holds every other one at each barrier)."""
    return max(1, int(min(free_cores, wanted) + 0.25))  # never more than wanted; inf: no figure yet


class LoadWatch:
    """Free cores over the last ``interval_s``, looked at only when that much time passed."""

    def __init__(
        self, interval_s: float = INTERVAL_S, proc: Path = PROC, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.interval_s = interval_s
        self.proc = proc
        self.clock = clock
        self.cpus = usable_cpus()
        self._last = read_times(self.cpus, proc)
        self._at = clock()

    def free_cores(self) -> float | None:
        """Cores other processes left free since the last figure; None until ``interval_s``
        passed (or without /proc)."""
        at = self.clock()
        if self._last is None or at - self._at < self.interval_s:
            return None
        now = read_times(self.cpus, self.proc)
        if now is None:
            return None
        outside = (now.machine_busy_s - self._last.machine_busy_s) - (now.own_s - self._last.own_s)
        elapsed = at - self._at
        self._last, self._at = now, at
        return len(self.cpus) - min(len(self.cpus), max(0.0, outside / elapsed))


class ThreadedContext(Protocol):
    def threads(self) -> tuple[int, int]: ...

    def set_threads(self, n_threads: int) -> None: ...


class ThreadFollower:
    """The threads one context runs on: those wanted and, when it follows the load, no more
    than the cores other processes leave free (a fresh figure at most once an interval)."""

    def __init__(self, ctx: ThreadedContext, follow: bool, interval_s: float = INTERVAL_S, name: str = "") -> None:
        self.ctx = ctx
        self.name = name
        self.wanted = self.threads = ctx.threads()[1]
        self.watch = LoadWatch(interval_s) if follow else None
        self.free_cores = float("inf")
        self.changes = 0  # times outside load (or a new wanted count) changed the threads in use

    def refresh(self) -> None:
        """Before a run: follow the load if a fresh figure is due."""
        if self.watch is not None:
            free = self.watch.free_cores()
            if free is not None:
                self.free_cores = free
                self.use(self.wanted)

    def use(self, wanted: int) -> None:
        """Run on ``wanted`` threads from now on, within the cores left free."""
        self.wanted = wanted
        n = threads_for(wanted, self.free_cores)
        if n != self.threads:
            self.ctx.set_threads(n)
            self.threads = n
            self.changes += 1
            if self.watch is not None:
                log.info("%s: %d thread(s); other processes leave %.1f core(s) free", self.name, n, self.free_cores)
