"""Gigabyte slices: a cut transfer resumes where it stopped, a second run sends nothing, and a
cached slice corrupted in place (size and mtime kept) is caught by its seal and sent again."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from potluck.discovery.auth import keys_from_token
from potluck.engine.cluster import slice_seal
from potluck.engine.cluster.head import open_pipeline
from potluck.engine.cluster.pipeline_target import PipelineTarget
from potluck.engine.cluster.transfer import SliceCache
from potluck.engine.core.runtime import ContextParams, Model
from potluck.engine.core.target import LocalTarget
from potluck.engine.lab.fixtures import build_shape

from .cluster_support import TOKEN, WorkerProc, loopback_workers

N_CTX = 256
PROMPT = "<|im_start|>user\nName three rivers.<|im_end|>\n<|im_start|>assistant\n"


def corrupt_in_place(path: Path, offset: int) -> None:
    """Flip one byte, then put the size and mtime back as they were."""
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns


def test_seal_catches_a_byte_changed_in_place(tmp_path: Path) -> None:
    path = tmp_path / "s.gguf"
    path.write_bytes(os.urandom(1 << 20))
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    slice_seal.seal(path, sha)
    assert slice_seal.sealed(path, sha) and not slice_seal.check_slice(path, sha)  # one stat, no hash
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns))  # touched, same bytes
    assert not slice_seal.sealed(path, sha)
    assert slice_seal.check_slice(path, sha) and slice_seal.sealed(path, sha)  # re-hashed, resealed
    corrupt_in_place(path, 12345)
    assert not slice_seal.sealed(path, sha)
    with pytest.raises(slice_seal.SliceCorrupted, match="does not match its sha256"):
        slice_seal.check_slice(path, sha)


@pytest.fixture(scope="module")
def wide() -> Path:
    return build_shape("wide")


@pytest.fixture(scope="module")
def reference(wide: Path) -> np.ndarray:
    with Model(wide) as m:
        target = LocalTarget(m, ContextParams(n_ctx=N_CTX, n_threads=1))
        try:
            return target.decode(m.tokenize(PROMPT))
        finally:
            target.close()


@pytest.fixture()
def worker(tmp_path: Path) -> Iterator[WorkerProc]:
    yield from (ws[0] for ws in loopback_workers(tmp_path, "slices", n=1))


class Cut(Exception):
    """Stands for the head going away mid-transfer (Ctrl-C, a dropped link)."""


def _open(wide: Path, w: WorkerProc, cache: SliceCache, progress=None) -> PipelineTarget:  # noqa: ANN001
    return open_pipeline(wide, [w.address], keys_from_token(TOKEN), n_ctx=N_CTX, split=[0, 4],
                         slice_cache=cache, progress=progress, recover=False)


def _exact(target: PipelineTarget, wide: Path, reference: np.ndarray) -> None:
    with Model(wide, vocab_only=True) as m:
        assert np.array_equal(target.decode(m.tokenize(PROMPT)), reference)


def test_a_cut_transfer_resumes_where_it_stopped(
    wide: Path, worker: WorkerProc, reference: np.ndarray, tmp_path: Path
) -> None:
    cache = SliceCache(tmp_path / "head")
    (sl,) = cache.slices(wide, [0, 4])
    seen: list[int] = []

    def cut_halfway(what: str, done: int, total: int) -> None:
        seen.append(done)
        if done >= total // 2:
            raise Cut

    with pytest.raises(Cut):
        _open(wide, worker, cache, cut_halfway)
    stopped = seen[-1]
    assert 0 < stopped < sl.size
    again: list[int] = []
    target = _open(wide, worker, cache, lambda what, done, total: again.append(done))
    try:
        assert again[0] > stopped - (8 << 20)  # resumed from what the worker kept, not from 0
        assert target.transfer.bytes_sent == sl.size - target.transfer.resumed_bytes
        assert target.transfer.resumed_bytes >= stopped - (8 << 20) and target.transfer.files_sent == 1
        _exact(target, wide, reference)
    finally:
        target.close()


def test_second_run_sends_nothing_and_a_corrupted_slice_is_sent_again(
    wide: Path, worker: WorkerProc, reference: np.ndarray, tmp_path: Path
) -> None:
    cache = SliceCache(tmp_path / "head")
    assert cache.known_ranges(wide) == frozenset()
    (sl,) = cache.slices(wide, [0, 4])
    assert SliceCache(tmp_path / "head").known_ranges(wide) == {(0, 4)}  # the planner prefers it next time
    first = _open(wide, worker, cache)
    first.close()
    assert first.transfer.files_sent == 1
    second = _open(wide, worker, cache)
    second.close()
    assert second.transfer.bytes_sent == 0 and second.transfer.files_cached == 1
    # each offer and load found the seal whole: one stat each, never a re-hash (marking the
    # slice used once set its time, which moved its ctime and broke the seal every time)
    assert "re-hashing" not in worker.log()
    cached = worker.log_path.parent / "slices0-cache" / f"{sl.sha256}.gguf"
    corrupt_in_place(cached, sl.size // 2)
    third = _open(wide, worker, cache)
    try:
        assert third.transfer.files_sent == 1 and third.transfer.bytes_sent == sl.size  # caught and re-sent
        _exact(third, wide, reference)
    finally:
        third.close()
    assert "does not match its sha256" in worker.log()


def test_a_slice_layout_is_laid_out_once_per_file_version(model_path: Path, tmp_path: Path) -> None:
    """A reopen lays out the same slice from memory (no header rebuilt); a model file replaced
    under the same name is laid out afresh, and the layout streams the new file's bytes."""
    from potluck.engine.core import gguf_tools

    src = tmp_path / "m.gguf"
    gguf_tools.merge_layer_ranges(model_path, src, [(0, 9)])
    first = gguf_tools.layer_layout(src, range(0, 4))
    built = gguf_tools._layout_of_version.cache_info().misses
    again = gguf_tools.layer_layout(src, range(0, 4))
    assert again is first and gguf_tools._layout_of_version.cache_info().misses == built
    # the head's slice cache names a slice by its source and this recipe: another layout of the
    # same range (a stage's, or a later potluck's) is another slice, hashed anew
    stage = gguf_tools.layer_layout(src, range(0, 4), stage=True)
    assert first.recipe == again.recipe and stage.recipe != first.recipe
    gguf_tools.merge_layer_ranges(model_path, src.with_name("new.gguf"), [(0, 11)])
    os.replace(src.with_name("new.gguf"), src)  # a new version of the file, same path
    built = gguf_tools._layout_of_version.cache_info().misses  # the merge laid out its own
    fresh = gguf_tools.layer_layout(src, range(0, 11))
    assert gguf_tools._layout_of_version.cache_info().misses == built + 1
    assert fresh.size == os.path.getsize(fresh.write_to(tmp_path / "cut.gguf"))
    with Model(tmp_path / "cut.gguf") as cut:
        assert cut.meta("llama.block_count") == "11"


def test_a_stage_slice_holds_its_unused_output_as_zeros_llama_cpp_does_not_repack(
    wide: Path, tmp_path: Path
) -> None:
    """A worker's stage never computes the output layer (the head does). The wide shape ties
    its output to the embeddings, which llama.cpp would duplicate and repack into the stage's
    memory; its stage slice carries an explicit output matrix instead, Q4_1 zeros (no repacked
    layout), the last worker's too, while the head's own slice keeps the model's."""
    import gguf

    from potluck.engine.core.gguf_tools import open_reader

    cache = SliceCache(tmp_path)
    front, back = cache.slices(wide, [0, 3, 4])
    tail = cache.head_slice(wide, (3, 4))
    head = {t.name: t for t in open_reader(tail.layout.write_to(tmp_path / "tail.gguf")).tensors}
    for i, sl in enumerate((front, back)):
        stage = {t.name: t for t in open_reader(sl.layout.write_to(tmp_path / f"s{i}.gguf")).tensors}
        out, embd = stage["output.weight"], stage["token_embd.weight"]
        assert out.tensor_type == gguf.GGMLQuantizationType.Q4_1 and not np.any(out.data)
        assert list(out.shape) == list(embd.shape)  # [n_embd, n_vocab], as the tied matrix
    embd = {t.name: t for t in open_reader(wide).tensors}["token_embd.weight"]
    assert "output.weight" not in head and head["token_embd.weight"].tensor_type == embd.tensor_type
