"""What the oldest supported JAX (jax/jaxlib 0.10.0, ``.ci/oldest``) does differently, for
the tests that must allow for it.

- **Scales 1 ulp apart.** jax 0.10.2 on XLA:CPU computes a quantization scale inside a Stack's
  scan to the bit of a loop's eager one; 0.10.0 (and 0.10.2 on a TPU) rounds some channels'
  scales 1 ulp apart there, which
  moves a code at a rounding boundary by one (and, through qwix's fake quantization, the
  calibration statistics downstream of it).
- **qwix SRQ inside a scan.** XLA:CPU of jaxlib 0.10.0 cannot compile qwix's static-range
  quantized layer (int8 activations times int8 weights) inside ``lax.scan``: a plain
  ``lax.scan`` over a ``nn.Dense`` with a qwix SRQ rule fails alike, outside stackwise, with
  "INTERNAL: RET_CHECK failure ... Invalid LLVM IR before optimizations: Both operands to a
  binary operator are not of the same type!", for some shapes (the tests' (4, 8) -> 16 -> 8
  blocks compile; the docstrings' (2, 8) -> 8 do not). jaxlib 0.10.2 compiles both.
"""

import jax
import numpy as np
from _trees import assert_trees_bitwise

JAX = tuple(int(v) for v in jax.__version__.split(".")[:3])
#: Scales (and so codes) computed inside a scan are bitwise a loop's: on XLA:CPU from jax
#: 0.10.2. Not on a TPU: on a v5e (jax 0.10.2, libtpu 0.0.42.1) qwix's NNX LoRA/QLoRA stack
#: and its loop quantized some weights to other bits (the TPU tier, 2026-12-06).
EXACT_SCALES = JAX >= (0, 10, 2) and jax.default_backend() == "cpu"
EXACT_SCALES_WHY = (
    "jax < 0.10.2, and a TPU, round a fake-quantization scale inside the scan 1 ulp from the "
    "loop's, "
    "which flips a code and so what is computed downstream of it (tests/_versions.py)"
)
#: Calibration statistics gathered through qwix's fake quantization inside a scan are the
#: loop's (to the reassociation of their sums) on XLA:CPU, on 0.10.0 too (the linen test holds
#: on .ci/oldest's versions); on a TPU they are not (the TPU tier, 2026-12-07).
CALIBRATION_AS_LOOP = jax.default_backend() == "cpu"
CALIBRATION_AS_LOOP_WHY = (
    "a TPU rounds a fake-quantization scale inside the scan 1 ulp from the loop's, which flips "
    "a code and moves the calibration statistics downstream of it (tests/_versions.py)"
)
#: How many ulp a float32 scale computed inside a compiled scan may be from a loop's: XLA:TPU
#: divides float32 within 2 ulp (a v5e, jax 0.10.2, libtpu 0.0.42.1, in the TPU tier's runs:
#: the quantized trees above, and qwix's NNX statistics converted inside the scan, 2026-12-07);
#: XLA:CPU within 1.
SCALE_ULP = 1 if jax.default_backend() == "cpu" else 2
#: qwix SRQ compiles inside any lax.scan on XLA:CPU.
SRQ_IN_SCAN = JAX >= (0, 10, 2) or jax.default_backend() != "cpu"
SRQ_IN_SCAN_WHY = (
    "XLA:CPU of jaxlib < 0.10.2 cannot compile qwix's static-range quantized dot inside "
    "lax.scan ('Invalid LLVM IR before optimizations'; tests/_versions.py)"
)


def assert_same_quantization(ours, theirs):
    """Quantized trees computed inside a scan and by a loop: bitwise where ``EXACT_SCALES``;
    else the same structure, dtypes and shapes, floats (scales) within 1 ulp and codes
    within 1."""
    if EXACT_SCALES:
        assert_trees_bitwise(ours, theirs)
        return
    assert jax.tree.structure(ours) == jax.tree.structure(theirs)
    for x, y in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        if np.issubdtype(x.dtype, np.floating):
            np.testing.assert_array_max_ulp(x, y, maxulp=SCALE_ULP)
        else:
            assert np.abs(x.astype(np.int32) - y.astype(np.int32)).max() <= 1
