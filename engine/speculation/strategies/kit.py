"""What the strategies share when they are built: option parsing, the draft model, the
saved verify-cost line and the draft-length options.

Each strategy module keeps its own method; this module keeps only what several of them
would otherwise write again (refusals name the option and its range in one line).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...core import validate as limits
from ...core.errors import PotluckError
from ..costs import SavedLine, saved_line

if TYPE_CHECKING:
    from ...core.runtime import Model
    from ...core.spec import EngineSpec


LENGTH_OPTIONS = {
    "max_draft": "the most tokens drafted in one round",
    "initial_draft": "tokens drafted in the first round (the length then adapts)",
    "adaptive": "adapt the draft length to measured costs (false: always max_draft)",
}


def int_option(spec: EngineSpec, key: str, default: int, lo: int, hi: int) -> int:
    """A whole-number strategy option in ``lo..hi`` (``default`` when not given)."""
    value = spec.strategy_options.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise PotluckError(f"strategy option {key} must be a whole number in {lo}..{hi}, got {value!r}")
    return value


def float_option(spec: EngineSpec, key: str, default: float, lo: float, hi: float) -> float:
    """A number strategy option in ``[lo, hi]`` (``default`` when not given)."""
    value = spec.strategy_options.get(key, default)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not lo <= value <= hi:
        raise PotluckError(f"strategy option {key} must be a number in [{lo:g}, {hi:g}], got {value!r}")
    return float(value)


def bool_option(spec: EngineSpec, key: str, default: bool) -> bool:
    """A true/false strategy option (``default`` when not given)."""
    value = spec.strategy_options.get(key, default)
    if not isinstance(value, bool):
        raise PotluckError(f"strategy option {key} must be true or false, got {value!r}")
    return value


def load_draft_model(target_model: Model, spec: EngineSpec) -> Model:
    """The draft GGUF, refused unless it shares the target's vocabulary and fits in memory."""
    from ...core.runtime import Model
    from ..drafters.draft_model import check_same_vocabulary

    if spec.draft is None:
        raise PotluckError(
            f"strategy {spec.strategy!r} needs a draft model: pass --draft PATH "
            "(a small GGUF with the target's vocabulary)"
        )
    draft_model = Model(spec.draft, use_extra_bufts=spec.use_extra_bufts)
    try:
        check_same_vocabulary(target_model, draft_model)
        limits.memory_fits(draft_model, spec.n_ctx)  # its own KV cache, next to the target's
    except BaseException:
        draft_model.close()
        raise
    return draft_model


def saved_costs(target_model: Model, spec: EngineSpec) -> SavedLine:
    """Where this target's verify-cost line is kept (engine/speculation/costs.py): per KV type too, since
    F16 and BF16 caches cost differently."""
    from ...core.load_watch import default_threads
    from ...core.spec import KV_TYPES

    where = "cluster:" + ",".join(spec.cluster.nodes) if spec.cluster else "local"
    threads = spec.n_threads or default_threads()
    kv_type, _ = KV_TYPES[limits.kv_cache(spec.kv_cache)]
    return saved_line(target_model.path, threads, kv_type, where)
