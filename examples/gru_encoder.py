"""Serve your own model: a GRU encoder, exported and served without rnnserve code.

The model is plain PyTorch: ``nn.GRU(6, 200, num_layers=2)`` -> ``nn.Linear(200, 4)`` -> each
output step divided by its L2 norm. (A zero initial state sized for one batch size, and the
norm broadcast with ``repeat``, would tie the module to that batch; the default zero state and
``keepdim`` do the same for any batch.) Run::

    python examples/gru_encoder.py --out-dir my-models    # trains a little, saves, exports
    rnnserve --model-dir my-models                        # serves gru_encoder (and any others)
    curl -s localhost:8000/models/gru_encoder/infer -H 'content-type: application/json' \\
      -d '{"inputs": [[[0.1, 0.2, 0.3, 0.4, 0.5, 0.6], [0, 0, 0, 0, 0, 1]]]}'

The export step is the command line anyone can run on their own checkpoint::

    rnnserve export --checkpoint gru_encoder.pt --name gru_encoder \\
        --out-dir my-models --activation l2_normalize

The same encoder can also be served as TorchScript (:class:`PackedGRUEncoder`, the
packed-sequence signature ``forward(data, batch_sizes)``; TorchScript files are code, so the
server loads them only with ``RNNSERVE_TRUST_TORCHSCRIPT=true``)::

    python examples/gru_encoder.py --out-dir my-models --torchscript
    # = rnnserve export --torchscript --factory examples.gru_encoder:make_packed \
    #     --checkpoint gru_encoder.pt --name gru_encoder_ts --out-dir my-models
    RNNSERVE_TRUST_TORCHSCRIPT=true rnnserve --model-dir my-models

:func:`gru_cell_loop` is an independent reference (one ``nn.GRUCell`` per layer, one sequence,
one step at a time); the tests check the server against it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence

from rnnserve.models import export


class GRUEncoder(nn.Module):
    """The encoder: 2-layer GRU, a linear layer, then per-step L2 normalisation."""

    def __init__(self, in_features: int = 6, hidden_size: int = 200, out_features: int = 4) -> None:
        super().__init__()
        self.gru = nn.GRU(input_size=in_features, hidden_size=hidden_size, num_layers=2)
        self.dense = nn.Linear(hidden_size, out_features)

    def forward(self, x: Tensor) -> Tensor:
        """``x`` ``[T, B, in_features]`` (time-major, ``nn.GRU``'s default) -> ``[T, B, out]``."""
        h, _ = self.gru(x)  # zero initial state, whatever the batch size
        y = self.dense(h)
        out: Tensor = y / y.norm(dim=-1, keepdim=True)
        return out


class PackedGRUEncoder(nn.Module):
    """The same model with rnnserve's TorchScript signature: the rows of a packed batch in,
    one output row per input row out, in the same packed order (see rnnserve.models.torchscript)."""

    def __init__(self, encoder: GRUEncoder | None = None) -> None:
        super().__init__()
        encoder = encoder if encoder is not None else GRUEncoder()
        self.gru = encoder.gru
        self.dense = encoder.dense
        self.input_size = encoder.gru.input_size

    def forward(self, data: Tensor, batch_sizes: Tensor) -> Tensor:
        """``data`` ``[N, 6]``, ``batch_sizes`` ``[T]`` (a PackedSequence's fields) ->
        ``[N, 4]``."""
        h, _ = self.gru(PackedSequence(data, batch_sizes, None, None))
        y = self.dense(h.data)
        out: Tensor = y / torch.linalg.vector_norm(y, dim=-1, keepdim=True)
        return out


def make() -> GRUEncoder:
    """A factory for ``rnnserve export --factory examples.gru_encoder:make``."""
    torch.manual_seed(0)
    return GRUEncoder()


def make_packed() -> PackedGRUEncoder:
    """A factory for ``rnnserve export --torchscript --factory
    examples.gru_encoder:make_packed``: the weights of :func:`make`."""
    return PackedGRUEncoder(make())


def gru_cell_loop(model: GRUEncoder, x: Tensor) -> Tensor:
    """The reference: one sequence ``x`` ``[T, 6]`` through GRUCells step by step -> ``[T, 4]``."""
    gru = model.gru
    cells = []
    for k in range(gru.num_layers):
        cell = nn.GRUCell(gru.input_size if k == 0 else gru.hidden_size, gru.hidden_size)
        cell.load_state_dict(
            {
                "weight_ih": getattr(gru, f"weight_ih_l{k}"),
                "weight_hh": getattr(gru, f"weight_hh_l{k}"),
                "bias_ih": getattr(gru, f"bias_ih_l{k}"),
                "bias_hh": getattr(gru, f"bias_hh_l{k}"),
            }
        )
        cells.append(cell)
    h = [torch.zeros(1, gru.hidden_size) for _ in cells]
    out = []
    with torch.no_grad():
        for t in range(len(x)):
            z = x[t : t + 1]  # [1, F]
            for k, cell in enumerate(cells):
                h[k] = cell(z, h[k])
                z = h[k]
            y = model.dense(z)[0]
            out.append(y / y.norm())
    return torch.stack(out)


def train(model: GRUEncoder, steps: int = 20) -> None:
    """A few steps of training towards a fixed direction, so the weights are no longer the
    initial ones (stands in for the user's own training)."""
    gen = torch.Generator().manual_seed(1)
    target = nn.functional.normalize(torch.randn(4, generator=gen), dim=0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(steps):
        x = torch.randn(30, 8, 6, generator=gen)
        loss = (model(x) - target).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Train, save and export the example GRU encoder.")
    parser.add_argument("--out-dir", type=Path, default=Path("my-models"))
    parser.add_argument("--name", default="gru_encoder")
    parser.add_argument("--steps", type=int, default=20, help="training steps (0: none)")
    parser.add_argument(
        "--torchscript",
        action="store_true",
        help="also export <name>_ts.torchscript.pt (served with RNNSERVE_TRUST_TORCHSCRIPT=true)",
    )
    args = parser.parse_args(argv)
    model = make()
    if args.steps:
        train(model, args.steps)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    checkpoint = args.out_dir.parent / f"{args.name}.pt"  # not in the model dir: a pickle
    torch.save(model.state_dict(), checkpoint)
    code = export.main(
        [
            "--checkpoint", str(checkpoint),
            "--name", args.name,
            "--out-dir", str(args.out_dir),
            "--activation", "l2_normalize",
        ]
    )  # fmt: skip
    if code == 0 and args.torchscript:  # what --torchscript --factory ...:make_packed does
        path, width, worst = export.export_torchscript(
            PackedGRUEncoder(model), 6, f"{args.name}_ts", args.out_dir
        )
        print(f"wrote {path} (torchscript: input size 6, output size {width}); answers like "
              f"yours to {worst:.2g}; serve it with RNNSERVE_TRUST_TORCHSCRIPT=true")  # fmt: skip
    return code


if __name__ == "__main__":
    sys.exit(main())
