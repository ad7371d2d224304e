"""The misuse catalogue of the core's stack, layout tools and pipeline: one table per surface.

Each row is a call an experienced user might make at two in the morning, the error it
must raise, and words its message must hold (the argument or leaf, and the fix). After
the tables, the calls that once went silently wrong or crashed and now give the right
result (abstract trees, NumPy integers, patterns).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _misuse import assert_refused, case
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import stackwise

KEY = jax.random.key(0)
MESH = Mesh(np.array(jax.devices()[:1]), ("stage",))
PATTERN = ({"w": jnp.arange(3.0)}, {"v": jnp.arange(3.0) + 10})  # layers a b a b a b
ABSTRACT = jax.ShapeDtypeStruct((3, 2), jnp.float32)


def _apply(params, x, *args):
    return x * params["w"]


def _layers(**options):
    return stackwise.stack(lambda key: {"w": jnp.ones(2)}, _apply, 3, **options)


def _has_aux_without_aux():
    layers = _layers(has_aux=True)
    layers.apply(layers.init(KEY), jnp.ones(2))


def _per_example_of_another_batch():
    pp = stackwise.pipeline(None, _apply, 2, MESH, microbatches=2)
    pp.apply({"w": jnp.ones((2, 1))}, jnp.zeros((4, 1)), stackwise.per_example(jnp.ones((2, 1))))


LAYOUT = [
    case(
        "slice_layers of a pattern's params without pattern=",
        lambda: stackwise.slice_layers(PATTERN, 0, 2),
        TypeError,
        "`stacked`",
        "pattern=2",
    ),
    case(
        "slice_layers pattern= of one tree",
        lambda: stackwise.slice_layers(PATTERN[0], 0, 2, pattern=2),
        TypeError,
        "pattern=2",
        "tuple of 2 stacked trees",
    ),
    case(
        "slice_layers float start",
        lambda: stackwise.slice_layers({"w": jnp.zeros(3)}, 1.0),
        TypeError,
        "`start` must be an int",
    ),
    case(
        "slice_layers bool stop",
        lambda: stackwise.slice_layers({"w": jnp.zeros(3)}, 0, True),
        TypeError,
        "`stop`",
    ),
    case(
        "slice_layers past the end",
        lambda: stackwise.slice_layers({"w": jnp.zeros(3)}, 0, 4),
        ValueError,
        "stop=4",
        "n=3",
    ),
    case(
        "slice_layers too negative",
        lambda: stackwise.slice_layers({"w": jnp.zeros(3)}, -4),
        ValueError,
        "start=-4",
    ),
    case(
        "slice_layers of an empty tree",
        lambda: stackwise.slice_layers({}, 0),
        ValueError,
        "no array leaves",
    ),
    case(
        "slice_layers of a Python float leaf",
        lambda: stackwise.slice_layers({"w": jnp.zeros(3), "s": 1.0}, 0, 1),
        ValueError,
        "['s']: shape ()",
    ),
    case(
        "slice_layers of a non-array leaf",
        lambda: stackwise.slice_layers({"w": "abc"}, 0, 1),
        TypeError,
        "leaf ['w']",
        "not an array",
    ),
    case(
        "stack_layers of a dict of layers",
        lambda: stackwise.stack_layers({"a": {"w": jnp.zeros(2)}, "b": {"w": jnp.zeros(2)}}),
        TypeError,
        "`layers`",
        "list(layers.values())",
    ),
    case(
        "stack_layers of a str",
        lambda: stackwise.stack_layers("layers"),
        TypeError,
        "`layers` must be a list",
    ),
    case(
        "stack_layers of an already stacked array",
        lambda: stackwise.stack_layers(jnp.zeros((3, 2))),
        TypeError,
        "already stacked",
    ),
    case(
        "stack_layers of NumPy int64 next to int32",
        lambda: stackwise.stack_layers([{"w": np.zeros(2, np.int64)}, {"w": jnp.zeros(2, int)}]),
        TypeError,
        "leaf ['w']",
        "int64",
        "int32",
    ),
    case(
        "unstack_layers of leaves of two depths",
        lambda: stackwise.unstack_layers({"w": ABSTRACT, "b": jnp.zeros(2)}),
        ValueError,
        "['b']: shape (2,)",
        "['w']: shape (3, 2)",
    ),
    case(
        "stacked_spec of a str",
        lambda: stackwise.stacked_spec("data"),
        TypeError,
        "`spec`",
        "P('data')",
    ),
    case(
        "stacked_spec of a tuple",
        lambda: stackwise.stacked_spec(("data", None)),
        TypeError,
        "`spec`",
        "P(*spec)",
    ),
    case(
        "stacked_spec layer_axis of another kind",
        lambda: stackwise.stacked_spec(P(), layer_axis=("stage", 3)),
        TypeError,
        "`layer_axis`",
    ),
    case(
        "stacked_shardings without a mesh",
        lambda: stackwise.stacked_shardings(None, {"w": P()}),
        TypeError,
        "`mesh`",
        "jax.make_mesh",
    ),
    case(
        "stacked_shardings spec naming an axis the mesh lacks",
        lambda: stackwise.stacked_shardings(MESH, {"w": P("data")}),
        ValueError,
        "leaf ['w']",
        "'data'",
        "'stage'",
    ),
    case(
        "stacked_shardings layer_axis the mesh lacks",
        lambda: stackwise.stacked_shardings(MESH, {"w": P()}, layer_axis="layers"),
        ValueError,
        "`layer_axis='layers'`",
        "not an axis of the mesh",
    ),
]


STACK = [
    case(
        "init with an int seed",
        lambda: _layers().init(0),
        TypeError,
        "Stacked.init",
        "`key` must be one PRNG key",
        "jax.random.key(seed)",
    ),
    case(
        "init with n keys already split",
        lambda: _layers().init(jax.random.split(KEY, 3)),
        TypeError,
        "Stacked.init",
        "a batch of keys of shape (3,)",
        "pass one key",
    ),
    case(
        "per_layer_keys of keys already split",
        lambda: stackwise.per_layer_keys(jax.random.split(KEY, 3)),
        TypeError,
        "stackwise.per_layer_keys",
        "`key`",
        "pass one key",
    ),
    case("fsdp= an int", lambda: _layers(fsdp=3), TypeError, "`fsdp` must be a mesh axis name"),
    case("fsdp= an empty name", lambda: _layers(fsdp=""), TypeError, "`fsdp`", "got str ''"),
    case(
        "fsdp= an axis the mesh in use lacks",
        lambda: _fsdp_off_the_mesh(),
        ValueError,
        "`fsdp='model'`",
        "'model'",
        "{'stage': 1}",
        "FSDP would be off",
    ),
    case(
        "has_aux=True, a layer returning no aux",
        _has_aux_without_aux,
        TypeError,
        "`has_aux=True`",
        "one array float32[2]",
        "(x, aux)",
    ),
    case(
        "apply with too few layers",
        lambda: _layers().apply({"w": jnp.ones((2, 2))}, jnp.ones(2)),
        ValueError,
        "['w']: shape (2, 2)",
        "n=3",
    ),
    case(
        "apply with a Python float leaf",
        lambda: _layers().apply({"w": 2.0}, jnp.ones(2)),
        ValueError,
        "['w']: shape ()",
    ),
]


def _fsdp_off_the_mesh():
    layers = _layers(fsdp="model")
    with jax.set_mesh(jax.make_mesh((1,), ("stage",))):
        jax.eval_shape(layers.apply, {"w": jnp.ones((3, 2))}, jnp.ones(2))


PIPELINE = [
    case(
        "pipeline mesh=None",
        lambda: stackwise.pipeline(None, _apply, 2, None, microbatches=1),
        TypeError,
        "`mesh`",
        "jax.make_mesh",
    ),
    case(
        "pipeline mesh as axis names",
        lambda: stackwise.pipeline(None, _apply, 2, ("stage",), microbatches=1),
        TypeError,
        "`mesh`",
        "('stage',)",
    ),
    case(
        "pipeline data_axis as a list",
        lambda: stackwise.pipeline(None, _apply, 2, MESH, microbatches=1, data_axis=["stage"]),
        TypeError,
        "`data_axis`",
        "a str",
    ),
    case(
        "pipeline stage_axis the mesh lacks",
        lambda: stackwise.pipeline(None, _apply, 2, MESH, microbatches=1, stage_axis="pp"),
        ValueError,
        "`stage_axis='pp'`",
    ),
    case(
        "pipeline microbatches a float",
        lambda: stackwise.pipeline(None, _apply, 2, MESH, microbatches=2.0),
        TypeError,
        "`microbatches`",
    ),
    case(
        "pipeline per_example of another batch that divides the microbatches",
        _per_example_of_another_batch,
        ValueError,
        "per_example argument 0",
        "batch is 4",
        "<root>: shape (2, 1)",
    ),
    case(
        "decode of a pipeline (it has none)",
        lambda: stackwise.pipeline(None, _apply, 2, MESH, microbatches=1).decode(
            {"w": jnp.ones((2, 2))}, jnp.ones((1, 2))),
        TypeError,
        "has no `decode`",
        "stackwise.stack(..., unroll=True).apply",
    ),
    case(
        "decode without state's arguments",
        lambda: stackwise.stack(None, lambda p, s, x: (x, s), 2, with_state=True).decode(
            jnp.ones(2), jnp.ones(2)),
        TypeError,
        "Stacked.decode is called as `apply(params, state, x",
    ),
]


@pytest.mark.every_case
@pytest.mark.parametrize("call, error, words", LAYOUT)
def test_misuse_layout(call, error, words):
    assert_refused(call, error, words)


@pytest.mark.every_case
@pytest.mark.parametrize("call, error, words", STACK)
def test_misuse_stack(call, error, words):
    assert_refused(call, error, words)


@pytest.mark.every_case
@pytest.mark.parametrize("call, error, words", PIPELINE)
def test_misuse_pipeline(call, error, words):
    assert_refused(call, error, words)


# --------------------------------------------------------------------------
# What once went silently wrong or crashed, now right.


def test_slice_layers_of_a_pattern_takes_the_models_layers():
    layers = stackwise.unstack_layers(PATTERN, pattern=2)  # 6 layers: a b a b a b
    for start, stop in [(0, 2), (0, 5), (1, 4), (3, 6), (4, 5), (-2, None)]:
        got = stackwise.slice_layers(PATTERN, start, stop, pattern=2)
        sliced = stackwise.unstack_layers(got, pattern=len(got))
        want = layers[start:stop]
        assert len(sliced) == len(want), (start, stop)
        for g, w in zip(sliced, want):
            assert jax.tree.structure(g) == jax.tree.structure(w)
            assert all(
                jnp.array_equal(u, v) for u, v in zip(jax.tree.leaves(g), jax.tree.leaves(w))
            )


def test_slice_layers_takes_numpy_ints_negatives_and_abstract_leaves():
    params = {"w": jnp.arange(12.0).reshape(6, 2)}
    assert jnp.array_equal(
        stackwise.slice_layers(params, np.int64(1), np.int32(3))["w"], params["w"][1:3]
    )
    assert jnp.array_equal(stackwise.slice_layers(params, -2)["w"], params["w"][-2:])
    assert stackwise.slice_layers({"w": ABSTRACT}, 1) == {
        "w": jax.ShapeDtypeStruct((2, 2), jnp.float32)
    }


def test_abstract_trees_unstack_and_stack_back():
    tree = jax.eval_shape(_layers().init, KEY)
    layers = stackwise.unstack_layers(tree)
    assert layers == [{"w": jax.ShapeDtypeStruct((2,), jnp.float32)}] * 3
    assert stackwise.stack_layers(layers) == tree


def test_numpy_integers_count_as_patterns():
    layers = [{"w": jnp.zeros(1)}, {"v": jnp.ones(1)}]
    assert (
        stackwise.unstack_layers(
            stackwise.stack_layers(layers, pattern=np.int64(2)), pattern=np.int32(2)
        )
        == layers
    )


def test_pipeline_takes_numpy_int_microbatches():
    pp = stackwise.pipeline(None, _apply, 2, MESH, microbatches=np.int64(2))
    assert jnp.array_equal(pp.apply({"w": jnp.full(2, 2.0)}, jnp.ones(4)), jnp.full(4, 4.0))


# --------------------------------------------------------------------------
# Options, markers and conversions' shared checks: every error path of the core.


def _split_over_layers():
    mesh = jax.make_mesh((1,), ("data",))
    placed = stackwise.shard_stacked({"w": jnp.ones((3, 2))}, mesh, layer_axis="data")
    _layers().apply(placed, jnp.ones(2))


OPTIONS_AND_MARKERS = [
    case(
        "remat=jax.checkpoint",
        lambda: _layers(remat=jax.checkpoint),
        TypeError,
        "`remat`",
        "not `jax.checkpoint`",
        "remat=True",
    ),
    case(
        "remat= a policy factory, uncalled",
        lambda: _layers(remat=jax.checkpoint_policies.save_only_these_names),
        TypeError,
        "policy factory",
        "save_only_these_names(...)",
    ),
    case(
        "a pattern of no layers",
        lambda: stackwise.stack(None, [], 2),
        ValueError,
        "`apply` is empty",
    ),
    case(
        "per_layer itself, uncalled",
        lambda: _layers().apply({"w": jnp.ones((3, 2))}, jnp.ones(2), stackwise.per_layer),
        TypeError,
        "argument *args[0]",
        "stackwise.per_layer(xs)",
    ),
    case(
        "a per-layer marker as the carry",
        lambda: _layers().apply({"w": jnp.ones((3, 2))}, stackwise.per_layer(jnp.ones((3, 2)))),
        TypeError,
        "carry `x`",
        "per-layer marker",
    ),
    case(
        "params split over their layer axis",
        _split_over_layers,
        ValueError,
        "params leaf ['w']",
        "layer axis",
        "stackwise.pipeline",
    ),
    case(
        "stack_layers of a NumPy int64 next to a Python int",
        lambda: stackwise.stack_layers([{"w": np.int64(1)}, {"w": 2}]),
        TypeError,
        "leaf ['w']",
        "int64",
        "stored as int32",
    ),
    case(
        "pipeline repeats= with the gpipe schedule",
        lambda: stackwise.pipeline(None, _apply, 2, MESH, microbatches=1, repeats=2),
        ValueError,
        "`repeats=2`",
        "schedule='circular'",
    ),
]


@pytest.mark.every_case
@pytest.mark.parametrize("call, error, words", OPTIONS_AND_MARKERS)
def test_misuse_options_and_markers(call, error, words):
    assert_refused(call, error, words)
