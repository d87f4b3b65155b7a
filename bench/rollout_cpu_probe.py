"""Probe: the Traveller's CPU rollout, numba vs TorchScript vs JAX ``jit`` + ``lax.scan``.

Usage (one core, as the figures in the numba kernel's docs were taken)::

    OMP_NUM_THREADS=1 XLA_FLAGS="--xla_cpu_multi_thread_eigen=false" \\
        taskset -c 1 python -m bench.rollout_cpu_probe [--rounds 15] [--gemm-from N ...] [--planned]

Default model shapes (num_inputs 6, hidden 128, 2 layers), float32. For B > 1 the lengths are
spread evenly from T down to T/2 and packed. Implementations are timed in interleaved rounds;
each figure is the median over rounds of one call's wall time divided by T (µs per step).
Compile and first-call times are reported apart. JAX is optional (``pip install jax``).
``--breakdown`` times a step's pieces apart instead, ``--versions FILE ...`` times this kernel
against other versions of its module (bench/rollout_cpu_steps.py).
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from rnnserve.models.kernels.rollout_cpu import (
    GEMM_FROM,
    describe_routes,
    plan_routes,
    rollout_packed_numba,
)
from rnnserve.models.packing import pack
from rnnserve.models.traveller import Traveller, TravellerConfig, scripted_rollout

Weights = tuple[list[Tensor], list[Tensor], Tensor, Tensor]


def jax_rollout(weights: Weights) -> Callable[[Any, Any], Any]:
    """A jitted JAX rollout over a padded time-major batch: ``(u [T, B, I], mask [T, B, 1])``
    -> positions ``[T, B, 2]`` (rows past a sequence's end hold garbage, its state is frozen)."""
    import jax
    import jax.numpy as jnp

    w_cat = [jnp.asarray(t.numpy()) for t in weights[0]]
    bias = [jnp.asarray(t.numpy()) for t in weights[1]]
    w_out, b_out = jnp.asarray(weights[2].numpy()), jnp.asarray(weights[3].numpy())
    hidden = w_cat[0].shape[1] // 4
    w0_rec, w0_u = w_cat[0][: 2 + hidden], w_cat[0][2 + hidden :]

    def cell(g: Any, c: Any) -> tuple[Any, Any]:
        i, f, gg, o = jnp.split(g, 4, axis=1)
        c_new = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(gg)
        return jax.nn.sigmoid(o) * jnp.tanh(c_new), c_new

    def rollout(u: Any, mask: Any) -> Any:
        gu = u @ w0_u + bias[0]  # [T, B, 4H]: layer 0's input projection for every step at once
        batch = u.shape[1]
        zeros = jnp.zeros((batch, hidden), u.dtype)

        def step(carry: Any, xs: Any) -> Any:
            hs, cs, p = carry
            gu_t, m = xs
            x, new_h, new_c = p, [], []
            for layer, (h, c) in enumerate(zip(hs, cs, strict=True)):
                if layer == 0:
                    g = gu_t + jnp.concatenate([x, h], 1) @ w0_rec
                else:
                    g = bias[layer] + jnp.concatenate([x, h], 1) @ w_cat[layer]
                h_new, c_new = cell(g, c)
                new_h.append(jnp.where(m, h_new, h))
                new_c.append(jnp.where(m, c_new, c))
                x = h_new
            p_new = jnp.tanh(x @ w_out + b_out)
            return (tuple(new_h), tuple(new_c), jnp.where(m, p_new, p)), p_new

        init = ((zeros,) * len(w_cat), (zeros,) * len(w_cat), jnp.zeros((batch, 2), u.dtype))
        _, positions = jax.lax.scan(step, init, (gu, mask))
        return positions

    # not a decorator: without jax installed (CI), mypy would see an untyped one
    run: Callable[[Any, Any], Any] = jax.jit(rollout)
    return run


def lengths_for(batch: int, steps: int) -> list[int]:
    """``batch`` lengths spread evenly from ``steps`` down to about ``steps / 2``."""
    return [steps - (i * (steps // 2)) // batch for i in range(batch)] if batch > 1 else [steps]


def clock(fn: Callable[[], object], min_s: float = 0.02) -> float:
    """Seconds per call, repeating the call until a sample lasts ``min_s``."""
    n, start = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        elapsed = time.perf_counter() - start
        if elapsed >= min_s:
            return elapsed / n


def probe(
    batch: int,
    steps: int,
    rounds: int,
    gemm_froms: Sequence[int],
    use_jax: bool,
    planned: bool = False,
) -> None:
    torch.manual_seed(0)
    cfg = TravellerConfig()
    model = Traveller(cfg.num_inputs, cfg.hidden_size, cfg.num_layers).eval().requires_grad_(False)
    weights: Weights = model.fused_weights()
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randn(n, cfg.num_inputs, generator=gen) for n in lengths_for(batch, steps)]
    x = pack(seqs)
    sizes: list[int] = x.batch_sizes.tolist()
    scripted = scripted_rollout()
    want = scripted(x.data, sizes, *weights)[0]
    cases: dict[str, Callable[[], object]] = {
        "torchscript": lambda: scripted(x.data, sizes, *weights)
    }
    for gf in gemm_froms:
        t0 = time.perf_counter()
        got = rollout_packed_numba(x.data, sizes, *weights, gemm_from=gf)[0]
        first = time.perf_counter() - t0
        err = float((got - want).abs().max())
        print(
            f"  numba gemm_from={gf}: first call {first:.2f} s, max |diff| vs TorchScript {err:.1e}"
        )
        cases[f"numba gemm_from={gf}"] = lambda gf=gf: rollout_packed_numba(  # type: ignore[misc]
            x.data, sizes, *weights, gemm_from=gf
        )
    if planned:
        # the plan through the plain call, as the unplanned cases run: only the routes differ
        plan = plan_routes(weights[0])
        print(f"  plan: {describe_routes(plan)}")
        got = rollout_packed_numba(x.data, sizes, *weights, routes=plan)[0]
        err = float((got - want).abs().max())
        cases["numba planned"] = lambda: rollout_packed_numba(x.data, sizes, *weights, routes=plan)
        print(f"  numba planned: max |diff| vs TorchScript {err:.1e}")
    if use_jax:
        import jax

        padded = torch.nn.utils.rnn.pad_packed_sequence(x)[0].numpy()  # [T, B, I]
        mask = np.arange(steps)[:, None, None] < np.array([len(s) for s in seqs])[None, :, None]
        u_j, m_j = jax.device_put(padded), jax.device_put(mask)
        run = jax_rollout(weights)
        t0 = time.perf_counter()
        out = run(u_j, m_j).block_until_ready()
        print(f"  jax: compile + first call {time.perf_counter() - t0:.2f} s")
        got_j = torch.nn.utils.rnn.pack_padded_sequence(
            torch.from_numpy(np.asarray(out)), torch.tensor([len(s) for s in seqs])
        ).data
        print(f"  jax: max |diff| vs TorchScript {float((got_j - want).abs().max()):.1e}")
        cases["jax lax.scan"] = lambda: run(u_j, m_j).block_until_ready()
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for fn in cases.values():
        fn()
    for _ in range(rounds):
        for name, fn in cases.items():
            samples[name].append(clock(fn) / steps * 1e6)
    base = statistics.median(samples["torchscript"])
    for name, ts in samples.items():
        med = statistics.median(ts)
        print(
            f"  {name:24s} {med:8.2f} µs/step  [{min(ts):.2f}, {max(ts):.2f}]  {med / base:.2f}x TS"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--gemm-from", type=int, nargs="*", default=[GEMM_FROM])
    ap.add_argument("--shape", type=str, nargs="*", default=["1x1000", "64x500"])
    ap.add_argument("--no-jax", action="store_true")
    ap.add_argument("--planned", action="store_true", help="also the rollout with plan_routes")
    ap.add_argument("--breakdown", action="store_true", help="time a step's pieces apart")
    ap.add_argument("--gemm-pad", type=int, nargs="*", default=[], help="with --breakdown")
    ap.add_argument("--versions", nargs="*", default=[], help="kernel files to A/B against")
    args = ap.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore", DeprecationWarning)
    if args.breakdown or args.versions:
        from bench.rollout_cpu_steps import breakdown, versions_ab

        for shape in args.shape:
            batch, steps = (int(v) for v in shape.split("x"))
            print(f"B={batch} T={steps}")
            if args.versions:
                versions_ab(batch, steps, args.rounds, args.versions)
            else:
                breakdown(batch, steps, args.rounds, args.gemm_pad)
        return
    for shape in args.shape:
        batch, steps = (int(v) for v in shape.split("x"))
        print(f"B={batch} T={steps}")
        probe(batch, steps, args.rounds, args.gemm_from, not args.no_jax, args.planned)


if __name__ == "__main__":
    main()
