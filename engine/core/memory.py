"""Free memory as this process may really use it: the smaller of MemAvailable and what its
memory cgroups still allow.

MemAvailable ignores the memory limit of a container, a systemd service (``MemoryMax=``) or
any other cgroup a spare machine runs its services in; a stage sized by it is killed by the
kernel's OOM killer, not refused. So free memory is read at every level of the process's
memory cgroup up to the root of the mounted hierarchy: at each level ``limit - usage that
cannot be reclaimed``, where the reclaimable part is page cache that no process maps (file
pages less shmem and mapped files). Unmapped page cache stays out: a worker's received or
released slice is charged to its cgroup, yet the kernel drops it under pressure, and
counting it would make a worker report nothing free after its first load. Mapped file pages
count as used: they are the running processes' working set (the interpreter's and llama.cpp's
code where a worker is the first to load it, a loaded stage's weights), and reclaiming them
makes every token fault them back in.

Layouts read (``/proc/self/cgroup`` joined with ``/proc/self/mountinfo``):

- cgroup v2 (unified): ``0::/path``; files ``memory.max``, ``memory.high`` (systemd's
  ``MemoryHigh=``: reclaim is forced above it, so it bounds what is usable too),
  ``memory.current`` and ``memory.stat`` (``file``, ``shmem``, ``file_mapped``);
- cgroup v1: ``N:memory:/path``; files ``memory.limit_in_bytes``, ``memory.usage_in_bytes``
  and ``memory.stat`` (``total_cache``, ``total_shmem``, ``total_mapped_file``: hierarchical,
  as usage is);
- hybrid machines (v1 memory controller beside an empty unified hierarchy, so the ``0::/``
  line leads to no memory files): both are read and the smallest figure wins.

A container whose cgroup namespace shows ``/`` while its mount root is its own group is
handled by the mount root: a path outside the mount's root maps to the mount point itself.

Also here: :func:`advise_random_reads`, how a stage keeps its mapped slice from crowding
out its own working set under such a limit.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
_V1_UNLIMITED = 1 << 62  # v1 writes "no limit" as PAGE_COUNTER_MAX pages (~2**63 bytes)


@dataclass(frozen=True)
class CgroupLevel:
    """One memory cgroup on the way from the process's own group to the hierarchy's root."""

    path: Path
    limit_bytes: int
    used_bytes: int  # usage less reclaimable page cache

    @property
    def free_bytes(self) -> int:
        return max(0, self.limit_bytes - self.used_bytes)


@dataclass(frozen=True)
class MemoryReading:
    """Where the free figure comes from: MemAvailable and each limited cgroup level."""

    mem_available_bytes: int | None
    levels: tuple[CgroupLevel, ...]

    @property
    def cgroup_free_bytes(self) -> int | None:
        return min((lv.free_bytes for lv in self.levels), default=None)

    @property
    def free_bytes(self) -> int:
        found = [b for b in (self.mem_available_bytes, self.cgroup_free_bytes) if b is not None]
        return min(found) if found else 0

    @property
    def limit_bytes(self) -> int | None:
        """The tightest cgroup limit (None: no cgroup limits this process)."""
        return min((lv.limit_bytes for lv in self.levels), default=None)


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None


def _int(text: str | None) -> int | None:
    if text is None or text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _stat(path: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in (_read(path) or "").splitlines():
        key, _, value = line.partition(" ")
        v = _int(value.strip())
        if v is not None:
            out[key] = v
    return out


def meminfo_bytes(key: str, proc: Path = PROC) -> int | None:
    """A ``/proc/meminfo`` figure in bytes (``MemAvailable``, ``MemTotal``...)."""
    for line in (_read(proc / "meminfo") or "").splitlines():
        if line.startswith(key + ":"):
            try:
                return int(line.split()[1]) * 1024
            except (IndexError, ValueError):
                return None
    return None


def process_rss_bytes(pid: int, proc: Path = PROC) -> int:
    """A process's resident memory (``VmRSS``: anonymous and mapped file pages, which its
    cgroup counts as used), 0 where it is gone."""
    for line in (_read(proc / str(pid) / "status") or "").splitlines():
        if line.startswith("VmRSS:"):
            return (_int(line.split()[1]) or 0) * 1024
    return 0


@dataclass(frozen=True)
class _Mount:
    root: str  # the part of the hierarchy mounted here
    point: Path
    version: int  # 1 or 2


def _memory_mounts(proc: Path) -> list[_Mount]:
    """cgroup v1 mounts carrying the memory controller and cgroup v2 mounts."""
    mounts: list[_Mount] = []
    for line in (_read(proc / "self" / "mountinfo") or "").splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 3:
            continue
        root, point = fields[3], Path(fields[4].replace("\\040", " "))
        if tail[0] == "cgroup2":
            mounts.append(_Mount(root, point, 2))
        elif tail[0] == "cgroup" and "memory" in tail[2].split(","):
            mounts.append(_Mount(root, point, 1))
    return mounts


def _own_groups(proc: Path) -> dict[int, str]:
    """The process's group path per hierarchy version (v1: the memory controller's line)."""
    groups: dict[int, str] = {}
    for line in (_read(proc / "self" / "cgroup") or "").splitlines():
        hid, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hid == "0" and controllers == "":
            groups[2] = path
        elif "memory" in controllers.split(","):
            groups[1] = path
    return groups


def _group_dir(mount: _Mount, group: str) -> Path:
    root = mount.root.rstrip("/")
    if group == root or group.startswith(root + "/"):
        rel = group[len(root):].lstrip("/")
        return mount.point / rel if rel else mount.point
    return mount.point  # a cgroup namespace shows "/" for the group the mount's root is


def _level(d: Path, version: int) -> CgroupLevel | None:
    """The limit and unreclaimable usage of one group, or None where nothing limits it."""
    if version == 2:
        limits = [_int(_read(d / "memory.max")), _int(_read(d / "memory.high"))]
        usage = _int(_read(d / "memory.current"))
        stat = _stat(d / "memory.stat")
        cache = stat.get("file", 0) - stat.get("shmem", 0) - stat.get("file_mapped", 0)
    else:
        limits = [_int(_read(d / "memory.limit_in_bytes"))]
        usage = _int(_read(d / "memory.usage_in_bytes"))
        stat = _stat(d / "memory.stat")
        cache = (stat.get("total_cache", stat.get("cache", 0)) - stat.get("total_shmem", stat.get("shmem", 0))
                 - stat.get("total_mapped_file", stat.get("mapped_file", 0)))
    limit = min((v for v in limits if v is not None and v < _V1_UNLIMITED), default=None)
    if limit is None:
        return None
    used = max(0, (usage or 0) - max(0, cache))
    return CgroupLevel(d, limit, used)


def own_cgroup_dirs(proc: Path = PROC) -> list[tuple[int, Path]]:
    """(hierarchy version, directory) of this process's memory cgroup in each mounted hierarchy."""
    groups = _own_groups(proc)
    return [(m.version, _group_dir(m, groups[m.version])) for m in _memory_mounts(proc) if m.version in groups]


def cgroup_levels(proc: Path = PROC) -> tuple[CgroupLevel, ...]:
    """Every limited memory cgroup level over this process, own group first."""
    mounts = {(m.version, m.point) for m in _memory_mounts(proc)}
    levels: list[CgroupLevel] = []
    for version, d in own_cgroup_dirs(proc):
        top = next(point for v, point in mounts if v == version and (d == point or point in d.parents))
        while True:
            lv = _level(d, version)
            if lv is not None:
                levels.append(lv)
            if d == top:
                break
            d = d.parent
    return tuple(levels)


def read_memory(proc: Path = PROC) -> MemoryReading:
    return MemoryReading(meminfo_bytes("MemAvailable", proc), cgroup_levels(proc))


def free_memory_bytes(proc: Path = PROC) -> int:
    """Memory this process can still use, in bytes (see the module docstring)."""
    reading = read_memory(proc)
    if reading.mem_available_bytes is None and not reading.levels:
        try:  # no /proc (not Linux): what the C library knows
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return 0
    return reading.free_bytes


def free_memory_mb(proc: Path = PROC) -> int:
    return free_memory_bytes(proc) >> 20


def advise_random_reads(path: Path, proc: Path = PROC) -> int:
    """Tell the kernel that this process reads its mappings of ``path`` at random
    (``MADV_RANDOM``), so that a page fault there reads that page only; returns the bytes
    advised (0 where there is no /proc or no madvise).

    A pipeline stage's weights are mostly repacked into its own memory at load; what it still
    reads from its mapped slice every token is small and scattered: the norm weights (a page
    or so each, between the repacked matrices) and an embedding row. Under a memory cap those
    pages are evicted like any other, and with the default advice each refault read a whole
    read-around window (``read_ahead_kb``: 8 MB on this VM's disk; 16 MB a fault measured) of
    dead repacked data, which pushed out the next norm: a capped 8b stage read ~1 GB/s from
    disk, 30 faults a token, and decoded at a third of its speed (docs/facts.md §17). Advising
    only the embeddings and output did not help; the whole mapping did. Where the weights stay
    mapped (no repacking) they are read whole every token and stay resident if the plan fits,
    so the advice changes nothing there."""
    advice = getattr(mmap, "MADV_RANDOM", None)
    if advice is None:
        return 0
    try:
        maps = (proc / "self" / "maps").read_text()
        madvise = ctypes.CDLL(None).madvise
    except (OSError, AttributeError):
        return 0
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    target = str(Path(path).resolve())
    advised = 0
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)  # range perms offset dev inode path
        if len(fields) == 6 and fields[5] == target:
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if madvise(lo, hi - lo, advice) == 0:
                advised += hi - lo
    return advised
