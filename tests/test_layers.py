"""The engine's floors and the app's reach into it hold (import-linter, contracts in pyproject.toml).

import-linter finds packages on ``sys.path``; the test venv's editable install maps
``potluck.*`` through setuptools' import hook, which it cannot read. So the check runs over a
directory that lays the source out as the installed ``potluck`` package (links, no copies).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_hold(tmp_path: Path) -> None:
    package = tmp_path / "potluck"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for part in ("app", "engine", "discovery", "assets"):
        (package / part).symlink_to(ROOT / part, target_is_directory=True)
    lint = Path(sys.executable).with_name("lint-imports")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    done = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout and "5 kept" in done.stdout, done.stdout[-2000:]
