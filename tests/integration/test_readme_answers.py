"""The README's first examples show what the bundled models answer: each ``curl`` body of its
"Use it" block, posted to the app with the bundled models, gives the figures that the block's
comments state (to the 4 decimals they are written with)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import numpy as np
import pytest

README = Path(__file__).resolve().parents[2] / "README.md"
CURL = re.compile(r"^curl -s localhost:8000(/smooth|/rollout)\b.*?-d '(.*?)'$", re.M | re.S)
CHANNEL = re.compile(r"^#\s+channel (\d+) [^:]*: ([-\d., ]+)$", re.M)


def use_it_block() -> str:
    text = README.read_text()
    start = text.index("## Use it")
    return text[start : text.index("```\n", text.index("```bash", start) + 7)]


def example(path: str) -> tuple[dict[str, object], str]:
    """The body the README posts to ``path`` and the comment lines that follow it."""
    block = use_it_block()
    for match in CURL.finditer(block):
        if match.group(1) == path:
            after = block[match.end() :]
            comments = after.split("\n\n", 1)[0]
            return json.loads(match.group(2)), comments
    raise AssertionError(f"the README's 'Use it' block posts nothing to {path}")


def floats(text: str) -> list[float]:
    return [float(v) for v in re.findall(r"-?\d+\.\d+", text)]


async def test_the_smoother_example_answers_the_channels_the_readme_shows(
    client: httpx.AsyncClient,
) -> None:
    body, comments = example("/smooth")
    stated = {int(c): floats(values) for c, values in CHANNEL.findall(comments)}
    assert len(stated) >= 2, comments  # at least a smoothed and an unsmoothed channel
    answer = await client.post("/smooth", json=body)
    assert answer.status_code == 200, answer.text
    got = np.asarray(answer.json()["sequences"][0])
    for channel, values in stated.items():
        assert got[:, channel] == pytest.approx(values, abs=5e-5), channel


async def test_the_rollout_example_answers_the_positions_the_readme_shows(
    client: httpx.AsyncClient,
) -> None:
    body, comments = example("/rollout")
    shown = comments[comments.index("# ->") :]
    stated = json.loads("".join(re.sub(r"^#\s*(->)?\s*", "", ln) for ln in shown.splitlines()))
    answer = await client.post("/rollout", json=body)
    assert answer.status_code == 200, answer.text
    got = answer.json()
    assert got["model"] == stated["model"]
    assert len(got["positions"]) == len(stated["positions"])
    for mine, theirs in zip(got["positions"], stated["positions"], strict=True):
        assert np.asarray(mine) == pytest.approx(np.asarray(theirs), abs=5e-5)


def test_the_smoother_example_shows_channels_smoothed_differently() -> None:
    # the point of the example: one channel follows the flips, another averages them
    _, comments = example("/smooth")
    stated = {int(c): floats(v) for c, v in CHANNEL.findall(comments)}
    swings = sorted(float(np.ptp(np.diff(v))) for v in stated.values())
    assert swings[0] < 0.5 * swings[-1], stated
