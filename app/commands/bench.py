"""`potluck bench`: decoding strategies side by side on shipped prompt families.

Also builds the synthetic benchmark targets (``--build-fixtures``), measures the N-gram
drafter's cost per token at growing context sizes (``--ngram-scaling``), and compares the
chat app's streaming speed with `potluck generate`, quiet and with one core busy
(``--chat-parity [--load]``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from ...engine import PotluckError, resolve_model, validate
from ...engine.lab.benchmark import (
    BASELINE,
    FAMILIES,
    LONG_FAMILY,
    OLD_NAMES,
    PROMPT_LOOKUP,
    BenchConfig,
    BenchRow,
    ngram_scaling,
    run_bench,
)
from ...engine.lab.cluster_bench import ClusterBenchConfig, ClusterRow
from ...engine.lab.fixtures import RECIPES, build_all, build_fixture
from ...engine.lab.shapes import SHAPE_NAMES, build_named_shape
from ..cli import COMMANDS
from .common import positive_int


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help=COMMANDS["bench"],
        description="Runs strategies side by side in one process on the same prompts "
        "(greedy) and reports tokens/s, speedup vs plain decoding, acceptance and whether "
        f"the output is identical to plain decoding. Baselines: {BASELINE} and '{PROMPT_LOOKUP}' "
        "(llama-cpp-python's LlamaPromptLookupDecoding).",
    )
    p.add_argument("-m", "--model", type=Path, help="target GGUF (default: the bundled model)")
    p.add_argument(
        "--target-recipe",
        metavar="RECIPE",
        help="use a synthetic target built from the bundled model's layers "
        f"(e.g. {', '.join(RECIPES)}); the bundled model becomes the default draft",
    )
    p.add_argument("--draft", type=Path, help="draft GGUF for 'sd' (and for 'pearl' and 'minions')")
    p.add_argument(
        "--strategies",
        default=None,
        help=f"comma-separated names, '{PROMPT_LOOKUP}' for llama-cpp-python's prompt lookup ('peer' before) "
        f"(default: anpd,minions,pearl,{PROMPT_LOOKUP}, plus sd when a draft is given); plain decoding "
        "always runs as the baseline",
    )
    p.add_argument(
        "--families",
        default=",".join(FAMILIES),
        help=f"prompt families (default: {','.join(FAMILIES)}; also '{LONG_FAMILY}': 2K-8K-token documents, "
        "with --ctx 8192); a path to a .txt file of your own prompts (separated by %%%% lines) is a family too",
    )
    p.add_argument("--max-tokens", type=positive_int, default=128, help="tokens per reply (128)")
    p.add_argument("--reps", type=positive_int, default=3, help="repetitions; medians are reported (3)")
    p.add_argument(
        "--ctx", type=positive_int, default=None, help=f"context size (4096; 8192 with the '{LONG_FAMILY}' family)"
    )
    p.add_argument("-t", "--threads", type=int, default=0, help="CPU threads (default: all cores)")
    p.add_argument(
        "--temp", type=float, default=0.0,
        help="sample every reply at this temperature with llama.cpp's default filters (top-k 40, top-p 0.95, "
        "min-p 0.05), one seed per prompt for every strategy (default 0: greedy)",
    )
    p.add_argument(
        "--kv", default="bf16", choices=sorted(validate.KV_CACHES),
        help="the target's KV cache: bf16 (default; prompts prefilled at F16's speed) or f16 (1-token steps "
        "on one thread)",
    )
    p.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="strategy option, e.g. max_draft=7, ngram_max=5, adaptive=false (repeatable)",
    )
    p.add_argument("--json", action="store_true", help="print a JSON array, one object per row")
    p.add_argument(
        "--build-fixtures",
        action="store_true",
        help=f"build the synthetic targets ({', '.join(RECIPES)}) and exit",
    )
    p.add_argument(
        "--shape",
        choices=list(SHAPE_NAMES),
        help="with --build-fixtures: build only a random-weight GGUF in this model's published shape "
        "(Llama 1b, 3b, 8b; qwen3-30b-a3b, gpt-oss-20b, gpt-oss-120b, deepseek-v2-lite; qwen35moe-35b-a3b: "
        "Qwen3.5's MoE hybrid; *-small and wide: the test suite's) and print its path on the last line",
    )
    p.add_argument(
        "--layers", type=positive_int, default=None,
        help="with --shape: this many layers of the shape's width instead of all (a full-depth 20B is 12 GB)",
    )
    p.add_argument("--fixture-seed", type=int, default=0, help="with --shape: the seed of the random weights")
    p.add_argument(
        "--ngram-scaling",
        action="store_true",
        help="measure the N-gram drafter's cost per token at growing context sizes and exit",
    )
    p.add_argument(
        "--chat-parity",
        action="store_true",
        help="stream the same reply through the chat app (headless) and `potluck generate` and "
        "compare tokens/s; uses -m, --max-tokens, --reps, --ctx, --threads, --prompt",
    )
    p.add_argument(
        "--load",
        action="store_true",
        help="with --chat-parity: repeat both with a background process spinning one core",
    )
    p.add_argument("--prompt", help="with --chat-parity: the user message (default: a short story)")
    c = p.add_argument_group("cluster bench (synchronous pipeline, anpd/sd over it, pipeinfer and its ablations)")
    c.add_argument(
        "--cluster", type=positive_int, metavar="N",
        help="start N `potluck worker`s on loopback (1 thread each) and bench the pipeline over them",
    )
    c.add_argument("--nodes", help="bench the pipeline over these running workers (host:port,... in order)")
    c.add_argument("--token-file", type=Path, help="with --nodes: the cluster token's file (default: $POTLUCK_TOKEN)")
    c.add_argument("--split", help="with --cluster/--nodes: fixed layer boundaries of the workers' stages")
    c.add_argument(
        "--variants", help="with --cluster/--nodes: comma-separated variants (default: all; the baselines always run)"
    )


def _parse_options(items: list[str]) -> dict[str, object]:
    out: dict[str, object] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise PotluckError(f"--option expects KEY=VALUE, got {item!r}")
        value: object
        if raw.lower() in ("true", "false"):
            value = raw.lower() == "true"
        else:
            try:
                value = int(raw)
            except ValueError:
                try:
                    value = float(raw)
                except ValueError:
                    value = raw
        out[key] = value
    return out


def run(args: argparse.Namespace) -> int:
    if args.shape is not None and not args.build_fixtures:
        raise PotluckError("--shape only applies to --build-fixtures; add --build-fixtures")
    if args.layers is not None and args.shape is None:
        raise PotluckError("--layers only applies to --build-fixtures --shape NAME; add --shape")
    if args.build_fixtures and args.shape is not None:
        print(build_named_shape(args.shape, args.fixture_seed, layers=args.layers))
        return 0
    if args.build_fixtures:
        for fx in build_all():
            print(f"{fx.recipe:<12} {fx.n_layer:>4} layers  {fx.path}  ({RECIPES[fx.recipe]})")
        return 0
    if args.load and not args.chat_parity:
        raise PotluckError("--load only applies to --chat-parity; add --chat-parity or drop --load")
    if args.chat_parity:
        return _chat_parity(args)
    if args.cluster or args.nodes:
        return _cluster(args)
    for flag in ("token_file", "split", "variants"):
        if getattr(args, flag) is not None:
            raise PotluckError(f"--{flag.replace('_', '-')} only applies to --cluster or --nodes")
    if args.ngram_scaling:
        rows = ngram_scaling()
        if args.json:
            print(json.dumps(rows))
        else:
            print(f"{'context':>8}  {'us/token':>9}  {'prefill us/token':>16}  {'draft len':>9}")
            for r in rows:
                print(
                    f"{r['context_tokens']:>8}  {r['us_per_token']:>9.1f}  "
                    f"{r['prefill_us_per_token']:>16.2f}  {r['mean_draft_len']:>9.2f}"
                )
        return 0

    model, draft = args.model, args.draft
    if args.target_recipe:
        if model is not None:
            raise PotluckError("pass either -m or --target-recipe, not both")
        model = build_fixture(args.target_recipe).path
        draft = draft or resolve_model(None)
    families = tuple(f.strip() for f in args.families.split(",") if f.strip())
    long = LONG_FAMILY in families
    if args.strategies:
        names = tuple(OLD_NAMES.get(s.strip(), s.strip()) for s in args.strategies.split(",") if s.strip())
    elif long:
        names = ("triforce", "anpd") + (("sd",) if draft is not None else ())
    else:
        names = ("anpd", "minions", "pearl", PROMPT_LOOKUP) + (("sd",) if draft is not None else ())
    if "sd" in names and draft is None:
        raise PotluckError("strategy 'sd' needs a draft model: pass --draft PATH or --target-recipe")
    cfg = BenchConfig(
        model=model,
        draft=draft,
        recipe=args.target_recipe,
        strategies=names,
        families=families,
        max_tokens=args.max_tokens,
        reps=args.reps,
        n_ctx=validate.context_sizes(args.ctx or (8192 if long else 4096)).n_ctx,
        n_threads=validate.threads(args.threads, "--threads"),
        options=_parse_options(args.option),
        kv_cache=args.kv,
        temperature=args.temp,
    )
    progress = None if args.json else (lambda msg: print(f"  {msg}", file=sys.stderr, flush=True))
    rows = run_bench(cfg, progress)
    if args.json:
        print(json.dumps([r.as_json() for r in rows], ensure_ascii=False))
    else:
        print(format_table(rows))
    return 0


def _chat_parity(args: argparse.Namespace) -> int:
    from ..tui.parity import PROMPT, format_parity, run_parity

    model = None if args.model is None else resolve_model(args.model)
    prompt = validate.text("--prompt", args.prompt) if args.prompt else PROMPT
    threads = validate.threads(args.threads, "--threads")
    n_ctx = validate.context_sizes(args.ctx or 4096).n_ctx
    progress = None if args.json else (lambda msg: print(f"  {msg}", file=sys.stderr, flush=True))
    rows = run_parity(model, prompt, args.max_tokens, args.reps, threads, n_ctx, args.load, progress)
    if args.json:
        print(json.dumps([{"load": r.load, "chat_tokens_per_s": round(r.chat_tokens_per_s, 3),
                           "generate_tokens_per_s": round(r.generate_tokens_per_s, 3),
                           "ratio": round(r.ratio, 4), "identical": r.identical} for r in rows]))
    else:
        print(format_parity(rows, args.max_tokens, args.reps))
    return 0


def _cluster(args: argparse.Namespace) -> int:
    import secrets
    import tempfile

    from ...discovery.auth import keys_from_token, resolve_token
    from ...engine.lab.cluster_bench import chosen_variants, run_cluster_bench
    from ..loopback import spawn_workers, stop_workers

    if args.cluster and args.nodes:
        raise PotluckError("pass either --cluster N (loopback workers) or --nodes (running workers), not both")
    families = tuple(f.strip() for f in args.families.split(",") if f.strip())
    cfg = ClusterBenchConfig(
        model=args.model,
        draft=args.draft,
        families=families,
        max_tokens=args.max_tokens,
        reps=args.reps,
        n_ctx=validate.context_sizes(args.ctx or 2048).n_ctx,
        n_threads=validate.threads(args.threads, "--threads"),
        split=None if args.split is None else validate.split(args.split),
        only=tuple(v.strip() for v in (args.variants or "").split(",") if v.strip()),
        options=_parse_options(args.option),
    )
    chosen_variants(cfg)  # a wrong name is refused before any worker starts
    progress = None if args.json else (lambda msg: print(f"  {msg}", file=sys.stderr, flush=True))
    procs = []
    try:
        if args.nodes:
            addresses = validate.nodes(args.nodes)
            keys = keys_from_token(resolve_token(None, args.token_file))
        else:
            token = secrets.token_urlsafe(32)
            folder = Path(tempfile.mkdtemp(prefix="potluck-bench-"))
            procs = spawn_workers(folder, [f"w{i}" for i in range(args.cluster)], token)
            addresses = tuple(p.address for p in procs)
            keys = keys_from_token(token)
        rows = run_cluster_bench(cfg, addresses, keys, progress)
    finally:
        stop_workers([p.proc for p in procs])
        if procs:
            shutil.rmtree(folder, ignore_errors=True)
    if args.json:
        print(json.dumps([r.as_json() for r in rows], ensure_ascii=False))
    else:
        print(format_cluster_table(rows, cfg))
    return 0


def format_cluster_table(rows: list[ClusterRow], cfg: ClusterBenchConfig) -> str:
    cols = (f"{'family':<14}{'variant':<26}{'tok/s':>7}{'vs pipe':>8}{'vs one':>8}{'ttft s':>8}{'accept':>8}"
            f"{'fed/tok':>8}{'cancel/rpl':>11}{'last B/tok':>11}  identical  busy: workers, head")
    lines = [f"max tokens {cfg.max_tokens}, reps {cfg.reps} (medians); 'one machine' holds the whole model "
             f"with {cfg.n_threads or 'all'} threads", "", cols, "-" * len(cols)]
    for r in rows:
        busy = " ".join(f"{b:.2f}" for b in r.stage_busy) or "-"
        lines.append(
            f"{r.family:<14}{r.variant:<26}{r.tokens_per_s:>7.1f}{r.vs_pipeline:>7.2f}x{r.vs_one_machine:>7.2f}x"
            f"{r.ttft_s:>8.2f}{_fmt(r.acceptance_rate, '.2f'):>8}{_fmt(r.fed_per_token, '.2f'):>8}"
            f"{_fmt(r.cancelled_per_reply, '.1f'):>11}{_fmt(r.last_stage_bytes_per_token, '.0f'):>11}"
            f"  {'yes' if r.identical_to_one_machine else 'NO':<9}  {busy}"
        )
    return "\n".join(lines)


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _identical(same: bool | None) -> str:
    return "n/a" if same is None else "yes" if same else "NO"


def format_table(rows: list[BenchRow]) -> str:
    if not rows:
        return "(no rows)"
    r0 = rows[0]
    head = [
        f"target: {r0.target} ({r0.target_layers} layers"
        + (f", recipe {r0.recipe}" if r0.recipe else "")
        + ")",
        f"max tokens {r0.max_tokens}, reps {r0.reps} (medians), threads {r0.threads or 'all'}, KV {r0.kv_cache}",
        f"sampled at temperature {r0.temperature:g}, top-k 40, top-p 0.95, min-p 0.05 (one seed per prompt)"
        if r0.temperature > 0 else "greedy",
    ]
    for r in rows:
        if r.cost_ratio is not None:
            head.append(f"draft: {r.draft}, cost ratio target/draft {r.cost_ratio:.2f}")
            break
    cols = (
        f"{'family':<14}{'strategy':<16}{'tok/s':>8}{'speedup':>9}{'accept':>8}"
        f"{'acc/rnd':>8}{'s/rnd':>7}{'draft ms/t':>11}{'verify ms/t':>12}{'both ms/t':>10}  identical"
        f"{'ttft s':>8}{'L1 acc':>8}{'L2 acc':>8}{'retrieval':>12}"
    )
    lines = [*head, "", cols, "-" * len(cols)]
    for r in rows:
        lines.append(
            f"{r.family:<14}{r.strategy:<16}{r.tokens_per_s:>8.1f}{r.speedup:>8.2f}x"
            f"{_fmt(r.acceptance_rate, '.2f'):>8}{_fmt(r.mean_accepted_len, '.2f'):>8}"
            f"{_fmt(r.mean_draft_len, '.1f'):>7}{_fmt(r.draft_ms_per_token, '.2f'):>11}"
            f"{_fmt(r.verify_ms_per_token, '.2f'):>12}{_fmt(r.overlap_ms_per_token, '.2f'):>10}"
            f"  {_identical(r.identical_to_ar):<9}"
            f"{_fmt(r.ttft_s, '.2f'):>8}{_fmt(r.ngram_acceptance, '.2f'):>8}"
            f"{_fmt(r.retrieval_acceptance, '.2f'):>8}{_budget(r):>12}"
        )
    if any(r.retrieval_budget is not None for r in rows):
        lines += ["", "triforce: L1 acc = N-gram drafts the retrieval cache kept, L2 acc = retrieval-cache drafts "
                  "the full cache kept (accept: every draft it judged); retrieval = positions held / context"]
    return "\n".join(lines)


def _budget(r: BenchRow) -> str:
    if r.retrieval_budget is None or r.retrieval_context is None:
        return "-"
    return f"{r.retrieval_budget}/{r.retrieval_context}"
