"""`potluck chat` (also `potluck` alone): the terminal chat app on the bundled model.

Settings come from config.toml; the options given here override them for this run only.
"""

from __future__ import annotations

import argparse
import logging
from typing import TYPE_CHECKING

from ...engine import (
    EngineSpec,
    PrintableFormatter,
    check_gguf_file,
    open_session,
    paths,
    resolve_model,
    strategy_fits,
    validate,
)
from ..cli import COMMANDS
from .common import (
    CLUSTER_OVERRIDES,
    add_cluster_args,
    add_model_args,
    add_sampling_args,
    check_cluster_args,
    settings_with_overrides,
)

if TYPE_CHECKING:
    from ..config import ClusterSettings

# argument dest -> (settings section, field); None-valued arguments keep the setting.
_OVERRIDES = {
    "model": ("model", "path"),
    "draft": ("model", "draft"),
    "strategy": ("model", "strategy"),
    "system": ("model", "system"),
    "ctx": ("model", "n_ctx"),
    "threads": ("model", "n_threads"),
    "max_tokens": ("sampling", "max_tokens"),
    "temp": ("sampling", "temperature"),
    "top_k": ("sampling", "top_k"),
    "top_p": ("sampling", "top_p"),
    "min_p": ("sampling", "min_p"),
    "repeat_penalty": ("sampling", "repeat_penalty"),
    "frequency_penalty": ("sampling", "frequency_penalty"),
    "presence_penalty": ("sampling", "presence_penalty"),
    "seed": ("sampling", "seed"),
    **CLUSTER_OVERRIDES,
}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "chat",
        help=COMMANDS["chat"],
        description="Open the chat app. Defaults come from config.toml (`potluck locate` shows where); "
        "without one: strategy auto, temperature 0.8, top-k 40, top-p 0.95, min-p 0.05.",
    )
    add_model_args(p, config=True)
    add_sampling_args(p, config=True)
    add_cluster_args(p)
    # Unset options must not override config.toml, so none of them has a default here.
    p.set_defaults(**dict.fromkeys(_OVERRIDES))


def run(args: argparse.Namespace) -> int:
    from ..config import spec_from_settings

    check_cluster_args(args)  # before the options become settings: its errors name the options
    settings = settings_with_overrides(args, _OVERRIDES)
    # Refuse bad values (engine.limits) before the screen opens: one line, exit code 2.
    settings.sampling.params()
    if args.draft is not None:  # given here, it must be used: the same rule as `generate`
        strategy_fits(settings.model.strategy, args.draft, {})
    spec = spec_from_settings(settings)
    for path in (resolve_model(spec.model), spec.draft):
        if path is not None:
            check_gguf_file(path)
    cluster = cluster_choice(args, settings.cluster)
    from ..tui import build_app  # Textual: only once every option passed (a refusal is quick)

    handler = logging.FileHandler(paths.log_file(), encoding="utf-8")
    handler.setLevel(logging.INFO)
    handler.setFormatter(PrintableFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("potluck")
    root.addHandler(handler)
    root.setLevel(min(root.getEffectiveLevel(), logging.INFO))
    _quiet_stderr_while_the_screen_is_up()

    def session_factory(spec: EngineSpec):  # noqa: ANN202 - returns the engine Session
        return open_session(spec)

    app = build_app(
        settings=settings, session_factory=session_factory, settings_path=paths.config_file(), cluster=cluster
    )
    try:
        app.run()
    finally:
        app.close_engine()
        root.removeHandler(handler)
        handler.close()
    return app.return_code or 0


def cluster_choice(args: argparse.Namespace, timeouts: ClusterSettings):  # -> ClusterChoice | None
    """``--nodes`` and its options, checked before the screen opens (one line, exit code 2);
    the timeouts come from [cluster], overridden by the options.

    The token is checked here too; discovery, the plan and the slice transfer happen in the
    app, where the user watches them. The options were checked by :func:`run`."""
    if args.nodes is None:
        return None
    from ...discovery.auth import resolve_token
    from ..tui.cluster import AUTO, ClusterChoice

    token_file = getattr(args, "token_file", None)
    resolve_token(args.token, token_file)  # no token: refuse now, not after the screen is up
    return ClusterChoice(
        nodes=AUTO if args.nodes == AUTO else validate.nodes(args.nodes),
        token=args.token,
        token_file=token_file,
        split=None if args.split is None else validate.split(args.split),
        hidden_dtype="f16" if args.hidden_f16 else "f32",
        discover_timeout_s=timeouts.discover_timeout_s,
        join_timeout_s=timeouts.join_timeout_s,
        strict_nodes=args.strict_nodes,
    )


def _quiet_stderr_while_the_screen_is_up() -> None:
    """Log lines on stderr would scribble over the screen; the log file and view have them."""
    for h in logging.getLogger().handlers:
        if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler):
            h.setLevel(logging.CRITICAL + 1)
