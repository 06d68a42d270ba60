"""What the model / strategy picker may offer: GGUF headers read fast, and the rules for
which draft models and strategies work with a target.

Reading a header with ``gguf.GGUFReader`` takes seconds (it materialises every array); the
picker only needs a few keys and a vocabulary fingerprint, so this scans the key/value
section itself and never loads weights. A draft must produce the target's token ids, so
only models whose vocabulary fingerprint equals the target's are offered as drafts, and
strategies that need a draft are offered only when such a draft is chosen.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Protocol

from ...assets import DEFAULT_MODEL_NAME, default_model_path
from ..model_files import FoundModel, models_on_disk

# GGUF value types -> struct format of one scalar (8 = string, 9 = array).
_SCALAR = {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
    10: "<Q", 11: "<q", 12: "<d",
}
_STRING, _ARRAY = 8, 9


class StrategyClass(Protocol):
    name: str
    needs_draft: bool
    description: str


@dataclass(frozen=True)
class ModelInfo:
    path: Path | None  # None: the bundled default model
    name: str
    arch: str = ""
    n_layer: int = 0
    n_vocab: int = 0
    vocab: str = ""  # fingerprint of the token list; "" when unreadable
    error: str | None = None
    source: str = ""  # where it was found: "hugging face", "lm studio", "ollama"; "" given

    @property
    def label(self) -> str:
        if self.error:
            return f"{self.name} (unreadable)"
        where = f" · {self.source}" if self.source else ""
        return f"{self.name} · {self.arch} · {self.n_layer} layers{where}"

    @property
    def key(self) -> str:
        return str(self.path) if self.path is not None else ""

    @property
    def file(self) -> Path | None:
        """The GGUF on disk (the bundled model's too): what a draft setting names."""
        return self.path if self.path is not None else default_model_path()

    def is_file(self, path: str | Path | None) -> bool:
        """Whether ``path`` (a setting, maybe with ``~``) names this model's file."""
        if path is None or self.file is None:
            return False
        try:
            return Path(path).expanduser().resolve() == self.file.resolve()
        except OSError:
            return False


def _read_str(f: BinaryIO) -> bytes:
    (n,) = struct.unpack("<Q", f.read(8))
    return f.read(n)


def _skip_or_read(f: BinaryIO, vtype: int) -> object:
    if vtype == _STRING:
        return _read_str(f).decode("utf-8", errors="replace")
    fmt = _SCALAR.get(vtype)
    if fmt is None:
        raise ValueError(f"unknown GGUF value type {vtype}")
    return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]


def read_header(path: Path, wanted: Iterable[str] = ()) -> tuple[dict[str, object], str, int]:
    """Scalar keys of a GGUF header, plus (vocab fingerprint, vocab size).

    The fingerprint is a SHA-1 over the token strings, so two files agree only when they
    map text to the same ids.
    """
    keep = set(wanted)
    values: dict[str, object] = {}
    fingerprint, n_vocab = "", 0
    with open(path, "rb", buffering=1 << 20) as f:
        if f.read(4) != b"GGUF":
            raise ValueError("not a GGUF file")
        (version,) = struct.unpack("<I", f.read(4))
        if version < 2:
            raise ValueError(f"GGUF version {version} is too old")
        _n_tensors, n_kv = struct.unpack("<QQ", f.read(16))
        for _ in range(n_kv):
            key = _read_str(f).decode("utf-8", errors="replace")
            (vtype,) = struct.unpack("<I", f.read(4))
            if vtype != _ARRAY:
                value = _skip_or_read(f, vtype)
                if not keep or key in keep or key == "general.architecture":
                    values[key] = value
                continue
            etype, count = struct.unpack("<IQ", f.read(12))
            if key == "tokenizer.ggml.tokens" and etype == _STRING:
                h = hashlib.sha1()
                for _ in range(count):
                    h.update(_read_str(f) + b"\0")
                fingerprint, n_vocab = h.hexdigest(), count
            elif etype == _STRING:
                for _ in range(count):
                    (n,) = struct.unpack("<Q", f.read(8))
                    f.seek(n, 1)
            else:
                fmt = _SCALAR.get(etype)
                if fmt is None:
                    raise ValueError(f"unsupported GGUF array type {etype} for {key}")
                f.seek(struct.calcsize(fmt) * count, 1)
    return values, fingerprint, n_vocab


def read_model_info(path: Path | None, name: str | None = None, source: str = "") -> ModelInfo:
    """Describe one model file; never raises (an unreadable file carries its error)."""
    real = default_model_path() if path is None else Path(path).expanduser()
    if real is None:
        return ModelInfo(None, DEFAULT_MODEL_NAME, error="the bundled model is not installed")
    try:
        values, vocab, n_vocab = read_header(real)
    except (OSError, ValueError, struct.error) as e:
        return ModelInfo(path, name or (DEFAULT_MODEL_NAME if path is None else real.name),
                         error=str(e) or type(e).__name__, source=source)
    arch = str(values.get("general.architecture", "?"))
    # By file name, as the user knows it: a GGUF's internal name is often a training run's
    # ("Smollm2 135M 8k Lc100K Mix1 Ep2" is the bundled model's).
    name = name or (DEFAULT_MODEL_NAME if path is None else real.name)
    return ModelInfo(
        path=None if path is None else real,
        name=name,
        arch=arch,
        n_layer=int(values.get(f"{arch}.block_count", 0) or 0),  # type: ignore[call-overload]
        n_vocab=n_vocab,
        vocab=vocab,
        source=source,
    )


def gguf_files(entries: Iterable[str | Path]) -> list[Path]:
    """Files named directly, and the ``*.gguf`` files inside named folders."""
    out: list[Path] = []
    for entry in entries:
        p = Path(entry).expanduser()
        if p.is_dir():
            out += sorted(p.glob("*.gguf"))
        elif p.exists():
            out.append(p)
    return out


def gather_models(
    model: str | None, draft: str | None, library: Iterable[str], found: Iterable[FoundModel] | None = None
) -> list[ModelInfo]:
    """The bundled model, the configured target and draft, the library, and the GGUFs other
    tools left on this machine (:mod:`..model_files`; None: look now), without repeats."""
    infos = [read_model_info(None)]
    seen = {str(default_model_path().resolve()) if default_model_path() else ""}
    named = [(p, None, "") for p in gguf_files([x for x in (model, draft) if x] + list(library))]
    on_disk = [(f.path, f.name, f.source) for f in (models_on_disk() if found is None else found)]
    for p, name, source in named + on_disk:
        if str(p.resolve()) not in seen:
            seen.add(str(p.resolve()))
            infos.append(read_model_info(p, name, source))
    return infos


@dataclass(frozen=True)
class Choices:
    """What the picker shows for one target (and chosen draft)."""

    drafts: list[ModelInfo]
    strategies: list[str]
    hidden: list[str] = field(default_factory=list)  # one line per thing left out, and why


def compatible_choices(
    target: ModelInfo,
    models: Iterable[ModelInfo],
    draft: ModelInfo | None,
    strategies: Mapping[str, StrategyClass],
) -> Choices:
    """Drafts with the target's vocabulary, and the strategies usable with that draft."""
    drafts: list[ModelInfo] = []
    hidden: list[str] = []
    for m in models:
        if m.key == target.key or m.error or target.error:
            continue
        if m.vocab and m.vocab == target.vocab:
            drafts.append(m)
        else:
            hidden.append(f"draft {m.name}: different vocabulary")
    usable_draft = draft is not None and any(d.key == draft.key for d in drafts)
    names: list[str] = []
    for name, cls in strategies.items():
        if cls.needs_draft and not usable_draft:
            hidden.append(f"strategy {name}: needs a draft model with the same vocabulary")
        else:
            names.append(name)
    return Choices(drafts=drafts, strategies=names, hidden=hidden)
