"""With :mod:`.batch` and :mod:`.backend`, the only modules that import ``llama_cpp``: typed,
closeable wrappers over its C API.

Objects here do what they are told and never decide anything: :class:`Model` (weights and
vocabulary), :class:`Grammar` (a GBNF grammar's state over that vocabulary), :class:`Context`
(a KV cache plus batch runs, logits, KV operations, an abort flag and capture of one named
intermediate tensor) and, in :mod:`.batch`, :class:`~.batch.Batch` (token ids
or embeddings with explicit positions, sequence ids and output flags).

Facts this module relies on (docs/facts.md):
- Extra buffer types are off by default on AMX CPUs (:mod:`.backend`, §1).
- Flash attention on makes a k-token batch (k <= 48) compute each position exactly like k
  single-token steps, which is what lets speculative decoding be bit-exact (§3).
- With per-sequence KV streams, a ranged ``seq_cp`` across streams aborts the process
  inside llama.cpp; :meth:`Context.apply_kv` refuses it for every caller (§4).
"""

from __future__ import annotations

import ctypes
import functools
import json
import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

# llama.cpp's CPU threads (an OpenMP team in this build) meet at a barrier after every graph
# op, and libgomp's default lets a waiting thread spin a while before it sleeps. Measured on
# this 2-core VM (docs/facts.md §6): spinning (the default) 120-131 tok/s idle and 35-40 with
# another process spinning one core; OMP_WAIT_POLICY=PASSIVE 43-45 idle and 54-56 loaded. The
# idle case is the common one, so libgomp's default stays; a user on a busy machine can set
# OMP_WAIT_POLICY=PASSIVE (README "Busy machines"). libgomp reads it when llama_cpp loads.
import llama_cpp as ll
import numpy as np

from .backend import (
    check_gguf_file,
    clear_llama_errors,
    default_extra_bufts,
    init_backend,
    last_llama_error,
)
from .batch import Batch
from .batch_exact import BatchExactness, model_exactness
from .errors import DecodeError, GrammarError, ModelError
from .kv import KvOp
from .kv_state import GGML_TYPE_BF16
from .load_watch import default_threads
from .native import NativeObject
from .observe import ObservedBuffers, native_observer

log = logging.getLogger(__name__)

# --------------------------------------------------------------------------- model


@dataclass(frozen=True)
class SpecialToken:
    """A token the tokenizer matches as a whole string (llama.cpp's ``cache_special_tokens``)."""

    id: int
    text: str
    control: bool  # control or unknown: matched only when special parsing is on
    lstrip: bool  # whitespace before it is dropped
    rstrip: bool  # whitespace after it is dropped
    # a turn marker that llama.cpp matches in any text (so text must be kept from becoming it)
    marker: bool = False


# gpt-oss's harmony markers: control tokens in its GGUF that llama.cpp re-flags user-defined so
# they always render (llama-vocab.cpp, "quick hack for gpt-oss"; <|end|> with its EOG fix), which
# also makes its tokenizer match them in text that is not parsed for special tokens
RENDERED_MARKERS = frozenset({"<|start|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|end|>"})


class Model(NativeObject):
    """Weights and vocabulary of one GGUF file."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        use_extra_bufts: bool | None = None,
        vocab_only: bool = False,
        mapped: bool = True,
    ) -> None:
        """``vocab_only``: tokenizer, chat template and metadata without mapping any weight
        (a cluster head never computes a layer of the target). ``mapped=False``: read the
        weights into memory instead of mapping the file. llama.cpp maps a file whole and reads
        it in at once (MAP_POPULATE), then copies every weight it repacks into memory of its
        own, so a mapped slice peaks at about twice its size; read, at its size (a stage after
        the first, whose embeddings it never reads: docs/facts.md §33)."""
        init_backend()
        self.path = Path(path)
        check_gguf_file(self.path)
        params = ll.llama_model_default_params()
        params.n_gpu_layers = 0
        params.vocab_only = vocab_only
        if not mapped:
            params.load_mode = ll.LLAMA_LOAD_MODE_NONE
        self.vocab_only = vocab_only
        params.use_extra_bufts = default_extra_bufts() if use_extra_bufts is None else use_extra_bufts
        self.use_extra_bufts = bool(params.use_extra_bufts)
        clear_llama_errors()
        self._ptr = ll.llama_model_load_from_file(os.fsencode(self.path), params)
        if not self._ptr:
            why = last_llama_error() or "unknown reason"
            raise ModelError(
                f"could not load model {self.path}: the file is truncated or corrupt "
                f"(llama.cpp: {why})"
            )
        self._vocab = ll.llama_model_get_vocab(self._ptr)
        self.n_vocab: int = ll.llama_vocab_n_tokens(self._vocab)
        self.n_embd: int = ll.llama_model_n_embd(self._ptr)
        self.n_layer: int = ll.llama_model_n_layer(self._ptr)
        self.n_ctx_train: int = ll.llama_model_n_ctx_train(self._ptr)
        self.arch: str = self.meta("general.architecture") or "unknown"
        self.name: str = self.meta("general.name") or self.path.stem
        self.bos: int = ll.llama_vocab_bos(self._vocab)
        self.eos: int = ll.llama_vocab_eos(self._vocab)
        self.add_bos: bool = bool(ll.llama_vocab_get_add_bos(self._vocab))
        tmpl = ll.llama_model_chat_template(self._ptr, None)
        self.chat_template: str | None = tmpl.decode("utf-8") if tmpl else None
        self._piece_cache: dict[int, bytes] = {}
        self._piece_cache_special: dict[int, bytes] = {}
        self._eog_cache: dict[int, bool] = {}
        self._vocab_lock = threading.Lock()  # the server tokenizes off the engine thread
        self._specials: tuple[SpecialToken, ...] | None = None
        self._control_ids: frozenset[int] | None = None
        self._longest: int | None = None

    # -- lifetime
    def close(self) -> None:
        if getattr(self, "_ptr", None):
            ll.llama_model_free(self._ptr)
            self._ptr = None


    @property
    def ptr(self) -> ctypes.c_void_p:
        if not self._ptr:
            raise RuntimeError("model is closed")
        return self._ptr

    # -- metadata
    @functools.cached_property
    def batch_exact(self) -> BatchExactness:
        """How long a verify batch may be, and whether single steps run as 2 rows, for every
        row to equal a single step (:mod:`.batch_exact`; the GGUF's tensor index, read once)."""
        return model_exactness(self.path, use_extra_bufts=self.use_extra_bufts, recurrent=self.recurrent)

    def meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(4096)
        n = ll.llama_model_meta_val_str(self.ptr, key.encode(), buf, len(buf))
        if n < 0:
            return None
        return buf.value.decode("utf-8", errors="replace")

    def size_bytes(self) -> int:
        return int(ll.llama_model_size(self.ptr))

    @property
    def plain_kv_cells(self) -> bool:
        """An attention KV cache only: not recurrent or hybrid (other state layouts)."""
        return not (ll.llama_model_is_recurrent(self.ptr) or ll.llama_model_is_hybrid(self.ptr))

    @property
    def kv_cell_ext(self) -> bool:
        """Whether a KV cell's state carries M-RoPE's extension (its 2D position and token):
        a model whose RoPE reads several positions a token (llama.cpp's ``has_cell_ext``)."""
        return self.positions_per_token > 1

    @property
    def kv_values(self) -> bool:
        """Whether a KV cell keeps a V row beside its K: not with multi-head latent attention
        (DeepSeek's MLA: ``key_length_mla`` set), whose V is a view of the compressed K."""
        return not self.meta(f"{self.arch}.attention.key_length_mla")

    @property
    def recurrent(self) -> bool:
        """Layers with a recurrent state (Mamba, Gated DeltaNet; alone or beside attention):
        a sequence's tail can then be dropped only as far as the state was kept
        (:mod:`.rollback`)."""
        return bool(ll.llama_model_is_recurrent(self.ptr) or ll.llama_model_is_hybrid(self.ptr))

    @property
    def positions_per_token(self) -> int:
        """RoPE positions llama.cpp reads per embedding row: 4 with M-RoPE, else 1."""
        multi = (ll.LLAMA_ROPE_TYPE_MROPE, ll.LLAMA_ROPE_TYPE_IMROPE)
        return 4 if ll.llama_model_rope_type(self.ptr) in multi else 1

    # -- vocabulary
    def is_eog(self, token: int) -> bool:
        """Asked a few times a token; remembered, because each ctypes call drops the GIL and may
        wait up to the switch interval to get it back while other threads run Python (the
        session thread spent 0.58 ms a token here beside serve's event loop)."""
        known = self._eog_cache.get(token)
        if known is None:
            known = self._eog_cache[token] = bool(ll.llama_vocab_is_eog(self._vocab, token))
        return known

    def tokenize(self, text: str, *, add_special: bool = False, parse_special: bool = True) -> list[int]:
        data = text.encode("utf-8")
        cap = len(data) + 16
        buf = (ll.llama_token * cap)()
        n = ll.llama_tokenize(self._vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            cap = -n
            buf = (ll.llama_token * cap)()
            n = ll.llama_tokenize(self._vocab, data, len(data), buf, cap, add_special, parse_special)
        return list(buf[:n])

    def token_bytes(self, token: int, *, special: bool = False) -> bytes:
        cache = self._piece_cache_special if special else self._piece_cache
        piece = cache.get(token)
        if piece is None:
            buf = ctypes.create_string_buffer(64)
            n = ll.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = ll.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
            piece = buf.raw[:n]
            cache[token] = piece
        return piece

    def detokenize(self, tokens: Sequence[int], *, special: bool = False) -> str:
        return b"".join(self.token_bytes(t, special=special) for t in tokens).decode(
            "utf-8", errors="replace"
        )

    def special_tokens(self) -> tuple[SpecialToken, ...]:
        """The tokens llama.cpp's tokenizer matches as whole strings before anything else
        (control, unknown and user-defined ones), with their text and whitespace-strip flags;
        read once (a call per vocabulary entry) and kept."""
        with self._vocab_lock:
            if self._specials is None:
                self._specials = self._read_special_tokens()
            return self._specials

    def control_ids(self) -> frozenset[int]:
        """The tokens that are never text: control tokens, and the markers llama.cpp renders."""
        if self._control_ids is None:  # two threads may both build it: the same value
            self._control_ids = frozenset(s.id for s in self.special_tokens() if s.control)
        return self._control_ids

    def _read_special_tokens(self) -> tuple[SpecialToken, ...]:
        wanted = ll.LLAMA_TOKEN_ATTR_CONTROL | ll.LLAMA_TOKEN_ATTR_UNKNOWN | ll.LLAMA_TOKEN_ATTR_USER_DEFINED
        out = []
        for token in range(self.n_vocab):
            attr = int(ll.llama_vocab_get_attr(self._vocab, token))
            if not attr & wanted:
                continue
            text = (ll.llama_vocab_get_text(self._vocab, token) or b"").decode("utf-8", errors="replace")
            if text:
                control = bool(attr & (ll.LLAMA_TOKEN_ATTR_CONTROL | ll.LLAMA_TOKEN_ATTR_UNKNOWN))
                marker = not control and text in RENDERED_MARKERS
                out.append(SpecialToken(
                    token, text, control=control or marker, lstrip=bool(attr & ll.LLAMA_TOKEN_ATTR_LSTRIP),
                    rstrip=bool(attr & ll.LLAMA_TOKEN_ATTR_RSTRIP), marker=marker))
        return tuple(out)

    def longest_token_bytes(self) -> int:
        """The most bytes of text one token stands for (a text of B bytes is at least B / this
        tokens); read once and kept."""
        with self._vocab_lock:
            if self._longest is None:
                buf = ctypes.create_string_buffer(256)
                longest = 1
                for t in range(self.n_vocab):
                    n = ll.llama_token_to_piece(self._vocab, t, buf, len(buf), 0, True)
                    longest = max(longest, abs(n))  # negative: the piece needs -n bytes
                self._longest = longest
            return self._longest

    def vocab_signature(self) -> tuple[int, int, int]:
        """Cheap fingerprint used to refuse a draft whose vocabulary differs from the target's."""
        return (self.n_vocab, self.bos, self.eos)


# --------------------------------------------------------------------------- grammar

# llama_token_data as numpy sees it, so a whole candidate list is filled and read without a
# Python loop
_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])


class Grammar(NativeObject):
    """Where a GBNF grammar stands after the tokens accepted so far (llama.cpp's grammar
    sampler over a model's vocabulary).

    It only answers and advances: :meth:`allows` says which tokens may come next,
    :meth:`accept` takes one of them, :meth:`clone` forks the state (a draft position).
    llama.cpp aborts the process when it accepts a token the grammar does not allow
    (``llama_grammar_accept_impl`` throws, or GGML_ABORTs on an end-of-generation token), so
    :meth:`accept` must only ever see a token :meth:`allows` passed; the sampler guarantees it.
    """

    def __init__(self, model: Model, text: str, root: str = "root", *, _ptr: object = None) -> None:
        self.model = model
        self.text = text
        self.root = root
        self._buf: np.ndarray | None = None  # token data for allows(), [n_vocab]
        if _ptr is not None:
            self._ptr = _ptr
            return
        clear_llama_errors()
        self._ptr = ll.llama_sampler_init_grammar(model._vocab, text.encode("utf-8"), root.encode("utf-8"))
        if not self._ptr:
            why = last_llama_error() or "it does not parse"
            raise GrammarError(f"llama.cpp refused the grammar: {why}")

    def close(self) -> None:
        if getattr(self, "_ptr", None):
            ll.llama_sampler_free(self._ptr)
            self._ptr = None

    def clone(self) -> Grammar:
        return Grammar(self.model, self.text, self.root, _ptr=ll.llama_sampler_clone(self._ptr))

    def accept(self, token: int) -> None:
        ll.llama_sampler_accept(self._ptr, token)

    def allows(self, tokens: np.ndarray) -> np.ndarray:
        """Which of ``tokens`` (ids) the grammar lets come next: bool [len(tokens)]. Costs
        about a microsecond a token plus ctypes' call; the whole vocabulary is milliseconds."""
        n = len(tokens)
        if self._buf is None or self._buf.shape[0] < n:
            self._buf = np.zeros(max(n, 64), dtype=_TOKEN_DATA)
        buf = self._buf[:n]
        buf["id"] = tokens
        buf["logit"] = 0.0
        data = ll.llama_token_data_array(buf.ctypes.data_as(ll.llama_token_data_p), n, -1, False)
        ll.llama_sampler_apply(self._ptr, ctypes.byref(data))
        return buf["logit"] == 0.0


def json_schema_grammar(schema: object) -> str:
    """GBNF for JSON values that match ``schema``, by the converter llama-cpp-python ships
    (llama.cpp's json-schema-to-grammar ported to Python); the top rule is ``root``. Raises
    whatever the converter raises on a schema it cannot take."""
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    return json_schema_to_gbnf(json.dumps(schema))


# --------------------------------------------------------------------------- context


def _libc_strlen_address() -> int:
    libc = ctypes.CDLL(None)
    return ctypes.cast(libc.strlen, ctypes.c_void_p).value or 0


@dataclass(frozen=True)
class ContextParams:
    n_ctx: int = 4096  # tokens per sequence (with per-sequence KV streams, each gets this many)
    n_batch: int = 512
    n_seq_max: int = 1
    n_threads: int = 0  # 0: all usable cores
    flash_attn: bool = True
    # False: one KV stream per sequence, so work in a side sequence never changes the numbers
    # of sequence 0 (docs/facts.md §4); True: one shared cache, cheap metadata-only seq_cp.
    kv_unified: bool = True
    capture_layer: int | None = None  # capture "l_out-N" (hidden states after layer N)
    # graph tensors to copy out of every run without stopping the graph, e.g. ("Qcur-12",
    # "Kcur-12"): the attention query and RoPE'd key rows of layer 12 (TriForce's chunk
    # scores). Observing splits the graph at those nodes only; each op computes as before.
    observe: tuple[str, ...] = ()
    # KV cache type. BF16, not llama.cpp's F16 default: with an F16/F32 cache and >1 thread,
    # a single-token decode over >= 512 KV cells takes a split-KV flash-attention path whose
    # reduction order differs from a multi-token batch (max |logit diff| ~1.0, flips greedy
    # tokens), which would break lossless speculation past ~256 tokens of context. BF16 never
    # takes that path (docs/facts.md §3) and decodes as fast or faster.
    kv_type: int = GGML_TYPE_BF16
    # Threads for 1-token batches (0: n_threads). With an F16 cache, 1 makes single steps
    # compute like verify batches (no split-KV path, docs/facts.md §3) while prompts and
    # batches keep every thread and F16's tiled prefill (the "f16" KV setting, loader.py).
    single_step_threads: int = 0
    # Run on the cores other processes leave free (core/load_watch.py), for contexts whose
    # thread count the user did not choose. Exact either way: batch rows do not depend on the
    # thread count, and 1-token steps stay within single_step_threads.
    follow_load: bool = False
    # A stage computes prompt chunks of a BF16 cache in an F16 twin context and hands the cells
    # back (core/staged_prefill.py): F16's tiled prefill, BF16's exact decoding.
    f16_prefill: bool = True
    # Recurrent-state snapshots kept per sequence (llama.cpp's n_rs_seq): a model with
    # recurrent layers can then drop up to this many tokens from the tail of its last batch
    # (core/rollback.py). 0 on every other model (llama.cpp ignores it there).
    n_rs_seq: int = 0


class Context(NativeObject):
    """One KV cache over a :class:`Model`, with batch runs, logits and KV operations.

    Not thread-safe: one thread runs batches; any thread may call :meth:`request_abort`.
    """

    def __init__(
        self, model: Model, params: ContextParams = ContextParams(), *, abort_flag_of: Context | None = None
    ) -> None:
        """``abort_flag_of``: share that context's abort flag, so one request stops either
        (a stage's F16 prefill twin, :mod:`.staged_prefill`)."""
        if model.vocab_only:
            raise ModelError(f"{model.path} was loaded without weights (vocabulary only)")
        self.model = model
        self.params = params
        cp = ll.llama_context_default_params()
        streams = 1 if params.kv_unified else max(1, params.n_seq_max)
        cp.n_ctx = params.n_ctx * streams  # llama.cpp divides n_ctx among the streams
        cp.n_batch = params.n_batch
        cp.n_ubatch = params.n_batch
        cp.n_seq_max = params.n_seq_max
        threads = params.n_threads or default_threads()
        cp.n_threads = self._single_step(threads)
        cp.n_threads_batch = threads
        cp.flash_attn_type = 1 if params.flash_attn else 0  # LLAMA_FLASH_ATTN_TYPE_ENABLED / DISABLED
        cp.kv_unified = params.kv_unified
        cp.type_k = params.kv_type
        cp.type_v = params.kv_type
        cp.no_perf = True
        cp.n_rs_seq = params.n_rs_seq
        # The abort callback is polled by llama.cpp's compute thread at every graph node. A
        # Python callback would take the GIL hundreds of times per batch and stall whenever
        # another Python thread runs (the UI, a drafter), so the callback is libc's strlen
        # over a 2-byte flag buffer: it returns 1 (abort) once byte 0 is set, 0 otherwise,
        # and never touches Python. (bool and size_t both come back in the return register.)
        self._abort_flag = abort_flag_of._abort_flag if abort_flag_of else ctypes.create_string_buffer(2)
        self._abort_cb = ll.ggml_abort_callback(_libc_strlen_address())
        cp.abort_callback = self._abort_cb
        cp.abort_callback_data = ctypes.cast(self._abort_flag, ctypes.c_void_p)
        self.captured: np.ndarray | None = None  # [n_tokens, n_embd] after a run
        # Threads that ran its batches. libgomp gives every thread that starts a parallel
        # region a team of its own, and once a process has more team threads than cores it
        # spins only ~100 times before sleeping at each of ggml's barriers: a second computing
        # thread made every decode ~40 % slower (docs/facts.md §27). Tests read this.
        self.compute_threads: set[int] = set()
        # observed tensor name -> its rows of the last run, [n_tokens, width] float32
        self.observed: dict[str, np.ndarray] = {}
        self._capture_name: str | None = None
        self._eval_cb = None
        self._native: ObservedBuffers | None = None
        names = list(params.observe)
        if params.capture_layer is not None:
            # a stage's output: the residual stream after its last layer; the graph stops there
            self._capture_name = f"l_out-{params.capture_layer}"
            names.append(self._capture_name)
        if names:
            # llama.cpp asks about every graph node: a compiled callback, never Python (a
            # ctypes trampoline cost a stage about a millisecond a batch). Rows of a batch: at
            # most n_batch, each at most 4 * n_embd floats wide.
            self._native = ObservedBuffers(names, params.n_batch * 16 * model.n_embd, stop=self._capture_name)
            self._eval_cb = ll.ggml_backend_sched_eval_callback(native_observer())
            cp.cb_eval = self._eval_cb
            cp.cb_eval_user_data = ctypes.c_void_p(self._native.address)
        self._ptr = ll.llama_init_from_model(model.ptr, cp)
        if not self._ptr:
            raise ModelError(
                f"could not create a llama.cpp context for {model.path} with n_ctx={params.n_ctx} "
                f"({last_llama_error() or 'out of memory?'})"
            )
        # reaches the CPU backend's thread pool too
        ll.llama_set_abort_callback(self._ptr, self._abort_cb, ctypes.cast(self._abort_flag, ctypes.c_void_p))
        self._mem = ll.llama_get_memory(self._ptr)
        self.n_ctx: int = ll.llama_n_ctx_seq(self._ptr)  # per sequence
        # llama.cpp clamps n_batch to the context it was asked for and aborts the process on a
        # longer batch (GGML_ASSERT in llama_decode), so the real value is what run_batch allows.
        self.n_batch: int = ll.llama_n_batch(self._ptr)
        self.n_vocab = model.n_vocab
        self._batch = Batch(self.n_batch, n_seq_max=max(1, params.n_seq_max))
        self.n_rs_seq: int = ll.llama_n_rs_seq(self._ptr)  # 0 where llama.cpp keeps no snapshots

    # -- lifetime
    def close(self) -> None:
        if getattr(self, "_batch", None) is not None:
            self._batch.close()
            self._batch = None  # type: ignore[assignment]
        if getattr(self, "_ptr", None):
            ll.llama_free(self._ptr)
            self._ptr = None


    # -- abort
    def request_abort(self) -> None:
        """Make the running (or next) batch stop at llama.cpp's next poll; any thread."""
        self._abort_flag[0] = b"\x01"

    def clear_abort(self) -> None:
        self._abort_flag[0] = b"\x00"

    # -- running batches (llama_decode)
    def run_batch(self, batch: Batch) -> None:
        """Run one batch; raises :class:`DecodeError` on failure, ``InterruptedError`` on abort
        (llama.cpp has then removed the batch's cells from every sequence it touched)."""
        if batch.n_tokens > self.n_batch:
            raise DecodeError(f"a batch of {batch.n_tokens} tokens exceeds this context's n_batch {self.n_batch}")
        self.captured = None
        self.observed = {}
        if self._native is not None:
            self._native.clear()
        self.compute_threads.add(threading.get_ident())
        rc = ll.llama_decode(self._ptr, batch.raw)
        if self._native is not None and rc in (0, -3):
            self.observed = self._native.rows(batch.n_tokens)
            if self._capture_name is not None:
                self.captured = self.observed.pop(self._capture_name, None)
        if rc == 2:
            raise InterruptedError("decode aborted")
        if rc != 0 and not (rc == -3 and self._capture_name is not None):
            raise DecodeError(f"llama_decode failed with code {rc} ({last_llama_error() or 'no detail'})")
        if self._capture_name is not None and self.captured is None:
            raise DecodeError(f"no tensor named {self._capture_name} was computed")
        missing = set(self.params.observe) - set(self.observed)
        if missing:
            raise DecodeError(f"no tensor named {sorted(missing)[0]} was computed")

    def run_tokens(
        self,
        tokens: Sequence[int],
        pos0: int,
        *,
        seq_id: int = 0,
        outputs: Sequence[bool] | str = "last",
    ) -> None:
        """Run ``tokens`` at positions ``pos0...`` of one sequence (one batch, <= n_batch)."""
        n = len(tokens)
        self._batch.set_tokens(tokens, range(pos0, pos0 + n), seq_id, outputs)
        self.run_batch(self._batch)

    def logits_row(self, i: int) -> np.ndarray:
        """Logits of batch row ``i`` (-1: last output) as a float32 view [vocab] (valid until next run)."""
        ptr = ll.llama_get_logits_ith(self._ptr, i)
        if not ptr:
            raise DecodeError(f"no logits for batch row {i} (was it marked as an output?)")
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))

    def logits(self, n_rows: int) -> np.ndarray:
        """Logits of the last run's ``n_rows`` output rows in batch order: float32 view [n_rows, vocab]."""
        ptr = ll.llama_get_logits(self._ptr)
        return np.ctypeslib.as_array(ptr, shape=(n_rows, self.n_vocab))

    # -- KV operations (positions: p0 inclusive, p1 exclusive, -1 = open end)
    def check_kv(self, op: KvOp) -> None:
        """Raise ``ValueError`` for an operation llama.cpp would reject or abort the process on."""
        n_seq = max(1, self.params.n_seq_max)
        if not 0 <= op.seq < n_seq or (op.op == "cp" and not 0 <= op.dst < n_seq):
            raise ValueError(f"sequence id outside 0..{n_seq - 1}: {op}")
        if op.op == "cp" and self._ranged_cross_stream(op.seq, op.dst, op.p0, op.p1):
            raise ValueError(
                f"seq_cp {op.seq}->{op.dst} [{op.p0}, {op.p1}) across KV streams: only whole "
                "sequences (p0 = p1 = -1) can be copied"
            )

    def apply_kv(self, op: KvOp) -> None:
        """Apply a :class:`~potluck.engine.core.kv.KvOp` after :meth:`check_kv`."""
        self.check_kv(op)
        if op.is_slot_op:
            raise ValueError(f"kv {op.op} is a stage's (kept conversations), not a context's")
        if op.op == "rm":
            self.seq_rm(op.seq, op.p0, op.p1)
        elif op.op == "cp":
            self.seq_cp(op.seq, op.dst, op.p0, op.p1)
        elif op.op == "keep":
            self.seq_keep(op.seq)
        else:
            self.seq_add(op.seq, op.p0, op.p1, op.delta)

    def _ranged_cross_stream(self, src: int, dst: int, p0: int, p1: int) -> bool:
        return not self.params.kv_unified and src != dst and (p0 > 0 or p1 >= 0)

    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool:
        return bool(ll.llama_memory_seq_rm(self._mem, seq_id, p0, p1))

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        """Copy ``src`` [p0, p1) into ``dst``. Across KV streams (``kv_unified=False``) only
        whole sequences can be copied and ``dst`` is replaced: llama.cpp aborts the whole
        process on a ranged copy (GGML_ASSERT in llama_kv_cache::seq_cp), so it is refused."""
        if self._ranged_cross_stream(src, dst, p0, p1):
            raise ValueError(
                f"seq_cp {src}->{dst} [{p0}, {p1}) across KV streams: only whole sequences "
                "(p0 = p1 = -1) can be copied"
            )
        ll.llama_memory_seq_cp(self._mem, src, dst, p0, p1)

    def seq_keep(self, seq_id: int) -> None:
        ll.llama_memory_seq_keep(self._mem, seq_id)

    def seq_add(self, seq_id: int, p0: int, p1: int, delta: int) -> None:
        ll.llama_memory_seq_add(self._mem, seq_id, p0, p1, delta)

    def seq_pos_max(self, seq_id: int) -> int:
        return int(ll.llama_memory_seq_pos_max(self._mem, seq_id))

    def clear(self) -> None:
        ll.llama_memory_clear(self._mem, True)

    def seq_state(self, seq_id: int) -> bytearray:
        """Sequence ``seq_id``'s KV cells and positions (llama_state_seq_get_data), written
        straight into the returned buffer (a long context's state is hundreds of MB)."""
        size = ll.llama_state_seq_get_size(self._ptr, seq_id)
        state = bytearray(size)
        buf = (ctypes.c_uint8 * size).from_buffer(state)
        got = ll.llama_state_seq_get_data(self._ptr, buf, size, seq_id)
        del buf  # releases the export, so the bytearray may be resized later
        if got != size:
            raise DecodeError(f"llama.cpp wrote {got} of {size} bytes of sequence {seq_id}'s state")
        return state

    def recurrent_state(self, seq_id: int, into: bytearray | None = None) -> bytearray:
        """Sequence ``seq_id``'s recurrent state only (llama.cpp's partial-only state: no
        attention cells), a rollback checkpoint (:mod:`.rollback`), written ``into`` a spare
        buffer of its size where one is given: a fresh one of several MB costs ~5x the copy
        (its pages are faulted in and zeroed; docs/facts.md §30)."""
        flags = ll.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
        size = ll.llama_state_seq_get_size_ext(self._ptr, seq_id, flags)
        state = into if into is not None and len(into) == size else bytearray(size)
        buf = (ctypes.c_uint8 * size).from_buffer(state)
        got = ll.llama_state_seq_get_data_ext(self._ptr, buf, size, seq_id, flags)
        del buf
        if got != size:
            raise DecodeError(f"llama.cpp wrote {got} of {size} bytes of sequence {seq_id}'s recurrent state")
        return state

    def set_recurrent_state(self, seq_id: int, state: bytearray) -> None:
        """Put back a :meth:`recurrent_state`; the sequence's attention cells are untouched."""
        buf = (ctypes.c_uint8 * len(state)).from_buffer(state)
        n = ll.llama_state_seq_set_data_ext(self._ptr, buf, len(state), seq_id, ll.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)
        del buf
        if n != len(state):
            raise DecodeError(f"llama.cpp could not restore sequence {seq_id}'s recurrent state")

    def set_seq_state(self, seq_id: int, state: bytes | bytearray) -> None:
        """Replace sequence ``seq_id`` with a :meth:`seq_state`; in an otherwise empty cache its
        cells land where they were computed (0..n-1), so decoding goes on exactly (docs/facts.md §3)."""
        array = ctypes.c_uint8 * len(state)
        buf = array.from_buffer(state) if isinstance(state, bytearray) else array.from_buffer_copy(state)
        if ll.llama_state_seq_set_data(self._ptr, buf, len(state), seq_id) != len(state):
            self.seq_rm(seq_id)
            raise DecodeError(f"llama.cpp could not restore sequence {seq_id}'s KV state (no room?)")

    def _single_step(self, n_threads: int) -> int:
        cap = self.params.single_step_threads
        return min(n_threads, cap) if cap > 0 else n_threads

    def threads(self) -> tuple[int, int]:
        """(threads for 1-token batches, threads for larger ones)."""
        return int(ll.llama_n_threads(self._ptr)), int(ll.llama_n_threads_batch(self._ptr))

    def set_threads(self, n_threads: int) -> None:
        """Threads from the next batch on; 1-token batches stay within ``single_step_threads``."""
        ll.llama_set_n_threads(self._ptr, self._single_step(n_threads), n_threads)


# --------------------------------------------------------------------------- quantizing


def quantize_model(src: Path, dst: Path, file_type: str, *, pure: bool = False, n_threads: int = 1) -> Path:
    """Write ``src`` requantized to llama.cpp's file type ``file_type`` ("Q4_K_M", "F16",
    "F32", ...) as ``llama-quantize --allow-requantize`` does (``pure``: every matrix in that
    type, none kept wider). Test models of each weight type (core/batch_exact.py)."""
    ftype = getattr(ll, "LLAMA_FTYPE_ALL_F32" if file_type == "F32" else f"LLAMA_FTYPE_MOSTLY_{file_type}", None)
    if ftype is None:
        raise ModelError(f"llama.cpp has no file type {file_type!r} (Q4_K_M, Q8_0, F16, ...)")
    init_backend()
    params = ll.llama_model_quantize_default_params()
    params.ftype = ftype
    params.pure = pure
    params.allow_requantize = True
    params.nthread = n_threads
    tmp = dst.with_name(dst.name + ".part")
    if ll.llama_model_quantize(os.fsencode(src), os.fsencode(tmp), ctypes.byref(params)) != 0:
        tmp.unlink(missing_ok=True)
        raise ModelError(f"could not quantize {src} to {file_type} (llama.cpp: {last_llama_error() or 'unknown'})")
    tmp.replace(dst)
    return dst
