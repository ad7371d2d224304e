"""How far two evaluations of the model's logits may be apart: the precision its matmuls run
at here, and a bound derived from it, relative to the logits' size.

The example checks the stacked model against its Python loop, and KV-cached decoding (and the
serving layout) against the full forward (``sample.py``): the same function, its sums done in
another order. Two such evaluations of a chain of sums differ by rounding alone, at most::

    max|got - want| <= units * 2u * max|want|,   units = LAMBDA * (2 * layers * S + 1)

with ``u`` the unit roundoff of the precision a matmul runs at (:data:`UNIT_ROUNDOFF`) and
``S = sum(sqrt(w))`` over a block's chained sums of ``w`` terms each (the qkv projection,
the scores, the attention over the context, the output projection, the MLP's two): a sum of
``w`` terms in any two orders differs by at most ``LAMBDA * sqrt(w) * 2u`` of its terms'
size, with probability over ``1 - 2w exp(-LAMBDA**2 / 2)`` (Higham and Mary, SIAM J. Sci.
Comput. 41(5), 2019), the errors of the layers' sums added as if all erred one way. (The
suite's ``tests/_tolerance.py`` derives its bounds the same way.)

The precision is what the backend and ``jax_default_matmul_precision`` make of the operands'
dtype (:func:`matmul_precision`): float32 on a CPU; unless told otherwise, a TPU rounds a
float32 matmul's operands to bfloat16 and a GPU to TF32. At bfloat16 the bound is 26 times
the logits (the default model: 3,377 x 2**-7), which no wrong decode would exceed: there
:func:`check_precision` runs the comparison at ``'highest'`` (float32) instead, where the
bound is 4.0e-4 of them (3,377 x 2**-23).
"""

from __future__ import annotations

if __name__ == "__main__":  # run by mistake: not a command
    raise SystemExit(f"{__file__} is a module of the example's package, not a command; the "
                     "command is: python examples/transformer_lm.py (--help lists its flags)")

import contextlib
import math
from typing import NamedTuple

import jax
import numpy as np

#: The unit roundoff ``u`` (half the spacing of the numbers at 1.0) of each precision a
#: float32 matmul may run at: its operands rounded to it, their products summed in float32.
UNIT_ROUNDOFF = {"bfloat16": 2.0**-8, "tensorfloat32": 2.0**-11, "float32": 2.0**-24}
#: The precision each backend runs a float32 matmul at when ``jax_default_matmul_precision``
#: asks for none (unset, "default" or "fastest").
BACKEND_DEFAULT = {"tpu": "bfloat16", "gpu": "tensorfloat32", "cpu": "float32"}
#: What each value of ``jax_default_matmul_precision`` asks for (None: the backend's default).
#: "high" is 3 bfloat16 passes on a TPU, at least as precise as TF32: taken as TF32.
SETTINGS = {None: None, "default": None, "fastest": None, "bfloat16": "bfloat16",
            "high": "tensorfloat32", "tensorfloat32": "tensorfloat32",
            "bfloat16_3x": "tensorfloat32", "highest": "float32", "float32": "float32"}
#: Higham and Mary's lambda: a sum strays past its share with probability below 3e-8 w.
LAMBDA = 6


class Precision(NamedTuple):
    """The precision a matmul runs at: its name, its unit roundoff ``u``, and why."""

    name: str
    u: float
    why: str


def matmul_precision(dtype=np.float32, backend: str | None = None,
                     setting: str | None = "config") -> Precision:
    """The precision a matmul of ``dtype`` operands runs at on ``backend`` (default: JAX's)
    under ``setting`` (default: ``jax.config.jax_default_matmul_precision``, as set now,
    ``jax.default_matmul_precision(...)`` included).

    >>> matmul_precision(backend="tpu", setting=None)[:2]
    ('bfloat16', 0.00390625)
    >>> matmul_precision(backend="tpu", setting="highest").name
    'float32'
    """
    dtype = np.dtype(dtype)
    if np.finfo(dtype).nmant < np.finfo(np.float32).nmant:  # the operands are narrower
        return Precision(dtype.name, 2.0 ** -(np.finfo(dtype).nmant + 1),
                         f"the operands are {dtype.name}")
    backend = backend or jax.default_backend()
    if setting == "config":
        setting = jax.config.jax_default_matmul_precision
    if setting not in SETTINGS:  # a setting this example does not know: the coarsest
        return Precision("bfloat16", UNIT_ROUNDOFF["bfloat16"],
                         f"jax_default_matmul_precision={setting!r}, taken as bfloat16")
    if SETTINGS[setting] is not None:
        name = SETTINGS[setting]
        return Precision(name, UNIT_ROUNDOFF[name], f"jax_default_matmul_precision={setting!r}")
    name = BACKEND_DEFAULT.get(backend, "bfloat16")  # an unknown backend: the coarsest
    told = "unset" if setting is None else f"{setting!r}"
    return Precision(name, UNIT_ROUNDOFF[name], f"{backend}'s default for float32 matmuls, "
                     f"jax_default_matmul_precision {told}")


def bound_units(layers: int, widths: tuple[int, ...]) -> int:
    """``LAMBDA * (2 * layers * sum(sqrt(widths)) + 1)``, rounded up: the bound in units of
    ``2u * max|logits|`` for ``layers`` blocks of chained sums of ``widths`` terms each."""
    return math.ceil(LAMBDA * (2 * layers * sum(math.sqrt(w) for w in widths) + 1))


def block_widths(config) -> tuple[int, ...]:
    """The terms of a block's chained sums: the qkv projection (``d_model``), the scores
    (``head_dim``), the attention over the context (``seq_len``), the output projection and
    the MLP's up and down projections (``d_model``, ``d_model``, ``hidden``)."""
    d = config.d_model
    return (d, config.head_dim, config.seq_len, d, d, config.hidden)


class Bound(NamedTuple):
    """A bound on ``max|got - want|``: ``tolerance = units * 2u * scale``, and how it came."""

    tolerance: float
    units: int
    precision: Precision
    scale: float

    def describe(self) -> str:
        """E.g. ``3.2e-04 = 877 x 2**-23 x max|logits| 3.02, at float32 (cpu's default ...)``."""
        eps = f"2**{round(math.log2(2 * self.precision.u))}"
        return (f"{self.tolerance:.1e} = {self.units} x {eps} x max|logits| {self.scale:.3g}, "
                f"at {self.precision.name} ({self.precision.why})")


def logits_bound(config, scale: float, precision: Precision) -> Bound:
    """The bound on two evaluations of ``config``'s model whose logits are at most ``scale``
    in size, at ``precision`` (the module's docstring derives it)."""
    units = bound_units(config.layers, block_widths(config))
    return Bound(units * 2 * precision.u * scale, units, precision, scale)


def check_precision(dtype=np.float32) -> tuple[contextlib.AbstractContextManager, Precision]:
    """Where to run a comparison of logits, and at what precision: as set here, if a matmul
    of ``dtype`` runs at float32 here (or its operands are narrower anyway); else under
    ``jax.default_matmul_precision('highest')``, at float32, with what it replaces in ``why``."""
    here = matmul_precision(dtype)
    narrow = np.finfo(np.dtype(dtype)).nmant < np.finfo(np.float32).nmant
    if here.name == "float32" or narrow:  # ('highest' would not widen narrow operands)
        return contextlib.nullcontext(), here
    why = f"run at 'highest': here {here.name}, u = 2**{round(math.log2(here.u))}, {here.why}"
    return jax.default_matmul_precision("highest"), Precision(
        "float32", UNIT_ROUNDOFF["float32"], why)
