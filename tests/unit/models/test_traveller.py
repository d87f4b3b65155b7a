"""The Traveller against a step-by-step loop calling nn.LSTM once per step."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.utils.rnn import PackedSequence

from rnnserve import models
from rnnserve.models.packing import pack, unpack
from rnnserve.models.traveller import Traveller
from tests.references import StepwiseTraveller, stepwise_rollout

BACKENDS = ["eager", "torchscript"]


def make_model(num_inputs: int = 6, hidden: int = 16, layers: int = 2, seed: int = 0) -> Traveller:
    torch.manual_seed(seed)
    return Traveller(num_inputs, hidden, layers).eval()


def reference(model: Traveller, u: torch.Tensor) -> torch.Tensor:
    return stepwise_rollout(model.lstm_layers, model.output_layer, model.activation, u[:, None, :])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layers", [1, 2, 3])
def test_rollout_matches_the_stepwise_loop(backend: str, layers: int) -> None:
    model = make_model(layers=layers)
    model.compile_rollout(backend)  # type: ignore[arg-type]
    seqs = [torch.randn(n, 6) for n in (12, 1, 30, 7)]
    with torch.inference_mode():
        out = unpack(model.rollout(pack(seqs)))
        for u, y in zip(seqs, out, strict=True):
            torch.testing.assert_close(y, reference(model, u), atol=1e-5, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_forward_takes_one_time_major_sequence(backend: str) -> None:
    model = make_model()
    model.compile_rollout(backend)  # type: ignore[arg-type]
    u = torch.randn(25, 1, 6)
    with torch.inference_mode():
        y = model(u)
        assert y.shape == (25, 2)
        torch.testing.assert_close(y, reference(model, u[:, 0]), atol=1e-5, rtol=0)


@settings(max_examples=25, deadline=None)
@given(lengths=st.lists(st.integers(1, 20), min_size=1, max_size=10), seed=st.integers(0, 999))
def test_packed_batch_equals_each_sequence_alone(lengths: list[int], seed: int) -> None:
    model = make_model(num_inputs=3, hidden=8, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randn(n, 3, generator=gen) for n in lengths]
    with torch.inference_mode():
        together = unpack(model.rollout(pack(seqs)))
        for u, y in zip(seqs, together, strict=True):
            alone = model.rollout(pack([u])).data
            torch.testing.assert_close(y, alone, atol=1e-5, rtol=0)


def test_rollout_keeps_packed_metadata_and_shape() -> None:
    model = make_model()
    packed = pack([torch.randn(4, 6), torch.randn(9, 6)])
    with torch.inference_mode():
        out = model.rollout(packed)
    assert isinstance(out, PackedSequence)
    assert out.data.shape == (13, 2)
    assert torch.equal(out.batch_sizes, packed.batch_sizes)
    assert torch.equal(out.unsorted_indices, packed.unsorted_indices)
    assert out.data.abs().max() <= 1  # tanh output


def test_state_dict_interchanges_with_a_plain_lstm_module() -> None:
    plain_model = StepwiseTraveller(6, 16, 2, 0.0).eval()
    ours = Traveller(6, 16, 2)
    assert set(ours.state_dict()) == set(plain_model.state_dict())
    ours.load_state_dict(plain_model.state_dict(), strict=True)
    ours.eval()
    u = torch.randn(10, 1, 6)
    with torch.inference_mode():
        torch.testing.assert_close(ours(u), plain_model(u), atol=1e-5, rtol=0)


def test_training_mode_with_dropout_uses_nn_lstm() -> None:
    torch.manual_seed(0)
    model = Traveller(6, 16, 2, dropout=0.5).train()
    u = torch.randn(8, 1, 6)
    torch.manual_seed(1)
    y = model(u)
    torch.manual_seed(1)
    expected = reference(model, u[:, 0])
    torch.testing.assert_close(y, expected)
    y.sum().backward()
    assert model.lstm_layers.weight_hh_l0.grad is not None


def test_rollout_is_differentiable() -> None:
    model = make_model().double()
    packed = pack([torch.randn(5, 6, dtype=torch.float64), torch.randn(3, 6, dtype=torch.float64)])
    model.rollout(packed).data.sum().backward()
    grad = model.output_layer.weight.grad
    assert grad is not None
    assert grad.abs().sum() > 0


def test_refuses_wrong_shapes() -> None:
    model = make_model()
    with pytest.raises(TypeError, match="PackedSequence"):
        model.rollout(torch.randn(3, 6))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="6 features"):
        model.rollout(pack([torch.randn(3, 5)]))
    with pytest.raises(ValueError, match=r"\[T, 1, 6\]"):
        model(torch.randn(3, 2, 6))


def test_default_weights_load_compiled() -> None:
    model = models.load("traveller")
    assert isinstance(model, Traveller)
    assert model.rollout_backend == "numba"  # "auto" on the CPU: the fastest measured there
    assert (model.num_inputs, model.hidden_size, model.num_layers) == (6, 128, 2)
    u = torch.randn(40, 6)
    with torch.inference_mode():
        y = model.rollout(pack([u])).data
        torch.testing.assert_close(y, reference(model, u), atol=1e-5, rtol=0)
