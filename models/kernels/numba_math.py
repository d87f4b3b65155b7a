"""Activations for numba kernels: float32 ones that vectorise, float64 ones from libm.

float32 uses a rational ``tanh`` (Eigen's ``generic_fast_tanh_float``, |error| < 4e-7; pure
arithmetic, so loops over it vectorise, which libm calls would not) and
``sigmoid(x) = (1 + tanh(x / 2)) / 2``; float64 uses libm's ``tanh`` and ``exp``. Call
:func:`fast_tanh` and :func:`fast_sigmoid` from ``@numba.njit`` code; numba picks the version by
the argument's type.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numba.core import types as nb_types
from numba.extending import overload


def fast_tanh(x: Any) -> Any:  # pragma: no cover - typed by the overloads below
    raise NotImplementedError("call from numba-compiled code")


def fast_sigmoid(x: Any) -> Any:  # pragma: no cover - typed by the overloads below
    raise NotImplementedError("call from numba-compiled code")


_F32 = np.float32
# Eigen's generic_fast_tanh_float: tanh(x) ~ x P(x^2) / Q(x^2) on [-c, c]
_TANH_CLAMP = _F32(7.90531110763549805)
_A1, _A3, _A5, _A7 = (
    _F32(4.89352455891786e-03),
    _F32(6.37261928875436e-04),
    _F32(1.48572235717979e-05),
    _F32(5.12229709037114e-08),
)
_A9, _A11, _A13 = (
    _F32(-8.60467152213735e-11),
    _F32(2.00018790482477e-13),
    _F32(-2.76076847742355e-16),
)
_B0, _B2, _B4, _B6 = (
    _F32(4.89352518554385e-03),
    _F32(2.26843463243900e-03),
    _F32(1.18534705686654e-04),
    _F32(1.19825839466702e-06),
)
_HALF32 = _F32(0.5)


def _tanh32(x: Any) -> Any:
    x = min(max(x, -_TANH_CLAMP), _TANH_CLAMP)
    x2 = x * x
    p = _A13
    p = p * x2 + _A11
    p = p * x2 + _A9
    p = p * x2 + _A7
    p = p * x2 + _A5
    p = p * x2 + _A3
    p = p * x2 + _A1
    q = _B6
    q = q * x2 + _B4
    q = q * x2 + _B2
    q = q * x2 + _B0
    return x * p / q


def _sigmoid32(x: Any) -> Any:
    return _HALF32 + _HALF32 * fast_tanh(_HALF32 * x)


def _tanh64(x: Any) -> Any:
    return math.tanh(x)


def _sigmoid64(x: Any) -> Any:
    return 1.0 / (1.0 + math.exp(-x))


def _overload_tanh(x: Any) -> Any:
    if isinstance(x, nb_types.Float):
        return _tanh32 if x.bitwidth == 32 else _tanh64
    return None


def _overload_sigmoid(x: Any) -> Any:
    if isinstance(x, nb_types.Float):
        return _sigmoid32 if x.bitwidth == 32 else _sigmoid64
    return None


# error_model="numpy": no ZeroDivisionError check on `/`, which would keep loops from vectorising
overload(fast_tanh, jit_options={"nogil": True, "error_model": "numpy", "fastmath": {"contract"}})(
    _overload_tanh
)
overload(
    fast_sigmoid, jit_options={"nogil": True, "error_model": "numpy", "fastmath": {"contract"}}
)(_overload_sigmoid)
