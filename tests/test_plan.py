"""Split planning: every stage fits its node, the bottleneck is minimal, errors are clear."""

from __future__ import annotations

from pathlib import Path

import pytest

from potluck.engine.cluster.plan import LayerCosts, NodeInfo, head_zeroed_layers, layer_costs, manual_plan, plan_split
from potluck.engine.core.errors import PotluckError

MB = 1 << 20


def costs(n: int = 30, layer_mb: float = 10) -> LayerCosts:
    return LayerCosts("llama", tuple([int(layer_mb * MB)] * n), 20 * MB, (0,) * n)


def node(name: str, free_mb: int = 10_000, speed: float = 1.0) -> NodeInfo:
    return NodeInfo(name, f"{name}:1", free_mb, speed)


def test_equal_nodes_get_balanced_contiguous_ranges() -> None:
    plan = plan_split(costs(), [node("a"), node("b"), node("c")], n_ctx=512)
    # the workers share every layer evenly; the head computes the output layer
    assert plan.bounds[0] == 0 and plan.bounds[-1] == 30 and plan.head == (30, 30)
    sizes = [s.hi - s.lo for s in plan.stages]
    assert len(sizes) == 3 and max(sizes) - min(sizes) <= 1


def test_faster_node_gets_more_layers() -> None:
    plan = plan_split(costs(), [node("slow", speed=1.0), node("fast", speed=3.0)], n_ctx=512)
    slow, fast = plan.stages
    assert fast.hi - fast.lo > 2 * (slow.hi - slow.lo)


def test_ranges_sliced_before_win_over_a_few_percent_of_speed() -> None:
    """Speed scores move between runs of the same machines: a plan within
    KNOWN_RANGE_ADVANTAGE of the best that reuses the slices sent before is kept, so the second
    load sends nothing; a node far faster than before still gets its layers."""
    c = costs(n=15)  # 8 + 7 one way or the other
    wobble = [node("a", speed=1.03), node("b", speed=1.0)]
    assert plan_split(c, wobble, n_ctx=512).bounds == [0, 8, 15]
    known = frozenset({(0, 7), (7, 15)})
    assert plan_split(c, wobble, n_ctx=512, known=known).bounds == [0, 7, 15]
    assert plan_split(c, [node("a", speed=1.5), node("b")], n_ctx=512, known=known).bounds == [0, 9, 15]


def test_memory_limits_are_respected() -> None:
    c = costs()
    plan = plan_split(c, [node("small", free_mb=200, speed=10.0), node("big", free_mb=10_000)], n_ctx=512)
    assert all(s.mem_mb <= s.node.free_mb for s in plan.stages)
    assert plan.stages[0].hi - plan.stages[0].lo < 15


def test_model_too_big_is_a_clear_error() -> None:
    with pytest.raises(PotluckError, match="does not fit"):
        plan_split(costs(), [node("a", free_mb=100), node("b", free_mb=100)], n_ctx=512)


def test_manual_plan_checks_counts() -> None:
    c = costs()
    # the last stage ends at the last layer: an end of 30 (or none) says so
    for bounds in ([0, 9, 30], [9]):
        plan = manual_plan(c, [node("a"), node("b")], bounds, 512)
        assert plan.bounds == [0, 9, 30] and plan.head == (30, 30)
    with pytest.raises(PotluckError, match="2 stages but 3"):
        manual_plan(c, [node("a"), node("b"), node("c")], [0, 9, 30], 512)
    with pytest.raises(PotluckError, match="stages must start at increasing layers below 30"):
        manual_plan(c, [node("a"), node("b"), node("c")], [0, 9, 30, 31], 512)


def test_the_heads_zeros_are_the_fewest_last_layers_that_load() -> None:
    assert head_zeroed_layers(costs()) == (29, 30)
    swa = tuple((i + 1) % 6 != 0 for i in range(18))  # Gemma 3 270M: layers 5, 11, 17 global
    gemma = LayerCosts("gemma3", (100,) * 18, 50, (10,) * 18, 1000, 64, swa)
    assert head_zeroed_layers(gemma) == (16, 18)  # layer 17 alone aborts llama.cpp; 16-17 loads
    assert head_zeroed_layers(costs(n=1)) == (0, 1)  # a model of one layer splits too: one worker holds it


def test_layer_costs_of_the_default_model(model_path: Path) -> None:
    c = layer_costs(model_path)
    assert c.arch == "llama" and c.n_layer == 30
    assert all(b > 0 for b in c.layer_bytes) and c.embd_bytes > 0 and all(b > 0 for b in c.kv_bytes_per_token)
    lines = plan_split(c, [node("a"), node("b")], 1024).describe()
    assert lines[0].startswith("split plan: 30 layers over 2 stage(s) and the head")
    assert lines[-1].split() == ["head:", "the", "output", "layer", "on", "this", "machine"]


def test_unverified_architecture_is_refused_in_one_line(tmp_path: Path) -> None:
    """A model whose per-layer structure we have not verified is never split (no worker needed)."""
    import gguf
    import numpy as np

    from potluck.discovery.auth import keys_from_token
    from potluck.engine.cluster.head import open_pipeline
    from potluck.engine.core.gguf_tools import slice_layers

    path = tmp_path / "other.gguf"
    w = gguf.GGUFWriter(str(path), arch="bloom")
    w.add_block_count(2)
    w.add_embedding_length(4)
    for i in range(2):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    keys = keys_from_token("potluck-swlfy4vgAWcjv3TfLEQ10F7hlqkR8k-vQB1JpW88eb0")
    with pytest.raises(PotluckError, match="'bloom' is not verified for exact layer splitting") as err:
        open_pipeline(path, ["127.0.0.1:9"], keys)
    assert "\n" not in str(err.value)
    with pytest.raises(PotluckError, match="not verified"):
        slice_layers(path, tmp_path / "s.gguf", 0, 1)


def test_a_machines_speed_is_llama_cpps_own_product_checked_against_its_sum(monkeypatch: pytest.MonkeyPatch) -> None:
    """The speed is GB/s of Q4_0 weights through ggml's matrix-vector product; every run checks
    the product's rows against the sum of their weights, so a ggml that computes something
    else (structures unlike the probe's) is refused in one line rather than timed."""
    from potluck.engine.cluster.profile import measure_speed
    from potluck.engine.core import matvec_probe

    assert 0.1 < measure_speed(1, trials=3) < 1000
    _, cpu = matvec_probe._libs()
    monkeypatch.setattr(cpu, "ggml_graph_compute_with_ctx", lambda ctx, graph, threads: 0)  # computes nothing
    with pytest.raises(PotluckError, match="speed probe computed"):
        matvec_probe.q4_0_matvec_gbps(1, trials=1)
