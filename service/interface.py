"""What crosses a process or layer boundary: sequences, pieces, the runtime's surface, errors.

Light on purpose (numpy only, no torch): the HTTP workers, the codec, the IPC frames, the engine
and the models all import it, so an HTTP worker of ``rnnserve --workers N`` never loads torch.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Protocol, overload

import numpy as np

# -- sequences -----------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class FlatSequences(Sequence[np.ndarray]):
    """N sequences stored one after another: sequence ``i`` is ``data[starts[i]:ends[i]]``.

    ``data`` is ``[sum T_i, F]``, ``lengths`` ``[N]`` int64 (each >= 1). It is also a read-only
    sequence of the N ``[T_i, F]`` views, so it goes wherever a list of arrays went.
    """

    data: np.ndarray  # [sum T_i, F]
    lengths: np.ndarray  # [N] int64

    def __post_init__(self) -> None:
        if self.lengths.ndim != 1 or int(self.lengths.sum()) != len(self.data):
            raise ValueError(
                f"lengths {self.lengths.shape} do not add up to the {len(self.data)} rows of data"
            )

    @classmethod
    def from_arrays(cls, arrays: Sequence[np.ndarray], width: int | None = None) -> FlatSequences:
        """Concatenate ``[T_i, F]`` arrays (one copy). ``width`` is F when ``arrays`` is empty."""
        lengths = np.fromiter((len(a) for a in arrays), dtype=np.int64, count=len(arrays))
        if not arrays:
            return cls(np.empty((0, width or 0), np.float32), lengths)
        return cls(np.concatenate(arrays, axis=0), lengths)

    @property
    def total(self) -> int:
        """Rows in all: ``sum T_i``."""
        return len(self.data)

    @property
    def ends(self) -> np.ndarray:
        return np.cumsum(self.lengths)

    def __len__(self) -> int:
        return len(self.lengths)

    @overload
    def __getitem__(self, i: int) -> np.ndarray: ...
    @overload
    def __getitem__(self, i: slice) -> list[np.ndarray]: ...
    def __getitem__(self, i: int | slice) -> np.ndarray | list[np.ndarray]:
        views = self._views()
        return views[i]

    def __iter__(self) -> Iterator[np.ndarray]:
        return iter(self._views())

    def _views(self) -> list[np.ndarray]:
        return np.split(self.data, self.ends[:-1].tolist()) if len(self) else []


# one piece of a request's output: (sequence index in the request, first step, [n, 2] positions)
Piece = tuple[int, int, np.ndarray]


class UnknownModel(LookupError):
    """No served model has that name."""


class StartupError(RuntimeError):
    """The server cannot start as configured; the message names the file or setting."""


class StreamingUnavailable(ValueError):
    """The model cannot stream its output (not a continuously scheduled Traveller)."""


class NonFiniteInput(ValueError):
    """A request held a NaN or an infinity, found by the model while it ran (its own pass).

    ``sequence`` is the index, within the request, of the first sequence with one.
    """

    def __init__(self, sequence: int) -> None:
        super().__init__(f"sequence {sequence} holds a value that is not finite")
        self.sequence = sequence


class ServedInfo(Protocol):
    """What the HTTP layer reads of a served model."""

    @property
    def name(self) -> str: ...
    @property
    def kind(self) -> str: ...
    @property
    def input_dim(self) -> int: ...
    @property
    def info(self) -> dict[str, Any]: ...
    @property
    def checks_finite(self) -> bool:
        """Whether the model checks its inputs for NaN and infinity as it runs.

        If so, the HTTP layer may skip its own pass over a binary body: a request with such
        a value then fails alone with :class:`NonFiniteInput`.
        """
        ...


class Runtime(Protocol):
    """What the HTTP layer uses of a runtime: :class:`ModelRuntime` in this process, or
    :class:`rnnserve.service.ipc.worker_side.RemoteRuntime` in an HTTP worker of ``rnnserve
    --workers N``. Both raise the same errors: ``UnknownModel``, ``QueueFull``, ``BatcherClosed``,
    ``StreamingUnavailable``."""

    @property
    def models(self) -> Mapping[str, ServedInfo]: ...
    @property
    def available(self) -> bool: ...
    async def start(self) -> None: ...
    async def stop(self) -> None: ...
    def get(self, name: str) -> ServedInfo: ...
    async def infer(self, name: str, sequences: FlatSequences) -> FlatSequences: ...
    async def open_stream(
        self, name: str, sequences: FlatSequences
    ) -> AsyncIterator[list[Piece]]: ...


# The id of the request being served (set by the HTTP layer); items remember it when submitted.
REQUEST_ID: ContextVar[str | None] = ContextVar("rnnserve_request_id", default=None)


def is_out_of_memory(exc: BaseException) -> bool:
    """``torch.cuda.OutOfMemoryError``, ``MemoryError`` or any error that says "out of memory"
    (without importing torch: this layer knows nothing about models)."""
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return True
    return "out of memory" in str(exc).lower()


def mark_logged(exc: BaseException) -> None:
    """Note that ``exc`` was logged with its request ids (callers need not log it again)."""
    with contextlib.suppress(AttributeError):  # an exception without a __dict__
        exc.rnnserve_logged = True  # type: ignore[attr-defined]


def was_logged(exc: BaseException) -> bool:
    return bool(getattr(exc, "rnnserve_logged", False))


class BatcherError(Exception):
    """Base class for the batcher's own errors."""


class QueueFull(BatcherError):
    """The queue holds ``max_queue_size`` items already; try again later."""


class BatcherClosed(BatcherError):
    """The batcher is shutting down or stopped and takes no new items."""


class EngineUnavailable(ConnectionError):
    """The engine process is not reachable (it died, or the worker is shutting down)."""


@dataclass
class RequestError(Exception):
    """A client error: machine-readable ``type``, a message and a location.

    No status: the HTTP layer's error catalogue gives each ``type`` its own.
    """

    type: str
    message: str
    loc: tuple[str | int, ...] = ()

    def __str__(self) -> str:
        return self.message

    def body(self) -> dict[str, Any]:
        return {"detail": self.message, "type": self.type, "loc": list(self.loc)}


@dataclass(frozen=True)
class Limits:
    max_sequences: int
    max_sequence_length: int
    max_timesteps: int
