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
- :func:`traveller_rollout`: the Traveller's autoregressive rollout as one ``lax.scan``, the
  math of ``rnnserve.models.traveller.rollout_packed``: layer 0's input is ``(p_{t-1}, u_t)``,
  LSTM layers with PyTorch's gate order ``i, f, g, o``, ``p_t = tanh(W_out h_top + b_out)``;
  layer 0's projection of ``u`` is one GEMM over all steps up front. It is written in several
  ways (:class:`RolloutVariant`: split or concatenated gate products, per-layer or stacked
  state, precision, unroll), all the same function, so that the benchmark can time each and
  compare against the fastest; :func:`traveller_rollout_scan` is the one it keeps on the CPU.

The variants named ``highest`` ask for ``Precision.HIGHEST`` in every matrix product: full fp32,
as the PyTorch rows run (on GPUs JAX's default would use TF32 and differ from fp32 by ~1e-3; on
the CPU the default is fp32 too).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from bench.padding import padded_time_major, unpad_time_major

__all__ = [
    "BEST_CPU",
    "CPU_CANDIDATES",
    "ROLLOUT_VARIANTS",
    "RolloutVariant",
    "compile_for",
    "device_for",
    "measure_main",
    "padded_time_major",
    "rollout_variant_fn",
    "smoother_associative_scan",
    "smoother_scan",
    "traveller_rollout",
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
    """The Traveller's weights in both layouts the variants use (a JAX pytree; a compiled
    variant reads only its own layout's arrays)."""

    w_u: jax.Array  # [num_inputs, 4H]: layer 0's columns for u
    b0: jax.Array  # [4H]: layer 0's b_ih + b_hh
    w_rec0: jax.Array  # concat layout: [2 + H, 4H], layer 0's rows for (p_{t-1}, h_0)
    w_cat: tuple[jax.Array, ...]  # concat layout, layers 1..L-1: [H + H, 4H], rows (x, h_l)
    b: tuple[jax.Array, ...]  # layers 1..L-1: [4H]
    w_out: jax.Array  # [H, 2]
    b_out: jax.Array  # [2]
    w_p0: jax.Array  # split layout: [2, 4H], layer 0's W_ih rows for p_{t-1}
    w_x: tuple[jax.Array, ...]  # split layout, layers 1..L-1: [H, 4H] (W_ih transposed)
    w_h: tuple[jax.Array, ...]  # split layout, every layer: [H, 4H] (W_hh transposed)


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
    layers = range(1, len(w_ih))
    return TravellerWeights(
        w_u=put(w0[:, n_pos:].T.copy()),
        b0=put(np.asarray(b_ih[0]) + np.asarray(b_hh[0])),
        w_rec0=put(np.concatenate([w0[:, :n_pos], np.asarray(w_hh[0])], 1).T.copy()),
        w_cat=tuple(
            put(np.concatenate([np.asarray(w_ih[k]), np.asarray(w_hh[k])], 1).T.copy())
            for k in layers
        ),
        b=tuple(put(np.asarray(b_ih[k]) + np.asarray(b_hh[k])) for k in layers),
        w_out=put(np.asarray(w_out).T.copy()),
        b_out=put(np.asarray(b_out)),
        w_p0=put(w0[:, :n_pos].T.copy()),
        w_x=tuple(put(np.asarray(w_ih[k]).T.copy()) for k in layers),
        w_h=tuple(put(np.asarray(m).T.copy()) for m in w_hh),
    )


class RolloutVariant(NamedTuple):
    """How one ``lax.scan`` rollout is written; every variant computes the same function.

    - ``layout``: ``"split"`` takes a layer's gates as ``x @ W_ih + h @ W_hh``, the two products
      of ``nn.LSTM``'s layout; ``"concat"`` as one product ``[x, h] @ [W_ih; W_hh]``, paying a
      concatenation every step;
    - ``state``: ``"tuple"`` carries one ``[B, H]`` array per layer; ``"stacked"`` carries
      ``[L, B, H]`` arrays, stacked again every step;
    - ``precision``: the matrix products' ``lax.Precision`` (``"highest"``, or ``"default"``,
      which on GPUs may take TF32);
    - ``unroll``: steps per iteration of the compiled loop (``lax.scan``'s ``unroll``).
    """

    layout: str = "split"
    state: str = "tuple"
    precision: str = "highest"
    unroll: int = 1

    @property
    def key(self) -> str:
        """A short name for the command line, e.g. ``split-tuple-highest-u2``."""
        return f"{self.layout}-{self.state}-{self.precision}-u{self.unroll}"

    @property
    def label(self) -> str:
        return (
            f"{self.layout}, {self.state} state, precision {self.precision}, unroll {self.unroll}"
        )

    @classmethod
    def parse(cls, key: str) -> RolloutVariant:
        layout, state, precision, unroll = key.split("-")
        variant = cls(layout, state, precision, int(unroll.removeprefix("u")))
        if variant not in ROLLOUT_VARIANTS:
            raise ValueError(f"no rollout variant {key!r}")
        return variant


# Every combination the sweep (bench/rollout_vs_jax.py) tries.
ROLLOUT_VARIANTS = tuple(
    RolloutVariant(layout, state, precision, unroll)
    for layout in ("split", "concat")
    for state in ("tuple", "stacked")
    for precision in ("highest", "default")
    for unroll in (1, 2, 4)
)
# The first rollout baseline: one concatenation and one stack a step.
CONCAT_STACKED = RolloutVariant("concat", "stacked", "highest", 1)
# What traveller_rollout_scan runs: on the 2-core AMD EPYC the sweep (bench/rollout_vs_jax.py,
# figures in docs/BENCHMARKS.md) found the first baseline among the fastest at both shapes.
# bench.bench_models times CPU_CANDIDATES and keeps the fastest.
BEST_CPU = CONCAT_STACKED
CPU_CANDIDATES = (
    *(BEST_CPU._replace(unroll=n) for n in (1, 2, 4)),
    RolloutVariant("split", "stacked", "highest", 1),
    RolloutVariant("split", "tuple", "highest", 1),
)

_PRECISIONS = {"highest": HIGHEST, "default": lax.Precision.DEFAULT}


def _cell(gates: jax.Array, c: jax.Array) -> tuple[jax.Array, jax.Array]:
    i, f, g, o = jnp.split(gates, 4, axis=-1)  # PyTorch's gate order
    c_new = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
    return jax.nn.sigmoid(o) * jnp.tanh(c_new), c_new


def _layer_gates(
    w: TravellerWeights,
    variant: RolloutVariant,
    layer: int,
    x: jax.Array,
    h: jax.Array,
    gu_t: jax.Array,
) -> jax.Array:
    """A layer's pre-activations from its input ``x`` (``p`` at layer 0) and its own ``h``."""
    precision = _PRECISIONS[variant.precision]
    if variant.layout == "concat":
        z = jnp.concatenate([x, h], 1)
        if layer == 0:
            return gu_t + jnp.dot(z, w.w_rec0, precision=precision)
        return jnp.dot(z, w.w_cat[layer - 1], precision=precision) + w.b[layer - 1]
    from_h = jnp.dot(h, w.w_h[layer], precision=precision)
    if layer == 0:
        return gu_t + jnp.dot(x, w.w_p0, precision=precision) + from_h
    return jnp.dot(x, w.w_x[layer - 1], precision=precision) + from_h + w.b[layer - 1]


def traveller_rollout(
    u: jax.Array, mask: jax.Array, w: TravellerWeights, variant: RolloutVariant = BEST_CPU
) -> jax.Array:
    """Positions ``[T, B, 2]`` of the autoregressive rollout of ``u`` ``[T, B, num_inputs]``,
    written as ``variant`` says (static: bind it before ``jax.jit``)."""
    num_layers = 1 + len(w.w_cat)
    hidden = w.w_rec0.shape[0] - 2
    batch = u.shape[1]
    precision = _PRECISIONS[variant.precision]
    gu = jnp.einsum("tbi,ig->tbg", u, w.w_u, precision=precision) + w.b0  # all steps, one GEMM
    zeros = jnp.zeros((batch, hidden), u.dtype)

    def step(carry: Any, gu_t: jax.Array) -> tuple[Any, jax.Array]:
        h, c, p = carry
        hs, cs = [], []
        x = p
        for layer in range(num_layers):
            x, c_new = _cell(_layer_gates(w, variant, layer, x, h[layer], gu_t), c[layer])
            hs.append(x)
            cs.append(c_new)
        p = jnp.tanh(jnp.dot(x, w.w_out, precision=precision) + w.b_out)
        if variant.state == "stacked":
            return (jnp.stack(hs), jnp.stack(cs), p), p
        return (tuple(hs), tuple(cs), p), p

    if variant.state == "stacked":
        state: Any = (jnp.stack([zeros] * num_layers),) * 2
    else:
        state = ((zeros,) * num_layers,) * 2
    p0 = jnp.zeros((batch, 2), u.dtype)
    _, positions = lax.scan(step, (*state, p0), gu, unroll=variant.unroll)
    return jnp.where(mask[..., None], positions, 0)


def traveller_rollout_scan(u: jax.Array, mask: jax.Array, w: TravellerWeights) -> jax.Array:
    """:func:`traveller_rollout` as :data:`BEST_CPU` writes it."""
    return traveller_rollout(u, mask, w, BEST_CPU)


def rollout_variant_fn(variant: RolloutVariant) -> Callable[..., jax.Array]:
    """``(u, mask, w) -> positions`` for ``variant``, ready for :func:`compile_for`."""
    return functools.partial(traveller_rollout, variant=variant)


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
# one GPU in one process, an H200 run died twice of an illegal memory access (at the B=1024
# rollout, after JAX had run), and the same run without JAX did not. A crash here costs its row,
# not the run.

FUNCTIONS = ("smoother_scan", "smoother_associative_scan", "traveller_rollout_scan")


def _build(
    fn_name: str, data: Any, device: Any, variant: RolloutVariant = BEST_CPU
) -> tuple[Callable[[], jax.Array], float]:
    """The compiled call of ``fn_name`` on the inputs in ``data`` (an ``.npz``), and its compile
    seconds. Smoother inputs: ``x``, ``mask``, ``alpha``, ``wx``; the rollout's: ``u``, ``mask``
    and ``w_ih_K``, ``w_hh_K``, ``b_ih_K``, ``b_hh_K`` per layer K, ``w_out``, ``b_out``; the
    rollout is written as ``variant`` says."""
    if fn_name == "traveller_rollout_scan":
        layers = range(int(data["layers"]))
        w_ih, w_hh, b_ih, b_hh = (
            [data[f"{name}_{k}"] for k in layers] for name in ("w_ih", "w_hh", "b_ih", "b_hh")
        )
        weights = traveller_weights(
            w_ih, w_hh, b_ih, b_hh, data["w_out"], data["b_out"], device=device
        )
        u, mask = (jax.device_put(data[k], device) for k in ("u", "mask"))
        rollout, secs = compile_for(rollout_variant_fn(variant), u, mask, weights)
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
    """``python -m bench.jax_baselines FN INPUTS OUT --device D --rounds R --sample-s S
    [--variant KEY]``: compile FN for the inputs (the rollout written as the variant KEY says,
    :attr:`RolloutVariant.key`), call it once for its output, then time R samples, each
    repeating the call until it lasts about S seconds; write ``out``, ``samples``, ``number``
    and ``compile_s`` to OUT (``.npz``)."""
    import argparse

    parser = argparse.ArgumentParser(description="time one JAX baseline in this process")
    parser.add_argument("fn", choices=FUNCTIONS)
    parser.add_argument("inputs")
    parser.add_argument("out")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--sample-s", type=float, default=0.03)
    parser.add_argument("--variant", type=RolloutVariant.parse, default=BEST_CPU)
    args = parser.parse_args(argv)
    with np.load(args.inputs) as data:
        call, compile_s = _build(args.fn, data, device_for(args.device), args.variant)
    out = np.asarray(call())
    once = min(_clocked(call, 1) for _ in range(3))
    number = max(1, min(10_000, int(np.ceil(args.sample_s / max(once, 1e-7)))))
    samples = [_clocked(call, number) for _ in range(args.rounds)]
    np.savez(args.out, out=out, samples=np.asarray(samples), number=number, compile_s=compile_s)
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(measure_main())
