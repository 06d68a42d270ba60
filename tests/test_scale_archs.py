"""qwen2 and qwen3 split exactly: random-weight fixtures of those architectures (q/k/v biases,
per-head q/k norms with an explicit head width) cut into layer slices give the whole model's
logits, prompt and greedy steps alike, and the greedy tokens vary (the path is not trivial).

Neither architecture has per-layer hyperparameters in llama.cpp (no sliding-window pattern or
per-layer arrays, unlike gemma3: docs/facts.md §5), so the llama recipe applies unchanged."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from potluck.engine.core.gguf_tools import SPLITTABLE_ARCHS, slice_layers
from potluck.engine.core.runtime import ContextParams, Model
from potluck.engine.core.target import LocalTarget
from potluck.engine.lab.fixtures import SHAPES, build_shape

from .support.split_target import SplitTarget

PROMPTS = ["<|im_start|>user\nHello there, how are you?<|im_end|>\n<|im_start|>assistant\n",
           "<|im_start|>user\nList three prime numbers.<|im_end|>\n<|im_start|>assistant\n"]


@pytest.mark.parametrize("shape", ["qwen2-small", "qwen3-small"])
def test_split_is_exact(shape: str, tmp_path: Path) -> None:
    path = build_shape(shape)
    with Model(path) as whole_model:
        assert whole_model.arch == SHAPES[shape].arch in SPLITTABLE_ARCHS
        slices = [Model(slice_layers(path, tmp_path / f"s{lo}.gguf", lo, hi)) for lo, hi in ((0, 1), (1, 3), (3, 4))]
        params = ContextParams(n_ctx=256, n_threads=1)
        whole, split = LocalTarget(whole_model, params), SplitTarget(slices, params)
        try:
            for prompt in PROMPTS:
                whole.truncate(0)
                split.truncate(0)
                tokens = whole_model.tokenize(prompt)
                ref = whole.decode(tokens, all_logits=True).copy()
                assert np.isfinite(ref).all() and np.array_equal(ref, split.decode(tokens, all_logits=True))
                tok, seen = int(np.argmax(ref[-1])), []
                for _ in range(24):
                    ref1 = whole.decode([tok])[0].copy()
                    assert np.array_equal(ref1, split.decode([tok])[0])
                    seen.append(tok)
                    tok = int(np.argmax(ref1))
                assert len(set(seen)) >= 12, seen
        finally:
            split.close()
            whole.close()
            for m in reversed(slices):
                m.close()
