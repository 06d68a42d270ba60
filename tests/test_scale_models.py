"""`potluck worker --models DIR`: a worker holding the model (same sha256) cuts its slice
itself, receives nothing, and the split is exact."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from potluck.discovery.auth import keys_from_token
from potluck.engine.cluster.head import open_pipeline
from potluck.engine.cluster.transfer import SliceCache
from potluck.engine.core.runtime import ContextParams, Model
from potluck.engine.core.target import LocalTarget
from potluck.engine.lab.fixtures import build_shape

from .cluster_support import TOKEN, WorkerProc, start_worker, stop_worker

PROMPT = "<|im_start|>user\nName three rivers.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def wide() -> Path:
    return build_shape("wide")


@pytest.fixture(scope="module")
def holder(wide: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProc]:
    """A worker whose --models folder holds the same file under another name."""
    folder = tmp_path_factory.mktemp("models")
    os.link(wide, folder / "my-copy.gguf")
    w = start_worker(tmp_path_factory.mktemp("holder"), "holder", extra_args=["--models", str(folder)])
    try:
        yield w
    finally:
        stop_worker(w.proc)


def test_a_worker_holding_the_model_receives_nothing_and_is_exact(
    wide: Path, holder: WorkerProc, tmp_path: Path
) -> None:
    target = open_pipeline(wide, [holder.address], keys_from_token(TOKEN), n_ctx=256, split=[0, 4],
                           slice_cache=SliceCache(tmp_path / "head"))
    try:
        assert target.transfer.bytes_sent == 0 and target.transfer.files_cached == 1
        with Model(wide) as m:
            local = LocalTarget(m, ContextParams(n_ctx=256, n_threads=1))
            try:
                tokens = m.tokenize(PROMPT)
                assert np.array_equal(local.decode(tokens), target.decode(tokens))
            finally:
                local.close()
    finally:
        target.close()
    assert "cut slice" in holder.log() and "from the local my-copy.gguf" in holder.log()
