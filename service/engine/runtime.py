"""Serving runtime: loads the models, owns one worker thread and one batcher per model.

The HTTP layer calls :meth:`ModelRuntime.infer`; the batcher gathers concurrent calls, and each
batch is packed, run and unpacked on the model's own worker thread under
``torch.inference_mode()``, never on the event loop. Each model has its own thread, so a long
batch of one model never delays another model's batches. Rollouts are scheduled continuously by
default (:mod:`rnnserve.service.engine.continuous`, :mod:`rnnserve.service.engine.chunked_rollout`):
sequences join and leave the running batch between chunks of steps, so a short rollout never waits
for a long one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence

from rnnserve import models
from rnnserve.models import torchscript
from rnnserve.models.packing import active_fraction, pack_flat, plan, unpack_flat
from rnnserve.models.recurrent import RecurrentModel, RecurrentState
from rnnserve.models.smoothing import LinearRecursion
from rnnserve.models.traveller import RolloutState, Traveller
from rnnserve.service import examples
from rnnserve.service.config import Settings
from rnnserve.service.engine.batcher import DynamicBatcher, ItemError, TimedResults
from rnnserve.service.engine.chunked_rollout import ChunkedRollout
from rnnserve.service.engine.continuous import ChunkOutcome, ContinuousBatcher
from rnnserve.service.engine.reload import (
    directory_state,
    file_version,
    model_file,
    poll_directory,
)
from rnnserve.service.interface import (
    CarriedState,
    FlatSequences,
    ModelChanged,
    NonFiniteInput,
    Piece,
    ReloadReport,
    StartupError,
    StateMismatch,
    StreamingUnavailable,
    UnknownModel,
    is_out_of_memory,
    quote,
)
from rnnserve.service.memory import settle_garbage_collector
from rnnserve.service.metrics import Metrics

log = logging.getLogger(__name__)

A = TypeVar("A")

# One request's sequences in ([sum T_i, input_dim] rows + lengths), its outputs out.
Item = FlatSequences


@dataclass
class ServedModel:
    name: str
    kind: str
    module: nn.Module
    input_dim: int
    info: dict[str, Any]
    batcher: DynamicBatcher[Item, Item] | ContinuousBatcher[Item, Item] = field(repr=False)
    executor: ThreadPoolExecutor = field(repr=False)
    checks_finite: bool = False  # the model finds NaN and infinity in its own pass over them
    version: str = ""  # a fingerprint of the file it was loaded from (reload.file_version)
    loaded_at: float = 0.0  # Unix time
    # one sequence's carried state: its parts and their shapes ({}: the model carries none)
    state_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)


def state_shapes_of(module: nn.Module) -> dict[str, tuple[int, ...]]:
    """The parts of one sequence's state a model carries from one piece of a stream to the
    next, and their shapes: what :func:`run_with_state` takes and returns, per sequence."""
    if isinstance(module, LinearRecursion):
        return {"s": (module.feat_dim,)}  # the smoothed value s_t of each feature
    if isinstance(module, Traveller):
        layers = (module.num_layers, module.hidden_size)
        return {"h": layers, "c": layers, "p": (2,)}  # p: the last position, fed back
    if isinstance(module, RecurrentModel):
        cfg = module.config
        layers = (cfg.num_layers, cfg.hidden_size)
        return {"h": layers, "c": layers} if cfg.cell == "lstm" else {"h": layers}
    return {}  # a TorchScript module's state is its own business


def run_with_state(
    module: nn.Module, packed: PackedSequence, init: dict[str, torch.Tensor] | None
) -> tuple[PackedSequence, dict[str, torch.Tensor]]:
    """One forward pass from ``init`` (``None``: the model's own start), and the final state.

    States are ``{part: [B, *shape]}`` (:func:`state_shapes_of`), row ``i`` of sequence ``i``
    in the order the sequences were packed; the models keep layers first, so ``h`` and ``c``
    are turned to ``[layers, B, hidden]`` and back."""
    if isinstance(module, LinearRecursion):
        out, s = module.forward_with_state(packed, None if init is None else init["s"])
        return out, {"s": s}
    if isinstance(module, Traveller):
        start = None
        if init is not None:
            start = RolloutState(_layers_first(init["h"]), _layers_first(init["c"]), init["p"])
        positions, final = module.rollout_with_state(packed, start)
        return positions, {"h": _layers_first(final.h), "c": _layers_first(final.c), "p": final.p}
    if isinstance(module, RecurrentModel):
        begin = None
        if init is not None:
            c = init.get("c")
            begin = RecurrentState(
                _layers_first(init["h"]), None if c is None else _layers_first(c)
            )
        y, end = module.forward_with_state(packed, begin)
        parts = {"h": _layers_first(end.h)}
        if end.c is not None:
            parts["c"] = _layers_first(end.c)
        return y, parts
    raise TypeError(f"{type(module).__name__} carries no state")


def _layers_first(t: torch.Tensor) -> torch.Tensor:
    """``[B, L, H]`` <-> ``[L, B, H]``."""
    return t.transpose(0, 1).contiguous()


def _stateful(items: Sequence[Item]) -> bool:
    return any(item.state is not None or item.return_state for item in items)


def _batch_start(
    module: nn.Module, items: Sequence[Item], device: torch.device
) -> dict[str, torch.Tensor] | None:
    """The batch's initial state, ``{part: [B, *shape]}``: each item's own, or the model's own
    start for an item without one (zeros; for the smoother, ``s_{-1} = x_0``, which makes
    ``s_0 = x_0`` as a fresh sequence has it); ``None`` when no item brings a state."""
    if all(item.state is None for item in items):
        return None
    shapes = state_shapes_of(module)
    dtype = next(module.parameters()).dtype
    parts: dict[str, list[np.ndarray]] = {name: [] for name in shapes}
    for item in items:
        for name, shape in shapes.items():
            if item.state is not None:
                rows = np.asarray(item.state.tensors[name], np.float32)
            elif name == "s":
                rows = item.data[item.ends - item.lengths]  # each sequence's first step
            else:
                rows = np.zeros((len(item), *shape), np.float32)
            parts[name].append(rows)
    return {
        name: torch.from_numpy(np.concatenate(rows)).to(device=device, dtype=dtype)
        for name, rows in parts.items()
    }


def _smoother_start(items: Sequence[Item], width: int) -> tuple[np.ndarray, np.ndarray]:
    """The smoother's batch start for its flat kernel: each sequence's carried ``s`` (``[B,
    F]``) and whether it has one (the others start from their first step, in the kernel)."""
    n = sum(len(item) for item in items)
    start = np.zeros((n, width), np.float32)
    given = np.zeros(n, np.bool_)
    row = 0
    for item in items:
        if item.state is not None:
            start[row : row + len(item)] = item.state.tensors["s"]
            given[row : row + len(item)] = True
        row += len(item)
    return start, given


def _refuse_another_width(served: ServedModel, sequences: Item) -> None:
    """Raise :class:`ModelChanged` for rows of another width than the model takes: the HTTP
    layer checked them against the version a reload has replaced since (the model itself would
    fail on them)."""
    given = sequences.data.shape[1] if sequences.data.ndim == 2 else 0
    if sequences.total and given != served.input_dim:
        raise ModelChanged.width(served.name, served.version, served.input_dim, given)


def _refuse_non_finite(served: ServedModel, sequences: Item) -> None:
    """Raise :class:`NonFiniteInput` for sequences with a NaN or an infinity, unless the model
    finds them in its own pass (then only that request fails, not its batch)."""
    if not served.checks_finite and not sequences.all_finite():
        raise NonFiniteInput.in_sequence(sequences.first_non_finite())


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def preflight(settings: Settings) -> list[str]:
    """Check the device and every model file before serving; the names of the models.

    Fails closed: an unavailable device, a missing or empty model directory, a pickle in it,
    or a file that is not a servable model raises :class:`StartupError` with one line that
    names the setting or file and says what to do.
    """
    check_device(settings)
    names = check_model_dir(settings)
    for name in names:
        check_model(name, settings)
    return names


def check_device(settings: Settings) -> None:
    device = resolve_device(settings.device)
    if device.type != "cuda":
        return
    if not torch.cuda.is_available():
        why = "this torch build has no CUDA" if torch.version.cuda is None else "no GPU found"
        raise StartupError(
            f"--device {settings.device}: CUDA is not available ({why}); "
            "use --device cpu, or auto to take a GPU when there is one"
        )
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise StartupError(
            f"--device {settings.device}: this host has {torch.cuda.device_count()} GPU(s)"
        )


def check_model_dir(settings: Settings) -> list[str]:
    """The checks of the whole model directory (at start-up and at each reload): it exists,
    holds no pickle, no untrusted TorchScript file, and at least one model; their names."""
    where = settings.model_dir
    if where is not None and not where.is_dir():
        raise StartupError(f"--model-dir {where}: no such directory")
    for path in models.pickles(where):
        if torchscript.looks_like_archive(path):  # read as a zip only
            stem = path.name.removesuffix(path.suffix)
            raise StartupError(
                f"{path}: a TorchScript archive under a pickle's name is refused; TorchScript "
                f"files are code: name it {stem}{torchscript.SUFFIX} and set "
                "RNNSERVE_TRUST_TORCHSCRIPT=true (--trust-torchscript) if you trust it"
            )
        raise StartupError(
            f"{path}: pickle files are refused (loading one can run code); export the model "
            "as <name>.safetensors with rnnserve export, or move the file out of the model "
            "directory"
        )
    if not settings.trust_torchscript:
        for path in models.torchscript_files(where):
            raise StartupError(
                f"{path}: TorchScript files are code that runs in the server when loaded, so "
                "they are refused unless you trust them: set RNNSERVE_TRUST_TORCHSCRIPT=true "
                "(--trust-torchscript) to serve it"
            )
    names = models.available(where)
    if not names:
        raise StartupError(
            f"--model-dir {where}: holds no <name>.safetensors model; nothing to serve"
        )
    return names


def check_model(name: str, settings: Settings) -> None:
    """Model ``name``'s file is a servable model (``models.read``: loading runs the same)."""
    try:
        models.read(name, settings.model_dir, trust_torchscript=settings.trust_torchscript)
    except (models.ModelLoadError, models.ModelNotFound) as exc:
        raise StartupError(str(exc)) from exc


def run_model(module: nn.Module, packed: PackedSequence) -> PackedSequence:
    """One forward pass of any kind of model over a packed batch (a smoother or a
    :class:`RecurrentModel` maps PackedSequence to PackedSequence; a Traveller rolls out)."""
    if isinstance(module, Traveller):
        return module.rollout(packed)
    out: PackedSequence = module(packed)
    return out


class ModelRuntime:
    """Models, their batchers and the worker thread, started and stopped with the app.

    Each version of a model has its own batcher and worker thread: a reload loads and warms a
    new version beside the one being served, then swaps it in, and the old version finishes
    the requests it was given, so a batch always runs on exactly one version.
    """

    def __init__(self, settings: Settings, metrics: Metrics | None = None) -> None:
        self.settings = settings
        self.metrics = metrics
        self.device = resolve_device(settings.device)
        self.models: dict[str, ServedModel] = {}  # replaced, never changed, by a reload
        # new models a reload has started but not listed yet: requests reach them while the
        # HTTP workers of --workers N learn their names (then they are listed)
        self.staged: dict[str, ServedModel] = {}
        self._listeners: list[Callable[[], object]] = []
        self._reloading = asyncio.Lock()  # one reload at a time, whatever asked for it
        self._loop: asyncio.AbstractEventLoop | None = None
        self._poll: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[Any]] = set()  # reloads asked for, old versions

    # -- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        torch.set_num_threads(self.settings.torch_threads)
        self._loop = asyncio.get_running_loop()
        files = directory_state(self.settings.model_dir)  # a change while loading: reloaded
        served: dict[str, ServedModel] = {}
        try:
            for name in preflight(self.settings):
                served[name] = await self._load_version(name)
        except BaseException:
            for loaded in served.values():
                loaded.executor.shutdown(wait=False)
            raise
        for loaded in served.values():
            loaded.batcher.start()
        self.models = served
        log.info("serving %s on %s", ", ".join(sorted(self.models)), self.device)
        if self.settings.reload_poll_s > 0:
            where, period = self.settings.model_dir, self.settings.reload_poll_s
            self._poll = asyncio.ensure_future(poll_directory(where, period, self.reload, files))

    async def stop(self) -> None:
        self._loop = None  # a reload asked for now is refused: the batchers are closing
        if self._poll is not None:
            self._poll.cancel()
        async with self._reloading:  # one under way swaps its versions in first
            pass
        while self._background:  # a reload under way, old versions finishing their requests
            await asyncio.gather(*list(self._background), return_exceptions=True)
        await asyncio.gather(
            *(m.batcher.close(self.settings.drain_timeout_s) for m in self.models.values())
        )
        for served in self.models.values():
            served.executor.shutdown(wait=True)

    async def _load_version(self, name: str) -> ServedModel:
        """Load, warm and describe the model in ``name``'s file now, on a new worker thread
        (the thread that loads and warms a model is the one that runs it); not started."""
        threads = self.settings.torch_threads
        executor = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix=f"rnnserve-{name}",
            initializer=torch.set_num_threads,
            initargs=(threads,),
        )
        loop = asyncio.get_running_loop()
        try:
            module, version = await loop.run_in_executor(executor, self._load_and_warm, name)
            example = await loop.run_in_executor(executor, self._example, name, module)
        except BaseException:
            executor.shutdown(wait=False)
            raise
        served = self._serve(name, module, executor)
        served.version, served.loaded_at = version, time.time()
        # the documented request and its real answer (GET /models, /openapi.json)
        served.info["example"] = example
        return served

    # -- reloads ----------------------------------------------------------------------------

    def on_models_changed(self, callback: Callable[[], object]) -> None:
        """Call ``callback`` (on the event loop) each time a reload changes the served or the
        staged models. A callback may return an awaitable (the engine's announcement to the
        HTTP workers): the reload waits for it before it lists the staged models, and before
        it returns."""
        self._listeners.append(callback)

    def reload_soon(self, why: str = "SIGHUP") -> None:
        """Reload in the background; safe from a signal handler or another thread."""
        if self._loop is None:
            log.warning("%s: the models are not being served (starting or stopping); ignored", why)
            return
        self._loop.call_soon_threadsafe(self._reload_in_background, why)

    def _reload_in_background(self, why: str) -> None:
        log.info("%s: reloading the model directory", why)
        self._keep(asyncio.ensure_future(self.reload()))

    def _keep(self, task: asyncio.Task[Any]) -> None:
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def reload(self) -> ReloadReport:
        """Serve what the model directory holds now: each new or changed file is checked as at
        start-up, loaded and warmed beside the version served, then swapped in; a file that
        fails leaves its model on the old version; a removed file stops its model once its
        requests are done. A directory that fails the start-up checks changes nothing."""
        async with self._reloading:
            report = ReloadReport()
            if self._loop is None:
                report.failed[""] = "the models are not being served (starting or stopping)"
                return report
            try:
                names = await asyncio.to_thread(check_model_dir, self.settings)
            except StartupError as exc:
                log.error("reload refused, nothing changed: %s", exc)
                report.failed[""] = str(exc)
            else:
                fresh: dict[str, ServedModel] = {}
                for name in names:
                    await self._reload_one(name, report, fresh)
                for name in self.models:
                    if name not in names:
                        self._remove(name, report)
                await self._stage({n: m for n, m in fresh.items() if n not in self.models})
                await self._wait_for(self._swap(fresh, report.removed))
            self._count(report)
            return report

    async def _reload_one(
        self, name: str, report: ReloadReport, fresh: dict[str, ServedModel]
    ) -> None:
        old = self.models.get(name)
        try:
            path = model_file(name, self.settings.model_dir)
            version = await asyncio.to_thread(file_version, path)
            if old is not None and old.version == version:
                report.unchanged.append(name)
                return
            served = await self._load_version(name)
        except Exception as exc:  # any failure keeps the old version serving
            self._refuse(name, old, str(exc), report)
            return
        refusal = self._default_refusal(name, served.kind)
        if refusal is not None:
            served.executor.shutdown(wait=False)
            self._refuse(name, old, refusal, report)
            return
        fresh[name] = served
        if old is None:
            report.loaded.append(name)
            log.info("reload: serving the new model %s, version %s", name, served.version)
        else:
            report.changed.append(name)
            log.info("reload: %s is now version %s (was %s)", name, served.version, old.version)

    def _refuse(self, name: str, old: ServedModel | None, why: str, report: ReloadReport) -> None:
        report.failed[name] = why
        kept = f"version {old.version} serves on" if old is not None else "not served"
        log.error("reload: the new file of %s is refused (%s): %s", name, kept, why)

    def _remove(self, name: str, report: ReloadReport) -> None:
        refusal = self._default_refusal(name, None)
        if refusal is not None:
            self._refuse(name, self.models[name], refusal, report)
            return
        report.removed.append(name)
        log.info("reload: %s's file is gone; it stops once its requests are done", name)

    def _default_refusal(self, name: str, kind: str | None) -> str | None:
        """Why a reload may not make model ``name`` a ``kind`` model (``None``: remove it),
        if it is a configured default: the start-up refuses such a server too."""
        configured = {
            "smoother": self.settings.default_smoother,
            "traveller": self.settings.default_traveller,
        }
        for wanted, default in configured.items():
            if name == default and kind != wanted:
                change = "remove it" if kind is None else f"make it a {kind}"
                return f"'{name}' is --default-{wanted}: a reload may not {change}"
        return None

    async def _stage(self, new: dict[str, ServedModel]) -> None:
        """Start the models new to the server and take requests for them, unlisted, until
        every listener has them: with --workers N every HTTP worker then accepts their names
        before any worker lists them, so none answers 404 for a model another one lists."""
        if not new:
            return
        for served in new.values():
            served.batcher.start()
        self.staged = new
        await self._wait_for(self._tell_listeners())

    def _swap(self, fresh: dict[str, ServedModel], removed: list[str]) -> list[Awaitable[object]]:
        """Serve ``fresh`` and stop serving ``removed``, in one step on the event loop: each
        request then goes to one version, which runs its whole batch. What the listeners
        returned to wait for."""
        if not fresh and not removed:
            return []
        for served in fresh.values():
            served.batcher.start()  # a staged one's is running already
        old = [self.models[name] for name in (*fresh, *removed) if name in self.models]
        kept = {name: m for name, m in self.models.items() if name not in removed}
        self.models = dict(sorted({**kept, **fresh}.items()))
        self.staged = {}
        waits = self._tell_listeners()
        self._keep(asyncio.ensure_future(self._retire(old)))
        return waits

    def _tell_listeners(self) -> list[Awaitable[object]]:
        waits: list[Awaitable[object]] = []
        for callback in self._listeners:
            try:
                result = callback()
            except Exception:
                log.exception("a listener of the model list failed")
                continue
            if inspect.isawaitable(result):
                waits.append(result)
        return waits

    async def _wait_for(self, waits: list[Awaitable[object]]) -> None:
        """Wait for what the listeners returned; a listener that fails is logged, not the
        reload's failure (each bounds its own wait)."""
        for outcome in await asyncio.gather(*waits, return_exceptions=True):
            if isinstance(outcome, Exception):
                log.error("a listener of the model list failed: %s", outcome)

    async def _retire(self, old: list[ServedModel]) -> None:
        """Let old versions finish the requests they were given, then free them."""
        await asyncio.gather(*(m.batcher.close(self.settings.drain_timeout_s) for m in old))
        for served in old:
            served.executor.shutdown(wait=False)
        if gc.get_freeze_count():  # the old versions were frozen with the rest: let them go
            gc.unfreeze()
            settle_garbage_collector()

    def _count(self, report: ReloadReport) -> None:
        if self.metrics is None:
            return
        counter = self.metrics.model_reloads
        for result, names in (
            ("loaded", report.loaded),
            ("changed", report.changed),
            ("removed", report.removed),
            ("failed", report.failed),
        ):
            if names:
                counter.labels(result).inc(len(names))

    def _read(self, name: str) -> tuple[nn.Module, str]:
        """The model in ``name``'s file, on the device, and the version it was read from."""
        path = model_file(name, self.settings.model_dir)
        version = file_version(path)
        module = models.load(
            name,
            self.settings.model_dir,
            device=self.device,
            rollout_backend=self.settings.rollout_backend,
            rollout_gemm_routes=self.settings.rollout_gemm_routes,
            trust_torchscript=self.settings.trust_torchscript,
        )
        if file_version(path) != version:  # replaced while it was read: which one is this?
            raise models.ModelLoadError(f"{path}: the file changed while it was read")
        return module, version

    def _load_and_warm(self, name: str) -> tuple[nn.Module, str]:
        started = time.perf_counter()
        module, version = self._read(name)
        dim = _input_dim(module)
        if isinstance(module, Traveller) and module.rollout_backend == "triton":
            from rnnserve.models.kernels.rollout_triton import warm_up

            # compile the kernels and capture the CUDA graphs of every batch-size bucket now
            warm_up(
                self.settings.max_batch_size,
                module.num_layers,
                module.hidden_size,
                module.num_inputs,
                dtype=next(module.parameters()).dtype,
                device=self.device,
            )
        if isinstance(module, LinearRecursion):
            # every tile plan's kernels (Triton on CUDA; nothing on the CPU): a plan first met
            # while serving would stall its batch for a compile
            t0 = time.perf_counter()
            plans = module.warm_up(self.settings.max_sequence_length)
            if plans:
                log.info(
                    "%s: compiled the Triton smoother's %d tile plans in %.1f s",
                    name,
                    plans,
                    time.perf_counter() - t0,
                )
        rng = np.random.default_rng(0)
        # a few batches of mixed lengths: compiles numba, lets TorchScript profile and optimise
        for lengths in ((3,), (5, 2), (7, 7, 1), (4,)):
            arrays = [rng.standard_normal((n, dim), np.float32) for n in lengths]
            self._compute(name, module, [FlatSequences.from_arrays(arrays)], record=False)
            if isinstance(module, Traveller):
                chunked = ChunkedRollout(module, self.device, 2)
                chunked.advance([(0, arrays)], [])  # the resumable path too
                while chunked.running_sequences:
                    chunked.advance([], [])
        self._warm_state(name, module, dim)
        log.info("loaded and warmed %s in %.2f s", name, time.perf_counter() - started)
        return module, version

    def _warm_state(self, name: str, module: nn.Module, dim: int) -> None:
        """Run the carried-state paths once (a kernel they compile would stall a request)."""
        shapes = state_shapes_of(module)
        if not shapes:
            return
        rows = np.random.default_rng(1).standard_normal((5, dim), np.float32)
        asked = FlatSequences(rows, np.array([3, 2]), return_state=True)
        [out] = self._compute(name, module, [asked], record=False)
        assert isinstance(out, FlatSequences)
        assert out.state is not None
        again = FlatSequences(rows, np.array([3, 2]), out.state, return_state=True)
        self._compute(name, module, [again, asked], record=False)
        if isinstance(module, Traveller):
            chunked = ChunkedRollout(module, self.device, 2)
            chunked.advance([(0, list(again))], [], {0: _rollout_start(again)}, [0])
            while chunked.running_sequences:
                chunked.advance([], [])

    def _example(self, name: str, module: nn.Module) -> dict[str, Any]:
        """The model's answer to the documented example request, computed the way a lone
        request is (its own batch; rollouts a chunk at a time when scheduled so), on the
        model's worker thread and outside the batcher (no metrics)."""
        inputs = examples.example_inputs(_input_dim(module))
        arrays = examples.as_arrays(inputs)
        outputs: Any
        if isinstance(module, Traveller) and self.settings.rollout_scheduling == "continuous":
            chunked = ChunkedRollout(module, self.device, self.settings.rollout_chunk_steps)
            done, _, _ = chunked.advance([(0, arrays)], [])
            while chunked.running_sequences:
                done, _, _ = chunked.advance([], [])
            outputs = done[0]
        else:
            [outputs] = self._compute(name, module, [FlatSequences.from_arrays(arrays)], False)
        return {"inputs": inputs, "outputs": examples.as_json(outputs)}

    def _serve(self, name: str, module: nn.Module, executor: ThreadPoolExecutor) -> ServedModel:
        s = self.settings
        batcher: DynamicBatcher[Item, Item] | ContinuousBatcher[Item, Item]
        if isinstance(module, Traveller) and s.rollout_scheduling == "continuous":
            chunked = ChunkedRollout(module, self.device, s.rollout_chunk_steps)

            async def advance(
                joins: list[tuple[int, Item]], leaves: list[int], unchanged: Callable[[], bool]
            ) -> ChunkOutcome[Item]:
                loop = asyncio.get_running_loop()
                # own copies: a binary request's rows are read-only views of its body
                lists = [(key, [a.copy() for a in item]) for key, item in joins]
                starts = {
                    key: _rollout_start(item) for key, item in joins if item.state is not None
                }
                keep = [key for key, item in joins if item.return_state]
                (done, progress, steps, finals), seconds = await loop.run_in_executor(
                    executor, _timed, _advance, chunked, lists, leaves, starts, keep, unchanged
                )
                if self.metrics is not None and steps:
                    fraction = self.metrics.batch_active_fraction.labels(name)
                    fraction.observe(chunked.last_active_fraction)
                flat = {
                    key: dataclasses.replace(
                        FlatSequences.from_arrays(out, 2), state=_rollout_end(name, finals.get(key))
                    )
                    for key, out in done.items()
                }
                return ChunkOutcome(flat, progress, steps, seconds)

            batcher = ContinuousBatcher(
                advance,
                max_active=s.max_batch_size,
                max_queue_size=s.max_queue_size,
                name=name,
                observer=self.metrics,
                max_split_depth=s.batch_split_depth,
            )
        else:

            async def handle(items: list[Item]) -> list[Item | ItemError]:
                loop = asyncio.get_running_loop()
                results, seconds = await loop.run_in_executor(
                    executor, _timed, self._compute, name, module, items
                )
                return TimedResults(results, seconds)

            batcher = DynamicBatcher(
                handle,
                max_batch_size=s.max_batch_size,
                max_batch_cost=s.max_batch_timesteps,
                max_delay_s=s.max_delay_ms / 1000,
                max_queue_size=s.max_queue_size,
                name=name,
                observer=self.metrics,
                max_split_depth=s.batch_split_depth,
            )
        info = models.describe(module)
        checks = self._checks_finite(module)
        served = ServedModel(
            name, info["kind"], module, _input_dim(module), info, batcher, executor, checks
        )
        served.state_shapes = state_shapes_of(module)
        return served

    def _checks_finite(self, module: nn.Module) -> bool:
        # the smoother's CPU kernel checks its inputs in the pass that smooths them
        return isinstance(module, LinearRecursion) and self.device.type == "cpu"

    # -- inference ------------------------------------------------------------------------

    @property
    def available(self) -> bool:
        """Always: the models live in this process (an HTTP worker's runtime may lose them)."""
        return True

    def get(self, name: str) -> ServedModel:
        try:
            return self.models[name]
        except KeyError:
            staged = self.staged.get(name)
            if staged is not None:
                return staged
            known = ", ".join(sorted(self.models)) or "none"
            raise UnknownModel(f"no model named '{quote(name)}' (served: {known})") from None

    def stream(self, name: str, sequences: Item) -> AsyncIterator[list[Piece]]:
        """Roll ``sequences`` out through Traveller ``name``, yielding output chunk by chunk.

        Each item is the list of pieces ``(sequence index, first step, [n, 2] positions)``
        that one chunk of steps produced. Needs continuous rollout scheduling.
        """
        served = self.get(name)
        if not isinstance(served.batcher, ContinuousBatcher):
            raise StreamingUnavailable(
                f"model '{name}' cannot stream: streaming needs a Traveller with "
                "continuous rollout scheduling"
            )
        _refuse_another_width(served, sequences)
        _refuse_non_finite(served, sequences)
        _check_state(served, sequences)
        return served.batcher.stream(
            sequences, size=len(sequences), cost=sum(len(s) for s in sequences)
        )

    async def open_stream(self, name: str, sequences: Item) -> AsyncIterator[list[Piece]]:
        """:meth:`stream`, awaitable: the same for this runtime, needed across processes."""
        return self.stream(name, sequences)

    async def infer(self, name: str, sequences: Item | list[np.ndarray]) -> Item:
        """Run ``sequences`` (float32, ``input_dim`` wide) through model ``name``."""
        served = self.get(name)
        if not isinstance(sequences, FlatSequences):
            sequences = FlatSequences.from_arrays(sequences, served.input_dim)
        _refuse_another_width(served, sequences)
        _refuse_non_finite(served, sequences)
        _check_state(served, sequences)
        out = await served.batcher.submit(sequences, size=len(sequences), cost=sequences.total)
        if out.state is not None:  # made by this version: its batcher ran the batch
            state = CarriedState(name, served.version, out.state.tensors)
            out = dataclasses.replace(out, state=state)
        return out

    def _compute(
        self, name: str, module: nn.Module, items: Sequence[Item], record: bool = True
    ) -> list[Item | ItemError]:
        """Runs on the worker thread: pack every sequence of every item, run once, split.

        Rows go straight from each request's flat array to their packed rows, and back to one
        flat output array in request order, each in one pass (no padding). The smoother on the
        CPU skips packing: its recursion is per sequence, so it runs on the rows as they come.
        """
        lengths = np.concatenate([item.lengths for item in items])
        finite: np.ndarray | None = None
        final: dict[str, np.ndarray] | None = None
        if self._checks_finite(module):
            assert isinstance(module, LinearRecursion)
            # the recursion is per sequence: run it on the requests' own rows, no packing, and
            # check them for NaN and infinity in the same pass (a bad row spoils only its own
            # sequence's outputs, which are then not sent); a carried state in the same pass,
            # so that a sequence's answer is the same bits whether or not it asks for its state
            data = items[0].data if len(items) == 1 else np.concatenate([i.data for i in items])
            finite = np.empty(len(lengths), np.bool_)
            if _stateful(items):
                rows, given = _smoother_start(items, module.feat_dim)
                flat, last = module.smooth_flat_with_state(data, lengths, rows, given, finite)
                final = {"s": last.astype(np.float32, copy=False)}
            else:
                flat = module.smooth_flat(data, lengths, finite)
        elif _stateful(items):
            layout = plan(lengths)
            with torch.inference_mode():
                packed = pack_flat([item.data for item in items], lengths, self.device, layout)
                start = _batch_start(module, items, self.device)
                out, end = run_with_state(module, packed, start)
                flat = unpack_flat(out.cpu(), lengths, layout).numpy()
                final = {part: t.float().cpu().numpy() for part, t in end.items()}
        else:
            layout = plan(lengths)
            with torch.inference_mode():
                packed = pack_flat([item.data for item in items], lengths, self.device, layout)
                out = run_model(module, packed)
                flat = unpack_flat(out.cpu(), lengths, layout).numpy()  # [sum T, out_dim]
        if record and self.metrics is not None:
            frac = active_fraction(lengths)
            self.metrics.batch_active_fraction.labels(name).observe(frac)
        results: list[Item | ItemError] = []
        row = seq = 0
        for item in items:
            ok = finite[seq : seq + len(item)] if finite is not None else None
            if ok is not None and not ok.all():
                results.append(ItemError(NonFiniteInput.in_sequence(int(np.argmin(ok)))))
            else:
                state = None
                if final is not None and item.return_state:
                    tensors = {part: t[seq : seq + len(item)] for part, t in final.items()}
                    state = CarriedState(name, "", tensors)  # infer names the version
                rows = flat[row : row + item.total]
                results.append(FlatSequences(rows, item.lengths, state))
            row += item.total
            seq += len(item)
        return results


def _check_state(served: ServedModel, sequences: Item) -> None:
    """Refuse a state another model or version made; one from this version runs on it."""
    state = sequences.state
    if state is not None and (state.model, state.version) != (served.name, served.version):
        raise StateMismatch(
            f"the state was made by model '{quote(state.model)}' version "
            f"'{quote(state.version)}'; '{served.name}' is version '{served.version}' now"
        )


def _rollout_start(item: Item) -> RolloutState:
    """A request's carried state as the Traveller holds it (layers first)."""
    assert item.state is not None
    t = {k: torch.from_numpy(np.array(v, np.float32)) for k, v in item.state.tensors.items()}
    return RolloutState(_layers_first(t["h"]), _layers_first(t["c"]), t["p"])


def _rollout_end(name: str, final: RolloutState | None) -> CarriedState | None:
    if final is None:
        return None
    tensors = {
        "h": _layers_first(final.h).numpy(),
        "c": _layers_first(final.c).numpy(),
        "p": final.p.contiguous().numpy(),
    }
    return CarriedState(name, "", tensors)  # infer names the version


def _advance(
    chunked: ChunkedRollout,
    joins: list[tuple[int, list[np.ndarray]]],
    leaves: list[int],
    starts: dict[int, RolloutState],
    keep: list[int],
    unchanged: Callable[[], bool],
) -> tuple[dict[int, list[np.ndarray]], dict[int, list[Piece]], int, dict[int, RolloutState]]:
    """Chunks of the continuous rollout: one with the joins and leaves, then more while the
    batcher has nothing new (``unchanged()``) and no request has finished. Returns the finished
    requests, the progress of every chunk, the steps run, and the final states of the finished
    requests that asked for them (read on the worker thread, before the next chunk)."""
    done, progress, steps = chunked.advance(joins, leaves, starts, keep)
    while not done and chunked.running_sequences and unchanged():
        done, more, more_steps = chunked.advance([], [])
        steps += more_steps
        for key, pieces in more.items():
            progress.setdefault(key, []).extend(pieces)
    return done, progress, steps, dict(chunked.finished_states)


def _timed(fn: Callable[..., A], *args: Any) -> tuple[A, float]:
    """Run ``fn`` on this (worker) thread: its result and the seconds it took.

    Out of memory, the CUDA caching allocator gives back what it holds before the error goes
    on to the batcher, which retries the batch in halves.
    """
    started = time.perf_counter()
    try:
        result = fn(*args)
    except Exception as exc:
        if is_out_of_memory(exc) and torch.cuda.is_available():
            torch.cuda.empty_cache()
        raise
    return result, time.perf_counter() - started


def _input_dim(module: nn.Module) -> int:
    if isinstance(module, LinearRecursion):
        return module.feat_dim
    if isinstance(module, Traveller):
        return module.num_inputs
    if isinstance(module, RecurrentModel | torchscript.TorchScriptModel):
        return module.input_size
    raise TypeError(f"cannot serve {type(module).__name__}")
