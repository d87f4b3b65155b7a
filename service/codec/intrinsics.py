"""LLVM intrinsics for the compiled JSON reader (:mod:`rnnserve.service.codec.bodies`) and writer
(:mod:`rnnserve.service.codec.json_writer`): unaligned 8-byte loads and stores into uint8 arrays,
and bit counts, each one machine instruction where numba has no spelling for it.

Functions handed to ``intrinsic(...)`` run inside numba's compiler while their callers compile;
mutation testing leaves them alone (docs/TESTING.md) and the reader's and writer's tests cover
them.
"""

from __future__ import annotations

from typing import Any

from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic

__all__ = ["bit_length", "load8", "store8", "trailing_zeros"]


def _zero_count(name: str, value: Any, builder: Any, *, zero: bool = False) -> Any:
    """LLVM's ``llvm.ctlz`` or ``llvm.cttz`` of a 64-bit value: not 0, or, with ``zero``,
    possibly 0 (then 64; x86's ``lzcnt``/``tzcnt`` give that without a branch)."""
    i64 = ir.IntType(64)
    fnty = ir.FunctionType(i64, [i64, ir.IntType(1)])
    fn = builder.module.declare_intrinsic(name, [i64], fnty)
    return builder.call(fn, [value, ir.Constant(ir.IntType(1), 0 if zero else 1)])


def _bit_length_typing(typingctx: Any, v: Any) -> Any:
    """``int.bit_length`` of an int64 v > 0, by LLVM's count of leading zeros."""
    sig = types.int64(types.int64)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        zeros = _zero_count("llvm.ctlz", args[0], builder)
        return builder.sub(ir.Constant(ir.IntType(64), 64), zeros)

    return sig, codegen


def _trailing_zeros_typing(typingctx: Any, v: Any) -> Any:
    """The trailing zero bits of a uint64 v, 64 if v is 0 (LLVM's cttz; one ``tzcnt``)."""
    sig = types.uint64(types.uint64)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return _zero_count("llvm.cttz", args[0], builder, zero=True)

    return sig, codegen


def _byte_pointer(context: Any, builder: Any, signature: Any, args: Any) -> Any:
    """``&buf[pos]`` of a uint8 array, as a pointer to a 64-bit word."""
    array = context.make_array(signature.args[0])(context, builder, args[0])
    ptr = builder.gep(array.data, [args[1]])
    return builder.bitcast(ptr, ir.IntType(64).as_pointer())


def _load8_typing(typingctx: Any, buf: Any, pos: Any) -> Any:
    """``buf[pos:pos + 8]`` (a uint8 array) as a little-endian uint64, unaligned."""
    sig = types.uint64(buf, pos)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        load = builder.load(_byte_pointer(context, builder, signature, args))
        load.align = 1
        return load

    return sig, codegen


def _store8_typing(typingctx: Any, buf: Any, pos: Any, word: Any) -> Any:
    """Store the int64 ``word`` little-endian at ``buf[pos:pos + 8]`` (a uint8 array), unaligned."""
    sig = types.void(buf, pos, word)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> None:
        store = builder.store(args[2], _byte_pointer(context, builder, signature, args))
        store.align = 1

    return sig, codegen


bit_length: Any = intrinsic(_bit_length_typing)
trailing_zeros: Any = intrinsic(_trailing_zeros_typing)
load8: Any = intrinsic(_load8_typing)
store8: Any = intrinsic(_store8_typing)
