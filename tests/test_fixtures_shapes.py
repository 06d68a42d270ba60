"""Random-weight fixtures in real models' shapes (engine/lab/fixtures.py ``build_shape``): the
small wide one loads, its weights are valid Q4_0 at the planned scale, its greedy tokens vary,
it is the same file for the same seed, and split over 2 loopback workers it is exact."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from potluck.app.cli import main
from potluck.discovery.auth import keys_from_token
from potluck.engine.cluster.head import open_pipeline
from potluck.engine.cluster.transfer import SliceCache
from potluck.engine.core.events import Finished
from potluck.engine.core.gguf_tools import describe, file_sha256, open_reader
from potluck.engine.core.plain import Plain
from potluck.engine.core.runtime import ContextParams, Model
from potluck.engine.core.sampling import SamplingParams
from potluck.engine.core.session import Session
from potluck.engine.core.target import LocalTarget, Target
from potluck.engine.lab.fixtures import SHAPES, build_shape, llama3_rope_factors

from .cluster_support import TOKEN, WorkerProc, loopback_workers

N_CTX = 512
PROMPTS = ["Hello there, how are you?", "Write a poem about the sea.", "List three prime numbers."]
MAX_NEW = 16


@pytest.fixture(scope="module")
def wide_path() -> Path:
    return build_shape("wide")


@pytest.fixture(scope="module")
def wide(wide_path: Path) -> Iterator[Model]:
    with Model(wide_path) as m:
        yield m


def test_cli_builds_a_shape_and_prints_its_bare_path(capsys: pytest.CaptureFixture[str], wide_path: Path) -> None:
    assert main(["bench", "--build-fixtures", "--shape", "wide"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == str(wide_path)
    assert main(["bench", "--shape", "wide"]) == 2  # --shape alone is one line, not a run
    assert "--shape only applies to --build-fixtures" in capsys.readouterr().err


def test_wide_shape_header_and_weights(wide_path: Path) -> None:
    d = describe(wide_path)
    s = SHAPES["wide"]
    assert (d["arch"], d["n_layer"], d["n_embd"], d["n_vocab"]) == ("llama", s.n_layer, s.n_embd, 49152)
    r = open_reader(wide_path)
    assert int(r.fields["llama.attention.head_count_kv"].contents()) == s.n_head_kv
    assert r.fields["tokenizer.chat_template"].contents().startswith("{% for message in messages %}")
    tensors = {t.name: t for t in r.tensors}
    assert tensors["blk.0.ffn_down.weight"].tensor_type.name == "Q4_0"
    np.testing.assert_array_equal(np.asarray(tensors["rope_freqs.weight"].data),
                                  llama3_rope_factors(s.head_dim, s.rope_factor))
    from gguf.quants import dequantize

    t = tensors["blk.1.ffn_up.weight"]
    w = dequantize(np.asarray(t.data), t.tensor_type)  # every block decodes to finite weights
    assert w.shape == (s.n_ff, s.n_embd) and np.isfinite(w).all()
    assert abs(w.std() * np.sqrt(s.n_embd) - 1.0) < 0.1 and abs(w.mean()) < 1e-3


def test_same_seed_same_bytes_other_seed_other_weights(wide_path: Path, tmp_path: Path) -> None:
    sha = file_sha256(wide_path)
    again = build_shape("wide", force=True)
    assert again == wide_path and file_sha256(again) == sha
    other = build_shape("wide", seed=1)
    assert other != wide_path and file_sha256(other) != sha
    other.unlink()


def greedy(model: Model, target: Target) -> list[tuple[int, ...]]:
    """One reply per prompt, each in a fresh conversation on ``target``."""
    out = []
    for prompt in PROMPTS:
        session = Session(model, target, Plain())
        events = list(session.generate(prompt, SamplingParams(), MAX_NEW))
        assert isinstance(events[-1], Finished)
        out.append(events[-1].tokens)
        target.reset()
    return out


@pytest.fixture(scope="module")
def one_process(wide: Model) -> list[tuple[int, ...]]:
    target = LocalTarget(wide, ContextParams(n_ctx=N_CTX, n_threads=1))
    try:
        return greedy(wide, target)
    finally:
        target.close()


def test_greedy_tokens_vary(one_process: list[tuple[int, ...]]) -> None:
    for tokens in one_process:
        assert len(tokens) == MAX_NEW and len(set(tokens)) >= MAX_NEW // 2, tokens
    assert len({t for tokens in one_process for t in tokens}) > MAX_NEW


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[WorkerProc]]:
    yield from loopback_workers(tmp_path_factory.mktemp("wide-workers"), "wide", n=2)


def test_wide_shape_split_over_two_workers_exact(
    wide: Model, wide_path: Path, workers: list[WorkerProc], one_process: list[tuple[int, ...]],
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    folder = tmp_path_factory.mktemp("wide-slices")
    target = open_pipeline(wide_path, [w.address for w in workers], keys_from_token(TOKEN), n_ctx=N_CTX,
                           split=[0, 2, 4], slice_cache=SliceCache(folder))
    try:
        assert [lk.layers for lk in target.links] == [(0, 2), (2, 4)] and target.head_layers == (4, 4)
        assert target.transfer.files_sent == 2
        # the workers' slices were streamed from the model file: the head wrote only its own slice
        # (the output layer behind layer 3 as zeros)
        assert [p.name.split("-", 1)[1] for p in folder.glob("*.gguf")] == ["3-4.gguf"]
        assert greedy(wide, target) == one_process
    finally:
        target.close()


# published totals and active parameters a token, in billions, and whether the active count
# includes the input embeddings (Qwen's does; gpt-oss's model card and DeepSeek-V2's do not)
PUBLISHED = {"gpt-oss-20b": (20.9, 3.6, False), "gpt-oss-120b": (116.8, 5.1, False),
             "qwen3-30b-a3b": (30.5, 3.3, True), "deepseek-v2-lite": (15.7, 2.4, False)}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_mixture_shapes_have_the_published_parameter_counts(name: str) -> None:
    from potluck.engine.lab.fixtures import _tensor_plan

    s = SHAPES[name]
    want_total, want_active, with_embeddings = PUBLISHED[name]
    total = active = 0
    for tensor, dims, _ in _tensor_plan(s, s.n_vocab):
        n = int(np.prod(dims))
        total += n
        if tensor != "token_embd.weight" or with_embeddings:
            active += n * s.n_expert_used // s.n_expert if "_exps." in tensor else n
    assert abs(total / 1e9 - want_total) < 0.1 and abs(active / 1e9 - want_active) < 0.1, (total, active)


def test_layers_builds_fewer_layers_of_a_shape(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--build-fixtures", "--shape", "deepseek2-small", "--layers", "2"]) == 0
    path = Path(capsys.readouterr().out.splitlines()[-1])
    d = describe(path)
    assert (d["arch"], d["n_layer"], d["n_expert"], d["n_expert_shared"]) == ("deepseek2", 2, 8, 1)
    # the hybrid's shapes (engine/lab/hybrid_shapes.py) through the same option
    assert main(["bench", "--build-fixtures", "--shape", "qwen35moe-small", "--layers", "4"]) == 0
    d = describe(Path(capsys.readouterr().out.splitlines()[-1]))
    assert (d["arch"], d["n_layer"], d["cache"]) == ("qwen35moe", 4, "kv+recurrent")
    assert main(["bench", "--layers", "2"]) == 2
    assert "--layers only applies to --build-fixtures --shape" in capsys.readouterr().err


@pytest.mark.slow
def test_a_full_width_layer_of_gpt_oss_20b_loads_with_the_published_vocabulary() -> None:
    """One layer of gpt-oss-20b at its width (1.1 GB): MXFP4 experts, 201,088 tokens (the
    bundled tokenizer padded with tokens no text makes), greedy tokens finite and varied."""
    path = build_shape("gpt-oss-20b", layers=1)
    with Model(path) as m:
        assert (m.arch, m.n_layer, m.n_vocab, m.n_embd) == ("gpt-oss", 1, 201088, 2880)
        assert max(m.tokenize("Hello there, <|potluck_pad_3|>")) < 49152  # text never makes a pad token
        target = LocalTarget(m, ContextParams(n_ctx=256, n_threads=2))
        try:
            logits = target.decode(m.tokenize("Hello there, how are you?"), all_logits=True)
            assert np.isfinite(logits).all() and len({int(np.argmax(r)) for r in logits}) > 3
        finally:
            target.close()


def test_gpt_oss_experts_are_valid_mxfp4_blocks_at_the_planned_scale() -> None:
    from gguf.quants import dequantize

    path = build_shape("gpt-oss-small")
    t = {t.name: t for t in open_reader(path).tensors}["blk.1.ffn_up_exps.weight"]
    assert t.tensor_type.name == "MXFP4"
    w = dequantize(np.asarray(t.data), t.tensor_type)  # every block decodes (gguf 0.19 reads MXFP4)
    n_expert, n_ff, n_embd = w.shape
    assert (n_expert, n_ff, n_embd) == (8, 256, 256) and np.isfinite(w).all()
    # a power-of-two scale: within a factor of sqrt(2) of 1/sqrt(inputs)
    assert 0.7 < w.std() * np.sqrt(n_embd) < 1.42 and abs(w.mean()) < 1e-3
