"""Split planning: contiguous layer ranges so every node fits and the slowest stage is fastest.

A stage's time is estimated as its weight bytes divided by the node's measured speed score
(decode is bound by reading weights; docs/facts.md §6 says measure, so the score is
measured on each worker). A stage's memory (:func:`stage_bytes`, the same figure the worker
checks before it loads) is its slice's weights, its KV cache for ``n_ctx`` tokens, and
llama.cpp's compute and output buffers for ``n_batch`` rows, measured (docs/facts.md §15);
each node's free memory is what its worker reported at join (MemAvailable, or less under a
cgroup limit: core/memory.py). Dynamic programming over (nodes in order, layers) finds the
assignment minimizing the bottleneck; nodes may get no layers, and a split that fits
nowhere is refused before anything is sent.

The workers share every layer, ``[0, n_layer)``; the head computes the output layer (so the
last worker returns a hidden state, not a row of logits: head.py) behind layers of zeros that
only let llama.cpp load it (:func:`head_zeroed_layers`).

A range llama.cpp cannot load is never planned: a Gemma 3 slice without a sliding-window
layer aborts the loading process (docs/facts.md §5), so every Gemma 3 stage holds one. Such
rules are the architecture's, in ``core/archs.py``; so is how a layer counts in memory (every
expert of a mixture is resident) and in time (a token reads only the experts it is routed to).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from ..core import archs
from ..core.errors import PotluckError
from ..core.gguf_tools import STAGE_VOCAB, file_version
from ..core.rollback import ROLLBACK_STATES
from ..core.validate import N_BATCH

# llama.cpp's CPU compute buffer for one ubatch of n rows, measured from its own log
# ("CPU compute buffer size") over SmolLM2-135M and the 1b and wide fixtures, n_ctx 512-4096,
# n_batch 64 and 512 (docs/facts.md §15): the graph's peak is the output layer's logits,
# n * 4 * n_vocab bytes, plus 8-16.5 bytes per row and unit of width; 20 bounds them all.
COMPUTE_BYTES_PER_ROW_VOCAB = 4
COMPUTE_BYTES_PER_ROW_EMBD = 20
COMPUTE_MARGIN_BYTES = 16 << 20  # graph inputs (KQ mask, positions) and allocator rounding
# A worker's free figure is read when it joins; receiving its slice then costs it some memory
# (socket and hashing buffers): measured 20+ MB on an 8b stage of 2.2 GB, whose load was then
# refused by 20 MB. Plans keep this much of each worker's figure free.
HEADROOM_MB = 64
PAGE_BYTES = 4096  # what reading one embedding row maps
# A single step run as 2 rows against 1 row, 1 thread (docs/facts.md §37: SmolLM2 1.86x,
# gpt-oss-small 1.98x, qwen3moe-small 1.96x, the gpt-oss-20b shape at 4 layers 1.93x): the
# spare row's products are computed, and in a mixture routed to experts of its own.
TWO_ROW_STEP_COST = 1.93
# Weight bytes a decode step streams per second, per unit of speed (profile.measure_speed: GB/s
# through llama.cpp's Q4_0 matrix-vector product): a whole step also normalizes, attends and
# hands over, and llama.cpp's repacked kernels run the products. Fitted on the dense 1b shape,
# then the same for gpt-oss and the hybrid (docs/facts.md §33). It turns a stage's bytes into
# seconds, to add its link's time.
WEIGHT_BYTES_PER_S_PER_SPEED = 0.95e9


def usable_mb(node: NodeInfo) -> float:
    """What the plan may fill on ``node``: its reported free memory less :data:`HEADROOM_MB`."""
    return node.free_mb - HEADROOM_MB


@dataclass(frozen=True)
class LayerCosts:
    """Sizes of one GGUF's parts, read from its header (no weights loaded)."""

    arch: str
    layer_bytes: tuple[int, ...]  # [n_layer] weight bytes per layer
    embd_bytes: int  # token_embd (a first stage reads a row a token)
    kv_bytes_per_token: tuple[int, ...]  # [n_layer] f16 K and V of one token (0: a recurrent layer)
    n_vocab: int = 0  # tokens in the GGUF's own vocabulary (the head checks results against it)
    n_embd: int = 0
    swa: tuple[bool, ...] | None = None  # per layer: sliding-window (archs with a pattern only)
    # tokens a stage between the first and the last is sliced with (0: the whole vocabulary;
    # gguf_tools.middle_stage_vocab)
    middle_vocab: int = STAGE_VOCAB
    # why llama.cpp would not load layers [lo, hi) as a slice, beyond the sliding-window rule
    # (the architecture's, core/archs.py), or None
    slice_problem: Callable[[int, int], str | None] | None = None
    # [n_layer] weight bytes a token reads per layer: a mixture's token reads only the experts it
    # is routed to (None: every byte, as a dense model's)
    time_bytes: tuple[int, ...] | None = None
    # a mixture's routed experts per layer, how many a token is sent to, its shared experts
    experts: tuple[int, int, int] = (0, 0, 0)
    output_bytes: int = 0  # the output matrix (the token embeddings when tied): the head's every token
    # per layer, one sequence's recurrent state (0: an attention layer); None: no recurrent layers
    state_bytes: tuple[int, ...] | None = None
    # why the model cannot be split exactly at all (archs.unsplittable_reason), or None
    unsplittable: str | None = None
    # the layer a slice of [lo, hi) carries as zeros (a hybrid's of one kind: archs.Arch.filler),
    # or None, and each layer's bytes as such (gguf_tools.filler_bytes)
    filler: Callable[[int, int], int | None] | None = None
    filler_bytes: tuple[int, ...] = ()
    # each layer's bytes as the head's zeros (one routed expert: gguf_tools.layer_layout)
    head_layer_bytes: tuple[int, ...] = ()

    @property
    def n_layer(self) -> int:
        return len(self.layer_bytes)

    def zeroed_layer(self, lo: int, hi: int) -> int | None:
        """The layer a slice of [lo, hi) carries as zeros, or None."""
        return self.filler(lo, hi) if self.filler is not None else None

    @property
    def head_zeros_bytes(self) -> int:
        """What the head's slice holds in front of its output layer, all zeros: the bytes a
        token reads there (:func:`head_zeroed_layers`, and a hybrid's filler)."""
        lo, hi = head_zeroed_layers(self)
        filler = self.zeroed_layer(lo, hi)
        layers = [*range(lo, hi), *([] if filler is None else [filler])]
        return sum(self.head_layer_bytes[i] for i in layers) if self.head_layer_bytes else 0

    @functools.cached_property
    def prefix_bytes(self) -> list[int]:
        """[n_layer + 1] prefix sums: the planner asks for range sizes O(nodes * L^2) times."""
        return [0, *itertools.accumulate(self.layer_bytes)]

    @functools.cached_property
    def prefix_time_bytes(self) -> list[int]:
        """[n_layer + 1] prefix sums of :attr:`time_bytes`."""
        return [0, *itertools.accumulate(self.time_bytes)] if self.time_bytes is not None else self.prefix_bytes


@dataclass(frozen=True)
class NodeInfo:
    name: str  # node id
    address: str  # host:port
    free_mb: int
    speed: float
    rtt_ms: float = 0.0  # the head's link to it, measured at join (0: not measured)
    mbps: float = 0.0

    def hop_s(self, hop_bytes: int) -> float:
        """One token's hidden state reaching this node: half a round trip plus its bytes at
        the link's rate. A hop from the previous worker is timed as the head's link to this
        one: the head measures only its own links (on a LAN, the access links dominate)."""
        wire_s = hop_bytes * 8 / (self.mbps * 1e6) if self.mbps > 0 else 0.0
        return self.rtt_ms / 2e3 + wire_s


@dataclass(frozen=True)
class StageAssignment:
    node: NodeInfo
    lo: int  # first layer (inclusive)
    hi: int  # last layer (exclusive)
    mem_mb: float
    cost: float  # estimated seconds per token: its layers, and its link's hop(s) (:func:`_cost`)


@dataclass(frozen=True)
class SplitPlan:
    """Worker stages over every layer; the head computes the output norm and matrix."""

    stages: tuple[StageAssignment, ...]
    n_layer: int
    head: tuple[int, int]  # layers the head computes itself: none, (n_layer, n_layer)
    experts: tuple[int, int, int] = (0, 0, 0)  # LayerCosts.experts of the model planned
    head_cost: float = 0.0  # seconds a token on the head: the output layer and its zeros (0: unknown)
    # what a single step costs in 1-row steps: single steps run as 2 rows on some weight types
    # (core/batch_exact.py), which computes the spare row too (TWO_ROW_STEP_COST)
    step_cost: float = 1.0

    @property
    def predicted_tokens_per_s(self) -> float | None:
        """The planner's model of synchronous decoding: a token goes through every stage in turn
        (its layers and hop, :func:`_cost`), then the head's output layer, each step
        as many rows as exactness needs; None when the head's speed was not measured."""
        if self.head_cost <= 0:
            return None
        return 1.0 / ((sum(s.cost for s in self.stages) + self.head_cost) * self.step_cost)

    def experts_text(self) -> str:
        """"4 of 32 experts a token (all resident)", or "" for a dense model."""
        n_expert, n_used, n_shared = self.experts
        if not n_expert:
            return ""
        shared = f" + {n_shared} shared" if n_shared else ""
        return f"{n_used} of {n_expert} experts{shared} a token (all resident)"

    @property
    def bounds(self) -> list[int]:
        """Where each worker stage starts, then where the last one ends (``n_layer``)."""
        return [s.lo for s in self.stages] + [self.head[0]]

    def describe(self) -> list[str]:
        """Lines the CLI prints before loading."""
        worst = max(s.cost for s in self.stages) or 1.0
        experts = self.experts_text()
        lines = [f"split plan: {self.n_layer} layers over {len(self.stages)} stage(s) and the head"
                 + (f"; {experts}" if experts else "")]
        for i, s in enumerate(self.stages):
            link = f", link {s.node.rtt_ms:.2f} ms {s.node.mbps:,.0f} Mbit/s" if s.node.rtt_ms else ""
            lines.append(
                f"  stage {i + 1}: layers {s.lo:>3}-{s.hi:<3} on {s.node.name} ({s.node.address})  "
                f"~{s.mem_mb:,.0f} MB of {s.node.free_mb:,} MB free, speed {s.node.speed:g}{link}, "
                f"load {s.cost / worst:.0%} of the slowest"
            )
        lines.append("  head:    the output layer on this machine")
        if self.predicted_tokens_per_s is not None:
            rows = f", single steps as 2 rows (x{self.step_cost:g})" if self.step_cost != 1.0 else ""
            lines.append(f"  predicted: about {self.predicted_tokens_per_s:.1f} tokens/s decoding (synchronous, "
                         f"plain; weights read at each machine's measured speed, hops at their measured links{rows})")
        return lines


def layer_costs(path: Path) -> LayerCosts:
    """Per-layer weight bytes and the other sizes the planner needs, from the GGUF header
    (remembered per file version: a head re-plans and reconnects without re-reading it)."""
    return _layer_costs(*file_version(path))


def splittable_costs(path: Path) -> LayerCosts:
    """:func:`layer_costs`, or :class:`PotluckError` saying in one line why the model cannot be
    split."""
    costs = layer_costs(path)
    if costs.unsplittable is not None:
        raise PotluckError(f"cannot split {Path(path).name}: {costs.unsplittable}")
    return costs


@functools.lru_cache(maxsize=16)
def _layer_costs(path: Path, size: int, mtime_ns: int) -> LayerCosts:
    from ..core.gguf_tools import HEAD_EXPERTS, filler_bytes, middle_stage_vocab, open_reader

    r = open_reader(path)
    h = archs.read_header(r)
    memory, time = archs.layer_bytes(h)
    rules = archs.slice_rules(h)
    arch = archs.ARCHS.get(h.arch)
    filler = None
    if arch is not None and arch.filler is not None:  # asked O(nodes * L^2) times by the planner
        filler = functools.lru_cache(maxsize=None)(lambda lo, hi: arch.filler_layer(h, range(lo, hi)))
    return LayerCosts(
        h.arch, tuple(memory), h.tensor_bytes.get("token_embd.weight", 0), archs.kv_bytes_per_token(h),
        h.n_vocab, h.int_of("embedding_length"), rules.swa, middle_stage_vocab(r.tensors), rules.problem,
        tuple(time) if time != memory else None, archs.experts(h),
        h.tensor_bytes.get("output.weight", h.tensor_bytes.get("token_embd.weight", 0)),
        archs.recurrent_state_bytes(h), archs.unsplittable_reason(h),
        filler, filler_bytes(r.tensors, h.n_layer) if filler is not None else (),
        filler_bytes(r.tensors, h.n_layer, h.int_of("expert_count"), HEAD_EXPERTS),
    )


def slice_problem(costs: LayerCosts, lo: int, hi: int) -> str | None:
    """Why llama.cpp cannot load layers [lo, hi) as a slice (Gemma 3: a sliding-window layer
    is needed), or None."""
    return archs.SliceRules(costs.swa, costs.slice_problem).why_not(lo, hi)


def loadable(costs: LayerCosts, lo: int, hi: int) -> bool:
    """Whether llama.cpp can load layers [lo, hi) as a slice."""
    return slice_problem(costs, lo, hi) is None


def head_zeroed_layers(costs: LayerCosts) -> tuple[int, int]:
    """The layers the head's slice carries as zeros (gguf_tools.layer_layout ``head=True``):
    llama.cpp loads no model of 0 layers, so the output layer stands behind the last layer,
    or the fewest last layers that llama.cpp loads as a slice (Gemma 3 270M's last layer is
    global: 16-17, not 17 alone; a hybrid's last layer alone carries a zeroed recurrent one,
    archs.Arch.filler)."""
    n = costs.n_layer
    for t in range(1, n + 1):
        if loadable(costs, n - t, n):
            return n - t, n
    raise PotluckError(f"cannot split {costs.arch}: llama.cpp loads none of its last layers as a slice")


def _range_bytes(costs: LayerCosts, lo: int, hi: int) -> int:
    prefix = costs.prefix_bytes
    return prefix[hi] - prefix[lo]


def kv_cells(n_ctx: int, n_seq_max: int, kv_unified: bool) -> int:
    """KV cells a stage allocates: ``n_ctx`` per stream, a stream per sequence unless unified."""
    return n_ctx * (1 if kv_unified else max(1, n_seq_max))


def stage_runtime_bytes(n_vocab: int, n_embd: int, n_batch: int) -> int:
    """What a loaded stage allocates beyond weights and KV cache: the compute buffer, the
    output buffer (a capturing stage marks every row an output, so llama.cpp keeps a logits row
    for each) and the captured hidden states, all for ``n_batch`` rows."""
    compute = n_batch * (COMPUTE_BYTES_PER_ROW_VOCAB * n_vocab + COMPUTE_BYTES_PER_ROW_EMBD * n_embd)
    outputs = n_batch * (4 * n_vocab + 4 * n_embd)
    return compute + COMPUTE_MARGIN_BYTES + outputs


def stage_bytes(
    costs: LayerCosts, lo: int, hi: int, n_ctx: int, n_batch: int = N_BATCH, seq_cells: int | None = None
) -> int:
    """Memory a worker needs for layers ``[lo, hi)`` of ``costs``' model; ``n_ctx``: its KV
    cells (every stream), ``seq_cells``: one sequence's (default ``n_ctx``).

    Its layers' weights count once, whether llama.cpp repacks them into the stage's own memory
    or reads them from the mapped file every token. Of the embeddings it counts the rows a
    context can read (a page each, at most one per cell): a first stage maps them and reads a
    row a token, a stage after it holds stubs. The output matrix counts nothing: a stage never
    computes it (its capture stops the graph first; gguf_tools.layer_layout writes it as
    zeros). Planning the whole embeddings and output in besides made a 60 % cap of the 8b
    shape refuse; what had paged when they were left out was the kernel's read-around, which
    a stage now turns off (core.memory.advise_random_reads, docs/facts.md §17). A worker
    checking a load counts its slice as it is, so its figure is never above the plan's.

    While a prompt prefills, the stage also holds its F16 twin (a KV cache of one sequence and
    its own buffers) and, at the hand-over, sequence 0's state as bytes
    (core/staged_prefill.py): that is counted too, so a worker never runs short mid-prompt."""
    # A stage after the first is sliced without a vocabulary where the model allows it: its
    # logits buffers and embeddings are then tiny. A slice's own costs (a worker checking a
    # load) already say so: it is all of its layers.
    middle = 0 < lo
    n_vocab = costs.middle_vocab if middle and costs.middle_vocab else costs.n_vocab
    seq = n_ctx if seq_cells is None else min(seq_cells, n_ctx)
    row_bytes = costs.embd_bytes // max(costs.n_vocab, 1)
    embd_read = min(n_vocab, n_ctx) * max(row_bytes, PAGE_BYTES)
    weights = _range_bytes(costs, lo, hi) + embd_read
    zeroed = costs.zeroed_layer(lo, hi)
    if zeroed is not None:  # a layer of the kind the slice lacks, as zeros
        weights += costs.filler_bytes[zeroed]
    states = costs.state_bytes[lo:hi] if costs.state_bytes else ()
    # a recurrent layer keeps no cell per token but its state, with llama.cpp's snapshots and
    # the stage's checkpoints of it (core/rollback.py)
    kv_cell = sum(costs.kv_bytes_per_token[lo:hi])
    recurrent = sum(states) * ROLLBACK_STATES
    runtime = stage_runtime_bytes(n_vocab, costs.n_embd, n_batch)
    prefill_twin = 2 * kv_cell * seq + runtime
    return weights + kv_cell * n_ctx + recurrent + runtime + prefill_twin


def stage_mem_mb(
    costs: LayerCosts, lo: int, hi: int, n_ctx: int, n_batch: int = N_BATCH, seq_cells: int | None = None
) -> float:
    return stage_bytes(costs, lo, hi, n_ctx, n_batch, seq_cells) / (1 << 20)


def head_cost(costs: LayerCosts, head_speed: float) -> float:
    """Seconds a token spends on the head: the output matrix and the zeros in front of it
    (:attr:`LayerCosts.head_zeros_bytes`), read at its speed (0 when the speed is unknown)."""
    if head_speed <= 0:
        return 0.0
    return (costs.head_zeros_bytes + costs.output_bytes) / (head_speed * WEIGHT_BYTES_PER_S_PER_SPEED)


def whole_model_s(costs: LayerCosts, speed: float) -> float:
    """Seconds a token of the whole model takes on one machine of speed ``speed``, as the
    planner counts them (scripts/plan_vs_step.py checks this against measured steps)."""
    return (_time_bytes(costs, 0, costs.n_layer) + costs.output_bytes) / (speed * WEIGHT_BYTES_PER_S_PER_SPEED)


def _time_bytes(costs: LayerCosts, lo: int, hi: int) -> int:
    """Weight bytes a token's time counts for layers [lo, hi): a filler layer (zeros) computes
    about as long as the layer it stands for (a hybrid's: docs/facts.md §33), so it counts as
    that layer."""
    read = costs.prefix_time_bytes[hi] - costs.prefix_time_bytes[lo]
    zeroed = costs.zeroed_layer(lo, hi)
    if zeroed is not None:
        read += costs.prefix_time_bytes[zeroed + 1] - costs.prefix_time_bytes[zeroed]
    return read


def _cost(costs: LayerCosts, lo: int, hi: int, node: NodeInfo, hop_bytes: int, last: bool) -> float:
    """Seconds a token spends on this stage: the weights it reads (a mixture's routed experts
    only) at the node's speed (the output layer is the head's), and its hop in (and, for the
    last stage, back to the head)."""
    compute = _time_bytes(costs, lo, hi) / (max(node.speed, 1e-9) * WEIGHT_BYTES_PER_S_PER_SPEED)
    return compute + node.hop_s(hop_bytes) * (2 if last else 1)


def _assign(
    costs: LayerCosts, node: NodeInfo, lo: int, hi: int, n_ctx: int, n_batch: int, hop_bytes: int, last: bool,
    seq_cells: int | None = None,
) -> StageAssignment:
    mem = stage_mem_mb(costs, lo, hi, n_ctx, n_batch, seq_cells)
    return StageAssignment(node, lo, hi, mem, _cost(costs, lo, hi, node, hop_bytes, last))


def hop_bytes(costs: LayerCosts, hidden_dtype: str = "f32") -> int:
    """One token's hidden state on the wire between stages."""
    return (2 if hidden_dtype == "f16" else 4) * costs.n_embd


# A layer range the head has sliced before (its workers likely hold the slice) is planned as if
# this much faster than measured: speed scores move several percent between runs of the same
# machines, and a plan that followed them would send gigabytes again for nothing (a hybrid's
# second load went from 6.6 to 98.7 s that way: docs/facts.md §33).
KNOWN_RANGE_ADVANTAGE = 0.10


def plan_split(
    costs: LayerCosts, nodes: Sequence[NodeInfo], n_ctx: int, n_batch: int = N_BATCH, hidden_dtype: str = "f32",
    seq_cells: int | None = None, head_speed: float = 0.0, known: frozenset[tuple[int, int]] = frozenset(),
) -> SplitPlan:
    """The contiguous assignment (nodes in the given order) of the model's layers with the
    smallest bottleneck, a stage's hop included, so
    a worker behind a slow link gets fewer layers, or none. ``head_speed``: the head's speed
    score, for the plan's prediction of tokens/s; ``known``: layer ranges sliced before
    (:data:`KNOWN_RANGE_ADVANTAGE`)."""
    if not nodes:
        raise PotluckError("no workers to split the model over")
    hop = hop_bytes(costs, hidden_dtype)
    n = costs.n_layer
    inf = float("inf")
    # best[k][j]: smallest bottleneck covering layers [0, j) with the first k nodes.
    best = [[inf] * (n + 1) for _ in range(len(nodes) + 1)]
    cut = [[-1] * (n + 1) for _ in range(len(nodes) + 1)]
    best[0][0] = 0.0
    for k, node in enumerate(nodes, start=1):
        for j in range(n + 1):
            best[k][j], cut[k][j] = best[k - 1][j], j  # this node takes no layers
            for i in range(j):
                if best[k - 1][i] == inf or not loadable(costs, i, j):
                    continue
                if stage_mem_mb(costs, i, j, n_ctx, n_batch, seq_cells) > usable_mb(node):
                    continue
                cost = _cost(costs, i, j, node, hop, j == n) * (1 - KNOWN_RANGE_ADVANTAGE * ((i, j) in known))
                v = max(best[k - 1][i], cost)
                if v < best[k][j]:
                    best[k][j], cut[k][j] = v, i
    if best[len(nodes)][n] == inf:
        one = min(stage_mem_mb(costs, i, i + 1, n_ctx, n_batch, seq_cells) for i in range(n))
        raise PotluckError(
            f"the model does not fit: its {n} worker layers need about "
            f"{stage_mem_mb(costs, 0, n, n_ctx, n_batch, seq_cells):,.0f} MB on one worker and at least "
            f"{one:,.0f} MB on each (n_ctx {n_ctx}), and the {len(nodes)} worker(s) have "
            f"{', '.join(f'{nd.free_mb:,}' for nd in nodes)} MB free; add workers or lower --ctx"
        )
    stages: list[StageAssignment] = []
    j = n
    for k in range(len(nodes), 0, -1):
        i = cut[k][j]
        if i < j:
            stages.append(_assign(costs, nodes[k - 1], i, j, n_ctx, n_batch, hop, j == n, seq_cells))
        j = i
    return SplitPlan(tuple(reversed(stages)), n, (n, n), costs.experts, head_cost(costs, head_speed))


def manual_plan(
    costs: LayerCosts, nodes: Sequence[NodeInfo], bounds: Sequence[int], n_ctx: int, n_batch: int = N_BATCH,
    hidden_dtype: str = "f32", seq_cells: int | None = None, head_speed: float = 0.0,
) -> SplitPlan:
    """Fixed layer boundaries, e.g. ``[0, 9, 18]``: stage i runs [bounds[i], bounds[i+1]).

    The last stage ends at ``n_layer``: a last boundary of ``n_layer`` may be left out."""
    end = costs.n_layer
    b = list(bounds)
    if b and b[0] != 0:
        b = [0, *b]
    if b[-1] < end:
        b = [*b, end]
    if any(lo >= hi for lo, hi in zip(b, b[1:])) or b[-1] != end:
        raise PotluckError(f"split {list(bounds)}: stages must start at increasing layers below {end}")
    for lo, hi in zip(b, b[1:]):
        why = slice_problem(costs, lo, hi)
        if why is not None:
            raise PotluckError(f"split {b}: layers {lo}-{hi} {why} for {costs.arch}; move the boundary")
    if len(b) - 1 != len(nodes):
        raise PotluckError(f"split {b} makes {len(b) - 1} stages but {len(nodes)} worker(s) are given")
    hop = hop_bytes(costs, hidden_dtype)
    stages = tuple(
        _assign(costs, nd, lo, hi, n_ctx, n_batch, hop, hi == end, seq_cells) for nd, lo, hi in zip(nodes, b, b[1:])
    )
    for s in stages:
        if s.mem_mb > usable_mb(s.node):
            raise PotluckError(
                f"split {b}: layers {s.lo}-{s.hi} need about {s.mem_mb:,.0f} MB (n_ctx {n_ctx}) but "
                f"{s.node.name} ({s.node.address}) has {s.node.free_mb:,} MB free; move the boundary, "
                "add workers or lower --ctx"
            )
    return SplitPlan(stages, end, (end, end), costs.experts, head_cost(costs, head_speed))


def step_cost(model_path: Path, costs: LayerCosts) -> float:
    """What a single step costs in 1-row steps: :data:`TWO_ROW_STEP_COST` where the model's
    weights need single steps run as 2 rows. The stages judge their own slices when they load;
    for the prediction this CPU judges the whole file."""
    from ..core.backend import default_extra_bufts
    from ..core.batch_exact import model_exactness

    recurrent = costs.state_bytes is not None
    exact = model_exactness(model_path, use_extra_bufts=default_extra_bufts(), recurrent=recurrent)
    return TWO_ROW_STEP_COST if exact.two_row_steps else 1.0


def with_step_cost(plan: SplitPlan, model_path: Path, costs: LayerCosts) -> SplitPlan:
    """``plan`` predicting single steps at :func:`step_cost`."""
    return replace(plan, step_cost=step_cost(model_path, costs))


def preview_plan(
    model_path: Path, nodes: Sequence[tuple[str, str, int, float]], n_ctx: int, n_batch: int = N_BATCH,
    head_speed: float = 0.0,
) -> SplitPlan:
    """The plan ``--nodes auto`` would make for ``model_path`` over ``nodes`` (name, address,
    free MB, speed score as they advertise them), before joining any: links are not timed yet.
    Raises :class:`PotluckError` in one line when the model cannot be split or does not fit."""
    costs = splittable_costs(model_path)
    infos = [NodeInfo(name, address, free_mb, speed) for name, address, free_mb, speed in nodes]
    return with_step_cost(plan_split(costs, infos, n_ctx, n_batch, head_speed=head_speed), Path(model_path), costs)
