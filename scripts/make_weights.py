"""Write the default weights that ship in models/weights (seeded, deterministic, untrained).

Run from the repository root: ``python scripts/make_weights.py [out_dir]``. The test suite checks
that the shipped files equal what this script produces.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from rnnserve import models
from rnnserve.models.smoothing import LinearRecursion
from rnnserve.models.traveller import Traveller

SEED = 20261130


def default_smoother() -> LinearRecursion:
    gen = torch.Generator().manual_seed(SEED)
    model = LinearRecursion(feat_dim=16)
    with torch.no_grad():
        # per-feature constants that differ, so a test can tell features apart
        model.alpha_smooth.copy_(0.1 + 0.8 * torch.rand(16, generator=gen))
        model.wx.copy_(0.5 + torch.rand(16, generator=gen))
    return model


def default_traveller() -> Traveller:
    torch.manual_seed(SEED)  # nn.LSTM / nn.Linear initialise from the global generator
    return Traveller(num_inputs=6, hidden_size=128, num_layers=2)


def main(out_dir: str | None = None) -> None:
    out = Path(out_dir) if out_dir else models.DEFAULT_MODEL_DIR
    out.mkdir(parents=True, exist_ok=True)
    models.save(default_smoother(), out / "smoother.safetensors")
    models.save(default_traveller(), out / "traveller.safetensors")
    for f in ("smoother.safetensors", "traveller.safetensors"):
        (out / f).chmod(0o644)  # safetensors writes 0600; images run as another user
    print(f"wrote {out}/smoother.safetensors and {out}/traveller.safetensors")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
