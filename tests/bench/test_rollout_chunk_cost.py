"""bench/rollout_chunk_cost.py on a tiny run: every layer runs the same chunk (the loop on the
arguments it prepares gives the served chunk's positions), and the table's ratios and the cost
beyond the loop are computed from the medians it is given."""

from __future__ import annotations

import numpy as np
import pytest
import torch

cost = pytest.importorskip("bench.rollout_chunk_cost")

from rnnserve import models  # noqa: E402
from rnnserve.models.packing import pack  # noqa: E402
from rnnserve.models.traveller import RolloutState, Traveller  # noqa: E402


def test_each_layer_runs_the_chunk_the_service_runs() -> None:
    model = models.load("traveller")
    assert isinstance(model, Traveller)
    layers = cost._layers(model, batch=3, chunks=2, seed=5)
    assert list(layers) == list(cost.LAYERS)
    served = layers["rollout function"]()[0]
    rng = np.random.default_rng(5)  # the inputs _layers draws: the chunk's first 64 steps
    steps = cost.CHUNK * 4
    inputs = [rng.standard_normal((steps, model.num_inputs)).astype(np.float32) for _ in range(3)]
    chunk = pack([torch.from_numpy(a[: cost.CHUNK]) for a in inputs])
    zeros = RolloutState.zeros(2, 3, model.hidden_size, dtype=torch.float32, device="cpu")
    with torch.inference_mode():
        want = model.rollout_with_state(chunk, zeros)[0].data
    torch.testing.assert_close(served, want, atol=0, rtol=0)
    assert layers["ChunkedRollout.advance"]()[2] == 3 * cost.CHUNK  # every sequence a chunk


def test_the_table_gives_medians_ratios_and_the_cost_beyond_the_loop() -> None:
    times = {
        "loop": [1e-3, 2e-3, 3e-3],  # median 2 ms
        "rollout function": [2.2e-3],
        "Traveller.rollout_with_state": [2.5e-3, 2.5e-3],
        "ChunkedRollout.advance": [9e-3, 3e-3, 1e-3],  # median 3 ms
    }
    head, rule, row = cost.table({4: times})
    assert head.count("|") == len(cost.LAYERS) + 3
    assert rule.count("---") == len(cost.LAYERS) + 2
    assert row == (
        "| 4 | 2,000 µs (1.00×) | 2,200 µs (1.10×) | 2,500 µs (1.25×) | 3,000 µs (1.50×) "
        "| 1,000 µs |"
    )


def test_a_measurement_takes_one_time_per_round_for_every_layer() -> None:
    model = models.load("traveller")
    assert isinstance(model, Traveller)
    times = cost.measure(model, batch=2, rounds=3, calls=1)
    assert set(times) == set(cost.LAYERS)
    for samples in times.values():
        assert len(samples) == 3
        assert all(0 < s < 60 for s in samples)
