"""The misuse catalogue of the sharding tools: fsdp_specs, shard_stacked, stacked_shardings,
logical_specs.

One table per surface: the call, the error it must raise, and words its message must
hold (the argument or leaf, and the fix). Meshes are abstract (``AbstractMesh``) or of
one device: every error here is about names and shapes, not about devices. After the
tables, what once crashed and now works: abstract trees and specs of other shapes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _misuse import assert_refused, case
from jax.sharding import AbstractMesh, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import stackwise

MESH = AbstractMesh((2,), ("data",))
DEVICES = Mesh(np.array(jax.devices()[:1]), ("data",))
PARAMS = {"w": jnp.zeros((3, 4, 8)), "b": jnp.zeros((3, 8))}


FSDP_SPECS = [
    case(
        "mesh=None",
        lambda: stackwise.fsdp_specs(PARAMS, None),
        TypeError,
        "`mesh`",
        "jax.make_mesh",
    ),
    case(
        "mesh as its axis names",
        lambda: stackwise.fsdp_specs(PARAMS, ("data",)),
        TypeError,
        "`mesh`",
        "('data',)",
    ),
    case(
        "axis the mesh lacks",
        lambda: stackwise.fsdp_specs(PARAMS, MESH, "model"),
        ValueError,
        "`axis='model'`",
        "not an axis of the mesh",
        "{'data': 2}",
    ),
    case(
        "one of the axes the mesh lacks",
        lambda: stackwise.fsdp_specs(PARAMS, MESH, ("data", "fsdp")),
        ValueError,
        "names 'fsdp'",
    ),
    case("axis an int", lambda: stackwise.fsdp_specs(PARAMS, MESH, 0), TypeError, "`axis`"),
    case(
        "a Python float among the params",
        lambda: stackwise.fsdp_specs({**PARAMS, "scale": 1.0}, MESH),
        ValueError,
        "leaf ['scale']",
        "no layer axis",
        "stacked=",
    ),
    case(
        "a NumPy scalar among the params",
        lambda: stackwise.fsdp_specs({**PARAMS, "scale": np.float32(1)}, MESH),
        ValueError,
        "leaf ['scale']",
    ),
    case(
        "a str among the params",
        lambda: stackwise.fsdp_specs({**PARAMS, "act": "gelu"}, MESH),
        TypeError,
        "leaf ['act']",
        "not an array",
    ),
    case(
        "base spec longer than its leaf",
        lambda: stackwise.fsdp_specs(PARAMS, MESH, base={"w": P(None, None, None), "b": None}),
        ValueError,
        "leaf ['w']",
        "P(None, None, None)",
        "leave out the layer axis",
    ),
    case(
        "base a str",
        lambda: stackwise.fsdp_specs(PARAMS, MESH, base="data"),
        TypeError,
        "`base`",
        "P('data')",
    ),
    case(
        "base leaf a str",
        lambda: stackwise.fsdp_specs(PARAMS, MESH, base={"w": "data", "b": None}),
        TypeError,
        "base['w']",
        "P('data')",
    ),
    case(
        "base naming an axis the mesh lacks",
        lambda: stackwise.fsdp_specs(PARAMS, MESH, base={"w": P(None, "model"), "b": None}),
        ValueError,
        "leaf ['w']",
        "'model'",
    ),
    case(
        "base of another structure",
        lambda: stackwise.fsdp_specs(PARAMS, MESH, base={"v": P()}),
        ValueError,
        "`base` must mirror the params",
    ),
    case(
        "min_size negative",
        lambda: stackwise.fsdp_specs(PARAMS, MESH, min_size=-1),
        ValueError,
        "`min_size` must be at least 0",
    ),
    case(
        "min_size a str",
        lambda: stackwise.fsdp_specs(PARAMS, MESH, min_size="1"),
        TypeError,
        "`min_size`",
    ),
]


SHARD_STACKED = [
    case(
        "mesh=None",
        lambda: stackwise.shard_stacked(PARAMS, None),
        TypeError,
        "`mesh`",
        "jax.make_mesh",
    ),
    case(
        "an AbstractMesh",
        lambda: stackwise.shard_stacked(PARAMS, MESH),
        TypeError,
        "AbstractMesh",
        "jax.make_mesh",
    ),
    case(
        "specs a str",
        lambda: stackwise.shard_stacked(PARAMS, DEVICES, "data"),
        TypeError,
        "`specs`",
        "P('data')",
    ),
    case(
        "specs a tuple of names",
        lambda: stackwise.shard_stacked(PARAMS, DEVICES, ("data",)),
        TypeError,
        "`specs`",
        "P(*spec)",
    ),
    case(
        "a spec leaf a str",
        lambda: stackwise.shard_stacked(PARAMS, DEVICES, {"w": "data", "b": None}),
        TypeError,
        "specs['w']",
        "P('data')",
    ),
    case(
        "layer_axis the mesh lacks",
        lambda: stackwise.shard_stacked(PARAMS, DEVICES, layer_axis="stage"),
        ValueError,
        "`layer_axis='stage'`",
        "not an axis of the mesh",
    ),
    case(
        "layer_axis a list with an int",
        lambda: stackwise.shard_stacked(PARAMS, DEVICES, layer_axis=["data", 1]),
        TypeError,
        "`layer_axis`",
    ),
    case(
        "repeats a float",
        lambda: stackwise.shard_stacked(PARAMS, DEVICES, repeats=2.0),
        TypeError,
        "`repeats`",
    ),
    case(
        "a Python float marked stacked",
        lambda: stackwise.shard_stacked({**PARAMS, "s": 1.0}, DEVICES),
        ValueError,
        "leaf ['s']",
        "no layer axis",
    ),
]


STACKED_SHARDINGS = [
    case("mesh=None", lambda: stackwise.stacked_shardings(None, {"w": P()}), TypeError,
         "`mesh`", "jax.make_mesh"),
    case("specs a str", lambda: stackwise.stacked_shardings(DEVICES, "data"), TypeError,
         "the spec at specs is str 'data'", "P('data')"),
    case("a spec written as a tuple", lambda: stackwise.stacked_shardings(
        DEVICES, {"w": ("data", None)}), TypeError,
         "the spec at specs['w'] is tuple ('data', None)", "P('data', None)"),
    case("a spec of another type", lambda: stackwise.stacked_shardings(DEVICES, {"w": 0}),
         TypeError, "the spec at specs['w'] is int 0", "P('data', None)"),
    case("a spec naming an axis the mesh lacks", lambda: stackwise.stacked_shardings(
        DEVICES, {"w": P("model")}), ValueError, "the spec of leaf ['w']", "names 'model'",
         "not an axis of the mesh", "{'data': 1}"),
    case("a spec naming such an axis in a tuple entry", lambda: stackwise.stacked_shardings(
        DEVICES, {"w": P(("data", "model"), None)}), ValueError, "names 'model'",
         "not an axis of the mesh"),
    case("layer_axis the mesh lacks", lambda: stackwise.stacked_shardings(
        DEVICES, {"w": P()}, layer_axis="stage"), ValueError, "`layer_axis='stage'`",
         "not an axis of the mesh"),
    case("layer_axis an int", lambda: stackwise.stacked_shardings(
        DEVICES, {"w": P()}, layer_axis=1), TypeError, "`layer_axis`", "int 1"),
]


LOGICAL_SPECS = [
    case(
        "mesh as its axis names",
        lambda: stackwise.logical_specs({"w": ("embed",)}, [("embed", "data")], mesh=("data",)),
        TypeError,
        "`mesh`",
        "('data',)",
    ),
    case(
        "a leaf's names as one str",
        lambda: stackwise.logical_specs({"w": "embed"}, [("embed", "data")]),
        TypeError,
        "leaf ['w']",
        "('embed',)",
    ),
    case(
        "a leaf's names with a number among them (the number blamed, not the str)",
        lambda: stackwise.logical_specs({"w": ("embed", 1)}, [("embed", "data")]),
        TypeError,
        "leaf ['w']",
        "('embed', 1)",
        "got 1",
        "a str) or None",
    ),
    case(
        "rules as a dict",
        lambda: stackwise.logical_specs({"w": ("embed",)}, {"embed": "data"}),
        TypeError,
        "`rules`",
    ),
    case(
        "a rule naming an axis the mesh lacks",
        lambda: stackwise.logical_specs({"w": ("embed",)}, [("embed", "model")], mesh=MESH),
        ValueError,
        "rule 0",
        "['model']",
    ),
]


@pytest.mark.every_case
@pytest.mark.parametrize("call, error, words", FSDP_SPECS)
def test_misuse_fsdp_specs(call, error, words):
    assert_refused(call, error, words)


@pytest.mark.every_case
@pytest.mark.parametrize("call, error, words", SHARD_STACKED)
def test_misuse_shard_stacked(call, error, words):
    assert_refused(call, error, words)


@pytest.mark.every_case
@pytest.mark.parametrize("call, error, words", STACKED_SHARDINGS)
def test_misuse_stacked_shardings(call, error, words):
    assert_refused(call, error, words)


@pytest.mark.every_case
@pytest.mark.parametrize("call, error, words", LOGICAL_SPECS)
def test_misuse_logical_specs(call, error, words):
    assert_refused(call, error, words)


# --------------------------------------------------------------------------
# What once crashed, now right.


def test_abstract_trees_get_specs_and_placed_restore_targets():
    abstract = jax.eval_shape(lambda: PARAMS)
    specs = stackwise.fsdp_specs(abstract, MESH)
    assert specs == stackwise.fsdp_specs(PARAMS, MESH) == {"b": P("data"), "w": P(None, "data")}
    target = stackwise.shard_stacked(abstract, DEVICES, specs)
    assert target["w"] == jax.ShapeDtypeStruct(
        (3, 4, 8), jnp.float32, sharding=NamedSharding(DEVICES, P(None, None, "data"))
    )
    placed = stackwise.shard_stacked(PARAMS, DEVICES, specs)
    assert placed["w"].sharding == target["w"].sharding


def test_unstacked_scalars_keep_their_specs():
    model = {"blocks": PARAMS, "scale": 1.0}
    specs = stackwise.fsdp_specs(model, MESH, stacked={"blocks": True, "scale": False})
    assert specs["scale"] == P()


# --------------------------------------------------------------------------
# Placing leaves: every per-leaf refusal of shard_stacked that one device can show.

PLACEMENT = [
    case(
        "repeats= without a layer axis",
        lambda: stackwise.shard_stacked(PARAMS, DEVICES, repeats=3),
        ValueError,
        "`repeats=3`",
        "layer_axis=",
    ),
    case(
        "repeats= that does not divide the layers",
        lambda: stackwise.shard_stacked(PARAMS, DEVICES, layer_axis="data", repeats=2),
        ValueError,
        "leaf ['b'] has 3 layers",
        "`repeats=2`",
    ),
    case(
        "a per-layer spec longer than the leaf",
        lambda: stackwise.shard_stacked(PARAMS, DEVICES, {"w": P(None, None, None), "b": None}),
        ValueError,
        "leaf ['w']",
        "names 4 axes",
        "leave out the layer axis",
    ),
    case(
        "a spec naming one mesh axis twice",
        lambda: stackwise.shard_stacked(PARAMS, DEVICES, {"w": P("data", "data"), "b": None}),
        ValueError,
        "leaf ['w']",
        "'data' twice",
    ),
    case(
        "logical names holding an int",
        lambda: stackwise.logical_specs({"w": P("embed", 3)}, [("embed", "data")]),
        TypeError,
        "leaf ['w']",
        "got 3",
    ),
]


@pytest.mark.every_case
@pytest.mark.parametrize("call, error, words", PLACEMENT)
def test_misuse_placement(call, error, words):
    assert_refused(call, error, words)
