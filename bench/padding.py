"""The padded, time-major layout the JAX baselines walk, in plain numpy (no JAX imported): the
benchmark prepares their inputs with it in a process that must not load JAX (on CUDA, JAX runs in
a process of its own; see ``bench.jax_baselines.measure_main``)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def padded_time_major(seqs: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """``[T_i, C]`` arrays -> ``x`` ``[T, B, C]`` (zeros after each end) and ``mask`` ``[T, B]``."""
    steps = max(len(s) for s in seqs)
    width = seqs[0].shape[1]
    x = np.zeros((steps, len(seqs), width), dtype=seqs[0].dtype)
    mask = np.zeros((steps, len(seqs)), dtype=bool)
    for i, s in enumerate(seqs):
        x[: len(s), i] = s
        mask[: len(s), i] = True
    return x, mask


def unpad_time_major(y: np.ndarray, lengths: Sequence[int]) -> list[np.ndarray]:
    """``[T, B, C]`` -> the ``[T_i, C]`` arrays of each sequence."""
    return [y[:n, i] for i, n in enumerate(lengths)]
