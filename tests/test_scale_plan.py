"""The planner fits slices, KV cache and llama.cpp's buffers into each worker's free memory:
a capped worker gets fewer layers, a split that fits nowhere is one line before anything is
sent, the compute-buffer figure bounds llama.cpp's own, and a worker in a memory cgroup
reports what the cgroup still allows."""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from potluck.discovery.auth import keys_from_token
from potluck.engine.cluster.child import StageProcess, StageSpec
from potluck.engine.cluster.head import open_pipeline
from potluck.engine.cluster.plan import (
    HEADROOM_MB,
    PAGE_BYTES,
    LayerCosts,
    NodeInfo,
    layer_costs,
    manual_plan,
    plan_split,
    stage_bytes,
    stage_runtime_bytes,
)
from potluck.engine.cluster.transfer import SliceCache
from potluck.engine.core.errors import PotluckError
from potluck.engine.core.gguf_tools import STAGE_VOCAB, layer_layout, middle_stage_vocab, slice_layers
from potluck.engine.core.runtime import Context, ContextParams, Model
from potluck.engine.lab.fixtures import build_shape

from .cluster_support import TOKEN, start_worker, stop_worker
from .support.cgroups import v1_memory_group

MB = 1 << 20


def one_b() -> LayerCosts:
    """The 1b shape's sizes (16 layers of 34 MB, a tied 56 MB embedding, 49,152 tokens)."""
    return LayerCosts("llama", tuple([34 * MB] * 16), 56 * MB, (2 * 8 * 64 * 2,) * 16, 49152, 2048)


def test_a_capped_worker_gets_fewer_layers() -> None:
    c = one_b()
    even = plan_split(c, [NodeInfo("a", "a:1", 8000, 1.0), NodeInfo("b", "b:1", 8000, 1.0)], n_ctx=4096)
    assert sorted(s.hi - s.lo for s in even.stages) == [8, 8]
    cap = int(stage_bytes(c, 0, 4, 4096) / MB) + 1 + HEADROOM_MB  # room for 4 layers, not 5
    capped = plan_split(c, [NodeInfo("a", "a:1", cap, 1.0), NodeInfo("b", "b:1", 8000, 1.0)], n_ctx=4096)
    assert [s.hi - s.lo for s in capped.stages] == [4, 12]
    assert all(s.mem_mb <= s.node.free_mb for s in capped.stages)
    # the KV cache counts: a longer context leaves the capped worker fewer layers still
    longer = plan_split(c, [NodeInfo("a", "a:1", cap, 1.0), NodeInfo("b", "b:1", 8000, 1.0)], n_ctx=65536)
    held = {s.node.name: s.hi - s.lo for s in longer.stages}
    assert held.get("a", 0) < 4 and sum(held.values()) == 16


def test_a_stage_without_a_vocabulary_counts_its_small_buffers(model_path: Path, tmp_path: Path) -> None:
    """A stage after the first is sliced without a vocabulary: the plan counts
    its logits and output-layer buffers at STAGE_VOCAB tokens (its own and its prefill twin's),
    and the worker's check over the slice itself is never above the plan."""
    c = one_b()
    first, middle = stage_bytes(c, 0, 4, 4096, 512), stage_bytes(c, 4, 8, 4096, 512)
    vocab_part = stage_runtime_bytes(c.n_vocab, c.n_embd, 512) - stage_runtime_bytes(STAGE_VOCAB, c.n_embd, 512)
    rows_read = (4096 - STAGE_VOCAB) * PAGE_BYTES  # a page an embedding row, a row a cell at most
    assert first - middle == 2 * vocab_part + rows_read and vocab_part > 50 * MB
    whole = layer_costs(model_path)
    sliced = layer_costs(layer_layout(model_path, range(10, 20), stage=True).write_to(tmp_path / "mid.gguf"))
    assert sliced.n_vocab == STAGE_VOCAB and sliced.n_layer == 10
    assert stage_bytes(sliced, 0, 10, 1024, 64) <= stage_bytes(whole, 10, 20, 1024, 64)
    # a model with another tensor sized by its vocabulary (an output bias) keeps it whole:
    # the slicer says so, and the plan counts the whole vocabulary's buffers
    tensor = SimpleNamespace
    embd = tensor(name="token_embd.weight", shape=(2048, 49152))
    assert middle_stage_vocab([embd, tensor(name="blk.0.attn_q.weight", shape=(2048, 2048))]) == STAGE_VOCAB
    assert middle_stage_vocab([embd, tensor(name="output.bias", shape=(49152,))]) == 0
    assert stage_bytes(replace(c, middle_vocab=0), 4, 8, 4096, 512) == first


def test_a_stage_process_reads_its_slice_by_rows(model_path: Path, tmp_path: Path) -> None:
    """A stage tells the kernel it reads its mapped slice at random (MADV_RANDOM: smaps shows
    ``rr``), so a fault for one embedding row reads a page, not a read-around window that
    pushes out its working set under a memory cap (docs/facts.md §17)."""
    path = slice_layers(model_path, tmp_path / "s.gguf", 0, 4)
    proc = StageProcess()
    try:
        proc.load(StageSpec(str(path), "0" * 64, True, 256, 32, 1, True, 1), 300)
        smaps = Path(f"/proc/{proc.proc.pid}/smaps").read_text()
        flags = [
            next(ln for ln in block.splitlines() if ln.startswith("VmFlags:")).split()[1:]
            for block in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", smaps)
            if block.splitlines()[0].endswith(str(path.resolve()))
        ]
        assert flags and all("rr" in f for f in flags), flags
    finally:
        proc.close()


def test_a_split_that_fits_nowhere_is_one_line() -> None:
    c = one_b()
    nodes = [NodeInfo("a", "a:1", 300, 1.0), NodeInfo("b", "b:1", 300, 1.0)]
    with pytest.raises(PotluckError, match="does not fit") as e:
        plan_split(c, nodes, n_ctx=4096)
    assert "\n" not in str(e.value) and "300, 300 MB free" in str(e.value)
    with pytest.raises(PotluckError, match=r"layers 0-8 need about .* but a \(a:1\) has 500 MB free") as e:
        manual_plan(c, [NodeInfo("a", "a:1", 500, 1.0), NodeInfo("b", "b:1", 8000, 1.0)], [0, 8, 16], 4096)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("n_batch", [64, 512])
def test_compute_buffer_figure_bounds_llama_cpp(model: Model, model_path: Path, n_batch: int,
                                                caplog: pytest.LogCaptureFixture) -> None:
    """llama.cpp logs its compute buffer at context creation; the planner's figure holds it."""
    caplog.set_level(logging.DEBUG, logger="potluck.engine.core.backend")
    with Context(model, ContextParams(n_ctx=1024, n_batch=n_batch, capture_layer=model.n_layer - 1, n_threads=1)):
        pass
    sizes = [float(m.group(1)) for r in caplog.records
             if (m := re.search(r"CPU compute buffer size = +([\d.]+) MiB", r.getMessage()))]
    assert sizes, "llama.cpp no longer logs its compute buffer: re-measure docs/facts.md §15"
    c = layer_costs(model_path)
    outputs = n_batch * (4 * c.n_vocab + 4 * c.n_embd)
    figure = (stage_runtime_bytes(c.n_vocab, c.n_embd, n_batch) - outputs) / MB
    assert max(sizes) <= figure <= max(sizes) * 1.3 + 16


@pytest.fixture()
def capped_group() -> Iterator[Path]:
    """A fresh v1 memory cgroup of 400 MiB under this process's own (root only)."""
    with v1_memory_group("capped", 400 * MB) as d:
        yield d


def test_capped_worker_reports_its_cgroup_and_a_split_that_cannot_fit_sends_nothing(
    capped_group: Path, tmp_path: Path
) -> None:
    w = start_worker(tmp_path, "capped", preexec=lambda: (capped_group / "cgroup.procs").write_text(str(os.getpid())))
    try:
        wide = build_shape("wide")
        stats: list[int] = []
        with pytest.raises(PotluckError, match="does not fit") as e:
            open_pipeline(wide, [w.address], keys_from_token(TOKEN), n_ctx=4096,
                          slice_cache=SliceCache(tmp_path / "head-slices"),
                          on_plan=lambda p: stats.append(1), head_fallback=False)
        free = [int(x.replace(",", "")) for x in re.findall(r"([\d,]+) MB free", str(e.value))]
        assert len(free) == 1 and free[0] < 400  # the welcome's figure: the cgroup's, not MemAvailable
        assert not stats and not list((tmp_path / "capped-cache").glob("*.gguf"))  # nothing planned or sent
    finally:
        stop_worker(w.proc)
