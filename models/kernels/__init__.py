"""Compute kernels for the models, one file per kernel family.

- :mod:`models.kernels.smoother_cpu`: the smoother's recursion on packed rows (a numba loop for
  CPU inference; a differentiable torch step loop that runs anywhere);
- :mod:`models.kernels.smoother_triton`: the smoother as a chunked parallel scan in Triton (GPU);
- :mod:`models.kernels.rollout_cpu`: the Traveller's rollout as one compiled CPU loop;
- :mod:`models.kernels.rollout_triton`: the Traveller's rollout as fused Triton step kernels.

Model classes pick among them; the loader compiles and captures. Kernels that need an optional
package (triton) import it lazily, so ``import models`` works without it.
"""

from models.kernels.smoother_cpu import ema_packed_numba, ema_packed_torch, numba_available

__all__ = ["ema_packed_numba", "ema_packed_torch", "numba_available"]
