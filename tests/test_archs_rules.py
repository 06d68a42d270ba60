"""The per-architecture rules of engine/core/archs.py, read off slices' headers and the planner
(no llama.cpp): what a slice rewrites, which slices are refused, how layers count. The slices'
exactness is tests/test_archs_exact.py's."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from potluck.engine.cluster.plan import head_zeroed_layers, layer_costs, slice_problem
from potluck.engine.core import archs, gguf_tools
from potluck.engine.core.errors import PotluckError
from potluck.engine.core.gguf_tools import describe, layer_layout, open_reader, write_layers
from potluck.engine.lab.fixtures import SHAPES, build_shape
from potluck.engine.lab.hybrid_shapes import build_hybrid_shape


def header_of(path: Path) -> archs.Header:
    return archs.read_header(open_reader(path))


def sliced(path: Path, layer_map: list[int], tmp_path: Path) -> archs.Header:
    return header_of(write_layers(path, tmp_path / f"s{layer_map[0]}-{len(layer_map)}.gguf", layer_map))


@pytest.mark.parametrize("shape", ["bundled", "gemma4-small"])
def test_a_slices_header_copies_unchanged_values_as_repacking_them_would_write_them(
    shape: str, model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Keys a slice does not change are copied as the source's bytes (a vocabulary's strings,
    scores, types and merges, never decoded): the header is byte for byte the one that
    decoding and packing every value again writes. gemma4-small's middle slice rewrites its
    per-layer arrays and leaves its vocabulary out; the bundled model's keeps 49,152 tokens."""
    path, layers = (model_path, list(range(0, 12))) if shape == "bundled" else (build_shape(shape), [2, 3, 4])
    copied: list[int] = []
    raw_value = gguf_tools._raw_value

    def counted(reader, field):
        raw = raw_value(reader, field)
        copied.append(len(raw))
        return raw

    def layout():
        gguf_tools._layout_of_version.cache_clear()
        return layer_layout(path, layers, stage=True)

    monkeypatch.setattr(gguf_tools, "_raw_value", counted)
    fast = layout()
    monkeypatch.setattr(gguf_tools, "_raw_value", lambda reader, field: None)
    repacked = layout()
    gguf_tools._layout_of_version.cache_clear()
    assert fast.header == repacked.header and fast.parts == repacked.parts
    assert len(copied) > 10 and (max(copied) > 100_000) == (shape == "bundled")


def test_gpt_oss_slices_keep_their_layers_sliding_windows(tmp_path: Path) -> None:
    """llama.cpp's default pattern (period 2) says even layers slide: a slice starting at an
    odd layer carries the explicit array. A slice of global layers only (llama.cpp asserts one
    sliding layer) is written as sliding layers over a window no position reaches: the same
    attention (tests/test_archs_exact.py's 3-stage split ends with one), so the head's slice
    carries the last layer alone as zeros."""
    path = build_shape("gpt-oss-small")
    h = header_of(path)
    assert archs.ARCHS["gpt-oss"].swa_layers(h) == (True, False, True, False, True, False)
    s = sliced(path, [1, 2, 3], tmp_path)
    assert s.get("attention.sliding_window_pattern") == [False, True, False]
    assert s.get("attention.sliding_window") == h.get("attention.sliding_window") == 8
    wide = sliced(path, [5], tmp_path)
    assert wide.get("attention.sliding_window_pattern") == [True]
    assert wide.get("attention.sliding_window") == archs.WIDE_WINDOW
    costs = layer_costs(path)
    assert slice_problem(costs, 5, 6) is None and slice_problem(costs, 3, 4) is None
    assert head_zeroed_layers(costs) == (costs.n_layer - 1, costs.n_layer)


def test_no_stage_context_reaches_a_widened_window() -> None:
    """A widened layer attends like a global one only while positions differ by less than its
    window: a Load longer than the window is refused by the wire's own check, and llama.cpp's
    SWA cache size for it (window x 256 sequences + a batch, a uint32) cannot overflow."""
    from potluck.engine.cluster import wire

    def load(n_ctx: int) -> wire.Load:
        return wire.Load("ef" * 32, 0, 2, True, True, n_ctx, 8, 256, True, "f32", "", "cd" * 32, "")

    load(wire.MAX_STAGE_CTX).check()
    with pytest.raises(wire.WireError, match="n_ctx / n_batch out of range"):
        load(archs.WIDE_WINDOW + 1).check()
    assert wire.MAX_STAGE_CTX <= archs.WIDE_WINDOW and archs.WIDE_WINDOW * 256 + (1 << 16) < 1 << 32


def test_gemma4_slices_keep_their_layers_kinds_and_the_global_ropes_factors_where_read(tmp_path: Path) -> None:
    """Each kind of layer has its own KV heads (per-layer arrays follow their layers); the
    global rope's factors, read by the global layers only, leave a slice of sliding ones (or
    llama.cpp refuses the file); llama.cpp's Gemma 4 cache needs two layers in a slice; E2B and
    E4B (per-layer embeddings, shared KV) are refused in one line."""
    path = build_shape("gemma4-small")
    h = header_of(path)
    assert archs.ARCHS["gemma4"].swa_layers(h) == (True,) * 5 + (False,)
    sliding, last = sliced(path, [0, 1, 2, 3], tmp_path), sliced(path, [3, 4, 5], tmp_path)
    assert archs.GEMMA4_ROPE_FREQS not in sliding.tensor_bytes and archs.GEMMA4_ROPE_FREQS in last.tensor_bytes
    assert last.get("attention.head_count_kv") == [2, 2, 1]
    assert last.get("attention.sliding_window_pattern") == [True, True, False]
    costs = layer_costs(path)
    assert slice_problem(costs, 4, 5) == "are one layer, and llama.cpp's Gemma 4 cache needs two"
    assert slice_problem(costs, 5, 6) is not None and slice_problem(costs, 3, 5) is None
    values = {"gemma4.block_count": 42}
    assert "per-layer embeddings" in (archs.unsplittable_reason(archs.Header(
        "gemma4", {**values, "gemma4.embedding_length_per_layer_input": 256})) or "")
    assert "shared_kv_layers" in (archs.unsplittable_reason(archs.Header(
        "gemma4", {**values, "gemma4.attention.shared_kv_layers": 18})) or "")
    assert archs.unsplittable_reason(h) is None


def test_gemma4_31b_cells_count_each_kind_of_layers_heads_and_widths() -> None:
    """Sliding layers: 16 KV heads 256 wide; global: 4 heads 512 wide (google/gemma-4-31B). The
    widest layer's count over all 60 would be 2x; the head count's (32) 4.4x."""
    a, pattern = "gemma4", [(i + 1) % 6 != 0 for i in range(60)]
    h = archs.Header(a, {f"{a}.block_count": 60, f"{a}.embedding_length": 5376, f"{a}.attention.head_count": 32,
                         f"{a}.attention.head_count_kv": [16 if s else 4 for s in pattern],
                         f"{a}.attention.key_length": 512, f"{a}.attention.value_length": 512,
                         f"{a}.attention.key_length_swa": 256, f"{a}.attention.value_length_swa": 256,
                         f"{a}.attention.sliding_window_pattern": pattern})
    assert sum(archs.kv_bytes_per_token(h)) == 50 * 2 * 16 * 512 + 10 * 2 * 4 * 1024


def test_a_loaded_models_cache_size_counts_per_layer_heads_from_the_header() -> None:
    """llama.cpp's metadata leaves per-layer arrays out (gemma4-small's KV heads: 2 sliding, 1
    global): validate.kv_bytes then reads each layer's heads and widths from the header."""
    from potluck.engine.core import validate
    from potluck.engine.core.runtime import Model

    path = build_shape("gemma4-small")
    with Model(path, vocab_only=True) as m:
        assert m.meta("gemma4.attention.head_count_kv") is None  # the path below, not the scalar one
        assert validate.kv_bytes(m, 100) == 100 * sum(archs.kv_bytes_per_token(header_of(path)))
        assert validate.kv_bytes(m, 100) == 100 * (5 * 2 * 2 * (64 + 64) + 2 * 1 * (128 + 128))


def test_deepseek2_slices_count_their_own_dense_layers_and_leave_the_mtp_block_out(tmp_path: Path) -> None:
    path = build_shape("deepseek2-small")
    h = header_of(path)
    assert (h.n_layer_all, h.n_nextn, h.n_layer) == (5, 1, 4)  # an MTP block after 4 trunk layers
    assert describe(path)["n_layer"] == 4
    first, later = sliced(path, [0, 1], tmp_path), sliced(path, [2, 3], tmp_path)
    assert first.get("leading_dense_block_count") == 1 and later.get("leading_dense_block_count") == 0
    for s in (first, later):
        assert s.n_layer_all == 2 and s.n_nextn == 0
        assert not any(".nextn." in name for name in s.tensor_bytes)
    with pytest.raises(PotluckError, match="is outside 0..3"):
        layer_layout(path, [3, 4])  # the MTP block is not a layer to split
    with pytest.raises(PotluckError, match="dense layers .* must come before its expert layers"):
        layer_layout(path, [1, 0])


def test_deepseek2_decisions_from_the_layer_count_are_written_out_or_refused() -> None:
    """llama.cpp takes a 26- or 27-layer deepseek2 for a Lite model (no low-rank query) and
    defaults the gating function by layer count: a slice must not change either."""
    values = {"general.architecture": "deepseek2", "deepseek2.block_count": 61}
    full = archs.Header("deepseek2", {**values, "deepseek2.attention.q_lora_rank": 1536}, n_vocab=129280)
    lite = archs.Header("deepseek2", {**values, "deepseek2.block_count": 27}, n_vocab=102400)
    entry = archs.ARCHS["deepseek2"]
    rules = archs.slice_rules(full)
    assert rules.why_not(0, 27) is not None and rules.why_not(1, 27) is not None
    assert rules.why_not(0, 28) is None and archs.slice_rules(lite).why_not(0, 26) is None
    assert entry.rewrites(full, range(30))["expert_gating_func"] == archs.GATING_SOFTMAX
    assert "attention.q_lora_rank" not in entry.rewrites(full, range(30))
    assert entry.rewrites(lite, range(10))["attention.q_lora_rank"] == 0


def test_memory_counts_every_expert_time_only_those_a_token_uses() -> None:
    """A mixture's layer: all experts resident, a token reads expert_used_count of
    expert_count of them (shared experts and the rest whole)."""
    for name in ("qwen3moe-small", "gpt-oss-small", "deepseek2-small", "gemma4-small"):
        s, h = SHAPES[name], header_of(build_shape(name))
        memory, time = archs.layer_bytes(h)
        i = s.n_layer - 1
        routed = sum(b for t, b in h.tensor_bytes.items() if t.startswith(f"blk.{i}.ffn_") and "_exps." in t)
        assert routed > 0 and memory[i] - time[i] == routed - routed * s.n_expert_used // s.n_expert, name
        costs = layer_costs(build_shape(name))
        assert costs.layer_bytes == tuple(memory) and costs.time_bytes == tuple(time)
    dense = layer_costs(build_shape("qwen3-small"))
    assert dense.time_bytes is None  # a dense model reads every byte


def test_a_recurrent_layers_time_counts_its_state_moved_each_token() -> None:
    """qwen35moe: a Gated DeltaNet layer's time is its weights a token reads plus its state,
    RECURRENT_STATE_PASSES times (update, snapshot, checkpoint); an attention layer's is its
    weights alone."""
    h = header_of(build_hybrid_shape("qwen35moe-small"))
    memory, time = archs.layer_bytes(h)
    states = archs.recurrent_state_bytes(h)
    assert states is not None and 0 in states and any(states)
    weights = archs.layer_bytes(archs.Header("qwen3moe", {k.replace("qwen35moe.", "qwen3moe."): v
                                                          for k, v in h.values.items()}, h.tensor_bytes))[1]
    for i, state in enumerate(states):
        assert time[i] - weights[i] == int(state * archs.RECURRENT_STATE_PASSES), i


def test_mla_cells_keep_k_only() -> None:
    h = header_of(build_shape("deepseek2-small"))
    s = SHAPES["deepseek2-small"]
    assert archs.kv_bytes_per_token(h) == (2 * (s.kv_lora_rank + s.rope_dim),) * s.n_layer


def test_an_architecture_outside_the_table_is_refused_naming_those_in_it() -> None:
    h = archs.Header("bloom", {"general.architecture": "bloom"})
    why = archs.unsplittable_reason(h)
    assert why is not None and "'bloom'" in why and all(a in why for a in archs.ARCHS)


def test_gemma3_27b_is_refused_its_attention_scale_depends_on_the_layer_count() -> None:
    values = {"gemma3.embedding_length": 5376, "gemma3.attention.head_count": 32, "gemma3.attention.key_length": 128}
    g27 = archs.Header("gemma3", {**values, "gemma3.block_count": 62})
    assert "attention scale" in (archs.unsplittable_reason(g27) or "")
    other = archs.Header("gemma3", {**values, "gemma3.block_count": 80})
    assert archs.unsplittable_reason(other) is None
    assert archs.slice_rules(other).why_not(0, 62) is not None and archs.slice_rules(other).why_not(0, 61) is None


def test_glm4moe_slices_take_hidden_states_through_m_rope(tmp_path: Path) -> None:
    """llama.cpp's GLM-4.5 graph aborts on hidden states without M-RoPE sections: every slice
    gets two over the rotated half-dims (16 of a 32-wide rotation here), so a stage reads 4
    positions a row, while the whole model keeps its own rope (test_archs_exact: the same logits)."""
    from potluck.engine.core.runtime import Model

    path = build_shape("glm4moe-small")
    part = write_layers(path, tmp_path / "glm-1-4.gguf", [1, 2, 3])
    assert archs.read_header(open_reader(part)).get("rope.dimension_sections") == [8, 8, 0, 0]
    assert archs.read_header(open_reader(path)).get("rope.dimension_sections") is None
    with Model(path) as whole, Model(part) as stage:
        assert (whole.positions_per_token, stage.positions_per_token) == (1, 4)
        assert not whole.kv_cell_ext and stage.kv_cell_ext  # its cells' state carries the extension


def refused_mixture(folder: Path) -> Path:
    """A header-only GGUF the table refuses, with experts: Gemma 4 with per-layer embeddings
    (as E2B and E4B have)."""
    import gguf

    path = folder / "gemma4.gguf"
    w = gguf.GGUFWriter(str(path), arch="gemma4")
    w.add_block_count(1)
    w.add_uint32("gemma4.embedding_length_per_layer_input", 256)
    w.add_expert_count(128)
    w.add_expert_used_count(8)
    w.add_uint32("gemma4.expert_shared_count", 1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    return path


def test_potluck_models_says_whether_a_file_splits_and_why_not(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:

    from potluck.app.cli import main

    refused = refused_mixture(tmp_path)
    assert main(["models", str(build_shape("gpt-oss-small")), str(refused)]) == 0
    out = capsys.readouterr().out
    oss, refused_part = out.split("gpt-oss-small", 1)[1].split("gemma4.gguf", 1)
    assert "arch gpt-oss, 6 layers" in oss and "2 of 8 experts a token" in oss
    assert "split over machines (--nodes): yes" in oss
    assert "8 of 128 experts + 1 shared a token" in refused_part
    assert "split over machines (--nodes): no: Gemma 4's per-layer embeddings (E2B, E4B)" in refused_part
    # Qwen3.5's one shared expert is known by its width alone (no expert_shared_count)
    assert main(["models", str(build_hybrid_shape("qwen35moe-small"))]) == 0
    assert "2 of 8 experts + 1 shared a token, cache kv+recurrent" in capsys.readouterr().out


def test_nodes_prints_the_plan_and_its_experts_over_the_workers_found(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`potluck nodes -m MODEL`: the plan --nodes auto would make over the workers advertised
    (here two records on loopback, no worker behind them: nothing is joined). Other modules'
    records on the shared loopback may be found beside them (one offers 999,999 MB), so what
    these two alone cannot hold is asked of the planner directly."""
    from potluck.app.cli import main
    from potluck.discovery.lan import Advertiser
    from potluck.engine.cluster.plan import preview_plan
    from potluck.engine.cluster.profile import NodeProfile

    ads = [Advertiser(NodeProfile(f"moenode{i}", 2, 4000, 3.0), 41000 + i, "9.9", interfaces=["127.0.0.1"])
           for i in range(2)]
    try:
        for ad in ads:
            ad.start()
        path = build_shape("gpt-oss-small")
        assert main(["nodes", "--interface", "127.0.0.1", "--timeout", "3", "-m", str(path)]) == 0
        out = capsys.readouterr().out
        assert "moenode0" in out and "moenode1" in out, out
        assert "split plan: 6 layers over" in out and "2 of 8 experts a token (all resident)" in out, out
        assert "single steps as 2 rows (x1.93)" in out  # its router is F32 (docs/facts.md §37)
        refused = refused_mixture(tmp_path)
        assert main(["nodes", "--interface", "127.0.0.1", "--timeout", "3", "-m", str(refused)]) == 1
        assert "no plan for gemma4.gguf: cannot split gemma4.gguf: Gemma 4's per-layer" in capsys.readouterr().out
        with pytest.raises(PotluckError, match="does not fit"):
            preview_plan(path, [(f"moenode{i}", f"127.0.0.1:{41000 + i}", 4000, 3.0) for i in range(2)], 4_000_000)
    finally:
        for ad in ads:
            ad.close()


def test_the_plan_predicts_decoding_from_the_bytes_a_token_reads() -> None:
    """Memory counts every expert, time only the routed ones a token reads: the plan's stage
    sizes hold all of a layer, its prediction (synchronous: the stages in turn, then the
    head's output matrix and the zeros in front of it) the quarter a token reads."""
    from potluck.engine.cluster.plan import (
        TWO_ROW_STEP_COST,
        WEIGHT_BYTES_PER_S_PER_SPEED,
        LayerCosts,
        NodeInfo,
        plan_split,
    )

    mb = 1 << 20
    costs = LayerCosts("qwen3moe", (100 * mb,) * 10, 10 * mb, (1024,) * 10, 1000, 64, time_bytes=(25 * mb,) * 10,
                       experts=(8, 2, 0), output_bytes=20 * mb, head_layer_bytes=(mb,) * 10)
    nodes = [NodeInfo("a", "x:1", 4000, 2.0), NodeInfo("b", "y:1", 4000, 2.0)]
    plan = plan_split(costs, nodes, 512, head_speed=4.0)
    w = WEIGHT_BYTES_PER_S_PER_SPEED
    assert plan.predicted_tokens_per_s == pytest.approx(1 / (10 * 25 * mb / (2.0 * w) + 21 * mb / (4.0 * w)))
    assert [s.hi - s.lo for s in plan.stages] == [5, 5]
    assert all(s.mem_mb > (s.hi - s.lo) * 100 for s in plan.stages)  # every expert resident
    assert "2 of 8 experts a token (all resident)" in plan.describe()[0]
    assert "predicted: about" in plan.describe()[-1] and "2 rows" not in plan.describe()[-1]
    assert plan_split(costs, nodes, 512).predicted_tokens_per_s is None  # the head's speed unknown
    # single steps as 2 rows (an F32 router) compute the spare row too
    doubled = replace(plan, step_cost=TWO_ROW_STEP_COST)
    assert doubled.predicted_tokens_per_s == pytest.approx(plan.predicted_tokens_per_s / TWO_ROW_STEP_COST)
