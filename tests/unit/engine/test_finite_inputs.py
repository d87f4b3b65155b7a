"""The engine's check for NaN and infinity: :meth:`FlatSequences.all_finite` (one pass, no
copy) and the runtime refusing such sequences for a model that does not check them itself."""

from __future__ import annotations

import numpy as np
import pytest

from rnnserve.service.config import Settings
from rnnserve.service.engine.runtime import ModelRuntime
from rnnserve.service.interface import FlatSequences, NonFiniteInput


def _flat(data: np.ndarray, lengths: list[int]) -> FlatSequences:
    return FlatSequences(data.astype(np.float32), np.array(lengths, np.int64))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("row", [0, 4, 9])
def test_any_single_non_finite_value_is_found(bad: float, row: int) -> None:
    data = np.ones((10, 3), np.float32)
    data[row, 1] = bad
    seqs = _flat(data, [4, 5, 1])
    assert not seqs.all_finite()
    assert seqs.first_non_finite() == (0 if row < 4 else 1 if row < 9 else 2)


def test_the_largest_finite_values_are_not_taken_for_infinity() -> None:
    top = np.finfo(np.float32).max
    seqs = _flat(np.full((4000, 16), top), [4000])  # a float32 sum would overflow
    assert seqs.all_finite()
    assert seqs.first_non_finite() == -1
    both = np.full((2, 1), top)
    both[1] = -np.inf
    assert not _flat(both, [2]).all_finite()


def test_infinities_of_both_signs_are_found() -> None:
    data = np.zeros((2, 1), np.float32)
    data[:, 0] = [np.inf, -np.inf]  # their sum is NaN, not zero
    assert not _flat(data, [1, 1]).all_finite()


@pytest.mark.parametrize("stream", [False, True])
async def test_the_runtime_refuses_non_finite_inputs_of_a_model_that_does_not_check(
    stream: bool,
) -> None:
    runtime = ModelRuntime(Settings(max_delay_ms=1.0))
    await runtime.start()
    try:
        data = np.zeros((7, runtime.get("traveller").input_dim), np.float32)
        data[5, 0] = np.nan
        bad = _flat(data, [3, 4])
        call = runtime.open_stream if stream else runtime.infer
        with pytest.raises(NonFiniteInput, match="sequence 1 "):
            await call("traveller", bad)
        data[5, 0] = 0.0
        out = await runtime.infer("traveller", _flat(data, [3, 4]))
        assert out.lengths.tolist() == [3, 4]
    finally:
        await runtime.stop()
