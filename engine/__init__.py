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

from importlib import import_module
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what each name is, for readers and type checkers; loaded on first use below
    from .cluster.plan import preview_plan
    from .cluster.profile import measure_profile
    from .cluster.worker import DEFAULT_CACHE_QUOTA_MB, KEEP_STAGE_S, Worker
    from .core import paths, validate
    from .core.backend import check_gguf_file
    from .core.chat import Message, TextStream, ToolCall
    from .core.errors import ContextFullError, DecodeError, GrammarError, ModelError, PotluckError
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
    from .core.grammar import GrammarSpec, check_schema, json_object_spec, json_schema_spec
    from .core.grammar import check as check_grammar
    from .core.harmony import HarmonyScanner, RenderedReader, harmony_bytes, is_harmony
    from .core.lanes import Lanes
    from .core.load_watch import default_threads
    from .core.printable import PrintableFormatter, printable
    from .core.prompt import Prompt
    from .core.prompt_cache import PromptCache, PromptCacheStats
    from .core.reasoning import ThinkSplitter, opens_thinking, split_thinking, thinks
    from .core.runtime import Model
    from .core.sampling import SamplingParams
    from .core.session import Session
    from .core.spec import DISCOVER_TIMEOUT_S, JOIN_TIMEOUT_S, ClusterSpec, CurveKeys, EngineSpec
    from .core.tools import CallPart, CallScanner, Tool, call_grammar, tool_format
    from .loader import checked_spec, open_lanes, open_session, resolve_model, strategy_fits
    from .loader import describe_model as describe_gguf
    from .speculation.strategies.registry import STRATEGIES, get_strategy_class, strategy_names

    PLAIN: str

# Where each public name lives ("module:attribute", or a module). Nothing is imported with the
# package: a worker's stage process needs only core, and loading every strategy with it (numba,
# the registry) cost each stage process about a second of CPU at start.
_WHERE = {
    "measure_profile": ".cluster.profile:measure_profile",
    "preview_plan": ".cluster.plan:preview_plan",
    "DEFAULT_CACHE_QUOTA_MB": ".cluster.worker:DEFAULT_CACHE_QUOTA_MB",
    "KEEP_STAGE_S": ".cluster.worker:KEEP_STAGE_S",
    "Worker": ".cluster.worker:Worker",
    "paths": ".core.paths",
    "validate": ".core.validate",
    "check_gguf_file": ".core.backend:check_gguf_file",
    "default_threads": ".core.load_watch:default_threads",
    "printable": ".core.printable:printable",
    "PrintableFormatter": ".core.printable:PrintableFormatter",
    "Message": ".core.chat:Message",
    "ToolCall": ".core.chat:ToolCall",
    "Tool": ".core.tools:Tool",
    "ThinkSplitter": ".core.reasoning:ThinkSplitter",
    "TextStream": ".core.chat:TextStream",
    "HarmonyScanner": ".core.harmony:HarmonyScanner",
    "RenderedReader": ".core.harmony:RenderedReader",
    "is_harmony": ".core.harmony:is_harmony",
    "harmony_bytes": ".core.harmony:harmony_bytes",
    "thinks": ".core.reasoning:thinks",
    "opens_thinking": ".core.reasoning:opens_thinking",
    "split_thinking": ".core.reasoning:split_thinking",
    "CallPart": ".core.tools:CallPart",
    "CallScanner": ".core.tools:CallScanner",
    "call_grammar": ".core.tools:call_grammar",
    "tool_format": ".core.tools:tool_format",
    "ContextFullError": ".core.errors:ContextFullError",
    "GrammarError": ".core.errors:GrammarError",
    "GrammarSpec": ".core.grammar:GrammarSpec",
    "check_grammar": ".core.grammar:check",
    "check_schema": ".core.grammar:check_schema",
    "json_object_spec": ".core.grammar:json_object_spec",
    "json_schema_spec": ".core.grammar:json_schema_spec",
    "DecodeError": ".core.errors:DecodeError",
    "ModelError": ".core.errors:ModelError",
    "PotluckError": ".core.errors:PotluckError",
    "ClusterView": ".core.events:ClusterView",
    "DrafterStanding": ".core.events:DrafterStanding",
    "Event": ".core.events:Event",
    "Finished": ".core.events:Finished",
    "NodeStatus": ".core.events:NodeStatus",
    "PlanChanged": ".core.events:PlanChanged",
    "ReplyStarted": ".core.events:ReplyStarted",
    "RoundStats": ".core.events:RoundStats",
    "StageView": ".core.events:StageView",
    "TokenText": ".core.events:TokenText",
    "describe_gguf": ".loader:describe_model",
    "Lanes": ".core.lanes:Lanes",
    "Prompt": ".core.prompt:Prompt",
    "PromptCache": ".core.prompt_cache:PromptCache",
    "PromptCacheStats": ".core.prompt_cache:PromptCacheStats",
    "Model": ".core.runtime:Model",
    "SamplingParams": ".core.sampling:SamplingParams",
    "Session": ".core.session:Session",
    "ClusterSpec": ".core.spec:ClusterSpec",
    "JOIN_TIMEOUT_S": ".core.spec:JOIN_TIMEOUT_S",
    "DISCOVER_TIMEOUT_S": ".core.spec:DISCOVER_TIMEOUT_S",
    "CurveKeys": ".core.spec:CurveKeys",
    "EngineSpec": ".core.spec:EngineSpec",
    "checked_spec": ".loader:checked_spec",
    "open_session": ".loader:open_session",
    "open_lanes": ".loader:open_lanes",
    "resolve_model": ".loader:resolve_model",
    "strategy_fits": ".loader:strategy_fits",
    "STRATEGIES": ".speculation.strategies.registry:STRATEGIES",
    "get_strategy_class": ".speculation.strategies.registry:get_strategy_class",
    "strategy_names": ".speculation.strategies.registry:strategy_names",
    "PLAIN": ".core.plain:Plain.name",  # the strategy name of plain decoding (no drafts)
}


def __getattr__(name: str) -> object:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, _, attribute = where.partition(":")
    value: object = import_module(module, __name__)
    for part in attribute.split(".") if attribute else ():
        value = getattr(value, part)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_WHERE])


__all__ = [
    "DEFAULT_CACHE_QUOTA_MB",
    "DISCOVER_TIMEOUT_S",
    "JOIN_TIMEOUT_S",
    "KEEP_STAGE_S",
    "PLAIN",
    "STRATEGIES",
    "CallPart",
    "CallScanner",
    "ClusterSpec",
    "ClusterView",
    "ContextFullError",
    "CurveKeys",
    "DecodeError",
    "DrafterStanding",
    "EngineSpec",
    "Event",
    "Finished",
    "GrammarError",
    "GrammarSpec",
    "Lanes",
    "Message",
    "Model",
    "ModelError",
    "NodeStatus",
    "PlanChanged",
    "PotluckError",
    "PrintableFormatter",
    "Prompt",
    "PromptCache",
    "PromptCacheStats",
    "ReplyStarted",
    "RoundStats",
    "SamplingParams",
    "Session",
    "StageView",
    "ThinkSplitter",
    "TextStream",
    "HarmonyScanner",
    "RenderedReader",
    "is_harmony",
    "harmony_bytes",
    "TokenText",
    "Tool",
    "ToolCall",
    "Worker",
    "check_gguf_file",
    "check_grammar",
    "check_schema",
    "call_grammar",
    "checked_spec",
    "default_threads",
    "describe_gguf",
    "get_strategy_class",
    "json_object_spec",
    "json_schema_spec",
    "measure_profile",
    "open_lanes",
    "open_session",
    "paths",
    "preview_plan",
    "printable",
    "resolve_model",
    "split_thinking",
    "strategy_fits",
    "strategy_names",
    "thinks",
    "opens_thinking",
    "tool_format",
    "validate",
]
