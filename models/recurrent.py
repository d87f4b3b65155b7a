"""Your own recurrent model (kind ``recurrent``): an ``nn.LSTM`` or ``nn.GRU`` stack, a linear
head, and an output activation, served on the packed path.

The architecture is the one most users train: ``rnn = nn.GRU|nn.LSTM(input_size, hidden_size,
num_layers)``, ``head = nn.Linear(hidden_size, head_size)``, then per step one of ``none``,
``tanh``, ``sigmoid`` or ``l2_normalize`` (``y / ||y||_2`` over the step's ``head_size`` outputs,
as examples/gru_encoder.py divides each output step by its L2 norm). Its ``state_dict`` keys are
``rnn.weight_ih_l0``, ..., ``head.weight``, ``head.bias``: exactly those of ``nn.GRU`` /
``nn.LSTM`` and ``nn.Linear`` under the names ``rnn`` and ``head``. ``rnnserve export`` maps a
user's own names (``gru``, ``lstm``, ``fc``, ``dense``, ...) to these.

``forward`` takes one :class:`PackedSequence` of all the batch's sequences: the whole stack runs
in one call (cuDNN on CUDA, oneDNN/ATen on the CPU), the head and the activation run on the
packed rows (no padding), and the result keeps the input's ``batch_sizes`` and indices, so the
caller unpacks it by index. ``batch_first`` of the user's module does not matter here: a
PackedSequence has one layout, and the weights are the same either way.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal, get_args

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence

Cell = Literal["lstm", "gru"]
Activation = Literal["none", "tanh", "sigmoid", "l2_normalize"]
CELLS: tuple[str, ...] = get_args(Cell)
ACTIVATIONS: tuple[str, ...] = get_args(Activation)
# ``l2_normalize`` divides by max(||y||, EPS): an all-zero step stays zero instead of NaN
EPS = 1e-12


@dataclass(frozen=True)
class RecurrentConfig:
    """What rebuilds the architecture; the weights carry everything else."""

    cell: Cell
    input_size: int
    hidden_size: int
    num_layers: int = 1
    head_size: int = 1
    activation: Activation = "none"
    bias: bool = True  # the RNN's biases (``bias=`` of nn.GRU / nn.LSTM)
    head_bias: bool = True  # the head's bias (``bias=`` of nn.Linear)

    def __post_init__(self) -> None:
        if self.cell not in CELLS:
            raise ValueError(f"cell must be one of {', '.join(CELLS)}, not {self.cell!r}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(
                f"activation must be one of {', '.join(ACTIVATIONS)}, not {self.activation!r}"
            )
        for key in ("input_size", "hidden_size", "num_layers", "head_size"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{key} must be a positive integer, not {value!r}")
        for key in ("bias", "head_bias"):
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"{key} must be true or false, not {getattr(self, key)!r}")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def activate(y: Tensor, activation: str) -> Tensor:
    """The output activation, per row (step) of ``y`` ``[..., head_size]``."""
    if activation == "none":
        return y
    if activation == "tanh":
        return torch.tanh(y)
    if activation == "sigmoid":
        return torch.sigmoid(y)
    if activation == "l2_normalize":
        norm: Tensor = torch.linalg.vector_norm(y, dim=-1, keepdim=True)
        return y / norm.clamp_min(EPS)
    raise ValueError(f"unknown activation {activation!r}")


@dataclass
class RecurrentState:
    """A batch's recurrent state: every layer's ``h``, and ``c`` for an LSTM (``None``: GRU);
    ``[num_layers, B, hidden_size]`` each, row ``i`` of sequence ``i``."""

    h: Tensor
    c: Tensor | None = None


class RecurrentModel(nn.Module):
    """``rnn`` (nn.LSTM or nn.GRU, time-major) -> ``head`` (nn.Linear) -> activation."""

    rnn: nn.LSTM | nn.GRU

    def __init__(self, config: RecurrentConfig) -> None:
        super().__init__()
        self.config = config
        cls = nn.LSTM if config.cell == "lstm" else nn.GRU
        self.rnn = cls(config.input_size, config.hidden_size, config.num_layers, bias=config.bias)
        self.head = nn.Linear(config.hidden_size, config.head_size, bias=config.head_bias)

    @property
    def input_size(self) -> int:
        return self.config.input_size

    @property
    def head_size(self) -> int:
        return self.config.head_size

    def forward(self, x: PackedSequence) -> PackedSequence:
        """``x.data`` ``[sum T_i, input_size]`` -> ``[sum T_i, head_size]``, same layout."""
        if not isinstance(x, PackedSequence):
            raise TypeError(
                f"RecurrentModel takes a PackedSequence, not {type(x).__name__}; pack the "
                "sequences with rnnserve.models.packing.pack"
            )
        return self.forward_with_state(x)[0]

    def forward_with_state(
        self, x: PackedSequence, state: RecurrentState | None = None
    ) -> tuple[PackedSequence, RecurrentState]:
        """:meth:`forward` from ``state`` (zeros when None), and the state after each
        sequence's own last step: a long sequence run in pieces, each piece from the state the
        one before returned, equals the sequence run at once.

        ``state`` holds one row per sequence in the order the sequences were packed (as
        ``unpack`` returns them): ``h`` ``[num_layers, B, hidden_size]``, and ``c`` the same
        for an LSTM (``None`` for a GRU)."""
        if not isinstance(x, PackedSequence):
            raise TypeError(
                f"RecurrentModel takes a PackedSequence, not {type(x).__name__}; pack the "
                "sequences with rnnserve.models.packing.pack"
            )
        hx = None if state is None else self._initial(state, int(x.batch_sizes[0]), x.data)
        # one call for the whole stack; hidden.data [sum T_i, hidden]. nn.LSTM / nn.GRU take
        # hx in the sequences' own order and return the final state in it too
        hidden, final = self.rnn(x, hx)
        y = activate(self.head(hidden.data), self.config.activation)  # [sum T_i, head_size]
        out = PackedSequence(y, x.batch_sizes, x.sorted_indices, x.unsorted_indices)
        if isinstance(final, tuple):
            return out, RecurrentState(final[0], final[1])
        return out, RecurrentState(final)

    def _initial(self, state: RecurrentState, batch: int, data: Tensor) -> Any:
        cfg = self.config
        want = (cfg.num_layers, batch, cfg.hidden_size)
        lstm = cfg.cell == "lstm"
        shapes = [state.h.shape, *([] if state.c is None else [state.c.shape])]
        if any(tuple(s) != want for s in shapes) or (state.c is not None) != lstm:
            parts = "h and c" if lstm else "h (no c)"
            raise ValueError(
                f"a {cfg.cell} state is {parts} of shape {list(want)}, got "
                f"{[list(s) for s in shapes]}"
            )
        h = state.h.to(device=data.device, dtype=data.dtype)
        if state.c is None:
            return h
        return h, state.c.to(device=data.device, dtype=data.dtype)

    def extra_repr(self) -> str:
        return f"activation={self.config.activation}"
