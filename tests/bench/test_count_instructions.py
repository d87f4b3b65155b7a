"""``bench/count_instructions.py``: splitting callgrind's per-function counts into compiled code
(JIT functions: no symbol, no object file) and the rest."""

from __future__ import annotations

import pytest

from bench.count_instructions import split_by_origin

# the shape of `callgrind_annotate --inclusive=no` (valgrind 3.19), lines taken from a real run
ANNOTATED = """\
--------------------------------------------------------------------------------
Ir
--------------------------------------------------------------------------------
2,878,233,742 (100.0%)  PROGRAM TOTALS

--------------------------------------------------------------------------------
Ir                    file:function
--------------------------------------------------------------------------------
388,648,664 (13.50%)  Python/ceval.c:_PyEval_EvalFrameDefault'2 [/usr/lib/libpython3.11.so.1.0]
  5,483,769 ( 0.19%)  ???:0x000000000000aa60 [/usr/lib/x86_64-linux-gnu/libz.so.1.2.13]
    721,492 ( 0.03%)  ???:0x00000000049367a8 [???]
    409,381 ( 0.01%)  ???:0x0000000004936728 [???]
     12,000 ( 0.00%)  ???:mkl_blas_avx512_sgemm_kernel [/usr/lib/libmkl_core.so]
"""


def test_the_program_total_and_the_jit_functions_are_read() -> None:
    assert split_by_origin(ANNOTATED) == (2_878_233_742, 721_492 + 409_381)


def test_a_stripped_library_is_not_counted_as_compiled_code() -> None:
    without_jit = "\n".join(line for line in ANNOTATED.splitlines() if "[???]" not in line)
    assert split_by_origin(without_jit) == (2_878_233_742, 0)


def test_output_without_a_total_is_refused() -> None:
    with pytest.raises(ValueError, match="PROGRAM TOTALS"):
        split_by_origin(ANNOTATED.replace("PROGRAM TOTALS", "something else"))
