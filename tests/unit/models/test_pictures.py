"""``python -m rnnserve.models.pictures``: PNGs of the expected size that show something, from a
folder the trainer wrote; the committed ones are valid and small."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from rnnserve.models import pictures, train

ROOT = Path(__file__).resolve().parents[3]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from the IHDR chunk, which the PNG format puts first."""
    head = path.read_bytes()[:24]
    assert head[:8] == PNG_SIGNATURE, f"{path.name} is not a PNG"
    assert head[12:16] == b"IHDR"
    width, height = struct.unpack(">II", head[16:24])
    return width, height


def distinct_colours(path: Path) -> int:
    import matplotlib.pyplot as plt

    pixels = plt.imread(path)  # [H, W, channels] floats
    return len(np.unique(pixels.reshape(-1, pixels.shape[-1]), axis=0))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("trained")
    small = ["--steps", "20", "--batch", "8", "--quiet"]
    assert (
        train.main(["smoother", "--out", str(out), "--features", "6", "--length", "64", *small])
        == 0
    )
    tiny = ["--hidden", "16", "--layers", "1", "--length", "24", "--held-out", "8"]
    assert train.main(["traveller", "--out", str(out), *tiny, *small]) == 0
    return out


def test_renders_every_picture_at_the_expected_size_and_not_blank(
    model_dir: Path, tmp_path: Path
) -> None:
    assert pictures.main(["--model-dir", str(model_dir), "--out", str(tmp_path / "img")]) == 0
    for name in pictures.PICTURES:
        path = tmp_path / "img" / name
        assert png_size(path) == (pictures.WIDTH_PX, pictures.HEIGHT_PX), name
        assert distinct_colours(path) > 20, f"{name} looks blank"


def test_the_same_folder_renders_the_same_bytes(model_dir: Path, tmp_path: Path) -> None:
    a = pictures.render(model_dir, tmp_path / "a")
    b = pictures.render(model_dir, tmp_path / "b")
    assert [p.name for p in a] == list(pictures.PICTURES)
    for pa, pb in zip(a, b, strict=True):
        assert pa.read_bytes() == pb.read_bytes(), pa.name


def test_a_folder_without_numbers_skips_the_loss_curves(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("smoother", "traveller"):
        (bare / f"{name}.safetensors").write_bytes((model_dir / f"{name}.safetensors").read_bytes())
    assert pictures.main(["--model-dir", str(bare), "--out", str(tmp_path / "img")]) == 0
    assert "skipped training_loss.png" in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "img").iterdir()) == sorted(pictures.PICTURES[:2])


def test_a_missing_model_folder_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        pictures.main(["--model-dir", str(tmp_path / "nope"), "--out", str(tmp_path / "img")])
    assert info.value.code == 2
    assert "not a folder" in capsys.readouterr().err


@pytest.mark.parametrize("name", pictures.PICTURES)
def test_the_committed_pictures_are_valid_and_small(name: str) -> None:
    path = ROOT / "docs" / "img" / name
    assert png_size(path) == (pictures.WIDTH_PX, pictures.HEIGHT_PX)
    assert path.stat().st_size < 150 * 1024
    assert distinct_colours(path) > 20
