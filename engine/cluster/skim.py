"""The worker's drain at C speed: a numba loop over libzmq's own message calls, reading the
socket pyzmq opened (``sock.underlying``), 0.15 µs a message where pyzmq takes 4.2 µs
(docs/facts.md §12). Imported on first need (:func:`potluck.engine.cluster.inbox.warm_up`),
since numba and LLVM add about 0.7 s to a process's start."""

from __future__ import annotations

import llvmlite.binding as llvm
import numba as nb
import numpy as np
import zmq.backend.cython._zmq as _pyzmq_backend
from numba import types

# libzmq's message calls, from the very library pyzmq uses (dlsym on pyzmq's extension
# searches its dependencies), so a numba loop can read the socket pyzmq opened. Named as
# external symbols rather than ctypes pointers, so numba can cache the compiled loop.
llvm.load_library_permanently(_pyzmq_backend.__file__)
_msg_init = types.ExternalFunction("zmq_msg_init", types.intc(types.voidptr))
_msg_recv = types.ExternalFunction("zmq_msg_recv", types.intc(types.voidptr, types.voidptr, types.intc))
_msg_data = types.ExternalFunction("zmq_msg_data", types.CPointer(types.uint8)(types.voidptr))
_msg_size = types.ExternalFunction("zmq_msg_size", types.uintp(types.voidptr))
_msg_more = types.ExternalFunction("zmq_msg_more", types.intc(types.voidptr))
_msg_close = types.ExternalFunction("zmq_msg_close", types.intc(types.voidptr))

EMPTY, READ, PAUSED = 0, 1, 2  # what skim found: nothing left, a message for Python, a long drop


@nb.njit(cache=True)
def _slot(data: np.ndarray, n: int, slots: int) -> int:
    """FNV-1a over a routing id: the peer's budget counters (a collision only pools two
    peers' budgets; the owner and the upstream are compared byte for byte, never metered)."""
    h = np.uint64(14695981039346656037)
    for i in range(n):
        h = (h ^ np.uint64(data[i])) * np.uint64(1099511628211)
    return np.int64(h % np.uint64(slots))


@nb.njit(cache=True)
def _same(data: np.ndarray, n: int, ident: np.ndarray) -> bool:
    if n != ident.size or n == 0:
        return False
    for i in range(n):
        if data[i] != ident[i]:
            return False
    return True


@nb.njit(cache=True)
def skim(sock: int, msg_buf: np.ndarray, ident_out: np.ndarray, trusted_a: np.ndarray,
          trusted_b: np.ndarray, spent_msgs: np.ndarray, spent_bytes: np.ndarray, peer_messages: int,
          peer_bytes: int, max_drops: int) -> tuple[int, int, int, int]:
    """Read routing ids until one belongs to a message Python must see; drop (read and free)
    the messages of peers past their budget. Returns (status, id length, peer slot, dropped);
    on READ the id is in ``ident_out`` and the rest of that message is still on the socket."""
    msg = msg_buf.ctypes.data
    dropped = 0
    while dropped < max_drops:
        _msg_init(msg)
        if _msg_recv(msg, sock, 1) < 0:  # ZMQ_DONTWAIT: nothing left (or EAGAIN)
            _msg_close(msg)
            return EMPTY, 0, 0, dropped
        n = min(np.int64(_msg_size(msg)), ident_out.size)
        data = nb.carray(_msg_data(msg), n)
        for i in range(n):
            ident_out[i] = data[i]
        more = _msg_more(msg)
        _msg_close(msg)
        slot = _slot(ident_out, n, spent_msgs.size)
        if (_same(ident_out, n, trusted_a) or _same(ident_out, n, trusted_b)
                or spent_msgs[slot] < peer_messages and spent_bytes[slot] < peer_bytes):
            spent_msgs[slot] += 1
            return READ, n, slot, dropped
        while more:  # past its budget: the rest of the message is read and freed unparsed
            _msg_init(msg)
            _msg_recv(msg, sock, 0)
            more = _msg_more(msg)
            _msg_close(msg)
        dropped += 1
    return PAUSED, 0, 0, dropped
