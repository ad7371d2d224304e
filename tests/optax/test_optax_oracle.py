"""The differential oracle: random trees and random chains of optax's public transformations,
`stackwise.optax.layerwise` against plain optax on the loop model (``_oracle.py``).

The trees mix stacked leaves (one or two layer axes; a pattern's two positions of different
numbers of rows) with leaves without layer axes. The chains mix masks and label functions
that read leaf shapes (``adamw(mask=...)``, ``masked``, ``multi_transform``,
``partition``), clipping, schedules, ``inject_hyperparams``, Muon, ``layer_mask``, under
``MultiSteps`` or ``apply_if_finite`` or neither, with ``freeze`` and ``lr_scale``. Each
step's updates are compared. The fast tier draws a few cases, the full suite more; every
counterexample found is a named test below.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _oracle import PARTS, WRAPPERS, Case, check, ndim_at_least_2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import stackwise.optax as so

_PROFILE = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def cases(draw) -> Case:
    depth = draw(st.sampled_from([1, 2]))
    layers = tuple(draw(st.integers(1, 3 if depth == 1 else 2)) for _ in range(depth))
    w = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    pattern = None
    if draw(st.booleans()):
        rows = draw(st.integers(1, 2))
        pattern = (rows + draw(st.integers(0, 1)), rows)
    parts = tuple(draw(st.lists(st.sampled_from(sorted(PARTS)), min_size=1, max_size=3)))
    wrapper = draw(st.sampled_from(sorted(WRAPPERS)))
    layer_aware = any(p.startswith("layer_mask") for p in parts)
    outside = wrapper != "none" and (layer_aware or draw(st.booleans()))
    marked = pattern is not None and draw(st.booleans())  # indices name the model's layers
    n = math.prod(layers)
    counts = {n, sum(pattern)} if marked else {n, *(pattern or ())}  # layers per leaf
    fewest = min(counts)
    some_layers = st.sets(st.integers(0, fewest - 1), min_size=1, max_size=2).map(
        lambda s: tuple(sorted(s)))
    chosen = draw(some_layers)
    freeze = draw(st.none() | some_layers)
    lr_scale = None
    if len(counts) == 1:  # one scale per layer fits every leaf
        lr_scale = draw(st.none() | st.lists(st.sampled_from([0.25, 0.5, 1.0, 2.0]),
                                             min_size=n, max_size=n).map(tuple))
    nan_at = draw(st.none() | st.integers(0, 2)) if wrapper == "apply_if_finite" else None
    return Case(layers=layers, w=w, parts=parts, wrapper=wrapper, outside=outside,
                pattern=pattern, marked=marked, chosen=chosen, freeze=freeze, lr_scale=lr_scale,
                seed=draw(st.integers(0, 3)), nan_at=nan_at)


@settings(max_examples=2, **_PROFILE)
@given(cases())
def test_random_chains_equal_the_loop(case):
    check(case)


@pytest.mark.slow
@settings(max_examples=40, **_PROFILE)
@given(cases())
def test_random_chains_equal_the_loop_longer(case):
    check(case)


# Every part and wrapper once, on a tree of both depths and a pattern (the draws above cover
# the mixtures).
@pytest.mark.slow
@pytest.mark.parametrize("part", sorted(PARTS))
def test_each_part_equals_the_loop(part):
    check(Case(layers=(2,), w=(2, 3), parts=(part,), pattern=(2, 1), chosen=(0,)))
    check(Case(layers=(2, 2), w=(3, 2), parts=(part, "adam"), chosen=(0, 3), freeze=(2,),
               steps=2))
    check(Case(layers=(3,), w=(2, 1), parts=(part,), pattern=(2, 1), marked=True,
               chosen=(1, 2), freeze=(0,), lr_scale=(0.5, 1.0, 2.0), steps=2))


@pytest.mark.slow
@pytest.mark.parametrize("wrapper", sorted(WRAPPERS))
@pytest.mark.parametrize("outside", [False, True])
def test_each_wrapper_equals_the_loop(wrapper, outside):
    check(Case(layers=(3,), w=(2, 2), parts=("clip_by_global_norm", "lamb_masked"),
               wrapper=wrapper, outside=outside, freeze=(1,), lr_scale=(1.0, 0.5, 2.0),
               steps=4, nan_at=1 if wrapper == "apply_if_finite" else None))


# Counterexamples, named.


def test_adamw_mask_by_ndim_leaves_stacked_biases_undecayed():
    """issue 30: `adamw(mask=ndim >= 2)` ran on the stacked tree, where a stacked bias
    `(n, f)` is 2-D and was decayed. Zero gradients: only the weight decay moves a leaf."""
    params = {"w": jnp.ones((4, 3, 3)), "b": jnp.ones((4, 3)), "embed": jnp.ones((5, 3))}
    tx = so.layerwise(optax.adamw(0.1, weight_decay=0.5, mask=ndim_at_least_2),
                      {"w": True, "b": True, "embed": False})
    zeros = jax.tree.map(jnp.zeros_like, params)
    u, _ = tx.update(zeros, tx.init(params), params)
    assert not jnp.any(u["b"]), "a stacked bias was decayed"
    assert jnp.all(u["w"] == -0.05) and jnp.all(u["embed"] == -0.05)
    check(Case(layers=(4,), w=(3, 3), parts=("adamw_masked",), steps=2))


def test_layer_mask_global_norm_leaves_out_the_unstacked_leaves():
    """issue 30: `layer_mask(clip_by_global_norm)` counted the embedding in the norm."""
    params = {"blocks": {"w": jnp.arange(24.0).reshape(4, 2, 3)}, "embed": jnp.full((5, 3), 10.0)}
    tx = so.layer_mask(optax.clip_by_global_norm(1.0), [1, 2], {"blocks": True, "embed": False})
    u, _ = tx.update(params, tx.init(params), params)
    norm = jnp.linalg.norm(params["blocks"]["w"][1:3])
    np.testing.assert_allclose(u["blocks"]["w"][1:3], params["blocks"]["w"][1:3] / norm,
                               rtol=1e-6)
    assert jnp.array_equal(u["embed"], params["embed"])  # passed through, not counted
    check(Case(layers=(3,), w=(2, 2), parts=("layer_mask_global_clip", "adam"), chosen=(0, 2),
               steps=2))


def test_layer_mask_under_multi_steps_outside_layerwise():
    """Found by the oracle: `layer_mask` inside a `MultiSteps` inside `layerwise` cannot name
    layers (the misuse catalogue has the error); `MultiSteps(layerwise(...))` is exact."""
    check(Case(layers=(3,), w=(2, 2), parts=("layer_mask_global_clip", "adam"), freeze=(0,),
               wrapper="multi_steps", outside=True, steps=2))
