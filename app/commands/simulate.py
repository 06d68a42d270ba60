"""`potluck simulate`: the discrete-event model of the LAN pipeline (engine/lab/simulate.py).

Compares iterative, synchronous speculative, pipelined speculative and PipeInfer decoding
for per-stage compute times measured by `potluck perf` (``--from-perf``) or given, and with
``--trends`` reproduces the PipeInfer paper's trend figures at 1-32 nodes as tables and
text plots (a PNG too with ``--png`` where matplotlib is installed), and with
``--conversations 1,2,4`` models several conversations decoded together (a server's lanes,
engine/lab/sim_lanes.py). Its figures are
predictions, not measurements: check them against loopback runs (``--fit-iterative`` takes
one measured speed to fix the per-hop cost of real sockets).
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

from ...engine import PotluckError
from ...engine.lab.sim_config import CUTOFF_RULES, STRATEGIES, PerfTiming, SimConfig, check_batch_cost
from ...engine.lab.sim_lanes import simulate_lanes
from ...engine.lab.simulate import TrendSetting, fit_latency, simulate, trends
from ..cli import COMMANDS

DEFAULT_MODEL_MS = 12.0  # SmolLM2-135M, one token on 2 threads (docs/facts.md §6)
MARKERS = {"iterative": "i", "speculative": "s", "pipelined": "p", "pipeinfer": "P",
           "pipeinfer-nocancel": "c", "pipeinfer-nocontinuous": "n"}
FIGURES = {
    "tok_s_high": "(a) tokens/s against nodes, high acceptance",
    "tok_s_low": "(a) tokens/s against nodes, low acceptance",
    "tok_s_slow": "(b) tokens/s against nodes, one node {slow}x slower",
    "ttft_ms": "(c) TTFT (ms) against nodes, high acceptance",
}


def add_parser(sub: argparse._SubParsersAction) -> None:
    d = SimConfig()
    p = sub.add_parser(
        "simulate",
        help=COMMANDS["simulate"],
        description="A discrete-event model of potluck's LAN pipeline (stages, links, the head's drafting "
        "and sampling, cancellation). Prints tokens/s, speed against iterative decoding, TTFT, each "
        "stage's busy fraction and the runs cancelled, as means over --seeds seeds.",
    )
    g = p.add_argument_group("pipeline")
    g.add_argument("--stages", type=int, default=2, help="stages, the model split evenly (default 2)")
    g.add_argument("--stage-ms", help="ms of one token on each stage, e.g. 5.1,5.3 (overrides --stages)")
    g.add_argument("--model-ms", type=float, default=None,
                   help=f"ms of one token through the whole model, split evenly (default {DEFAULT_MODEL_MS})")
    g.add_argument("--from-perf", type=Path, metavar="FILE.json",
                   help="`potluck perf --json` output: its decode speed and batch-cost curve")
    g.add_argument("--batch-cost", help="batch cost relative to one token, k:cost,... (default: the bundled "
                   "model measured on 2 cores, 1:1,2:1.76,4:3.06,8:5.55,16:11.07)")
    g.add_argument("--head-ms", type=float, default=d.head_ms, help="the head's output layer, ms a token")
    g.add_argument("--sample-ms", type=float, default=d.sample_ms, help="sampling one run's result, ms")
    g.add_argument("--run-ms", type=float, default=d.run_ms, help="a stage's fixed cost per job, whatever its rows")
    g.add_argument("--msg-ms", type=float, default=d.msg_ms,
                   help="CPU one message burns at its receiver, beside it (sockets, pipes); counts only with --cores")
    g.add_argument("--latency-ms", type=float, help=f"one message on one link (default {d.latency_ms})")
    g.add_argument("--bandwidth-mbps", type=float, help=f"link bandwidth, Mbit/s (default {d.bandwidth_mbps:g})")
    g.add_argument("--n-embd", type=int, help=f"hidden size: n_embd*4 bytes a token a link (default {d.n_embd})")
    g.add_argument("--return-bytes", type=int, default=d.return_bytes,
                   help="bytes a token on the return link (default: the hidden state; 196608 for logits)")
    g.add_argument("--fit-iterative", type=float, metavar="TOK_S",
                   help="a measured speed of the synchronous pipeline: sets --latency-ms so that 'iterative' "
                   "decodes at it (the per-hop cost of real sockets), the other strategies become predictions")
    g.add_argument("--cores", type=int, default=d.cores,
                   help="cores that the stages and the head all share (default 0: each on its own machine; "
                   "N models loopback workers on one N-core machine)")
    g.add_argument("--skip-ms", type=float, default=d.skip_ms, help="a stage skipping a cancelled run")
    g.add_argument("--abort-ms", type=float, default=d.abort_ms, help="a stage stopping a run mid-compute")
    s = p.add_argument_group("decoding")
    s.add_argument("--alpha", type=float, default=d.alpha, help="chance a drafted token is accepted")
    s.add_argument("--p-none", type=float, default=d.p_none, help="chance the drafter has no guess")
    s.add_argument("--draft-ms", type=float, help="ms a drafted token (default 0: N-gram lookups)")
    s.add_argument("--k", type=int, default=d.k, help="draft length of speculative and pipelined (default 4)")
    s.add_argument("--max-runs", type=int, default=d.max_runs, help="runs in flight (default: stages + 1)")
    s.add_argument("--max-draft", type=int, default=d.max_draft, help="pipeinfer-nocontinuous's run size")
    s.add_argument("--p-accept", type=float, default=d.p_accept, help="PipeInfer cutoff base (paper 0.001)")
    s.add_argument("--recovery", type=float, default=d.recovery,
                   help="cutoff recovery factor (default: min(0.4, 1 / (stages + 1)), as the strategy; paper 0.4)")
    s.add_argument("--decay", type=float, default=d.decay, help="cutoff decay factor (paper 0.01)")
    s.add_argument("--cutoff-rule", choices=CUTOFF_RULES, default=None,
                   help="how the cutoff's counters reset: 'paper' as PipeInfer's paper writes it, 'reference' as its "
                   "authors' code does, 'code' as potluck's strategy does (default: 'code', and 'reference' "
                   "for --trends)")
    s.add_argument("--strategies", default=None, help=f"comma-separated, from {','.join(STRATEGIES)} (default all)")
    r = p.add_argument_group("run")
    r.add_argument("--tokens", type=int, default=d.tokens, help="tokens generated per conversation")
    r.add_argument("--seeds", type=int, default=d.seeds, help="conversations (seeds) averaged")
    r.add_argument("--prompt-tokens", type=int, default=d.prompt_tokens, help="prompt prefilled first")
    r.add_argument("--n-batch", type=int, default=d.n_batch, help="prefill chunk size")
    r.add_argument("--prefill-ms", type=float, default=None, help="whole model, ms a prompt token (default: "
                   "--from-perf's prefill speed, else the batch-cost curve)")
    r.add_argument("--conversations", metavar="N,N,...",
                   help="conversations decoded together (a server's lanes, plain decoding): aggregate tokens/s "
                   "for each count and the gain over one, e.g. 1,2,4")
    r.add_argument("--json", action="store_true", help="print one JSON object")
    r.add_argument("--trends", action="store_true",
                   help="the paper's trend figures at 1-32 nodes (a big target split evenly, gigabit LAN); "
                   "--model-ms, --draft-ms, --latency-ms, --bandwidth-mbps, --n-embd and --batch-cost change "
                   "that setting")
    r.add_argument("--png", type=Path, metavar="FILE", help="with --trends: also write the figures as a PNG")


def run(args: argparse.Namespace) -> int:
    if args.png and not args.trends:
        raise PotluckError("simulate: --png draws the --trends figures; add --trends")
    plt = pyplot() if args.png else None  # refused before any work when matplotlib is missing
    cfg = config_from_args(args)
    if args.conversations:
        if args.trends:
            raise PotluckError("simulate: --conversations and --trends are separate tables; pick one")
        lanes = simulate_lanes(cfg, parse_counts(args.conversations))
        if args.json:
            print(json.dumps(lanes))
        else:
            print_lanes(lanes)
        return 0
    if args.trends:
        rule = args.cutoff_rule or "reference"
        setting = trend_setting(args)
        if args.strategies:
            setting = replace(setting, strategies=cfg.strategies)
        result = trends(replace(cfg, cutoff_rule=rule), setting)
        if args.json:
            print(json.dumps(result))
        else:
            print_trends(result, rule)
        if plt is not None:
            write_png(plt, result, args.png)
            if not args.json:
                print(f"figures written to {args.png}")
        return 0
    result = simulate(cfg)
    if args.json:
        print(json.dumps(result))
    else:
        print_table(result)
    return 0


def trend_setting(args: argparse.Namespace) -> TrendSetting:
    """The paper's setting, with what the user gave explicitly."""
    t = TrendSetting()
    given = {
        "model_ms": args.model_ms, "draft_ms": args.draft_ms, "latency_ms": args.latency_ms,
        "bandwidth_mbps": args.bandwidth_mbps, "n_embd": args.n_embd,
        "batch_cost": parse_batch_cost(args.batch_cost) if args.batch_cost else None,
    }
    t = replace(t, **{k: v for k, v in given.items() if v is not None})
    if not (t.model_ms > 0 and math.isfinite(t.model_ms)):
        raise PotluckError(f"simulate: --model-ms must be a positive number, got {t.model_ms}")
    return t


def config_from_args(args: argparse.Namespace) -> SimConfig:
    batch_cost = parse_batch_cost(args.batch_cost) if args.batch_cost else None
    model_ms, prefill_ms = args.model_ms, args.prefill_ms
    if args.from_perf:
        perf = read_perf(args.from_perf)
        model_ms = model_ms if model_ms is not None else perf.model_ms
        prefill_ms = prefill_ms if prefill_ms is not None else perf.prefill_ms
        batch_cost = batch_cost or perf.batch_cost
    if args.stage_ms:
        stage_ms = tuple(parse_floats(args.stage_ms, "--stage-ms"))
    else:
        if not 1 <= args.stages <= 256:
            raise PotluckError(f"simulate: --stages must be between 1 and 256, got {args.stages}")
        total = DEFAULT_MODEL_MS if model_ms is None else model_ms
        stage_ms = (total / args.stages,) * args.stages
    strategies = tuple(s.strip() for s in args.strategies.split(",") if s.strip()) if args.strategies else STRATEGIES
    d = SimConfig()
    cfg = SimConfig(
        stage_ms=stage_ms, head_ms=args.head_ms, sample_ms=args.sample_ms, run_ms=args.run_ms, msg_ms=args.msg_ms,
        draft_ms=d.draft_ms if args.draft_ms is None else args.draft_ms,
        latency_ms=d.latency_ms if args.latency_ms is None else args.latency_ms,
        bandwidth_mbps=d.bandwidth_mbps if args.bandwidth_mbps is None else args.bandwidth_mbps,
        n_embd=d.n_embd if args.n_embd is None else args.n_embd,
        return_bytes=args.return_bytes, alpha=args.alpha, p_none=args.p_none, tokens=args.tokens,
        seeds=args.seeds, prompt_tokens=args.prompt_tokens, n_batch=args.n_batch, k=args.k,
        max_runs=args.max_runs, max_draft=args.max_draft, p_accept=args.p_accept, recovery=args.recovery,
        decay=args.decay, cutoff_rule=args.cutoff_rule or "code", skip_ms=args.skip_ms,
        abort_ms=args.abort_ms, strategies=strategies, prefill_ms=prefill_ms or 0.0, cores=args.cores,
    )
    if batch_cost:
        cfg = replace(cfg, batch_cost=batch_cost)
    if args.fit_iterative is not None:
        if args.latency_ms is not None:
            raise PotluckError("simulate: --fit-iterative sets the latency; leave out --latency-ms")
        return fit_latency(cfg, args.fit_iterative)
    return cfg.check()


def parse_floats(text: str, flag: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",")]
    except ValueError:
        raise PotluckError(f"simulate: {flag} takes numbers separated by commas, got {text!r}") from None
    if not all(math.isfinite(v) and v > 0 for v in values):
        raise PotluckError(f"simulate: {flag} takes positive numbers, got {text!r}")
    return values


def parse_counts(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise PotluckError(f"simulate: --conversations takes whole numbers separated by commas, got {text!r}") from None


def parse_batch_cost(text: str) -> tuple[tuple[int, float], ...]:
    try:
        points = tuple((int(k), float(c)) for k, c in (item.split(":") for item in text.split(",")))
    except ValueError:
        raise PotluckError(f"simulate: --batch-cost takes k:cost pairs like 1:1,2:1.76,4:3.06, got {text!r}") from None
    check_batch_cost(points)
    return points


def read_perf(path: Path) -> PerfTiming:
    try:
        report = json.loads(path.read_text())
    except OSError as e:
        raise PotluckError(
            f"simulate: cannot read {path}: {e.strerror or e}; write it with `potluck perf --json > FILE.json`"
        ) from None
    except ValueError:
        report = None
    if not isinstance(report, dict):
        raise PotluckError(f"simulate: {path} is not JSON from `potluck perf --json`; write it with "
                           "`potluck perf --json > FILE.json`")
    return PerfTiming.from_report(report, str(path))


def print_table(result: dict) -> None:
    cfg, rows = result["config"], result["results"]
    stages = cfg["stage_ms"]
    per_stage_ms = ", ".join(f"{ms:.2f}" for ms in stages)
    print(f"{len(stages)} stages ({per_stage_ms} ms a token), link {cfg['latency_ms']:.3g} ms + "
          f"{cfg['bandwidth_mbps']:g} Mbit/s, alpha {cfg['alpha']}, draft {cfg['draft_ms']} ms a token, "
          f"cutoff rule {cfg['cutoff_rule']}, "
          + (f"{cfg['cores']} shared core{'s' * (cfg['cores'] > 1)}" if cfg["cores"] else "a machine each")
          + f"; means of {cfg['seeds']} x {cfg['tokens']} tokens")
    per_stage = len(stages) <= 4
    busy_head = "busy per stage" if per_stage else "busy (mean)"
    print(f"{'strategy':<24}{'tok/s':>8}{'vs iter':>9}{'TTFT ms':>9}{'e2e ms':>9}  {busy_head:<20}"
          f"{'cancel':>7}{'wasted':>7}{'tok/run':>8}")
    for name, r in rows.items():
        busy = "/".join(f"{b:.2f}" for b in r["stage_busy"]) if per_stage else f"{r['busy_mean']:.2f}"
        vs = f"{r['speed_vs_iterative']:.2f}x" if r["speed_vs_iterative"] is not None else "-"
        print(f"{name:<24}{r['tok_s']:8.1f}{vs:>9}{r['ttft_ms']:9.1f}{r['ttft_e2e_ms']:9.1f}  {busy:<20}"
              f"{r['cancelled']:7.1f}{r['wasted']:7.1f}{r['tokens_per_run']:8.2f}")


def print_lanes(result: dict) -> None:
    cfg, rows = result["config"], result["results"]
    stages = cfg["stage_ms"]
    print(f"{len(stages)} stages ({', '.join(f'{ms:.2f}' for ms in stages)} ms a token), link "
          f"{cfg['latency_ms']:.3g} ms + {cfg['bandwidth_mbps']:g} Mbit/s, sampling {cfg['sample_ms']:g} ms a row, "
          + (f"{cfg['cores']} shared core{'s' * (cfg['cores'] > 1)}" if cfg["cores"] else "a machine each")
          + f"; {cfg['tokens']} tokens a conversation, plain decoding")
    per_stage = len(stages) <= 4
    busy_head = "busy per stage" if per_stage else "busy (mean)"
    print(f"{'conversations':<14}{'tok/s':>8}{'each':>8}{'vs one':>8}{'rows/batch':>11}{'in flight':>10}  {busy_head}")
    for n, r in rows.items():
        busy = "/".join(f"{b:.2f}" for b in r["stage_busy"]) if per_stage else f"{r['busy_mean']:.2f}"
        vs = f"{r['gain_vs_one']:.2f}x" if r["gain_vs_one"] is not None else "-"
        print(f"{n:<14}{r['tok_s']:8.1f}{r['per_conversation_tok_s']:8.1f}{vs:>8}{r['rows_per_batch']:11.2f}"
              f"{r['max_in_flight']:10d}  {busy}")


def print_trends(result: dict, rule: str) -> None:
    st, nodes = result["setting"], result["nodes"]
    print(f"PipeInfer trends: a {st['model_ms']:g} ms/token target split evenly over N nodes, draft "
          f"{st['draft_ms']:g} ms/token, link {st['latency_ms']:g} ms + {st['bandwidth_mbps']:g} Mbit/s, "
          f"n_embd {st['n_embd']}, acceptance {st['high_alpha']} (high) / {st['low_alpha']} (low), "
          f"cutoff rule {rule}")
    for key, title in FIGURES.items():
        series = result["figures"][key]
        print()
        print(title.format(slow=st["slow_factor"]))
        print(f"{'nodes':<14}" + "".join(f"{n:>9}" for n in nodes))
        for name, values in series.items():
            print(f"{name:<14}" + "".join(f"{v:9.1f}" for v in values))
        print()
        for line in text_plot(series, nodes):
            print(line)


def text_plot(series: dict[str, list[float]], xs: list[int], height: int = 10, step: int = 8) -> list[str]:
    """Markers on a character grid (one column slot per x, evenly spaced as the x are powers
    of two); where two series meet, the later one's marker goes beside the first."""
    top = max(max(v) for v in series.values()) or 1.0
    width = step * (len(xs) - 1) + 4  # room beside the last points
    grid = [[" "] * width for _ in range(height)]
    for name, values in series.items():
        mark = MARKERS.get(name, name[0])
        for j, v in enumerate(values):
            row = height - 1 - round(v / top * (height - 1))
            col = j * step
            while grid[row][col] != " " and col < min(j * step + step - 2, width - 1):
                col += 1  # a point already there: put this one beside it
            grid[row][col] = mark
    label_w = len(f"{top:.1f}")
    lines = []
    for i, row in enumerate(grid):
        label = f"{top:.1f}" if i == 0 else (f"{0.0:.1f}" if i == height - 1 else "")
        lines.append(f"{label:>{label_w}} │ " + "".join(row))
    lines.append(" " * label_w + " └─" + "─" * width)
    lines.append(" " * (label_w + 3) + "".join(f"{x:<{step}}" for x in xs).rstrip() + "  nodes")
    lines.append(" " * (label_w + 3) + "  ".join(f"{MARKERS.get(n, n[0])} {n}" for n in series))
    return lines


def pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PotluckError("simulate: --png needs matplotlib, which is not installed: pip install matplotlib") from None
    return plt


def write_png(plt: Any, result: dict, path: Path) -> None:
    nodes = result["nodes"]
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, (key, title) in zip(axes.flat, FIGURES.items()):
        for name, values in result["figures"][key].items():
            ax.plot(nodes, values, marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xticks(nodes, [str(n) for n in nodes])
        ax.set_xlabel("nodes")
        ax.set_title(title.format(slow=result["setting"]["slow_factor"]), fontsize=9)
        ax.legend(fontsize=8)
    fig.tight_layout()
    try:
        fig.savefig(path)
    except OSError as e:
        raise PotluckError(f"simulate: cannot write {path}: {e.strerror or e}") from None
    finally:
        plt.close(fig)
