from __future__ import annotations

import os

import pytest

# Model compute runs in one worker thread; one torch thread keeps it fast and predictable here.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors (read at triton import).
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """An ``e2e`` test (real processes: rnnserve, Prometheus) is also ``slow``, wherever it is."""
    for item in items:
        if item.get_closest_marker("e2e") is not None:
            item.add_marker(pytest.mark.slow)
