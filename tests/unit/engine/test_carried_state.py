"""The engine's carried state: a batch whose items start from different states (or none) gives
each item what it would get alone, and the final state continues a sequence exactly; in
whole batches (``run_with_state`` through the packed path) and in the chunked rollout."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rnnserve.models.packing import pack_flat, unpack_flat
from rnnserve.models.recurrent import RecurrentConfig, RecurrentModel
from rnnserve.models.smoothing import LinearRecursion
from rnnserve.models.traveller import RolloutState
from rnnserve.service.engine.chunked_rollout import ChunkedRollout
from rnnserve.service.engine.runtime import _batch_start, run_with_state, state_shapes_of
from rnnserve.service.interface import CarriedState, FlatSequences
from tests.references import bent_model

CPU = torch.device("cpu")
TOLERANCE = 1e-5


def make(kind: str, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    if kind == "traveller":
        model = bent_model(num_inputs=3, hidden=8, seed=seed, dtype=torch.float32)
        model.compile_rollout("eager")
        return model
    if kind == "smoother":
        smoother = LinearRecursion(3, 0.7)
        with torch.no_grad():
            smoother.wx.uniform_(0.5, 1.5)
        return smoother.eval()
    return RecurrentModel(RecurrentConfig(kind, 3, 6, 2, 2)).eval()


def run(
    model: torch.nn.Module, items: list[FlatSequences]
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """The batch of ``items`` through the packed path, as ``ModelRuntime._compute`` runs it."""
    lengths = np.concatenate([i.lengths for i in items])
    with torch.inference_mode():
        packed = pack_flat([i.data for i in items], lengths, CPU)
        out, final = run_with_state(model, packed, _batch_start(model, items, CPU))
        flat = unpack_flat(out, lengths).numpy()
    return flat, {k: v.numpy() for k, v in final.items()}


@settings(max_examples=25, deadline=None)
@given(
    kind=st.sampled_from(["traveller", "smoother", "lstm", "gru"]),
    lengths=st.lists(st.integers(2, 17), min_size=1, max_size=4),
    stateful=st.lists(st.booleans(), min_size=4, max_size=4),
    seed=st.integers(0, 999),
)
def test_a_mixed_batch_gives_each_item_its_own_continuation(
    kind: str, lengths: list[int], stateful: list[bool], seed: int
) -> None:
    """Item ``i`` is sequence ``i`` from step ``cut_i`` on, started from the state after its
    first ``cut_i`` steps (or, unflagged, from the start): its outputs are the whole
    sequence's from there, in one batch with the others."""
    model = make(kind, seed)
    rng = np.random.default_rng(seed)
    xs = [rng.standard_normal((n, 3)).astype(np.float32) for n in lengths]
    whole = [run(model, [FlatSequences(x, np.array([len(x)]))])[0] for x in xs]
    items, wants = [], []
    for i, x in enumerate(xs):
        if not stateful[i]:
            items.append(FlatSequences(x, np.array([len(x)]), return_state=True))
            wants.append(whole[i])
            continue
        cut = int(rng.integers(1, len(x)))
        _, head = run(model, [FlatSequences(x[:cut], np.array([cut]), return_state=True)])
        state = CarriedState("m", "v", head)
        items.append(FlatSequences(x[cut:], np.array([len(x) - cut]), state, True))
        wants.append(whole[i][cut:])
    flat, final = run(model, items)
    assert set(final) == set(state_shapes_of(model))
    rows = np.split(flat, np.cumsum([i.total for i in items])[:-1])
    for got, want in zip(rows, wants, strict=True):
        assert float(np.abs(got - want).max()) <= TOLERANCE
    for i, x in enumerate(xs):  # every final state is the whole sequence's
        _, alone = run(model, [FlatSequences(x, np.array([len(x)]), return_state=True)])
        for part, rows_ in final.items():
            assert float(np.abs(rows_[i] - alone[part][0]).max()) <= TOLERANCE


@pytest.mark.parametrize("chunk", [1, 3, 8])
def test_a_chunked_rollout_starts_from_a_carried_state_and_keeps_the_final(chunk: int) -> None:
    """Request 1 starts from request 0's final state and joins while request 2 (fresh) runs:
    request 1's outputs and final state are those of the whole sequence."""
    model = make("traveller", 3)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((20, 3)).astype(np.float32)
    other = rng.standard_normal((13, 3)).astype(np.float32)
    whole, whole_final = run(model, [FlatSequences(x, np.array([20]), return_state=True)])
    engine = ChunkedRollout(model, CPU, chunk)
    finished: dict[int, list[np.ndarray]] = {}
    states: dict[int, RolloutState] = {}

    def drain() -> None:
        while engine.running_sequences:
            done, _, _ = engine.advance([], [])
            finished.update(done)
            states.update(engine.finished_states)

    done, _, _ = engine.advance([(0, [x[:9]]), (2, [other])], [], None, [0])
    finished.update(done)
    states.update(engine.finished_states)
    while 0 not in finished:
        done, _, _ = engine.advance([], [])
        finished.update(done)
        states.update(engine.finished_states)
    assert 2 not in states  # it did not ask for its state
    done, _, _ = engine.advance([(1, [x[9:]])], [], {1: states[0]}, [1])
    finished.update(done)
    states.update(engine.finished_states)
    drain()
    got = np.concatenate([finished[0][0], finished[1][0]])
    assert float(np.abs(got - whole).max()) <= TOLERANCE
    final = states[1]
    for part, rows in (
        ("h", final.h.transpose(0, 1)),
        ("c", final.c.transpose(0, 1)),
        ("p", final.p),
    ):
        assert float(np.abs(rows.numpy() - whole_final[part]).max()) <= TOLERANCE
