"""potluck's inference engine: usable and testable without the app (it never imports it).

This module is the engine's public surface: the app imports from here (and its commands from
``potluck.engine.lab``), never from the floors below. Build a :class:`Session` with
:func:`open_session` from an :class:`EngineSpec`, call ``session.generate(text, sampling,
max_tokens)`` and render the events it yields (every event carries its reply's ``run_id``);
``session.cancel()`` stops a reply and ``session.cluster_view()`` shows the chain.

The floors, each importing only those below it (``.importlinter`` checks it in CI):

- ``lab``: benchmarks, the simulator, fixtures and baselines; only app commands import it;
- ``loader``: assembles a session from the floors below;
- ``speculation`` | ``cluster``: strategies, drafters, kernels and acceptance rules | the
  pipeline across machines (wire, transport, worker, head, planning, transfer); neither
  imports the other;
- ``core``: llama.cpp (the only importer of llama_cpp), stages, targets, sessions, sampling,
  events, errors, validation, paths.
"""

from .cluster.profile import measure_profile
from .cluster.worker import DEFAULT_CACHE_QUOTA_MB, Worker
from .core import paths, validate
from .core.backend import check_gguf_file, default_threads
from .core.chat import Message
from .core.errors import ContextFullError, DecodeError, ModelError, PotluckError
from .core.events import (
    ClusterView,
    DrafterStanding,
    Event,
    Finished,
    NodeStatus,
    PlanChanged,
    ReplyStarted,
    RoundStats,
    StageView,
    TokenText,
)
from .core.gguf_tools import describe as describe_gguf
from .core.plain import Plain
from .core.prompt_cache import PromptCache, PromptCacheStats
from .core.runtime import Model
from .core.sampling import SamplingParams
from .core.session import Session
from .core.spec import ClusterSpec, CurveKeys, EngineSpec
from .loader import checked_spec, open_session, resolve_model, strategy_fits
from .speculation.strategies.registry import STRATEGIES, get_strategy_class, strategy_names

PLAIN = Plain.name
"""The strategy name of plain decoding (no drafts)."""

__all__ = [
    "DEFAULT_CACHE_QUOTA_MB",
    "PLAIN",
    "STRATEGIES",
    "ClusterSpec",
    "ClusterView",
    "ContextFullError",
    "CurveKeys",
    "DecodeError",
    "DrafterStanding",
    "EngineSpec",
    "Event",
    "Finished",
    "Message",
    "Model",
    "ModelError",
    "NodeStatus",
    "PlanChanged",
    "PotluckError",
    "PromptCache",
    "PromptCacheStats",
    "ReplyStarted",
    "RoundStats",
    "SamplingParams",
    "Session",
    "StageView",
    "TokenText",
    "Worker",
    "check_gguf_file",
    "checked_spec",
    "default_threads",
    "describe_gguf",
    "get_strategy_class",
    "measure_profile",
    "open_session",
    "paths",
    "resolve_model",
    "strategy_fits",
    "strategy_names",
    "validate",
]
