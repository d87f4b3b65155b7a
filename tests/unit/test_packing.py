"""pack_flat / unpack_flat against torch's pack_sequence / unpack_sequence, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.utils.rnn import pack_sequence, unpack_sequence

from models.packing import FlatSequences, pack, pack_flat, plan, unpack, unpack_flat

LENGTHS = st.lists(st.integers(1, 12), min_size=1, max_size=12)


def _data(lengths: list[int], width: int = 3) -> torch.Tensor:
    # distinct values per row: a misplaced row cannot go unnoticed
    n = sum(lengths)
    return torch.arange(n * width, dtype=torch.float32).reshape(n, width) * 0.5 - 7


def _same(a: torch.nn.utils.rnn.PackedSequence, b: torch.nn.utils.rnn.PackedSequence) -> None:
    assert torch.equal(a.data, b.data)
    assert torch.equal(a.batch_sizes, b.batch_sizes)
    assert a.sorted_indices is not None
    assert b.sorted_indices is not None
    assert torch.equal(a.sorted_indices, b.sorted_indices)
    assert a.unsorted_indices is not None
    assert b.unsorted_indices is not None
    assert torch.equal(a.unsorted_indices, b.unsorted_indices)


@settings(max_examples=200, deadline=None)
@given(LENGTHS, st.integers(1, 5))
def test_pack_flat_equals_pack_sequence(lengths: list[int], width: int) -> None:
    data = _data(lengths, width)
    ref = pack_sequence(list(data.split(lengths)), enforce_sorted=False)
    _same(pack_flat(data, lengths), ref)  # from a tensor (index_select)
    _same(pack_flat(data.numpy(), lengths), ref)  # from a numpy array (compiled scatter)
    cut = sum(lengths[: len(lengths) // 2])  # from the chunks of two requests
    _same(pack_flat([data.numpy()[:cut], data.numpy()[cut:]], lengths), ref)
    back = unpack_flat(ref, lengths)
    assert torch.equal(back, torch.cat(unpack_sequence(ref)))
    assert torch.equal(back, data)


@pytest.mark.parametrize("lengths", [[1], [7], [4, 4, 4, 4], [1, 1, 1], [2, 5, 5, 1, 5]])
def test_edge_shapes(lengths: list[int]) -> None:
    data = _data(lengths)
    ref = pack(list(data.split(lengths)))
    packed = pack_flat(data, torch.tensor(lengths))
    _same(packed, ref)
    assert torch.equal(unpack_flat(packed, lengths), torch.cat(unpack(ref)))


def test_shared_plan_and_row_formula() -> None:
    lengths = [3, 5, 1]
    p = plan(lengths)
    # sorted order: sequence 1 (5), 0 (3), 2 (1); row of sorted j at step t = offset[t] + j
    assert p.batch_sizes.tolist() == [3, 2, 2, 1, 1]
    assert p.sorted_indices.tolist() == [1, 0, 2]
    offsets = [0, 3, 5, 7, 8]
    want = [offsets[t] + 1 for t in range(3)] + [offsets[t] for t in range(5)] + [2]
    assert p.rows.tolist() == want
    assert torch.equal(p.gather[p.rows], torch.arange(9))


def test_bad_lengths_are_refused() -> None:
    with pytest.raises(ValueError, match="length >= 1"):
        plan([])
    with pytest.raises(ValueError, match="length >= 1"):
        plan([2, 0])
    with pytest.raises(ValueError, match="add up to"):
        pack_flat(torch.zeros(4, 2), [2, 3])
    with pytest.raises(ValueError, match="add up to"):
        unpack_flat(pack_flat(torch.zeros(5, 2), [2, 3]), [2, 2])


def test_flat_sequences_is_a_sequence_of_views() -> None:
    arrays = [np.full((n, 2), n, np.float32) for n in (2, 1, 3)]
    flat = FlatSequences.from_arrays(arrays)
    assert len(flat) == 3
    assert flat.total == 6
    assert [a.shape for a in flat] == [(2, 2), (1, 2), (3, 2)]
    assert np.shares_memory(flat[2], flat.data)
    assert all(np.array_equal(a, b) for a, b in zip(flat, arrays, strict=True))
    assert FlatSequences.from_arrays([], 4).data.shape == (0, 4)
    with pytest.raises(ValueError, match="do not add up"):
        FlatSequences(np.zeros((3, 2), np.float32), np.array([1, 1]))
