"""GGUF files already on this machine: the Hugging Face cache (what `potluck pull` fills),
LM Studio's models folder and ollama's blob store, so `potluck models` and the picker list
them without the user finding the files.

Each place is read as its tool lays it out, never written:

- Hugging Face hub cache (``$HF_HUB_CACHE``, ``$HF_HOME/hub``, ``~/.cache/huggingface/hub``):
  ``models--ORG--NAME/snapshots/REVISION/FILE.gguf``, links into ``blobs/``;
- LM Studio (``~/.lmstudio/models``, the older ``~/.cache/lm-studio/models``):
  ``PUBLISHER/MODEL/FILE.gguf``;
- ollama (``$OLLAMA_MODELS``, ``~/.ollama/models``): a manifest per ``NAME:TAG`` under
  ``manifests/HOST/NAMESPACE/NAME/TAG`` names its layers; the one of media type
  ``application/vnd.ollama.image.model`` is a GGUF stored as ``blobs/sha256-HEX``.

A model split into several files (``NAME-00001-of-00003.gguf``) is listed once, by its first
part: llama.cpp loads the rest from beside it.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")


@dataclass(frozen=True)
class FoundModel:
    """A GGUF on disk and where it was found."""

    path: Path
    name: str  # as the user knows it: the file name, or ollama's NAME:TAG
    source: str  # "hugging face", "lm studio", "ollama"


def hf_hub_cache() -> Path:
    """Where huggingface_hub keeps downloads (its own environment variables, read now)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def lm_studio_dirs() -> list[Path]:
    return [Path("~/.lmstudio/models").expanduser(), Path("~/.cache/lm-studio/models").expanduser()]


def ollama_dir() -> Path:
    return Path(os.environ.get("OLLAMA_MODELS") or "~/.ollama/models").expanduser()


def is_first_part(path: Path) -> bool:
    """A single-file GGUF, or the first part of a split one (the part llama.cpp is given)."""
    m = _SPLIT.search(path.name)
    return m is None or int(m.group(1)) == 1


def _ggufs(folder: Path, pattern: str) -> Iterator[Path]:
    try:
        yield from sorted(p for p in folder.glob(pattern) if p.is_file() and is_first_part(p))
    except OSError:
        return


def hf_cache_models(cache: Path | None = None) -> list[FoundModel]:
    out = []
    for path in _ggufs(cache or hf_hub_cache(), "models--*/snapshots/*/**/*.gguf"):
        out.append(FoundModel(path, path.name, "hugging face"))
    return out


def lm_studio_models(folders: Iterable[Path] | None = None) -> list[FoundModel]:
    out = []
    for folder in lm_studio_dirs() if folders is None else folders:
        out += [FoundModel(p, p.name, "lm studio") for p in _ggufs(folder, "*/*/*.gguf")]
    return out


def ollama_models(root: Path | None = None) -> list[FoundModel]:
    """ollama's models by the names ollama gives them; a manifest that is not JSON or names a
    blob that is missing is skipped (ollama writes them, and may be pulling one now)."""
    root = root or ollama_dir()
    manifests = root / "manifests"
    out = []
    try:
        files = sorted(p for p in manifests.rglob("*") if p.is_file())
    except OSError:
        return []
    for manifest in files:
        try:
            layers = json.loads(manifest.read_text(encoding="utf-8")).get("layers", [])
        except (OSError, ValueError, AttributeError):
            continue
        model_layers = [la for la in layers if isinstance(la, dict) and la.get("mediaType") == OLLAMA_MODEL_LAYER]
        digest = str(model_layers[0].get("digest", "")) if model_layers else ""
        blob = root / "blobs" / digest.replace(":", "-")
        if not re.fullmatch(r"sha256:[0-9a-f]{64}", digest) or not blob.is_file():
            continue
        parts = manifest.relative_to(manifests).parts  # host, namespace, name, tag
        name, tag = parts[-2], parts[-1]
        namespace = parts[-3] if len(parts) >= 3 and parts[-3] != "library" else ""
        out.append(FoundModel(blob, f"{namespace + '/' if namespace else ''}{name}:{tag}", "ollama"))
    return out


def models_on_disk() -> list[FoundModel]:
    """Every GGUF the places above hold, each file once."""
    seen: set[Path] = set()
    out = []
    for found in hf_cache_models() + lm_studio_models() + ollama_models():
        real = found.path.resolve()
        if real not in seen:
            seen.add(real)
            out.append(found)
    return out
