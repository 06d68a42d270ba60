"""Every random-weight model shape by name, behind one builder: the transformer and mixture
shapes (:mod:`.fixtures`) and Qwen3.5's hybrid (:mod:`.hybrid_shapes`), for the CLI and the
benchmark scripts, which take any of them."""

from __future__ import annotations

from pathlib import Path

from ..core.errors import ModelError
from .fixtures import SHAPES, build_shape
from .hybrid_shapes import HYBRID_SHAPES, build_hybrid_shape

SHAPE_NAMES: tuple[str, ...] = (*SHAPES, *HYBRID_SHAPES)


def build_named_shape(name: str, seed: int = 0, *, layers: int | None = None) -> Path:
    """The GGUF of shape ``name`` (built once per seed and depth), ``layers`` trunk layers if given."""
    if name in HYBRID_SHAPES:
        return build_hybrid_shape(name, seed, layers=layers)
    if name in SHAPES:
        return build_shape(name, seed, layers=layers)
    raise ModelError(f"unknown shape {name!r}; pick one of {', '.join(SHAPE_NAMES)}")
