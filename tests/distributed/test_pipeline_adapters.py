"""Pipeline parallelism on params that came from the adapters: Haiku, Flax linen, NNX, Equinox.

A model stacked with ``stackwise.haiku.Stack``, ``stackwise.flax.Stack``,
``stackwise.nnx.Stack`` or ``stackwise.equinox.Stack`` keeps its params in the
adapter's layout: every leaf has a leading layer axis ``n`` and the block's
own names sit under the Stack's. Pipelining those params needs only (1) the
block's per-layer apply and (2) the Stack's params as that apply names them;
both are done here in a few lines (``_haiku_layers``, ``_flax_layers``,
``_nnx_layers``, ``_equinox_layers``). The pipelined model takes the adapter's
params as they are, so outputs and gradients compare leaf for leaf with the
model's own (unpipelined) apply.

FSDP inside the stages (``fsdp="data"``) runs with every adapter's params: the
Haiku, NNX and Equinox params placed over stage x data with
``stackwise.shard_stacked(params, mesh, stackwise.fsdp_specs(params, mesh, "data"),
layer_axis="stage")`` keep that layout in their gradients; the linen case's
boxed params go in unplaced (the pipeline places them).

The multi-device checks run once, in a subprocess with 8 simulated CPU
devices (``XLA_FLAGS=--xla_force_host_platform_device_count=8``): this file is
also that subprocess's script (see ``_CASES``), as in tests/distributed/test_pipeline.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from _multidevice import result, run_cases, run_module
from _tolerance import check, compare, reassociation_bound

import stackwise

D, N, BATCH = 8, 8, 16  # feature width, layers, batch

# float32 sums reassociated across microbatches, stages and the data axis: outputs and grads
# within PIPELINE_BOUND * eps * (the leaf's largest magnitude) of the model's own
# (tests/_tolerance.py). N layers of up to two matmuls (contractions of D and 2 * D terms), grads
# summing the BATCH rows: 6 * (2 * 8 * (sqrt(8) + sqrt(16)) + sqrt(16)) = 680 eps, 8.1e-5 of the
# scale.
# Measured on an AMD EPYC VM (the suite's XLA flags, XLA's default fusion emitters, optimisation
# level 2): at most 2 eps. A relative error of 1e-3 is 8,389 eps.
PIPELINE_BOUND = reassociation_bound(depth=N, width=(D, 2 * D), summed=BATCH)


# --------------------------------------------------------------------------
# The mappings: a Stack's params -> (per-layer apply, stacked per-layer params).


def _haiku_layers(block, stack_name="stack"):
    """``(apply, to_layer)`` for the layers of ``stackwise.haiku.Stack(block, n)``.

    ``apply(p_i, x)`` runs one block, as ``hk.transform(lambda x: block()(x))``
    names it (``block/linear``, ...). ``to_layer(params)`` takes the model's
    params and keeps the Stack's entries, stripping the Stack's name
    (``stack/block/linear`` -> ``block/linear``): the Stack runs the same
    per-layer transform inside its own module scope, so that prefix is the
    only difference. Arrays are not copied or sliced, so the rename is free
    under ``jax.grad``.
    """
    import haiku as hk

    layer = hk.without_apply_rng(hk.transform(lambda x: block()(x)))
    prefix = stack_name + "/"

    def to_layer(params):
        return {k[len(prefix) :]: v for k, v in params.items() if k.startswith(prefix)}

    return layer.apply, to_layer


def _flax_layers(block, stack_name):
    """``(apply, to_layer)`` for the layers of ``stackwise.flax.Stack(block, n, name=...)``.

    The Stack keeps the block's variables under its own name with the block's
    own names inside (``Dense_0``, ...), so the per-layer params are that
    subtree as it is; partitioning boxes (``nn.with_partitioning``) are
    unboxed, since a box's names still include the layer axis.
    """
    import flax.linen as nn

    def apply(p, x):
        return block().apply({"params": p}, x)

    def to_layer(params):
        return nn.meta.unbox(params[stack_name])

    return apply, to_layer


def _nnx_layers(stack):
    """``(apply, to_layer)`` for the layers of a ``stackwise.nnx.Stack``, ``stack``.

    ``stack.layers`` is one block whose variables carry the layer axis; its
    graph (``nnx.split``) is the block's, so ``nnx.merge`` of that graph with
    one layer's ``nnx.Param`` state is layer i's block. ``to_layer(params)``
    takes the model's ``nnx.Param`` state (``nnx.split(model, nnx.Param, ...)``)
    and keeps the Stack's ``layers`` subtree, found by the Stack's attribute
    path in the model (here ``blocks``). The blocks hold params only.
    """
    from flax import nnx

    graphdef, _ = nnx.split(stack.layers)

    def apply(p, x):
        return nnx.merge(graphdef, p)(x)

    def to_layer(params):
        return params["blocks"]["layers"]

    return apply, to_layer


def _equinox_layers(stack):
    """``(apply, to_layer)`` for the layers of a ``stackwise.equinox.Stack``, ``stack``.

    The Stack's ``layers`` is one block whose arrays carry the layer axis;
    ``eqx.partition`` splits off its static part, and ``eqx.combine`` of one
    layer's arrays with it is layer i's block. ``to_layer(params)`` takes the
    model's arrays (``eqx.partition(model, eqx.is_array)``, the same pytree
    with ``None`` for the static leaves) and keeps the Stack's ``layers``.
    """
    import equinox as eqx

    _, static = eqx.partition(stack.layers, eqx.is_array)

    def apply(p, x):
        return eqx.combine(p, static)(x)

    def to_layer(params):
        return params.blocks.layers

    return apply, to_layer


def _fsdp_placed(params, mesh):
    """``params`` (any pytree of stacked arrays) over ``"stage"`` x ``"data"``: FSDP."""
    specs = stackwise.fsdp_specs(params, mesh, "data")
    return stackwise.shard_stacked(params, mesh, specs, layer_axis="stage")


def _layout(tree):
    """Per leaf (by path): its spec (no trailing ``None`` s) and the part one device holds."""

    def one(a):
        spec = list(a.sharding.spec) if hasattr(a.sharding, "spec") else [type(a.sharding).__name__]
        while spec and spec[-1] is None:
            spec.pop()
        return [str(jax.sharding.PartitionSpec(*spec)), a.addressable_shards[0].data.size / a.size]

    return {jax.tree_util.keystr(k): one(a) for k, a in jax.tree_util.tree_leaves_with_path(tree)}


# --------------------------------------------------------------------------
# The cases, run in the 8-device subprocess.


def _compare(model_apply, pipelined_apply, params, x, placed):
    """The worst leaf of the outputs and of the grads w.r.t. the model's params and x,
    relative to the model's own (``_tolerance.compare``), and the layout (``_layout``) of the
    placed params and of their grads."""

    def loss(f):
        def fn(p, v):
            y = f(p, v)
            return jnp.sum(jnp.sin(y)), y

        return jax.jit(jax.value_and_grad(fn, argnums=(0, 1), has_aux=True))

    (_, y), g = loss(pipelined_apply)(placed, x)
    (_, y_ref), g_ref = loss(model_apply)(params, x)
    if jax.tree.structure(g) != jax.tree.structure(g_ref):
        raise AssertionError(
            f"grad trees differ: {jax.tree.structure(g)} vs {jax.tree.structure(g_ref)}"
        )
    named = lambda y, g: {"out": y, "grad_params": g[0], "grad_x": g[1]}  # noqa: E731
    return {
        "max_err": compare(named(y, g), named(y_ref, g_ref)),
        "param_layout": _layout(placed),
        "grad_layout": _layout(g[0]),
    }


def _case_haiku_gpipe():
    """Haiku Stack of an MLP block, GPipe on mesh (stage=4, data=2), FSDP over "data":
    params placed over stages x data."""
    import haiku as hk

    import stackwise.haiku

    class Block(hk.Module):
        def __call__(self, x):
            return x + hk.Linear(D)(jax.nn.gelu(hk.Linear(2 * D)(x)))

    model = hk.without_apply_rng(hk.transform(lambda x: stackwise.haiku.Stack(Block, n=N)(x)))
    x = jax.random.normal(jax.random.key(1), (BATCH, D))
    params = model.init(jax.random.key(0), x)

    layer_apply, to_layer = _haiku_layers(Block)
    mesh = jax.make_mesh((4, 2), ("stage", "data"))
    pp = stackwise.pipeline(
        None, layer_apply, N, mesh, microbatches=4, data_axis="data", remat=True, fsdp="data"
    )
    placed = _fsdp_placed(params, mesh)
    return {
        **_compare(model.apply, lambda p, v: pp.apply(to_layer(p), v), params, x, placed),
        "stack_names": sorted(params),
        "layer_names": sorted(to_layer(params)),
        "block_names": sorted(hk.transform(lambda x: Block()(x)).init(jax.random.key(0), x)),
        "layers_per_device": [
            s.data.shape[0] for s in placed["stack/block/linear"]["w"].addressable_shards
        ],
    }


def _flax_model(block, name, **stack_options):
    import flax.linen as nn

    import stackwise.flax

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            return stackwise.flax.Stack(block, n=N, name=name, **stack_options)(x)

    return Model()


def _case_flax_gpipe():
    """Flax linen Stack of an MLP block, GPipe on mesh (stage=4,)."""
    import flax.linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            return x + nn.Dense(D)(nn.gelu(nn.Dense(2 * D)(x)))

    model = _flax_model(Block, "layers")
    x = jax.random.normal(jax.random.key(1), (BATCH, D))
    params = model.init(jax.random.key(0), x)["params"]

    layer_apply, to_layer = _flax_layers(Block, "layers")
    mesh = jax.make_mesh((4,), ("stage",))
    pp = stackwise.pipeline(None, layer_apply, N, mesh, microbatches=4)
    return {
        **_compare(
            lambda p, v: model.apply({"params": p}, v),
            lambda p, v: pp.apply(to_layer(p), v),
            params, x, params,
        ),
        "layer_names": sorted(to_layer(params)),
        "block_names": sorted(Block().init(jax.random.key(0), x)["params"]),
    }


def _case_flax_circular_partitioned():
    """Flax Stack with partitioned params (``layer_axis_name``); circular, (stage=4, data=2),
    FSDP over "data" per tick; the boxed params unplaced (the pipeline places them)."""
    import flax.linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            init = nn.with_partitioning(nn.initializers.lecun_normal(), (None, None))
            return x + jnp.tanh(nn.Dense(D, kernel_init=init)(x))

    model = _flax_model(Block, "layers", layer_axis_name="stage")
    x = jax.random.normal(jax.random.key(1), (BATCH, D))
    boxed = model.init(jax.random.key(0), x)["params"]
    names = boxed["layers"]["Dense_0"]["kernel"].names

    layer_apply, to_layer = _flax_layers(Block, "layers")
    mesh = jax.make_mesh((4, 2), ("stage", "data"))
    pp = stackwise.pipeline(
        None, layer_apply, N, mesh, microbatches=4, data_axis="data", schedule="circular",
        repeats=2, fsdp="data", fsdp_gather="tick",
    )
    return {
        **_compare(
            lambda p, v: model.apply({"params": p}, v),
            lambda p, v: pp.apply(to_layer(p), v),
            boxed, x, boxed,
        ),
        "box_names": list(names),
    }


def _case_nnx_gpipe_fsdp():
    """NNX model holding a Stack of a residual block; GPipe on (stage=4, data=2), FSDP over
    "data" per step, the ``nnx.Param`` state placed over stages x data."""
    from flax import nnx

    import stackwise.nnx

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(D, D, rngs=rngs)

        def __call__(self, x):
            return x + jnp.tanh(self.linear(x))

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.blocks = stackwise.nnx.Stack(Block, n=N, rngs=rngs)

        def __call__(self, x):
            return self.blocks(x)

    model = Model(nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    x = jax.random.normal(jax.random.key(1), (BATCH, D))

    layer_apply, to_layer = _nnx_layers(model.blocks)
    mesh = jax.make_mesh((4, 2), ("stage", "data"))
    pp = stackwise.pipeline(
        None, layer_apply, N, mesh, microbatches=4, data_axis="data", fsdp="data"
    )
    return _compare(
        lambda p, v: nnx.merge(graphdef, p, rest)(v),
        lambda p, v: pp.apply(to_layer(p), v),
        params, x, _fsdp_placed(params, mesh),
    )


def _case_equinox_gpipe_fsdp():
    """Equinox model holding a Stack of a residual block; GPipe on (stage=4, data=2), FSDP over
    "data" per tick, the model's arrays placed over stages x data."""
    import equinox as eqx

    import stackwise.equinox

    class Block(eqx.Module):
        linear: eqx.nn.Linear

        def __init__(self, key):
            self.linear = eqx.nn.Linear(D, D, key=key)

        def __call__(self, x):  # a batch: the pipeline splits it into microbatches
            return x + jnp.tanh(jax.vmap(self.linear)(x))

    class Model(eqx.Module):
        blocks: stackwise.equinox.Stack

        def __init__(self, key):
            self.blocks = stackwise.equinox.Stack(Block, n=N, key=key)

        def __call__(self, x):
            return self.blocks(x)

    params, static = eqx.partition(Model(jax.random.key(0)), eqx.is_array)
    x = jax.random.normal(jax.random.key(1), (BATCH, D))

    layer_apply, to_layer = _equinox_layers(eqx.combine(params, static).blocks)
    mesh = jax.make_mesh((4, 2), ("stage", "data"))
    pp = stackwise.pipeline(
        None, layer_apply, N, mesh, microbatches=4, data_axis="data", fsdp="data",
        fsdp_gather="tick",
    )
    return _compare(
        lambda p, v: eqx.combine(p, static)(v),
        lambda p, v: pp.apply(to_layer(p), v),
        params, x, _fsdp_placed(params, mesh),
    )


_CASES = {
    "haiku_gpipe": _case_haiku_gpipe,
    "flax_gpipe": _case_flax_gpipe,
    "flax_circular_partitioned": _case_flax_circular_partitioned,
    "nnx_gpipe_fsdp": _case_nnx_gpipe_fsdp,
    "equinox_gpipe_fsdp": _case_equinox_gpipe_fsdp,
}

# --------------------------------------------------------------------------
# The tests.


@pytest.fixture(scope="module")
def multi_device():
    pytest.importorskip("haiku")
    pytest.importorskip("flax")
    pytest.importorskip("equinox")
    return run_module(__file__, timeout=300)


def _result(multi_device, name):
    return result(multi_device, name)


@pytest.mark.parametrize("name", list(_CASES))
def test_pipeline_of_adapter_params_matches_the_model(multi_device, name):
    check(_result(multi_device, name)["max_err"], PIPELINE_BOUND, name)


@pytest.mark.parametrize("name", ["haiku_gpipe", "nnx_gpipe_fsdp", "equinox_gpipe_fsdp"])
def test_fsdp_params_and_grads_split_over_stages_and_data(multi_device, name):
    r = _result(multi_device, name)
    layout = r["param_layout"]
    assert len(layout) >= 2, layout
    for leaf, (spec, part) in layout.items():
        # the layer axis over "stage", one other axis over "data": 1/8 of it per device
        assert spec.startswith("P('stage',") and "'data'" in spec, (leaf, spec)
        assert part == 1 / 8, (leaf, part)
    assert r["grad_layout"] == layout  # the grads come back in the params' layout


def test_haiku_mapping_gives_the_blocks_own_names(multi_device):
    r = _result(multi_device, "haiku_gpipe")
    assert r["stack_names"] == ["stack/block/linear", "stack/block/linear_1"]
    assert r["layer_names"] == r["block_names"] == ["block/linear", "block/linear_1"]
    assert r["layers_per_device"] == [2] * 8  # the adapter's params, placed on 4 stages


def test_flax_mapping_gives_the_blocks_own_names(multi_device):
    r = _result(multi_device, "flax_gpipe")
    assert r["layer_names"] == r["block_names"] == ["Dense_0", "Dense_1"]
    # The box's names carry the layer axis, which a per-layer apply must not see.
    assert _result(multi_device, "flax_circular_partitioned")["box_names"] == ["stage", None, None]


if __name__ == "__main__":
    run_cases(_CASES)
