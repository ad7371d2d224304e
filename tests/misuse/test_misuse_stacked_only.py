"""The misuse catalogue of the core's functions over stacked trees given a tree in the serving
layout: the core's ``stackwise.Serving`` of per-layer trees, or an adapter's variables served
leaf-wise (each leaf a ``Serving`` of its layers). Each would read a per-layer array's first
axis as the layer axis (slice, quantize, shard, optimize or save the wrong axis), so each
refuses, naming the argument, the leaf and the way back to the stacked tree."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _misuse import assert_refused, case
from jax.sharding import Mesh

import stackwise
from stackwise import _kit

N = 3
PARAMS = {"b": jnp.zeros((N, 4)), "w": jnp.ones((N, 4, 4))}
NAMES = {"b": "l.{}.b", "w": "l.{}.w"}
MESH = Mesh(np.array(jax.devices()[:1]), ("data",))
ROOT = stackwise.to_serving(PARAMS)  # the core's: a Serving of per-layer trees
LEAVES = _kit.serving.split(PARAMS, "test", "params")  # an adapter's: each leaf a Serving


def _adapters():
    return stackwise.lora.init(jax.random.key(0), PARAMS, rank=2)


def _optax(tree):
    import optax

    import stackwise.optax

    stackwise.optax.layerwise(optax.adam(1e-3)).init(tree)


CALLS = {
    "stackwise.quant.quantize": ("params", lambda t: stackwise.quant.quantize(t, "int8")),
    "stackwise.lora.init": ("params", lambda t: stackwise.lora.init(jax.random.key(0), t, rank=2)),
    "stackwise.lora.attach": ("base", lambda t: stackwise.lora.attach(t, _adapters())),
    "stackwise.lora.merge": ("base", lambda t: stackwise.lora.merge(t, _adapters())),
    "stackwise.lora.unmerge": ("base", lambda t: stackwise.lora.unmerge(t, _adapters())),
    "stackwise.lora.stack_adapters": ("adapters[1]",
                                      lambda t: stackwise.lora.stack_adapters([PARAMS, t])),
    "stackwise.lora.layer_axes": ("tree", stackwise.lora.layer_axes),
    "stackwise.lora.save_peft": ("adapters", lambda t: stackwise.lora.save_peft(
        "/nonexistent/never", t, {"w": "q_proj"})),
    "stackwise.save_safetensors": ("params", lambda t: stackwise.save_safetensors(
        t, NAMES, "/nonexistent/never")),
    "stackwise.save_orbax": ("params", lambda t: stackwise.save_orbax(
        t, NAMES, "/nonexistent/never")),
    "stackwise.slice_layers": ("stacked", lambda t: stackwise.slice_layers(t, 0, 2)),
    "stackwise.unstack_layers": ("stacked", stackwise.unstack_layers),
    "stackwise.stack_layers": ("layers", lambda t: stackwise.stack_layers([t, t])),
    "stackwise.fsdp_specs": ("params", lambda t: stackwise.fsdp_specs(t, MESH, "data")),
    "stackwise.shard_stacked": ("params", lambda t: stackwise.shard_stacked(t, MESH)),
    "stackwise.optax.layerwise": ("params", _optax),
}


def _rows():
    for who, (what, call) in CALLS.items():
        for form, tree, at in (("the core's Serving", ROOT, ""),
                               ("leaf-wise", LEAVES, "['b']")):
            at = "" if what == "layers" else at  # a list of trees: the first one's path
            where = f"`{what}{at}`" if what != "layers" else "`layers[0]"
            yield case(f"{who} given {form}", lambda call=call, tree=tree: call(tree),
                       TypeError, f"{who}: {where}", "is in the serving layout",
                       "takes stacked trees", "`stackwise.from_serving(tree)`",
                       "`stackwise.flax.from_serving`")


@pytest.mark.every_case
@pytest.mark.parametrize("call, error, words", list(_rows()))
def test_misuse_stacked_only(call, error, words):
    assert_refused(call, error, words)
