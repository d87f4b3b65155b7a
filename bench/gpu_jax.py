"""The ``jax`` step of ``bench.gpu_decide`` (``python -m bench.gpu_measure jax OUT.json``): JAX's
``associative_scan`` smoother and ``lax.scan`` rollout on the decision run's shapes, checked
against the kernels' float64 references. The rollout is ``bench.jax_baselines``' ``BEST_CPU``
variant, the fastest of its variants on the CPU; on a GPU the variants are not compared here.
"""

from __future__ import annotations

import importlib.util
import os
import statistics
from typing import Any

import numpy as np
import torch
from torch import Tensor

from bench.gpu_measure import (
    FEAT,
    ROLLOUT_HIDDEN,
    ROLLOUT_SHAPES,
    SMOOTHER_SHAPES,
    Emitter,
    rollout_reference,
    smoother_batch,
    smoother_reference,
    traveller,
)
from bench.models_harness import half_spread_lengths, random_sequences
from rnnserve.models.packing import pack


def step_jax(em: Emitter, device: torch.device, quick: bool) -> None:
    """JAX's ``associative_scan`` smoother and ``lax.scan`` rollout on the same shapes, in this
    process (a child of the decision script, so a JAX fault costs this step only), each checked
    against the same float64 references as the kernels."""
    if importlib.util.find_spec("jax") is None:
        em.set(skipped="JAX not installed")
        return
    from bench.padding import padded_time_major

    kind = "cuda" if device.type == "cuda" else "cpu"
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    rounds = 2 if quick else 7
    cpu = torch.device("cpu")
    for batch, steps in SMOOTHER_SHAPES[quick]:
        packed, alpha, wx = smoother_batch(batch, steps, cpu)
        seqs = random_sequences(half_spread_lengths(batch, steps), FEAT, seed=steps)
        refs = _per_sequence(packed, smoother_reference(packed, alpha, wx))
        x, mask = padded_time_major([s.numpy() for s in seqs])
        data = {"x": x, "mask": mask, "alpha": alpha.numpy(), "wx": wx.numpy()}
        em.add(_jax_row("smoother_associative_scan", data, (batch, steps), kind, rounds, refs))
    model = traveller(ROLLOUT_HIDDEN[quick], cpu)
    lstm = model.lstm_layers
    for batch, steps in ROLLOUT_SHAPES[quick]:
        seqs = random_sequences(half_spread_lengths(batch, steps), 6, seed=steps)
        packed = pack(seqs, cpu)
        refs = _per_sequence(packed, rollout_reference(model, packed))
        u, mask = padded_time_major([s.numpy() for s in seqs])
        data = {"u": u, "mask": mask, "layers": np.asarray(model.num_layers)}
        for k in range(model.num_layers):
            for key, attr in (("w_ih", "weight_ih"), ("w_hh", "weight_hh")):
                data[f"{key}_{k}"] = getattr(lstm, f"{attr}_l{k}").detach().numpy()
            for key, attr in (("b_ih", "bias_ih"), ("b_hh", "bias_hh")):
                data[f"{key}_{k}"] = getattr(lstm, f"{attr}_l{k}").detach().numpy()
        data["w_out"] = model.output_layer.weight.detach().numpy()
        data["b_out"] = model.output_layer.bias.detach().numpy()
        em.add(_jax_row("traveller_rollout_scan", data, (batch, steps), kind, rounds, refs))


def _per_sequence(packed: Any, rows: Tensor) -> list[np.ndarray]:
    """Packed float64 rows as each sequence's ``[T_i, C]`` array, in the batch's own order."""
    from torch.nn.utils.rnn import PackedSequence

    from rnnserve.models.packing import unpack

    rows = rows.detach()
    like = PackedSequence(rows, packed.batch_sizes, packed.sorted_indices, packed.unsorted_indices)
    return [t.numpy() for t in unpack(like)]


def _jax_row(
    fn: str,
    data: dict[str, Any],
    shape: tuple[int, int],
    kind: str,
    rounds: int,
    refs: list[np.ndarray],
) -> dict[str, Any]:
    from bench import jax_baselines as jb
    from bench.padding import unpad_time_major

    try:
        call, compile_s = jb._build(fn, data, jb.device_for(kind))
        out = np.asarray(call(), dtype=np.float64)
        got = unpad_time_major(out, [len(r) for r in refs])
        error = max(float(np.abs(g - r).max()) for g, r in zip(got, refs, strict=True))
        once = min(jb._clocked(call, 1) for _ in range(2))
        number = max(1, min(1000, int(0.02 / max(once, 1e-7))))
        seconds = statistics.median(jb._clocked(call, number) for _ in range(rounds))
    except Exception as e:
        return {"fn": fn, "shape": list(shape), "failed": f"{type(e).__name__}: {str(e)[:300]}"}
    row = {"fn": fn, "shape": list(shape), "error": error, "wall_us": seconds * 1e6}
    row["compile_s"] = compile_s
    if fn == "traveller_rollout_scan":
        row["us_per_step"] = seconds * 1e6 / shape[1]
    return row
