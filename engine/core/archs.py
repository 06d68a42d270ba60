"""One home for each model architecture's rules: what a layer slice of it must rewrite, which
slices llama.cpp loads and computes exactly, how its layers count in memory and in time, and
what a stage's cache holds. The slicer (:mod:`.gguf_tools`), the planner (``cluster/plan.py``),
the worker's load check, ``potluck models`` and the fixtures all read this table; nothing else
branches on an architecture's name.

The rules come from what llama.cpp (the version llama-cpp-python vendors) reads for each
architecture in ``src/models/<arch>.cpp`` (``load_arch_hparams``, ``load_arch_tensors`` and
the graph) and ``src/llama-model.cpp`` (``load_hparams``, ``create_memory``). What every
architecture shares is applied to all of them by the slicer:

- ``<arch>.block_count`` becomes the slice's layer count, and ``blk.i.*`` are renumbered;
- every per-layer array (a key whose array has one value per layer, such as ``head_count_kv``
  or ``expert_used_count``) keeps the values of the slice's original layers;
- layers after the trunk (``nextn_predict_layers``: multi-token-prediction blocks) are never
  in a slice, whose ``nextn_predict_layers`` is 0;
- a later stage takes hidden states, which llama.cpp does not rescale (Gemma's sqrt(n_embd)
  applies to token embeddings only), so a stage's input needs nothing.

What differs between architectures is an :class:`Arch` entry of :data:`ARCHS`.

How to add an architecture:

1. Read its ``src/models/<arch>.cpp`` in the vendored llama.cpp: every hyperparameter that is
   indexed by layer (a pattern computed from the layer's index, a count of leading layers), every
   choice made from ``n_layer`` (a slice has fewer), anything that reads another layer's cache
   or the token ids inside the layers, and any tensor that multiplies a layer's whole output
   (the head's slice writes its layers as zeros, which must add 0). Say each in its entry
   (``swa_default_period``, ``dense_lead``, ``slice_keys``, ``slice_problem``,
   ``model_problem``, ``output_scales``).
2. Add one :class:`Arch` entry to :data:`ARCHS`.
3. Add one fixture shape in ``engine/lab/fixtures.py`` (its published dimensions in ``SHAPES``,
   and its layer's tensors in ``LAYER_TENSORS`` if no other architecture has the same ones).
4. Add one line to ``ARCH_SHAPES`` in ``tests/test_archs_exact.py``: its slices over 2 and 3
   stages and the head's must give the whole model's logits, prompt and incremental decode
   alike.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from .errors import PotluckError

_BLK = re.compile(r"^blk\.(\d+)\.(.+)$")
# llama.cpp's names for a mixture's routed experts: one matrix (or bias) per expert, stacked
# on the last dimension; every other tensor of a layer, shared experts included, is read whole
_ROUTED_EXPERTS = re.compile(r"^ffn_(gate|up|down|gate_up)_exps\.")
# The window of a widened slice's layers (``Arch.widens_global_slices``): llama.cpp masks a cell
# where positions differ by the window or more, so it is also the longest context a stage takes
# (cluster/wire's Load refuses a longer one); and small enough that llama.cpp's SWA cache size
# (window x 256 sequences + batch, a uint32) cannot overflow
WIDE_WINDOW = 1 << 23


@dataclass(frozen=True)
class Header:
    """The key/values of a GGUF header a rule looks at (every key but the tokenizer's), by
    full name, and its tensors' names and sizes."""

    arch: str
    values: Mapping[str, object]
    tensor_bytes: Mapping[str, int] = field(default_factory=dict)
    n_vocab: int = 0

    def get(self, key: str, default: object = None) -> object:
        """``<arch>.key``'s value, or ``default``."""
        return self.values.get(f"{self.arch}.{key}", default)

    def int_of(self, key: str, default: int = 0) -> int:
        """An integer key; of a per-layer array, its largest value."""
        v = self.get(key)
        if v is None:
            return default
        return int(max(v)) if isinstance(v, list) else int(v)  # type: ignore[arg-type]

    def per_layer(self, key: str, default: int = 0) -> list[int]:
        """A key that llama.cpp reads as one value or one per layer (``get_key_or_arr``), one
        value per layer of the file."""
        v = self.get(key)
        n = self.n_layer_all
        if isinstance(v, list):
            return [int(x) for x in v[:n]] + [default] * (n - len(v))
        return [int(v) if v is not None else default] * n  # type: ignore[arg-type]

    @property
    def n_layer_all(self) -> int:
        """Every ``blk.N`` of the file (``block_count``), next-token blocks included."""
        return self.int_of("block_count")

    @property
    def n_nextn(self) -> int:
        """Multi-token-prediction blocks after the trunk (``nextn_predict_layers``)."""
        return self.int_of("nextn_predict_layers")

    @property
    def n_layer(self) -> int:
        """The trunk: the layers a token goes through, the ones a split shares out."""
        return self.n_layer_all - self.n_nextn


def read_header(reader) -> Header:  # reader: gguf.GGUFReader
    """A :class:`Header` of a parsed GGUF (its arrays but the tokenizer's are read whole)."""
    values = {
        f.name: f.contents() for f in reader.fields.values()
        if not f.name.startswith(("GGUF.", "tokenizer."))
    }
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    arch = str(values.get("general.architecture", ""))
    n_vocab = len(tokens.data) if tokens is not None else int(values.get(f"{arch}.vocab_size", 0) or 0)  # type: ignore[call-overload]
    sizes = {t.name: int(t.n_bytes) for t in reader.tensors}
    return Header(arch, values, sizes, n_vocab)


@dataclass(frozen=True)
class Arch:
    """What splitting one architecture by layers needs to know beyond the shared recipe.

    The callables take the whole model's :class:`Header`; ``layer_map`` lists the original
    layers of a slice in order (a contiguous range for a stage, any list for a merge)."""

    name: str  # general.architecture
    # Sliding-window attention: llama.cpp's default period when the file has no
    # ``attention.sliding_window_pattern`` (``load_swa_pattern(ml, N)``: layer i slides unless
    # (i + 1) % N == 0); None: no sliding-window layers. Every slice gets the explicit per-layer
    # array of its original layers, and (llama.cpp asserts it) at least one sliding layer.
    swa_default_period: int | None = None
    # ...only when the file sets ``attention.sliding_window`` above 0 (gemma3 without a window
    # is all global)
    swa_needs_window: bool = False
    # a slice of global layers only is written as sliding layers over a window no position
    # reaches (:data:`WIDE_WINDOW`), which llama.cpp loads and computes as the same attention:
    # only where a sliding layer reads the same rope as a global one (gpt-oss; Gemma 3's
    # sliding layers have their own base and scale). Such a slice needs no sliding layer.
    widens_global_slices: bool = False
    # reads ``leading_dense_block_count`` (the first layers are dense, the rest experts): a
    # slice's count is that of its own leading layers
    dense_lead: bool = False
    # what a stage keeps per sequence: "kv" (cells per position), "recurrent" (a state) or
    # "kv+recurrent" (a hybrid's layers, some of each)
    cache: str = "kv"
    # more key/values a slice must carry: name (without "<arch>.") -> value (int: uint32, list:
    # an array)
    slice_keys: Callable[[Header, Sequence[int]], dict[str, object]] | None = None
    # why llama.cpp would not load or not compute exactly a slice of this many layers starting
    # at ``lo``, or None
    slice_problem: Callable[[Header, int, int], str | None] | None = None
    # an original layer of the kind a slice of these layers lacks, or None: the slice carries
    # it in front as zeros (:func:`_kind_filler`)
    filler: Callable[[Header, Sequence[int]], int | None] | None = None
    # why no split of this file is exact, or None
    model_problem: Callable[[Header], str | None] | None = None
    # a layer's tensors (name after ``blk.N.``) that multiply its whole output, residual
    # included: ones, not zeros, in a layer of zeros (gguf_tools.layer_layout), so it adds 0
    output_scales: frozenset[str] = frozenset()
    # tensors outside ``blk.N`` that llama.cpp reads only for some layers, which a slice of
    # these original layers must leave out (a file holding a tensor llama.cpp did not read is
    # refused: "wrong number of tensors")
    unread_tensors: Callable[[Header, Sequence[int]], frozenset[str]] | None = None

    # -- what the slicer and the planner ask
    def swa_layers(self, h: Header) -> tuple[bool, ...] | None:
        """Per trunk layer, by original index: a sliding-window layer? None: none slide."""
        if self.swa_default_period is None:
            return None
        if self.swa_needs_window and not h.int_of("attention.sliding_window"):
            return None
        n = h.n_layer
        value = h.get("attention.sliding_window_pattern")
        if isinstance(value, list):
            return tuple(bool(v) for v in value[:n])
        period = self.swa_default_period if value is None else int(value)  # type: ignore[call-overload]
        return tuple(period == 0 or (i + 1) % period != 0 for i in range(n))

    def rewrites(self, h: Header, layer_map: Sequence[int]) -> dict[str, object]:
        """Key/values (without "<arch>.") a slice of ``layer_map`` sets after the copied ones."""
        out: dict[str, object] = {}
        swa = self.swa_layers(h)
        if swa is not None:
            pattern = [swa[i] for i in layer_map]
            if self.widens_global_slices and not any(pattern):
                pattern = [True] * len(pattern)
                out["attention.sliding_window"] = WIDE_WINDOW
            out["attention.sliding_window_pattern"] = pattern
        if self.dense_lead:
            out["leading_dense_block_count"] = _leading_dense(h, layer_map)
        if h.n_nextn:
            out["nextn_predict_layers"] = 0
        if self.slice_keys is not None:
            out.update(self.slice_keys(h, layer_map))
        return out

    def filler_layer(self, h: Header, layer_map: Sequence[int]) -> int | None:
        """The original layer a slice of ``layer_map`` carries as zeros in front, or None."""
        return self.filler(h, layer_map) if self.filler is not None else None

    def unread(self, h: Header, layer_map: Sequence[int]) -> frozenset[str]:
        """Tensors outside the layers a slice of ``layer_map`` leaves out."""
        return self.unread_tensors(h, layer_map) if self.unread_tensors is not None else frozenset()

    def problem(self, h: Header) -> str | None:
        """Why no split of this file is exact (the model itself), or None."""
        return self.model_problem(h) if self.model_problem is not None else None


def _leading_dense(h: Header, layer_map: Sequence[int]) -> int:
    """How many of a slice's first layers are dense: its original layers below the model's
    count, which must come first in the map."""
    n_dense = h.int_of("leading_dense_block_count")
    dense = [i < n_dense for i in layer_map]
    count = dense.index(False) if False in dense else len(dense)
    if any(dense[count:]):
        raise PotluckError(
            f"cannot lay out layers {list(layer_map)[:8]}...: {h.arch}'s dense layers (the first {n_dense}) must "
            "come before its expert layers"
        )
    return count


def check_layer_map(h: Header, layer_map: Sequence[int]) -> None:
    """Refuse a slice outside the trunk (a next-token block is never part of one)."""
    n = h.n_layer
    if not layer_map or min(layer_map) < 0 or max(layer_map) >= n:
        raise PotluckError(f"layer map {list(layer_map)[:8]}... is outside 0..{n - 1}")


# --------------------------------------------------------------------------- hybrids


def recurrent_layers(h: Header) -> tuple[bool, ...]:
    """Qwen3.5's trunk, by original index: a Gated DeltaNet layer (a recurrent state) or full
    attention. llama.cpp reads an explicit ``attention.recurrent_layers`` array first, else
    every ``full_attention_interval``-th layer (default 4) attends (``src/models/qwen35moe.cpp``)."""
    n = h.n_layer
    value = h.get("attention.recurrent_layers")
    if isinstance(value, list):
        return tuple(bool(v) for v in value[:n])
    period = h.int_of("full_attention_interval", 4) or 4
    return tuple((i + 1) % period != 0 for i in range(n))


def recurrent_state_bytes(h: Header) -> tuple[int, ...] | None:
    """Per trunk layer, one sequence's recurrent state (a Gated DeltaNet layer's conv window
    of ``conv_kernel - 1`` inputs and its state matrix per value head, F32), 0 for an
    attention layer; None for a model without recurrent layers."""
    arch = ARCHS.get(h.arch)
    if arch is None or "recurrent" not in arch.cache:
        return None
    head, k_heads, v_heads = h.int_of("ssm.state_size"), h.int_of("ssm.group_count"), h.int_of("ssm.time_step_rank")
    conv_channels = 2 * head * k_heads + h.int_of("ssm.inner_size")
    state = 4 * ((h.int_of("ssm.conv_kernel") - 1) * conv_channels + head * head * v_heads)
    return tuple(state if recurrent else 0 for recurrent in recurrent_layers(h))


def _recurrent_pattern(h: Header, layer_map: Sequence[int]) -> dict[str, object]:
    """A slice's own pattern: layer j is its original layer ``layer_map[j]``."""
    pattern = recurrent_layers(h)
    return {"attention.recurrent_layers": [pattern[i] for i in layer_map]}


def _kind_filler(h: Header, layer_map: Sequence[int]) -> int | None:
    """llama.cpp's hybrid memory allocates no buffer for a kind of layer a model lacks, then
    reads it at the first decode (GGML_ASSERT(buffer) aborts the process). A slice of one kind
    carries the nearest layer of the other kind in front, its weights zeros: attention over
    zero values or a recurrent state of zeros, and experts, all times zero matrices, add
    exactly 0 to the residual stream, so every slice loads and computes its own layers alone
    (the head computes the last one: tests/test_archs_exact.py)."""
    kinds = recurrent_layers(h)
    have = {kinds[i] for i in layer_map}
    if len(have) != 1:
        return None
    other = [i for i, k in enumerate(kinds) if k not in have]
    return min(other, key=lambda i: abs(i - layer_map[0])) if other else None


# --------------------------------------------------------------------------- the table

# llama.cpp's expert gating functions (llama-hparams.h)
GATING_SOFTMAX, GATING_SIGMOID = 1, 2
# slice lengths llama.cpp's deepseek2 loader takes for a "lite" model (DeepSeek-V2-Lite and
# kin: no low-rank query), whatever the file says (models/deepseek2.cpp, load_arch_hparams)
_DEEPSEEK2_LITE_LAYERS = (26, 27)
_DEEPSEEK2_LITE_48_VOCAB = 128256


def _deepseek2_keys(h: Header, layer_map: Sequence[int]) -> dict[str, object]:
    """What llama.cpp would decide from the whole model's layer count, written out: a Lite
    model's query rank of 0 (read only when the count is not a Lite one's), and the gating
    function (a missing one defaults by layer count and vocabulary)."""
    out: dict[str, object] = {}
    if h.get("attention.q_lora_rank") is None:
        out["attention.q_lora_rank"] = 0
    if h.get("expert_gating_func") is None:
        glm_lite = h.n_layer in (47, 48) and h.n_vocab == 154880
        out["expert_gating_func"] = GATING_SIGMOID if glm_lite else GATING_SOFTMAX
    return out


def _deepseek2_slice_problem(h: Header, lo: int, hi: int) -> str | None:
    """A model with a low-rank query cannot be cut into slices of a Lite model's layer count:
    llama.cpp would not read the rank and look for a plain query projection."""
    n = hi - lo
    if not h.int_of("attention.q_lora_rank"):
        return None
    if n in _DEEPSEEK2_LITE_LAYERS or (n == 48 and h.n_vocab == _DEEPSEEK2_LITE_48_VOCAB):
        return f"are {n} layers, which llama.cpp's deepseek2 loader takes for a Lite model (no low-rank query)"
    return None


def _glm4moe_keys(h: Header, layer_map: Sequence[int]) -> dict[str, object]:
    """M-RoPE sections, so that llama.cpp's GLM-4.5 graph takes hidden states: it aborts on an
    embedding batch unless the model has them ("This GGUF does not support multimodal",
    models/glm4-moe.cpp). With them it rotates by ``ggml_rope_multi`` (rope type MROPE)
    instead of NEOX: for text, where every section it reads holds the token's position
    (llama.cpp fills the first three for token ids, :class:`..core.batch.Batch` all four for
    hidden states; sections summing to the rotated half never read the fourth), ggml's CPU rope builds
    the same angles in the same order and rotates the same pairs, so the result is the same
    bit for bit (test_archs_exact proves it). Sections over the rotated half-dims, two of them
    (llama.cpp's ``use_mrope`` needs both of the first two above 0)."""
    sections = h.get("rope.dimension_sections")
    if isinstance(sections, list):  # written back whole: the slicer cuts arrays as long as the trunk
        return {"rope.dimension_sections": [int(v) for v in sections]}
    n_rot = h.int_of("rope.dimension_count") or h.int_of("attention.key_length") or (
        h.int_of("embedding_length") // max(1, h.int_of("attention.head_count", 1)))
    half = n_rot // 2
    return {"rope.dimension_sections": [half - half // 2, half // 2, 0, 0]}


# llama.cpp scales Gemma 3's attention by 1/sqrt(n_embd / n_head) for its 27B, which it knows by
# the layer count, and by 1/sqrt(head width) otherwise (models/gemma3.cpp)
_GEMMA3_27B_LAYERS = 62


def _gemma3_scales_differ(h: Header) -> bool:
    n_embd, n_head = h.int_of("embedding_length"), h.int_of("attention.head_count", 1) or 1
    return n_embd // n_head != h.int_of("attention.key_length", n_embd // n_head)


def _gemma3_problem(h: Header) -> str | None:
    if h.n_layer == _GEMMA3_27B_LAYERS and _gemma3_scales_differ(h):
        return ("llama.cpp picks Gemma 3 27B's attention scale by its layer count (62), which no slice "
                "has, so a split would not compute the same model")
    return None


def _gemma3_slice_problem(h: Header, lo: int, hi: int) -> str | None:
    if hi - lo == _GEMMA3_27B_LAYERS and _gemma3_scales_differ(h):
        return "are 62 layers, which llama.cpp takes for Gemma 3 27B (another attention scale)"
    return None


# Gemma 4 (models/gemma4.cpp)
GEMMA4_ROPE_FREQS = "rope_freqs.weight"  # one tensor, read by the full-attention layers only


def _gemma4_problem(h: Header) -> str | None:
    """E2B and E4B: every layer adds an embedding looked up from the token ids (a stage after
    the first has hidden states, and llama.cpp would use token 0's), and their last layers
    read the KV of earlier ones (``shared_kv_layers``), which another stage would hold."""
    if h.int_of("embedding_length_per_layer_input"):
        return ("Gemma 4's per-layer embeddings (E2B, E4B) are looked up from the token ids inside every layer, "
                "which a stage after the first does not have")
    if h.int_of("attention.shared_kv_layers"):
        return "its last layers reuse earlier layers' KV cache (shared_kv_layers), which another stage would hold"
    return None


def _gemma4_slice_problem(h: Header, lo: int, hi: int) -> str | None:
    """llama.cpp's Gemma 4 cache asserts two layers at least (``n_layer_kv_from_start >= 2``)."""
    return "are one layer, and llama.cpp's Gemma 4 cache needs two" if hi - lo < 2 else None


def _gemma4_unread(h: Header, layer_map: Sequence[int]) -> frozenset[str]:
    """The proportional RoPE's frequency factors belong to the full-attention layers: a slice
    of sliding layers only leaves them out."""
    swa = ARCHS["gemma4"].swa_layers(h)
    if swa is not None and all(swa[i] for i in layer_map):
        return frozenset({GEMMA4_ROPE_FREQS})
    return frozenset()


ARCHS: dict[str, Arch] = {
    a.name: a
    for a in (
        # Llama 2/3, Mistral, SmolLM2 (and Mixtral: experts in the same layer names)
        Arch("llama"),
        # Gemma 3: five sliding-window layers, then a global one (each with its own rope base)
        # (27B: see _gemma3_problem)
        Arch("gemma3", swa_default_period=6, swa_needs_window=True, slice_problem=_gemma3_slice_problem,
             model_problem=_gemma3_problem),
        Arch("qwen2"),  # q/k/v biases
        Arch("qwen3"),  # per-head q/k norms, an explicit head width
        # Qwen3 MoE (30B-A3B, 235B-A22B): Qwen3's attention, then routed experts only
        Arch("qwen3moe"),
        # gpt-oss (20b, 120b): even layers slide (window 128), odd ones are global; attention
        # sinks, biases everywhere, MXFP4 experts: none of it depends on a layer's index but the
        # windows
        Arch("gpt-oss", swa_default_period=2, widens_global_slices=True),
        # DeepSeek V2/V3 and kin (Kimi K2, GLM-4.7-Flash): multi-head latent attention (a cell
        # is one compressed K, no V), leading dense layers, shared experts, an MTP block after
        # the trunk; decisions llama.cpp makes from the layer count are written out
        Arch("deepseek2", dense_lead=True, slice_keys=_deepseek2_keys, slice_problem=_deepseek2_slice_problem),
        # Phi-3 and Phi-4: fused q/k/v and gate/up; LongRoPE factors picked by the context size
        # (the same on every stage: each has the conversation's n_ctx)
        Arch("phi3"),
        # Qwen3.5 MoE: three Gated DeltaNet layers to one gated full-attention layer, routed and
        # shared experts in every layer, M-RoPE, a next-token block after the trunk; its cache
        # is KV cells for the attention layers and one state per sequence for the others, whose
        # tail a stage drops through core/rollback.py
        Arch("qwen35moe", cache="kv+recurrent", slice_keys=_recurrent_pattern, filler=_kind_filler),
        # GLM-4.5 and 4.5-Air: biases on q/k/v, partial RoPE, a dense first layer, then routed
        # experts (sigmoid, a selection bias) and one shared expert, an MTP block after the
        # trunk; hidden states need M-RoPE sections written in (_glm4moe_keys)
        Arch("glm4moe", dense_lead=True, slice_keys=_glm4moe_keys),
        # Gemma 4 26B-A4B and 31B: five sliding layers to one global (an explicit pattern), each
        # kind with its own head width, KV heads and rope (the global layers' proportional, by
        # rope_freqs; K doubles as V there), q/k norms, a scale per layer, routed experts beside
        # the dense FFN (26B-A4B), a softcap on the logits; E2B/E4B refused (_gemma4_problem)
        Arch("gemma4", swa_default_period=6, slice_problem=_gemma4_slice_problem, model_problem=_gemma4_problem,
             unread_tensors=_gemma4_unread, output_scales=frozenset({"layer_output_scale.weight"})),
    )
}


# Architectures read and found unsplittable with the llama.cpp potluck runs, and why
REFUSED: dict[str, str] = {
    # models/glm4.cpp: GGML_ABORT when a batch holds embeddings and the model has no M-RoPE
    # sections ("This GGUF does not support multimodal"); with them it would rotate by M-RoPE's
    # NEOX-style pairs instead of GLM-4's interleaved ones (glm4moe's NEOX is the same: its entry)
    "glm4": "llama.cpp's GLM-4 graph aborts when a stage after the first gives it hidden states instead of tokens",
}


def supported() -> str:
    """The architectures a split takes, for messages."""
    return ", ".join(sorted(ARCHS))


def unsplittable_reason(h: Header) -> str | None:
    """Why this model cannot be split exactly (its architecture or the file itself), or None."""
    arch = ARCHS.get(h.arch)
    if arch is None:
        known = f": {REFUSED[h.arch]}" if h.arch in REFUSED else " is not verified for exact layer splitting"
        return f"architecture {h.arch!r}{known} (supported: {supported()})"
    return arch.problem(h)


def experts(h: Header) -> tuple[int, int, int]:
    """(routed experts per layer, how many a token is sent to, shared experts): zeros for a
    dense model. DeepSeek's kin count their shared experts; Qwen's (Qwen2 MoE, Qwen3-Next,
    Qwen3.5 MoE) have one, known only by its width (``n_ff_shexp`` in llama.cpp)."""
    shared = h.int_of("expert_shared_count") or (1 if h.int_of("expert_shared_feed_forward_length") else 0)
    return h.int_of("expert_count"), h.int_of("expert_used_count"), shared


def require_splittable(h: Header, name: str) -> Arch:
    """The entry of ``h``'s architecture, or :class:`PotluckError` saying in one line why ``name``
    cannot be split."""
    why = unsplittable_reason(h)
    if why is not None:
        raise PotluckError(f"cannot split {name}: {why}")
    return ARCHS[h.arch]


# --------------------------------------------------------------------------- how layers count

@dataclass(frozen=True)
class SliceRules:
    """Which layer ranges llama.cpp loads as a slice of one model, for the planner: per trunk
    layer whether it slides (an architecture with sliding windows needs one in every slice,
    unless it widens global-only slices: None then), and any other refusal of the architecture's."""

    swa: tuple[bool, ...] | None = None
    problem: Callable[[int, int], str | None] | None = None

    def why_not(self, lo: int, hi: int) -> str | None:
        if self.swa is not None and not any(self.swa[lo:hi]):
            return "hold no sliding-window layer, which llama.cpp cannot load"
        return self.problem(lo, hi) if self.problem is not None else None


def slice_rules(h: Header) -> SliceRules:
    arch = ARCHS.get(h.arch)
    if arch is None:
        return SliceRules()
    bound = arch.slice_problem
    swa = None if arch.widens_global_slices else arch.swa_layers(h)
    return SliceRules(swa, (lambda lo, hi: bound(h, lo, hi)) if bound is not None else None)


# What a recurrent layer moves a token beyond its weights, in passes over its state (timed like
# weight bytes): the update reads and writes it, llama.cpp's snapshot of the row copies it (read
# and write), and a stage's checkpoint after every batch copies it out, measured at 0.8 ms for
# 6.6 MB where the weights streamed at 12.6 GB/s (1.5 passes; docs/facts.md §33). The four
# passes of one process match the hybrid layer's measured 1.25-1.32x of its weights' time.
RECURRENT_STATE_PASSES = 5.5


def layer_bytes(h: Header) -> tuple[list[int], list[int]]:
    """Per trunk layer: (the bytes it holds in memory, every expert resident; the bytes a token
    reads, only the ``expert_used_count`` of ``expert_count`` routed experts it is sent to,
    shared experts and the dense parts whole, and a recurrent layer's state as many times as
    it is moved, :data:`RECURRENT_STATE_PASSES`)."""
    n = h.n_layer
    memory, time = [0] * n, [0] * n
    n_expert = h.int_of("expert_count")
    used = h.per_layer("expert_used_count")
    for name, nbytes in h.tensor_bytes.items():
        m = _BLK.match(name)
        if not m or int(m.group(1)) >= n:
            continue
        i = int(m.group(1))
        memory[i] += nbytes
        if n_expert and _ROUTED_EXPERTS.match(m.group(2)):
            time[i] += nbytes * used[i] // n_expert
        else:
            time[i] += nbytes
    for i, state in enumerate(recurrent_state_bytes(h) or ()):
        time[i] += int(state * RECURRENT_STATE_PASSES)
    return memory, time


def kv_bytes_per_token(h: Header) -> tuple[int, ...]:
    """Per trunk layer, its KV cache for one token (BF16 K and V): each layer's own KV heads
    and head widths (Gemma 4's sliding layers have others than its global ones), K only under
    multi-head latent attention (``key_length_mla`` set: V is a view of it, llama-kv-cache.cpp),
    nothing in a recurrent layer (its state is :func:`recurrent_state_bytes`)."""
    n_embd = h.int_of("embedding_length")
    n_head = h.int_of("attention.head_count", 1) or 1
    kv_heads = h.per_layer("attention.head_count_kv", n_head)
    mla = bool(h.int_of("attention.key_length_mla"))
    k_full = h.int_of("attention.key_length", n_embd // n_head)
    v_full = 0 if mla else h.int_of("attention.value_length", n_embd // n_head)
    k_swa, v_swa = h.int_of("attention.key_length_swa", k_full), h.int_of("attention.value_length_swa", v_full)
    arch = ARCHS.get(h.arch)
    swa = (arch.swa_layers(h) if arch is not None else None) or (False,) * h.n_layer
    recurrent = recurrent_layers(h) if arch is not None and "recurrent" in arch.cache else (False,) * h.n_layer
    return tuple(
        0 if recurrent[i] else 2 * (kv_heads[i] or n_head) * ((k_swa + v_swa) if swa[i] else (k_full + v_full))
        for i in range(h.n_layer)
    )
