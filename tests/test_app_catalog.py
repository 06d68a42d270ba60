"""Which drafts and strategies the picker offers, and the fast GGUF header scan."""

from __future__ import annotations

import struct
from pathlib import Path

from potluck.app.tui.catalog import ModelInfo, compatible_choices, gather_models, read_model_info
from potluck.app.tui.export import code_blocks
from potluck.engine.speculation.strategies.registry import STRATEGIES


class _Plain:
    name, needs_draft, description = "autoregressive", False, "plain"


class _Spec:
    name, needs_draft, description = "sd", True, "draft model"


TARGET = ModelInfo(Path("/m/big.gguf"), "big", "llama", 60, 100, vocab="v1")
DRAFT = ModelInfo(Path("/m/small.gguf"), "small", "llama", 30, 100, vocab="v1")
ALIEN = ModelInfo(Path("/m/alien.gguf"), "alien", "gemma3", 18, 300, vocab="v2")
STRATS = {"autoregressive": _Plain, "sd": _Spec}


def test_a_draft_with_another_vocabulary_is_not_offered() -> None:
    c = compatible_choices(TARGET, [TARGET, DRAFT, ALIEN], None, STRATS)
    assert [d.name for d in c.drafts] == ["small"]
    assert "draft alien: different vocabulary" in c.hidden


def test_strategies_needing_a_draft_need_a_compatible_one() -> None:
    assert compatible_choices(TARGET, [DRAFT], None, STRATS).strategies == ["autoregressive"]
    assert compatible_choices(TARGET, [DRAFT], DRAFT, STRATS).strategies == ["autoregressive", "sd"]
    # A chosen draft with another vocabulary does not unlock them.
    assert compatible_choices(TARGET, [ALIEN], ALIEN, STRATS).strategies == ["autoregressive"]


def test_bundled_model_header(model_path: Path) -> None:
    info = read_model_info(None)
    assert info.error is None and info.arch == "llama" and info.n_layer == 30
    assert info.n_vocab == 49152 and len(info.vocab) == 40
    same = read_model_info(model_path)
    assert same.vocab == info.vocab  # the same file read by path: same fingerprint
    # The registry's own strategies: those without a draft are always offered.
    c = compatible_choices(info, [info], None, STRATEGIES)
    assert set(c.strategies) == {n for n, cls in STRATEGIES.items() if not cls.needs_draft}


def test_unreadable_files_carry_their_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + struct.pack("<I", 3) + b"\x00" * 3)
    assert read_model_info(bad).error
    notgguf = tmp_path / "x.gguf"
    notgguf.write_text("hello")
    assert read_model_info(notgguf).error == "not a GGUF file"
    infos = gather_models(None, None, [str(tmp_path)], found=[])
    assert {i.name for i in infos if i.error} >= {"bad.gguf", "x.gguf"}


def test_code_blocks_are_found_even_unclosed() -> None:
    md = "a\n```py\nx = 1\n```\ntext\n~~~\ny\n~~~\n```sh\nls"
    assert code_blocks(md) == ["x = 1", "y", "ls"]


def test_models_are_named_by_their_file(model_path: Path) -> None:
    # The bundled file's internal name is "Smollm2 135M 8k Lc100K Mix1 Ep2": not what a user knows.
    assert read_model_info(model_path).name == model_path.name
