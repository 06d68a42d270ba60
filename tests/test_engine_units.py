"""Engine building blocks: sampling filters, UTF-8 streaming, GGUF merges, abort, chat format."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

from potluck.engine.core.chat import ChatFormat, Message, TextStream
from potluck.engine.core.gguf_tools import file_sha256, merge_layer_ranges, open_reader, parse_recipe
from potluck.engine.core.plain import Plain
from potluck.engine.core.runtime import ContextParams, Model
from potluck.engine.core.sampling import Sampler, SamplingParams, penalize
from potluck.engine.core.session import Session
from potluck.engine.core.target import LocalTarget

from .support.distributions import dense_probs

LOGITS = np.log(np.array([0.5, 0.2, 0.15, 0.1, 0.05], dtype=np.float32))
TOP3 = [0.5 / 0.85, 0.2 / 0.85, 0.15 / 0.85, 0, 0]


def test_header_reader_parses_arrays_as_the_element_wise_walk_does(model_path: Path) -> None:
    """The fast array walk gives the same fields, parts, offsets and tensors as gguf's own
    per-element recursion (the default model's string and integer arrays among them)."""
    import gguf

    fast = open_reader(model_path)

    class ElementWise(type(fast)):  # type: ignore[misc]
        _get_field_parts = gguf.GGUFReader._get_field_parts

    walk = ElementWise(str(model_path), "r")
    assert list(fast.fields) == list(walk.fields)
    kinds = set()
    for name, f in fast.fields.items():
        w = walk.fields[name]
        assert (f.offset, f.data, f.types) == (w.offset, w.data, w.types), name
        assert [(p.dtype, p.tobytes()) for p in f.parts] == [(p.dtype, p.tobytes()) for p in w.parts], name
        assert f.contents() == w.contents(), name
        kinds.add(tuple(f.types))
    array, string, int32 = gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING, gguf.GGUFValueType.INT32
    assert {(array, string), (array, int32)} <= kinds
    assert [(t.name, t.data_offset, t.n_bytes) for t in fast.tensors] == [
        (t.name, t.data_offset, t.n_bytes) for t in walk.tensors
    ]


@pytest.mark.parametrize("count", [2**60, 10**9, "one more"])
def test_an_array_longer_than_the_file_is_refused_in_one_line(count: object, model_path: Path, tmp_path: Path) -> None:
    """A vocabulary whose count says more strings than the file holds is refused at once in one
    line (never a list of 2^60 offsets, never a walk off the end); one string too many reads
    on into the next keys, and is refused in one line too."""
    import struct

    from potluck.engine.core.errors import ModelError

    tokens = open_reader(model_path).fields["tokenizer.ggml.tokens"]
    at = tokens.offset + 8 + int(tokens.parts[0][0]) + 4 + 4  # the key, its type, the element type
    data = bytearray(model_path.open("rb").read(4_000_000))
    n = len(tokens.data) + 1 if count == "one more" else count
    data[at : at + 8] = struct.pack("<Q", n)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    t0 = time.perf_counter()
    with pytest.raises(ModelError, match="truncated or corrupt") as err:
        open_reader(bad)
    assert "\n" not in str(err.value)
    if count != "one more":  # one string more reads the next key as one: what follows is then wrong
        assert "runs past the end of the file" in str(err.value)
    assert time.perf_counter() - t0 < 30


def test_greedy_is_one_hot_on_argmax() -> None:
    p = dense_probs(LOGITS, SamplingParams())
    assert p.tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]


def test_temperature_one_recovers_softmax() -> None:
    p = dense_probs(LOGITS, SamplingParams(temperature=1.0))
    assert np.allclose(p, [0.5, 0.2, 0.15, 0.1, 0.05])


def test_top_k_top_p_min_p_filters() -> None:
    assert np.allclose(dense_probs(LOGITS, SamplingParams(temperature=1.0, top_k=2)), [5 / 7, 2 / 7, 0, 0, 0])
    # top-p 0.8: the smallest set with mass >= 0.8 is {0.5, 0.2, 0.15} (0.85)
    assert np.allclose(dense_probs(LOGITS, SamplingParams(temperature=1.0, top_p=0.8)), TOP3)
    # min-p 0.25: keep tokens with p >= 0.25 * 0.5
    assert np.allclose(dense_probs(LOGITS, SamplingParams(temperature=1.0, min_p=0.25)), TOP3)


def test_repeat_penalty_lowers_repeated_tokens() -> None:
    logits = np.array([2.0, 2.0, -1.0], dtype=np.float32)
    p = dense_probs(logits, SamplingParams(temperature=1.0, repeat_penalty=2.0), history=[0, 2])
    assert p[0] < p[1]
    assert p[2] < dense_probs(logits, SamplingParams(temperature=1.0))[2]


def test_top_p_and_min_p_read_the_untempered_distribution_as_llama_cpp_does() -> None:
    """llama.cpp's chain: top-k, top-p, min-p, then temperature. At temperature 0.5 the mass
    of {0.5, 0.2} would pass 0.8 (0.89 of the sharpened softmax), but top-p reads the untempered
    one, where it takes {0.5, 0.2, 0.15}; temperature then sharpens only the survivors."""
    p = dense_probs(LOGITS, SamplingParams(temperature=0.5, top_p=0.8))
    kept = np.array([0.5, 0.2, 0.15]) ** 2
    assert np.allclose(p, [*(kept / kept.sum()), 0, 0])
    # min-p 0.25 keeps p >= 0.125 at temperature 1, whatever the temperature
    assert np.count_nonzero(dense_probs(LOGITS, SamplingParams(temperature=3.0, min_p=0.25))) == 3
    assert np.count_nonzero(dense_probs(LOGITS, SamplingParams(temperature=0.2, min_p=0.25))) == 3


def test_frequency_and_presence_penalties_are_llama_cpps() -> None:
    """A token seen c times in the window: logit / repeat (x repeat when negative), minus
    c * frequency + presence; the window is the last repeat_last_n tokens."""
    logits = np.array([2.0, -1.0, 0.5, 0.0], dtype=np.float32)
    params = SamplingParams(temperature=1.0, repeat_penalty=2.0, frequency_penalty=0.3,
                            presence_penalty=0.2, repeat_last_n=4)
    history = [2, 2, 0, 1, 1, 1]  # the window holds 0, 1, 1, 1: token 2 fell out of it
    want = np.array([2.0 / 2 - 0.3 - 0.2, -1.0 * 2 - 3 * 0.3 - 0.2, 0.5, 0.0])
    assert np.allclose(dense_probs(logits, params, history), np.exp(want) / np.exp(want).sum())
    assert np.allclose(penalize(logits, history, params), want)
    assert penalize(logits, history, SamplingParams(temperature=1.0)) is logits  # nothing on: no copy
    # greedy with penalties: the argmax of the penalized logits
    greedy = SamplingParams(frequency_penalty=2.0)
    assert Sampler(greedy).sample(logits, [0]) == 2 and Sampler(SamplingParams()).sample(logits, [0]) == 0


def test_sampler_draws_follow_distribution() -> None:
    sampler = Sampler(SamplingParams(temperature=1.0, seed=3))
    counts = np.bincount([sampler.sample(LOGITS) for _ in range(20000)], minlength=5) / 20000
    assert np.allclose(counts, [0.5, 0.2, 0.15, 0.1, 0.05], atol=0.015)


def test_text_stream_holds_back_partial_utf8() -> None:
    data = "né 🙂".encode()
    stream = TextStream()
    out = [stream.feed([data[i : i + 1]]) for i in range(len(data))]
    assert "".join(out) + stream.flush() == "né 🙂"
    assert all("\ufffd" not in o for o in out)


def test_model_tokens_stream_back_to_text(model: Model) -> None:
    text = "Grüße 🙂 — naïve café"
    tokens = model.tokenize(text)
    stream = TextStream()
    assert "".join(stream.feed([model.token_bytes(t)]) for t in tokens) + stream.flush() == text


def test_chat_template_renders_model_format(model: Model) -> None:
    fmt = ChatFormat(model.chat_template)
    text = fmt.render([Message("system", "S"), Message("user", "U")])
    assert text == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"


def test_merge_and_slice_layers(model_path: Path, model: Model, tmp_path: Path) -> None:
    identity = merge_layer_ranges(model_path, tmp_path / "same.gguf", [(0, 29)])
    deeper = merge_layer_ranges(model_path, tmp_path / "deep.gguf", parse_recipe("0-19,10-29"))
    assert parse_recipe("0-29x2") == [(0, 29), (0, 29)]
    with Model(identity) as same, Model(deeper) as deep:
        assert (same.n_layer, deep.n_layer) == (30, 40)
        tokens = model.tokenize("Hello world")
        a, b = LocalTarget(model, ContextParams(n_ctx=256)), LocalTarget(same, ContextParams(n_ctx=256))
        assert np.array_equal(a.decode(tokens), b.decode(tokens))
        a.close()
        b.close()
    assert len(file_sha256(identity)) == 64
    with pytest.raises(Exception, match="outside"):
        merge_layer_ranges(model_path, tmp_path / "bad.gguf", [(0, 30)])


def test_abort_stops_prefill_and_cleans_cells(model: Model) -> None:
    session = Session(model, LocalTarget(model, ContextParams(n_ctx=4096, n_batch=512)), Plain())
    long_text = "Describe this. " + "The sky is blue and the grass is green. " * 80

    def cancel_once_computing() -> None:
        while session.target.runner.running_group is None:
            time.sleep(0.001)
        session.cancel()

    timer = threading.Thread(target=cancel_once_computing)
    timer.start()
    events = list(session.generate(long_text, max_tokens=8))
    timer.join()
    assert events[-1].reason == "cancelled"
    assert events[-1].tokens == ()  # stopped inside the prompt, not after it
    assert session.target.runner.counters.aborted == 1  # stopped mid-batch, not between batches
    assert session.target.n_past == session.target.pos_max()[0] + 1
    # Decoding goes on normally after the abort (a fresh conversation reuses the cleaned cells).
    session.load_messages([])
    events = list(session.generate("Say hi.", max_tokens=4))
    assert events[-1].tokens
    session.target.close()


def test_plain_steps_sent_ahead_are_dropped_where_the_reply_ends_early(model: Model) -> None:
    """Plain sends each token's step before handing its round on; a reply its caller ends (a
    stop string) leaves that step unread: it is dropped, so the cache holds the conversation's
    prefix and the next reply is a fresh session's, token for token."""
    from potluck.engine.core.events import TokenText

    params = ContextParams(n_ctx=1024, n_batch=512)
    plain = Plain()
    session = Session(model, LocalTarget(model, params), plain)
    seen = 0
    for event in session.generate("Name three rivers.", max_tokens=24):
        if isinstance(event, TokenText):
            seen += 1
            if seen == 3:
                session.end_choice()  # as serve does when a stop string turns up
    assert event.reason == "stop" and len(event.tokens) == 3
    assert plain.sent_ahead >= 3 and plain.dropped == 1  # the path ran
    target = session.target
    assert target.n_past == target.pos_max()[0] + 1 == len(session._tokens) - 1  # the last token pending
    *_, after = session.generate("And two lakes?", max_tokens=16)
    fresh = Session(model, LocalTarget(model, params), Plain())
    fresh.load_messages(session.messages[:-2], fresh=True)
    *_, want = fresh.generate("And two lakes?", max_tokens=16)
    assert after.tokens == want.tokens
    # a reply that runs to its length drops nothing: its last token sends no step
    dropped = plain.dropped
    *_, whole = session.generate("One more?", max_tokens=5)
    assert whole.reason == "length" and plain.dropped == dropped
    for s in (session, fresh):
        s.target.close()


_OBSERVER_IN_A_FRESH_PROCESS = """
from potluck.engine.core.observe import native_observer
from potluck.engine.core.observe_kernel import observe
assert native_observer() == observe.address
print(observe.cache_hits)
"""


def test_the_graph_observer_is_loaded_from_numbas_cache_in_a_new_process(model: Model) -> None:
    """Every worker's stage process observes its graph (the capture after its last layer); the
    callback reads the C functions' addresses from its control block, so numba caches it and a
    second process loads it instead of compiling it again. Through it a context copies the last
    layer's rows and computes the same logits as one that observes nothing; that the rows are the
    layer's exact output is proven where stages hand them on (the cluster exactness tests)."""
    import subprocess
    import sys

    runs = [subprocess.run([sys.executable, "-c", _OBSERVER_IN_A_FRESH_PROCESS], capture_output=True, text=True,
                           timeout=120) for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), runs[-1].stderr[-2000:]
    assert runs[1].stdout.split() == ["1"]  # loaded from the cache, not compiled
    tokens = model.tokenize("The observer copies rows out of a running graph.")
    last = model.n_layer - 1
    watched = LocalTarget(model, ContextParams(n_ctx=256, n_threads=1, observe=(f"l_out-{last}",)))
    plain = LocalTarget(model, ContextParams(n_ctx=256, n_threads=1))
    try:
        logits = watched.decode(tokens, all_logits=True).copy()
        rows = watched.stage.ctx.observed[f"l_out-{last}"]
        assert rows.shape == (len(tokens), model.n_embd) and np.isfinite(rows).all() and rows.any()
        assert np.array_equal(logits, plain.decode(tokens, all_logits=True))  # observing changes nothing
    finally:
        watched.close()
        plain.close()


def test_the_tensor_index_is_read_again_when_the_file_changes_and_a_missing_file_is_one_line(tmp_path: Path) -> None:
    """Remembered per file version (gguf_tools.file_version): a GGUF rewritten in place is
    indexed anew, and a path that is gone is one line naming it."""
    import os

    import gguf

    from potluck.engine.core.errors import ModelError
    from potluck.engine.core.gguf_tools import tensor_index

    path = tmp_path / "m.gguf"

    def write(types: list[np.dtype]) -> None:
        w = gguf.GGUFWriter(str(path), arch="llama")
        for i, t in enumerate(types):
            w.add_tensor(f"blk.{i}.ffn_up.weight", np.ones((4, 4), dtype=t))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()

    write([np.float32])
    assert [(t.name, t.type_name) for t in tensor_index(path)] == [("blk.0.ffn_up.weight", "F32")]
    assert tensor_index(path) == tensor_index(path)  # remembered: the same entries again
    write([np.float16, np.float32])
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # a new version even on a coarse clock
    assert [(t.name, t.type_name) for t in tensor_index(path)] == [
        ("blk.0.ffn_up.weight", "F16"), ("blk.1.ffn_up.weight", "F32")]
    path.unlink()
    with pytest.raises(ModelError) as err:
        tensor_index(path)
    assert "could not read GGUF" in str(err.value) and "m.gguf" in str(err.value) and "\n" not in str(err.value)
