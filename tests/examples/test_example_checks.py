"""The example's checks of its logits (examples/lm/sample.py) and their bound, derived from the
precision the matmuls run at (examples/lm/precision.py): on this CPU, and as it would be on a
TPU or GPU, or with ``jax_default_matmul_precision`` set.

A TPU once failed the check with an absolute tolerance: there a float32 matmul rounds its
operands to bfloat16 unless told otherwise. The bound now follows the precision; where it is
coarser than float32, the comparison runs at 'highest'. A wrong decode must fail either way.
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _scripts import load_example

lm = load_example()
precision = lm.precision


@pytest.mark.parametrize(
    "setting, name, u",
    [
        (None, "float32", 2**-24),  # the CPU's default
        ("default", "float32", 2**-24),
        ("bfloat16", "bfloat16", 2**-8),
        ("tensorfloat32", "tensorfloat32", 2**-11),
        ("high", "tensorfloat32", 2**-11),
        ("highest", "float32", 2**-24),
        ("float32", "float32", 2**-24),
    ],
)
def test_the_precision_follows_the_matmul_precision_setting(setting, name, u):
    with jax.default_matmul_precision(setting):
        found = precision.matmul_precision()
    assert (found.name, found.u) == (name, u)
    assert (setting is None) == ("unset" in found.why), found.why


@pytest.mark.parametrize(
    "backend, setting, name",
    [
        ("tpu", None, "bfloat16"),  # a TPU rounds float32 operands to bfloat16 by default
        ("gpu", None, "tensorfloat32"),
        ("cpu", None, "float32"),
        ("tpu", "highest", "float32"),
        ("cpu", "bfloat16", "bfloat16"),
        ("tpu", "fastest", "bfloat16"),
        ("some_new_chip", None, "bfloat16"),  # unknown: the coarsest
        ("cpu", "ANY_F8_ANY_F8_F32", "bfloat16"),  # a setting the example does not know
    ],
)
def test_the_precision_of_each_backend(backend, setting, name):
    found = precision.matmul_precision(backend=backend, setting=setting)
    assert found.name == name and found.u == precision.UNIT_ROUNDOFF[name]


def test_narrow_operands_set_the_precision_whatever_the_setting():
    with jax.default_matmul_precision("highest"):
        found = precision.matmul_precision(jnp.bfloat16)
    assert (found.name, found.u) == ("bfloat16", 2**-8)
    context, at = precision.check_precision(jnp.bfloat16)  # ('highest' would not widen them)
    assert at == found and "'highest'" not in at.why


def test_the_bound_is_derived_from_the_precision_and_the_logits_size():
    config = lm.model.Config()  # the default model: 4 blocks of width 128
    widths = (128, 32, 64, 128, 128, 512)
    units = math.ceil(6 * (2 * 4 * sum(math.sqrt(w) for w in widths) + 1))
    assert precision.bound_units(4, precision.block_widths(config)) == units == 3377
    with jax.default_matmul_precision("bfloat16"):
        bf16 = precision.logits_bound(config, 10.0, precision.matmul_precision())
    assert bf16.tolerance == units * 2**-7 * 10.0  # the bfloat16 bound: 2u = 2**-7
    f32 = precision.logits_bound(config, 10.0, precision.matmul_precision())
    assert f32.tolerance == units * 2**-23 * 10.0 and f32.tolerance < 5e-3
    assert bf16.describe().startswith(f"{bf16.tolerance:.1e} = 3377 x 2**-7 x max|logits| 10, "
                                      "at bfloat16 (jax_default_matmul_precision='bfloat16')")


def test_a_coarser_precision_is_checked_at_highest():
    context, at = precision.check_precision()
    assert at.name == "float32" and "'highest'" not in at.why  # this CPU: as set
    with jax.default_matmul_precision("bfloat16"):
        context, at = precision.check_precision()
        with context:
            assert jax.config.jax_default_matmul_precision == "highest"
    assert (at.name, at.u) == ("float32", 2**-24)
    assert at.why == ("run at 'highest': here bfloat16, u = 2**-8, "
                      "jax_default_matmul_precision='bfloat16'")


@pytest.fixture(scope="module")
def tiny():
    """A tiny pure-JAX model (it has the serving layout too), its params and a window."""
    config = lm.model.Config(vocab=11, layers=2, d_model=16, heads=2, seq_len=8)
    model = lm.model.build("jax", config)
    params = model.init(jax.random.key(0))
    window = np.asarray(jax.random.randint(jax.random.key(1), (8,), 0, 11))
    return config, model, params, window


def forgetful(model):
    """The model with a wrong decode: it zeroes the KV cache before every cached call."""

    def apply(params, tokens, positions, cache=None):
        if cache is not None:
            cache = jax.tree.map(jnp.zeros_like, cache)
        return model.apply(params, tokens, positions, cache)

    return model._replace(apply=apply)


@pytest.mark.parametrize("setting", [None, "bfloat16"])
def test_the_checks_pass_and_a_wrong_decode_fails(tiny, setting):
    config, model, params, window = tiny
    lines, result = [], {}
    with jax.default_matmul_precision(setting):
        served = lm.sample.check_logits(model, config, params, window, result, lines.append)
        assert served is not None  # (the serving layout, checked too)
        with pytest.raises(RuntimeError, match=r"^cache_diff = \S+ exceeds its bound, "):
            lm.sample.check_logits(forgetful(model), config, params, window, {}, print)
    for name in ("loop_diff", "cache_diff", "serving_diff"):
        assert result[name] <= result["logits_bound"], name
    # The bound, as the run prints it: the float32 bound (at 'highest' if set coarser).
    said = re.search(r"each within its bound, (\S+) = (\d+) x 2\*\*-23 x max\|logits\| (\S+), "
                     r"at float32 \((.*)\)$", lines[-1])
    assert said, lines
    units = precision.bound_units(2, precision.block_widths(config))
    assert int(said.group(2)) == units
    printed = float(said.group(1))  # (to 2 digits; the scale to 3)
    assert printed == pytest.approx(units * 2**-23 * float(said.group(3)), rel=0.05)
    assert printed == pytest.approx(result["logits_bound"], rel=0.05)
    assert ("run at 'highest': here bfloat16" in said.group(4)) == (setting == "bfloat16")
