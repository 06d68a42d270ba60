"""Settings: defaults without a file, strict parsing, a lossless save/load round trip."""

from __future__ import annotations

from pathlib import Path

import pytest

from potluck.app.config import (
    KeySettings,
    ModelSettings,
    SamplingSettings,
    Settings,
    UISettings,
    load_settings,
    save_settings,
)
from potluck.engine.core import paths
from potluck.engine.core.errors import PotluckError


def test_missing_file_gives_defaults(tmp_home: Path) -> None:
    assert not paths.config_file().exists()
    assert load_settings() == Settings()


def test_round_trip_keeps_every_changed_value(tmp_path: Path) -> None:
    settings = Settings(
        model=ModelSettings(path="/m/a.gguf", draft="/m/b.gguf", strategy="sd", library=("/m",)),
        sampling=SamplingSettings(temperature=0.7, seed=3, max_tokens=64),
        ui=UISettings(theme="nord", show_panels=False),
        keys=KeySettings(regenerate="ctrl+g"),
    )
    path = save_settings(settings, tmp_path / "config.toml")
    assert load_settings(path) == settings
    text = path.read_text()
    assert "n_ctx" not in text  # defaults are not written
    assert 'regenerate = "ctrl+g"' in text


def test_toml_values_are_coerced_and_checked(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text('[sampling]\ntemperature = 1\n[model]\nlibrary = "~/models"\n')
    s = load_settings(path)
    assert s.sampling.temperature == 1.0 and isinstance(s.sampling.temperature, float)
    assert s.model.library == ("~/models",)


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ("[ui]\nthme = 'nord'\n", "unknown key 'thme' in [ui]"),
        ("[colors]\na = 1\n", "unknown section [colors]"),
        ("[model]\nn_ctx = 'big'\n", "[model] n_ctx must be int"),
        ("[ui]\nshow_panels = 1\n", "[ui] show_panels must be bool"),
        ("[model]\nn_ctx = true\n", "[model] n_ctx must be int"),
        ("[model\n", "not valid TOML"),
        ("[cluster]\njoin_timeout_s = 0\n", "[cluster] join_timeout_s must be more than 0"),
        ("[cluster]\ndiscover_timeout_s = 1e9\n", "[cluster] discover_timeout_s must be more than 0 and at most 60"),
    ],
)
def test_bad_files_are_refused_with_the_key_named(tmp_path: Path, toml: str, message: str) -> None:
    path = tmp_path / "config.toml"
    path.write_text(toml)
    with pytest.raises(PotluckError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_settings(path)


def test_sampling_settings_are_validated() -> None:
    assert SamplingSettings(temperature=0.5, top_k=5).params().top_k == 5
    with pytest.raises(PotluckError):
        SamplingSettings(top_p=0.0).params()
    with pytest.raises(PotluckError):
        SamplingSettings(max_tokens=0).params()


def test_keymap_uses_binding_ids() -> None:
    keymap = KeySettings(toggle_panels="f9").keymap()
    assert keymap["toggle_panels"] == "f9" and keymap["stop"] == "escape"


def test_saving_keeps_the_users_comments_and_layout(tmp_path: Path) -> None:
    from potluck.app.config import ModelSettings, save_settings

    path = tmp_path / "config.toml"
    original = (
        "# my settings, written by hand\n"
        "[model]\n"
        "strategy = \"anpd\"  # fast on my laptop\n"
        "n_ctx = 8192\n"
        "\n"
        "[sampling]\n"
        "# greedy: I want the same answer every time\n"
        "temperature = 0.0\n"
    )
    path.write_text(original)
    settings = load_settings(path)
    chosen = Settings(
        model=ModelSettings(path="/models/big.gguf", strategy="sd", draft="/models/small.gguf", n_ctx=8192),
        sampling=settings.sampling,
    )
    save_settings(chosen, path)
    text = path.read_text()
    for kept in ("# my settings, written by hand", "# fast on my laptop", "# greedy: I want the same answer every time",
                 "temperature = 0.0"):
        assert kept in text, text
    assert 'strategy = "sd"  # fast on my laptop' in text  # the value changes, its comment stays
    reread = load_settings(path)
    assert reread.model == chosen.model and reread.sampling.temperature == 0.0
    # A setting back to "unset" leaves the file (TOML has no null); the rest stays.
    save_settings(Settings(model=ModelSettings(path="/models/big.gguf", strategy="sd", n_ctx=8192),
                           sampling=settings.sampling), path)
    assert "draft" not in path.read_text() and "# fast on my laptop" in path.read_text()
