"""Compute kernels for the models, one file per kernel family.

- :mod:`.smoother_cpu`: the smoother's recursion on packed rows (numba loops for CPU inference
  and training: ``smooth_packed_numba``, a compiled forward and backward; a differentiable
  torch step loop that runs anywhere);
- :mod:`.smoother_triton`: the smoother as a chunked parallel scan in Triton (GPU), the forward
  that serves; :mod:`.smoother_triton_single_pass` holds two single-pass forwards (not the
  default) and :mod:`.smoother_triton_backward` the training backward; each forward design
  runs through an inner entry that only launches kernels on preallocated buffers
  (:func:`.smoother_triton.launch_forward`, CUDA-graph capturable);
- :mod:`.rollout_cpu`: the Traveller's rollout as one compiled CPU loop;
- :mod:`.rollout_triton`: the Traveller's rollout as fused Triton step kernels.

Model classes pick among them; the loader compiles and captures. Kernels that need an optional
package (triton) import it lazily, so importing the models works without it.
"""

from __future__ import annotations

import functools
import os

from rnnserve.models.kernels.smoother_cpu import (
    ema_packed_numba,
    ema_packed_torch,
    last_step_rows,
    numba_available,
)


@functools.cache
def triton_available() -> bool:
    """Whether triton imports here (it is imported on the first call, not with this package)."""
    try:
        import triton  # noqa: F401
    except Exception:  # ImportError, or a broken install that fails while loading
        return False
    return True


def triton_interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (on CPU tensors): ``TRITON_INTERPRET``
    read as Triton reads it, true for 1, true, yes or on in any case (the rollout once read only
    "1", and refused the CPU tensors Triton would have interpreted)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


__all__ = [
    "ema_packed_numba",
    "ema_packed_torch",
    "last_step_rows",
    "numba_available",
    "triton_available",
    "triton_interpreting",
]
