"""Every tie of `stackwise.optax` to optax's internals (``adapters/optax/_upstream.py``): each
holds on the installed optax (a failure here means upstream changed: read the tie's comment),
and, when a tie no longer holds, the wrapper falls back to an exact path (the loop's updates,
only slower)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _oracle import Case, by_ndim, check, ndim_at_least_2

from stackwise.optax import _layerwise, _own, _plan, _upstream

MUON_DIMS = optax.contrib.MuonDimensionNumbers


def _updates(tx, tree, params=None):
    return tx.update(tree, tx.init(tree), params)[0]


def test_chain_is_read_part_by_part():
    first, second = optax.scale_by_adam(), optax.scale(-1e-3)
    parts = _upstream.chain_parts(optax.chain(first, second))
    assert parts is not None, "optax.chain's closure changed: see _upstream.CHAIN"
    assert [_upstream.unwrap_extra_args(p).update for p in parts] == [first.update,
                                                                      second.update]
    assert [p.init for p in parts] == [first.init, second.init]
    assert len(_upstream.chain_parts(optax.lamb(1e-3))) == 4  # an alias is a chain
    assert _upstream.chain_parts(optax.scale(1.0)) is None


def test_with_extra_args_support_is_seen_through():
    plain = optax.GradientTransformation(lambda p: (), lambda u, s, p=None: (u, s))
    wrapped = optax.with_extra_args_support(plain)
    assert wrapped.update is not plain.update
    assert _upstream.unwrap_extra_args(wrapped) is plain, "see _upstream.EXTRA_ARGS"


def test_partition_is_read_group_by_group():
    groups = {"matrix": optax.lamb(1e-3), "other": optax.adam(1e-3)}
    parts = _upstream.partition_parts(optax.multi_transform(groups, by_ndim))
    assert parts is not None, "optax.partition's closure changed: see _upstream.PARTITION"
    transforms, labels, extra = parts
    assert transforms.keys() == groups.keys() and labels is by_ndim and extra is False
    assert _upstream.partition_parts(optax.adam(1e-3)) is None


def test_global_norm_clip_is_recognised_and_sums_every_element():
    clip = optax.clip_by_global_norm(1.0)
    assert _upstream.is_global_norm_clip(clip), "see _upstream.GLOBAL_NORM_CLIP"
    assert _upstream.is_global_norm_clip(optax.with_extra_args_support(clip))
    assert not _upstream.is_global_norm_clip(optax.clip(1.0))
    # The tie's premise: its norm is over every element, however they are grouped.
    whole = {"a": jnp.arange(12.0).reshape(3, 4)}
    split = {"a": [whole["a"][i] for i in range(3)]}
    np.testing.assert_allclose(jnp.stack(_updates(clip, split)["a"]),
                               _updates(clip, whole)["a"], rtol=1e-6)


def test_muon_parts_are_read_and_rebuilt():
    muon = optax.contrib.scale_by_muon()
    shape = optax.contrib._muon.scale_by_shape()  # a part of contrib.muon, not exported
    read = _upstream.muon_part(muon)
    assert read is not None and read.forces_2d, "see _upstream.MUON"
    assert _upstream.muon_part(shape) is not None and not _upstream.muon_part(shape).forces_2d
    assert _upstream.muon_part(optax.adam(1e-3)) is None
    # The premise of `forces_2d`: a 2-D leaf is orthogonalised with (0, 1), whatever given.
    tree = {"w": jax.random.normal(jax.random.key(0), (3, 4))}
    given = lambda dims: optax.contrib.scale_by_muon(  # noqa: E731
        weight_dimension_numbers=lambda u: jax.tree.map(lambda _: dims, u))
    np.testing.assert_allclose(_updates(given(MUON_DIMS(1, 0)), tree)["w"],
                               _updates(given(MUON_DIMS(0, 1)), tree)["w"], rtol=1e-6)
    # The rebuilt update uses the dimension numbers it is given, as the public option does.
    stacked = {"w": jax.random.normal(jax.random.key(1), (2, 3, 4))}
    dims = lambda u: jax.tree.map(lambda _: MUON_DIMS((1,), (2,)), u)  # noqa: E731
    rebuilt = _upstream.with_dimensions(read, dims)
    public = optax.contrib.scale_by_muon(weight_dimension_numbers=dims)
    assert jnp.array_equal(_updates(rebuilt, stacked)["w"], _updates(public, stacked)["w"])


def test_closure_of_a_callable_without_one():
    assert _upstream.closure(len) == {} and _upstream.closure(lambda: 0) == {}


# When a tie no longer holds: the reader returns None (or False), as it would on an optax
# that changed, and the wrapper is still the loop.
BROKEN = {
    "chain": (_upstream, "chain_parts", None),
    "partition": (_upstream, "partition_parts", None),
    "muon": (_upstream, "muon_part", None),
    "global_norm_clip": (_upstream, "is_global_norm_clip", False),
}


@pytest.mark.parametrize("tie", list(BROKEN))  # the fast tier runs the first
def test_a_broken_tie_falls_back_to_an_exact_path(tie, monkeypatch):
    module, name, result = BROKEN[tie]
    monkeypatch.setattr(module, name, lambda *args: result)
    assert _layerwise._upstream is _own._upstream is _plan._upstream is _upstream
    parts = {"chain": ("clip_by_global_norm", "adamw_masked", "scale_by_trust_ratio"),
             "partition": ("multi_transform_by_ndim",),
             "muon": ("muon",),
             "global_norm_clip": ("clip_by_global_norm", "adam")}[tie]
    check(Case(layers=(3,), w=(2, 3), parts=parts, steps=2))


def test_without_the_partition_tie_labels_still_see_one_layer(monkeypatch):
    """The fallback of a partition is exact because the labels used are those of one layer's
    leaves (vmapped): a stacked bias `(n, f)` is not labelled 2-D. (The label function is
    also traced on the stacked leaves, to see that it labels them otherwise.)"""
    monkeypatch.setattr(_upstream, "partition_parts", lambda *args: None)
    seen = []

    def labels(tree):
        seen.extend(x.ndim for x in jax.tree.leaves(tree))
        return ndim_at_least_2(tree)

    params = {"w": jnp.ones((3, 2, 2)), "b": jnp.ones((3, 2))}
    tx = _layerwise.layerwise(optax.multi_transform(
        {True: optax.sgd(1.0), False: optax.set_to_zero()}, labels))
    u = _updates(tx, params, params)
    assert {1, 2} <= set(seen) and not jnp.any(u["b"]) and jnp.all(u["w"] == -1.0)
