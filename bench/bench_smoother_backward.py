"""One training step of the smoother on the CPU: the compiled kernels against autograd through
the torch step loop and against JAX's ``grad`` of ``lax.scan``.

Usage::

    python -m bench.bench_smoother_backward [--shapes 16x100,64x1000,256x4000] [--rounds 9]

A step is the forward and the backward of the trainer's loss, ``F.mse_loss(y, target)`` (the
mean over the real steps and the features), no optimiser update, the gradients of ``alpha`` and
``wx`` its result; ``x`` needs none, as in training. Every variant's gradients are checked
against the float64 autograd of the torch loop before it is timed. The rows:

- compiled, fused loss: ``LinearRecursion.mse_loss`` on packed rows, kernel ``"numba"``, the
  trainer's step: the loss computed inside the compiled kernels with its gradients
  (:func:`rnnserve.models.kernels.smoother_cpu.smooth_mse_packed_numba`);
- compiled, torch loss: ``F.mse_loss`` of ``LinearRecursion``'s output, kernel ``"numba"``
  (:func:`rnnserve.models.kernels.smoother_cpu.smooth_packed_numba`, a compiled forward and a
  compiled backward, the path of any other loss);
- torch loop: the same model with kernel ``"torch"``, autograd through the Python step loop;
- JAX variants, each ``jax.jit`` of ``jax.value_and_grad`` over the padded, time-major
  ``[T, B, F]`` batch with a ``[T, B]`` mask (the layout ``lax.scan`` walks): ``lax.scan``
  differentiated by JAX; the same with ``unroll=4``; ``lax.scan`` with a hand-written
  ``custom_vjp`` whose backward is a reverse ``lax.scan`` of the adjoint (what the compiled
  kernel does); and ``lax.associative_scan`` differentiated by JAX. Each JAX variant's loss is
  part of its jitted program, fused as XLA sees fit.

Samples are interleaved round-robin across the variants; each sample repeats the step until it
lasts about ``--sample-s``. Prints a markdown table: median, min and max per step, and a row
for the torch rows' loss alone (``mse_loss`` forward and backward), the share of their step
that is not the smoother.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from bench.models_harness import cpu_model, half_spread_lengths, random_sequences
from bench.padding import padded_time_major
from rnnserve.models.kernels import ema_packed_torch
from rnnserve.models.packing import pack
from rnnserve.models.smoothing import LinearRecursion

FEAT = 16
FUSED = "compiled, loss fused (numba, packed)"
COMPILED = "compiled backward, torch mse_loss (numba, packed)"
TORCH_LOOP = "autograd through the torch step loop (packed)"
JAX_SCAN = "JAX grad of lax.scan (padded)"
JAX_SCAN_UNROLL = "JAX grad of lax.scan, unroll=4 (padded)"
JAX_SCAN_VJP = "JAX lax.scan, custom_vjp reverse scan (padded)"
JAX_ASSOC = "JAX grad of lax.associative_scan (padded)"
LOSS_ALONE = "(share) torch mse_loss alone, forward + backward"


@dataclass
class Problem:
    """One shape's inputs: packed for torch, padded time-major for JAX, and the parameters."""

    batch: int
    steps: int
    seqs: list[Tensor]
    targets: list[Tensor]
    alpha: np.ndarray
    wx: np.ndarray
    n_rows: int = field(init=False)

    def __post_init__(self) -> None:
        self.n_rows = sum(len(s) for s in self.seqs)


def make_problem(batch: int, steps: int, seed: int) -> Problem:
    seqs = random_sequences(half_spread_lengths(batch, steps), FEAT, seed)
    rng = np.random.default_rng(seed)
    alpha = (0.05 + 0.9 * rng.random(FEAT)).astype(np.float32)
    wx = (0.2 + 1.5 * rng.random(FEAT)).astype(np.float32)
    # targets: a smoother with other constants, so the loss and its gradients are not small
    other = torch.from_numpy(np.clip(alpha + 0.2, 0.0, 0.99))
    targets = []
    for s in seqs:
        packed = pack([s])
        ema = ema_packed_torch(packed.data, packed.batch_sizes, other)
        targets.append(torch.tanh(torch.from_numpy(wx) * 0.7 * ema))
    return Problem(batch, steps, seqs, targets, alpha, wx)


def reference_grads(p: Problem) -> np.ndarray:
    """float64 ``(dalpha, dwx)`` by autograd through the torch loop."""
    x, t = pack([s.double() for s in p.seqs]), pack([s.double() for s in p.targets]).data
    alpha = torch.from_numpy(p.alpha).double().requires_grad_(True)
    wx = torch.from_numpy(p.wx).double().requires_grad_(True)
    y = torch.tanh(wx * ema_packed_torch(x.data, x.batch_sizes, alpha))
    loss = torch.mean((y - t) ** 2)
    loss.backward()
    assert alpha.grad is not None
    assert wx.grad is not None
    return np.concatenate([alpha.grad.numpy(), wx.grad.numpy()])


# --------------------------------------------------------------------------- torch


def torch_step(p: Problem, kernel: str, fused: bool = False) -> Callable[[], np.ndarray]:
    model = LinearRecursion(FEAT)
    with torch.no_grad():
        model.alpha_smooth.copy_(torch.from_numpy(p.alpha))
        model.wx.copy_(torch.from_numpy(p.wx))
    model.kernel = kernel  # type: ignore[assignment]
    x, target = pack(p.seqs), pack(p.targets).data

    def step() -> np.ndarray:
        model.zero_grad(set_to_none=True)
        # unfused, mse_loss is one op forward and one backward: the cheapest way torch writes it
        loss = model.mse_loss(x, target) if fused else F.mse_loss(model(x).data, target)
        loss.backward()
        a, w = model.alpha_smooth.grad, model.wx.grad
        assert a is not None
        assert w is not None
        return np.concatenate([a.numpy(), w.numpy()])

    return step


def loss_alone(p: Problem) -> Callable[[], np.ndarray]:
    """The torch rows' loss by itself, forward and backward, on a fixed ``y``: their share."""
    target = pack(p.targets).data
    y = target.flip(0).clone().requires_grad_(True)

    def step() -> np.ndarray:
        y.grad = None
        F.mse_loss(y, target).backward()
        return np.zeros(2 * FEAT)

    return step


# --------------------------------------------------------------------------- JAX


def jax_steps(p: Problem) -> dict[str, Callable[[], np.ndarray]]:
    """The JAX variants, compiled for this shape; each returns ``(dalpha, dwx)``."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    xs_np, mask_np = padded_time_major([s.numpy() for s in p.seqs])
    ts_np, _ = padded_time_major([t.numpy() for t in p.targets])
    xs, mask, ts = jnp.asarray(xs_np), jnp.asarray(mask_np), jnp.asarray(ts_np)
    params = (jnp.asarray(p.alpha), jnp.asarray(p.wx))
    n_values = float(p.n_rows * FEAT)

    def loss_of(y: jax.Array) -> jax.Array:
        return jnp.sum(jnp.where(mask[..., None], (y - ts) ** 2, 0.0)) / n_values

    def scan_loss(unroll: int) -> Callable[..., jax.Array]:
        def loss(prm: tuple[jax.Array, jax.Array], x: jax.Array) -> jax.Array:
            alpha, wx = prm

            def step(s: jax.Array, x_t: jax.Array) -> tuple[jax.Array, jax.Array]:
                s = alpha * s + (1 - alpha) * x_t
                return s, jnp.tanh(wx * s)

            # s_{-1} = x_0 gives s_0 = x_0
            _, y = lax.scan(step, x[0], x, unroll=unroll)
            return loss_of(y)

        return loss

    @jax.custom_vjp
    def smooth(alpha: jax.Array, wx: jax.Array, x: jax.Array) -> jax.Array:
        return smooth_fwd(alpha, wx, x)[0]

    def smooth_fwd(alpha: jax.Array, wx: jax.Array, x: jax.Array) -> tuple[jax.Array, Any]:
        def step(s: jax.Array, x_t: jax.Array) -> tuple[jax.Array, jax.Array]:
            s = alpha * s + (1 - alpha) * x_t
            return s, s

        _, s = lax.scan(step, x[0], x)
        y = jnp.tanh(wx * s)
        return y, (alpha, wx, x, s, y)

    def smooth_bwd(res: Any, gy: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        alpha, wx, x, s, y = res
        g_pre = gy * (1 - y * y)
        g = g_pre * wx

        def back(lam: jax.Array, g_t: jax.Array) -> tuple[jax.Array, jax.Array]:
            lam = g_t + alpha * lam
            return lam, lam

        _, lam = lax.scan(back, jnp.zeros_like(x[0]), g, reverse=True)
        # padded steps have g = 0 after each end, so their adjoint is 0 and adds nothing
        dalpha = jnp.sum(lam[1:] * (s[:-1] - x[1:]), axis=(0, 1))
        dwx = jnp.sum(g_pre * s, axis=(0, 1))
        dx = jnp.concatenate([lam[:1], (1 - alpha) * lam[1:]])
        return dalpha, dwx, dx

    smooth.defvjp(smooth_fwd, smooth_bwd)

    def vjp_loss(prm: tuple[jax.Array, jax.Array], x: jax.Array) -> jax.Array:
        return loss_of(smooth(prm[0], prm[1], x))

    def assoc_loss(prm: tuple[jax.Array, jax.Array], x: jax.Array) -> jax.Array:
        alpha, wx = prm
        first = (jnp.arange(x.shape[0]) == 0)[:, None, None]
        a = jnp.where(first, jnp.zeros_like(x), alpha)
        b = jnp.where(first, x, (1 - alpha) * x)

        def combine(
            left: tuple[jax.Array, jax.Array], right: tuple[jax.Array, jax.Array]
        ) -> tuple[jax.Array, jax.Array]:
            return left[0] * right[0], right[0] * left[1] + right[1]

        _, s = lax.associative_scan(combine, (a, b), axis=0)
        return loss_of(jnp.tanh(wx * s))

    variants = {
        JAX_SCAN: scan_loss(1),
        JAX_SCAN_UNROLL: scan_loss(4),
        JAX_SCAN_VJP: vjp_loss,
        JAX_ASSOC: assoc_loss,
    }

    def stepper(grad: Any) -> Callable[[], np.ndarray]:
        def step() -> np.ndarray:
            _, (da, dw) = grad(params, xs)
            return np.concatenate([np.asarray(da), np.asarray(dw)])  # waits for the result

        return step

    return {
        name: stepper(jax.jit(jax.value_and_grad(loss)).lower(params, xs).compile())
        for name, loss in variants.items()
    }


# --------------------------------------------------------------------------- timing


def clocked(fn: Callable[[], object], number: int) -> float:
    start = time.perf_counter()
    for _ in range(number):
        fn()
    return (time.perf_counter() - start) / number


def measure(
    steps: dict[str, Callable[[], np.ndarray]], rounds: int, sample_s: float
) -> dict[str, list[float]]:
    numbers = {}
    for name, fn in steps.items():
        once = min(clocked(fn, 1) for _ in range(3))
        numbers[name] = max(1, min(1000, int(np.ceil(sample_s / max(once, 1e-6)))))
    samples: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    for r in range(rounds):
        gc.collect()
        k = r % len(names)
        for name in names[k:] + names[:k]:
            samples[name].append(clocked(steps[name], numbers[name]))
    return samples


def check(name: str, got: np.ndarray, want: np.ndarray) -> float:
    err = float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-30))
    if not err < 1e-3:
        raise AssertionError(f"{name}: gradients off by {err:.2e} (relative to the largest)")
    return err


def bench_shape(
    batch: int, steps: int, rounds: int, sample_s: float, torch_rounds: int
) -> list[str]:
    p = make_problem(batch, steps, seed=batch + steps)
    want = reference_grads(p)
    fast = {FUSED: torch_step(p, "numba", fused=True), COMPILED: torch_step(p, "numba")}
    try:
        fast |= jax_steps(p)
    except ImportError as e:
        print(f"JAX rows left out: {e}")
    slow = {TORCH_LOOP: torch_step(p, "torch")}
    errs = {name: check(name, fn(), want) for name, fn in (fast | slow).items()}
    fast[LOSS_ALONE] = loss_alone(p)
    samples = measure(fast, rounds, sample_s) | measure(slow, torch_rounds, 0.0)
    base = statistics.median(samples[FUSED])
    jax_names = [n for n in samples if n.startswith("JAX")]  # the loss row is not a variant
    best_jax = min(jax_names, key=lambda n: statistics.median(samples[n]), default=None)
    lines = [
        f"**B={batch}, T={steps}, F={FEAT}** ({p.n_rows:,} rows; lengths T/2..T)",
        "",
        "| variant | median | min | max | × fused | max rel. grad error |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, ts in sorted(samples.items(), key=lambda kv: statistics.median(kv[1])):
        med = statistics.median(ts)
        mark = " (fastest JAX)" if name == best_jax else ""
        lines.append(
            f"| {name}{mark} | {med * 1e3:.2f} ms | {min(ts) * 1e3:.2f} ms | "
            f"{max(ts) * 1e3:.2f} ms | {med / base:.2f}× | "
            f"{'' if name == LOSS_ALONE else f'{errs[name]:.1e}'} |"
        )
    if best_jax is not None:
        jax_median = statistics.median(samples[best_jax])
        lines.append("")
        for name in (FUSED, COMPILED):
            ratio = statistics.median(samples[name]) / jax_median
            lines.append(f"{name} / fastest JAX ({best_jax}): **{ratio:.2f}×**")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--shapes", default="16x100,64x1000,256x4000", help="BxT,BxT,...")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--torch-rounds", type=int, default=3, help="samples of the torch loop")
    parser.add_argument("--sample-s", type=float, default=0.2)
    args = parser.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("BENCH_TORCH_THREADS", "1")))
    try:
        import jax

        jax_version = jax.__version__
    except ImportError:
        jax_version = "not installed"
    load = os.getloadavg()
    now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(
        f"{cpu_model()}, {os.cpu_count()} logical CPUs; {now}; load average {load[0]:.2f}; "
        f"torch {torch.__version__} ({torch.get_num_threads()} thread), jax {jax_version}"
    )
    for shape in args.shapes.split(","):
        batch, steps = (int(v) for v in shape.lower().split("x"))
        print()
        print("\n".join(bench_shape(batch, steps, args.rounds, args.sample_s, args.torch_rounds)))
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
