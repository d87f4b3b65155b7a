"""What crosses a process or layer boundary: sequences, pieces, the runtime's surface, errors.

Light on purpose (numpy only, no torch): the HTTP workers, the codec, the IPC frames, the engine
and the models all import it, so an HTTP worker of ``rnnserve --workers N`` never loads torch.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Protocol, overload

import numpy as np

# -- sequences -----------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class CarriedState:
    """The recurrent state of N sequences, tied to the model version that made it.

    ``tensors`` maps each part of the state to a float32 array with one row per sequence,
    ``[N, *shape]``: the shapes a served model's ``state_shapes`` names (a Traveller's ``h`` and
    ``c`` ``[N, layers, hidden]`` and ``p`` ``[N, 2]``; a smoother's ``s`` ``[N, F]``; a
    recurrent model's ``h``, and ``c`` for an LSTM). ``version`` is the model's
    :attr:`ServedInfo.version`: a state is only ever continued by the version that made it.
    """

    model: str
    version: str
    tensors: Mapping[str, np.ndarray]


@dataclass(frozen=True, eq=False)
class FlatSequences(Sequence[np.ndarray]):
    """N sequences stored one after another: sequence ``i`` is ``data[starts[i]:ends[i]]``.

    ``data`` is ``[sum T_i, F]``, ``lengths`` ``[N]`` int64 (each >= 1). It is also a read-only
    sequence of the N ``[T_i, F]`` views, so it goes wherever a list of arrays went.

    As a request, ``state`` is where its sequences start (``None``: the model's own start) and
    ``return_state`` asks for their final state; as an answer, ``state`` is that final state.
    """

    data: np.ndarray  # [sum T_i, F]
    lengths: np.ndarray  # [N] int64
    state: CarriedState | None = None
    return_state: bool = False

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

    def all_finite(self) -> bool:
        """No NaN and no infinity, in one pass without a copy: a float64 sum of float32 values
        cannot overflow, so it is finite exactly when every value is."""
        with np.errstate(invalid="ignore"):  # inf + -inf is NaN: found, not warned about
            return math.isfinite(np.sum(self.data, dtype=np.float64))

    def first_non_finite(self) -> int:
        """The index of the first sequence with a NaN or an infinity; ``-1``: none."""
        bad = ~np.isfinite(self.data).all(axis=1)
        if not bad.any():
            return -1
        return int(np.searchsorted(self.ends, int(np.argmax(bad)), side="right"))

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


class StateMismatch(ValueError):
    """A carried state made by another model, or by another version of this one."""


class ModelChanged(ValueError):
    """A reload changed the model after the request was checked against it: its rows are not
    the width the version serving now takes (the HTTP layer checked them against the old one)."""

    @classmethod
    def width(cls, name: str, version: str, width: int, given: int) -> ModelChanged:
        return cls(
            f"model '{name}' changed while this request was on its way: version '{version}' "
            f"takes {width} input features per step, the request's steps have {given}"
        )


class NonFiniteInput(ValueError):
    """A request's sequences hold a NaN or an infinity, found by the engine (or by the model in
    its own pass over them); the layer that has the request's body says where."""

    @classmethod
    def in_sequence(cls, sequence: int) -> NonFiniteInput:
        return cls(f"sequence {sequence} holds a value that is not finite")


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
    def version(self) -> str:
        """A fingerprint of the model's file (weights and config): the first hex digits of its
        sha256, so a reload tells a changed file from one written again unchanged."""

    @property
    def loaded_at(self) -> float:
        """When this version was loaded (Unix time)."""


def state_shapes(served: ServedInfo) -> Mapping[str, tuple[int, ...]] | None:
    """The parts of one sequence's carried state and their shapes (``{}``: the model cannot
    carry one); ``None``: the served object does not say."""
    shapes: Mapping[str, tuple[int, ...]] | None = getattr(served, "state_shapes", None)
    return shapes


@dataclass
class ReloadReport:
    """What one reload of the model directory did, by model name; ``failed`` maps a model (or
    ``""``: the directory itself) to why its new file was refused, its old version served on."""

    loaded: list[str] = field(default_factory=list)  # new names, now served
    changed: list[str] = field(default_factory=list)  # a new version swapped in
    removed: list[str] = field(default_factory=list)  # file gone: no longer served
    unchanged: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)

    @property
    def changes_models(self) -> bool:
        return bool(self.loaded or self.changed or self.removed)

    def as_json(self) -> dict[str, Any]:
        return {
            "loaded": self.loaded,
            "changed": self.changed,
            "removed": self.removed,
            "unchanged": self.unchanged,
            "failed": [{"model": name or None, "error": why} for name, why in self.failed.items()],
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> ReloadReport:
        failed = {f["model"] or "": f["error"] for f in doc["failed"]}
        return cls(doc["loaded"], doc["changed"], doc["removed"], doc["unchanged"], failed)


class Runtime(Protocol):
    """What the HTTP layer uses of a runtime: :class:`ModelRuntime` in this process, or
    :class:`rnnserve.service.ipc.worker_side.RemoteRuntime` in an HTTP worker of ``rnnserve
    --workers N``. Both raise the same errors: ``UnknownModel``, ``QueueFull``, ``BatcherClosed``,
    ``StreamingUnavailable``, ``ModelChanged`` for rows checked against a version a reload has
    replaced since, and ``NonFiniteInput`` for sequences that hold a NaN or an
    infinity (the HTTP layer need not check binary bodies for them).

    ``models`` is replaced, never changed in place, when a reload changes what is served; the
    callbacks given to ``on_models_changed`` are called then (``/openapi.json`` is rebuilt)."""

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
    async def reload(self) -> ReloadReport: ...
    def on_models_changed(self, callback: Callable[[], None]) -> None: ...


@dataclass(eq=False)
class RequestContext:
    """The request a task serves, as every layer of its process sees it.

    The HTTP layer opens one per request (:func:`open_request`); the batchers read it when an
    item is submitted, log a model's failure with the ids of the requests it hit and note it
    here, so that the layer that answers the request does not log the same failure again. The
    engine process opens one per call from the id the worker sent.
    """

    request_id: str
    failure_logged: bool = False


_CURRENT_REQUEST: ContextVar[RequestContext | None] = ContextVar("rnnserve_request", default=None)


def open_request(request_id: str) -> RequestContext:
    """Begin serving request ``request_id`` in this task (and the tasks it starts)."""
    context = RequestContext(request_id)
    _CURRENT_REQUEST.set(context)
    return context


def current_request() -> RequestContext | None:
    """The request this task serves; ``None`` outside one."""
    return _CURRENT_REQUEST.get()


def is_out_of_memory(exc: BaseException) -> bool:
    """``torch.cuda.OutOfMemoryError``, ``MemoryError`` or any error that says "out of memory"
    (without importing torch: this layer knows nothing about models)."""
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return True
    return "out of memory" in str(exc).lower()


class BatcherError(Exception):
    """Base class for the batcher's own errors."""


class QueueFull(BatcherError):
    """The queue holds ``max_queue_size`` items already; try again later."""


class BatcherClosed(BatcherError):
    """The batcher is shutting down or stopped and takes no new items."""


class EngineUnavailable(ConnectionError):
    """The engine process is not reachable (it died, or the worker is shutting down)."""


QUOTE_CHARS = 64  # the most of a client's text an error message repeats


def quote(text: object, limit: int = QUOTE_CHARS) -> str:
    """``text`` (a name, key or value the client sent) as an error may repeat it: whole when it
    is at most ``limit`` characters, else its first ``limit`` and an ellipsis. An error answer
    then stays small whatever the client sent, and never echoes its input back."""
    text = text if isinstance(text, str) else str(text)
    return text if len(text) <= limit else text[:limit] + "…"


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
