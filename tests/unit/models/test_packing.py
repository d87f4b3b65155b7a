"""pack_flat / unpack_flat against torch's pack_sequence / unpack_sequence, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.utils.rnn import pack_sequence, unpack_sequence

from rnnserve.models import packing
from rnnserve.models.packing import (
    pack,
    pack_flat,
    pack_sorted,
    plan,
    unpack,
    unpack_flat,
    unpack_sorted,
)
from rnnserve.service.interface import FlatSequences

LENGTHS = st.lists(st.integers(1, 12), min_size=1, max_size=12)


def _data(lengths: list[int], width: int = 3) -> torch.Tensor:
    # distinct values per row: a misplaced row cannot go unnoticed
    n = sum(lengths)
    return torch.arange(n * width, dtype=torch.float32).reshape(n, width) * 0.5 - 7


def _same(a: torch.nn.utils.rnn.PackedSequence, b: torch.nn.utils.rnn.PackedSequence) -> None:
    assert a.data.dtype == b.data.dtype  # torch.equal alone compares across dtypes
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


@settings(max_examples=200, deadline=None)
@given(LENGTHS, st.sampled_from([(1,), (3,), (2, 3)]))
def test_pack_sorted_equals_pack_sequence_of_sequences_longest_first(
    lengths: list[int], features: tuple[int, ...]
) -> None:
    lengths = sorted(lengths, reverse=True)
    width = int(np.prod(features))
    data = _data(lengths, width).reshape(sum(lengths), *features)
    chunks = [c.numpy() for c in data.split(lengths)]
    ref = pack_sequence(list(data.split(lengths)))  # enforce_sorted: no indices either
    packed = pack_sorted(chunks)
    assert packed.data.dtype == ref.data.dtype
    assert torch.equal(packed.data, ref.data)
    assert torch.equal(packed.batch_sizes, ref.batch_sizes)
    assert packed.sorted_indices is None
    assert packed.unsorted_indices is None
    assert torch.equal(unpack_sorted(packed), data)  # one sequence after another


def test_pack_sorted_refuses_what_is_not_longest_first() -> None:
    lengths_refused = ([], [2, 3], [5, 2, 3], [2, 0])  # [5, 2, 3]: out of order after the first
    for lengths in lengths_refused:
        with pytest.raises(
            ValueError, match=r"^need one or more sequences, longest first, each of length >= 1$"
        ):
            pack_sorted([np.zeros((n, 3)) for n in lengths])
    refusal = r"^unpack_sorted takes a batch packed longest first \(no sorted_indices\)$"
    with pytest.raises(ValueError, match=refusal):
        unpack_sorted(pack([torch.zeros(2, 3), torch.zeros(3, 3)]))


def test_pack_sorted_data_goes_to_the_requested_device() -> None:
    chunks = [_data([3, 1, 2]).numpy()[i : i + n] for i, n in ((0, 3), (3, 2), (5, 1))]
    moved = pack_sorted(chunks, device="meta")  # "meta" stands in for an accelerator
    assert moved.data.device.type == "meta"
    assert moved.data.shape == (6, 3)
    assert moved.batch_sizes.device.type == "cpu"
    assert moved.batch_sizes.tolist() == [3, 2, 1]
    assert pack_sorted(chunks, device="cpu").data.device.type == "cpu"


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


# -- from the mutation run (scripts/mutation.sh models/packing.py) -----------------------------


def test_active_fraction_is_real_steps_over_the_padded_grid() -> None:
    assert packing.active_fraction([]) == 1.0  # nothing padded
    assert packing.active_fraction([4]) == 1.0
    assert packing.active_fraction([1, 3]) == pytest.approx(4 / 6)
    assert packing.active_fraction(np.array([2, 5, 1], np.int64)) == pytest.approx(8 / 15)


def test_dtypes_and_empty_shapes_are_kept() -> None:
    lengths = [2, 3]
    data = _data(lengths)
    for src in (data.numpy(), [data.numpy()[:1], data.numpy()[1:]]):
        assert pack_flat(src, lengths).data.dtype == torch.float32
    as_f64 = pack_flat(data.double().numpy(), lengths).data
    assert as_f64.dtype == torch.float64
    assert torch.equal(as_f64, pack_flat(data.double(), lengths).data)
    empty = FlatSequences.from_arrays([], 4)
    assert empty.data.dtype == np.float32
    assert empty.lengths.dtype == np.int64
    assert FlatSequences.from_arrays([]).data.shape == (0, 0)
    assert len(empty) == 0
    assert list(empty) == []
    assert empty[:] == []


def test_many_chunks_each_land_on_their_rows() -> None:
    lengths = [4, 1, 3, 2, 5]
    data = _data(lengths)
    ref = pack_sequence(list(data.split(lengths)), enforce_sorted=False)
    flat = data.numpy()
    for cuts in ([3, 5, 9], [1, 2, 3, 4, 10, 15], [0, 0, 6, 6, 15]):  # empty chunks included
        chunks = np.split(flat, cuts)
        _same(pack_flat(chunks, lengths), ref)


def test_plan_indices_and_refusal_message() -> None:
    p = plan(np.array([3, 5, 1]))
    assert p.sorted_indices.tolist() == [1, 0, 2]
    assert p.unsorted_indices.tolist() == [1, 0, 2]
    p = plan([1, 4, 3, 2])
    assert p.sorted_indices.tolist() == [1, 2, 3, 0]
    assert p.unsorted_indices.tolist() == [3, 0, 1, 2]
    assert p.batch_sizes.dtype == torch.int64
    with pytest.raises(ValueError, match=r"^need one or more sequences, each of length >= 1$"):
        plan([3, -1])


def test_a_given_layout_is_used_not_planned_again(monkeypatch: pytest.MonkeyPatch) -> None:
    lengths = [2, 4, 1]
    data = _data(lengths)
    layout = plan(lengths)
    ref = pack_sequence(list(data.split(lengths)), enforce_sorted=False)

    def no_plan(lengths: object) -> None:
        raise AssertionError("planned again despite the layout")

    monkeypatch.setattr(packing, "plan", no_plan)
    _same(pack_flat(data, lengths, layout=layout), ref)
    _same(pack_flat(data.numpy(), lengths, layout=layout), ref)
    assert torch.equal(unpack_flat(ref, lengths, layout=layout), data)


def test_unpack_flat_takes_the_compiled_gather_on_plain_cpu_data(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    lengths = [3, 1, 2]
    data = _data(lengths)
    packed = pack_flat(data, lengths)
    calls = []
    gather = packing._gather_rows

    def spy(src: np.ndarray, rows: np.ndarray, out: np.ndarray) -> None:
        calls.append(len(rows))
        gather(src, rows, out)

    monkeypatch.setattr(packing, "_gather_rows", spy)
    assert torch.equal(unpack_flat(packed, lengths), data)
    assert calls == [6]


def test_unpack_flat_of_grad_or_strided_data_keeps_values_and_grad() -> None:
    lengths = [3, 1, 2]
    data = _data(lengths, width=4)
    ref = pack_sequence(list(data.split(lengths)), enforce_sorted=False)
    # needs grad: index_select, so the gradient reaches the packed rows
    leaf = ref.data.clone().requires_grad_(True)
    back = unpack_flat(ref._replace(data=leaf), lengths)
    assert back.requires_grad
    assert torch.equal(back.detach(), data)
    (back * torch.arange(4.0)).sum().backward()
    assert leaf.grad is not None
    assert torch.equal(leaf.grad, torch.arange(4.0).expand(6, 4))
    # not contiguous: every other feature of a wider array
    wide = torch.stack([ref.data, -ref.data], dim=2).reshape(6, 8)[:, ::2]
    assert not wide.is_contiguous()
    assert torch.equal(unpack_flat(ref._replace(data=wide), lengths), data)


@pytest.mark.parametrize("how", ["pack", "tensor", "numpy"])
def test_packed_data_goes_to_the_requested_device(how: str) -> None:
    # "meta" stands in for an accelerator: the data moves, batch_sizes stays on the CPU
    lengths = [3, 1, 2]
    data = _data(lengths)
    if how == "pack":
        moved = pack(list(data.split(lengths)), device="meta")
        same_place = pack(list(data.split(lengths)), device="cpu")
    else:
        src = data if how == "tensor" else data.numpy()
        moved = pack_flat(src, lengths, device="meta")
        same_place = pack_flat(src, lengths, device=torch.device("cpu"))
    assert moved.data.device.type == "meta"
    assert moved.data.shape == (6, 3)
    assert moved.batch_sizes.device.type == "cpu"
    assert moved.batch_sizes.tolist() == [3, 2, 1]
    ref = pack_sequence(list(data.split(lengths)), enforce_sorted=False)
    _same(same_place, ref)
    assert same_place.data.device.type == "cpu"
    # off the CPU, unpack_flat gathers with index_select on the data's device
    back = unpack_flat(moved, lengths)
    assert back.device.type == "meta"
    assert back.shape == (6, 3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_pack_flat_and_unpack_flat_on_a_gpu() -> None:
    lengths = [3, 1, 2]
    data = _data(lengths).cuda()
    ref = pack_sequence(list(data.cpu().split(lengths)), enforce_sorted=False)
    packed = pack_flat(data, lengths)
    assert packed.data.is_cuda
    assert torch.equal(packed.data.cpu(), ref.data)
    assert torch.equal(unpack_flat(packed, lengths).cpu(), data.cpu())
