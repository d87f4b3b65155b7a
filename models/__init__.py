"""PyTorch models served by rnnserve, their weights, and the loader.

A model directory holds one ``<name>.safetensors`` file per model. The file's metadata names the
model's ``kind`` (``smoother`` or ``traveller``) and its constructor ``config`` as JSON; the
tensors are the module's ``state_dict`` under the keys SYSTEM.md lists. The default models ship
inside this package (``models/weights``).
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from models.smoothing import LinearRecursion, SmootherConfig
from models.traveller import RolloutBackend, Traveller, TravellerConfig

__all__ = [
    "DEFAULT_MODEL_DIR",
    "KINDS",
    "LinearRecursion",
    "ModelNotFound",
    "Traveller",
    "available",
    "build",
    "describe",
    "load",
    "save",
]

DEFAULT_MODEL_DIR = Path(__file__).parent / "weights"
KINDS = ("smoother", "traveller")


class ModelNotFound(LookupError):
    """No weights file for the requested model name."""


def build(kind: str, config: dict[str, Any]) -> nn.Module:
    """A freshly initialised model of ``kind`` from its constructor arguments."""
    if kind == "smoother":
        return LinearRecursion(**asdict(SmootherConfig(**config)))
    if kind == "traveller":
        return Traveller(**asdict(TravellerConfig(**config)))
    raise ValueError(f"unknown model kind {kind!r}; known kinds: {', '.join(KINDS)}")


def kind_of(model: nn.Module) -> str:
    if isinstance(model, LinearRecursion):
        return "smoother"
    if isinstance(model, Traveller):
        return "traveller"
    raise TypeError(f"not an rnnserve model: {type(model).__name__}")


def _config(model: nn.Module) -> dict[str, Any]:
    """Constructor arguments that rebuild ``model``'s architecture."""
    if isinstance(model, LinearRecursion):
        config = asdict(model.config)
        config.pop("alpha_smooth")  # an initial value only; the weights carry alpha
        return config
    if isinstance(model, Traveller):
        return asdict(model.config)
    raise TypeError(f"not an rnnserve model: {type(model).__name__}")


def save(model: nn.Module, path: str | Path) -> None:
    """Write ``model``'s weights, kind and config to a safetensors file."""
    config = _config(model)
    tensors = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    meta = {"kind": kind_of(model), "config": json.dumps(config)}
    save_file(tensors, str(path), metadata=meta)


def available(model_dir: str | Path | None = None) -> list[str]:
    """Names of the models in ``model_dir`` (default: the weights shipped with rnnserve)."""
    root = Path(model_dir) if model_dir is not None else DEFAULT_MODEL_DIR
    return sorted(p.stem for p in root.glob("*.safetensors"))


def load(
    name: str,
    model_dir: str | Path | None = None,
    *,
    device: torch.device | str = "cpu",
    rollout_backend: RolloutBackend = "auto",
) -> nn.Module:
    """The named model with its weights, in eval mode on ``device``.

    Traveller models get their rollout compiled (``rollout_backend``) here, at load time.
    """
    root = Path(model_dir) if model_dir is not None else DEFAULT_MODEL_DIR
    path = root / f"{name}.safetensors"
    if not path.is_file():
        known = ", ".join(available(root)) or "none"
        raise ModelNotFound(f"no model {name!r} in {root} (available: {known})")
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    if "kind" not in meta or "config" not in meta:
        raise ValueError(f"{path} has no rnnserve metadata (kind, config)")
    model = build(meta["kind"], json.loads(meta["config"]))
    model.load_state_dict(load_file(str(path)), strict=True)
    model.eval().requires_grad_(False)
    model.to(device)
    if isinstance(model, Traveller):
        model.compile_rollout(rollout_backend)
    return model


def describe(model: nn.Module) -> dict[str, Any]:
    """Kind, config, tensor shapes and parameter count, as ``GET /models`` shows them."""
    kind = kind_of(model)
    config = _config(model)
    if isinstance(model, LinearRecursion):
        shapes = {"input": ["T", model.feat_dim], "output": ["T", model.feat_dim]}
    else:
        assert isinstance(model, Traveller)
        shapes = {"input": ["T", model.num_inputs], "output": ["T", 2]}
        config["rollout_backend"] = model.rollout_backend
    return {
        "kind": kind,
        "config": config,
        "shapes": shapes,
        "parameters": sum(p.numel() for p in model.parameters()),
        "device": str(next(model.parameters()).device),
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
    }
