"""The model picker with the models a newcomer has: the bundled model beside a larger one of
the same vocabulary (the README's own setup), a library model as the target."""

from __future__ import annotations

from pathlib import Path

from potluck.app.config import load_settings
from potluck.app.tui.catalog import ModelInfo
from potluck.app.tui.screens import PickerScreen
from potluck.assets import default_model_path

from .app_fakes import FakeFactory, ScriptedSession, run_async, until, words
from .test_app_pilot import SIZE, make_app, ready

BUNDLED = ModelInfo(None, "SmolLM2-135M-Instruct (bundled)", "llama", 30, 49152, vocab="smol")
BIG = ModelInfo(Path("/models/SmolLM2-1.7B-Instruct-Q4_K_M.gguf"), "SmolLM2 1.7B Instruct", "llama", 24, 49152,
                vocab="smol")


class _Plain:
    name, needs_draft, description = "plain", False, "plain decoding"


class _Spec:
    name, needs_draft, description = "sd", True, "draft model speculation"


def option_ids(picker: PickerScreen, list_id: str) -> list[str]:
    ol = picker.query_one(list_id)
    return [str(ol.get_option_at_index(i).id) for i in range(ol.option_count)]  # type: ignore[attr-defined]


@run_async
async def test_the_bundled_model_as_a_draft_opens_the_picker_and_applies(tmp_path: Path) -> None:
    # On main the bundled model offered as a draft got the "(no draft)" row's id: DuplicateID.
    factory = FakeFactory(lambda spec: ScriptedSession(words("ok")))
    settings_path = tmp_path / "config.toml"
    app = make_app(
        tmp_path, factory, settings_path=settings_path,
        model_catalog=lambda: [BUNDLED, BIG], strategies={"plain": _Plain, "sd": _Spec},
    )
    async with app.run_test(size=SIZE) as pilot:
        await ready(app)
        await pilot.press("ctrl+o")
        await until(lambda: isinstance(app.screen, PickerScreen), what="the picker")
        picker = app.screen
        assert isinstance(picker, PickerScreen)
        assert len(set(option_ids(picker, "#pick-draft"))) == 2  # (no draft) and the 1.7B
        # Target the 1.7B: the bundled model becomes its draft candidate.
        picker.query_one("#pick-model").focus()
        await pilot.press("down", "enter")
        await until(lambda: picker.model is BIG, what="the 1.7B picked")
        drafts = option_ids(picker, "#pick-draft")
        assert len(drafts) == len(set(drafts)) == 2
        picker.query_one("#pick-draft").focus()
        await pilot.press("down", "enter")
        await until(lambda: picker.draft is BUNDLED, what="the bundled draft picked")
        assert option_ids(picker, "#pick-strategy") == ["strategy-0", "strategy-1"]
        picker.strategy = "sd"
        await pilot.press("ctrl+s")
        await until(lambda: len(factory.sessions) == 2 and not app.loading, what="the reload")
        spec = factory.specs[-1]
        assert spec.model == BIG.path and spec.strategy == "sd"
        assert spec.draft == default_model_path()  # the bundled file, not "no draft"
        assert load_settings(settings_path).model.draft == str(default_model_path())
        # Opened again, the picker shows that choice.
        await pilot.press("ctrl+o")
        await until(lambda: isinstance(app.screen, PickerScreen), what="the picker again")
        again = app.screen
        assert again.model.key == BIG.key and again.draft is not None and again.draft.path is None  # type: ignore[attr-defined]
        await pilot.press("escape")


@run_async
async def test_the_picker_opens_any_gguf_by_path(tmp_path: Path, model_path: Path) -> None:
    factory = FakeFactory(lambda spec: ScriptedSession(words("ok")))
    app = make_app(tmp_path, factory, model_catalog=lambda: [BUNDLED], strategies={"plain": _Plain, "sd": _Spec})
    async with app.run_test(size=SIZE) as pilot:
        await ready(app)
        await pilot.press("ctrl+o")
        await until(lambda: isinstance(app.screen, PickerScreen), what="the picker")
        picker = app.screen
        field = picker.query_one("#pick-path")
        field.focus()
        field.value = str(tmp_path / "missing.gguf")  # type: ignore[attr-defined]
        await pilot.press("enter")
        assert picker.model is BUNDLED  # type: ignore[attr-defined]
        field.value = str(model_path)  # type: ignore[attr-defined]
        await pilot.press("enter")
        await until(lambda: picker.model.path == model_path, what="the file as the target")  # type: ignore[attr-defined]
        assert picker.model.name == model_path.name and picker.model.n_layer == 30  # type: ignore[attr-defined]
        await pilot.press("ctrl+s")
        await until(lambda: len(factory.sessions) == 2 and not app.loading, what="the reload")
        assert factory.specs[-1].model == model_path


@run_async
async def test_file_names_with_markup_brackets_are_shown_as_they_are(tmp_path: Path) -> None:
    odd = ModelInfo(Path("/models/[/red] odd [b].gguf"), "[/red] odd [b].gguf", "llama", 2, 49152, vocab="smol")
    factory = FakeFactory(lambda spec: ScriptedSession(words("ok")))
    app = make_app(tmp_path, factory, model_catalog=lambda: [BUNDLED, odd], strategies={"plain": _Plain})
    async with app.run_test(size=SIZE) as pilot:
        await ready(app)
        await pilot.press("ctrl+o")
        await until(lambda: isinstance(app.screen, PickerScreen), what="the picker")
        ol = app.screen.query_one("#pick-model")
        shown = [str(ol.get_option_at_index(i).prompt) for i in range(ol.option_count)]  # type: ignore[attr-defined]
        assert any("[/red] odd [b].gguf" in s for s in shown), shown
        await pilot.press("escape")
