"""The Traveller's rollout as one compiled CPU loop (numba, ``nogil``), with fused LSTM gates.

:func:`rollout_packed_numba` has exactly the semantics of
:func:`rnnserve.models.traveller.rollout_packed` (same arguments, same weight layout, same results);
the whole time loop runs in one numba call that releases the GIL, so it runs in the service's worker
thread without holding up the event loop. A layer's gates ``[b, 4H] = z[:b] @ W`` come, per step,
from one of three routes, chosen by the layer and the number of active rows ``b``:

- a hand-written matrix-vector loop. Eight weight rows at a time are scaled into the ``4H``
  outputs; the inner loop runs over contiguous outputs, so it vectorises, and the step streams
  the ~0.8 MB of weights from cache once;
- MKL's ``sgemm_``/``dgemm_``, called from inside the loop, where the torch build exports them
  (x86-64 Linux wheels), else ``np.dot`` (numba calls scipy's BLAS), else the hand-written loop.
  float32 rollouts of at least ``PACK_FROM_STEPS`` such steps multiply by weights packed into
  MKL's own layout (``sgemm_compute_``), once per call or, through :class:`NumbaRollout`, once
  per model and batch width;
- numpy's own OpenBLAS (``gemv`` at one row, else ``gemm``), where numpy's wheel bundles it.
  Its small-matrix kernels run narrow products several times faster than MKL on some CPUs
  (AMD's) and not on others, so this route is only taken where it was measured faster.

Unplanned, a step takes the loop below ``GEMM_FROM`` rows and MKL from there on.
:func:`plan_routes` measures the three routes on this machine for a model's layer shapes at each
width up to ``PLAN_WIDTHS`` rows (a fraction of a second, once, at load time, as FFTW's planner or
cuDNN's benchmark mode do) and :class:`NumbaRollout` binds the fastest to a model's rollout. The
routes round differently (each within float32's precision), so two processes whose plans differ
at some width give results that differ in the last bits there.

Each call used to rearrange the weights into the loop's layout (stacking, transposing, packing:
a large share of a 64-step chunk at few rows); :class:`NumbaRollout`, the form a Traveller
serves, does it once per model and keeps the result while the weights stay the same.

The gate nonlinearities and the cell update of a layer run in one fused loop.

The state lives in per-layer input buffers laid out as the GEMM reads them: layer 0 reads
``z0 = [p | h_0 | u_t]``, layer ``l`` reads ``[h_{l-1} | h_l]``; a layer writes its new ``h`` into
its own buffer and the next layer's. Rows ``b..`` of every buffer are finished sequences: they are
not touched again, so each sequence's final state is simply what its rows hold at the end.
Each step copies its input rows ``u_t`` into ``z0``, so layer 0's input projection is part of
that step's GEMM (a few more columns of ``K``) rather than one ``[N, 4H]`` product made up front:
that array is many times the size of the caches for a long batch, so writing it (into freshly
faulted pages) and reading it back cost far more than the few extra columns of ``K``.

Activations: float64 uses libm's ``tanh`` and ``exp`` (the conformance tests compare at 1e-10).
float32 uses a rational ``tanh`` (Eigen's ``generic_fast_tanh_float``, |error| < 4e-7; pure
arithmetic, so the gate loop vectorises, which libm calls would not) and
``sigmoid(x) = (1 + tanh(x / 2)) / 2``. The only fast-math flag is ``contract`` (fused
multiply-add, one rounding instead of two); nothing is reordered.

Compiling takes seconds, once per process and dtype: :func:`compile_for` does it at load time.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import importlib.util
import itertools
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

try:  # numba is a runtime dependency; without it this module cannot be imported.
    import numba
except ImportError as exc:  # pragma: no cover - exercised only where numba is missing
    raise ImportError("rnnserve.models.kernels.rollout_cpu needs numba") from exc

from rnnserve.models.kernels.numba_math import fast_sigmoid, fast_tanh

# Unplanned, a step's gates come from MKL's gemm from this many active rows on and from the
# hand-written loop below it. On one core of an AVX-512 Xeon, MKL's gemm already wins at 2 rows
# and loses to the loop at 1 (bench/rollout_cpu_probe.py --gemm-from 1 2 3).
GEMM_FROM = 2
# The routes of a step's GEMM: the loop's `routes[layer, b]` holds one of these
ROUTE_LOOP, ROUTE_MKL, ROUTE_OPENBLAS = 0, 1, 2  # in this order: checks compare with the ends
ROUTE_NAMES = ("loop", "mkl", "openblas")
# plan_routes measures widths 1..PLAN_WIDTHS; wider steps take MKL, where every BLAS measured
# here reaches the same speed
PLAN_WIDTHS = 32
# a plan leaves a width on its unplanned route unless another is faster by more than this
PLAN_MARGIN = 0.9
# float32 rollouts with at least this many BLAS steps multiply by weights packed once per call
# into MKL's own layout (see _mkl_packed_sgemm): packing a layer costs about what a few steps'
# GEMMs save, so shorter rollouts keep the plain sgemm.
PACK_FROM_STEPS = 8


def _torch_cpu_lib() -> ctypes.CDLL | None:
    lib_dir = Path(torch.__file__).parent / "lib"
    for name in ("libtorch_cpu.so", "libtorch_cpu.dylib"):
        try:
            return ctypes.CDLL(str(lib_dir / name))
        except OSError:
            continue
    return None


def _mkl_packed_sgemm() -> tuple[Any, Any, Any] | None:
    """MKL's ``sgemm_pack_get_size``, ``sgemm_pack_`` and ``sgemm_compute_`` as ctypes
    functions, if this torch build exports them (it exports no double-precision ones).

    Every ``sgemm_`` call first copies the weight matrix into MKL's internal blocked layout,
    work that does not shrink with the active rows, so it dominates the narrow steps of a
    ragged batch's tail. Packing each layer's weights once per rollout and multiplying with
    ``sgemm_compute_`` at every step leaves only the multiplication (the same results, bit for
    bit; bench/rollout_cpu_probe.py --breakdown times both).
    """
    lib = _torch_cpu_lib()
    if lib is None:
        return None
    ptr = ctypes.c_void_p
    try:
        get_size = ctypes.CFUNCTYPE(ctypes.c_size_t, ptr, ptr, ptr, ptr)(
            ("sgemm_pack_get_size", lib)
        )
        pack = ctypes.CFUNCTYPE(None, *([ptr] * 9))(("sgemm_pack_", lib))
        compute = ctypes.CFUNCTYPE(None, *([ptr] * 12))(("sgemm_compute_", lib))
    except AttributeError:
        return None
    return get_size, pack, compute


def _mkl_gemm() -> tuple[Any, Any] | None:
    """MKL's Fortran ``sgemm_``/``dgemm_`` as ctypes functions, if this torch build exports them.

    PyTorch's x86-64 Linux wheels link MKL statically into ``libtorch_cpu`` and export its BLAS
    interface; on one core it runs these GEMMs at 16 rows and more at least as fast as OpenBLAS
    (figures in docs/BENCHMARKS.md). MKL's threads follow torch's (``torch.set_num_threads``),
    as the service sets them.
    """
    lib_dir = Path(torch.__file__).parent / "lib"
    for name in ("libtorch_cpu.so", "libtorch_cpu.dylib"):
        try:
            lib = ctypes.CDLL(str(lib_dir / name))
            proto = ctypes.CFUNCTYPE(None, *([ctypes.c_void_p] * 13))
            return proto(("sgemm_", lib)), proto(("dgemm_", lib))
        except (OSError, AttributeError):
            continue
    return None


# ---------------------------------------------------------------------------- activations

# float32: a rational tanh and sigmoid that vectorise; float64: libm (models/kernels/numba_math.py)
_tanh, _sigmoid = fast_tanh, fast_sigmoid

# ---------------------------------------------------------------------------- the loop


def _jit(fn: Any) -> Any:
    """``fn`` compiled without the GIL, bounds checks or Python's division-by-zero checks.

    ``fastmath={"contract"}`` lets LLVM fuse ``a * b + c`` into one FMA (one rounding instead
    of two); no other fast-math flag, so nothing is reordered.
    """
    return numba.njit(
        fn,
        nogil=True,
        cache=False,
        boundscheck=False,
        error_model="numpy",
        fastmath={"contract"},
    )


def _gemm_small(z: Any, w: Any, b: int, g: Any) -> None:
    # g[:b] = z[:b] @ w; z: [B, K], w: [K, 4H], g: [B, 4H]. Eight weight rows at a time are
    # read once for all b rows; the inner loop runs over the 4H contiguous outputs (vectorised).
    n_out = w.shape[1]
    n_in = w.shape[0]
    for r in range(b):
        for j in range(n_out):
            g[r, j] = 0
    k = 0
    while k + 8 <= n_in:
        w0, w1, w2, w3 = w[k], w[k + 1], w[k + 2], w[k + 3]
        w4, w5, w6, w7 = w[k + 4], w[k + 5], w[k + 6], w[k + 7]
        for r in range(b):
            gr = g[r]
            z0, z1, z2, z3 = z[r, k], z[r, k + 1], z[r, k + 2], z[r, k + 3]
            z4, z5, z6, z7 = z[r, k + 4], z[r, k + 5], z[r, k + 6], z[r, k + 7]
            for j in range(n_out):
                gr[j] = (
                    gr[j]
                    + z0 * w0[j]
                    + z1 * w1[j]
                    + z2 * w2[j]
                    + z3 * w3[j]
                    + z4 * w4[j]
                    + z5 * w5[j]
                    + z6 * w6[j]
                    + z7 * w7[j]
                )
        k += 8
    while k < n_in:
        wk = w[k]
        for r in range(b):
            gr = g[r]
            zk = z[r, k]
            for j in range(n_out):
                gr[j] += zk * wk[j]
        k += 1


_gemm_small_jit = _jit(_gemm_small)
_MKL = _mkl_gemm()
_HAVE_SCIPY_BLAS = importlib.util.find_spec("scipy") is not None


def _gemm_mkl(z: Any, w: Any, b: int, g: Any, ints: Any, scalars: Any) -> None:
    # g[:b] = z[:b] @ w through MKL's Fortran gemm: column-major, so it computes
    # g^T [4H, b] = w^T [4H, K] @ z^T [K, b], which are the same bytes as our row-major arrays.
    # ints: int32 [8] scratch (m, n, k, lda, ldb, ldc, 'N', 'N'); scalars: [2] scratch, g's dtype
    ints[0] = w.shape[1]
    ints[1] = b
    ints[2] = w.shape[0]
    ints[3] = w.shape[1]
    ints[4] = z.shape[1]
    ints[5] = g.shape[1]
    ints[6] = 78  # 'N', read as a character by the Fortran interface
    ints[7] = 78
    scalars[0] = 1
    scalars[1] = 0
    fn = _MKL_S if g.itemsize == 4 else _MKL_D
    fn(
        ints[6:].ctypes,
        ints[7:].ctypes,
        ints[0:].ctypes,
        ints[1:].ctypes,
        ints[2:].ctypes,
        scalars[0:].ctypes,
        w.ctypes,
        ints[3:].ctypes,
        z.ctypes,
        ints[4:].ctypes,
        scalars[1:].ctypes,
        g.ctypes,
        ints[5:].ctypes,
    )


def _gemm_mkl_packed(
    z: Any, packed: Any, n_out: int, b: int, g: Any, ints: Any, scalars: Any
) -> None:
    # g[:b] = z[:b] @ w as _gemm_mkl computes it, from w packed by _pack_weights (transa 'P';
    # MKL ignores lda then); float32 only. n_out: w's 4H columns.
    ints[0] = n_out
    ints[1] = b
    ints[2] = z.shape[1]
    ints[3] = n_out
    ints[4] = z.shape[1]
    ints[5] = g.shape[1]
    ints[6] = 80  # 'P'
    ints[7] = 78  # 'N'
    scalars[1] = 0
    _MKL_COMPUTE(
        ints[6:].ctypes,
        ints[7:].ctypes,
        ints[0:].ctypes,
        ints[1:].ctypes,
        ints[2:].ctypes,
        packed.ctypes,
        ints[3:].ctypes,
        z.ctypes,
        ints[4:].ctypes,
        scalars[1:].ctypes,
        g.ctypes,
        ints[5:].ctypes,
    )


def _gemm_unpacked_only(
    z: Any, packed: Any, n_out: int, b: int, g: Any, ints: Any, scalars: Any
) -> None:  # pragma: no cover - the loop takes it only for packed weights, never made here
    raise RuntimeError("this torch build exports no packed sgemm")


def _gemm_numpy(z: Any, w: Any, b: int, g: Any, ints: Any, scalars: Any) -> None:
    np.dot(z[:b], w, g[:b])  # numba calls scipy's BLAS


def _gemm_fallback(z: Any, w: Any, b: int, g: Any, ints: Any, scalars: Any) -> None:
    _gemm_small_jit(z, w, b, g)


if _MKL is not None:
    _MKL_S, _MKL_D = _MKL
    BLAS = "mkl"
    _gemm_blas_jit = _jit(_gemm_mkl)
elif _HAVE_SCIPY_BLAS:
    BLAS = "scipy"
    _gemm_blas_jit = _jit(_gemm_numpy)
else:  # pragma: no cover - no BLAS reachable from numba: every step takes the hand-written loop
    BLAS = "none"
    _gemm_blas_jit = _jit(_gemm_fallback)

_MKL_PACK = _mkl_packed_sgemm() if _MKL is not None else None
if _MKL_PACK is not None:
    _MKL_COMPUTE = _MKL_PACK[2]
    _gemm_packed_jit = _jit(_gemm_mkl_packed)
else:  # pragma: no cover - every torch build with MKL's sgemm_ exports these too
    _gemm_packed_jit = _jit(_gemm_unpacked_only)


def _numpy_openblas() -> tuple[Any, Any, Any, Any, Any] | None:
    """numpy's own OpenBLAS, which numpy's Linux wheels bundle as ``scipy_openblas64_`` (64-bit
    integers, prefixed names): its ``sgemm_``, ``dgemm_``, ``sgemv_``, ``dgemv_`` and its
    thread-local thread count, as ctypes functions; None where numpy was built otherwise."""
    libs = Path(np.__file__).resolve().parent.parent / "numpy.libs"
    ptr = ctypes.c_void_p
    for path in sorted(libs.glob("libscipy_openblas64_*.so")):
        try:
            lib = ctypes.CDLL(str(path))
            gemm = ctypes.CFUNCTYPE(None, *([ptr] * 13))
            gemv = ctypes.CFUNCTYPE(None, *([ptr] * 11))
            threads = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int)
            return (
                gemm(("scipy_sgemm_64_", lib)),
                gemm(("scipy_dgemm_64_", lib)),
                gemv(("scipy_sgemv_64_", lib)),
                gemv(("scipy_dgemv_64_", lib)),
                threads(("openblas_set_num_threads_local", lib)),
            )
        except (OSError, AttributeError):
            continue
    return None


def _gemm_openblas(z: Any, w: Any, b: int, g: Any, longs: Any, scalars: Any) -> None:
    # g[:b] = z[:b] @ w through numpy's OpenBLAS, column-major as in _gemm_mkl; one row is a
    # gemv, g[0]^T = w^T @ z[0]^T. longs: int64 [9] scratch (m, n, k, lda, ldb, ldc, 'N', 'N',
    # and the vectors' stride 1); scalars: [2] scratch, g's dtype
    longs[0] = w.shape[1]
    longs[1] = b
    longs[2] = w.shape[0]
    longs[3] = w.shape[1]
    longs[4] = z.shape[1]
    longs[5] = g.shape[1]
    longs[6] = 78  # 'N'
    longs[7] = 78
    longs[8] = 1
    scalars[0] = 1
    scalars[1] = 0
    if b == 1:
        fn_v = _OPENBLAS_SGEMV if g.itemsize == 4 else _OPENBLAS_DGEMV
        fn_v(
            longs[6:].ctypes,
            longs[0:].ctypes,
            longs[2:].ctypes,
            scalars[0:].ctypes,
            w.ctypes,
            longs[3:].ctypes,
            z.ctypes,
            longs[8:].ctypes,
            scalars[1:].ctypes,
            g.ctypes,
            longs[8:].ctypes,
        )
        return
    fn = _OPENBLAS_SGEMM if g.itemsize == 4 else _OPENBLAS_DGEMM
    fn(
        longs[6:].ctypes,
        longs[7:].ctypes,
        longs[0:].ctypes,
        longs[1:].ctypes,
        longs[2:].ctypes,
        scalars[0:].ctypes,
        w.ctypes,
        longs[3:].ctypes,
        z.ctypes,
        longs[4:].ctypes,
        scalars[1:].ctypes,
        g.ctypes,
        longs[5:].ctypes,
    )


def _gemm_no_openblas(  # pragma: no cover - plan_routes never picks a route this build lacks
    z: Any, w: Any, b: int, g: Any, longs: Any, scalars: Any
) -> None:
    _gemm_small_jit(z, w, b, g)


_OPENBLAS = _numpy_openblas()
if _OPENBLAS is not None:
    _OPENBLAS_SGEMM, _OPENBLAS_DGEMM, _OPENBLAS_SGEMV, _OPENBLAS_DGEMV, _OPENBLAS_THREADS = (
        _OPENBLAS
    )
    _gemm_openblas_jit = _jit(_gemm_openblas)
else:  # pragma: no cover - numpy built against another BLAS (macOS: Accelerate)
    _gemm_openblas_jit = _jit(_gemm_no_openblas)


def _pack_weights(weights: list[np.ndarray[Any, Any]], n_rows: int) -> np.ndarray[Any, Any]:
    """``[L, S]`` bytes: each layer's ``[K, 4H]`` float32 weights in MKL's packed layout, as the
    A operand of ``g^T = w^T @ z^T`` (see _gemm_mkl), for products of up to ``n_rows`` rows."""
    assert _MKL_PACK is not None
    get_size, pack, _ = _MKL_PACK
    ref = ctypes.byref
    ident, trans, alpha = ctypes.c_char(b"A"), ctypes.c_char(b"N"), ctypes.c_float(1.0)
    dims = [
        (ctypes.c_int(w.shape[1]), ctypes.c_int(n_rows), ctypes.c_int(w.shape[0])) for w in weights
    ]
    sizes = [get_size(ref(ident), ref(m), ref(n), ref(k)) for m, n, k in dims]
    out = np.empty((len(weights), max(sizes)), dtype=np.uint8)
    for layer, (w, (m, n, k)) in enumerate(zip(weights, dims, strict=True)):
        src = np.ascontiguousarray(w, dtype=np.float32)
        dest = out[layer].ctypes.data_as(ctypes.c_void_p)
        pack(ref(ident), ref(trans), ref(m), ref(n), ref(k), ref(alpha), src.ctypes, ref(m), dest)
    return out


def _gemm_route(
    route: int, z: Any, w: Any, packed: Any, b: int, g: Any, ints: Any, longs: Any, scalars: Any
) -> None:
    # g[:b] = z[:b] @ w by `route`; packed: this layer's packed weights, or no bytes: unpacked
    if route == ROUTE_MKL and packed.shape[0] > 0:
        _gemm_packed_jit(z, packed, w.shape[1], b, g, ints, scalars)
    elif route == ROUTE_MKL:
        _gemm_blas_jit(z, w, b, g, ints, scalars)
    elif route == ROUTE_OPENBLAS:
        _gemm_openblas_jit(z, w, b, g, longs, scalars)
    else:
        _gemm_small_jit(z, w, b, g)


_gemm_route_jit = _jit(_gemm_route)


def _cell(g: Any, bias: Any, c: Any, b: int, z: Any, col: int, z_next: Any) -> None:
    # Fused LSTM cell on rows :b. g: [B, 4H] pre-activations (gate order i, f, g, o) still
    # missing the [4H] bias; c: [B, H] updated in place; the new h goes to z[:, col:col + H]
    # (this layer's next step) and, unless z_next has no rows (the top layer), to z_next[:, :H]
    # (the next layer's input). Each row's gates are taken as 1-D views so LLVM sees
    # contiguous, non-overlapping runs and vectorises.
    hidden = c.shape[1]
    ai, af = bias[:hidden], bias[hidden : 2 * hidden]
    ag, ao = bias[2 * hidden : 3 * hidden], bias[3 * hidden :]
    for r in range(b):
        gi, gf = g[r, :hidden], g[r, hidden : 2 * hidden]
        gg, go = g[r, 2 * hidden : 3 * hidden], g[r, 3 * hidden :]
        cr = c[r]
        hr = z[r, col : col + hidden]
        for j in range(hidden):
            i = _sigmoid(gi[j] + ai[j])
            f = _sigmoid(gf[j] + af[j])
            cell_in = _tanh(gg[j] + ag[j])
            o = _sigmoid(go[j] + ao[j])
            c_new = f * cr[j] + i * cell_in
            cr[j] = c_new
            hr[j] = o * _tanh(c_new)
        if z_next.shape[0] > 0:
            for j in range(hidden):
                z_next[r, j] = hr[j]


_cell_jit = _jit(_cell)


def _output_layer(
    z_top: Any,
    col: int,
    w_out_t: Any,
    b_out: Any,
    b: int,
    lanes: Any,
    sums: Any,
    out: Any,
    z0: Any,
) -> None:
    # p = tanh(h_top @ w_out + b_out) for rows :b, h_top = z_top[:, col:col + H]; written to
    # out[:b] and fed back into z0[:, :2], the next step's input. Each dot product is summed in
    # 16 independent lanes ([2, 16] scratch) so that it vectorises; the lanes of every row go to
    # sums ([2, 17, B] scratch), where they are added up in lane order and squashed across the
    # rows at once (contiguous runs over r), rather than as one dependent chain of adds and a
    # scalar tanh per row.
    hidden = w_out_t.shape[1]
    # the lane count is read from the scratch, not written as a constant: a loop of unknown
    # length goes to LLVM's loop vectoriser, which checks for overlap at run time, where a
    # constant 16 is unrolled first and then left scalar (lanes might alias h_top)
    n_lanes = lanes.shape[1]
    l0, l1 = lanes[0], lanes[1]
    w0, w1 = w_out_t[0], w_out_t[1]
    for r in range(b):
        h_top = z_top[r, col : col + hidden]
        for q in range(n_lanes):
            l0[q] = 0
            l1[q] = 0
        k0 = 0
        while k0 + n_lanes <= hidden:
            hk, w0k, w1k = h_top[k0 : k0 + n_lanes], w0[k0 : k0 + n_lanes], w1[k0 : k0 + n_lanes]
            for q in range(n_lanes):
                l0[q] += hk[q] * w0k[q]
                l1[q] += hk[q] * w1k[q]
            k0 += n_lanes
        for q in range(hidden - k0):
            l0[q] += h_top[k0 + q] * w0[k0 + q]
            l1[q] += h_top[k0 + q] * w1[k0 + q]
        for q in range(n_lanes):
            sums[0, q, r] = l0[q]
            sums[1, q, r] = l1[q]
    for d in range(2):
        acc = sums[d, 16]
        for r in range(b):
            acc[r] = b_out[d]
        for q in range(16):
            lane = sums[d, q]
            for r in range(b):
                acc[r] += lane[r]
        for r in range(b):
            acc[r] = _tanh(acc[r])
    for r in range(b):
        for d in range(2):
            out[r, d] = sums[d, 16, r]
            z0[r, d] = sums[d, 16, r]


_output_layer_jit = _jit(_output_layer)


def _rollout_loop(
    u: Any,  # [N, I]: packed inputs
    batch_sizes: Any,  # [T] int64, non-increasing
    w0: Any,  # [2 + H + I, 4H]: layer 0's rows for (p, h_0, u)
    w_up: Any,  # [L - 1, 2H, 4H]: layer l's rows for (h_{l-1}, h_l)
    bias: Any,  # [L, 4H]
    w_out_t: Any,  # [2, H]
    b_out: Any,  # [2]
    z0: Any,  # [B, 2 + H + I] state in/out: (p, h_0), then this step's inputs
    z_up: Any,  # [L - 1, B, 2H] state in/out: (h_{l-1}, h_l)
    c: Any,  # [L, B, H] state in/out
    out: Any,  # [N, 2] positions
    routes: Any,  # [L, B + 1] int8: each layer's route (ROUTE_*) at each number of active rows
    packed: Any,  # [L, S] uint8: the weights as _pack_weights lays them out, or [L, 0]: unpacked
) -> None:
    hidden = c.shape[2]
    n_up = z_up.shape[0]
    u_col, n_in = 2 + hidden, u.shape[1]
    g = np.empty((z0.shape[0], 4 * hidden), dtype=z0.dtype)
    no_rows = np.empty((0, 2 * hidden), dtype=z0.dtype)
    lanes = np.zeros((2, 16), dtype=z0.dtype)
    sums = np.zeros((2, 17, z0.shape[0]), dtype=z0.dtype)
    ints = np.zeros(8, dtype=np.int32)
    longs = np.zeros(9, dtype=np.int64)
    scalars = np.zeros(2, dtype=z0.dtype)
    off = 0
    for t in range(batch_sizes.shape[0]):
        b = batch_sizes[t]
        for r in range(b):
            for k in range(n_in):
                z0[r, u_col + k] = u[off + r, k]
        for layer in range(n_up + 1):
            z = z0 if layer == 0 else z_up[layer - 1]
            w = w0 if layer == 0 else w_up[layer - 1]
            _gemm_route_jit(routes[layer, b], z, w, packed[layer], b, g, ints, longs, scalars)
            z_next = z_up[layer] if layer < n_up else no_rows
            _cell_jit(g, bias[layer], c[layer], b, z, 2 if layer == 0 else hidden, z_next)
        z_top = z_up[n_up - 1] if n_up else z0
        _output_layer_jit(
            z_top, hidden if n_up else 2, w_out_t, b_out, b, lanes, sums, out[off:], z0
        )
        off += b


_rollout_loop_jit = _jit(_rollout_loop)


_State = tuple[Tensor | None, Tensor | None, Tensor | None]
_WEIGHTS_SHAPE = "expected one bias per layer and 2-D packed inputs"


def _check_each(want: list[tuple[str, Tensor | None, tuple[int, ...]]]) -> None:
    for name, t, shape in want:
        if t is not None and tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")


def _check_input(u: Tensor) -> None:
    if u.dim() != 2:
        raise ValueError(_WEIGHTS_SHAPE)
    if u.device.type != "cpu":
        raise ValueError(f"the numba rollout runs on CPU tensors, got {u.device}")
    if u.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"the numba rollout takes float32 or float64, got {u.dtype}")


def _check_weights(
    w_cat: Sequence[Tensor], bias: Sequence[Tensor], w_out: Tensor, b_out: Tensor, num_inputs: int
) -> None:
    # The compiled loop does not check bounds: a wrong shape must not reach it.
    num_layers, hidden = len(w_cat), w_cat[0].shape[1] // 4
    _check_each(
        [
            ("w_cat[0]", w_cat[0], (2 + hidden + num_inputs, 4 * hidden)),
            *((f"w_cat[{i}]", w, (2 * hidden, 4 * hidden)) for i, w in enumerate(w_cat[1:], 1)),
            *((f"bias[{i}]", b, (4 * hidden,)) for i, b in enumerate(bias)),
            ("w_out", w_out, (hidden, 2)),
            ("b_out", b_out, (2,)),
        ]
    )
    if len(bias) != num_layers or hidden < 1:
        raise ValueError(_WEIGHTS_SHAPE)


def _check_call(u: Tensor, batch_sizes: list[int], weights: LoopWeights, state: _State) -> None:
    """What a call brings beside the weights: the inputs' width, the state, the batch sizes."""
    layers, hidden, num_inputs = weights.num_layers, weights.hidden, weights.num_inputs
    if u.shape[1] != num_inputs:  # the weights were checked for this width
        want = [2 + hidden + u.shape[1], 4 * hidden]
        raise ValueError(f"w_cat[0] must have shape {want}, got {list(weights.w0.shape)}")
    b_max = batch_sizes[0] if batch_sizes else 0
    _check_each(
        [
            ("h0", state[0], (layers, b_max, hidden)),
            ("c0", state[1], (layers, b_max, hidden)),
            ("p0", state[2], (b_max, 2)),
        ]
    )
    if not batch_sizes or sum(batch_sizes) != u.shape[0] or batch_sizes[-1] < 1:
        raise ValueError(f"batch_sizes must be positive and sum to {u.shape[0]} rows")
    if any(a < b for a, b in itertools.pairwise(batch_sizes)):
        raise ValueError("batch_sizes must be non-increasing")


def route_table(
    num_layers: int,
    b_max: int,
    gemm_from: int | None = None,
    routes: np.ndarray[Any, Any] | None = None,
) -> np.ndarray[Any, Any]:
    """``[L, b_max + 1]`` int8, the loop's route for each layer at each number of active rows:
    ``routes`` (a plan from :func:`plan_routes`) where given, MKL beyond its widths; else the
    hand-written loop below ``gemm_from`` rows (``GEMM_FROM`` where None; 0 is taken as 1)
    and MKL from there on."""
    table = np.full((num_layers, b_max + 1), ROUTE_MKL, dtype=np.int8)
    if routes is not None:
        if gemm_from is not None:
            raise ValueError("give routes or gemm_from, not both")
        if routes.ndim != 2 or routes.shape[0] != num_layers:
            raise ValueError(f"routes must have shape [{num_layers}, W + 1], got {routes.shape}")
        width = min(routes.shape[1], b_max + 1)
        table[:, :width] = routes[:, :width]
        if table.min() < ROUTE_LOOP or table.max() > ROUTE_OPENBLAS:
            raise ValueError(f"routes must hold only {', '.join(ROUTE_NAMES)} (0, 1, 2)")
        if _OPENBLAS is None and table.max() == ROUTE_OPENBLAS:
            raise ValueError("this numpy bundles no OpenBLAS: no openblas route")
        return table
    first_blas = GEMM_FROM if gemm_from is None else max(gemm_from, 1)
    table[:, : min(first_blas, b_max + 1)] = ROUTE_LOOP
    return table


@contextlib.contextmanager
def _one_openblas_thread(table: np.ndarray[Any, Any]) -> Iterator[None]:
    # OpenBLAS splits a gemv of this size over every core by default: one thread, as MKL's
    # follow torch's; set for the calling thread only, and put back
    if _OPENBLAS is None or table.max() < ROUTE_OPENBLAS:
        yield
        return
    before = _OPENBLAS_THREADS(1)
    try:
        yield
    finally:
        _OPENBLAS_THREADS(before)


@dataclasses.dataclass(frozen=True)
class LoopWeights:
    """Fused weights (as :func:`rollout_packed_numba` takes them) in the compiled loop's layout
    and dtype, their shapes checked; what :class:`NumbaRollout` keeps between a model's calls."""

    w0: np.ndarray[Any, Any]  # [2 + H + I, 4H]: layer 0's rows for (p, h_0, u)
    w_up: np.ndarray[Any, Any]  # [L - 1, 2H, 4H]: layer l's rows for (h_{l-1}, h_l)
    bias: np.ndarray[Any, Any]  # [L, 4H]
    w_out_t: np.ndarray[Any, Any]  # [2, H]
    b_out: np.ndarray[Any, Any]  # [2]

    @property
    def num_layers(self) -> int:
        return int(self.bias.shape[0])

    @property
    def hidden(self) -> int:
        return int(self.bias.shape[1]) // 4

    @property
    def num_inputs(self) -> int:
        return int(self.w0.shape[0]) - 2 - self.hidden


def _as_array(t: Tensor, dtype: torch.dtype) -> np.ndarray[Any, Any]:
    return t.detach().to(dtype).contiguous().numpy()


def loop_weights(
    w_cat: Sequence[Tensor],
    bias: Sequence[Tensor],
    w_out: Tensor,
    b_out: Tensor,
    dtype: torch.dtype,
    num_inputs: int,
) -> LoopWeights:
    """The weights in the loop's layout for inputs of ``num_inputs`` features (checked here)."""
    _check_weights(w_cat, bias, w_out, b_out, num_inputs)
    w0 = _as_array(w_cat[0], dtype)
    if len(w_cat) > 1:
        w_up = _as_array(torch.stack(list(w_cat[1:])), dtype)
    else:
        w_up = np.zeros((0, w0.shape[1] // 2, w0.shape[1]), dtype=w0.dtype)
    return LoopWeights(
        w0,
        w_up,
        _as_array(torch.stack(list(bias)), dtype),
        _as_array(w_out.t(), dtype),
        _as_array(b_out, dtype),
    )


def _mkl_widths(table: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """``[b_max + 1]`` bool: at which numbers of active rows some layer runs on MKL."""
    mkl: np.ndarray[Any, Any] = (table == ROUTE_MKL).any(axis=0)
    return mkl


def _worth_packing(weights: LoopWeights, mkl_steps: int) -> bool:
    # MKL packs float32 only; packing pays for itself over PACK_FROM_STEPS steps on MKL
    is_float32 = weights.w0.dtype == np.float32
    return is_float32 and _MKL_PACK is not None and mkl_steps >= PACK_FROM_STEPS


def _packed_weights(weights: LoopWeights, n_rows: int) -> np.ndarray[Any, Any]:
    return _pack_weights([weights.w0, *weights.w_up], n_rows)


def _unpacked(num_layers: int) -> np.ndarray[Any, Any]:
    """``[L, 0]`` bytes: the loop's sign that it multiplies by the plain weights."""
    return np.zeros((num_layers, 0), dtype=np.uint8)


def loop_arguments(
    u: Tensor,
    sizes: np.ndarray[Any, Any],
    weights: LoopWeights,
    state: _State,
    table: np.ndarray[Any, Any],
    packed: np.ndarray[Any, Any],
) -> dict[str, Any]:
    """The compiled loop's arguments, by its parameters' names and in their order: the weights
    in the loop's layout and new state buffers, which the loop updates in place."""
    h0, c0, p0 = state
    dtype = weights.w0.dtype
    num_layers, hidden, b_max = weights.num_layers, weights.hidden, int(sizes[0])
    # the state buffers, laid out as each layer's GEMM reads them (see the module docstring)
    z0 = np.zeros((b_max, 2 + hidden + u.shape[1]), dtype=dtype)
    z_up = np.zeros((num_layers - 1, b_max, 2 * hidden), dtype=dtype)
    if c0 is None:
        c = np.zeros((num_layers, b_max, hidden), dtype=dtype)
    else:
        c = _as_array(c0, u.dtype).copy()
    if p0 is not None:
        z0[:, :2] = _as_array(p0, u.dtype)
    if h0 is not None:
        h = _as_array(h0, u.dtype)
        z0[:, 2 : 2 + hidden] = h[0]
        # layer l reads [h_{l-1} | h_l], but its h_{l-1} half is written by layer l - 1 in the
        # same step before layer l reads it (every row is active at the first step): only h_l
        for layer in range(1, num_layers):
            z_up[layer - 1, :, hidden:] = h[layer]
    return {
        "u": u.detach().contiguous().numpy(),
        "batch_sizes": sizes,
        "w0": weights.w0,
        "w_up": weights.w_up,
        "bias": weights.bias,
        "w_out_t": weights.w_out_t,
        "b_out": weights.b_out,
        "z0": z0,
        "z_up": z_up,
        "c": c,
        "out": np.empty((u.shape[0], 2), dtype=dtype),
        "routes": table,
        "packed": packed,
    }


def _run_loop(args: dict[str, Any]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Run the compiled loop on ``args``; the positions and each sequence's final state."""
    with _one_openblas_thread(args["routes"]):
        _rollout_loop_jit(*args.values())
    z0, z_up, c, out = args["z0"], args["z_up"], args["c"], args["out"]
    num_layers, b_max, hidden = c.shape
    h_t = np.empty((num_layers, b_max, hidden), dtype=c.dtype)
    h_t[0] = z0[:, 2 : 2 + hidden]
    for layer in range(1, num_layers):
        h_t[layer] = z_up[layer - 1, :, hidden:]
    p_t = np.ascontiguousarray(z0[:, :2])
    return (
        torch.from_numpy(out),
        torch.from_numpy(h_t),
        torch.from_numpy(c),
        torch.from_numpy(p_t),
    )


def rollout_packed_numba(
    u: Tensor,  # [N, num_inputs]: packed rows, time-major, longest sequence first
    batch_sizes: list[int],  # [T]: active sequences per step, non-increasing
    w_cat: list[Tensor],  # per layer: [in + H, 4H]; rows (x, h_l), layer 0: (p, h_0, u)
    bias: list[Tensor],  # per layer: [4H] = b_ih + b_hh
    w_out: Tensor,  # [H, 2]
    b_out: Tensor,  # [2]
    h0: Tensor | None = None,  # [L, B, H] initial h, packed (sorted) order; None: zeros
    c0: Tensor | None = None,  # [L, B, H] initial c; None: zeros
    p0: Tensor | None = None,  # [B, 2] position fed back at the first step; None: zeros
    *,
    gemm_from: int | None = None,  # MKL from this many active rows on; None: GEMM_FROM
    routes: np.ndarray[Any, Any] | None = None,  # [L, W + 1] from plan_routes; or gemm_from
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`rnnserve.models.traveller.rollout_packed` as one compiled CPU loop (float32 or
    float64).

    Returns the ``[N, 2]`` packed positions and the final state ``(h_T, c_T, p_T)``, each
    sequence's state after its own last step. CPU tensors only; not differentiable. The weights
    are rearranged into the loop's layout on every call; :class:`NumbaRollout` keeps them.
    """
    _check_input(u)
    weights = loop_weights(w_cat, bias, w_out, b_out, u.dtype, u.shape[1])
    prepared = _Prepared((), (), weights, {}, {})  # for this call only
    state = (h0, c0, p0)
    _check_call(u, batch_sizes, weights, state)
    table = route_table(weights.num_layers, batch_sizes[0], gemm_from, routes)
    return _roll(u, batch_sizes, prepared, state, table, _mkl_widths(table))


def _roll(
    u: Tensor,
    batch_sizes: list[int],
    prepared: _Prepared,
    state: _State,
    table: np.ndarray[Any, Any],
    mkl_widths: np.ndarray[Any, Any],
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """A checked call on prepared weights: packed for MKL where that pays, then the loop."""
    weights = prepared.weights
    sizes = np.asarray(batch_sizes, dtype=np.int64)
    packed = _unpacked(weights.num_layers)
    if _worth_packing(weights, int(mkl_widths[sizes].sum())):
        packed = _packed_for(prepared, batch_sizes[0])
    return _run_loop(loop_arguments(u, sizes, weights, state, table, packed))


# a NumbaRollout keeps MKL's packed weights for this many batch widths (the newest)
PACKED_WIDTHS_KEPT = 8


@dataclasses.dataclass(eq=False)
class _Prepared:
    """One model's weights in the loop's layout, the tensors they were made from (and their
    versions), and what is derived from them per batch width: route tables, MKL's packing."""

    sources: tuple[Tensor, ...]
    versions: tuple[int, ...]
    weights: LoopWeights
    # replaced whole, never changed in place: a call on another thread sees an old dict or a
    # new one, and at worst builds again what it finds missing
    tables: dict[int, tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]]
    packed: dict[int, np.ndarray[Any, Any]]

    def made_from(self, sources: tuple[Tensor, ...], versions: tuple[int, ...]) -> bool:
        same = len(self.sources) == len(sources) and self.versions == versions
        return same and all(a is b for a, b in zip(self.sources, sources, strict=True))


class NumbaRollout:
    """:func:`rollout_packed_numba` bound to one model, as :meth:`Traveller.compile_rollout`
    sets it: the GEMM ``routes`` of a plan (None: the fixed routes) for calls in ``dtype``, and
    the model's weights in the loop's layout (and MKL's packing of them), made on the first call
    and kept while the same weight tensors come back unchanged (the Traveller hands every call
    the same fused tensors until a parameter changes; an in-place change bumps a tensor's version
    counter). Calls in another dtype, or with their own ``gemm_from`` or ``routes``, run the
    plain function."""

    def __init__(
        self, routes: np.ndarray[Any, Any] | None = None, dtype: torch.dtype = torch.float32
    ) -> None:
        self.routes = routes
        self.dtype = dtype
        # replaced whole when the weights change, with everything derived from them, so that a
        # call never pairs new weights with packing made from old ones
        self._prepared: _Prepared | None = None

    def __call__(
        self,
        u: Tensor,
        batch_sizes: list[int],
        w_cat: list[Tensor],
        bias: list[Tensor],
        w_out: Tensor,
        b_out: Tensor,
        h0: Tensor | None = None,
        c0: Tensor | None = None,
        p0: Tensor | None = None,
        **options: Any,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        args = (u, batch_sizes, w_cat, bias, w_out, b_out, h0, c0, p0)
        if options or u.dtype != self.dtype:  # its own routes or gemm_from, or another dtype
            return rollout_packed_numba(*args, **options)
        _check_input(u)
        prepared = self._prepare(u, w_cat, bias, w_out, b_out)
        state = (h0, c0, p0)
        _check_call(u, batch_sizes, prepared.weights, state)
        table, mkl_widths = self._table(prepared, batch_sizes[0])
        return _roll(u, batch_sizes, prepared, state, table, mkl_widths)

    def _prepare(
        self, u: Tensor, w_cat: list[Tensor], bias: list[Tensor], w_out: Tensor, b_out: Tensor
    ) -> _Prepared:
        sources = (*w_cat, *bias, w_out, b_out)
        try:
            versions = tuple(t._version for t in sources)
        except RuntimeError:  # inference tensors (made under inference_mode) have no version
            versions = ()
        kept = self._prepared
        if kept is not None and kept.made_from(sources, versions):
            return kept
        weights = loop_weights(w_cat, bias, w_out, b_out, u.dtype, u.shape[1])
        prepared = _Prepared(sources, versions, weights, {}, {})
        if versions:  # kept only where a change would show
            self._prepared = prepared
        return prepared

    def _table(
        self, prepared: _Prepared, b_max: int
    ) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
        """The route table for ``b_max`` rows, and at which widths some layer runs on MKL."""
        kept = prepared.tables.get(b_max)
        if kept is None:
            table = route_table(prepared.weights.num_layers, b_max, routes=self.routes)
            kept = (table, _mkl_widths(table))
            prepared.tables = {**prepared.tables, b_max: kept}
        return kept

    def __repr__(self) -> str:
        routes = "fixed routes" if self.routes is None else describe_routes(self.routes)
        return f"NumbaRollout({routes}, {self.dtype})"


def _packed_for(prepared: _Prepared, b_max: int) -> np.ndarray[Any, Any]:
    """MKL's packing of the prepared weights for ``b_max`` rows, kept for the newest
    ``PACKED_WIDTHS_KEPT`` widths."""
    packed = prepared.packed.get(b_max)
    if packed is None:
        packed = _packed_weights(prepared.weights, b_max)
        newest = list(prepared.packed.items())[1 - PACKED_WIDTHS_KEPT :]
        prepared.packed = {**dict(newest), b_max: packed}
    return packed


def compile_for(dtype: torch.dtype) -> None:
    """JIT-compile the loop for ``dtype`` now (a few seconds, once per process and dtype).

    One compilation serves every batch size, length and model size of that dtype, so calling
    this at load time keeps the first request from paying for it.
    """
    hidden, num_inputs = 4, 1
    w_cat = [
        torch.zeros(2 + hidden + num_inputs, 4 * hidden, dtype=dtype),
        torch.zeros(2 * hidden, 4 * hidden, dtype=dtype),
    ]
    bias = [torch.zeros(4 * hidden, dtype=dtype)] * 2
    u = torch.zeros(3, num_inputs, dtype=dtype)
    w_out = torch.zeros(hidden, 2, dtype=dtype)
    rollout_packed_numba(u, [2, 1], w_cat, bias, w_out, torch.zeros(2, dtype=dtype))


# ---------------------------------------------------------------------------- the plan


def _repeat_route(
    route: int, z: Any, w: Any, packed: Any, b: int, g: Any, ints: Any, longs: Any, scalars: Any,
    n: int,
) -> None:  # fmt: skip
    for _ in range(n):
        _gemm_route_jit(route, z, w, packed, b, g, ints, longs, scalars)


_repeat_route_jit = _jit(_repeat_route)

# a timed sample lasts at least this long; a route's time is the fastest of _SAMPLES samples,
# the routes' samples taken in turns so that a burst of other work falls on all of them alike
_SAMPLE_S = 2e-4
_SAMPLES = 3


def _sample(fn: Any, n: int) -> float:
    start = time.perf_counter()
    fn(n)
    return time.perf_counter() - start


def _calls_per_sample(fn: Any) -> int:
    fn(1)  # compiled, caches warm
    n = 1
    while _sample(fn, n) < _SAMPLE_S:
        n *= 2
    return n


def _fastest_seconds_per_call(fns: dict[int, Any]) -> dict[int, float]:
    calls = {key: _calls_per_sample(fn) for key, fn in fns.items()}
    best = dict.fromkeys(fns, np.inf)
    for _ in range(_SAMPLES):
        for key, fn in fns.items():
            best[key] = min(best[key], _sample(fn, calls[key]) / calls[key])
    return best


def _available_routes() -> tuple[int, ...]:
    blas = (ROUTE_MKL,) if BLAS != "none" else ()
    return (ROUTE_LOOP, *blas, *((ROUTE_OPENBLAS,) if _OPENBLAS is not None else ()))


def measure_routes(
    dims: Sequence[tuple[int, int]], dtype: torch.dtype, widths: int = PLAN_WIDTHS
) -> np.ndarray[Any, Any]:
    """``[3, L, widths + 1]`` seconds per call of each route's GEMM (``ROUTE_*`` order) for each
    layer's ``[K, 4H]`` weights at 1..``widths`` active rows (column 0 unused), measured now on
    this thread; ``inf`` for a route this build lacks. MKL is timed as a long rollout runs it:
    on packed weights where this build packs float32 ones."""
    np_dtype = np.float32 if dtype == torch.float32 else np.float64
    times = np.full((len(ROUTE_NAMES), len(dims), widths + 1), np.inf)
    rng = np.random.default_rng(0)
    ints, longs, scalars = np.zeros(8, np.int32), np.zeros(9, np.int64), np.zeros(2, np_dtype)
    measured: dict[tuple[int, int], np.ndarray[Any, Any]] = {}
    with _one_openblas_thread(np.array([ROUTE_OPENBLAS])):
        for layer, (k, n_out) in enumerate(dims):
            if (k, n_out) in measured:  # layers of one shape share one measurement
                times[:, layer] = measured[k, n_out]
                continue
            w = (rng.standard_normal((k, n_out)) / np.sqrt(k)).astype(np_dtype)
            z = (rng.standard_normal((widths, k)) * 0.5).astype(np_dtype)
            g = np.zeros((widths, n_out), np_dtype)
            if np_dtype == np.float32 and _MKL_PACK is not None:
                packed = _pack_weights([w], widths)[0]
            else:
                packed = np.zeros(0, np.uint8)
            for b in range(1, widths + 1):
                fns = {  # route as int8, the type the loop passes, so nothing new compiles
                    route: functools.partial(
                        _repeat_route_jit, np.int8(route), z, w, packed, b, g, ints, longs, scalars
                    )
                    for route in _available_routes()
                }
                for route, seconds in _fastest_seconds_per_call(fns).items():
                    times[route, layer, b] = seconds
            measured[k, n_out] = times[:, layer]
    return times


def fastest_routes(times: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """``[L, W + 1]`` int8 routes from :func:`measure_routes`' ``[3, L, W + 1]`` seconds: at each
    layer and width the unplanned route (see :func:`route_table`), unless another is at least
    ``1 / PLAN_MARGIN`` times faster, then the fastest. Routes within a few percent of each
    other trade places from one measurement to the next; the margin keeps such widths on the
    unplanned route, so a plan holds only the differences that are real."""
    n_layers, n_widths = times.shape[1:]
    routes = route_table(n_layers, n_widths - 1)
    for layer in range(n_layers):
        for b in range(1, n_widths):
            default = times[routes[layer, b], layer, b]
            best = int(np.argmin(times[:, layer, b]))
            if times[best, layer, b] < PLAN_MARGIN * default:
                routes[layer, b] = best
    return routes


@functools.lru_cache(maxsize=64)
def _plan(
    dims: tuple[tuple[int, int], ...], dtype: torch.dtype, widths: int
) -> np.ndarray[Any, Any]:
    routes = fastest_routes(measure_routes(dims, dtype, widths))
    routes.flags.writeable = False  # shared by every model of these shapes
    return routes


def plan_routes(
    w_cat: Sequence[Tensor], dtype: torch.dtype = torch.float32, widths: int = PLAN_WIDTHS
) -> np.ndarray[Any, Any]:
    """The fastest route of each layer of these fused weights (as :func:`rollout_packed_numba`
    takes them) at each width up to ``widths`` rows on this machine: ``[L, widths + 1]`` int8,
    measured once per process for each set of layer shapes, dtype and ``widths``."""
    dims = tuple((int(w.shape[0]), int(w.shape[1])) for w in w_cat)
    return _plan(dims, dtype, widths)


def describe_routes(routes: np.ndarray[Any, Any]) -> str:
    """A plan in a line: each layer's routes as runs of widths, the last open-ended (MKL takes
    every width past the plan's), e.g. ``"layer 0: loop 1, openblas 2-12, mkl 13-"``."""
    layers = []
    for layer, row in enumerate(routes):
        runs, first = [], 1
        # widths 1..W as planned, then one more on MKL: the open-ended run past the plan
        for route, group in itertools.groupby([*row[1:].tolist(), ROUTE_MKL]):
            last = first + len(list(group)) - 1
            if last == len(row):
                widths = f"{first}-"
            elif last > first:
                widths = f"{first}-{last}"
            else:
                widths = f"{first}"
            runs.append(f"{ROUTE_NAMES[route]} {widths}")
            first = last + 1
        layers.append(f"layer {layer}: " + ", ".join(runs))
    return "; ".join(layers)
