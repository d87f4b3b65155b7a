"""Values that are not finite: JSON bodies refused by the reader, binary ones kept for the engine
to refuse, and the located error for what the engine found."""

from __future__ import annotations

import numpy as np
import pytest
from safetensors.numpy import save

from rnnserve.service.codec import bodies
from rnnserve.service.http.errors import status as status_of
from rnnserve.service.interface import FlatSequences, Limits, RequestError

LIMITS = Limits(256, 100_000, 1_000_000)


def _body(data: np.ndarray, lengths: list[int]) -> bytes:
    return save({"sequences": data, "lengths": np.array(lengths, np.int64)})


def test_a_binary_body_keeps_its_values_for_the_engine_to_check() -> None:
    data = np.arange(5 * 3, dtype=np.float32).reshape(5, 3)
    data[3, 2] = np.inf
    decoded = bodies.decode(_body(data, [2, 3]), bodies.SAFETENSORS, "sequences", LIMITS)
    assert decoded is not None
    seqs = decoded.sequences(3, "m")
    np.testing.assert_array_equal(seqs.data, data)
    assert seqs.lengths.tolist() == [2, 3]
    assert seqs.first_non_finite() == 1
    # the other checks still run
    with pytest.raises(RequestError) as err:
        decoded.sequences(4, "m")
    assert err.value.type == "wrong_feature_count"


def test_json_bodies_are_checked_by_the_reader() -> None:
    decoded = bodies.decode(b'{"sequences": [[[1, 2]], [[1e39, 0]]]}', None, "sequences", LIMITS)
    assert decoded is not None
    with pytest.raises(RequestError) as err:
        decoded.sequences(2, "m")
    assert (err.value.type, err.value.loc) == ("non_finite", ("sequences", 1, 0, 0))


@pytest.mark.parametrize(
    ("where", "loc"),
    [((0, 0), ("s", 0, 0, 0)), ((4, 1), ("s", 1, 2, 1)), ((8, 1), ("s", 2, 0, 1))],
)
def test_non_finite_error_names_the_first_bad_value(where: tuple[int, int], loc: tuple) -> None:
    data = np.ones((9, 2), np.float32)
    data[where] = np.nan
    data[8, 0] = -np.inf if where != (8, 1) else 1.0  # a later one does not matter
    err = bodies.non_finite_error(FlatSequences(data, np.array([2, 6, 1])), "s")
    assert (status_of(err.type), err.type, err.loc) == (422, "non_finite", loc)
    assert err.message == f"sequence {loc[1]}, step {loc[2]}, feature {loc[3]}: " + (
        "value is not a finite number"
    )


def test_non_finite_error_without_a_bad_value_still_refuses_the_request() -> None:
    err = bodies.non_finite_error(FlatSequences(np.ones((3, 2), np.float32), np.array([3])), "s")
    assert (status_of(err.type), err.type, err.loc) == (422, "non_finite", ("s",))
