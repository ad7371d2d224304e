"""tests/_bf16_matmul.py, the plugin that gives the CPU a TPU's default matmul precision: it
rounds a float32 product's operands to bfloat16 at the default precision, and only there. In a
subprocess (the plugin changes the process's matmuls for good)."""

import json
import os
import pathlib
import subprocess
import sys

from _tolerance import EPS, LAMBDA

TESTS = pathlib.Path(__file__).resolve().parent
K = 256  # (the contraction's length)
CODE = f"""
import json, _bf16_matmul, jax, jax.numpy as jnp, numpy as np
x = jax.random.normal(jax.random.key(0), (8, {K}))
w = jax.random.normal(jax.random.key(1), ({K}, 8))
def f64(a): return np.asarray(a, np.float64)
exact = f64(x) @ f64(w)
rounded = f64(x.astype(jnp.bfloat16)) @ f64(w.astype(jnp.bfloat16))
def off(y, want): return float(np.abs(f64(y) - want).max() / np.abs(want).max())
with jax.default_matmul_precision("highest"):
    highest = off(jax.jit(jnp.matmul)(x, w), exact)
grad = jax.grad(lambda w: (x @ w).sum())(w)  # x.T @ ones: rounded too
print(json.dumps({{
    "matmul": off(x @ w, rounded), "einsum": off(jnp.einsum("te,ed->td", x, w), rounded),
    "jit": off(jax.jit(jnp.matmul)(x, w), rounded), "highest": highest,
    "bf16 from exact": off(x @ w, exact),
    "grad": off(grad, f64(x.astype(jnp.bfloat16)).T @ np.ones((8, 8))),
}}))
"""


def test_default_precision_products_are_bfloat16_ones_and_highest_is_float32():
    env = dict(os.environ, PYTHONPATH=str(TESTS))
    out = subprocess.run(
        [sys.executable, "-c", CODE], capture_output=True, text=True, check=True, env=env
    ).stdout
    found = json.loads(out)
    # A float32 sum of the rounded operands' exact products: within float32's rounding of a
    # K-term sum (tests/_tolerance.py's probabilistic bound, lambda sqrt(K) eps).
    float32_sum = LAMBDA * K**0.5 * EPS
    for how in ("matmul", "einsum", "jit", "grad"):
        assert found[how] <= float32_sum, (how, found)
    assert found["highest"] <= float32_sum, found
    # ... and the rounding shows: bfloat16 keeps 8 bits, float32 24.
    assert found["bf16 from exact"] > 2**-12, found
