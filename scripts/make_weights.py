"""Write the default models that ship in models/weights: the trainer's output with its default
settings and seed (``rnnserve train``), each with its model card and the card's
numbers (``<name>.md``, ``<name>.json``).

Run from the repository root: ``python scripts/make_weights.py [out_dir]`` (minutes on a CPU).
The tests check that the shipped models score on fresh held-out data what their cards say, and
(slow) that this script trains models that score the same.
"""

from __future__ import annotations

import sys
from pathlib import Path

from rnnserve import models
from rnnserve.models import train

KINDS = ("smoother", "traveller")


def main(out_dir: str | None = None) -> None:
    out = Path(out_dir) if out_dir else models.DEFAULT_MODEL_DIR
    out.mkdir(parents=True, exist_ok=True)
    for kind in KINDS:
        if train.main([kind, "--out", str(out), "--quiet"]) != 0:
            raise SystemExit(f"training the {kind} failed")
        for suffix in (".safetensors", ".md", ".json"):
            (out / f"{kind}{suffix}").chmod(0o644)  # images run as another user
    print(f"wrote the trained {' and '.join(KINDS)} to {out}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
