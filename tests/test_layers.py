"""The engine's floors and the app's reach into it hold (import-linter, contracts in pyproject.toml)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_hold() -> None:
    lint = Path(sys.executable).with_name("lint-imports")
    done = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout and "7 kept" in done.stdout, done.stdout[-2000:]


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


def _sources(*folders: str) -> list[Path]:
    """The Python files under ``folders`` (each must hold some: an empty scan proves nothing)."""
    found = {folder: sorted((ROOT / folder).rglob("*.py")) for folder in folders}
    assert all(found.values()), {f: len(p) for f, p in found.items()}
    return [path for paths in found.values() for path in paths]


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module, imported names) for every import in ``path``, inside functions too."""
    out: list[tuple[str, list[str]]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            out.append(("." * node.level + (node.module or ""), [alias.name for alias in node.names]))
    return out


def test_scripts_and_tests_share_code_only_through_the_package() -> None:
    """scripts/ imports nothing from tests/ and no test imports a script: code both need
    (fake workers, the LAN attacker, message builders) lives in the package."""
    crossings = [
        f"{path.relative_to(ROOT)}: {module}"
        for folder, other in (("scripts", "tests"), ("tests", "scripts"))
        for path in _sources(folder)
        for module, _ in _imports(path)
        if module.split(".")[0] == other
    ]
    assert not crossings, crossings


def test_no_module_imports_another_modules_private_names() -> None:
    """A name that starts with one underscore belongs to its module: what two modules share is
    public (``__future__`` and dunder names aside)."""
    found = [
        f"{path.relative_to(ROOT)}: {module}.{name}"
        for path in _sources("app", "engine", "discovery", "assets")
        for module, names in _imports(path)
        for name in names
        if name.startswith("_") and not name.startswith("__")
    ]
    assert not found, found
