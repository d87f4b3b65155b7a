"""A model's numba rollout keeps its weights in the loop's layout between calls, and never
serves stale ones: a changed weight (new tensors, or the same tensor changed in place) is
rearranged again, and the results are always those of the weights passed in."""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np
import pytest
import torch
from torch import Tensor

from rnnserve.models.packing import pack
from rnnserve.models.traveller import Traveller, rollout_packed
from tests.helpers import refusal
from tests.unit.models.kernels.test_rollout_cpu import (
    assert_same,
    bent_weights,
    packed_inputs,
    random_state,
)

rollout_cpu = pytest.importorskip("rnnserve.models.kernels.rollout_cpu")


@pytest.fixture
def rearranged(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the weights' rearrangements into the loop's layout (their number of layers)."""
    calls: list[int] = []
    real = rollout_cpu.loop_weights

    def spy(w_cat: list[Tensor], *args: Any) -> Any:
        calls.append(len(w_cat))
        return real(w_cat, *args)

    monkeypatch.setattr(rollout_cpu, "loop_weights", spy)
    return calls


def test_the_same_weights_are_rearranged_once_and_give_the_plain_calls_bits(
    rearranged: list[int],
) -> None:
    weights = bent_weights(16, 2, torch.float32)
    bound = rollout_cpu.NumbaRollout(None, torch.float32)
    for lengths in ([9, 4, 4], [3], [12, 12, 7, 1]):
        u, sizes = packed_inputs(lengths, torch.float32)
        state = random_state(2, sizes[0], 16, torch.float32)
        with torch.inference_mode():
            got = bound(u, sizes, *weights, *state)
            want = rollout_cpu.rollout_packed_numba(u, sizes, *weights, *state)
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w)
    # the bound rollout once, the plain function once per call
    assert rearranged == [2, 2, 2, 2]


def test_a_weight_changed_in_place_is_rearranged_again(rearranged: list[int]) -> None:
    w_cat, bias, w_out, b_out = bent_weights(8, 2, torch.float32)
    bound = rollout_cpu.NumbaRollout(None, torch.float32)
    u, sizes = packed_inputs([6, 3], torch.float32)
    for change in (lambda: w_cat[1].mul_(0.5), lambda: b_out.add_(0.25), lambda: None):
        with torch.no_grad():
            change()
        with torch.inference_mode():
            got = bound(u, sizes, w_cat, bias, w_out, b_out)
            want = rollout_packed(u, sizes, w_cat, bias, w_out, b_out)
        assert_same(got, want, torch.float32)
    assert rearranged == [2, 2]  # a bumped version each time, then nothing changed


def test_other_weight_tensors_are_rearranged_again(rearranged: list[int]) -> None:
    bound = rollout_cpu.NumbaRollout(None, torch.float32)
    u, sizes = packed_inputs([5, 5, 2], torch.float32)
    first = bent_weights(8, 2, torch.float32)
    second = tuple(
        [t.clone() * 0.9 for t in x] if isinstance(x, list) else x.clone() for x in first
    )
    for weights in (first, second, first):
        with torch.inference_mode():
            got = bound(u, sizes, *weights)
            want = rollout_packed(u, sizes, *weights)
        assert_same(got, want, torch.float32)
    assert rearranged == [2, 2, 2]


def test_inference_tensors_are_rearranged_on_every_call(rearranged: list[int]) -> None:
    with torch.inference_mode():  # weights made here have no version counter to trust
        weights = bent_weights(8, 1, torch.float32)
        u, sizes = packed_inputs([4, 2], torch.float32)
        bound = rollout_cpu.NumbaRollout(None, torch.float32)
        for _ in range(2):
            want = rollout_packed(u, sizes, *weights)
            assert_same(bound(u, sizes, *weights), want, torch.float32)
    assert rearranged == [1, 1]


def test_inputs_of_another_width_or_rank_are_refused() -> None:
    weights = bent_weights(8, 2, torch.float32)  # 6 inputs
    bound = rollout_cpu.NumbaRollout(None, torch.float32)
    u, sizes = packed_inputs([3, 2], torch.float32)
    bound(u, sizes, *weights)
    message = refusal(ValueError, lambda: bound(u[:, :5], sizes, *weights))
    assert "w_cat[0] must have shape [15, 32], got [16, 32]" in message
    for call in (bound, rollout_cpu.rollout_packed_numba):
        message = refusal(ValueError, lambda call=call: call(u[:, 0], sizes, *weights))
        assert message == "expected one bias per layer and 2-D packed inputs"


def test_weights_of_another_dtype_are_converted_to_the_inputs(rearranged: list[int]) -> None:
    weights = bent_weights(8, 2, torch.float64)
    bound = rollout_cpu.NumbaRollout(None, torch.float32)
    u, sizes = packed_inputs([5, 3], torch.float32)
    for _ in range(2):
        got = bound(u, sizes, *weights)
        want = rollout_cpu.rollout_packed_numba(u, sizes, *weights)
        for g, w in zip(got, want, strict=True):
            assert g.dtype == torch.float32
            assert torch.equal(g, w)
    assert rearranged == [2, 2, 2]  # the bound rollout once, the plain function every call


def test_route_tables_are_made_once_per_batch_width(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[int] = []
    real = rollout_cpu.route_table

    def spy(num_layers: int, b_max: int, *args: Any, **kwargs: Any) -> Any:
        made.append(b_max)
        return real(num_layers, b_max, *args, **kwargs)

    monkeypatch.setattr(rollout_cpu, "route_table", spy)
    weights = bent_weights(8, 1, torch.float32)
    bound = rollout_cpu.NumbaRollout(None, torch.float32)
    for lengths in ([4, 2], [3, 3], [5], [2, 1]):
        u, sizes = packed_inputs(lengths, torch.float32)
        with torch.inference_mode():
            want = rollout_packed(u, sizes, *weights)
            assert_same(bound(u, sizes, *weights), want, torch.float32)
    assert made == [2, 1]


needs_packed_sgemm = pytest.mark.skipif(
    getattr(rollout_cpu, "_MKL_PACK", None) is None, reason="this torch build packs no sgemm"
)


@pytest.fixture
def packed_for(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of rows MKL's packing is made for, at each packing."""
    rows: list[int] = []
    real = rollout_cpu._pack_weights

    def spy(weights: list[np.ndarray], n_rows: int) -> Any:
        rows.append(n_rows)
        return real(weights, n_rows)

    monkeypatch.setattr(rollout_cpu, "_pack_weights", spy)
    return rows


@needs_packed_sgemm
def test_packed_weights_are_kept_for_the_newest_batch_widths(packed_for: list[int]) -> None:
    w_cat, bias, w_out, b_out = bent_weights(8, 2, torch.float32)
    bound = rollout_cpu.NumbaRollout(None, torch.float32)  # MKL from 2 rows
    kept = rollout_cpu.PACKED_WIDTHS_KEPT
    steps = rollout_cpu.PACK_FROM_STEPS

    def roll(widths: list[int]) -> None:
        for b in widths:
            u, sizes = packed_inputs([steps] * b, torch.float32)
            with torch.inference_mode():
                got = bound(u, sizes, w_cat, bias, w_out, b_out)
                want = rollout_packed(u, sizes, w_cat, bias, w_out, b_out)
            assert_same(got, want, torch.float32)

    # one width more than are kept, then the first (the oldest, so gone), then the then oldest
    # (still kept), then the newest
    roll([*range(2, kept + 3), 2, 4, kept + 2])
    assert packed_for == [*range(2, kept + 3), 2]
    with torch.no_grad():
        w_cat[0].mul_(0.75)  # new weights: every width packed again
    roll([4, 4])
    assert packed_for[kept + 2 :] == [4]


@needs_packed_sgemm
def test_packing_is_kept_by_a_batchs_widest_step(packed_for: list[int]) -> None:
    """A ragged batch's packing is kept under its first (widest) step's width, which a later
    batch as wide then finds."""
    weights = bent_weights(8, 2, torch.float32)
    bound = rollout_cpu.NumbaRollout(None, torch.float32)
    steps = rollout_cpu.PACK_FROM_STEPS
    for lengths in ([steps] * 5 + [1], [steps] * 6):  # 6 rows, then 5 from the second step
        u, sizes = packed_inputs(lengths, torch.float32)
        with torch.inference_mode():
            assert_same(
                bound(u, sizes, *weights), rollout_packed(u, sizes, *weights), torch.float32
            )
    assert packed_for == [6]


def test_a_traveller_whose_parameters_change_rolls_out_with_the_new_ones() -> None:
    torch.manual_seed(3)
    model = Traveller(6, 8, 2).eval().requires_grad_(False)
    model.compile_rollout("numba", "fixed")
    gen = torch.Generator().manual_seed(1)
    x = pack([torch.randn(n, 6, generator=gen) for n in (7, 4)])
    eager = Traveller(6, 8, 2).eval().requires_grad_(False)
    for change in (
        lambda: model.output_layer.bias.add_(0.5),  # served as is: its version is bumped
        lambda: model.lstm_layers.weight_hh_l1.mul_(1.5),  # fused again into new tensors
    ):
        with torch.no_grad():
            change()
        eager.load_state_dict(model.state_dict())
        with torch.inference_mode():
            got = model.rollout(x).data
            want = eager.rollout(x).data
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_the_loops_arguments_are_its_parameters_in_order_in_the_inputs_dtype() -> None:
    """The loop is called with the arguments' values in order, so their names must be its
    parameters'; a state of another dtype is converted, and laid out as the layers read it."""
    weights = bent_weights(8, 3, torch.float32)
    u, sizes = packed_inputs([4, 2], torch.float32)
    h, c, p = (t.double() for t in random_state(3, 2, 8, torch.float32))
    prepared = rollout_cpu.loop_weights(*weights, torch.float32, u.shape[1])
    table = rollout_cpu.route_table(3, 2)
    steps = np.asarray(sizes, dtype=np.int64)
    packed = rollout_cpu._unpacked(3)
    args = rollout_cpu.loop_arguments(u, steps, prepared, (h, c, p), table, packed)
    assert list(args) == list(inspect.signature(rollout_cpu._rollout_loop).parameters)
    for name in ("u", "z0", "z_up", "c", "out"):
        assert args[name].dtype == np.float32, name
    assert args["z0"].shape == (2, 2 + 8 + 6)  # [p | h_0 | u_t]
    np.testing.assert_array_equal(args["z0"][:, :2], p.float().numpy())
    np.testing.assert_array_equal(args["z0"][:, 2:10], h[0].float().numpy())
    assert args["z_up"].shape == (2, 2, 16)  # layer l: [h_{l-1} | h_l]
    for layer in (1, 2):
        np.testing.assert_array_equal(args["z_up"][layer - 1, :, 8:], h[layer].float().numpy())
    np.testing.assert_array_equal(args["c"], c.float().numpy())
    assert args["out"].shape == (6, 2)


def test_warmed_loops_serve_every_kind_of_call_without_compiling_again() -> None:
    """compile_for at load time compiles the loop once per dtype; no call shape, state,
    route, packing or bound rollout afterwards may compile it again while serving."""
    for dtype in (torch.float32, torch.float64):
        rollout_cpu.compile_for(dtype)
    compiled = len(rollout_cpu._rollout_loop_jit.signatures)
    assert compiled == 2  # whatever ran before in this process: one loop per dtype
    bound = rollout_cpu.NumbaRollout(None, torch.float32)
    steps = rollout_cpu.PACK_FROM_STEPS + 2
    for dtype in (torch.float32, torch.float64):
        weights = bent_weights(8, 2, dtype)
        for lengths in ([steps] * 4, [3, 1]):  # packed for MKL (float32), and not
            u, sizes = packed_inputs(lengths, dtype)
            state = random_state(2, sizes[0], 8, dtype)
            with torch.inference_mode():
                bound(u, sizes, *weights, *state)
                rollout_cpu.rollout_packed_numba(u, sizes, *weights, gemm_from=1)
    assert len(rollout_cpu._rollout_loop_jit.signatures) == compiled
