"""The Traveller's backend choice, state handling, fused-weight cache and refusals.

Every backend computes the same positions, so a model that resolves the wrong one still matches
the references: these tests check which function a backend name resolves to, that a state
continues each sequence in the order it was given, when the fused weights are rebuilt, and that
each refusal names what was wrong (the caller's only clue).
"""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch
from torch.nn.utils.rnn import pack_sequence

import rnnserve.models.kernels.rollout_cpu as rollout_cpu
import rnnserve.models.traveller as traveller
from rnnserve import models
from rnnserve.models.packing import pack, unpack
from rnnserve.models.traveller import RolloutState, Traveller, rollout_backend_fn, rollout_packed
from tests.helpers import refusal
from tests.references import bent_model, stepwise_rollout

CPU = torch.device("cpu")


def mentions(message: str, *words: str) -> bool:
    """Whether a refusal's message names every one of ``words`` (the argument, the shapes)."""
    missing = [w for w in words if w not in message]
    assert not missing, f"{message!r} does not mention {missing}"
    return True


def reference(model: Traveller, u: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return stepwise_rollout(model.lstm_layers, model.output_layer, model.activation, u[:, None])


def test_backend_names_resolve_to_their_functions() -> None:
    assert rollout_backend_fn("eager", CPU) == (rollout_packed, "eager")
    assert rollout_backend_fn("torchscript", CPU) == (traveller.scripted_rollout(), "torchscript")
    assert rollout_backend_fn("numba", CPU) == (rollout_cpu.rollout_packed_numba, "numba")
    assert rollout_backend_fn("auto", CPU) == (rollout_cpu.rollout_packed_numba, "numba")


def test_auto_on_the_cpu_without_numba_is_torchscript(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "rnnserve.models.kernels.rollout_cpu", None)  # import fails
    assert rollout_backend_fn("auto", CPU) == (traveller.scripted_rollout(), "torchscript")


def test_auto_on_cuda_takes_the_gpu_kernel_when_it_imports(monkeypatch: pytest.MonkeyPatch) -> None:
    import rnnserve.models.kernels.rollout_triton as rollout_triton

    checked: list[torch.device] = []
    monkeypatch.setattr(rollout_triton, "check_device", checked.append)
    cuda = torch.device("cuda")
    monkeypatch.setattr(traveller, "_triton_rollout_imports", lambda: True)
    assert rollout_backend_fn("auto", cuda) == (rollout_triton.rollout_packed_triton, "triton")
    assert checked == [cuda]
    monkeypatch.setattr(traveller, "_triton_rollout_imports", lambda: False)
    assert rollout_backend_fn("auto", cuda) == (traveller.scripted_rollout(), "torchscript")


def test_the_gpu_kernel_import_check_says_whether_it_imports(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert traveller._triton_rollout_imports() is True
    monkeypatch.setitem(sys.modules, "rnnserve.models.kernels.rollout_triton", None)
    assert traveller._triton_rollout_imports() is False


def test_an_unknown_backend_is_refused_with_the_known_ones() -> None:
    message = refusal(ValueError, lambda: rollout_backend_fn("fast", CPU))
    assert mentions(message, "'fast'", "auto", "eager", "torchscript", "numba", "triton")


def test_compile_rollout_sets_the_function_and_its_name() -> None:
    model = Traveller(2, 4, 1)
    assert model.rollout_backend == "eager"
    assert model._rollout_fn is rollout_packed
    model.compile_rollout("numba")
    assert model.rollout_backend == "numba"
    planned = model._rollout_fn
    assert isinstance(planned, rollout_cpu.NumbaRollout)
    w_cat = model.fused_weights()[0]
    assert planned.routes is rollout_cpu.plan_routes(w_cat)  # planned for this model's shapes
    assert planned.routes.shape == (1, rollout_cpu.PLAN_WIDTHS + 1)
    assert model.rollout_routes == rollout_cpu.describe_routes(planned.routes)
    assert models.describe(model)["config"]["rollout_routes"] == model.rollout_routes
    model.compile_rollout("eager")
    assert model.rollout_routes is None
    assert "rollout_routes" not in models.describe(model)["config"]
    model.compile_rollout()  # auto: numba on the CPU
    assert model.rollout_backend == "numba"


def test_fixed_gemm_routes_run_the_unplanned_kernel_in_every_process() -> None:
    model = Traveller(2, 4, 1)
    model.compile_rollout("numba", "fixed")
    assert model.rollout_backend == "numba"
    assert isinstance(model._rollout_fn, rollout_cpu.NumbaRollout)
    assert model._rollout_fn.routes is None  # no plan: the fixed routes
    assert model.rollout_routes is None
    assert "rollout_routes" not in models.describe(model)["config"]
    model.compile_rollout("numba", "measured")
    assert model._rollout_fn.routes is not None
    loaded = models.load("traveller", rollout_backend="numba", rollout_gemm_routes="fixed")
    assert loaded._rollout_fn.routes is None
    assert models.load("traveller")._rollout_fn.routes is not None


def test_a_new_traveller_has_no_dropout_and_says_its_config() -> None:
    model = Traveller(3, 5, 2)
    assert model.dropout == 0.0
    assert model.lstm_layers.dropout == 0.0
    assert model.config == traveller.TravellerConfig(3, 5, 2, 0.0)
    assert (model.lstm_layers.input_size, model.lstm_layers.hidden_size) == (5, 5)
    assert model.lstm_layers.num_layers == 2
    assert model.lstm_layers.batch_first


def test_zeros_state_is_zero_in_the_asked_dtype() -> None:
    state = RolloutState.zeros(3, 2, 5, dtype=torch.float64, device=CPU)
    for t, shape in ((state.h, (3, 2, 5)), (state.c, (3, 2, 5)), (state.p, (2, 2))):
        assert tuple(t.shape) == shape
        assert t.dtype == torch.float64
        assert not t.any()
    assert state.c.data_ptr() != state.h.data_ptr()
    # "meta" stands in for a GPU: the state is made on the device asked for
    meta = RolloutState.zeros(1, 2, 3, dtype=torch.float32, device=torch.device("meta"))
    assert {t.device.type for t in (meta.h, meta.c, meta.p)} == {"meta"}


def test_state_index_takes_the_rows_in_order() -> None:
    h = torch.arange(2 * 3 * 2, dtype=torch.float64).reshape(2, 3, 2)
    state = RolloutState(h, -h, torch.arange(6, dtype=torch.float64).reshape(3, 2))
    picked = state.index(torch.tensor([2, 0]))
    torch.testing.assert_close(picked.h, h[:, [2, 0]])
    torch.testing.assert_close(picked.c, -h[:, [2, 0]])
    torch.testing.assert_close(
        picked.p, torch.tensor([[4.0, 5.0], [0.0, 1.0]], dtype=torch.float64)
    )


def test_a_state_given_in_original_order_continues_each_sequence() -> None:
    """Sequences out of sorted order: the state is reordered on the way in and on the way out."""
    model = bent_model(num_inputs=2, hidden=4, layers=2, seed=3)
    gen = torch.Generator().manual_seed(3)
    seqs = [torch.randn(n, 2, generator=gen, dtype=torch.float64) for n in (3, 7, 5)]
    heads, tails = [u[:2] for u in seqs], [u[2:] for u in seqs]
    with torch.inference_mode():
        _, mid = model.rollout_with_state(pack(heads))
        out, end = model.rollout_with_state(pack(tails), mid)
        for i, u in enumerate(seqs):
            alone, alone_end = model.rollout_with_state(pack([u]))
            torch.testing.assert_close(unpack(out)[i], alone.data[2:], atol=1e-12, rtol=0)
            torch.testing.assert_close(end.p[i], alone_end.p[0], atol=1e-12, rtol=0)
            torch.testing.assert_close(end.h[:, i], alone_end.h[:, 0], atol=1e-12, rtol=0)
            torch.testing.assert_close(end.c[:, i], alone_end.c[:, 0], atol=1e-12, rtol=0)


def test_wrong_widths_and_states_are_refused_with_their_shapes() -> None:
    model = Traveller(6, 4, 2)
    assert mentions(
        refusal(ValueError, lambda: model.rollout(pack([torch.zeros(3, 5)]))),
        *("6 features", "got shape [3, 5]"),
    )
    assert mentions(
        refusal(ValueError, lambda: model(torch.zeros(3, 2, 6))), "[T, 1, 6]", "[3, 2, 6]"
    )
    assert mentions(
        refusal(ValueError, lambda: model(torch.zeros(3, 6))), "[T, 1, 6]", "got [3, 6]"
    )
    assert mentions(
        refusal(ValueError, lambda: model(torch.zeros(3, 1, 5))), "6 features", "[3, 5]"
    )
    message = refusal(TypeError, lambda: model.rollout(torch.zeros(3, 6)))  # type: ignore[arg-type]
    assert mentions(message, "PackedSequence", "got Tensor")
    packed = pack([torch.zeros(3, 6), torch.zeros(2, 6)])
    good = RolloutState.zeros(2, 2, 4, dtype=torch.float32, device=CPU)
    for h, c, p, words in (
        (
            good.h[:, :1],
            good.c,
            good.p,
            ("state h and c", "[2, 2, 4]", "got [2, 1, 4] and [2, 2, 4]"),
        ),
        (good.h, good.c[:1], good.p, ("state h and c", "[2, 2, 4]", "got [2, 2, 4] and [1, 2, 4]")),
        (good.h, good.c, good.p[:1], ("state p", "[2, 2]", "got [1, 2]")),
    ):
        state = RolloutState(h, c, p)
        assert mentions(
            refusal(ValueError, lambda s=state: model.rollout_with_state(packed, s)), *words
        )


def test_fused_weights_are_cached_until_a_parameter_changes() -> None:
    model = bent_model(num_inputs=2, hidden=4, layers=2, dtype=torch.float32)
    with torch.no_grad():
        first = model.fused_weights()
        assert model.fused_weights() is first
    with torch.inference_mode():
        assert model.fused_weights() is first
    # with gradients needed, a fresh fusion every call, part of the autograd graph
    live = model.fused_weights()
    assert live is not first
    assert live[0][0].requires_grad
    assert model.fused_weights() is not live
    w_before = first[0][1].clone()
    with torch.no_grad():
        model.lstm_layers.weight_hh_l1.add_(1.0)
        changed = model.fused_weights()
    assert changed is not first
    torch.testing.assert_close(changed[0][1][:4], w_before[:4])  # rows of w_ih_l1
    torch.testing.assert_close(changed[0][1][4:], w_before[4:] + 1.0)  # rows of w_hh_l1


def test_fused_weights_of_inference_tensors_are_not_cached() -> None:
    with torch.inference_mode():
        model = bent_model(num_inputs=2, hidden=4, layers=1, dtype=torch.float32)
        a = model.fused_weights()
        b = model.fused_weights()
    assert a is not b
    assert model._fused_cache is None
    torch.testing.assert_close(a[0][0], b[0][0])


def test_fused_layout_is_p_then_h_then_u() -> None:
    model = Traveller(3, 4, 2)
    w_cat, bias, w_out, b_out = model.fused_weights()
    lstm = model.lstm_layers
    w_ih0, w_hh0 = lstm.weight_ih_l0.detach(), lstm.weight_hh_l0.detach()
    torch.testing.assert_close(w_cat[0], torch.cat([w_ih0[:, :2], w_hh0, w_ih0[:, 2:]], 1).t())
    torch.testing.assert_close(
        w_cat[1], torch.cat([lstm.weight_ih_l1.detach(), lstm.weight_hh_l1.detach()], 1).t()
    )
    torch.testing.assert_close(bias[1], (lstm.bias_ih_l1 + lstm.bias_hh_l1).detach())
    torch.testing.assert_close(w_out, model.output_layer.weight.detach().t())
    torch.testing.assert_close(b_out, model.output_layer.bias.detach())
    assert w_cat[0].is_contiguous()
    assert w_out.is_contiguous()


def test_forward_of_one_sequence_matches_the_stepwise_loop_where_tanh_bends() -> None:
    model = bent_model(num_inputs=2, hidden=4, layers=2, seed=5)
    u = torch.randn(9, 1, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        y = model(u)
    torch.testing.assert_close(y, reference(model, u[:, 0]), atol=1e-12, rtol=0)


def spy_on(model: Traveller) -> list[int]:
    """The number of steps of each call of the model's fused rollout, which still runs."""
    calls: list[int] = []

    def spy(u: torch.Tensor, sizes: list[int], *rest: Any) -> Any:
        calls.append(len(sizes))
        return rollout_packed(u, sizes, *rest)

    model._rollout_fn = spy
    return calls


def test_training_without_dropout_takes_the_fused_rollout() -> None:
    """``_stepwise`` (nn.LSTM per step) is only for dropout; dropout 0 in training is fused."""
    model = bent_model(num_inputs=2, hidden=4, layers=2, seed=6).train()
    calls = spy_on(model)
    u = torch.randn(5, 1, 2, dtype=torch.float64)
    y = model(u)
    assert calls == [5]
    torch.testing.assert_close(y.detach(), reference(model, u[:, 0]), atol=1e-12, rtol=0)


def test_stepwise_with_dropout_in_eval_is_the_fused_rollout() -> None:
    """Dropout only matters in training: in eval a model with dropout takes the fused rollout."""
    model = Traveller(2, 4, 2, dropout=0.5).double().eval()
    calls = spy_on(model)
    u = torch.randn(6, 1, 2, dtype=torch.float64)
    with torch.no_grad():
        model(u)
    assert calls == [6]
    torch.testing.assert_close(model(u), model._stepwise(u), atol=1e-12, rtol=0)
    torch.testing.assert_close(model(u), reference(model, u[:, 0]), atol=1e-12, rtol=0)


def test_a_state_continues_sequences_packed_without_indices() -> None:
    """``pack_sequence(enforce_sorted=True)`` leaves ``sorted_indices`` None: the state is used
    as it is, row ``i`` for sequence ``i``."""
    model = bent_model(num_inputs=2, hidden=4, layers=2, seed=8)
    gen = torch.Generator().manual_seed(8)
    seqs = [torch.randn(n, 2, generator=gen, dtype=torch.float64) for n in (6, 4, 3)]
    with torch.inference_mode():
        _, mid = model.rollout_with_state(pack([u[:2] for u in seqs]))
        tails = pack_sequence([u[2:] for u in seqs], enforce_sorted=True)
        assert tails.sorted_indices is None
        out, end = model.rollout_with_state(tails, mid)
        for i, u in enumerate(seqs):
            alone, alone_end = model.rollout_with_state(pack([u]))
            torch.testing.assert_close(unpack(out)[i], alone.data[2:], atol=1e-12, rtol=0)
            torch.testing.assert_close(end.h[:, i], alone_end.h[:, 0], atol=1e-12, rtol=0)
            torch.testing.assert_close(end.p[i], alone_end.p[0], atol=1e-12, rtol=0)


def test_dropout_reaches_the_lstm() -> None:
    assert Traveller(2, 4, 2, dropout=0.25).lstm_layers.dropout == 0.25


def test_a_frozen_model_gives_gradients_for_its_inputs() -> None:
    """Frozen weights are cached; the cache must hold plain tensors (not inference tensors),
    which autograd can save when the inputs need a gradient."""
    model = bent_model(num_inputs=2, hidden=4, layers=2, seed=9)
    twin = bent_model(num_inputs=2, hidden=4, layers=2, seed=9)
    model.requires_grad_(False)
    u = torch.randn(5, 2, dtype=torch.float64, requires_grad=True)
    model.rollout(pack([u])).data.sum().backward()
    u2 = u.detach().clone().requires_grad_()
    twin.rollout(pack([u2])).data.sum().backward()
    assert u.grad is not None
    assert u2.grad is not None
    torch.testing.assert_close(u.grad, u2.grad, atol=1e-12, rtol=0)


def test_rollout_keeps_every_index_of_the_packed_inputs() -> None:
    model = bent_model(num_inputs=2, hidden=4, layers=1, seed=10)
    packed = pack([torch.randn(2, 2, dtype=torch.float64), torch.randn(5, 2, dtype=torch.float64)])
    with torch.inference_mode():
        out, _ = model.rollout_with_state(packed)
    assert packed.sorted_indices is not None
    assert out.sorted_indices is not None
    assert torch.equal(out.sorted_indices, packed.sorted_indices)
    assert torch.equal(out.batch_sizes, packed.batch_sizes)
