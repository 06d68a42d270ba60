"""Baselines from other projects, run in our process on the same prompt tokens.

``llama_cpp.Llama`` (the high-level class of our own dependency) is imported here and
nowhere else in the engine besides :mod:`.runtime`. It cannot set ``use_extra_bufts``
(needed on AMX CPUs, docs/facts.md §1), so ``llama_model_default_params`` is patched while
the model loads; it needs ``logits_all=True`` with a draft model or it crashes (docs/facts.md §9).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..core.backend import default_extra_bufts
from ..core.load_watch import default_threads
from ..core.runtime import ContextParams

KV_TYPE = ContextParams().kv_type


@dataclass(frozen=True)
class BaselineRun:
    tokens: list[int]
    prefill_s: float  # until the first token
    decode_s: float  # from the first token to the last


@contextlib.contextmanager
def _model_params_patched(use_extra_bufts: bool) -> Iterator[None]:
    import llama_cpp.llama_cpp as low

    original = low.llama_model_default_params

    def patched():  # type: ignore[no-untyped-def]
        params = original()
        params.use_extra_bufts = use_extra_bufts
        return params

    low.llama_model_default_params = patched
    try:
        yield
    finally:
        low.llama_model_default_params = original


class PromptLookupBaseline:
    """llama-cpp-python's ``LlamaPromptLookupDecoding`` (an N-gram drafter), greedy."""

    name = "baseline:prompt-lookup"

    def __init__(
        self,
        model_path: Path,
        *,
        n_ctx: int = 4096,
        n_threads: int = 0,
        max_ngram_size: int = 2,
        num_pred_tokens: int = 10,
    ) -> None:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        threads = n_threads or default_threads()
        with _model_params_patched(default_extra_bufts()):
            self.llm = Llama(
                str(model_path),
                n_ctx=n_ctx,
                n_threads=threads,
                n_threads_batch=threads,
                flash_attn=True,
                type_k=KV_TYPE,  # potluck's KV type, so the rows compare like for like
                type_v=KV_TYPE,
                logits_all=True,
                draft_model=LlamaPromptLookupDecoding(
                    max_ngram_size=max_ngram_size, num_pred_tokens=num_pred_tokens
                ),
                verbose=False,
            )

    def generate(
        self, prompt: Sequence[int], max_tokens: int, is_eog: Callable[[int], bool]
    ) -> BaselineRun:
        self.llm.reset()
        out: list[int] = []
        t0 = time.perf_counter()
        t_first = t0
        for tok in self.llm.generate(list(prompt), temp=0.0, repeat_penalty=1.0, reset=True):
            if not out:
                t_first = time.perf_counter()
            out.append(int(tok))
            if is_eog(int(tok)) or len(out) >= max_tokens:
                break
        t_end = time.perf_counter()
        return BaselineRun(out, t_first - t0, t_end - t_first)

    def close(self) -> None:
        self.llm.close()
