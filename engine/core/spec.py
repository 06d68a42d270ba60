"""What a session is opened with: the user's settings as frozen values (no behaviour).

They live in the core floor because every floor reads them: strategies read their options
and draft, the cluster reads its nodes and keys, the loader reads everything.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .kv_state import GGML_TYPE_BF16, GGML_TYPE_F16


@dataclass(frozen=True)
class CurveKeys:
    """Z85-encoded CURVE key pairs shared by every member of one cluster."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes


# Cluster mode's defaults ([cluster] in config.toml, --discover-timeout, --join-timeout)
DISCOVER_TIMEOUT_S = 2.0  # how long --nodes auto browses zeroconf
JOIN_TIMEOUT_S = 5.0  # how long a worker has to accept us (CURVE and hello)


@dataclass(frozen=True)
class ClusterSpec:
    """Run the target on LAN workers (cluster mode); the draft and sampling stay on the head."""

    nodes: tuple[str, ...]  # host:port of each worker, in pipeline order
    keys: CurveKeys  # from the cluster token (potluck.discovery.auth.keys_from_token)
    split: tuple[int, ...] | None = None  # fixed layer boundaries; None: plan by memory and speed
    hidden_dtype: str = "f32"  # "f16" halves the bytes between stages (see the closing note)
    potluck_version: str = "0"
    on_plan: Callable[[Any], None] | None = field(default=None, compare=False)  # gets the SplitPlan
    progress: Callable[[str, int, int], None] | None = field(default=None, compare=False)
    skip_failed_joins: bool = False  # --nodes auto: a node that does not join is skipped, with a warning
    join_timeout_s: float = JOIN_TIMEOUT_S  # --join-timeout: slow or busy machines need longer
    strict_nodes: bool = False  # --strict-nodes: a listed node that does not join refuses the run (else skipped)


@dataclass(frozen=True)
class EngineSpec:
    model: Path | None = None  # None: the bundled default model
    strategy: str = "plain"
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


# --kv setting -> (KV cache type, threads for 1-token steps; 0: all of them)
KV_TYPES = {"bf16": (GGML_TYPE_BF16, 0), "f16": (GGML_TYPE_F16, 1)}


