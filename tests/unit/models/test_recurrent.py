"""Kind ``recurrent``: your own LSTM/GRU stack + linear head, on the packed path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

from rnnserve import models
from rnnserve.models.packing import pack, unpack
from rnnserve.models.recurrent import ACTIVATIONS, RecurrentConfig, RecurrentModel

LENGTHS = (5, 1, 9, 3, 9)


class UserModel(nn.Module):
    """What a user wrote: their names, their layout."""

    def __init__(self, cell: str, batch_first: bool, hidden: int = 8) -> None:
        super().__init__()
        cls = nn.LSTM if cell == "lstm" else nn.GRU
        self.batch_first = batch_first
        self.rnn = cls(3, hidden, num_layers=2, batch_first=batch_first)
        self.head = nn.Linear(hidden, 2)

    def forward(self, x: Tensor, activation: str) -> Tensor:
        """``x`` ``[T, F]`` one sequence, through the user's own layout."""
        batch = x.unsqueeze(0 if self.batch_first else 1)
        h, _ = self.rnn(batch)
        y = self.head(h.squeeze(0 if self.batch_first else 1))
        if activation == "tanh":
            return torch.tanh(y)
        if activation == "sigmoid":
            return torch.sigmoid(y)
        if activation == "l2_normalize":
            return y / y.norm(dim=-1, keepdim=True)
        return y


def ours(user: UserModel, cell: str, activation: str) -> RecurrentModel:
    cfg = RecurrentConfig(cell, 3, user.rnn.hidden_size, 2, 2, activation)  # type: ignore[arg-type]
    model = RecurrentModel(cfg)
    model.load_state_dict(user.state_dict())  # the user's keys: rnn.*, head.*
    return model.eval()


def inputs(seed: int = 0) -> list[Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, 3, generator=gen) for n in LENGTHS]


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_matches_the_users_module_per_sequence(
    cell: str, batch_first: bool, activation: str
) -> None:
    torch.manual_seed(0)
    user = UserModel(cell, batch_first).eval()
    model = ours(user, cell, activation)
    xs = inputs()
    with torch.no_grad():
        got = unpack(model(pack(xs)))
        for x, y in zip(xs, got, strict=True):
            torch.testing.assert_close(y, user(x, activation), atol=1e-6, rtol=0)


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_a_packed_batch_equals_each_sequence_alone(cell: str) -> None:
    torch.manual_seed(1)
    model = ours(UserModel(cell, False), cell, "l2_normalize")
    xs = inputs(1)
    with torch.no_grad():
        together = unpack(model(pack(xs)))
        for x, y in zip(xs, together, strict=True):
            alone = unpack(model(pack([x])))[0]
            torch.testing.assert_close(y, alone, atol=1e-6, rtol=0)


def test_keeps_the_layout_and_refuses_a_plain_tensor() -> None:
    model = RecurrentModel(RecurrentConfig("gru", 3, 4, 1, 5))
    packed = pack(inputs())
    out = model(packed)
    assert out.data.shape == (sum(LENGTHS), 5)
    assert torch.equal(out.batch_sizes, packed.batch_sizes)
    assert out.sorted_indices is not None
    assert packed.sorted_indices is not None
    assert torch.equal(out.sorted_indices, packed.sorted_indices)
    with pytest.raises(TypeError, match="PackedSequence"):
        model(torch.zeros(3, 1, 3))


def test_l2_normalize_leaves_a_zero_step_zero() -> None:
    model = RecurrentModel(RecurrentConfig("gru", 3, 4, 1, 2, "l2_normalize"))
    with torch.no_grad():
        model.head.weight.zero_()
        model.head.bias.zero_()
        out = model(pack(inputs()))
    assert torch.equal(out.data, torch.zeros_like(out.data))


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"cell": "rnn", "input_size": 3, "hidden_size": 4}, "cell must be one of"),
        ({"cell": "gru", "input_size": 0, "hidden_size": 4}, "input_size must be a positive"),
        ({"cell": "gru", "input_size": 3, "hidden_size": 4, "activation": "relu"}, "activation"),
        ({"cell": "gru", "input_size": 3, "hidden_size": 4, "dropout": 0.1}, "dropout"),
    ],
)
def test_bad_configs_are_refused(config: dict[str, object], message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        models.build("recurrent", config)


def test_save_read_describe(tmp_path: Path) -> None:
    torch.manual_seed(2)
    model = RecurrentModel(RecurrentConfig("lstm", 3, 8, 2, 2, "tanh")).eval()
    models.save(model, tmp_path / "mine.safetensors")
    assert models.available(tmp_path) == ["mine"]
    back = models.load("mine", tmp_path)
    assert isinstance(back, RecurrentModel)
    assert models.kind_of(back) == "recurrent"
    xs = inputs()
    with torch.no_grad():
        for a, b in zip(unpack(model(pack(xs))), unpack(back(pack(xs))), strict=True):
            assert torch.equal(a, b)
    info = models.describe(back)
    assert info["kind"] == "recurrent"
    assert info["config"]["cell"] == "lstm"
    assert info["config"]["activation"] == "tanh"
    assert info["shapes"] == {"input": ["T", 3], "output": ["T", 2]}
    assert info["parameters"] == sum(p.numel() for p in model.parameters())


def test_a_file_with_wrong_shapes_is_refused_in_one_line(tmp_path: Path) -> None:
    model = RecurrentModel(RecurrentConfig("gru", 3, 8, 1, 2))
    models.save(model, tmp_path / "mine.safetensors")
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(tmp_path / "mine.safetensors"))
    config = '{"cell": "gru", "input_size": 4, "hidden_size": 8, "num_layers": 1, "head_size": 2}'
    save_file(tensors, str(tmp_path / "bad.safetensors"), {"kind": "recurrent", "config": config})
    with pytest.raises(models.ModelLoadError) as info:
        models.read("bad", tmp_path)
    text = str(info.value)
    assert "\n" not in text
    assert "bad.safetensors" in text
    assert "rnn.weight_ih_l0" in text
