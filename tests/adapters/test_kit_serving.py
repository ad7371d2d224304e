"""The adapters' leaf-wise serving layout (``stackwise._kit.serving``): every stacked leaf a
``stackwise.Serving`` of its layers, regrouped into the core's per-layer trees at the call."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stackwise
from stackwise import _kit

WHO = "stackwise.test.Stack"


def _tree(n, seed=0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return {"dense": {"kernel": jax.random.normal(k1, (n, 3, 4)),
                      "count": jnp.arange(n, dtype=jnp.int32)},
            "norm": jax.random.normal(k2, (n, 4)).astype(jnp.bfloat16)}


def _same(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_split_and_join_are_exact_inverses():
    tree = _tree(5)
    served = _kit.serving.split(tree, WHO, "params")
    assert _kit.serving.served(served) and not _kit.serving.served(tree)
    kernel = served["dense"]["kernel"]
    assert isinstance(kernel, stackwise.Serving) and len(kernel) == 5
    _same(kernel.layers[3], tree["dense"]["kernel"][3])
    _same(_kit.serving.join(served, WHO, "params"), tree)
    assert _kit.serving.split({}, WHO, "params") == {}  # an empty collection stays empty


def test_gather_gives_the_cores_layers_in_layer_order_and_scatter_undoes_it():
    n, k = 5, 2
    positions = [_tree(3, 0), {"w": jnp.arange(2 * 4.0).reshape(2, 4)}]
    leafwise = [_kit.serving.split(t, WHO, "params") for t in positions]
    core = _kit.serving.gather(leafwise, n, True, WHO, "params")
    assert core.pattern == k and len(core) == n
    expected = stackwise.unstack_layers(tuple(positions), pattern=k)
    for got, want in zip(core.layers, expected):
        _same(got, want)
    for back, want in zip(_kit.serving.scatter(core, k), leafwise):
        _same(back, want)
    one = _kit.serving.gather([leafwise[0]], 3, False, WHO, "params")
    assert one.pattern is None
    _same(stackwise.from_serving(one), positions[0])


def test_converting_twice_is_refused():
    served = _kit.serving.split(_tree(2), WHO, "params")
    with pytest.raises(TypeError, match=r"`params\['dense'\]\['count'\]` is already in"):
        _kit.serving.split(served, WHO, "params")


def test_a_stacked_leaf_among_served_ones_is_refused_naming_both():
    served = _kit.serving.split(_tree(2), WHO, "params")
    served["norm"] = jnp.zeros((2, 4))
    for call in (lambda: _kit.serving.join(served, WHO, "params"),
                 lambda: _kit.serving.gather([served], 2, False, WHO, "params")):
        with pytest.raises(TypeError, match=r"`params\['norm'\]` is .*not in the serving "
                                            r"layout.*while `params\['dense'\]"):
            call()


def test_served_leaves_of_other_depths_are_refused():
    served = _kit.serving.split(_tree(2), WHO, "params")
    served["norm"] = _kit.serving.split({"v": jnp.zeros((3, 4))}, WHO, "p")["v"]
    with pytest.raises(ValueError, match=r"different numbers of layers .*`params\['norm'\]`: 3"):
        _kit.serving.join(served, WHO, "params")
    good = _kit.serving.split(_tree(2), WHO, "params")
    with pytest.raises(ValueError, match=r"`params\['dense'\]\['count'\]` holds 2 layers .*"
                                         r"runs 3 there"):
        _kit.serving.gather([good], 3, False, WHO, "params")
    with pytest.raises(ValueError, match=r"of pattern position 1 holds 2 layers .* runs 1"):
        _kit.serving.gather([good, good], 3, True, WHO, "params")
