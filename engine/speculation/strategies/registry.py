"""Strategy names -> classes. Only implemented strategies appear here (and so in the CLI/UI)."""

from __future__ import annotations

from ...core.plain import Plain
from ...core.strategy import Strategy
from .auto import Auto
from .minions import Minions
from .pearl import Pearl
from .pipeinfer import PipeInfer
from .speculative import DraftModelSpeculative, NgramSpeculative
from .triforce import TriForce

STRATEGIES: dict[str, type[Strategy]] = {
    Plain.name: Plain,
    DraftModelSpeculative.name: DraftModelSpeculative,
    NgramSpeculative.name: NgramSpeculative,
    Pearl.name: Pearl,
    Minions.name: Minions,
    TriForce.name: TriForce,
    PipeInfer.name: PipeInfer,
    Auto.name: Auto,
}


def strategy_names() -> list[str]:
    return list(STRATEGIES)


# names a strategy had before (config.toml files and scripts may still say them)
FORMER_NAMES = {"autoregressive": Plain.name}


def get_strategy_class(name: str) -> type[Strategy]:
    from ...core.errors import PotluckError

    try:
        return STRATEGIES[FORMER_NAMES.get(name, name)]
    except KeyError:
        raise PotluckError(
            f"unknown strategy {name!r}; choose one of: {', '.join(STRATEGIES)}"
        ) from None
