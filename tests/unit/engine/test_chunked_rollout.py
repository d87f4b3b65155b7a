"""Chunked rollouts: joining, leaving and chunking never change a sequence's result."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rnnserve.models.packing import pack
from rnnserve.models.traveller import RolloutState
from rnnserve.service.engine.chunked_rollout import ChunkedRollout
from rnnserve.service.engine.runtime import _advance
from tests.helpers import Chunk, serve_schedule
from tests.references import available_backends, bent_model

CPU = torch.device("cpu")


def solo(model: torch.nn.Module, u: np.ndarray) -> np.ndarray:
    with torch.inference_mode():
        return model.rollout(pack([torch.from_numpy(u)])).data.numpy()  # type: ignore[operator]


@settings(max_examples=30, deadline=None)
@given(
    requests=st.lists(
        st.tuples(st.lists(st.integers(1, 23), min_size=1, max_size=3), st.integers(0, 6)),
        min_size=1,
        max_size=6,
    ),
    chunk=st.integers(1, 9),
    seed=st.integers(0, 999),
)
def test_joins_between_chunks_equal_each_sequence_alone(
    requests: list[tuple[list[int], int]], chunk: int, seed: int
) -> None:
    """Requests join at different chunks (the int: how many chunks after the previous)."""
    model = bent_model(num_inputs=3, hidden=8, seed=seed, dtype=torch.float32)
    model.compile_rollout("eager")
    rng = np.random.default_rng(seed)
    inputs = {
        key: [rng.standard_normal((n, 3)).astype(np.float32) for n in lengths]
        for key, (lengths, _) in enumerate(requests)
    }
    engine = ChunkedRollout(model, CPU, chunk)
    results: dict[int, list[np.ndarray]] = {}
    schedule = [(key, gap) for key, (_, gap) in enumerate(requests)]
    while schedule or engine.running_sequences:
        joins = []
        while schedule and schedule[0][1] == 0:
            key = schedule.pop(0)[0]
            joins.append((key, inputs[key]))
        if schedule:
            schedule[0] = (schedule[0][0], schedule[0][1] - 1)
        running = engine.running_sequences + sum(len(arrays) for _, arrays in joins)
        done, progress, steps = engine.advance(joins, [])
        assert steps == sum(len(y) for pieces in progress.values() for _, _, y in pieces)
        assert 0 < steps <= chunk * running or running == 0
        assert not set(done) & set(results)
        results.update(done)
    assert sorted(results) == sorted(inputs)
    for key, outs in results.items():
        assert len(outs) == len(inputs[key])
        for u, y in zip(inputs[key], outs, strict=True):
            assert y.dtype == np.float32  # as the wire writes them: float32's shortest digits
            np.testing.assert_allclose(y, solo(model, u), atol=1e-6, rtol=0)


def test_a_request_finishes_when_its_longest_sequence_does() -> None:
    model = bent_model(num_inputs=2, hidden=4, dtype=torch.float32)
    engine = ChunkedRollout(model, CPU, 4)
    u = [np.ones((3, 2), np.float32), np.ones((10, 2), np.float32)]
    finished = [engine.advance([(7, u)], [])[0]]
    while engine.running_sequences:
        done, progress, _ = engine.advance([], [])
        finished.append(done)
        # the pieces of this chunk: the long sequence's next steps only
        assert [(i, start, len(y)) for i, start, y in progress[7]] == [
            (1, 4 * len(finished) - 4, min(4, 14 - 4 * len(finished)))
        ]
    assert finished[:2] == [{}, {}]  # 4 and 8 steps run: the 10-step sequence is not done
    assert list(finished[2]) == [7]
    assert [len(y) for y in finished[2][7]] == [3, 10]
    assert len(finished) == 3


def test_a_request_that_leaves_is_dropped_and_the_rest_continue() -> None:
    model = bent_model(num_inputs=2, hidden=4, dtype=torch.float32)
    rng = np.random.default_rng(3)
    gone = [rng.standard_normal((50, 2)).astype(np.float32)]
    stays = [rng.standard_normal((9, 2)).astype(np.float32)]
    engine = ChunkedRollout(model, CPU, 4)
    engine.advance([(1, gone), (2, stays)], [])
    assert engine.running_sequences == 2
    done, _, steps = engine.advance([], [1])
    assert engine.running_sequences == 1
    assert steps == 4  # only the staying sequence ran
    while not done:
        done, _, _ = engine.advance([], [])
    np.testing.assert_allclose(done[2][0], solo(model, stays[0]), atol=1e-6, rtol=0)
    assert engine.running_sequences == 0


def test_a_request_of_several_sequences_gets_each_ones_final_state_in_its_order() -> None:
    """Its sequences run in the order of their steps left, not the request's: the final state
    still has one row per sequence in the request's order, each that sequence's own."""
    model = bent_model(num_inputs=2, hidden=4, dtype=torch.float32)
    rng = np.random.default_rng(8)
    seqs = [rng.standard_normal((n, 2)).astype(np.float32) for n in (5, 11, 8)]
    engine = ChunkedRollout(model, CPU, 3)
    engine.advance([(4, [seqs[0][:2]])], [])  # a sequence already running, then the request
    done, _, _ = engine.advance([(9, seqs)], [], None, [9])
    states = dict(engine.finished_states)
    while 9 not in done:
        done, _, _ = engine.advance([], [])
        states.update(engine.finished_states)
    final = states[9]
    assert final.h.shape == (model.num_layers, 3, 4)
    assert final.c.shape == (model.num_layers, 3, 4)
    assert final.p.shape == (3, 2)
    for i, u in enumerate(seqs):
        with torch.inference_mode():
            _, alone = model.rollout_with_state(pack([torch.from_numpy(u)]))
        torch.testing.assert_close(final.h[:, i], alone.h[:, 0], atol=1e-6, rtol=0)
        torch.testing.assert_close(final.c[:, i], alone.c[:, 0], atol=1e-6, rtol=0)
        torch.testing.assert_close(final.p[i], alone.p[0], atol=1e-6, rtol=0)


def test_leaving_a_request_that_is_not_running_changes_nothing() -> None:
    """A client can go away as its request finishes, or before it joined: its leave then names
    a request the chunk no longer (or never) had, and the others run on."""
    model = bent_model(num_inputs=2, hidden=4, dtype=torch.float32)
    rng = np.random.default_rng(5)
    short, long = (rng.standard_normal((n, 2)).astype(np.float32) for n in (2, 7))
    engine = ChunkedRollout(model, CPU, 3)
    done, _, _ = engine.advance([(1, [short]), (2, [long])], [])
    assert list(done) == [1]
    finished = {}
    for leaves in ([1], [77], []):  # finished already; never joined; then to the end
        done, _, _ = engine.advance([], leaves)
        finished.update(done)
    while engine.running_sequences:
        finished.update(engine.advance([], [])[0])
    np.testing.assert_allclose(finished[2][0], solo(model, long), atol=1e-6, rtol=0)


def test_a_failed_chunk_leaves_nothing_behind(monkeypatch: pytest.MonkeyPatch) -> None:
    model = bent_model(num_inputs=2, hidden=4, dtype=torch.float32)
    engine = ChunkedRollout(model, CPU, 2)
    engine.advance([(1, [np.ones((9, 2), np.float32)])], [])

    def broken(*args: object) -> object:
        raise RuntimeError("device lost")

    monkeypatch.setattr(model, "rollout_with_state", broken)
    with pytest.raises(RuntimeError, match="device lost"):
        engine.advance([(2, [np.ones((3, 2), np.float32)])], [])
    assert engine.running_sequences == 0
    monkeypatch.undo()
    u = np.full((5, 2), 0.5, np.float32)
    done, _, _ = engine.advance([(3, [u])], [])
    while not done:
        done, _, _ = engine.advance([], [])
    assert list(done) == [3]
    np.testing.assert_allclose(done[3][0], solo(model, u), atol=1e-6, rtol=0)


def test_chunk_steps_must_be_positive() -> None:
    with pytest.raises(ValueError, match="chunk_steps"):
        ChunkedRollout(bent_model(), CPU, 0)


def _alone(model64: torch.nn.Module, u: np.ndarray) -> tuple[np.ndarray, RolloutState]:
    """One sequence rolled out by itself, in float64 on the eager path: outputs and final state."""
    with torch.inference_mode():
        packed, final = model64.rollout_with_state(pack([torch.from_numpy(u).double()]))  # type: ignore[operator]
    return packed.data.numpy(), final


@pytest.mark.parametrize("backend", available_backends())
def test_every_backend_gives_each_sequence_its_own_rollout_through_joins_and_leaves(
    backend: str,
) -> None:
    """The service's schedule on each backend: requests join at different chunks (one from a
    carried state, keeping its final state), one leaves while running; each sequence gets what
    it would get alone, and its chunks are packed as they stand (longest first, no sort)."""
    model = bent_model(num_inputs=3, hidden=8, seed=11, dtype=torch.float32)
    model64 = bent_model(num_inputs=3, hidden=8, seed=11, dtype=torch.float64)
    model64.compile_rollout("eager")
    model.compile_rollout(backend)  # type: ignore[arg-type]
    rng = np.random.default_rng(12)

    def seqs(*lengths: int) -> list[np.ndarray]:
        return [rng.standard_normal((n, 3)).astype(np.float32) for n in lengths]

    a, b, gone = seqs(7, 2, 11), seqs(5, 9), seqs(30)
    prefixes = seqs(3, 6)  # b's sequences continue these
    ends = [_alone(model64, u)[1] for u in prefixes]
    start = RolloutState(
        torch.cat([e.h for e in ends], 1).float(),
        torch.cat([e.c for e in ends], 1).float(),
        torch.cat([e.p for e in ends], 0).float(),
    )
    engine = ChunkedRollout(model, CPU, 4)
    schedule: list[Chunk] = [([(1, a)], [], {}, []), ([(2, b)], [], {2: start}, [2])]
    schedule += [([(3, gone)], [], {}, []), ([], [3], {}, [])]
    finished, states = serve_schedule(engine, schedule)
    assert sorted(finished) == [1, 2]
    for u, y in zip(a, finished[1], strict=True):
        np.testing.assert_allclose(y, _alone(model64, u)[0], atol=1e-5, rtol=0)
    for prefix, u, y, row in zip(prefixes, b, finished[2], range(2), strict=True):
        whole, final = _alone(model64, np.concatenate([prefix, u]))
        np.testing.assert_allclose(y, whole[len(prefix) :], atol=1e-5, rtol=0)
        torch.testing.assert_close(states[2].h[:, row].double(), final.h[:, 0], atol=1e-5, rtol=0)
        torch.testing.assert_close(states[2].c[:, row].double(), final.c[:, 0], atol=1e-5, rtol=0)
        torch.testing.assert_close(states[2].p[row].double(), final.p[0], atol=1e-5, rtol=0)


def test_chunks_go_on_while_nothing_changes_and_stop_when_a_request_finishes() -> None:
    """The worker thread's side of ``unchanged()``: chunks run back to back while it holds,
    each one's progress kept, until a request finishes or it stops holding."""
    model = bent_model(num_inputs=2, hidden=4, dtype=torch.float32)
    engine = ChunkedRollout(model, CPU, 3)
    rng = np.random.default_rng(6)
    short, long = (rng.standard_normal((n, 2)).astype(np.float32) for n in (8, 20))
    joins = [(1, [short]), (2, [long])]
    done, progress, steps, finals = _advance(engine, joins, [], {}, [1], lambda: True)
    assert list(done) == [1]  # three chunks (3 + 3 + 2 steps), then request 1 is done
    assert steps == 8 + 9
    assert [(start, len(y)) for _, start, y in progress[1]] == [(0, 3), (3, 3), (6, 2)]
    assert [(start, len(y)) for _, start, y in progress[2]] == [(0, 3), (3, 3), (6, 3)]
    assert list(finals) == [1]
    np.testing.assert_allclose(done[1][0], solo(model, short), atol=1e-6, rtol=0)
    answers = iter([True, False])  # the first chunk, one more, then news
    done, progress, steps, finals = _advance(engine, [], [], {}, [], lambda: next(answers))
    assert (done, steps, finals) == ({}, 6, {})
    assert [start for _, start, _ in progress[2]] == [9, 12]
    while not done:
        done, _, _, _ = _advance(engine, [], [], {}, [], lambda: False)
    np.testing.assert_allclose(done[2][0], solo(model, long), atol=1e-6, rtol=0)
