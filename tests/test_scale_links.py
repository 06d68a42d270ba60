"""Links like a real LAN: the head times each worker's link at join (round trip, bandwidth),
the planner counts a hop's time, and a worker behind a shaped link (the Wi-Fi profile of
potluck.engine.lab.link_relay) is joined, timed and exact. Only bounds the relay makes
certain are asserted (it cannot deliver faster than it is set to), never a speed."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from potluck.discovery.auth import keys_from_token
from potluck.engine.cluster.head import open_pipeline
from potluck.engine.cluster.plan import LayerCosts, NodeInfo, plan_split
from potluck.engine.cluster.transfer import SliceCache
from potluck.engine.core.runtime import ContextParams, Model
from potluck.engine.core.target import LocalTarget
from potluck.engine.lab.link_relay import PROFILES, Link, RelayThread

from .cluster_support import JOIN_S, TOKEN, WorkerProc

MB = 1 << 20
PROMPT = "<|im_start|>user\nName three rivers.<|im_end|>\n<|im_start|>assistant\n"


def costs(n: int = 16, layer_mb: float = 30) -> LayerCosts:
    """About an 8b layer's decode time per layer at speed 15 (GB/s, 2 threads): 2.2 ms."""
    return LayerCosts("llama", tuple([int(layer_mb * MB)] * n), 20 * MB, (0,) * n, 49152, 4096)


def test_the_planner_gives_a_worker_behind_a_slow_link_fewer_layers() -> None:
    near = NodeInfo("near", "near:1", 10_000, 15.0, rtt_ms=0.2, mbps=1000)
    far_same = NodeInfo("far", "far:1", 10_000, 15.0, rtt_ms=0.2, mbps=1000)
    far_wifi = NodeInfo("far", "far:1", 10_000, 15.0, rtt_ms=3.0, mbps=100)
    even = plan_split(costs(), [near, far_same], n_ctx=512)
    shaped = plan_split(costs(), [near, far_wifi], n_ctx=512)
    layers = {s.node.name: s.hi - s.lo for s in shaped.stages}
    assert [s.hi - s.lo for s in even.stages] == [8, 8]
    assert layers["far"] < 8 < layers["near"], shaped.describe()
    # a link far slower than its share of compute: that worker gets no layers at all
    remote = NodeInfo("remote", "remote:1", 10_000, 15.0, rtt_ms=200.0, mbps=10)
    alone = plan_split(costs(), [near, remote], n_ctx=512)
    assert [s.node.name for s in alone.stages] == ["near"]
    assert "link 3.00 ms 100 Mbit/s" in "\n".join(shaped.describe())


def test_a_worker_behind_a_wifi_link_is_timed_at_join_and_exact(
    model: Model, model_path: Path, loopback_pool: list[WorkerProc], tmp_path: Path
) -> None:
    worker = loopback_pool[0]
    rtt_ms, mbit = PROFILES["wifi"]
    keys = keys_from_token(TOKEN)
    local = LocalTarget(model, ContextParams(n_ctx=256, n_threads=1))
    tokens = model.tokenize(PROMPT)
    try:
        want = local.decode(tokens)
    finally:
        local.close()
    direct = open_pipeline(model_path, [worker.address], keys, n_ctx=256, join_timeout_s=JOIN_S,
                           slice_cache=SliceCache(tmp_path / "head"))
    try:
        (plain,) = direct.plan.stages
        assert plain.node.rtt_ms > 0 and plain.node.mbps > 0  # the measurement ran
    finally:
        direct.close()
    with RelayThread(worker.address, Link(rtt_ms, mbit)) as relay:
        target = open_pipeline(model_path, [relay.address], keys, n_ctx=256, join_timeout_s=JOIN_S,
                               slice_cache=SliceCache(tmp_path / "head"))
        try:
            (stage,) = target.plan.stages
            assert stage.node.address == relay.address
            assert stage.node.rtt_ms >= rtt_ms, stage.node  # the relay holds each direction rtt/2
            assert 0 < stage.node.mbps < 10 * mbit, stage.node  # 256 KiB take >= 21 ms at 100 Mbit/s
            assert np.array_equal(want, target.decode(tokens))
        finally:
            target.close()
