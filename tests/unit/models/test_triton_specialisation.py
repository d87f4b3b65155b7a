"""After warm-up, no served batch makes Triton compile: every launch's specialisation key is one
that warm-up already met.

Triton compiles one binary per specialisation key of a launch: each pointer argument's type and
whether its address is a multiple of 16 bytes, each integer's type and whether it is 1 or a
multiple of 16 (unless the kernel says ``do_not_specialize``), the constexprs and the launch
options. A key first met while serving is a compile in the middle of a batch. The keys here are
Triton's own: the installed Triton's argument binder (``create_function_from_signature`` over the
kernel's parameters, as ``JITFunction.run`` builds it) and ``compute_cache_key``, against the
CUDA backend of the GPU served on (sm_90). Launches are recorded in Triton's interpreter and not
executed: the keys depend only on the arguments, so large batches cost no kernel time.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from torch import Tensor

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":  # pragma: no cover - tests/conftest.py sets it
    pytest.skip("records launches in Triton's interpreter", allow_module_level=True)

from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import CUDABackend
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction, compute_cache_key, create_function_from_signature

from rnnserve.models.kernels import rollout_triton as rt
from rnnserve.models.kernels import smoother_triton as st

BACKEND = CUDABackend(GPUTarget("cuda", 90, 32))
FEAT = 3
MAX_STEPS = 4000
MAX_SEQS = 256


class KeyRecorder:
    """Every launch's (kernel, key) while :attr:`recording`, the kernels left unexecuted."""

    def __init__(self) -> None:
        self.keys: set[tuple[str, str]] = set()
        self._binders: dict[int, Any] = {}

    def binder(self, fn: InterpretedFunction) -> Any:
        found = self._binders.get(id(fn))
        if found is None:
            # the JITFunction Triton would have made of this kernel without the interpreter,
            # with the same do_not_specialize lists; its binder is the one JITFunction.run uses
            jit = JITFunction(fn.fn, **fn.kwargs)
            found = create_function_from_signature(jit.signature, jit.params, BACKEND)
            self._binders[id(fn)] = found
        return found

    def record(
        self, fn: InterpretedFunction, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        _, specialization, options = self.binder(fn)(*args, **kwargs)
        key = compute_cache_key({}, specialization, options)
        self.keys.add((f"{fn.fn.__module__}.{fn.fn.__qualname__}", key))


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> KeyRecorder:
    rec = KeyRecorder()

    def run(self: InterpretedFunction, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        rec.record(self, args, kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", run)
    return rec


def _keys_of(rec: KeyRecorder, work: Callable[..., object], *args: Any) -> set[tuple[str, str]]:
    """The keys of the launches ``work(*args)`` makes."""
    rec.keys = set()
    work(*args)
    return rec.keys


def batch_shapes(seed: int, count: int) -> list[tuple[int, int]]:
    """(sequences, steps): the corners, every parity pairing, and random ones in range."""
    rng = np.random.default_rng(seed)
    shapes = [(1, 1), (2, 2), (1, 2), (2, 1), (3, 17), (16, 32), (MAX_SEQS, MAX_STEPS)]
    shapes += [(MAX_SEQS - 1, MAX_STEPS - 1), (129, 1000), (128, 999)]
    while len(shapes) < count:
        shapes.append((int(rng.integers(1, MAX_SEQS + 1)), int(rng.integers(1, MAX_STEPS + 1))))
    return shapes


def batch_sizes(n_seqs: int, n_steps: int, seed: int) -> Tensor:
    """A PackedSequence's step sizes: ``n_seqs`` sequences, the longest ``n_steps`` long."""
    rng = np.random.default_rng(seed)
    lengths = np.sort(rng.integers(1, n_steps + 1, size=n_seqs))[::-1].copy()
    lengths[0] = n_steps
    steps = np.arange(n_steps)
    return torch.from_numpy((lengths[None, :] > steps[:, None]).sum(1).astype(np.int64))


def serve_batches(dtype: torch.dtype, seed: int, count: int) -> None:
    alpha, wx = torch.full((FEAT,), 0.5, dtype=dtype), torch.ones(FEAT, dtype=dtype)
    for i, (n_seqs, n_steps) in enumerate(batch_shapes(seed, count)):
        sizes = batch_sizes(n_seqs, n_steps, seed + i)
        data = torch.zeros(int(sizes.sum()), FEAT, dtype=dtype)
        with torch.inference_mode():  # as the server runs it
            st.smooth_packed_triton(data, sizes, alpha, wx, None)


def _unwarmed(served: set[tuple[str, str]], warmed: set[tuple[str, str]]) -> list[str]:
    return sorted(f"{kernel}: {key}" for kernel, key in served - warmed)


@pytest.mark.parametrize("scan", st.SCANS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_served_smoother_batches_only_meet_the_kernels_warm_up_compiled(
    recorder: KeyRecorder, monkeypatch: pytest.MonkeyPatch, scan: str, dtype: torch.dtype
) -> None:
    """Any batch of 1 to 256 sequences and 1 to 4000 steps, after warm-up (for the scan that
    is the default, as start-up warms the default)."""
    monkeypatch.setattr(st, "DEFAULT_SCAN", scan)
    alpha, wx = torch.full((FEAT,), 0.5, dtype=dtype), torch.ones(FEAT, dtype=dtype)
    warmed = _keys_of(
        recorder, lambda: st.warm_up(FEAT, MAX_STEPS, alpha, wx, device="cpu", dtype=dtype)
    )
    assert warmed  # the recorder saw warm-up's launches
    served = _keys_of(recorder, lambda: serve_batches(dtype, seed=len(scan), count=40))
    assert {k for k, _ in served} <= {k for k, _ in warmed}
    assert _unwarmed(served, warmed) == []


def test_smoother_backward_keys_do_not_depend_on_the_batch(recorder: KeyRecorder) -> None:
    """Training compiles the backward once per tile plan, not again for batches of another
    parity of steps or sequences."""
    tiles = {"chunk": 32, "block": 16}

    def backward(n_seqs: int, n_steps: int, with_state: bool) -> None:
        sizes = batch_sizes(n_seqs, n_steps, n_seqs + n_steps)
        x = torch.zeros(int(sizes.sum()), FEAT, requires_grad=True)
        alpha = torch.full((FEAT,), 0.5, requires_grad=True)
        wx = torch.ones(FEAT, requires_grad=True)
        init = torch.zeros(n_seqs, FEAT, requires_grad=True) if with_state else None
        y, final = st.smooth_packed_triton(x, sizes, alpha, wx, init, **tiles)
        (y.sum() + final.sum()).backward()

    for with_state in (False, True):
        first = _keys_of(recorder, backward, 1, 1, with_state)
        for n_seqs, n_steps in ((2, 2), (2, 7), (5, 40), (7, 64), (16, 3)):
            keys = _keys_of(recorder, backward, n_seqs, n_steps, with_state)
            assert _unwarmed(keys, first) == [], (n_seqs, n_steps, with_state)


def _rollout_weights(layers: int, hidden: int, num_inputs: int) -> tuple[Any, ...]:
    w = [torch.zeros(2 + hidden + num_inputs, 4 * hidden)]
    w += [torch.zeros(2 * hidden, 4 * hidden) for _ in range(layers - 1)]
    b = [torch.zeros(4 * hidden) for _ in range(layers)]
    return w, b, torch.zeros(hidden, 2), torch.zeros(2)


def test_served_rollout_batches_only_meet_the_kernels_warm_up_compiled(
    recorder: KeyRecorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rollout without CUDA graphs (the CPU's path, and ``graphs=False`` on CUDA) launches
    each chunk of steps from Python: whatever the chunks, warm-up compiled them."""
    layers, hidden, num_inputs, max_steps = 2, 16, 3, 600
    monkeypatch.setattr(rt, "_DEFAULT", rt.TritonRollout())  # a cache of this test's own
    warmed = _keys_of(
        recorder,
        lambda: rt.warm_up(MAX_SEQS, layers, hidden, num_inputs, device="cpu", max_steps=max_steps),
    )
    weights = _rollout_weights(layers, hidden, num_inputs)

    def serve() -> None:
        shapes = [(1, 1), (2, 2), (1, 64), (3, 37), (MAX_SEQS, max_steps), (100, 127), (17, 600)]
        for i, (n_seqs, n_steps) in enumerate(shapes):
            sizes = batch_sizes(n_seqs, n_steps, i)
            u = torch.zeros(int(sizes.sum()), num_inputs)
            with torch.inference_mode():
                rt.rollout_packed_triton(u, sizes.tolist(), *weights)

    assert _unwarmed(_keys_of(recorder, serve), warmed) == []
