"""JAX baselines for ``bench.bench_models``: the same two models, written the way JAX wants them.

JAX is an optional ``bench`` extra (``pip install '.[bench]'``); nothing in ``models`` or
``service`` imports this module. Every function takes a *padded, time-major* batch -- ``[T, B, C]``
plus a ``[T, B]`` mask that is true at real steps -- because that is the layout ``lax.scan``
walks. Outputs at padded steps are zeroed, so padding never shows in a result; the recursions are
causal, so padded steps never change a real step's output either.

- :func:`smoother_scan`: the smoother's EMA + ``tanh(wx * s)`` as one ``lax.scan`` over time;
- :func:`smoother_associative_scan`: the same recursion as ``lax.associative_scan`` over
  ``(a, b)`` pairs (``s_t = a_t * s_{t-1} + b_t``; combine ``(a1 * a2, a2 * b1 + b2)``), with
  ``(a_0, b_0) = (0, x_0)`` so that ``s_0 = x_0``;
- :func:`traveller_rollout_scan`: the Traveller's autoregressive rollout as one ``lax.scan``, the
  math of ``rnnserve.models.traveller.rollout_packed``: ``z_t = concat(p_{t-1}, u_t)``, LSTM layers
  with PyTorch's gate order ``i, f, g, o``, ``p_t = tanh(W_out h_top + b_out)``; layer 0's
  projection of ``u`` is one GEMM over all steps up front, so each step costs one GEMM per layer.

Every matrix product asks for ``Precision.HIGHEST``: full fp32, as the PyTorch rows run (on GPUs
JAX's default would use TF32 and differ from fp32 by ~1e-3).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from bench.padding import padded_time_major, unpad_time_major

__all__ = [
    "compile_for",
    "device_for",
    "measure_main",
    "padded_time_major",
    "smoother_associative_scan",
    "smoother_scan",
    "traveller_rollout_scan",
    "traveller_weights",
    "unpad_time_major",
]

HIGHEST = lax.Precision.HIGHEST


# --------------------------------------------------------------------------- smoother


def smoother_scan(x: jax.Array, mask: jax.Array, alpha: jax.Array, wx: jax.Array) -> jax.Array:
    """``tanh(wx * s)`` with ``s`` the EMA of ``x`` [T, B, F] along time, by ``lax.scan``."""

    def step(s: jax.Array, x_t: jax.Array) -> tuple[jax.Array, jax.Array]:
        s = alpha * s + (1 - alpha) * x_t
        return s, jnp.tanh(wx * s)

    # starting from s_{-1} = x_0 gives s_0 = alpha * x_0 + (1 - alpha) * x_0 = x_0
    _, y = lax.scan(step, x[0], x)
    return jnp.where(mask[..., None], y, 0)


def _combine(
    left: tuple[jax.Array, jax.Array], right: tuple[jax.Array, jax.Array]
) -> tuple[jax.Array, jax.Array]:
    a1, b1 = left
    a2, b2 = right
    return a1 * a2, a2 * b1 + b2


def smoother_associative_scan(
    x: jax.Array, mask: jax.Array, alpha: jax.Array, wx: jax.Array
) -> jax.Array:
    """The same as :func:`smoother_scan`, as a parallel scan over ``(a, b)`` pairs."""
    first = (jnp.arange(x.shape[0]) == 0)[:, None, None]
    a = jnp.where(first, jnp.zeros_like(x), alpha)  # a_0 = 0: nothing before the first step
    b = jnp.where(first, x, (1 - alpha) * x)
    _, s = lax.associative_scan(_combine, (a, b), axis=0)
    return jnp.where(mask[..., None], jnp.tanh(wx * s), 0)


# --------------------------------------------------------------------------- Traveller


class TravellerWeights(NamedTuple):
    """The Traveller's weights in the fused layout the step uses (a JAX pytree)."""

    w_u: jax.Array  # [num_inputs, 4H]: layer 0's columns for u
    b0: jax.Array  # [4H]: layer 0's b_ih + b_hh
    w_rec0: jax.Array  # [2 + H, 4H]: layer 0's rows for (p_{t-1}, h_0)
    w_cat: tuple[jax.Array, ...]  # layers 1..L-1: [H + H, 4H], rows (x, h_l)
    b: tuple[jax.Array, ...]  # layers 1..L-1: [4H]
    w_out: jax.Array  # [H, 2]
    b_out: jax.Array  # [2]


def traveller_weights(
    w_ih: Sequence[np.ndarray],
    w_hh: Sequence[np.ndarray],
    b_ih: Sequence[np.ndarray],
    b_hh: Sequence[np.ndarray],
    w_out: np.ndarray,
    b_out: np.ndarray,
    device: Any = None,
) -> TravellerWeights:
    """From ``nn.LSTM``'s per-layer ``weight_ih_l*`` [4H, in], ``weight_hh_l*`` [4H, H], biases,
    and the output layer's ``weight`` [2, H] and ``bias`` [2] (layer 0's input is ``(p, u)``)."""
    n_pos = 2
    w0 = np.asarray(w_ih[0])
    put = (lambda a: jax.device_put(a, device)) if device is not None else jnp.asarray
    return TravellerWeights(
        w_u=put(w0[:, n_pos:].T.copy()),
        b0=put(np.asarray(b_ih[0]) + np.asarray(b_hh[0])),
        w_rec0=put(np.concatenate([w0[:, :n_pos], np.asarray(w_hh[0])], 1).T.copy()),
        w_cat=tuple(
            put(np.concatenate([np.asarray(w_ih[k]), np.asarray(w_hh[k])], 1).T.copy())
            for k in range(1, len(w_ih))
        ),
        b=tuple(put(np.asarray(b_ih[k]) + np.asarray(b_hh[k])) for k in range(1, len(w_ih))),
        w_out=put(np.asarray(w_out).T.copy()),
        b_out=put(np.asarray(b_out)),
    )


def _cell(gates: jax.Array, c: jax.Array) -> tuple[jax.Array, jax.Array]:
    i, f, g, o = jnp.split(gates, 4, axis=-1)  # PyTorch's gate order
    c_new = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
    return jax.nn.sigmoid(o) * jnp.tanh(c_new), c_new


def traveller_rollout_scan(u: jax.Array, mask: jax.Array, w: TravellerWeights) -> jax.Array:
    """Positions ``[T, B, 2]`` of the autoregressive rollout of ``u`` ``[T, B, num_inputs]``."""
    num_layers = 1 + len(w.w_cat)
    hidden = w.w_rec0.shape[0] - 2
    batch = u.shape[1]
    gu = jnp.einsum("tbi,ig->tbg", u, w.w_u, precision=HIGHEST) + w.b0  # all steps, one GEMM
    zeros = jnp.zeros((num_layers, batch, hidden), u.dtype)

    def step(
        carry: tuple[jax.Array, jax.Array, jax.Array], gu_t: jax.Array
    ) -> tuple[tuple[jax.Array, jax.Array, jax.Array], jax.Array]:
        h, c, p = carry
        hs, cs = [], []
        x = p
        for layer in range(num_layers):
            if layer == 0:
                z = jnp.concatenate([p, h[0]], 1)
                gates = gu_t + jnp.dot(z, w.w_rec0, precision=HIGHEST)
            else:
                z = jnp.concatenate([x, h[layer]], 1)
                gates = jnp.dot(z, w.w_cat[layer - 1], precision=HIGHEST) + w.b[layer - 1]
            x, c_new = _cell(gates, c[layer])
            hs.append(x)
            cs.append(c_new)
        p = jnp.tanh(jnp.dot(x, w.w_out, precision=HIGHEST) + w.b_out)
        return (jnp.stack(hs), jnp.stack(cs), p), p

    p0 = jnp.zeros((batch, 2), u.dtype)
    _, positions = lax.scan(step, (zeros, zeros, p0), gu)
    return jnp.where(mask[..., None], positions, 0)


# --------------------------------------------------------------------------- compiling


def compile_for(fn: Callable[..., jax.Array], *args: Any) -> tuple[Callable[..., Any], float]:
    """``jax.jit(fn)`` lowered and compiled ahead of time for ``args``; and the seconds it took."""
    start = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    return compiled, time.perf_counter() - start


def device_for(kind: str) -> Any:
    """The first JAX device of ``kind`` ("cpu" or "cuda"); raises RuntimeError if there is none."""
    if kind == "cpu":
        return jax.devices("cpu")[0]
    for name in ("cuda", "gpu"):
        try:
            return jax.devices(name)[0]
        except RuntimeError:
            continue
    raise RuntimeError(
        f"JAX {jax.__version__} has no CUDA backend here (devices: {jax.devices()}); "
        "install jax[cuda12] for the GPU rows"
    )


# --------------------------------------------------------------------------- a process of its own
#
# On CUDA, ``bench.bench_models`` measures these in a process of their own: with JAX and torch on
# one GPU in one process, the H200 run of session 6 died twice of an illegal memory access (at the
# B=1024 rollout, after JAX had run), and the same run without JAX did not. A crash here costs
# its row, not the run.

FUNCTIONS = ("smoother_scan", "smoother_associative_scan", "traveller_rollout_scan")


def _build(fn_name: str, data: Any, device: Any) -> tuple[Callable[[], jax.Array], float]:
    """The compiled call of ``fn_name`` on the inputs in ``data`` (an ``.npz``), and its compile
    seconds. Smoother inputs: ``x``, ``mask``, ``alpha``, ``wx``; the rollout's: ``u``, ``mask``
    and ``w_ih_K``, ``w_hh_K``, ``b_ih_K``, ``b_hh_K`` per layer K, ``w_out``, ``b_out``."""
    if fn_name == "traveller_rollout_scan":
        layers = range(int(data["layers"]))
        w_ih, w_hh, b_ih, b_hh = (
            [data[f"{name}_{k}"] for k in layers] for name in ("w_ih", "w_hh", "b_ih", "b_hh")
        )
        weights = traveller_weights(
            w_ih, w_hh, b_ih, b_hh, data["w_out"], data["b_out"], device=device
        )
        u, mask = (jax.device_put(data[k], device) for k in ("u", "mask"))
        rollout, secs = compile_for(traveller_rollout_scan, u, mask, weights)
        return (lambda: rollout(u, mask, weights)), secs
    args = [jax.device_put(data[k], device) for k in ("x", "mask", "alpha", "wx")]
    smoother, secs = compile_for(globals()[fn_name], *args)
    return (lambda: smoother(*args)), secs


def _clocked(call: Callable[[], jax.Array], number: int) -> float:
    start = time.perf_counter()
    out = None
    for _ in range(number):
        out = call()
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / number


def measure_main(argv: Sequence[str] | None = None) -> int:
    """``python -m bench.jax_baselines FN INPUTS OUT --device D --rounds R --sample-s S``:
    compile FN for the inputs, call it once for its output, then time R samples, each repeating
    the call until it lasts about S seconds; write ``out``, ``samples``, ``number`` and
    ``compile_s`` to OUT (``.npz``)."""
    import argparse

    parser = argparse.ArgumentParser(description="time one JAX baseline in this process")
    parser.add_argument("fn", choices=FUNCTIONS)
    parser.add_argument("inputs")
    parser.add_argument("out")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--sample-s", type=float, default=0.03)
    args = parser.parse_args(argv)
    with np.load(args.inputs) as data:
        call, compile_s = _build(args.fn, data, device_for(args.device))
    out = np.asarray(call())
    once = min(_clocked(call, 1) for _ in range(3))
    number = max(1, min(10_000, int(np.ceil(args.sample_s / max(once, 1e-7)))))
    samples = [_clocked(call, number) for _ in range(args.rounds)]
    np.savez(args.out, out=out, samples=np.asarray(samples), number=number, compile_s=compile_s)
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(measure_main())
