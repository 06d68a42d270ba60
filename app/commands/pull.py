"""`potluck pull REPO[:QUANT]`: download a GGUF from Hugging Face into its cache.

As ollama's ``pull`` and llama.cpp's ``-hf``: ``REPO`` is a Hugging Face model repository
(``bartowski/SmolLM2-1.7B-Instruct-GGUF``), ``QUANT`` picks a file by its quantization
(``Q4_K_M``, the default when the repository has it). huggingface_hub does the transfer: into
its cache (``potluck models`` and the chat's picker list what is there), resumed where an
interrupted one stopped, with a progress bar. Each file is then checked against the SHA-256
the hub lists for it; a file that does not match is deleted. A model split into parts
(``-00001-of-00003.gguf``) is downloaded whole and used as llama.cpp uses it: by its first
part. ``HF_ENDPOINT`` points it at a mirror (the tests' fake hub), ``HF_TOKEN`` at gated repos.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

from ...engine import PotluckError
from ..cli import COMMANDS
from ..model_files import hf_hub_cache, is_first_part

DEFAULT_QUANT = "Q4_K_M"  # llama.cpp's and ollama's usual pick: small, close to the original
_REPO = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_SPLIT = re.compile(r"-\d{5}-of-\d{5}(?=\.gguf$)")
_QUANT = re.compile(r"(?i)(?:^|[-_.])((?:I?Q\d[\w]*?)|(?:BF16|F16|F32))(?=\.gguf$|-\d{5}-of-)")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "pull",
        help=COMMANDS["pull"],
        description="Download a GGUF from a Hugging Face repository into the Hugging Face cache "
        f"(resumable, SHA-256 checked). QUANT picks the file (default {DEFAULT_QUANT} when there is one); "
        "split models are downloaded whole. Then `potluck chat -m PATH` (or ctrl+o in the chat) opens it.",
    )
    p.add_argument("model", metavar="REPO[:QUANT]", help="e.g. bartowski/SmolLM2-1.7B-Instruct-GGUF:Q4_K_M")
    p.add_argument("--revision", default=None, help="a branch, tag or commit (default: main)")
    p.add_argument("--list", action="store_true", help="list the repository's GGUF files and download nothing")


@dataclass(frozen=True)
class RemoteFile:
    path: str
    size: int
    sha256: str | None  # the hub's LFS checksum; None for a file kept in git itself


def parse_model(text: str) -> tuple[str, str | None]:
    repo, _, quant = text.partition(":")
    if not _REPO.match(repo):
        raise PotluckError(f"pull: {text!r} is not a Hugging Face repository (ORG/NAME[:QUANT])")
    return repo, quant or None


def quant_of(path: str) -> str:
    m = _QUANT.search(Path(path).name)
    return m.group(1).upper() if m else Path(_SPLIT.sub("", path)).stem


def choose(files: list[RemoteFile], quant: str | None, repo: str) -> list[RemoteFile]:
    """The files of one model: those whose name has ``quant`` (all parts of a split one)."""
    ggufs = [f for f in files if f.path.endswith(".gguf")]
    if not ggufs:
        raise PotluckError(f"pull: {repo} has no GGUF file")
    models: dict[str, list[RemoteFile]] = {}
    for f in sorted(ggufs, key=lambda f: f.path):
        models.setdefault(_SPLIT.sub("", f.path), []).append(f)
    available = sorted({quant_of(k) for k in models})
    if quant is None:
        if len(models) == 1:
            return next(iter(models.values()))
        quant = DEFAULT_QUANT if DEFAULT_QUANT in available else None
        if quant is None:
            raise PotluckError(
                f"pull: {repo} has several GGUFs; name one: {repo}:QUANT with QUANT in {', '.join(available)}"
            )
    wanted = [parts for key, parts in models.items() if quant.upper() == quant_of(key)]
    if not wanted:
        wanted = [parts for key, parts in models.items() if quant.upper() in Path(key).name.upper()]
    if not wanted:
        raise PotluckError(f"pull: {repo} has no {quant} GGUF; it has {', '.join(available)}")
    if len(wanted) > 1:
        names = ", ".join(parts[0].path for parts in wanted)
        raise PotluckError(f"pull: {quant} matches several files in {repo} ({names}); name one more exactly")
    return wanted[0]


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _hub_error(e: Exception, repo: str) -> PotluckError:
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    if isinstance(e, GatedRepoError):
        return PotluckError(f"pull: {repo} is gated: accept its terms on Hugging Face and set HF_TOKEN")
    if isinstance(e, RepositoryNotFoundError):
        return PotluckError(f"pull: no repository {repo} on Hugging Face (or it is private: set HF_TOKEN)")
    if isinstance(e, RevisionNotFoundError):
        return PotluckError(f"pull: {repo} has no such revision")
    where = os.environ.get("HF_ENDPOINT") or "huggingface.co"
    reason = " ".join(str(e).split())[:200] or type(e).__name__
    return PotluckError(f"pull: cannot download from {where}: {reason}; check the connection and run it again")


def list_files(repo: str, revision: str | None) -> list[RemoteFile]:
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import RepoFile

    api = HfApi(endpoint=os.environ.get("HF_ENDPOINT") or None)
    try:
        entries = list(api.list_repo_tree(repo, recursive=True, revision=revision))
    except Exception as e:  # network, HTTP and hub errors alike: one line
        raise _hub_error(e, repo) from None
    return [
        RemoteFile(e.path, e.size, e.lfs.sha256 if e.lfs is not None else None)
        for e in entries if isinstance(e, RepoFile)
    ]


def download(repo: str, f: RemoteFile, revision: str | None) -> Path:
    """One file into the hub cache (resumed if a partial one is there), checked by SHA-256."""
    from huggingface_hub import hf_hub_download

    try:
        path = Path(hf_hub_download(
            repo, f.path, revision=revision, cache_dir=hf_hub_cache(),
            endpoint=os.environ.get("HF_ENDPOINT") or None,
        ))
    except Exception as e:
        raise _hub_error(e, repo) from None
    if f.sha256 is not None:
        got = sha256_of(path)
        if got != f.sha256:
            blob = path.resolve()
            path.unlink(missing_ok=True)
            blob.unlink(missing_ok=True)
            raise PotluckError(
                f"pull: {f.path} is corrupt (SHA-256 {got[:12]}…, the hub lists {f.sha256[:12]}…); "
                "deleted it: run pull again"
            )
    return path


def run(args: argparse.Namespace) -> int:
    repo, quant = parse_model(args.model)
    files = list_files(repo, args.revision)
    if args.list:
        for f in files:
            if f.path.endswith(".gguf"):
                print(f"{f.size / 1e9:7.2f} GB  {quant_of(f.path):<8} {f.path}")
        return 0
    parts = choose(files, quant, repo)
    total = sum(f.size for f in parts)
    print(f"{repo}: {', '.join(f.path for f in parts)} ({total / 1e9:.2f} GB)", flush=True)
    paths = [download(repo, f, args.revision) for f in parts]
    first = next(p for p in paths if is_first_part(p))
    print(f"ready: {first}\nchat with it: potluck chat -m {first}   (or ctrl+o in the chat)")
    return 0
