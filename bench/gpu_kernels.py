"""The one Triton kernel of ``bench.gpu_decide``'s floors: an empty one, for the launch cost."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import triton
from torch import Tensor


def _empty(x_ptr):  # type: ignore[no-untyped-def]
    # touches nothing: its time is the launch's alone
    pass


_EMPTY: Any = triton.jit(_empty)


def empty_launch(target: Tensor) -> Callable[[], None]:
    """A launch of the empty kernel (one program) on ``target``'s device."""

    def launch() -> None:
        _EMPTY[(1,)](target)

    return launch
