"""What the engine accepts: every user-settable value is checked here before llama.cpp sees it.

Why one module: llama.cpp seldom returns an error for a bad size. It rounds the context up,
clamps the batch to the context, silently truncates integers to 32 bits, and for a batch
longer than its n_batch it stops the whole process (``GGML_ASSERT`` in llama-context.cpp).
So the CLI, config.toml, the chat app's picker and the cluster head all pass their values
through these functions, which compute the sizes llama.cpp will really use and refuse the
rest with a :class:`PotluckError`: one line naming the value and saying what to do.

Decisions (README, ``generate`` options):
- ``--ctx`` is rounded up to a multiple of 256 (llama.cpp allocates that anyway), so the batch
  is never clamped below 256 tokens and every strategy's verify batch fits.
- ``--threads`` above the usable cores is refused, not clamped: oversubscribed llama.cpp
  threads spin-wait on each other (``-t 1000`` on 2 cores ran at 0.21 tok/s), and a refusal
  is one line that says what to pass, where a clamp would need a second line to explain itself.
- ``--seed`` takes any integer; it is reduced modulo 2**64 (numpy's generators take only
  non-negative seeds), so ``-1`` and ``2**64 - 1`` draw the same tokens.
- ``--max-tokens`` above what the context has room for is not an error: the reply stops
  when the context is full (finish reason ``context_full``).
"""

from __future__ import annotations

import math
import numbers
import operator
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import ContextFullError, PotluckError
from .memory import free_memory_bytes
from .sampling import SamplingParams

if TYPE_CHECKING:
    from .runtime import Model

N_BATCH = 512
"""Most tokens potluck puts in one llama_decode (prompt chunks); llama.cpp clamps it to the context."""
CTX_STEP = 256
"""llama.cpp rounds each KV stream's context up to a multiple of this (GGML_PAD(n_ctx, 256))."""
MAX_CTX = 1 << 24
"""Largest context: the cluster wire format's bound, and n_ctx times streams stays a uint32."""
SEED_MODULUS = 1 << 64
MIN_SAMPLING_FACTOR = 1e-6
"""Smallest positive temperature and repeat penalty: logits divided by far less overflow to inf
and make the probabilities NaN. A temperature this low is already greedy in all but name."""
MAX_PENALTY = 2.0
"""Largest frequency or presence penalty either way: OpenAI's range (llama.cpp takes any number)."""
MAX_DISCOVER_S = 60.0
MAX_JOIN_S = 600.0
KV_CACHES = {
    "bf16": "exact on every path; prompts prefill at about half F16's speed",
    "f16": "prompts prefill about 2x faster; exact because 1-token steps run on one thread",
}
"""The target's KV cache settings (``--kv``; docs/facts.md §3, ``loader.target_params``)."""


def _whole(value: object) -> int | None:
    """``value`` as an int (numpy integers too), or None for bools, floats and the rest."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


@dataclass(frozen=True)
class ContextSizes:
    """The sizes a llama.cpp context will really have (read back by ``runtime.Context`` too)."""

    n_ctx: int
    """Tokens per sequence: the request rounded up to a multiple of :data:`CTX_STEP`."""
    n_batch: int
    """Most tokens per llama_decode: :data:`N_BATCH`, clamped to the whole context as llama.cpp does."""


def context_sizes(n_ctx: int, n_streams: int = 1) -> ContextSizes:
    """Sizes for ``n_ctx`` tokens per sequence over ``n_streams`` KV streams.

    Asking llama.cpp for the rounded size itself means its clamp ``n_batch <= n_ctx`` never
    bites below 256 tokens, so prompt chunks and verify batches (<= 48) always fit.
    """
    n = _whole(n_ctx)
    if n is None or not 1 <= n <= MAX_CTX:
        raise PotluckError(f"--ctx (n_ctx) must be a whole number from 1 to {MAX_CTX}, got {n_ctx!r}")
    per_stream = -(-n // CTX_STEP) * CTX_STEP
    return ContextSizes(per_stream, min(N_BATCH, per_stream * max(1, n_streams)))


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask, not the machine's total)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def threads(n: int, what: str = "--threads (n_threads)") -> int:
    """0 means every usable core; more than the usable cores is refused (see the module notes)."""
    cores = usable_cores()
    count = _whole(n)
    if count is None or not 0 <= count <= cores:
        raise PotluckError(f"{what} must be from 1 to the {cores} usable cores, or 0 for all of them; got {n!r}")
    return count


def seed(value: int | None) -> int | None:
    """Any integer onto numpy's seed range [0, 2**64); None stays None (a fresh seed per reply)."""
    if value is None:
        return None
    n = _whole(value)
    if n is None:
        raise PotluckError(f"--seed must be a whole number, got {value!r}")
    return n % SEED_MODULUS


def _number(what: str, value: float) -> float:
    try:
        number = float(value) if isinstance(value, numbers.Real) and not isinstance(value, bool) else math.nan
    except OverflowError:  # an int beyond float range
        number = math.inf
    if not math.isfinite(number):
        raise PotluckError(f"{what} must be a finite number, got {value!r}")
    return number


def sampling(params: SamplingParams) -> SamplingParams:
    """The parameters with the seed mapped; refuses values that would make NaN probabilities."""
    temp = _number("--temp (temperature)", params.temperature)
    if temp < 0 or 0 < temp < MIN_SAMPLING_FACTOR:
        raise PotluckError(
            f"--temp (temperature) must be 0 (greedy) or at least {MIN_SAMPLING_FACTOR:g}, got {temp:g}"
        )
    top_k = _whole(params.top_k)
    if top_k is None or top_k < 0:
        raise PotluckError(f"--top-k must be a whole number >= 0 (0 = off), got {params.top_k!r}")
    top_p = _number("--top-p", params.top_p)
    if not 0.0 < top_p <= 1.0:
        raise PotluckError(f"--top-p must be in (0, 1] (1 = off), got {top_p:g}")
    min_p = _number("--min-p", params.min_p)
    if not 0.0 <= min_p < 1.0:
        raise PotluckError(f"--min-p must be in [0, 1) (0 = off), got {min_p:g}")
    penalty = _number("--repeat-penalty", params.repeat_penalty)
    if penalty < MIN_SAMPLING_FACTOR:
        raise PotluckError(
            f"--repeat-penalty must be at least {MIN_SAMPLING_FACTOR:g} (1 = off), got {penalty:g}"
        )
    for flag, value in (("--frequency-penalty", params.frequency_penalty),
                        ("--presence-penalty", params.presence_penalty)):
        if not -MAX_PENALTY <= _number(flag, value) <= MAX_PENALTY:
            raise PotluckError(f"{flag} must be from {-MAX_PENALTY:g} to {MAX_PENALTY:g} (0 = off), got {value:g}")
    last_n = _whole(params.repeat_last_n)
    if last_n is None or last_n < 0:
        raise PotluckError(f"the penalties' window (repeat_last_n) must be a whole number >= 0, "
                           f"got {params.repeat_last_n!r}")
    return replace(params, seed=seed(params.seed))


def max_tokens(n: int) -> int:
    """At least one token; more than the context holds just ends at ``context_full``."""
    count = _whole(n)
    if count is None or count <= 0:
        raise PotluckError(f"--max-tokens (max_tokens) must be a positive whole number, got {n!r}")
    return count


MAX_CHOICES = 16  # replies to one request (n): each costs a whole reply
MAX_TOP_LOGPROBS = 20  # OpenAI's limit


def choices(n: int) -> int:
    """How many replies one request may ask for (``n``)."""
    count = _whole(n)
    if count is None or not 1 <= count <= MAX_CHOICES:
        raise PotluckError(f"n must be a whole number from 1 to {MAX_CHOICES}, got {n!r}")
    return count


def top_logprobs(n: int) -> int:
    """How many likeliest tokens a reply may report at each position."""
    count = _whole(n)
    if count is None or not 0 <= count <= MAX_TOP_LOGPROBS:
        raise PotluckError(f"top_logprobs must be a whole number from 0 to {MAX_TOP_LOGPROBS}, got {n!r}")
    return count


def text(what: str, value: str) -> str:
    """Text that can be encoded for the tokenizer: invalid UTF-8 (argv, files) arrives as
    lone surrogates, which would fail deep inside tokenization."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise PotluckError(
            f"{what} is not valid UTF-8 (bad byte at character {e.start}); convert it to UTF-8 "
            "(e.g. iconv -t UTF-8)"
        ) from None
    return value


def path(what: str, value: Path | str | None) -> Path | None:
    """A user path with ``~`` expanded; a NUL byte (possible in config.toml) is refused here
    because every filesystem call would raise on it."""
    if value is None:
        return None
    raw = os.fspath(value)
    if "\x00" in raw:
        raise PotluckError(f"{what} {raw!r} contains a NUL character; fix the path")
    if raw == "":
        raise PotluckError(f"{what} is empty; pass a path to a .gguf file")
    return Path(os.path.expanduser(raw))  # unlike Path.expanduser, never raises for ~unknown_user


def kv_cache(value: str) -> str:
    if value not in KV_CACHES:
        raise PotluckError(f"--kv must be one of {', '.join(KV_CACHES)}, got {value!r}")
    return value


def prompt_fits(n_tokens: int, n_ctx: int, what: str = "the prompt") -> None:
    """A prompt needs its tokens plus one free cell for the first reply token."""
    if n_tokens + 1 > n_ctx:
        raise ContextFullError(
            f"{what} is {n_tokens} tokens but the context holds {n_ctx}; shorten it or raise --ctx"
        )


def context_fits_model(model: Model, n_ctx: int) -> None:
    """A context no longer than the model's training length (8,192 for the bundled model):
    past it llama.cpp only warns, and the model's positions beyond it are untrained."""
    train = model.n_ctx_train
    if train > 0 and n_ctx > -(-train // CTX_STEP) * CTX_STEP:
        raise PotluckError(
            f"--ctx (n_ctx) is longer than the {train} tokens {model.path.name} was trained on; "
            f"pass --ctx {train} or less"
        )


def kv_bytes(model: Model, n_cells: int) -> int | None:
    """Upper bound of a BF16 KV cache of ``n_cells`` over every layer (None: unknown layout).

    Sliding-window layers (gemma3) really keep fewer cells, so this errs on the safe side.
    Where the KV heads are one per layer (Gemma 4's sliding and global layers differ), each
    layer counts its own heads and widths, read from the header."""

    def meta_int(key: str, default: int | None) -> int | None:
        raw = model.meta(f"{model.arch}.{key}")
        try:
            return int(raw) if raw is not None else default
        except ValueError:  # per-layer arrays: take the safe default
            return default

    # from the header, not llama.cpp's hparams: a head in cluster mode opens its model vocab-only
    n_head = meta_int("attention.head_count", None)
    n_layer = meta_int("block_count", 0) or 0
    n_embd = meta_int("embedding_length", 0) or 0
    if not n_head or n_layer <= 0 or n_embd <= 0:
        return None
    n_head_kv = meta_int("attention.head_count_kv", None)
    if n_head_kv is None:  # absent, or one per layer (llama.cpp's metadata leaves arrays out)
        from .archs import kv_bytes_per_token
        from .gguf_tools import file_header

        return n_cells * sum(kv_bytes_per_token(file_header(model.path)))
    k_len = meta_int("attention.key_length", n_embd // n_head) or 0
    v_len = meta_int("attention.value_length", k_len) or 0
    return n_cells * n_layer * n_head_kv * (k_len + v_len) * 2


def memory_fits(model: Model, n_ctx: int, n_streams: int = 1, hint: str = "lower --ctx") -> None:
    """Refuse a context whose KV cache and weights cannot fit in free memory: llama.cpp clears
    the whole cache when it creates it, so an oversized one gets the process killed (or the
    machine swapping), not an error."""
    # every stream's cells, plus a prompt's F16 twin of one sequence and the state it hands
    # back (core/staged_prefill.py)
    kv = kv_bytes(model, n_ctx * (max(1, n_streams) + 2))
    free = free_memory_bytes()  # MemAvailable, or less under a cgroup limit
    # a tenth of the free memory stays for compute buffers, the rest of potluck and the system
    if kv is None or free is None or kv + model.size_bytes() <= 0.9 * free:
        return
    gib = 1 << 30
    raise PotluckError(
        f"a context of {n_ctx} tokens (--ctx) needs about {kv / gib:.1f} GiB of KV cache (prefill included) plus "
        f"{model.size_bytes() / gib:.1f} GiB of weights for {model.path.name} but "
        f"{free / gib:.1f} GiB of memory is free; {hint}"
    )


def nodes(value: str) -> tuple[str, ...]:
    """``host:port,...`` with ports 1..65535 (ZeroMQ would raise on anything else)."""
    found = tuple(a.strip() for a in value.split(",") if a.strip())
    if not found:
        raise PotluckError(f"--nodes must be host:port,... or 'auto', got {value!r}")
    for a in found:
        host, _, port = a.rpartition(":")
        if not host or any(c.isspace() for c in host) or not (port.isascii() and port.isdigit()) \
                or not 1 <= int(port) <= 65535:
            raise PotluckError(f"--nodes entry {a!r} is not host:port (port 1-65535)")
    return found


def split(value: str) -> tuple[int, ...]:
    """Layer boundaries like ``0,12,30``: increasing whole numbers (the plan checks the top)."""
    try:
        bounds = tuple(int(x) for x in value.split(","))
    except ValueError:
        raise PotluckError(f"--split must be layer numbers like 0,12,30, got {value!r}") from None
    if any(b < 0 for b in bounds) or any(a >= b for a, b in zip(bounds, bounds[1:])):
        raise PotluckError(f"--split must be increasing layer numbers >= 0 like 0,12,30, got {value!r}")
    return bounds


def discover_timeout(value: float, name: str = "--discover-timeout") -> float:
    """Seconds to browse for workers: a typo like 1e9 would hang the command, not fail it."""
    return _seconds(name, value, MAX_DISCOVER_S)


def join_timeout(value: float, name: str = "--join-timeout") -> float:
    """Seconds a worker has to accept us: bounded like :func:`discover_timeout`."""
    return _seconds(name, value, MAX_JOIN_S)


def _seconds(name: str, value: float, most: float) -> float:
    s = _number(name, value)
    if not 0 < s <= most:
        raise PotluckError(f"{name} must be more than 0 and at most {most:g} seconds, got {s:g}")
    return s
