"""A pytest plugin that gives the CPU a TPU's default float32 matmul precision, to check that the
docs' and doctests' comparisons hold there (issue 38: a TPU runs a float32 matmul at the default
precision as one bfloat16 pass: both operands rounded to bfloat16, products summed in float32).

Not part of the suite (CI has no TPU, and the suite runs at float32): run by hand,

    PYTHONPATH=tests python -m pytest -p _bf16_matmul tests/package/test_docs.py \\
        tests/package/test_doctests.py tests/adapters/test_convert_docs.py

It replaces ``dot_general``'s CPU lowering: each float32 product at the default precision, in
every program the CPU compiles (forward, gradient, eager), rounds its operands to bfloat16 and
sums in float32. A precision that is set (``precision=``, or
``jax.default_matmul_precision("highest")``, scoped or global, which JAX writes into the
product when it traces it) is left alone, as a TPU would.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax._src.interpreters import mlir  # (a lowering rule: every product the CPU compiles)
from jax._src.lax import lax as _lax

_PRIMITIVE = _lax.dot_general_p
_ENTRY = mlir._platform_specific_lowerings["cpu"].get(_PRIMITIVE) or mlir._lowerings[_PRIMITIVE]
_ORIGINAL = getattr(_ENTRY, "rule", _ENTRY)  # (jax 0.10 keeps the rule in a LoweringRuleEntry)


def _default(precision) -> bool:
    if isinstance(precision, tuple):
        return all(p in (None, _lax.Precision.DEFAULT) for p in precision)
    return precision in (None, _lax.Precision.DEFAULT)


def _rounded(lhs, rhs, **params):
    return _PRIMITIVE.bind(
        _lax.convert_element_type(lhs, jnp.bfloat16),
        _lax.convert_element_type(rhs, jnp.bfloat16),
        **dict(params, preferred_element_type=jnp.dtype(jnp.float32)),
    )


def _lowering(ctx, lhs, rhs, **params):
    """A float32 product at the default precision: its operands in bfloat16, its sums in
    float32 (the result float32, as asked); any other product as before."""
    f32 = jnp.dtype(jnp.float32)
    avals = [a.dtype for a in ctx.avals_in]
    if avals == [f32, f32] and _default(params.get("precision")):
        return mlir.lower_fun(_rounded, multiple_results=False)(ctx, lhs, rhs, **params)
    return _ORIGINAL(ctx, lhs, rhs, **params)


mlir.register_lowering(_PRIMITIVE, _lowering, platform="cpu")
