"""Free memory honours cgroup limits (engine/core/memory.py): v1, v2 and hybrid layouts laid
out in a temporary directory, and a real v1 memory cgroup when the test runs as root."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from potluck.engine.core import memory

from .support.cgroups import v1_memory_group

MIB = 1 << 20
GIB = 1 << 30


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="ascii")


def _proc(tmp: Path, cgroup: str, mounts: list[str], available: int = 20 * GIB) -> Path:
    proc = tmp / "proc"
    _write(proc / "meminfo", f"MemTotal: {24 * GIB >> 10} kB\nMemAvailable: {available >> 10} kB\n")
    _write(proc / "self" / "cgroup", cgroup)
    _write(proc / "self" / "mountinfo", "".join(m + "\n" for m in mounts))
    return proc


def _v1_group(d: Path, limit: int, usage: int, cache: int, shmem: int = 0, mapped: int = 0) -> None:
    _write(d / "memory.limit_in_bytes", f"{limit}\n")
    _write(d / "memory.usage_in_bytes", f"{usage}\n")
    _write(d / "memory.stat", f"cache {cache}\nrss 1\nmapped_file {mapped}\ntotal_cache {cache}\n"
                              f"total_shmem {shmem}\ntotal_mapped_file {mapped}\n")


def _v2_group(d: Path, limit: str, usage: int, file: int, high: str = "max", shmem: int = 0,
              mapped: int = 0) -> None:
    _write(d / "memory.max", limit + "\n")
    _write(d / "memory.high", high + "\n")
    _write(d / "memory.current", f"{usage}\n")
    _write(d / "memory.stat", f"anon {usage - file}\nfile {file}\nfile_mapped {mapped}\nshmem {shmem}\n")


def test_v1_hybrid_nested_group_leaves_page_cache_out(tmp_path: Path) -> None:
    """This machine's layout: v1 memory controller, an empty unified hierarchy, ``0::/``."""
    mem = tmp_path / "sys" / "memory"
    unified = tmp_path / "sys" / "unified"
    unified.mkdir(parents=True)
    _write(unified / "cgroup.controllers", "\n")  # no memory controller there
    _v1_group(mem, memory._V1_UNLIMITED * 2, 10 * GIB, 2 * GIB)  # the root: unlimited
    _v1_group(mem / "svc", 4 * GIB, 3 * GIB, 2 * GIB + 768 * MIB, shmem=512 * MIB, mapped=256 * MIB)
    _v1_group(mem / "svc" / "worker", 8 * GIB, 2 * GIB, 1 * GIB)  # looser than its parent
    proc = _proc(tmp_path, "4:memory:/svc/worker\n1:cpu:/\n0::/\n", [
        f"35 31 0:32 / {mem} rw,relatime - cgroup cgroup rw,memory",
        f"32 31 0:29 / {tmp_path / 'sys' / 'cpu'} rw,relatime - cgroup cgroup rw,cpu",
        f"41 31 0:38 / {unified} rw,relatime - cgroup2 cgroup2 rw",
    ])
    r = memory.read_memory(proc)
    assert [lv.path for lv in r.levels] == [mem / "svc" / "worker", mem / "svc"]
    # svc: 4 GiB limit, 3 GiB used of which 2.75 GiB page cache, but 0.5 GiB is shmem and
    # 0.25 GiB is mapped by processes (code, a loaded stage's weights): neither is reclaimable
    assert r.levels[1].used_bytes == 3 * GIB - 2 * GIB
    assert r.levels[0].free_bytes == 8 * GIB - 1 * GIB
    assert r.free_bytes == 3 * GIB == memory.free_memory_bytes(proc)  # the parent binds
    assert r.limit_bytes == 4 * GIB


def test_v2_container_and_systemd_memory_high(tmp_path: Path) -> None:
    cg = tmp_path / "sys"
    _write(cg / "cgroup.controllers", "cpu memory io\n")  # the root has no memory.max
    _v2_group(cg / "system.slice", "max", 6 * GIB, 4 * GIB)
    _v2_group(cg / "system.slice" / "potluck.service", str(8 * GIB), 5 * GIB, 4 * GIB + 256 * MIB,
              high=str(2 * GIB), mapped=256 * MIB)
    proc = _proc(tmp_path, "0::/system.slice/potluck.service\n", [
        f"30 23 0:26 / {cg} rw,nosuid - cgroup2 cgroup2 rw,nsdelegate",
    ])
    r = memory.read_memory(proc)
    assert len(r.levels) == 1 and r.limit_bytes == 2 * GIB  # MemoryHigh= is tighter than MemoryMax=
    assert r.free_bytes == 2 * GIB - 1 * GIB


def test_v2_cgroup_namespace_maps_to_the_mount_root(tmp_path: Path) -> None:
    """Inside a container the group reads ``/`` and the mount's root is the container's group."""
    cg = tmp_path / "sys"
    _v2_group(cg, str(512 * MIB), 300 * MIB, 100 * MIB)
    proc = _proc(tmp_path, "0::/\n", [f"30 23 0:26 /docker/abc {cg} rw - cgroup2 cgroup2 rw"])
    assert memory.free_memory_bytes(proc) == 512 * MIB - 200 * MIB
    # the same mount seen from outside the namespace: the full path under the mount's root
    _v2_group(cg / "inner", str(64 * MIB), 10 * MIB, 0)
    proc = _proc(tmp_path, "0::/docker/abc/inner\n", [f"30 23 0:26 /docker/abc {cg} rw - cgroup2 cgroup2 rw"])
    assert memory.free_memory_bytes(proc) == 54 * MIB


def test_no_cgroup_limit_is_mem_available(tmp_path: Path) -> None:
    cg = tmp_path / "sys"
    _v2_group(cg / "user.slice", "max", 1 * GIB, 0)
    proc = _proc(tmp_path, "0::/user.slice\n", [f"30 23 0:26 / {cg} rw - cgroup2 cgroup2 rw"], available=5 * GIB)
    r = memory.read_memory(proc)
    assert r.levels == () and r.limit_bytes is None
    assert memory.free_memory_mb(proc) == 5 * GIB // MIB


def test_a_limit_above_mem_available_changes_nothing(tmp_path: Path) -> None:
    mem = tmp_path / "sys" / "memory"
    _v1_group(mem / "big", 64 * GIB, 1 * GIB, 0)
    proc = _proc(tmp_path, "4:memory:/big\n0::/\n", [f"35 31 0:32 / {mem} rw - cgroup cgroup rw,memory"],
                 available=3 * GIB)
    assert memory.free_memory_bytes(proc) == 3 * GIB


def test_real_v1_cgroup_caps_a_child_process() -> None:
    """A child moved into a fresh 300 MiB cgroup reads its limit, less its own memory."""
    with v1_memory_group("test", 300 * MIB) as d:
        code = (
            "from potluck.engine.core import memory as m; r = m.read_memory(); "
            "print(r.limit_bytes, r.levels[0].used_bytes, r.free_bytes, m.free_memory_bytes(), r.levels[0].path)"
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True,
                             preexec_fn=lambda: (d / "cgroup.procs").write_text(str(os.getpid())))
        limit, used, free, free_later, path = out.stdout.split()
        assert Path(path) == d and int(limit) == 300 * MIB
        assert 5 * MIB < int(used) < 250 * MIB  # the child interpreter's own pages
        assert int(free) == 300 * MIB - int(used)
        # a second reading: the child's usage may have grown meanwhile (by 256 kB seen once), never shrunk much
        assert 300 * MIB - int(used) - 16 * MIB < int(free_later) <= 300 * MIB - int(used) + MIB


def test_a_kept_stage_offers_what_its_process_holds() -> None:
    """A released stage still loaded is on offer to the next head at its process's resident
    memory where that is more than the planner's figure (a real stage holds more than planned)."""
    from types import SimpleNamespace

    from potluck.engine.cluster.stage_host import held_mb

    rss = memory.process_rss_bytes(os.getpid())
    status = Path(f"/proc/{os.getpid()}/status").read_text()
    listed = int(next(ln for ln in status.splitlines() if ln.startswith("VmRSS:")).split()[1]) * 1024
    assert rss > 0 and abs(rss - listed) < 64 << 20
    stage = SimpleNamespace(proc=SimpleNamespace(proc=SimpleNamespace(pid=os.getpid())))
    assert held_mb(stage, 1.0) >= rss / (1 << 20) - 64  # type: ignore[arg-type]
    assert held_mb(stage, 1e9) == 1e9  # type: ignore[arg-type]
    assert memory.process_rss_bytes(2 ** 22 + 7) == 0  # no such process
