"""What the default run leaves to ``-m slow``.

The default run proves each path once (every strategy exact, every sampling setting kept, every
fault handled); the breadth around it (the same path with more settings, stages or prompts) runs
with ``-m slow``, so the suite stays within its budget on two cores (README).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import pytest


def beyond(values: Iterable[Any], keep: Sequence[Any]) -> list[Any]:
    """``values`` as parameters, those not in ``keep`` marked slow."""
    return [v if v in keep else pytest.param(*(v if isinstance(v, tuple) else (v,)), marks=pytest.mark.slow)
            for v in values]

