"""Arguments shared by the commands that load a model (generate, chat, bench).

Argument types only parse (int, float, path); :mod:`potluck.engine.core.validate` decides which
values are acceptable, for the CLI and config.toml alike.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from ... import engine  # the loader and the strategies load when a command uses them, not for `worker`
from ...engine import DISCOVER_TIMEOUT_S, JOIN_TIMEOUT_S, EngineSpec, PotluckError, SamplingParams, validate
from ..config import ClusterSettings, SamplingSettings


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {value}")
    return value


def _default(config: bool, value: str) -> str:
    """The help's default: the command's own, or config.toml's (chat: options only override it)."""
    return "(default: config.toml)" if config else f"(default {value})"


def add_model_args(p: argparse.ArgumentParser, config: bool = False) -> None:
    """Model options; ``config``: unset ones keep config.toml's values, and the help says so."""
    p.add_argument("-m", "--model", type=Path, help="target GGUF model (default: the bundled SmolLM2-135M)")
    p.add_argument(
        "--strategy",
        default="plain",
        help=f"decoding strategy: {', '.join(engine.strategy_names())} {_default(config, 'plain')}",
    )
    p.add_argument("--draft", type=Path, help="draft GGUF model for strategies that use one")
    p.add_argument("-s", "--system", help="system prompt")
    p.add_argument(
        "--ctx", type=int, default=4096,
        help=f"context size in tokens, rounded up to a multiple of 256 {_default(config, '4096')}",
    )
    p.add_argument(
        "-t", "--threads", type=int, default=0,
        help=f"CPU threads, at most the usable cores {_default(config, '0: all of them, fewer while others are busy')}",
    )


# The cluster options that override config.toml's [cluster] (chat and serve read it; generate
# takes the options over the defaults).
CLUSTER_OVERRIDES = {
    "discover_timeout": ("cluster", "discover_timeout_s"),
    "join_timeout": ("cluster", "join_timeout_s"),
}


def add_cluster_args(p: argparse.ArgumentParser) -> None:
    """Cluster mode: run the target's layers on `potluck worker`s of the LAN."""
    g = p.add_argument_group("cluster")
    g.add_argument(
        "--nodes",
        help="workers as host:port,... in pipeline order, or 'auto' to find them with zeroconf",
    )
    g.add_argument(
        "--token-file", type=Path, help="file holding the cluster token, mode 0600 (default: $POTLUCK_TOKEN "
        "or the one `potluck token` saved)",
    )
    g.add_argument("--token", help=argparse.SUPPRESS)  # visible in `ps`: kept for old scripts, undocumented
    g.add_argument(
        "--strict-nodes", action="store_true",
        help="refuse to start when a listed worker does not join (default: skip it with a warning when the "
        "others can hold the model)",
    )
    g.add_argument(
        "--split", help="fixed layer boundaries of the workers' stages, e.g. 0,12,30 (the last, the model's "
        "layer count, may be left out; the head computes the output layer) (default: planned)",
    )
    g.add_argument(
        "--hidden-f16", action="store_true", help="send hidden states as fp16 (half the bytes; not exact)"
    )
    g.add_argument(
        "--discover-timeout", type=float, default=None,
        help=f"seconds to browse for --nodes auto (default {DISCOVER_TIMEOUT_S:g})",
    )
    g.add_argument(
        "--join-timeout", type=float, default=None,
        help=f"seconds each worker has to accept us (default {JOIN_TIMEOUT_S:g}; more for slow or busy machines)",
    )


def check_cluster_args(args: argparse.Namespace) -> None:
    """Cluster options are refused without --nodes (they would be silently ignored)."""
    nodes = getattr(args, "nodes", None)
    given = [
        flag for flag, value in (("--split", args.split), ("--token", args.token),
                                 ("--token-file", getattr(args, "token_file", None)),
                                 ("--hidden-f16", args.hidden_f16 or None),
                                 ("--strict-nodes", getattr(args, "strict_nodes", False) or None),
                                 ("--discover-timeout", args.discover_timeout),
                                 ("--join-timeout", args.join_timeout))
        if value is not None
    ]
    if nodes is None and given:
        raise PotluckError(f"{given[0]} only applies to cluster mode; add --nodes or drop {given[0]}")
    if nodes is None:
        return
    if nodes == "auto" and getattr(args, "strict_nodes", False):
        raise PotluckError("--strict-nodes applies to a list of workers, not --nodes auto; drop it")
    if nodes != "auto":
        validate.nodes(nodes)
        if args.discover_timeout is not None:
            raise PotluckError("--discover-timeout only applies to --nodes auto; drop it")
    elif args.discover_timeout is not None:
        validate.discover_timeout(args.discover_timeout)
    if args.join_timeout is not None:
        validate.join_timeout(args.join_timeout)
    if args.split is not None:
        validate.split(args.split)


def cluster_spec(args: argparse.Namespace, timeouts: ClusterSettings | None = None):  # -> ClusterSpec | None
    """The ClusterSpec for ``--nodes`` (None without it); prints the plan and transfer progress.
    ``timeouts``: config.toml's [cluster] with the options applied (None: the options alone)."""
    nodes_arg = getattr(args, "nodes", None)
    if nodes_arg is None:
        return None
    check_cluster_args(args)
    from ...engine import ClusterSpec
    from ..cli import potluck_version

    if timeouts is None:
        given = {name: getattr(args, dest) for dest, (_, name) in CLUSTER_OVERRIDES.items()}
        timeouts = ClusterSettings(**{name: v for name, v in given.items() if v is not None})
    keys = cluster_keys(args)
    if nodes_arg == "auto":
        from ...discovery.lan import find_candidates

        nodes = find_candidates(timeouts.discover_timeout_s)  # unproven: the joins prove them
    else:
        nodes = validate.nodes(nodes_arg)
    split = None if args.split is None else validate.split(args.split)
    return ClusterSpec(
        nodes=nodes,
        keys=keys,
        split=split,
        hidden_dtype="f16" if args.hidden_f16 else "f32",
        potluck_version=potluck_version(),
        skip_failed_joins=nodes_arg == "auto",
        strict_nodes=getattr(args, "strict_nodes", False),
        join_timeout_s=timeouts.join_timeout_s,
        on_plan=lambda plan: print("\n".join(plan.describe()), file=sys.stderr, flush=True),
        progress=_progress_bar,
    )


def cluster_keys(args: argparse.Namespace):  # -> CurveKeys
    """The CURVE keys from the token of --token-file, $POTLUCK_TOKEN or the saved file.

    ``--token`` still works for old scripts but is hidden from --help and warned about each
    time: `ps` shows it to every user of the machine."""
    from ...discovery.auth import keys_from_token, resolve_token

    return keys_from_token(resolve_token(args.token, getattr(args, "token_file", None)))


def _progress_bar(what: str, done: int, total: int) -> None:
    if not sys.stderr.isatty() and done < total:
        return
    width = 30
    filled = int(width * done / total) if total else width
    end = "\n" if done >= total else ""
    sys.stderr.write(f"\r  sending {what}: [{'#' * filled}{'.' * (width - filled)}] "
                     f"{done / 1e6:,.1f}/{total / 1e6:,.1f} MB{end}")
    sys.stderr.flush()


def add_sampling_args(p: argparse.ArgumentParser, config: bool = False) -> None:
    """Sampling options; ``config`` as for :func:`add_model_args`."""
    p.add_argument(
        "--max-tokens", type=int, default=512,
        help=f"most tokens to generate; the reply also ends when the context is full {_default(config, '512')}",
    )
    p.add_argument("--temp", type=float, default=0.0, help=f"temperature; 0 = greedy {_default(config, '0')}")
    p.add_argument("--top-k", type=int, default=0, help=f"keep the k likeliest tokens, 0 = off {_default(config, '0')}")
    p.add_argument("--top-p", type=float, default=1.0, help=f"nucleus sampling mass, 1 = off {_default(config, '1')}")
    p.add_argument("--min-p", type=float, default=0.0, help=f"min-p filter, 0 = off {_default(config, '0')}")
    p.add_argument("--repeat-penalty", type=float, default=1.0,
                   help=f"repetition penalty, 1 = off {_default(config, '1')}")
    p.add_argument("--frequency-penalty", type=float, default=0.0,
                   help=f"lower a token's logit by this for each time it occurs in the last 64 tokens, "
                   f"-2 to 2, 0 = off {_default(config, '0')}")
    p.add_argument("--presence-penalty", type=float, default=0.0,
                   help=f"lower a token's logit by this once if it occurs in the last 64 tokens, "
                   f"-2 to 2, 0 = off {_default(config, '0')}")
    p.add_argument("--seed", type=int, default=None, help="RNG seed for sampling (any integer, taken mod 2**64)")


def engine_spec(args: argparse.Namespace) -> EngineSpec:
    """The checked spec, without its cluster: that needs the network (see :func:`with_cluster`)."""
    if hasattr(args, "nodes"):
        check_cluster_args(args)
    return engine.checked_spec(
        EngineSpec(
            model=args.model,
            strategy=args.strategy,
            draft=getattr(args, "draft", None),
            n_ctx=args.ctx,
            n_threads=args.threads,
            system=args.system,
        )
    )


def with_cluster(spec: EngineSpec, args: argparse.Namespace, timeouts: ClusterSettings | None = None) -> EngineSpec:
    """Resolve --nodes (token, discovery) once the cheap checks have passed."""
    return replace(spec, cluster=cluster_spec(args, timeouts))


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """The options as config.toml's [sampling] section, checked the same way."""
    return SamplingSettings(
        temperature=args.temp,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repeat_penalty=args.repeat_penalty,
        frequency_penalty=args.frequency_penalty,
        presence_penalty=args.presence_penalty,
        seed=args.seed,
        max_tokens=args.max_tokens,
    ).params()


def read_prompt(arg: str | None) -> str:
    """The prompt argument, or stdin for '-' or none; invalid UTF-8 and empty text are refused."""
    if arg is not None and arg != "-":
        if not arg.strip():
            raise PotluckError("the prompt is empty; pass some text")
        return validate.text("the prompt", arg)
    if sys.stdin is None or sys.stdin.isatty():
        raise PotluckError("no prompt: pass it as an argument or pipe it on stdin")
    if hasattr(sys.stdin, "buffer"):  # bytes: invalid UTF-8 becomes a one-line refusal, not a traceback
        raw = sys.stdin.buffer.read().decode("utf-8", errors="surrogateescape")
    else:
        raw = sys.stdin.read()
    text = validate.text("the prompt on stdin", raw)
    if not text.strip():
        raise PotluckError("the prompt on stdin is empty")
    return text


def settings_with_overrides(args: argparse.Namespace, overrides: dict[str, tuple[str, str]]):  # -> Settings
    """config.toml's settings with the options given on the command line (``dest -> (section,
    field)``); an option left unset keeps config.toml's value."""
    from dataclasses import replace

    from ..config import load_settings

    settings = load_settings()
    for dest, (section, name) in overrides.items():
        value = getattr(args, dest, None)
        if value is None:
            continue
        if dest in ("model", "draft"):
            value = str(validate.path(f"--{dest}", value).resolve())  # type: ignore[union-attr]
        if dest == "system":
            value = value or None  # -s "" clears config.toml's system prompt
        settings = replace(settings, **{section: replace(getattr(settings, section), **{name: value})})
    return settings
