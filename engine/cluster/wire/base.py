"""What every wire message shares: the protocol version, the limits, array dtypes, the error
the codec raises and the message base class."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

PROTOCOL_VERSION = 16  # 2: forward/kv carry engine jobs and KV ops; 3: a stage belongs to its head;
# 4: status reports busy time; 5: the last worker returns hidden states (the head computes the output);
# 6: one cancel names several job groups; 7: run_id fields renamed group/groups; 8: an offer's reply
# says how much of a cut-off transfer the worker kept (the head resumes there); 9: an offer names
# the model and layers of its slice (a worker holding the model cuts it: --models); 10: the head's
# messages and the pipeline's traffic are signed with keys from the head (hello, load), not
# recognized by routing id; 11: kv carries save/load/drop of kept conversations (stage slots);
# 12: a ping may carry padding (the head measures each worker's round trip and bandwidth at join);
# 13: a stage between the first and the last is sliced without a vocabulary (a worker cutting
# slices from its own copy, --models, must cut them byte for byte as the head does); 14: kv
# save/load name any sequence (several conversations decoded together, each in its own stream);
# 15: loaded says how long a verify batch stays exact on the stage's weights and CPU; 16: a node's
# speed is GB/s through llama.cpp's Q4_0 matrix-vector product (was a numpy multiply-add score)
MAGIC = b"potluck/%d" % PROTOCOL_VERSION
MAX_HEADER_BYTES = 16 * 1024
MAX_STR = 4096
MAX_ARRAYS = 4
MAX_CANCEL = 256  # job groups one cancel may name (besides the first)
MAX_DIM = 1 << 31
INT32_MAX = (1 << 31) - 1
DEFAULT_MAX_BYTES = 256 * 1024 * 1024  # one message; the worker also sets ZMQ_MAXMSGSIZE

DTYPES: dict[str, np.dtype] = {
    "i32": np.dtype("<i4"),
    "f32": np.dtype("<f4"),
    "f16": np.dtype("<f2"),
    "u8": np.dtype("u1"),
}
HIDDEN_DTYPES = ("f32", "f16")


class WireError(ValueError):
    """A frame list that is not a valid potluck message (the only error :func:`parse_frames` raises)."""


@dataclass(frozen=True)
class WireMessage:
    """Base of every message; subclasses set TYPE, ARRAYS and may override :meth:`check`."""

    TYPE: ClassVar[str] = ""
    ARRAYS: ClassVar[tuple[str, ...]] = ()

    def check(self) -> None:
        """Cross-field validation; raise :class:`WireError`."""



def check_hex64(value: str, what: str) -> None:
    """Keys and sha256 digests travel as 64 lowercase hex digits."""
    if len(value) != 64 or any(c not in "0123456789abcdef" for c in value):
        raise WireError(f"{what} must be 64 lowercase hex digits")
