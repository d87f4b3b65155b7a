"""The Traveller's side of continuous batching: rollouts advanced a chunk of steps at a time.

:class:`ChunkedRollout` holds every running request's sequences, how far each has got, its
outputs so far and its LSTM state (on the model's device, one row per running sequence). Each
call to :meth:`ChunkedRollout.advance` admits new requests, drops abandoned ones, runs every
running sequence ``chunk_steps`` further (or to its end) in one packed call of the model's
resumable rollout, and returns the requests that finished. It runs on the model's worker thread;
the asyncio side is :class:`rnnserve.service.engine.continuous.ContinuousBatcher`.

A sequence's result does not depend on how its steps were split into chunks: the resumable
rollout carries ``(h, c, p)`` exactly. Which other sequences shared a step changes it only by
float32 rounding: the CPU kernel takes each step's matrix product by the route measured fastest
for its number of running sequences (a hand-written loop or a BLAS GEMM), whose sums may round
differently.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from rnnserve.models.packing import active_fraction, pack_sorted, unpack_sorted
from rnnserve.models.traveller import RolloutState, Traveller
from rnnserve.service.interface import Piece


@dataclass(eq=False)
class _Sequence:
    key: int  # the request it belongs to
    index: int  # its place in the request
    inputs: np.ndarray  # [T, num_inputs] float32
    outputs: np.ndarray  # [T, 2] float32, filled as steps run
    done: int = 0  # steps run so far
    keep: bool = False  # its request asked for its final state
    final: RolloutState | None = None  # its state after its last step (CPU), when kept

    @property
    def left(self) -> int:
        return len(self.inputs) - self.done


class ChunkedRollout:
    """Running rollouts of one Traveller, advanced ``chunk_steps`` at a time."""

    def __init__(self, model: Traveller, device: torch.device, chunk_steps: int) -> None:
        if chunk_steps < 1:
            raise ValueError(f"chunk_steps must be >= 1, got {chunk_steps}")
        self.model = model
        self.device = device
        self.chunk_steps = chunk_steps
        # row i of the state is _running[i]; longest left first, so a chunk's batch is packed
        # as it stands (pack_sorted): no sort, no permutation of the state in and out
        self._running: list[_Sequence] = []
        self._state: RolloutState | None = None
        self._pending: dict[int, int] = {}  # request key -> sequences not yet finished
        self._requests: dict[int, list[_Sequence]] = {}
        self.last_active_fraction = 1.0  # of the last chunk's [sequences x longest] grid
        # the final state of each request the last advance finished that asked for it
        self.finished_states: dict[int, RolloutState] = {}

    @property
    def running_sequences(self) -> int:
        return len(self._running)

    def reset(self) -> None:
        """Forget everything (after a failed chunk, whose state cannot be trusted)."""
        self._running, self._state = [], None
        self._pending.clear()
        self._requests.clear()

    def advance(
        self,
        joins: list[tuple[int, list[np.ndarray]]],
        leaves: list[int],
        starts: Mapping[int, RolloutState] | None = None,
        keep_state: Collection[int] = (),
    ) -> tuple[dict[int, list[np.ndarray]], dict[int, list[Piece]], int]:
        """Admit ``joins``, drop ``leaves``, run one chunk.

        ``starts``: the state a joining request's sequences start from (one row per sequence,
        in its order), by key; the others start from zeros. ``keep_state``: the joining
        requests whose final state :attr:`finished_states` holds once they finish.

        Returns the finished requests' outputs, the pieces of output each request got in this
        chunk (for streaming), and the number of timesteps run.
        """
        self.finished_states = {}
        try:
            self._drop(set(leaves))
            self._join(joins, starts or {}, set(keep_state))
            progress = self._run_chunk() if self._running else {}
            steps = sum(len(y) for pieces in progress.values() for _, _, y in pieces)
            return self._collect(), progress, steps
        except BaseException:
            self.reset()
            raise

    # -- bookkeeping ------------------------------------------------------------------------

    def _drop(self, keys: set[int]) -> None:
        if not keys:
            return
        keep = [i for i, s in enumerate(self._running) if s.key not in keys]
        self._running = [self._running[i] for i in keep]
        if self._state is not None:
            self._state = self._state.index(
                torch.tensor(keep, dtype=torch.long, device=self.device)
            )
        for key in keys:
            self._pending.pop(key, None)
            self._requests.pop(key, None)

    def _join(
        self,
        joins: list[tuple[int, list[np.ndarray]]],
        starts: Mapping[int, RolloutState],
        keep: set[int],
    ) -> None:
        if not joins:
            return
        new: list[_Sequence] = []
        parts: list[RolloutState] = []
        m = self.model
        dtype = next(m.parameters()).dtype
        for key, arrays in joins:
            seqs = [
                _Sequence(key, i, a, np.empty((len(a), 2), dtype=np.float32), keep=key in keep)
                for i, a in enumerate(arrays)
            ]
            self._requests[key] = seqs
            self._pending[key] = len(seqs)
            new.extend(seqs)
            start = starts.get(key)
            if start is None:
                start = RolloutState.zeros(
                    m.num_layers, len(seqs), m.hidden_size, dtype=dtype, device=self.device
                )
            parts.append(_on(start, self.device, dtype))
        if not new:
            return
        fresh = RolloutState(
            torch.cat([p.h for p in parts], 1),
            torch.cat([p.c for p in parts], 1),
            torch.cat([p.p for p in parts], 0),
        )
        if self._state is None:
            self._state = fresh
        else:
            old = self._state
            self._state = RolloutState(
                torch.cat([old.h, fresh.h], 1),
                torch.cat([old.c, fresh.c], 1),
                torch.cat([old.p, fresh.p], 0),
            )
        self._running.extend(new)
        self._sort_longest_first()

    def _sort_longest_first(self) -> None:
        # Only a join can break the order: a chunk takes the same steps from every sequence
        # that outlives it, so the survivors keep theirs.
        order = sorted(range(len(self._running)), key=lambda i: -self._running[i].left)
        if order == list(range(len(order))):
            return
        self._running = [self._running[i] for i in order]
        if self._state is not None:
            rows = torch.tensor(order, dtype=torch.long, device=self.device)
            self._state = self._state.index(rows)

    def _run_chunk(self) -> dict[int, list[Piece]]:
        assert self._state is not None
        lengths = [min(s.left, self.chunk_steps) for s in self._running]
        self.last_active_fraction = active_fraction(lengths)
        running = zip(self._running, lengths, strict=True)
        pieces = [s.inputs[s.done : s.done + n] for s, n in running]
        with torch.inference_mode():
            batch = pack_sorted(pieces, self.device)
            packed, state = self.model.rollout_with_state(batch, self._state)
            flat = unpack_sorted(packed.cpu()).numpy()
        progress: dict[int, list[Piece]] = {}
        first = 0
        for seq, n in zip(self._running, lengths, strict=True):
            start = seq.done
            seq.outputs[start : start + n] = flat[first : first + n]
            first += n
            seq.done += n
            progress.setdefault(seq.key, []).append(
                (seq.index, start, seq.outputs[start : seq.done])
            )
        self._state = state
        return progress

    def _collect(self) -> dict[int, list[np.ndarray]]:
        """Retire the sequences that reached their end; return the requests now complete."""
        finished: dict[int, list[np.ndarray]] = {}
        keep: list[int] = []
        for i, seq in enumerate(self._running):
            if seq.left:
                keep.append(i)
                continue
            if seq.keep and self._state is not None:
                row = torch.tensor([i], dtype=torch.long, device=self.device)
                seq.final = _on(self._state.index(row), torch.device("cpu"), torch.float32)
            self._pending[seq.key] -= 1
            if self._pending[seq.key] == 0:
                del self._pending[seq.key]
                seqs = self._requests.pop(seq.key)
                finished[seq.key] = [s.outputs for s in seqs]
                if seq.keep:
                    self.finished_states[seq.key] = _stack([s.final for s in seqs])
        if len(keep) != len(self._running):
            self._running = [self._running[i] for i in keep]
            if self._state is not None:
                idx = torch.tensor(keep, dtype=torch.long, device=self.device)
                self._state = self._state.index(idx) if keep else None
        return finished


def _on(state: RolloutState, device: torch.device, dtype: torch.dtype) -> RolloutState:
    return RolloutState(
        state.h.to(device=device, dtype=dtype),
        state.c.to(device=device, dtype=dtype),
        state.p.to(device=device, dtype=dtype),
    )


def _stack(finals: list[RolloutState | None]) -> RolloutState:
    """One request's final state, its sequences' rows in order."""
    rows = [f for f in finals if f is not None]
    assert len(rows) == len(finals)
    return RolloutState(
        torch.cat([r.h for r in rows], 1),
        torch.cat([r.c for r in rows], 1),
        torch.cat([r.p for r in rows], 0),
    )
