"""Pictures of trained models: ``python -m rnnserve.models.pictures --model-dir DIR --out DIR``.

Reads a folder that ``rnnserve train`` wrote (``smoother`` and ``traveller``,
their ``.safetensors`` and the ``.json`` numbers beside them) and renders, with matplotlib:

- ``trained_smoother.png``: noisy input, the smoother's answer and the clean signal, for a few
  channels of fresh synthetic data;
- ``trained_traveller.png``: true and rolled-out trajectories (from the commands alone, the
  model's outputs fed back) for a few held-out command sequences, with the straight-line
  baseline;
- ``training_loss.png``: the loss curves from the ``.json`` files.

A picture whose inputs are missing from the folder is skipped with a line saying so. matplotlib
comes with the ``test`` and ``bench`` extras; serving needs none of this.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rnnserve import models
from rnnserve.models import train
from rnnserve.models.packing import pack
from rnnserve.models.smoothing import LinearRecursion
from rnnserve.models.traveller import Traveller

if TYPE_CHECKING:
    from matplotlib.figure import Figure

WIDTH_PX = 960
HEIGHT_PX = 540
DPI = 96
PALETTE = 64
PICTURES = ("trained_smoother.png", "trained_traveller.png", "training_loss.png")
SMOOTHER_STEPS = 120  # long enough to see the slow channels move, short enough to see the noise
TRAVELLER_SEQUENCES = 4


def _figure(rows: int, cols: int) -> tuple[Figure, Any]:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        rows, cols, figsize=(WIDTH_PX / DPI, HEIGHT_PX / DPI), dpi=DPI, squeeze=False
    )
    return fig, axes


def _save(fig: Figure, path: Path) -> None:
    """The figure as a PNG of at most ``PALETTE`` colours: anti-aliased noisy lines otherwise
    make files several times larger, for no difference a reader can see."""
    import matplotlib.pyplot as plt
    from PIL import Image  # matplotlib's own dependency

    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI)
    plt.close(fig)
    buffer.seek(0)
    with Image.open(buffer) as image:
        paletted = image.convert("RGB").quantize(PALETTE, method=Image.Quantize.MEDIANCUT)
    # written without metadata (no time, no version): the same inputs give the same bytes
    paletted.save(path, format="png", optimize=True)


def _channels_to_show(model: LinearRecursion, count: int = 3) -> list[int]:
    """The least, a middle and the most smoothing channel: the range the smoother learnt."""
    order = torch.argsort(model.alpha_smooth.detach()).tolist()
    picks = [order[0], order[len(order) // 2], order[-1]]
    return list(dict.fromkeys(picks))[:count]


def smoother_picture(model: LinearRecursion, path: Path, seed: int) -> None:
    channels = train.Channels.spread(model.feat_dim)
    xs, ys = train.sequences(channels, [SMOOTHER_STEPS], torch.Generator().manual_seed(seed))
    with torch.no_grad():
        smoothed = model(pack(xs)).data
    x, clean = xs[0], ys[0]
    shown = _channels_to_show(model)
    fig, axes = _figure(len(shown), 1)
    for row, c in enumerate(shown):
        ax = axes[row][0]
        ax.plot(torch.tanh(x[:, c]), color="0.7", lw=0.8, label="noisy input, tanh(x)")
        ax.plot(clean[:, c], color="tab:green", lw=1.4, label="clean, tanh(z)")
        ax.plot(smoothed[:, c], color="tab:blue", lw=1.4, label="smoother")
        ax.set_ylabel(f"channel {c}")
        ax.set_title(
            f"rho {channels.rho[c]:.3f}, noise sigma {channels.sigma[c]:.2f}, "
            f"learnt alpha {float(model.alpha_smooth[c]):.3f}",
            fontsize=9,
        )
        ax.set_ylim(-1.1, 1.1)
    axes[0][0].legend(loc="upper right", fontsize=8, ncol=3)
    axes[-1][0].set_xlabel("step")
    _save(fig, path)


def traveller_picture(model: Traveller, path: Path, seed: int, length: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    us, truth = train.trajectories(gen, [length] * TRAVELLER_SEQUENCES)
    rolled = train.free_rollout(model, us)
    fig, axes = _figure(2, TRAVELLER_SEQUENCES // 2)
    for j in range(TRAVELLER_SEQUENCES):
        ax = axes[j // 2][j % 2]
        t, r, s = truth[j], rolled[j], train.straight_line(us[j])
        ax.plot(s[:, 0], s[:, 1], color="0.6", lw=1, ls="--", label="straight line")
        ax.plot(t[:, 0], t[:, 1], color="tab:green", lw=2, label="true")
        ax.plot(r[:, 0], r[:, 1], color="tab:red", lw=1.4, label="rollout")
        ax.plot([0], [0], "ko", ms=4)
        ax.set_xlim(-1, 1)
        ax.set_ylim(-1, 1)
        ax.set_aspect("equal")
        ax.set_title(f"held-out sequence {j + 1}", fontsize=9)
    axes[0][0].legend(loc="lower left", fontsize=8)
    fig.suptitle(f"traveller: {length} steps from the commands alone, its outputs fed back")
    _save(fig, path)


def loss_picture(numbers: dict[str, dict[str, Any]], path: Path) -> None:
    fig, axes = _figure(1, len(numbers))
    for j, (name, body) in enumerate(sorted(numbers.items())):
        ax = axes[0][j]
        steps = [p["step"] for p in body["curve"]]
        ax.plot(steps, [p["loss"] for p in body["curve"]], "o-", ms=3, label="training batch")
        ax.plot(steps, [p["validation"] for p in body["curve"]], "s-", ms=3, label="validation")
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel("mean squared error")
        kind = body["kind"]
        ax.set_title(name if name == kind else f"{name} ({kind})", fontsize=10)
        ax.legend(fontsize=8)
    _save(fig, path)


def render(model_dir: Path, out: Path, seed: int = 7) -> list[Path]:
    """Every picture whose inputs ``model_dir`` holds, written to ``out``; the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    names = set(models.available(model_dir))
    written: list[Path] = []
    if "smoother" in names:
        smoother = models.load("smoother", model_dir)
        assert isinstance(smoother, LinearRecursion)
        smoother_picture(smoother, out / PICTURES[0], seed)
        written.append(out / PICTURES[0])
    if "traveller" in names:
        traveller = models.load("traveller", model_dir, rollout_backend="eager")
        assert isinstance(traveller, Traveller)
        length = _trained_length(model_dir / "traveller.json")
        traveller_picture(traveller, out / PICTURES[1], seed, length)
        written.append(out / PICTURES[1])
    numbers = {
        name: json.loads((model_dir / f"{name}.json").read_text(encoding="utf-8"))
        for name in sorted(names)
        if (model_dir / f"{name}.json").is_file()
    }
    if numbers:
        loss_picture(numbers, out / PICTURES[2])
        written.append(out / PICTURES[2])
    return written


def _trained_length(numbers: Path) -> int:
    """The held-out length the trainer used, else its default: the rollout shown is one the
    model was trained for."""
    if numbers.is_file():
        body = json.loads(numbers.read_text(encoding="utf-8"))
        length = body.get("length")
        if isinstance(length, int) and length > 0:
            return length
    default = train.KIND_DEFAULTS["traveller"]["length"]
    assert isinstance(default, int)
    return default


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m rnnserve.models.pictures",
        description="Render PNGs of the trained smoother and traveller in a model folder.",
    )
    parser.add_argument("--model-dir", type=Path, required=True, help="what the trainer wrote")
    parser.add_argument("--out", type=Path, required=True, help="the folder for the PNGs")
    parser.add_argument("--seed", type=int, default=7, help="the synthetic data shown")
    args = parser.parse_args(argv)
    if not args.model_dir.is_dir():
        parser.error(f"--model-dir {args.model_dir}: not a folder")
    written = render(args.model_dir, args.out, args.seed)
    for name in PICTURES:
        if args.out / name not in written:
            print(f"skipped {name}: its model or numbers are not in {args.model_dir}")
    for path in written:
        print(f"wrote {path} ({path.stat().st_size // 1024} KiB)")
    return 0 if written else 1


if __name__ == "__main__":
    sys.exit(main())
