"""The defaults the README states: the chat app and `serve` speculate (``auto``) and sample like
llama.cpp (temperature 0.8, top-k 40, top-p 0.95, min-p 0.05) unless config.toml says otherwise;
`generate` stays plain greedy decoding."""

from __future__ import annotations

from pathlib import Path

from potluck.app.cli import build_parser
from potluck.app.config import SamplingSettings, Settings, load_settings, spec_from_settings
from potluck.engine.core.sampling import SamplingParams


def test_chat_defaults_speculate_and_sample_like_llama_cpp(tmp_home: Path) -> None:
    settings = load_settings()  # no config.toml
    assert settings == Settings()
    assert settings.model.strategy == "auto"
    assert spec_from_settings(settings).strategy == "auto"
    assert settings.sampling.params() == SamplingParams(
        temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.0, seed=None
    )


def test_config_toml_overrides_the_defaults(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text('[model]\nstrategy = "autoregressive"\n[sampling]\ntemperature = 0\ntop_k = 0\n')
    s = load_settings(path)
    assert s.model.strategy == "autoregressive"
    assert s.sampling.params().greedy and s.sampling.top_k == 0
    assert s.sampling.top_p == SamplingSettings().top_p  # keys not given keep the defaults


def test_generate_keeps_plain_greedy_decoding() -> None:
    args = build_parser().parse_args(["generate", "hi"])
    assert args.strategy == "plain"
    assert (args.temp, args.top_k, args.top_p, args.min_p, args.repeat_penalty) == (0.0, 0, 1.0, 0.0, 1.0)


def test_chat_help_names_the_defaults_it_runs_with() -> None:
    """`potluck chat --help` once said "(default: plain)" and "(default 0)": generate's values,
    not the chat's. Its options say config.toml, and its description gives config's defaults."""
    chat = build_parser()._subparsers._group_actions[0].choices["chat"]  # type: ignore[union-attr]
    text = " ".join(chat.format_help().split())
    assert "(default: plain)" not in text and "(default 0)" not in text
    s = Settings()
    assert (f"strategy {s.model.strategy}, temperature {s.sampling.temperature}, top-k {s.sampling.top_k}, "
            f"top-p {s.sampling.top_p}, min-p {s.sampling.min_p}") in text
