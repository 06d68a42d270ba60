"""`potluck pull` against a fake Hugging Face hub on loopback (HF_ENDPOINT), and the GGUFs
other tools leave on disk (Hugging Face cache, LM Studio, ollama) in `potluck models` and
the picker. No network: the hub is tests/support/fake_hub.py."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import gguf
import pytest

from potluck.app.cli import main
from potluck.app.commands.pull import RemoteFile, choose
from potluck.app.model_files import hf_cache_models, lm_studio_models, ollama_models
from potluck.app.tui.catalog import gather_models

from .support.fake_hub import Hub, fake_hub

REPO = "someone/Tiny-GGUF"


def tiny_gguf(arch: str = "llama", n_layer: int = 2, tokens: tuple[str, ...] = ("a", "b", "c"), pad: int = 0) -> bytes:
    """A small valid GGUF header (no tensors), ``pad`` bytes of payload after it."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "x.gguf"
        w = gguf.GGUFWriter(str(path), arch)
        w.add_block_count(n_layer)
        w.add_token_list(list(tokens))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.close()
        return path.read_bytes() + bytes(range(256)) * (pad // 256)


@pytest.fixture()
def hub_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    hub = Hub(repos={REPO: {
        "README.md": b"# tiny",
        "tiny-Q8_0.gguf": tiny_gguf(pad=4096),
        # past huggingface_hub's 10 MB read chunk, so a cut file has something to resume from
        "tiny-Q4_K_M.gguf": tiny_gguf(pad=24 << 20),
        "big/tiny-F16-00001-of-00002.gguf": tiny_gguf(pad=2048),
        "big/tiny-F16-00002-of-00002.gguf": bytes(range(256)) * 8,
    }})
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    with fake_hub(hub):
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        yield hub


def test_pull_takes_the_default_quant_verifies_it_and_models_lists_it(hub_env: Hub, tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["pull", REPO]) == 0
    out = capsys.readouterr().out
    assert "tiny-Q4_K_M.gguf" in out and "potluck chat -m" in out
    found = hf_cache_models(tmp_path / "hf")
    assert [f.name for f in found] == ["tiny-Q4_K_M.gguf"]
    assert found[0].path.read_bytes() == hub_env.repos[REPO]["tiny-Q4_K_M.gguf"]
    assert main(["models", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert any(r["name"] == "tiny-Q4_K_M.gguf" and r.get("source") == "hugging face" for r in rows)


def test_an_interrupted_download_resumes(hub_env: Hub, tmp_path: Path) -> None:
    hub_env.cut_after["tiny-Q4_K_M.gguf"] = 15 << 20
    code = main(["pull", f"{REPO}:q4_k_m"])
    if code != 0:  # huggingface_hub gave up on this run: the next one goes on from the partial file
        code = main(["pull", f"{REPO}:q4_k_m"])
    assert code == 0
    assert [r for r in hub_env.ranges if r[0] == "tiny-Q4_K_M.gguf" and r[1] > 0], hub_env.ranges
    [found] = hf_cache_models(tmp_path / "hf")
    assert hashlib.sha256(found.path.read_bytes()).hexdigest() == hashlib.sha256(
        hub_env.repos[REPO]["tiny-Q4_K_M.gguf"]).hexdigest()


def test_a_corrupt_download_is_refused_and_deleted(hub_env: Hub, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    hub_env.corrupt.add("tiny-Q8_0.gguf")
    assert main(["pull", f"{REPO}:Q8_0"]) == 2
    err = capsys.readouterr().err
    assert "corrupt" in err and "SHA-256" in err and len(err.strip().splitlines()) == 1
    assert hf_cache_models(tmp_path / "hf") == []
    assert not [p for p in (tmp_path / "hf").rglob("*") if p.is_file() and p.stat().st_size > 4000]


def test_a_split_model_comes_whole_and_is_listed_by_its_first_part(hub_env: Hub, tmp_path: Path) -> None:
    assert main(["pull", f"{REPO}:F16"]) == 0
    assert sorted(set(hub_env.gets)) == ["big/tiny-F16-00001-of-00002.gguf", "big/tiny-F16-00002-of-00002.gguf"]
    assert [f.name for f in hf_cache_models(tmp_path / "hf")] == ["tiny-F16-00001-of-00002.gguf"]


def test_pull_errors_are_one_line(hub_env: Hub, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["pull", "nobody/missing"]) == 2
    assert main(["pull", f"{REPO}:Q2_K"]) == 2
    assert main(["pull", "not a repo"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 3 and "no repository" in lines[0] and "Q4_K_M" in lines[1] and "ORG/NAME" in lines[2]


def test_choose_needs_a_quant_when_there_is_no_default() -> None:
    files = [RemoteFile("m-Q8_0.gguf", 1, None), RemoteFile("m-Q5_K_S.gguf", 1, None)]
    with pytest.raises(Exception, match="Q5_K_S, Q8_0"):
        choose(files, None, "r/m")
    assert choose(files, "q8_0", "r/m") == [files[0]]


def test_models_other_tools_left_on_disk(tmp_path: Path) -> None:
    # LM Studio: PUBLISHER/MODEL/FILE.gguf
    lms = tmp_path / "lmstudio"
    (lms / "pub" / "Model-GGUF").mkdir(parents=True)
    (lms / "pub" / "Model-GGUF" / "model-Q4_K_M.gguf").write_bytes(tiny_gguf(n_layer=3))
    # ollama: a manifest names the model layer's blob
    ol = tmp_path / "ollama"
    blob = tiny_gguf(arch="qwen2", n_layer=4, tokens=("x", "y"))
    digest = "sha256:" + hashlib.sha256(blob).hexdigest()
    (ol / "blobs").mkdir(parents=True)
    (ol / "blobs" / digest.replace(":", "-")).write_bytes(blob)
    manifest = ol / "manifests" / "registry.ollama.ai" / "library" / "qwen2.5" / "0.5b"
    manifest.parent.mkdir(parents=True)
    manifest.write_text(json.dumps({"layers": [
        {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:" + "0" * 64},
        {"mediaType": "application/vnd.ollama.image.model", "digest": digest},
    ]}))
    broken = manifest.parent / "broken"
    broken.write_text("{not json")
    # Hugging Face cache: snapshots link into blobs
    snap = tmp_path / "hf" / "models--org--M-GGUF" / "snapshots" / "abc"
    snap.mkdir(parents=True)
    (tmp_path / "hf" / "models--org--M-GGUF" / "blobs").mkdir()
    real = tmp_path / "hf" / "models--org--M-GGUF" / "blobs" / "deadbeef"
    real.write_bytes(tiny_gguf())
    (snap / "m-Q8_0.gguf").symlink_to(real)

    found = lm_studio_models([lms]) + ollama_models(ol) + hf_cache_models(tmp_path / "hf")
    assert [(f.name, f.source) for f in found] == [
        ("model-Q4_K_M.gguf", "lm studio"), ("qwen2.5:0.5b", "ollama"), ("m-Q8_0.gguf", "hugging face"),
    ]
    infos = gather_models(None, None, [], found=found)
    by_name = {i.name: i for i in infos}
    assert by_name["qwen2.5:0.5b"].arch == "qwen2" and by_name["qwen2.5:0.5b"].n_layer == 4
    assert "ollama" in by_name["qwen2.5:0.5b"].label and by_name["model-Q4_K_M.gguf"].n_layer == 3
