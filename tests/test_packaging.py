"""Packaging guards: what a pipx install ships must match the source tree."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOP = {"app": "potluck.app", "engine": "potluck.engine", "discovery": "potluck.discovery", "assets": "potluck.assets"}

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def test_every_source_package_is_listed_in_pyproject() -> None:
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = set()
    for folder, dotted in TOP.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((dotted, *rel)))
    assert found <= listed, f"add to [tool.setuptools] packages: {sorted(found - listed)}"


def test_engine_never_imports_app_or_textual() -> None:
    offenders = []
    for path in (ROOT / "engine").rglob("*.py"):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [("." * node.level) + (node.module or "")]
            for name in names:
                if re.match(r"^(textual|potluck\.app|\.\.app|\.\.\.app)\b", name):
                    offenders.append(f"{path.relative_to(ROOT)}: {name}")
    assert not offenders


def test_readme_commands_are_what_ci_runs() -> None:
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    blocks = re.findall(r"```bash\n(.*?)\n```", readme, flags=re.S)
    install, tests = blocks[0].strip(), blocks[1].strip()
    install_steps = install.split(" && ")[:-1]  # the last step starts the interactive chat
    for step in install_steps:
        assert step.split(" --force")[0] in ci.replace(" --force", ""), step
    assert tests in ci
