"""Logical axis names to mesh specs: ``stackwise.logical_specs`` against flax's own rules.

``flax.linen.logical_to_mesh_axes`` is the reference (MaxText uses it): the same
names and rules must give the same specs, for any names and rules. Pure shape
logic, so no devices are needed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from _tiers import examples
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

import stackwise

nn = pytest.importorskip("flax.linen")

LOGICAL = ["batch", "embed", "mlp", "heads", "kv", "vocab", "layers"]
MESH = ["data", "fsdp", "model", "stage"]

_mesh_axes = st.one_of(
    st.none(),
    st.sampled_from(MESH),
    st.lists(st.sampled_from(MESH), min_size=1, max_size=3, unique=True).map(tuple),
)


@settings(max_examples=examples(200, 50), deadline=None)
@given(
    names=st.lists(st.one_of(st.none(), st.sampled_from(LOGICAL)), max_size=4).filter(
        lambda ns: len([n for n in ns if n]) == len({n for n in ns if n})
    ),
    rules=st.lists(st.tuples(st.sampled_from(LOGICAL), _mesh_axes), max_size=8),
)
def test_same_specs_as_flax(names, rules):
    ours = stackwise.logical_specs({"w": tuple(names)}, rules)["w"]
    assert ours == nn.logical_to_mesh_axes(tuple(names), rules)


def test_trees_of_specs_tuples_and_none():
    rules = [("embed", ("data", "fsdp")), ("mlp", "model"), ("layers", "stage")]
    names = {
        "blocks": {"w": P("layers", "embed", "mlp"), "b": ("layers", None)},
        "embed": ["vocab", "embed"],  # a list of names is a leaf too
        "scale": None,  # replicated
        "pattern": ({"w": ("embed",)}, {"w": ("mlp",)}),  # a tuple of trees is a container
    }
    assert stackwise.logical_specs(names, rules) == {
        "blocks": {"w": P("stage", ("data", "fsdp"), "model"), "b": P("stage", None)},
        "embed": P(None, ("data", "fsdp")),
        "scale": P(),
        "pattern": ({"w": P(("data", "fsdp"))}, {"w": P("model")}),
    }


def test_a_taken_mesh_axis_falls_through_to_the_next_rule():
    # MaxText's style: "embed" prefers the fsdp axis, but "mlp" took it already.
    rules = [("mlp", "fsdp"), ("embed", "fsdp"), ("embed", "data")]
    assert stackwise.logical_specs(P("embed", "mlp"), rules) == P("data", "fsdp")


def test_names_from_linen_and_nnx_include_the_layer_axis():
    from flax import nnx

    import stackwise.flax
    import stackwise.nnx

    rules = [("layers", None), ("embed", "data"), ("mlp", "model")]
    init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            return x + nn.Dense(x.shape[-1], kernel_init=init)(x)

    stack = stackwise.flax.Stack(Block, 3, layer_axis_name="layers")
    abstract = jax.eval_shape(stack.init, jax.random.key(0), jnp.ones((2, 4)))
    specs = stackwise.logical_specs(nn.get_partition_spec(abstract), rules)
    assert specs["params"]["Dense_0"]["kernel"] == P(None, "data", "model")

    class NBlock(nnx.Module):
        def __init__(self, rngs):
            kernel = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "mlp"))
            self.linear = nnx.Linear(4, 4, kernel_init=kernel, rngs=rngs)

    with nnx.use_eager_sharding(False):
        blocks = stackwise.nnx.Stack(NBlock, 3, rngs=nnx.Rngs(0), layer_axis_name="layers")
    specs = stackwise.logical_specs(nnx.get_partition_spec(nnx.state(blocks)), rules)
    assert jax.tree.leaves(specs) == [P(), P(None, "data", "model")]


def test_errors():
    mesh = AbstractMesh((2, 2), ("data", "model"))
    with pytest.raises(TypeError, match=r"`rules` must be a sequence of .* pairs"):
        stackwise.logical_specs(P("embed"), "embed")
    with pytest.raises(TypeError, match=r"rule 1 is \('mlp', 3\)"):
        stackwise.logical_specs(P("embed"), [("embed", "data"), ("mlp", 3)])
    with pytest.raises(ValueError, match=r"rule 0, \('embed', 'fsdp'\), names mesh axes "
                       r"\['fsdp'\] that the mesh does not have"):
        stackwise.logical_specs(P("embed"), [("embed", "fsdp")], mesh=mesh)
    with pytest.raises(ValueError, match=r"leaf \['w'\] names dimensions \('embed', 'embed'\)"):
        stackwise.logical_specs({"w": ("embed", "embed")}, [])
