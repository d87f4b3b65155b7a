"""The one place where sequences become PackedSequences and back.

Packed data is time-major: the rows for step ``t`` are the ``batch_sizes[t]`` sequences still
active at that step, longest first. Both models work on that layout directly.

Three ways in and out:

- :func:`pack` / :func:`unpack` take and give a list of ``[T_i, F]`` tensors (through torch's
  ``pack_sequence`` / ``unpack_sequence``, which pad);
- :func:`pack_flat` / :func:`unpack_flat` take and give the sequences one after another in a
  single ``[sum T_i, F]`` array plus their lengths, and move the rows
  with one gather each way: no padding, no per-sequence work. The row of sorted sequence ``j``
  at step ``t`` is ``offset[t] + j``, where ``offset[t]`` is the number of rows of all earlier
  steps;
- :func:`pack_sorted` / :func:`unpack_sorted` take sequences already longest first, as the
  chunked rollout keeps its running ones: nothing to sort, no permutation to apply to a state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numba
import numpy as np
import torch
from torch import Tensor
from torch.nn.utils.rnn import PackedSequence, invert_permutation, pack_sequence, unpack_sequence


def pack(sequences: Sequence[Tensor], device: torch.device | str | None = None) -> PackedSequence:
    """Pack ``[T_i, F]`` tensors (any order, any lengths >= 1) into one PackedSequence."""
    packed = pack_sequence(list(sequences), enforce_sorted=False)
    return _to(packed, device)


def unpack(packed: PackedSequence) -> list[Tensor]:
    """Split a PackedSequence back into ``[T_i, ...]`` tensors in the original order."""
    return list(unpack_sequence(packed))


def pack_sorted(
    chunks: Sequence[np.ndarray], device: torch.device | str | None = None
) -> PackedSequence:
    """Pack ``[T_i, F]`` arrays that come longest first (lengths non-increasing, each >= 1).

    They are in packed order already: nothing to sort (the result's ``sorted_indices`` is None,
    so its state rows are the sequences' own order) and each row is copied once to its place.
    """
    lengths = np.array([len(c) for c in chunks], dtype=np.int64)
    if len(lengths) == 0 or lengths[-1] < 1 or bool((lengths[1:] > lengths[:-1]).any()):
        raise ValueError("need one or more sequences, longest first, each of length >= 1")
    batch_sizes, offsets = _sorted_layout(lengths)
    flat = np.concatenate(chunks)
    out = np.empty_like(flat)
    _interleave_rows(flat.reshape(len(flat), -1), lengths, offsets, out.reshape(len(out), -1))
    return _to(PackedSequence(torch.from_numpy(out), torch.from_numpy(batch_sizes)), device)


def unpack_sorted(packed: PackedSequence) -> Tensor:
    """The inverse of :func:`pack_sorted`: ``[sum T_i, ...]`` rows, one sequence after another,
    longest first; ``packed`` on the CPU, with no ``sorted_indices``."""
    if packed.sorted_indices is not None:
        raise ValueError("unpack_sorted takes a batch packed longest first (no sorted_indices)")
    batch_sizes = packed.batch_sizes.numpy()
    # sequence j is as long as the number of steps with more than j active rows
    steps_of_width = np.bincount(batch_sizes - 1)  # batch_sizes[0] long: the widest step
    lengths = np.cumsum(steps_of_width[::-1])[::-1]
    _, offsets = _sorted_layout(lengths)
    src = packed.data.contiguous().numpy()
    out = np.empty_like(src)
    _deinterleave_rows(src.reshape(len(src), -1), lengths, offsets, out.reshape(len(out), -1))
    return torch.from_numpy(out)


def _sorted_layout(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Batch sizes and each step's first packed row, for lengths given longest first."""
    counts = np.bincount(lengths)  # lengths[0] + 1 long: lengths[0] is the longest
    batch_sizes = len(lengths) - np.cumsum(counts)[: int(lengths[0])]
    offsets = np.zeros(len(batch_sizes), np.int64)
    np.cumsum(batch_sizes[:-1], out=offsets[1:])
    return batch_sizes, offsets


def active_fraction(lengths: Sequence[int] | np.ndarray) -> float:
    """Share of a padded ``[B, max(T)]`` grid that holds real steps (1.0 = no padding)."""
    if len(lengths) == 0:
        return 1.0
    return float(sum(lengths) / (len(lengths) * max(lengths)))


# -- flat layout ------------------------------------------------------------------------------


@dataclass(frozen=True)
class PackPlan:
    """Where every row goes: ``rows[k]`` is the packed row of flat row ``k``."""

    batch_sizes: Tensor  # [max T] int64, CPU
    sorted_indices: Tensor  # [N] int64: sequence at sorted position j
    unsorted_indices: Tensor  # [N] int64: inverse of sorted_indices
    rows: Tensor  # [sum T] int64: flat row -> packed row
    gather: Tensor  # [sum T] int64: packed row -> flat row (inverse of rows)


def plan(lengths: Sequence[int] | np.ndarray | Tensor) -> PackPlan:
    """The packing of sequences of these lengths (each >= 1), in the given order."""
    lens = torch.as_tensor(np.asarray(lengths, dtype=np.int64))
    if lens.ndim != 1 or len(lens) == 0 or bool((lens < 1).any()):
        raise ValueError("need one or more sequences, each of length >= 1")
    # the same call as torch's pack_padded_sequence, so ties are ordered the same way
    sorted_lens, sorted_indices = torch.sort(lens, descending=True)
    unsorted_indices = invert_permutation(sorted_indices)
    assert unsorted_indices is not None
    sl = sorted_lens.numpy()
    max_t = int(sl[0])
    # batch_sizes[t] = #sequences longer than t; offsets[t] = first packed row of step t
    counts = np.bincount(sl, minlength=max_t + 1)
    batch_sizes = len(sl) - np.cumsum(counts)[:max_t]
    offsets = np.zeros(max_t, np.int64)
    np.cumsum(batch_sizes[:-1], out=offsets[1:])
    ln = lens.numpy()
    total = int(ln.sum())
    rows = np.empty(total, np.int64)
    gather = np.empty(total, np.int64)
    _row_indices(ln, unsorted_indices.numpy(), offsets, rows, gather)
    return PackPlan(
        torch.from_numpy(batch_sizes),
        sorted_indices,
        unsorted_indices,
        torch.from_numpy(rows),
        torch.from_numpy(gather),
    )


def pack_flat(
    data: Tensor | np.ndarray | Sequence[np.ndarray],
    lengths: Sequence[int] | np.ndarray | Tensor,
    device: torch.device | str | None = None,
    layout: PackPlan | None = None,
) -> PackedSequence:
    """Pack ``data`` ``[sum T_i, F]`` (sequence ``i`` is the next ``lengths[i]`` rows).

    Equal to ``pack(list(data.split(lengths)))`` bit for bit, in one pass over the rows.
    ``data`` may also be a list of numpy chunks that together make those rows (the flat
    arrays of several requests): each is copied straight to its packed rows, never
    concatenated first.
    """
    p = layout if layout is not None else plan(lengths)
    if isinstance(data, Tensor):
        _check_rows(len(data), p)
        packed_data = data.index_select(0, p.gather.to(data.device))
    else:
        chunks = [data] if isinstance(data, np.ndarray) else list(data)
        _check_rows(sum(len(c) for c in chunks), p)
        width = chunks[0].shape[1:]
        out = np.empty((len(p.rows), *width), dtype=chunks[0].dtype)
        rows, first = p.rows.numpy(), 0
        for chunk in chunks:  # one scatter per chunk, every row written once
            if not len(chunk):
                continue
            src = chunk.reshape(len(chunk), -1)
            _scatter_rows(src, rows[first : first + len(chunk)], out.reshape(len(out), -1))
            first += len(chunk)
        packed_data = torch.from_numpy(out)
    packed = PackedSequence(packed_data, p.batch_sizes, p.sorted_indices, p.unsorted_indices)
    return _to(packed, device)


def unpack_flat(
    packed: PackedSequence,
    lengths: Sequence[int] | np.ndarray | Tensor,
    layout: PackPlan | None = None,
) -> Tensor:
    """The inverse of :func:`pack_flat`: ``[sum T_i, ...]`` rows in the original order."""
    p = layout if layout is not None else plan(lengths)
    data = packed.data
    _check_rows(len(data), p)
    if data.device.type == "cpu" and not data.requires_grad and data.is_contiguous():
        src = data.numpy()
        out = np.empty_like(src)
        _gather_rows(src.reshape(len(src), -1), p.rows.numpy(), out.reshape(len(out), -1))
        return torch.from_numpy(out)
    return data.index_select(0, p.rows.to(data.device))


def _check_rows(n: int, p: PackPlan) -> None:
    if n != len(p.rows):
        raise ValueError(f"lengths add up to {len(p.rows)} rows; the data has {n}")


def _rows(lengths: Any, rank: Any, offsets: Any, rows: Any, gather: Any) -> None:
    # flat row k of sequence i at step t <-> packed row offsets[t] + rank[i]
    k = 0
    for i in range(lengths.shape[0]):
        j = rank[i]
        for t in range(lengths[i]):
            r = offsets[t] + j
            rows[k] = r
            gather[r] = k
            k += 1


def _interleave(flat: Any, lengths: Any, offsets: Any, out: Any) -> None:
    # flat row k, sequence j's step t, -> packed row offsets[t] + j
    k = 0
    for j in range(lengths.shape[0]):
        for t in range(lengths[j]):
            r = offsets[t] + j
            for f in range(flat.shape[1]):
                out[r, f] = flat[k, f]
            k += 1


def _deinterleave(packed: Any, lengths: Any, offsets: Any, out: Any) -> None:
    k = 0
    for j in range(lengths.shape[0]):
        for t in range(lengths[j]):
            r = offsets[t] + j
            for f in range(packed.shape[1]):
                out[k, f] = packed[r, f]
            k += 1


def _scatter(src: Any, rows: Any, out: Any) -> None:
    for k in range(src.shape[0]):
        r = rows[k]
        for f in range(src.shape[1]):
            out[r, f] = src[k, f]


def _gather(src: Any, rows: Any, out: Any) -> None:
    for k in range(out.shape[0]):
        r = rows[k]
        for f in range(src.shape[1]):
            out[k, f] = src[r, f]


_JIT: dict[str, Any] = {"cache": False, "nogil": True, "boundscheck": False}
_row_indices = numba.njit(**_JIT)(_rows)
_scatter_rows = numba.njit(**_JIT)(_scatter)
_gather_rows = numba.njit(**_JIT)(_gather)
_interleave_rows = numba.njit(**_JIT)(_interleave)
_deinterleave_rows = numba.njit(**_JIT)(_deinterleave)


def _to(packed: PackedSequence, device: torch.device | str | None) -> PackedSequence:
    if device is None or torch.device(device) == packed.data.device:
        return packed
    # packed on the CPU, then moved in one copy (batch_sizes stays on the CPU by design)
    moved: PackedSequence = packed.to(torch.device(device))  # type: ignore[arg-type]
    return moved
