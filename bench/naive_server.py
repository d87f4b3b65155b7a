"""The naive baseline: the FastAPI endpoint a user writes to serve these models without rnnserve.

Usage::

    python -m bench.naive_server [--port 8001] [--torch-threads N]

Plain FastAPI; the body is a pydantic model with ``list[list[list[float]]]``; the answer is a
dict of lists that FastAPI turns into JSON its default way; the model runs once per request and
per sequence, written as plain per-step loops:

- the smoother: a Python loop over the steps of each sequence
  in torch, ``s_0 = x_0``, ``s_t = alpha * s_{t-1} + (1 - alpha) * x_t``, ``y_t = tanh(wx * s_t)``;
- the Traveller: ``nn.LSTM`` called once per step with its hidden state carried over,
  the tanh'd position fed back as the next step's input.

The weights are rnnserve's bundled ones (``models.load``), so both servers give the same answers
(to 1e-5). Same endpoints and shapes as rnnserve: ``POST /smooth``, ``POST /rollout``,
``GET /readyz``, ``GET /healthz``; no ``/metrics``. Endpoints are plain ``def`` functions, so
FastAPI runs them in its thread pool, as it runs any blocking endpoint. The server binds loopback.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import torch
import uvicorn
from fastapi import FastAPI, HTTPException
from pydantic import BaseModel
from torch import Tensor, nn

from rnnserve import models
from rnnserve.models.smoothing import LinearRecursion
from rnnserve.models.traveller import Traveller
from tests.e2e.server import Server, free_port


class SmoothBody(BaseModel):
    sequences: list[list[list[float]]]
    model: str = "smoother"


class RolloutBody(BaseModel):
    inputs: list[list[list[float]]]
    model: str = "traveller"


def stepwise_smooth(x: Tensor, alpha: Tensor, wx: Tensor) -> Tensor:
    """The smoother as a Python loop over one sequence's steps: ``x`` [T, F] -> [T, F]."""
    y = torch.empty_like(x)
    s = x[0]
    y[0] = torch.tanh(wx * s)
    for t in range(1, x.shape[0]):
        s = alpha * s + (1 - alpha) * x[t]
        y[t] = torch.tanh(wx * s)
    return y


def stepwise_rollout(lstm: nn.LSTM, output_layer: nn.Linear, inputs: Tensor) -> Tensor:
    """The Traveller as a loop calling ``nn.LSTM`` once per step: ``inputs`` [T, 1, num_inputs]
    -> positions [T, 2]."""
    hidden_state: tuple[Tensor, Tensor] | None = None
    prev_position = torch.zeros((1, 1, 2), dtype=inputs.dtype)
    positions = []
    for t in range(inputs.size(0)):
        input_data = torch.cat([prev_position, inputs[t : t + 1]], dim=2)
        lstm_out, hidden_state = lstm(input_data, hidden_state)
        position = torch.tanh(output_layer(lstm_out))
        prev_position = position
        positions.append(position)
    return torch.cat(positions, dim=0).squeeze(dim=1)


def create_app(model_dir: str | Path | None = None) -> FastAPI:
    """The baseline app; the models are loaded before it is returned."""
    smoother = models.load("smoother", model_dir)
    traveller = models.load("traveller", model_dir, rollout_backend="eager")
    assert isinstance(smoother, LinearRecursion)
    assert isinstance(traveller, Traveller)
    alpha = smoother.alpha_smooth.detach()
    wx = smoother.wx.detach()
    lstm, output_layer = traveller.lstm_layers, traveller.output_layer
    app = FastAPI(title="naive baseline")

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    def readyz() -> dict[str, Any]:
        return {"status": "ready", "torch_threads": torch.get_num_threads()}

    @app.post("/smooth")
    def smooth(body: SmoothBody) -> dict[str, Any]:
        if body.model != "smoother":
            raise HTTPException(404, f"no model {body.model!r}")
        with torch.no_grad():
            out = [stepwise_smooth(torch.tensor(seq), alpha, wx).tolist() for seq in body.sequences]
        return {"model": "smoother", "sequences": out}

    @app.post("/rollout")
    def rollout(body: RolloutBody) -> dict[str, Any]:
        if body.model != "traveller":
            raise HTTPException(404, f"no model {body.model!r}")
        with torch.no_grad():
            out = [
                stepwise_rollout(lstm, output_layer, torch.tensor(seq).unsqueeze(1)).tolist()
                for seq in body.inputs
            ]
        return {"model": "traveller", "positions": out}

    return app


def start_naive_server(
    log_dir: Path, *, torch_threads: int | None = None, timeout_s: float = 60.0
) -> Server:
    """This module's server in its own process on a free loopback port, once /readyz says 200.

    Stop it with ``tests.e2e.server.stop``.
    """
    port = free_port()
    log = log_dir / f"naive-{port}.log"
    cmd = [sys.executable, "-m", "bench.naive_server", "--port", str(port)]
    if torch_threads is not None:
        cmd += ["--torch-threads", str(torch_threads)]
    root = Path(__file__).resolve().parents[1]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])),
    }
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env, cwd=root)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"naive server exited early:\n{log.read_text()}")
        try:
            if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                return Server(proc, url, log)
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"naive server did not become ready:\n{log.read_text()}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--host", default="127.0.0.1", help="a loopback address")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument(
        "--torch-threads", type=int, default=None, help="torch intra-op threads (default: torch's)"
    )
    args = parser.parse_args(argv)
    if args.host != "localhost" and not ipaddress.ip_address(args.host).is_loopback:
        parser.error("the baseline binds loopback addresses only")
    if args.torch_threads is not None:
        torch.set_num_threads(args.torch_threads)
    uvicorn.run(create_app(), host=args.host, port=args.port, log_level="info", access_log=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
