"""The compiled ``cb_eval`` callback behind :func:`.observe.native_observer`, cached on disk.

It calls four C functions (ggml's tensor name, size and copy, libc's strncmp) through
addresses it reads from its control block, never addresses baked into the code: the
libraries load at other addresses in every process, and baked ones kept numba from caching
the callback, so every process that observed a graph compiled it again (each worker's stage
process and its spare: 0.81 s of CPU for its first call, 0.53 s with the cache; docs/facts.md §38).
Imported only by ``native_observer`` and ``ObservedBuffers`` (numba).

The control block (:class:`.observe.ObservedBuffers` writes it, int64 words): the number of
names, the block's length, the index of the name that ends the graph (-1: none), the four
function addresses, the names (``NAME_WORDS`` each), then per name the bytes written by the
last run (-1: did not fit), the byte offset of its data region and the region's size.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import carray, cfunc, types
from numba.extending import intrinsic

# The control block's layout (here, not in observe.py: numba's cache would not see a change there)
NAME_WORDS = 8  # a graph tensor name: GGML_MAX_NAME = 64 bytes = 8 int64 words
HEAD_WORDS = 7  # names, the block's length, the stopping name's index, the four addresses
_I64 = ir.IntType(64)


def _call_at(builder: ir.IRBuilder, address: ir.Value, ret: ir.Type, args: list[ir.Value]) -> ir.Value:
    fn = ir.FunctionType(ret, [a.type for a in args])
    return builder.call(builder.inttoptr(address, fn.as_pointer()), args)


@intrinsic
def _address(typingctx, pointer):  # type: ignore[no-untyped-def]
    """A ``void *`` as an integer."""
    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        return builder.ptrtoint(args[0], _I64)
    return types.uint64(types.voidptr), codegen


@intrinsic
def _size_of_1(typingctx, address, a):  # type: ignore[no-untyped-def]
    """``size_t f(void *)`` at ``address`` (ggml_get_name, ggml_nbytes)."""
    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        return _call_at(builder, args[0], _I64, [args[1]])
    return types.uint64(types.uint64, types.uint64), codegen


@intrinsic
def _int_of_3(typingctx, address, a, b, c):  # type: ignore[no-untyped-def]
    """``int f(void *, void *, size_t)`` at ``address`` (strncmp)."""
    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        return _call_at(builder, args[0], ir.IntType(32), list(args[1:]))
    return types.int32(types.uint64, types.uint64, types.uint64, types.uint64), codegen


@intrinsic
def _void_of_4(typingctx, address, a, b, c, d):  # type: ignore[no-untyped-def]
    """``void f(void *, void *, size_t, size_t)`` at ``address`` (ggml_backend_tensor_get)."""
    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        _call_at(builder, args[0], ir.VoidType(), list(args[1:]))
        return context.get_dummy_value()
    return types.none(types.uint64, types.uint64, types.uint64, types.uint64, types.uint64), codegen


@cfunc(types.boolean(types.voidptr, types.boolean, types.voidptr), cache=True)
def observe(tensor, ask, user_data):  # type: ignore[no-untyped-def]
    head = carray(user_data, (HEAD_WORDS,), np.int64)
    n = head[0]
    ctl = carray(user_data, (head[1],), np.int64)
    base = np.uint64(ctl.ctypes.data)
    get_name, nbytes, tensor_get, strncmp = (np.uint64(head[3]), np.uint64(head[4]),
                                             np.uint64(head[5]), np.uint64(head[6]))
    at = _address(tensor)
    written_at = HEAD_WORDS + NAME_WORDS * n
    name = _size_of_1(get_name, at)
    for i in range(n):
        own = base + np.uint64((HEAD_WORDS + NAME_WORDS * i) * 8)
        if _int_of_3(strncmp, name, own, np.uint64(NAME_WORDS * 8)) == 0:
            if ask:
                return True
            size = np.int64(_size_of_1(nbytes, at))
            if size <= ctl[written_at + 2 * n + i]:
                _void_of_4(tensor_get, at, base + np.uint64(ctl[written_at + n + i]), np.uint64(0), np.uint64(size))
                ctl[written_at + i] = size
            else:
                ctl[written_at + i] = -1
            return i != head[2]
    return not ask
