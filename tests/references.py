"""Independent references the models are checked against.

- the smoother: pandas' ``ewm(adjust=False)``, per feature;
- the Traveller: the plain step-by-step loop, calling ``nn.LSTM`` once per step
  with the hidden state carried over, using the module's own ``lstm_layers`` and
  ``output_layer``.
"""

from __future__ import annotations

import os

import numpy as np
import pandas as pd
import torch
from torch import nn

from rnnserve.models.traveller import Traveller


def smoother_reference(x: np.ndarray, alpha: np.ndarray, wx: np.ndarray) -> np.ndarray:
    """``tanh(wx * ewm(x))`` with pandas doing the recursion; ``x``: [T, F] -> [T, F]."""
    x64 = x.astype(np.float64)
    s = np.stack(
        [
            pd.Series(x64[:, f]).ewm(alpha=1 - float(alpha[f]), adjust=False).mean().to_numpy()
            for f in range(x.shape[1])
        ],
        axis=1,
    )
    return np.tanh(wx.astype(np.float64) * s)


def stepwise_rollout(
    lstm_layers: nn.LSTM, output_layer: nn.Linear, activation: nn.Module, inputs: torch.Tensor
) -> torch.Tensor:
    """The plain forward, one ``nn.LSTM`` call per step: ``inputs`` [T, 1, num_inputs] -> [T, 2]."""
    assert inputs.shape[1] == 1, "window should always be 1 since we're not using sequences"
    hidden_state = None
    prev_position = torch.zeros((1, 1, 2), device=inputs.device, dtype=inputs.dtype)
    positions_list = []
    for t in range(inputs.size(0)):
        current_inputs = inputs[t : t + 1]
        input_data = torch.cat([prev_position, current_inputs], dim=2)
        lstm_out, hidden_state = lstm_layers(input_data, hidden_state)
        out = output_layer(lstm_out)
        position = activation(out)
        prev_position = position
        positions_list.append(position)
    positions = torch.cat(positions_list, dim=0).squeeze(dim=1)
    assert positions.shape == (inputs.shape[0], 2)
    return positions


class StepwiseTraveller(nn.Module):
    """A plain module with the Traveller's attribute names (``lstm_layers``, ``output_layer``,
    ``activation``), to prove state_dicts interchange."""

    def __init__(self, num_inputs: int, hidden_size: int, num_layers: int, dropout: float):
        super().__init__()
        self.lstm_layers = nn.LSTM(
            input_size=num_inputs + 2,
            hidden_size=hidden_size,
            num_layers=num_layers,
            dropout=dropout,
            batch_first=True,
        )
        self.output_layer = nn.Linear(in_features=hidden_size, out_features=2)
        self.activation = nn.Tanh()

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return stepwise_rollout(self.lstm_layers, self.output_layer, self.activation, inputs)


def bent_model(
    num_inputs: int = 6,
    hidden: int = 16,
    layers: int = 2,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
) -> Traveller:
    """A random Traveller whose positions swing well into tanh's curve."""
    torch.manual_seed(seed)
    model = Traveller(num_inputs, hidden, layers).eval().to(dtype)
    with torch.no_grad():
        model.output_layer.weight.mul_(12.0)
        model.output_layer.bias.mul_(4.0)
        model.lstm_layers.weight_ih_l0.mul_(3.0)  # the fed-back position moves the state
    return model


def available_backends() -> list[str]:
    """The Traveller's rollout backends this environment runs (triton on CUDA, or on the CPU
    in Triton's interpreter)."""
    names = ["eager", "torchscript"]
    try:
        import rnnserve.models.kernels.rollout_cpu
    except ImportError:
        pass
    else:
        names.append("numba")
    try:
        import rnnserve.models.kernels.rollout_triton  # noqa: F401
    except ImportError:
        pass
    else:
        if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
            names.append("triton")
    return names
