"""stackwise.nnx's conversions: built blocks (`Stack.from_layers`/`to_layers`), state by name
(`from_loop`/`to_loop`, `from_scan`/`to_scan`) and by graph order (`convert`, on flax's Gemma
example), exact or a clear error; and one layer of a Stack as a block of its own."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from _references import NNX_D, Block, make, scan_model, stacked
from _trees import assert_trees_bitwise, assert_trees_close
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from upstream import gemma as upstream

import stackwise.nnx as swn

D, B = NNX_D, 3


class Loop(nnx.Module):
    def __init__(self, rngs, n=3):
        self.layers = nnx.List([make(rngs) for _ in range(n)])
        self.head = nnx.Linear(D, 2, rngs=rngs)

    def __call__(self, x):
        for block in self.layers:
            x = block(x)
        return self.head(x)


class Port(nnx.Module):
    def __init__(self, rngs, n=3):
        self.layers = swn.Stack(make, n, rngs=rngs)
        self.head = nnx.Linear(D, 2, rngs=rngs)

    def __call__(self, x):
        return self.head(self.layers(x))


X = jax.random.normal(jax.random.key(1), (B, D))


# --------------------------------------------------------------------------
# Built blocks, and nnx.vmap's layout.


def test_conversion_round_trips_are_exact():
    blocks = [make(nnx.Rngs(i, dropout=10 + i), 0.5) for i in range(3)]
    s = swn.Stack.from_layers(blocks)
    assert_trees_bitwise(nnx.state(s.layers), stacked([nnx.state(b) for b in blocks]))
    back = s.to_layers()
    for a, b in zip(back, blocks):
        assert type(a) is Block
        assert_trees_bitwise(nnx.state(a), nnx.state(b))
    again = swn.Stack.from_layers(back)
    assert_trees_bitwise(nnx.state(again), nnx.state(s))
    # nnx.vmap's layout (the vmapped block) is the Stack's `layers`, both ways.
    ref = scan_model(3, nnx.Rngs(5))
    nnx.update(s.layers, nnx.state(ref))
    assert_trees_bitwise(nnx.state(s.layers), nnx.state(ref))


class ScanParent(nnx.Module):
    def __init__(self, rngs):
        self.blocks = scan_model(3, rngs)
        self.head = nnx.Linear(D, 2, rngs=rngs)


class StackParent(nnx.Module):
    def __init__(self, rngs):
        self.blocks = swn.Stack(make, 3, rngs=rngs)
        self.head = nnx.Linear(D, 2, rngs=rngs)


def test_scan_layout_both_ways():
    scanned = nnx.state(ScanParent(nnx.Rngs(0)))
    state = swn.from_scan(scanned, "blocks")
    port = nnx.eval_shape(lambda: StackParent(nnx.Rngs(1)))
    nnx.update(port, state)
    assert_trees_bitwise(nnx.state(port.blocks.layers), scanned["blocks"])
    assert_trees_bitwise(swn.to_scan(nnx.state(port), "blocks"), scanned)
    # Another stacked axis (nnx.StateAxes({nnx.Param: 1, ...: 0})) moves to 0 and back.
    other = {"blocks": {"kernel": jnp.arange(24.0).reshape(2, 3, 4), "count": jnp.arange(3)}}
    axes = {nnx.PathContains("kernel"): 1, ...: 0}
    state = swn.from_scan(other, "blocks", variable_axes=axes)
    assert state["blocks"]["layers"]["kernel"].shape == (3, 2, 4)
    assert_trees_bitwise(swn.to_scan(state, "blocks", variable_axes=axes), other)
    with pytest.raises(ValueError, match=r"nothing at blocks\.layers to convert"):
        swn.to_scan(other, "blocks")
    with pytest.raises(ValueError, match=r"matched by no int axis"):
        swn.from_scan(other, "blocks", variable_axes={nnx.PathContains("kernel"): 0})


# --------------------------------------------------------------------------
# By name.


def test_loop_state_converts_by_name_both_ways():
    loop = Loop(nnx.Rngs(0))
    state = swn.from_loop(nnx.state(loop), "layers")
    port = nnx.eval_shape(lambda: Port(nnx.Rngs(1)))
    nnx.update(port, state)
    for i in range(3):
        assert_trees_bitwise(nnx.state(port.layers.layer(i)), nnx.state(loop.layers[i]))
    assert_trees_bitwise(swn.to_loop(nnx.state(port), "layers"), nnx.state(loop))
    # A pure dict (a checkpoint) with `layer_{i}` names.
    pure = nnx.to_pure_dict(nnx.state(loop))
    by_attr = {"head": pure["head"], **{f"layer_{i}": pure["layers"][i] for i in range(3)}}
    state = swn.from_loop(by_attr, "layers", "layer_{}")
    assert_trees_bitwise(state, nnx.to_pure_dict(nnx.state(port)))
    assert_trees_bitwise(swn.to_loop(state, "layers", "layer_{}"), by_attr)
    assert_trees_close(port(X), loop(X))


def test_sharding_metadata_gains_and_loses_the_layer_axis():
    def make_sharded(rngs):
        init = nnx.with_partitioning(nnx.initializers.ones, ("embed", "mlp"))
        return nnx.Linear(2, 3, kernel_init=init, rngs=rngs)

    class Sharded(nnx.Module):
        def __init__(self, rngs):
            self.layers = nnx.List([make_sharded(rngs) for _ in range(3)])

    with nnx.use_eager_sharding(False):
        loop = nnx.state(Sharded(nnx.Rngs(0)))
    state = swn.from_loop(loop, "layers", layer_axis_name="stage")
    kernel = state["layers"]["layers"]["kernel"]
    assert kernel.get_metadata("out_sharding") == ("stage", "embed", "mlp")
    back = swn.to_loop(state, "layers", layer_axis_name="stage")
    assert back["layers"][1]["kernel"].get_metadata("out_sharding") == ("embed", "mlp")
    assert_trees_bitwise(back, loop)
    with pytest.raises(
        ValueError,
        match=r"out_sharding \('stage', 'embed', 'mlp'\), whose first "
        r"\(layer\) axis should be named None",
    ):
        swn.to_loop(state, "layers")
    # nnx.scan's layout, the layer axis at 1 for the kernel: its name moves with it.
    axes = {nnx.PathContains("kernel"): 1, ...: 0}
    scanned = swn.to_scan(state, "layers", variable_axes=axes, layer_axis_name="stage",
                          scan_axis_name="layers")
    kernel = scanned["layers"]["kernel"]
    assert kernel.get_value().shape == (2, 3, 3)
    assert kernel.get_metadata("out_sharding") == ("embed", "layers", "mlp")
    again = swn.from_scan(scanned, "layers", variable_axes=axes, scan_axis_name="layers",
                          layer_axis_name="stage")
    assert again["layers"]["layers"]["kernel"].get_metadata("out_sharding") == (
        "stage", "embed", "mlp")
    assert_trees_bitwise(again, state)


@pytest.mark.slow
@settings(max_examples=20, deadline=None)
@given(
    n=st.integers(1, 5),
    leaves=st.dictionaries(
        st.sampled_from(["w", "b", "attn/q", "mlp/up/kernel"]),
        st.tuples(
            st.sampled_from([jnp.float32, jnp.bfloat16, jnp.int32, jnp.uint32]),
            st.lists(st.integers(1, 3), max_size=2),
        ),
        min_size=1,
    ),
    names=st.sampled_from([None, "layer_{}", "blocks/{}"]),
)
def test_random_states_round_trip_bitwise(n, leaves, names):
    keys = iter(jax.random.split(jax.random.key(n), n * len(leaves)))
    name_of = {
        None: lambda i: ("layers", i),
        "layer_{}": lambda i: (f"layer_{i}",),
        "blocks/{}": lambda i: ("blocks", i),
    }[names]
    tree = {"head": {"b": jnp.ones(2, jnp.bfloat16)}}
    for i in range(n):
        node_at = tree
        for part in name_of(i):
            node_at = node_at.setdefault(part, {})
        for path, (dtype, shape) in leaves.items():
            node = node_at
            *parents, leaf = path.split("/")
            for p in parents:
                node = node.setdefault(p, {})
            node[leaf] = (10 * jax.random.normal(next(keys), shape)).astype(dtype)
    for as_state in (False, True):
        t = nnx.State(tree) if as_state else tree
        state = swn.from_loop(t, "layers", names)
        assert isinstance(state, nnx.State) == as_state
        assert_trees_bitwise(swn.to_loop(state, "layers", names), t)


# --------------------------------------------------------------------------
# One test per defect class.


LOOP = {"layers": {i: {"w": jnp.full(2, float(i))} for i in range(3)}}


def test_gaps_surpluses_and_duplicates_are_errors():
    gap = {"layers": {0: LOOP["layers"][0], 2: LOOP["layers"][2]}}
    with pytest.raises(ValueError, match=r"layer\(s\) 1 \('layers\.1'\) missing, yet layer 2"):
        swn.from_loop(gap, "layers")
    with pytest.raises(ValueError, match=r"found 3 layers.*but n=2: layers 2\.\.2 would be left"):
        swn.from_loop(LOOP, "layers", n=2)
    state = swn.from_loop(LOOP, "layers")
    with pytest.raises(ValueError, match=r"layers 0 and 1 are both named \('a',\)"):
        swn.to_loop(state, "layers", ["a", "a", "b"])
    with pytest.raises(TypeError, match=r"`names='block'` has no `\{\}`"):
        swn.to_loop(state, "layers", "block")


def test_existing_entries_are_never_overwritten_and_absent_paths_are_errors():
    taken = {"layers": {**LOOP["layers"], "layers": {"w": jnp.zeros(1)}}}
    with pytest.raises(ValueError, match=r"layers\.layers already exists in the state"):
        swn.from_loop(taken, "layers")
    state = swn.from_loop(LOOP, "layers")
    with pytest.raises(ValueError, match=r"layer_1 already exists"):
        swn.to_loop({**state, "layer_1": {"w": jnp.zeros(1)}}, "layers", "layer_{}")
    with pytest.raises(ValueError, match=r"no Stack block at blocks\.layers"):
        swn.to_loop(state, "blocks")
    with pytest.raises(ValueError, match=r"nothing at blocks to convert"):
        swn.from_scan(state, "blocks")
    with pytest.raises(TypeError, match=r"`path` is one place here, the vmapped block's"):
        swn.from_scan(LOOP, ["layers/a", "layers/b"])


def test_mixed_dtypes_and_metadata_are_refused():
    mixed = {"layers": {**LOOP["layers"], 1: {"w": jnp.ones(2, jnp.bfloat16)}}}
    with pytest.raises(
        TypeError,
        match=r"leaf w \(in each layer\).*layers 0, 2: float32; "
        r"layer 1 \(layers\.1\): bfloat16",
    ):
        swn.from_loop(mixed, "layers")
    kinds = nnx.State(
        {"layers": {0: {"w": nnx.Param(jnp.zeros(2))}, 1: {"w": nnx.BatchStat(jnp.zeros(2))}}}
    )
    with pytest.raises(ValueError, match=r"layers\.1\.w has type and metadata \('BatchStat'"):
        swn.from_loop(kinds, "layers")


# --------------------------------------------------------------------------
# By graph order: flax's Gemma example, ported onto a Stack.


CONFIG = upstream.TransformerConfig(
    num_layers=3,
    num_embed=17,
    embed_dim=16,
    hidden_dim=24,
    num_heads=4,
    head_dim=8,
    num_kv_heads=1,
    final_logit_softcap=None,
    use_post_attn_norm=True,
    use_post_ffw_norm=True,
    attention_types=(upstream.AttentionType.GLOBAL,) * 3,
)
# Upstream reads variables with `.value`, which this flax deprecates.
UPSTREAM_WARNINGS = pytest.mark.filterwarnings(
    "ignore:'\\.value' (access|setter) is now deprecated:DeprecationWarning"
)


class PortedBlock(upstream.Block):
    """upstream.Block returning x alone (a Stack's block returns its carry first)."""

    def __call__(self, x, segment_pos, cache, attn_mask):
        _, x = super().__call__(x, segment_pos, cache, attn_mask)
        return x


class PortedTransformer(upstream.Transformer):
    """upstream.Transformer with its list of blocks replaced by a Stack, same attribute names."""

    def __init__(self, config, *, rngs, sow_config=upstream.SowConfig()):  # noqa: B008
        self.embedder = upstream.Embedder(
            vocab_size=config.num_embed, embed_dim=config.embed_dim, rngs=rngs
        )

        def make_block(rngs):
            return PortedBlock(
                num_heads=config.num_heads,
                num_kv_heads=config.num_kv_heads,
                embed_dim=config.embed_dim,
                head_dim=config.head_dim,
                hidden_dim=config.hidden_dim,
                sliding_window_size=config.sliding_window_size,
                use_post_attn_norm=config.use_post_attn_norm,
                use_post_ffw_norm=config.use_post_ffw_norm,
                attn_logits_soft_cap=config.attn_logits_soft_cap,
                attn_type=upstream.AttentionType.GLOBAL,
                query_pre_attn_scalar=config.query_pre_attn_scalar(),
                rngs=rngs,
                use_qk_norm=config.use_qk_norm,
                sow_config=sow_config,
            )

        self.layers = swn.Stack(make_block, config.num_layers, rngs=rngs)
        self.final_norm = upstream.RMSNorm(config.embed_dim, rngs=rngs)
        self.final_logits_softcap = config.final_logit_softcap
        self.sow_config = sow_config

    def __call__(self, last_tokens, positions, cache, attention_mask):
        x = self.embedder.encode(last_tokens)
        x = self.layers(x, positions, None, attention_mask)
        return self.embedder.decode(self.final_norm(x)), None


TOKENS = jnp.array([[1, 2, 3, 4, 0], [5, 6, 7, 0, 0]])
MASK = TOKENS != 0


def gemma_logits(model):
    positions = upstream.build_positions_from_mask(MASK)
    return model(TOKENS, positions, None, upstream.make_causal_attn_mask(MASK))[0]


def gemma_loss_and_grads(model):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params):
        logits = gemma_logits(nnx.merge(graphdef, params, rest, copy=True))
        return jnp.mean(jax.nn.log_softmax(logits)[..., 1]), logits

    return jax.value_and_grad(loss, has_aux=True)(params)


@pytest.mark.slow
@UPSTREAM_WARNINGS
def test_upstream_gemma_state_converts_in_one_call():
    loop = upstream.Transformer(CONFIG, rngs=nnx.Rngs(0))
    port = nnx.eval_shape(lambda: PortedTransformer(CONFIG, rngs=nnx.Rngs(1)))
    nnx.update(port, swn.convert(nnx.state(loop), loop, port))
    # Bitwise against names: port.layers.layers.<path>[i] is loop.layers[i].<path>.
    stack_state = nnx.to_flat_state(nnx.state(port.layers.layers))
    for path, var in stack_state:
        for i in range(CONFIG.num_layers):
            expected = dict(nnx.to_flat_state(nnx.state(loop.layers[i])))[path]
            assert_trees_bitwise(var[...][i], expected[...])
    assert_trees_bitwise(nnx.state(port.embedder), nnx.state(loop.embedder))
    assert_trees_bitwise(nnx.state(port.final_norm), nnx.state(loop.final_norm))
    # Same logits and gradients; and back, bitwise.
    (_, y_loop), g_loop = gemma_loss_and_grads(loop)
    (_, y_port), g_port = gemma_loss_and_grads(port)
    assert_trees_close(y_port, y_loop)
    assert_trees_close(swn.convert(g_port, port, loop), g_loop)
    assert_trees_bitwise(swn.convert(nnx.state(port), port, loop), nnx.state(loop))
    # The same, by name: the loop's `layers[i]` into the Stack at `layers`.
    assert_trees_bitwise(swn.from_loop(nnx.state(loop), "layers"), nnx.state(port))


def linen_checkpoint(model):
    """A Gemma checkpoint in upstream's linen format, from an NNX Transformer's state."""
    params = {
        "embedder": {"input_embedding": model.embedder.input_embedding[...]},
        "final_norm": {"scale": model.final_norm.scale[...]},
    }
    for i, block in enumerate(model.layers):
        params[f"layer_{i}"] = {
            "pre_attention_norm": {"scale": block.pre_attention_norm.scale[...]},
            "post_attention_norm": {"scale": block.post_attention_norm.scale[...]},
            "pre_ffw_norm": {"scale": block.pre_ffw_norm.scale[...]},
            "post_ffw_norm": {"scale": block.post_ffw_norm.scale[...]},
            "attn": {
                name: {"w": getattr(block.attn, name).w[...]}
                for name in ("q_einsum", "kv_einsum", "attn_vec_einsum")
            },
            "mlp": {
                "gating_einsum": jnp.stack(
                    [block.mlp.gate_proj.kernel[...], block.mlp.up_proj.kernel[...]]
                ),
                "linear": block.mlp.down_proj.kernel[...],
            },
        }
    return {"transformer": params}


@pytest.mark.slow
@UPSTREAM_WARNINGS
def test_upstream_from_params_then_one_call_onto_the_port():
    reference = upstream.Transformer(CONFIG, rngs=nnx.Rngs(3))
    checkpoint = linen_checkpoint(reference)
    # Upstream's loader writes `layers[i]`, which the port does not have.
    with pytest.raises(ValueError, match=r"PortedTransformer\.layers\[0\]\.pre_attention_norm"):
        PortedTransformer.from_params(checkpoint, CONFIG)
    loop = upstream.Transformer.from_params(checkpoint, CONFIG)
    port = nnx.eval_shape(lambda: PortedTransformer(CONFIG, rngs=nnx.Rngs(0)))
    nnx.update(port, swn.convert(nnx.state(loop), loop, port))
    assert_trees_bitwise(swn.convert(nnx.state(port), port, reference), nnx.state(reference))
    assert_trees_close(gemma_logits(port), gemma_logits(reference))


@pytest.mark.slow
@UPSTREAM_WARNINGS
def test_one_layer_of_a_stack_is_a_block_of_its_own():
    loop = upstream.Transformer(CONFIG, rngs=nnx.Rngs(0))
    port = nnx.eval_shape(lambda: PortedTransformer(CONFIG, rngs=nnx.Rngs(1)))
    nnx.update(port, swn.convert(nnx.state(loop), loop, port))
    stack = port.layers
    # A property computed from a variable's shape sees the layer axis on the stacked block.
    assert stack.layers.attn.head_dim == CONFIG.num_heads != CONFIG.head_dim
    assert stack.layer(1).attn.head_dim == CONFIG.head_dim
    assert len(stack) == CONFIG.num_layers
    assert type(stack[-1]) is PortedBlock
    for i, block in enumerate(stack):
        assert_trees_bitwise(nnx.state(block), nnx.state(loop.layers[i]))
        assert_trees_bitwise(block.init_cache(4, 2), loop.layers[i].init_cache(4, 2))
    # Abstract stacks give abstract layers.
    abstract = nnx.eval_shape(lambda: PortedTransformer(CONFIG, rngs=nnx.Rngs(1)))
    assert abstract.layers.layer(0).attn.head_dim == CONFIG.head_dim
    with pytest.raises(IndexError, match="layer 3 is out of range for n=3"):
        stack.layer(3)
    with pytest.raises(TypeError, match="a layer index must be an int, got slice"):
        stack[0:2]


def test_models_that_do_not_correspond_are_refused():
    loop = Loop(nnx.Rngs(0))

    class Renamed(nnx.Module):  # the Stack under another attribute name than the loop's list
        def __init__(self, rngs):
            self.blocks = swn.Stack(make, 3, rngs=rngs)
            self.head = nnx.Linear(D, 2, rngs=rngs)

    with pytest.raises(ValueError, match=r"(?s)names within the layer differ|do not correspond"):
        swn.convert(nnx.state(loop), loop, lambda: Renamed(nnx.Rngs(0)))
    deeper = lambda: Port(nnx.Rngs(0), n=4)  # noqa: E731
    with pytest.raises(ValueError, match=r"the source has \d+ per-layer leaves and the target"):
        swn.convert(nnx.state(loop), loop, deeper)
    state = nnx.state(loop)
    with pytest.raises(ValueError, match=r"(?s)not the source model's.*missing: head\.bias"):
        swn.convert(nnx.State({"layers": state["layers"]}), loop, Port(nnx.Rngs(0)))
    with pytest.raises(TypeError, match="must be an `nnx.Module` or a function"):
        swn.convert(state, loop, 3)
    # Converting a state to the model it came from is the identity.
    assert_trees_bitwise(swn.convert(state, loop, loop), state)
