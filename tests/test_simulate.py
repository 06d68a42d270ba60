"""The pipeline model (engine/lab/simulate.py) and `potluck simulate`: the event engine's
invariants against figures worked out by hand, the counters that show each path ran, and
the command's output and refusals. Pure Python: the whole file runs in seconds."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import replace
from pathlib import Path

import pytest

from potluck.app.cli import main
from potluck.engine.core.errors import PotluckError
from potluck.engine.lab.sim_config import SimConfig, batch_cost_fn
from potluck.engine.lab.sim_lanes import simulate_lanes
from potluck.engine.lab.simulate import simulate, trends

FOUR = SimConfig(stage_ms=(3.0,) * 4, tokens=150, seeds=2)


def run(cfg: SimConfig, *strategies: str) -> dict[str, dict]:
    return simulate(replace(cfg, strategies=strategies))["results"]


def test_batch_cost_interpolates_and_extrapolates_the_last_slope() -> None:
    cost = batch_cost_fn(((1, 1.0), (2, 1.76), (4, 3.06), (8, 5.55), (16, 11.07)))
    assert cost(1) == 1.0
    assert cost(3) == pytest.approx((1.76 + 3.06) / 2)
    assert cost(32) == pytest.approx(11.07 + 16 * (11.07 - 5.55) / 8)


def test_iterative_keeps_one_stage_busy_at_a_time() -> None:
    r = run(FOUR, "iterative")["iterative"]
    # a token: 4 stages x 3 ms, 5 links x (0.1 ms + 2304 bytes at 10 Gbit/s), 0.1 ms sampling
    per_token_ms = 12 + 5 * (0.1 + 2304 * 8 / 1e7) + 0.1
    assert r["tok_s"] == pytest.approx(1000 / per_token_ms, rel=1e-3)
    for busy in r["stage_busy"]:
        assert busy == pytest.approx(3 / per_token_ms, rel=1e-3)  # about 1/N of the wall time
    assert r["runs"] == FOUR.tokens and r["cancelled"] == 0 and r["drafted"] == 0


@pytest.mark.parametrize("rule", ["paper", "reference"])
def test_full_acceptance_keeps_every_stage_busy(rule: str) -> None:
    cfg = replace(FOUR, alpha=1.0, draft_ms=0.0, cutoff_rule=rule, tokens=300)
    r = run(cfg, "iterative", "pipeinfer")
    p = r["pipeinfer"]
    assert min(p["stage_busy"]) > 0.9
    # a full pipeline finishes one 4-token micro-batch per stage time
    micro_batch_bound = 4 / (3.0 * batch_cost_fn(cfg.batch_cost)(4)) * 1000
    assert p["tok_s"] > 0.9 * micro_batch_bound
    assert p["tok_s"] > 4 * r["iterative"]["tok_s"]
    assert p["cancelled"] == 0 and p["accepted"] == p["drafted"] > 0
    assert p["max_in_flight"] == 5  # stages + 1


def test_alpha_zero_pipeinfer_costs_no_more_than_its_skips() -> None:
    r = run(replace(FOUR, alpha=0.0), "iterative", "pipeinfer", "speculative")
    it, p, s = r["iterative"], r["pipeinfer"], r["speculative"]
    assert p["accepted"] == 0
    # a stage busy with a doomed micro-batch delays the own token until the abort lands
    assert p["tok_s"] >= 0.95 * it["tok_s"]
    # speculation pays for its drafts and bigger batches and gets nothing back
    assert s["tok_s"] < it["tok_s"]
    assert s["drafted"] > 0 and s["accepted"] == 0


def test_speculative_pays_for_drafting_at_alpha_zero() -> None:
    cfg = replace(FOUR, alpha=0.0, draft_ms=1.0, batch_cost=((1, 1.0), (2, 1.0)))  # flat: only drafting costs
    r = run(cfg, "iterative", "speculative")
    assert r["speculative"]["tok_s"] < r["iterative"]["tok_s"]


def test_pipeinfer_cancels_at_half_acceptance() -> None:
    for rule in ("code", "reference", "paper"):
        p = run(replace(FOUR, alpha=0.5, cutoff_rule=rule), "pipeinfer")["pipeinfer"]
        assert p["cancelled"] > 0, rule
        assert p["skipped"] + p["aborted"] > 0, rule
        assert p["wasted"] == 0, rule


def test_cancellation_off_is_slower_at_low_acceptance() -> None:
    cfg = replace(FOUR, alpha=0.5, cutoff_rule="reference", abort_ms=0.2, seeds=3)
    r = run(cfg, "pipeinfer", "pipeinfer-nocancel")
    on, off = r["pipeinfer"], r["pipeinfer-nocancel"]
    assert off["cancelled"] == 0 and off["wasted"] > 0
    assert on["cancelled"] > 0
    assert on["tok_s"] > off["tok_s"]


def test_pipelined_computes_runs_it_then_throws_away() -> None:
    p = run(replace(FOUR, alpha=0.5), "pipelined")["pipelined"]
    assert p["wasted"] > 0 and p["cancelled"] == 0 and p["skipped"] == 0
    assert p["max_in_flight"] == 5


def test_same_seeds_same_figures() -> None:
    cfg = replace(FOUR, alpha=0.6, p_none=0.2)
    assert simulate(cfg) == simulate(cfg)
    assert simulate(cfg)["results"]["pipeinfer"] != simulate(replace(cfg, seeds=3))["results"]["pipeinfer"]


def test_one_stage_pipeinfer_runs_as_speculation() -> None:
    r = run(replace(FOUR, stage_ms=(12.0,), alpha=0.7), "speculative", "pipeinfer")
    assert r["pipeinfer"] == r["speculative"]


def test_logits_on_the_return_link_cost_bandwidth() -> None:
    lan = replace(FOUR, latency_ms=1.0, bandwidth_mbps=880.0)
    hidden = run(lan, "iterative")["iterative"]
    logits = run(replace(lan, return_bytes=49152 * 4), "iterative")["iterative"]
    extra_ms = 49152 * 4 * 8 / 880e3 - 576 * 4 * 8 / 880e3
    assert 1000 / logits["tok_s"] - 1000 / hidden["tok_s"] == pytest.approx(extra_ms, rel=1e-3)


def test_ttft_counts_from_the_prompt_token() -> None:
    r = run(replace(FOUR, prefill_ms=1.0, prompt_tokens=100), "iterative", "speculative")
    it = r["iterative"]
    assert it["prefill_ms"] == pytest.approx(100 + 5 * 0.1 + 0.1, rel=0.01)
    assert it["ttft_e2e_ms"] == pytest.approx(it["prefill_ms"] + it["ttft_ms"])
    assert r["speculative"]["ttft_ms"] > it["ttft_ms"]  # it waits for a bigger batch


@pytest.mark.parametrize(
    "bad",
    [dict(alpha=1.5), dict(stage_ms=()), dict(tokens=0), dict(strategies=("nope",)),
     dict(batch_cost=((2, 1.0),)), dict(latency_ms=-1.0), dict(cutoff_rule="x")],
)
def test_config_refuses_what_it_cannot_mean(bad: dict) -> None:
    with pytest.raises(PotluckError):
        simulate(replace(FOUR, **bad))


def test_trends_show_the_papers_shapes() -> None:
    result = trends(replace(SimConfig(), tokens=60, seeds=1, cutoff_rule="reference"))
    figs, nodes = result["figures"], result["nodes"]
    assert nodes == [1, 2, 4, 8, 16, 32]
    for key in ("tok_s_high", "tok_s_low", "tok_s_slow", "ttft_ms"):
        assert set(figs[key]) == {"iterative", "speculative", "pipelined", "pipeinfer"}
        assert all(len(v) == len(nodes) for v in figs[key].values())
    at8 = nodes.index(8)
    assert figs["tok_s_high"]["pipeinfer"][at8] > figs["tok_s_high"]["speculative"][at8]
    assert figs["tok_s_low"]["pipeinfer"][at8] > figs["tok_s_low"]["pipelined"][at8]
    # TTFT: PipeInfer's first token goes alone, as iterative decoding's does (§V-B)
    for i in range(1, len(nodes)):
        assert figs["ttft_ms"]["pipeinfer"][i] == pytest.approx(figs["ttft_ms"]["iterative"][i])
        assert figs["ttft_ms"]["speculative"][i] > figs["ttft_ms"]["iterative"][i]


# --- the command ---


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    try:
        rc = main(["simulate", *args])
    except SystemExit as e:  # argparse refusals
        rc = int(e.code or 0)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = cli(capsys, "--stages", "3", "--tokens", "60", "--seeds", "1", "--alpha", "0.6")
    assert rc == 0
    for name in ("iterative", "speculative", "pipelined", "pipeinfer", "pipeinfer-nocancel"):
        assert any(line.startswith(name + " ") for line in out.splitlines()), name
    assert "busy per stage" in out


def test_cli_json_and_perf_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    perf = tmp_path / "perf.json"
    perf.write_text(json.dumps({
        "model": "m", "threads": 2, "decode_tokens_per_s": 80.0, "prefill_tokens_per_s": 1000.0,
        "prefill_tokens": 256, "batch_ms": {"1": 12.5, "2": 22.0}, "runs": 5,
        "batch_cost": {"1": 1.0, "2": 1.76, "4": 3.06},
    }))
    rc, out, _ = cli(capsys, "--from-perf", str(perf), "--stages", "2", "--tokens", "40", "--seeds", "1",
                     "--strategies", "iterative,pipeinfer", "--json")
    assert rc == 0
    result = json.loads(out)
    assert result["config"]["stage_ms"] == [6.25, 6.25]  # 1000/80 ms split over 2 stages
    assert result["config"]["batch_cost"] == [[1, 1.0], [2, 1.76], [4, 3.06]]
    assert result["config"]["prefill_ms"] == 1.0
    assert set(result["results"]) == {"iterative", "pipeinfer"}
    assert result["results"]["iterative"]["speed_vs_iterative"] == 1.0


def test_cli_trends_table_and_plot(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = cli(capsys, "--trends", "--tokens", "30", "--seeds", "1")
    assert rc == 0
    assert "(b) tokens/s against nodes, one node 3.0x slower" in out
    assert "└─" in out and "P pipeinfer" in out


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is not None, reason="matplotlib is installed")
def test_cli_png_without_matplotlib_says_what_to_install(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    rc, out, err = cli(capsys, "--trends", "--tokens", "10", "--seeds", "1", "--png", str(tmp_path / "f.png"))
    assert rc == 2 and out == ""  # refused before any work
    assert "pip install matplotlib" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "args",
    [
        ["--from-perf", "missing.json"],
        ["--from-perf", "{bad}"],
        ["--stage-ms", "5,x"],
        ["--stage-ms", "5,-1"],
        ["--alpha", "1.5"],
        ["--alpha", "abc"],
        ["--stages", "0"],
        ["--batch-cost", "2:1.5"],
        ["--batch-cost", "1-1"],
        ["--strategies", "bogus"],
        ["--tokens", "0"],
        ["--png", "x.png"],
        ["--model-ms", "0"],
        ["--trends", "--model-ms", "-5"],
        ["--fit-iterative", "1000"],
        ["--sample-ms", "1e308"],
        ["--msg-ms", "-1"],
        ["--run-ms", "1e308"],
        ["--stages", "99999999999999999999"],
        ["--batch-cost", "1:1,2:1e300"],
        ["--fit-iterative", "40", "--latency-ms", "1"],
        ["--conversations", "0,4"],
        ["--conversations", "2,x"],
        ["--conversations", "1.5"],
        ["--conversations", "999"],
        ["--conversations", "1,4", "--trends"],
    ],
)
def test_cli_bad_input_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                   monkeypatch: pytest.MonkeyPatch, args: list[str]) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "{bad}").write_text("{\"decode_tokens_per_s\": 10}")
    rc, out, err = cli(capsys, *args)
    assert rc == 2
    assert out == ""
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_text_plot_puts_equal_points_side_by_side() -> None:
    from potluck.app.commands.simulate import text_plot

    lines = text_plot({"iterative": [1.0, 2.0], "pipeinfer": [1.0, 2.0], "speculative": [1.0, 2.0]}, [1, 2])
    assert "iPs" in lines[0]  # the last column too
    assert "iPs" in "".join(lines)


def test_perf_report_sets_the_stages() -> None:
    from potluck.engine.lab.sim_config import PerfTiming

    timing = PerfTiming.from_report({"decode_tokens_per_s": 50.0, "batch_cost": {"1": 1.0, "4": 2.5}})
    cfg = timing.config(4)
    assert cfg.stage_ms == (5.0,) * 4 and cfg.batch_cost == ((1, 1.0), (4, 2.5)) and cfg.prefill_ms == 0.0
    with pytest.raises(PotluckError):
        PerfTiming.from_report({"decode_tokens_per_s": 0.0, "batch_cost": {"1": 1.0}})


def test_cli_trends_take_explicit_link_settings(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = cli(capsys, "--trends", "--tokens", "20", "--seeds", "1", "--json",
                     "--latency-ms", "0.1", "--bandwidth-mbps", "20000", "--model-ms", "100")
    assert rc == 0
    setting = json.loads(out)["setting"]
    assert (setting["latency_ms"], setting["bandwidth_mbps"], setting["model_ms"]) == (0.1, 20000.0, 100.0)
    assert setting["draft_ms"] == 6.0  # not given: the paper's setting


def test_fit_latency_makes_iterative_match_a_measurement() -> None:
    from potluck.engine.lab.simulate import fit_latency

    cfg = fit_latency(replace(FOUR, stage_ms=(10.0, 10.0)), 40.0)  # 25 ms a token, 20.1 of it computed
    assert cfg.latency_ms > 1.0
    assert run(cfg, "iterative")["iterative"]["tok_s"] == pytest.approx(40.0, rel=1e-6)
    with pytest.raises(PotluckError, match="faster than the stages"):
        fit_latency(replace(FOUR, stage_ms=(10.0, 10.0)), 60.0)


def test_code_rule_caps_speculative_runs_by_the_recovery_factor() -> None:
    # potluck's strategy counts the speculative runs in flight: with the paper's 0.4,
    # p_accept + 3 * 0.4 > 1 stops a 4th; its default (1 / (stages + 1)) fills 8 stages
    cfg = replace(FOUR, stage_ms=(1.5,) * 8, alpha=1.0, cutoff_rule="code")
    capped = run(replace(cfg, recovery=0.4), "pipeinfer")["pipeinfer"]
    assert capped["max_in_flight"] == 4  # 3 speculative + the own token's run
    deeper = run(cfg, "pipeinfer")["pipeinfer"]
    assert deeper["max_in_flight"] == 9  # stages + 1
    assert deeper["busy_mean"] > capped["busy_mean"] + 0.2


# --- shared cores (loopback workers on one machine) ---

TWO = SimConfig(stage_ms=(6.0, 6.0), head_ms=1.0, draft_ms=0.05, tokens=120, seeds=2)


def test_enough_cores_change_nothing() -> None:
    # one mechanism: with a core for everything that can compute at once, the shared
    # model is the default one, figure for figure
    cfg = replace(TWO, alpha=0.6, p_none=0.1)
    own, shared = simulate(cfg)["results"], simulate(replace(cfg, cores=64))["results"]
    assert own == shared
    assert own["pipeinfer"]["max_computing"] >= 3 and own["pipeinfer"]["contended"] == 0.0


def test_one_core_slows_pipeinfer_not_iterative() -> None:
    cfg = replace(TWO, alpha=0.8)
    own = run(cfg, "iterative", "pipeinfer")
    one = run(replace(cfg, cores=1), "iterative", "pipeinfer")
    assert own["iterative"] == one["iterative"]  # one thing computes at a time
    assert one["iterative"]["max_computing"] == 1 and one["iterative"]["contended"] == 0.0
    gain_own = own["pipeinfer"]["speed_vs_iterative"]
    gain_one = one["pipeinfer"]["speed_vs_iterative"]
    assert gain_own > 1.2
    assert gain_one < gain_own - 0.3  # micro-batches take the core the own token needs
    assert one["pipeinfer"]["contended"] > 0.3 and one["pipeinfer"]["max_computing"] >= 2
    for r in (*own.values(), *one.values()):
        assert all(0.0 <= b <= 1.0 + 1e-9 for b in r["stage_busy"])


def test_shared_cores_keep_aborts_and_determinism() -> None:
    cfg = replace(TWO, alpha=0.5, cores=1, seeds=2)
    r = simulate(cfg)
    assert r == simulate(cfg)
    p = r["results"]["pipeinfer"]
    assert p["cancelled"] > 0 and p["aborted"] > 0 and p["contended"] > 0
    assert simulate(replace(cfg, seeds=3))["results"]["pipeinfer"] != p


def test_fit_latency_holds_with_shared_cores() -> None:
    from potluck.engine.lab.simulate import fit_latency

    for cores in (1, 2):
        cfg = fit_latency(replace(TWO, cores=cores), 50.0)
        assert run(cfg, "iterative")["iterative"]["tok_s"] == pytest.approx(50.0, rel=1e-6)


def test_cli_cores(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = cli(capsys, "--stages", "2", "--cores", "2", "--tokens", "40", "--seeds", "1", "--json")
    assert rc == 0 and json.loads(out)["config"]["cores"] == 2
    rc, out, _ = cli(capsys, "--stages", "2", "--cores", "1", "--tokens", "40", "--seeds", "1")
    assert rc == 0 and "1 shared core;" in out
    rc, out, err = cli(capsys, "--cores", "-1")
    assert rc == 2 and out == ""
    assert "--cores must be between 0 and 1024" in err and len(err.strip().splitlines()) == 1


def test_per_message_work_weighs_on_many_small_runs() -> None:
    """The same measured synchronous speed, with part of its time moved from link latency
    into CPU per job and per message: iterative decoding is unchanged (it fits), PipeInfer,
    sending several runs a token on shared cores, slows down."""
    from potluck.engine.lab.simulate import fit_latency

    base = replace(TWO, alpha=0.7, cores=1)
    free = fit_latency(base, 40.0)
    dear = fit_latency(replace(base, run_ms=1.0, msg_ms=1.0), 40.0)
    assert dear.latency_ms == pytest.approx(free.latency_ms - (2 * 1.0 + 3 * 1.0) / 3)
    a, b = run(free, "iterative", "pipeinfer"), run(dear, "iterative", "pipeinfer")
    assert a["iterative"]["tok_s"] == pytest.approx(40.0) and b["iterative"]["tok_s"] == pytest.approx(40.0)
    assert b["pipeinfer"]["runs"] > 1.2 * b["iterative"]["runs"]
    assert b["pipeinfer"]["tok_s"] < 0.9 * a["pipeinfer"]["tok_s"]


def test_message_cpu_runs_beside_the_message() -> None:
    """With a core to spare, a message's CPU delays nothing in synchronous decoding: the
    fitted latency only loses the per-job cost; on one core it is in the way, and the fit
    finds the latency by bisection that still matches the measurement."""
    from potluck.engine.lab.simulate import fit_latency

    free = fit_latency(replace(TWO, cores=2), 40.0)
    spare = fit_latency(replace(TWO, cores=2, run_ms=1.0, msg_ms=1.0), 40.0)
    assert spare.latency_ms == pytest.approx(free.latency_ms - 2 * 1.0 / 3)
    tight = fit_latency(replace(TWO, cores=1, run_ms=1.0, msg_ms=0.5), 40.0)
    assert tight.latency_ms < spare.latency_ms
    assert run(tight, "iterative")["iterative"]["tok_s"] == pytest.approx(40.0, rel=1e-4)


def test_the_head_loop_decides_with_the_strategys_own_speculation() -> None:
    """The model's 'code' reading is pipeinfer's Speculation itself: the same sends, room,
    bar and decline bookkeeping as the strategy, step by step over one trace of rounds."""
    from potluck.engine.lab.sim_head import READINGS
    from potluck.engine.speculation.strategies.pipeinfer import Cutoff, Speculation

    assert issubclass(READINGS["code"], Speculation)
    args = (Cutoff(), 4, 3, True, 2)
    strategy, model = Speculation(*args), READINGS["code"](*args)
    # (runs in flight, speculative ones, guesses in flight, remaining, result waiting, accepted, own)
    trace = [(1, 0, 0, 50, False, 0, True), (2, 1, 4, 49, False, 3, False), (3, 2, 8, 40, True, 0, True),
             (1, 1, 2, 3, False, 2, False), (0, 0, 0, 1, False, 0, True)]
    for n_runs, n_spec, n_guesses, remaining, waiting, accepted, own in trace:
        strategy.decided(accepted, own)
        model.settled(accepted, own, whole=False)
        assert model.may_send(n_runs, n_spec) == strategy.may_send(n_runs, n_spec)
        assert model.room(remaining, n_guesses) == strategy.room(remaining, n_guesses)
        assert model.bar(n_spec) == strategy.bar(n_spec)
        strategy.declined(waiting)
        model.declined(waiting)
        assert model.declines == strategy.declines
    assert strategy.declines > 0 and strategy.room(1, 0) == 0 and not strategy.may_send(3, 0)


# --------------------------------------------------------------------------- several conversations


def test_lanes_on_one_stage_share_every_step() -> None:
    """One machine: every conversation's row in one batch a step; the gain is what a batch of
    four rows saves over four single steps (the batch-cost curve), nothing more."""
    cfg = SimConfig(stage_ms=(12.0,), tokens=50, sample_ms=0.0, latency_ms=0.0)
    r = simulate_lanes(cfg, (1, 4))["results"]
    assert r[1]["rows_per_batch"] == 1 and r[4]["rows_per_batch"] == 4
    assert r[4]["max_in_flight"] == 1 and r[4]["batches"] == 50
    assert r[4]["gain_vs_one"] == pytest.approx(4 / batch_cost_fn(cfg.batch_cost)(4), rel=0.02)


def test_lanes_fill_a_pipeline_one_micro_batch_a_stage() -> None:
    """Three stages, four conversations: four micro-batches of one conversation in flight
    (one a stage, one waiting), every stage busy, about three times one conversation."""
    cfg = SimConfig(stage_ms=(4.0,) * 3, tokens=100)
    r = simulate_lanes(cfg, (1, 4, 8))["results"]
    assert r[1]["max_in_flight"] == 1 and max(r[1]["stage_busy"]) < 0.4
    assert r[4]["max_in_flight"] == 4 and r[4]["rows_per_batch"] == 1
    assert min(r[4]["stage_busy"]) > 0.95 and r[4]["gain_vs_one"] > 2.7
    assert r[8]["rows_per_batch"] == 2 and r[8]["tok_s"] > r[4]["tok_s"]  # bigger micro-batches once all are busy


def test_lanes_on_shared_cores_are_held_back_by_the_cores() -> None:
    """Loopback: three stages on two cores cannot all compute at once."""
    cfg = SimConfig(stage_ms=(4.0,) * 3, tokens=100)
    own = simulate_lanes(cfg, (1, 4))["results"][4]
    shared = simulate_lanes(replace(cfg, cores=2), (1, 4))["results"][4]
    assert shared["contended"] > 0.5 and shared["gain_vs_one"] < own["gain_vs_one"]


def test_cli_conversations(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = cli(capsys, "--stages", "3", "--tokens", "40", "--conversations", "1,4")
    assert rc == 0 and "vs one" in out
    assert [line.split()[0] for line in out.splitlines()[2:]] == ["1", "4"]
