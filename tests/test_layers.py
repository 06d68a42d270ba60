"""The engine's floors and the app's reach into it hold (import-linter, contracts in pyproject.toml)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_hold() -> None:
    lint = Path(sys.executable).with_name("lint-imports")
    done = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout and "6 kept" in done.stdout, done.stdout[-2000:]


def test_the_engine_facade_loads_each_name_on_first_use() -> None:
    """``import potluck.engine`` loads no floor (a worker's stage process needs only core), and
    every public name still resolves to the object of the module the facade names for it."""
    code = (
        "import sys, potluck.engine as e\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('potluck.engine.'))\n"
        "assert loaded == [], loaded\n"
        "from potluck.engine.core.errors import PotluckError\n"
        "from potluck.engine.loader import open_session\n"
        "assert e.PotluckError is PotluckError and e.open_session is open_session\n"
        "missing = [n for n in e.__all__ if getattr(e, n, None) is None]\n"
        "assert not missing, missing\n"
        "assert set(e.__all__) <= set(dir(e))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
