"""Call a running rnnserve with the Python client: both endpoints, then a streamed rollout.

Start a server first (``rnnserve``), then::

    python examples/client_example.py --url http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse

import numpy as np

from rnnserve.client import Client


def main() -> None:
    parser = argparse.ArgumentParser(description="Call a running rnnserve with rnnserve.client.")
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    args = parser.parse_args()
    rng = np.random.default_rng(0)

    with Client(args.url, timeout=30) as rnn:
        # the three lines: one sequence in, one array out; a list in, a list out
        smoothed = rnn.smooth(rng.standard_normal((100, 16)))  # [100, 16] float32
        positions = rnn.rollout([rng.standard_normal((50, 6)), rng.standard_normal((7, 6))])
        print(f"smooth: {smoothed.shape}; rollout: {[p.shape for p in positions]}")

        for m in rnn.models():
            print(f"model {m.name}: {m.kind}, [T, {m.input_dim}] -> [T, {m.output_dim}]")

        # a long rollout, streamed: positions arrive chunk by chunk while it runs
        with rnn.stream_rollout(rng.standard_normal((500, 6))) as stream:
            for sequence, start, chunk in stream:
                end = start + len(chunk) - 1
                print(f"sequence {sequence}, steps {start}..{end}: last position {chunk[-1]}")
        print(f"streamed by model {stream.model}")


if __name__ == "__main__":
    main()
