"""The one place where lists of sequences become PackedSequences and back.

Packed data is time-major: the rows for step ``t`` are the ``batch_sizes[t]`` sequences still
active at that step, longest first. Both models work on that layout directly.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torch.nn.utils.rnn import PackedSequence, pack_sequence, unpack_sequence


def pack(sequences: Sequence[Tensor], device: torch.device | str | None = None) -> PackedSequence:
    """Pack ``[T_i, F]`` tensors (any order, any lengths >= 1) into one PackedSequence."""
    packed = pack_sequence(list(sequences), enforce_sorted=False)
    if device is None or torch.device(device) == packed.data.device:
        return packed
    # packed on the CPU, then moved in one copy (batch_sizes stays on the CPU by design)
    moved: PackedSequence = packed.to(torch.device(device))  # type: ignore[arg-type]
    return moved


def unpack(packed: PackedSequence) -> list[Tensor]:
    """Split a PackedSequence back into ``[T_i, ...]`` tensors in the original order."""
    return list(unpack_sequence(packed))


def active_fraction(lengths: Sequence[int]) -> float:
    """Share of a padded ``[B, max(T)]`` grid that holds real steps (1.0 = no padding)."""
    if not lengths:
        return 1.0
    return sum(lengths) / (len(lengths) * max(lengths))
