"""The layout tools: unstack/stack (with patterns), slice, specs. Exact or an error."""

from __future__ import annotations

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _tiers import examples
from _trees import assert_trees_bitwise as assert_bitwise
from _trees import assert_trees_close
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import stackwise

D = 4

# Dtypes a checkpoint holds; stacking must keep each, bit for bit.
DTYPES = [np.float32, jnp.bfloat16, np.float16, np.int32, np.int8, np.uint8, np.bool_]


def init_layer(key, d=D):
    k1, k2 = jax.random.split(key)
    return {"w": jax.random.normal(k1, (d, d)) / d**0.5, "b": 0.1 * jax.random.normal(k2, (1, d))}


def apply_layer(params, x):
    return x + jnp.tanh(x @ params["w"] + params["b"])


def loop(params, x):
    for p in stackwise.unstack_layers(params):
        x = apply_layer(p, x)
    return x


# --------------------------------------------------------------------------
# Round trips.


def test_unstack_stack_round_trip_is_bitwise():
    params = stackwise.stack(init_layer, apply_layer, 4).init(jax.random.key(0))
    assert_bitwise(stackwise.stack_layers(stackwise.unstack_layers(params)), params)


def test_slice_gives_a_shallower_model():
    layers = stackwise.stack(init_layer, apply_layer, 6)
    params = layers.init(jax.random.key(0))
    first2 = stackwise.slice_layers(params, 0, 2)
    x = jnp.ones((2, D))
    shallow = stackwise.stack(init_layer, apply_layer, 2).apply(first2, x)
    assert_trees_close(shallow, loop(first2, x))
    deeper = stackwise.stack(init_layer, apply_layer, 4)
    rest = deeper.apply(stackwise.slice_layers(params, 2), shallow)
    assert_trees_close(rest, layers.apply(params, x))


@st.composite
def layer_trees(draw):
    """n per-layer trees of one structure, random leaf shapes and dtypes."""
    n = draw(st.integers(1, 5))
    names = draw(st.lists(st.sampled_from("abcdefg"), min_size=1, max_size=4, unique=True))
    specs = {
        name: (draw(st.sampled_from(DTYPES)), draw(hnp.array_shapes(min_dims=0, max_dims=3)))
        for name in names
    }
    layers = [
        {
            name: draw(hnp.arrays(dtype, shape, elements={"allow_nan": False}))
            if dtype is not jnp.bfloat16
            else jnp.asarray(draw(hnp.arrays(np.float32, shape)), jnp.bfloat16)
            for name, (dtype, shape) in specs.items()
        }
        for _ in range(n)
    ]
    return layers, draw(st.one_of(st.none(), st.integers(1, n)))


@settings(max_examples=examples(40, 10), deadline=None)
@given(case=layer_trees())
def test_random_round_trips_are_bitwise(case):
    layers, pattern = case
    stacked = stackwise.stack_layers(layers, pattern=pattern)
    if pattern is not None:
        assert isinstance(stacked, tuple) and len(stacked) == pattern
        for p, tree in enumerate(stacked):
            assert_bitwise(tree, stackwise.stack_layers(layers[p::pattern]))
    back = stackwise.unstack_layers(stacked, pattern=pattern)
    assert len(back) == len(layers)
    for a, b in zip(back, layers):
        assert_bitwise(a, b)
    assert_bitwise(stackwise.stack_layers(back, pattern=pattern), stacked)


def test_pattern_params_are_those_of_a_pattern_stack():
    def init_b(key):
        return {"s": jax.random.normal(key, (1, D))}

    pattern = stackwise.stack([init_layer, init_b], [apply_layer, lambda p, x: x * p["s"]], n=5)
    params = pattern.init(jax.random.key(0))
    layers = stackwise.unstack_layers(params, pattern=2)
    assert [sorted(layer) for layer in layers] == [["b", "w"], ["s"]] * 2 + [["b", "w"]]
    assert_bitwise(stackwise.stack_layers(layers, pattern=2), params)
    x, y = jnp.ones((2, D)), jnp.ones((2, D))
    for i, layer in enumerate(layers):
        y = apply_layer(layer, y) if i % 2 == 0 else y * layer["s"]
    assert_trees_close(pattern.apply(params, x), y)


def test_numpy_leaves_keep_their_dtype():
    layers = [{"step": np.array([i], np.int64), "w": np.full(2, i, np.float64)} for i in range(3)]
    stacked = stackwise.stack_layers(layers)
    assert stacked["step"].dtype == np.int64 and stacked["w"].dtype == np.float64
    assert_bitwise(stackwise.unstack_layers(stacked), layers)


# --------------------------------------------------------------------------
# Each defect class: an error naming what is wrong, never a silent change.


def test_mixed_dtypes_are_refused_not_promoted():
    with pytest.raises(TypeError, match=r"leaf \['w'\].*layer 0: bfloat16; layer 1: float32"):
        stackwise.stack_layers([{"w": jnp.zeros(2, jnp.bfloat16)}, {"w": jnp.zeros(2)}])
    # float32 cannot hold 16777217: promotion would change the value.
    with pytest.raises(TypeError, match=r"layer 0: int32; layer 1: float32.*never"):
        stackwise.stack_layers([{"n": jnp.int32(16777217)}, {"n": jnp.float32(1.0)}])


def test_different_shapes_name_the_leaf_and_the_layers():
    layers = [{"w": jnp.zeros((2, 3))}, {"w": jnp.zeros((2, 3))}, {"w": jnp.zeros((3, 3))}]
    with pytest.raises(ValueError, match=r"leaf \['w'\].*layers 0, 1: \(2, 3\); layer 2: \(3, 3\)"):
        stackwise.stack_layers(layers)


def test_different_structures_name_the_missing_leaves():
    with pytest.raises(ValueError, match=r"layer 1 holds other leaves.*missing: \['a'\]"):
        stackwise.stack_layers([{"a": 1.0}, {"b": 1.0}])
    with pytest.raises(ValueError, match="at least one layer"):
        stackwise.stack_layers([])


def test_unstack_and_slice_errors():
    with pytest.raises(ValueError, match=r"(?s)leading layer axis.*\['b'\]: shape \(2, 2\)"):
        stackwise.unstack_layers({"a": jnp.zeros((3, 2)), "b": jnp.zeros((2, 2))})
    with pytest.raises(ValueError, match="start=4, stop=2"):
        stackwise.slice_layers({"a": jnp.zeros((3, 2))}, 4, 2)
    with pytest.raises(TypeError, match="`start` must be an int"):
        stackwise.slice_layers({"a": jnp.zeros((3, 2))}, 1.0)


def test_pattern_errors():
    a, b = {"w": jnp.zeros((3, 2))}, {"v": jnp.zeros((1, 2))}
    with pytest.raises(ValueError, match=r"hold \[3, 1\] layers.*n=4 they would hold \[2, 2\]"):
        stackwise.unstack_layers((a, b), pattern=2)
    with pytest.raises(TypeError, match="pass a tuple of 2 stacked trees"):
        stackwise.unstack_layers(a, pattern=2)
    with pytest.raises(TypeError, match="`pattern` must be None or the number k"):
        stackwise.stack_layers([a], pattern=True)
    with pytest.raises(ValueError, match="needs at least 3 layers, got 2"):
        stackwise.stack_layers([a, a], pattern=3)


def test_spec_strings_are_refused():
    with pytest.raises(TypeError, match=r"got str 'data'; pass `P\('data'\)`"):
        stackwise.stacked_spec("data")
    with pytest.raises(TypeError, match=r"P\(\*spec\)"):
        stackwise.stacked_spec(("data", None))
    with pytest.raises(TypeError, match="`layer_axis` must be None"):
        stackwise.stacked_spec(P("data"), layer_axis=0)
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    with pytest.raises(TypeError, match=r"spec at specs\['w'\] is str 'data'.*P\('data'\)"):
        stackwise.stacked_shardings(mesh, {"w": "data", "b": None})
    assert stackwise.stacked_spec(P("data", None), "stage") == P("stage", "data", None)
