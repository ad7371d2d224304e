"""stackwise.flax's conversions: by name (`from_loop`/`to_loop`, `from_scan`/`to_scan`) and by
creation order (`convert`, on flax's lm1b example model), exact or a clear error."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from _references import Loop
from _tiers import examples
from _trees import assert_trees_bitwise, assert_trees_close
from hypothesis import given, settings
from hypothesis import strategies as st
from upstream import lm1b as upstream

import stackwise
import stackwise.flax as swf

D = 4
N = 3
X = jnp.linspace(-1.0, 1.0, 2 * D).reshape(2, D)


class BNBlock(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
        h = nn.Dense(D, use_bias=False)(x)
        return x + jnp.tanh(nn.BatchNorm(use_running_average=not train)(h))


class Sharded(nn.Module):
    @nn.compact
    def __call__(self, x):
        w = self.param(
            "w", nn.with_partitioning(nn.initializers.normal(1.0), (None, "model")), (D, D)
        )
        init = nn.with_logical_partitioning(nn.initializers.normal(1.0), ("embed", "mlp"))
        return x + jnp.tanh(nn.Dense(D, kernel_init=init)(x @ w))


class Stacked(nn.Module):
    block: type
    n: int
    reverse: bool = False

    @nn.compact
    def __call__(self, x, *args, **kwargs):
        stack = swf.Stack(self.block, self.n, reverse=self.reverse, name="layers")
        return stack(x, *args, **kwargs)


# --------------------------------------------------------------------------
# By name.


def test_loop_layout_round_trip_is_exact_for_every_collection():
    variables = Loop(BNBlock, N).init(jax.random.key(0), X)
    _, state = Loop(BNBlock, N).apply(variables, X, mutable="batch_stats")
    variables = {**variables, **state}
    stacked = swf.from_loop(variables, "layers")
    assert_trees_bitwise(swf.to_loop(stacked, "layers"), variables)
    assert stacked["batch_stats"]["layers"]["BatchNorm_0"]["var"].shape == (N, D)
    y, _ = Stacked(BNBlock, N).apply(stacked, X, mutable="batch_stats")
    assert_trees_close(y, Loop(BNBlock, N).apply(variables, X, mutable="batch_stats")[0])


def test_any_per_layer_naming_and_nested_paths():
    loop = {
        "params": {"enc": {"blocks": {str(i): {"w": jnp.full((2,), i)} for i in range(4)}}},
        "cache": {"enc": {"blocks": {str(i): {"k": jnp.full((), i)} for i in range(4)}}},
    }
    for names in (lambda i: f"blocks/{i}", "blocks/{}", [f"blocks/{i}" for i in range(4)]):
        stacked = swf.from_loop(loop, "enc/stack", names=names)
        assert stacked["params"]["enc"]["stack"]["w"].tolist() == [[0, 0], [1, 1], [2, 2], [3, 3]]
        assert list(stacked["cache"]["enc"]) == ["stack"]
        assert_trees_bitwise(swf.to_loop(stacked, "enc/stack", names=names), loop)


def test_scan_layout_round_trip_with_partition_names():
    stack = swf.Stack(Sharded, N, layer_axis_name="layers")
    variables = stack.init(jax.random.key(0), X)
    scanned = swf.to_scan(
        variables, variable_axes={"params": 1}, layer_axis_name="layers", scan_axis_name="stage"
    )
    spec = nn.get_partition_spec(scanned)["params"]["w"]
    assert spec == jax.sharding.PartitionSpec(None, "stage", "model")
    assert scanned["params"]["w"].value.shape == (D, N, D)
    back = swf.from_scan(
        scanned, variable_axes={"params": 1}, layer_axis_name="layers", scan_axis_name="stage"
    )
    assert_trees_bitwise(back, variables)
    message = (
        r"variable `params\['Dense_0'\]\['kernel'\]` is partitioned as "
        r"\('embed', 'stage', 'mlp'\), whose axis 1"
    )
    with pytest.raises(ValueError, match=message + " should be named 'other'"):
        swf.from_scan(scanned, variable_axes={"params": 1}, scan_axis_name="other")
    # The loop layout drops the layer axis from every spec (checking its name), and back.
    loop = swf.to_loop({"params": {"s": variables["params"]}}, "s", layer_axis_name="layers")
    assert nn.get_partition_spec(loop)["params"]["layers_0"]["w"] == jax.sharding.PartitionSpec(
        None, "model"
    )
    assert_trees_bitwise(
        swf.from_loop(loop, "s", layer_axis_name="layers"), {"params": {"s": variables["params"]}}
    )
    with pytest.raises(
        ValueError,
        match=r"first \(layer\) axis should be named None; pass the "
        r"Stack's `layer_axis_name='layers'`",
    ):
        swf.to_loop({"params": {"s": variables["params"]}}, "s")


@settings(max_examples=examples(6, 2), deadline=None)
@given(n=st.integers(1, 5), depth=st.integers(1, 3), reverse=st.booleans())
def test_random_depths_match_loop(n, depth, reverse):
    class Deep(nn.Module):
        @nn.compact
        def __call__(self, x):
            for _ in range(depth):
                x = x + jnp.tanh(nn.Dense(D)(x))
            return x

    variables = Loop(Deep, n, reverse=reverse).init(jax.random.key(n), X)
    stacked = swf.from_loop(variables, "layers")
    y = Stacked(Deep, n, reverse=reverse).apply(stacked, X)
    assert_trees_close(y, Loop(Deep, n, reverse=reverse).apply(variables, X))
    assert_trees_bitwise(swf.to_loop(stacked, "layers"), variables)
    # By creation order, a reversed loop's first layer (the last one created by name) is the
    # Stack's layer 0: the same model, run forward.
    converted = swf.convert(variables, Loop(Deep, n, reverse), Stacked(Deep, n), X)
    assert_trees_close(Stacked(Deep, n).apply(converted, X), y)
    if not reverse:
        assert_trees_bitwise(converted, stacked)


DTYPES = [jnp.float32, jnp.bfloat16, jnp.int32, jnp.uint8]


@pytest.mark.slow
@settings(max_examples=20, deadline=None)
@given(
    n=st.integers(1, 5),
    leaves=st.dictionaries(
        st.sampled_from(["w", "b", "Dense_0/kernel", "norm/scale"]),
        st.tuples(st.sampled_from(DTYPES), st.lists(st.integers(1, 3), max_size=2)),
        min_size=1,
    ),
    collections=st.sampled_from([("params",), ("params", "batch_stats"), ("cache",)]),
    boxed=st.booleans(),
)
def test_random_variables_round_trip_bitwise(n, leaves, collections, boxed):
    keys = iter(jax.random.split(jax.random.key(n), n * len(leaves) * len(collections)))
    variables = {}
    for col in collections:
        tree = variables.setdefault(col, {"head": {"b": jnp.ones(2, jnp.bfloat16)}})
        for i in range(n):
            for path, (dtype, shape) in leaves.items():
                value = (10 * jax.random.normal(next(keys), shape)).astype(dtype)
                if boxed:
                    value = nn.Partitioned(value, names=(None,) * len(shape))
                node = tree.setdefault(f"block_{i}", {})
                *parents, name = path.split("/")
                for p in parents:
                    node = node.setdefault(p, {})
                node[name] = value
    stacked = swf.from_loop(variables, "stack", names="block_{}")
    for col in collections:
        assert "block_0" not in stacked[col] and "head" in stacked[col]
    assert_trees_bitwise(swf.to_loop(stacked, "stack", names="block_{}"), variables)


def test_a_pattern_of_blocks_both_ways():
    # Loop layers A, A, B, A, A, B, A (n=7, k=3): position p holds layers p, p+3, ...
    loop = {"params": {}}
    for i in range(7):
        width = 5 if i % 3 == 2 else 2
        loop["params"][f"layers_{i}"] = {"Dense_0": {"kernel": jnp.full((width,), float(i))}}
    paths = ["layers/Local_0", "layers/Local_1", "layers/Global_0"]
    stacked = swf.from_loop(loop, paths)
    position = stacked["params"]["layers"]
    assert position["Local_0"]["Dense_0"]["kernel"][:, 0].tolist() == [0, 3, 6]
    assert position["Global_0"]["Dense_0"]["kernel"].shape == (2, 5)
    layers = [loop["params"][f"layers_{i}"] for i in range(7)]
    for name, expected in zip(
        ["Local_0", "Local_1", "Global_0"], stackwise.stack_layers(layers, pattern=3)
    ):
        assert_trees_bitwise(position[name], expected)
    assert_trees_bitwise(swf.to_loop(stacked, paths), loop)


# --------------------------------------------------------------------------
# One test per defect class: each is an error that says what it found.


LOOP = {"params": {f"layers_{i}": {"w": jnp.full(2, float(i))} for i in range(3)}}


def test_a_name_without_a_placeholder_is_refused_at_once():
    # It used to search for the depth forever (no `{}`: every layer the same name).
    with pytest.raises(
        TypeError,
        match=r"`names='block'` has no `\{\}`.*every layer would get "
        r"the same name",
    ):
        swf.from_loop(LOOP, "stack", names="block")
    with pytest.raises(TypeError, match=r"`names='block'` has no `\{\}`"):
        swf.from_loop(LOOP, "stack", names="block", n=2)
    with pytest.raises(TypeError, match=r"`names='block'` has no `\{\}`"):
        swf.to_loop(swf.from_loop(LOOP, "stack"), "stack", names="block")
    with pytest.raises(TypeError, match=r"`names='layers_\{i\}'` is not a format string of one"):
        swf.from_loop(LOOP, "stack", names="layers_{i}")


def test_existing_entries_are_never_overwritten():
    taken = {"params": {**LOOP["params"], "layers": {"w": jnp.zeros(1)}}}
    with pytest.raises(
        ValueError,
        match=r"params/layers already exists; stackwise never "
        "overwrites",
    ):
        swf.from_loop(taken, "layers")
    stacked = swf.from_loop(LOOP, "layers")
    taken = {"params": {**stacked["params"], "layers_0": {"w": jnp.zeros(1)}}}
    with pytest.raises(ValueError, match=r"params/layers_0 already exists"):
        swf.to_loop(taken, "layers")
    with pytest.raises(ValueError, match=r"layers 0 and 1 are both named 'a'"):
        swf.to_loop(stacked, "layers", names=["a", "a", "b"])
    with pytest.raises(ValueError, match=r"layers 0 and 1 are both named 'same'"):
        swf.to_loop(stacked, "layers", names=lambda i: "same")


def test_absent_paths_are_errors_not_the_input_unchanged():
    with pytest.raises(ValueError, match=r"no collection has 'stack'"):
        swf.to_loop(LOOP, "stack")
    with pytest.raises(ValueError, match=r"nothing to convert.*holds 'scan'"):
        swf.from_scan(LOOP, "scan")
    with pytest.raises(ValueError, match=r"nothing to convert.*holds 'scan'"):
        swf.to_scan(LOOP, "scan")
    with pytest.raises(ValueError, match=r"found no layer: nothing is named 'block_0'"):
        swf.from_loop(LOOP, "stack", names="block_{}")
    with pytest.raises(ValueError, match="broadcast collection"):
        swf.from_scan({"params": {"w": jnp.zeros((3, 2))}}, variable_axes={"params": nn.broadcast})


def test_gaps_and_surpluses_are_errors():
    gap = {"params": {k: v for k, v in LOOP["params"].items() if k != "layers_1"}}
    with pytest.raises(
        ValueError,
        match=r"layer\(s\) 1 \('layers_1'\) missing, yet layer 2 "
        r"\('layers_2'\) is present",
    ):
        swf.from_loop(gap, "stack")
    with pytest.raises(ValueError, match=r"found 3 layers.*but n=2: layers 2\.\.2 would be left"):
        swf.from_loop(LOOP, "stack", n=2)
    partial = {**LOOP, "cache": {"layers_0": {"k": jnp.zeros(1)}}}
    with pytest.raises(
        ValueError,
        match=r"collection 'cache' has some of the 3 layers but not "
        r"layers \[1, 2\]",
    ):
        swf.from_loop(partial, "stack")


def test_mixed_dtypes_and_shapes_are_refused_not_promoted():
    mixed = {"params": {**LOOP["params"], "layers_1": {"w": jnp.ones(2, jnp.bfloat16)}}}
    with pytest.raises(
        TypeError,
        match=r"leaf params/stack\['w'\].*layers 0, 2: float32; "
        r"layer 1 \('layers_1'\): bfloat16",
    ):
        swf.from_loop(mixed, "stack")
    other = {"params": {"layers_0": {"w": jnp.zeros(2)}, "layers_1": {"v": jnp.zeros(2)}}}
    with pytest.raises(ValueError, match=r"layer 1 \('layers_1'\) holds other leaves"):
        swf.from_loop(other, "layers")
    boxes = {
        "params": {
            f"layers_{i}": {"w": nn.Partitioned(jnp.zeros(2), names=(a,))}
            for i, a in enumerate(["x", "y"])
        }
    }
    with pytest.raises(ValueError, match=r"partitioning .* in layer 1 .* but .* in layer 0"):
        swf.from_loop(boxes, "stack")


# --------------------------------------------------------------------------
# By creation order: flax's lm1b model, ported onto a Stack.


class PortedDecoder(upstream.Decoder):
    """upstream.Decoder with its loop of blocks replaced by a Stack of the same block."""

    @nn.compact
    def __call__(
        self,
        inputs,
        inputs_positions=None,
        inputs_segmentation=None,
        decoder_mask=None,
        encoder_decoder_mask=None,
    ):
        config = self.config
        output_embed = nn.Embed(
            num_embeddings=config.output_vocab_size,
            features=config.emb_dim,
            embedding_init=nn.with_logical_partitioning(
                nn.initializers.normal(stddev=1.0), ("vocab", "embed")
            ),
        )
        y = inputs.astype("int32")
        if not config.decode:
            y = upstream.shift_inputs(y, segment_ids=inputs_segmentation)
        y = output_embed(y)
        y = upstream.AddPositionEmbs(config=config, decode=config.decode, name="posembed_output")(
            y, inputs_positions=inputs_positions
        )
        y = nn.Dropout(rate=config.dropout_rate)(y, deterministic=config.deterministic)
        y = y.astype(config.dtype)
        block = functools.partial(upstream.EncoderDecoder1DBlock, config=config)
        y = swf.Stack(block, config.num_layers, name="encoderdecoderblocks")(
            y, decoder_mask=decoder_mask, encoder_decoder_mask=encoder_decoder_mask
        )
        y = nn.LayerNorm(
            dtype=config.dtype,
            name="encoderdecoder_norm",
            bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)),
            scale_init=nn.with_logical_partitioning(nn.initializers.ones, ("embed",)),
        )(y)
        return nn.Dense(
            config.output_vocab_size,
            dtype=config.dtype,
            kernel_init=nn.with_logical_partitioning(config.kernel_init, ("embed", "vocab")),
            bias_init=nn.with_logical_partitioning(config.bias_init, ("vocab",)),
            name="logitdense",
        )(y)


class PortedLM(upstream.TransformerLM):
    @nn.compact
    def __call__(self, inputs, inputs_positions=None, inputs_segmentation=None):
        config = self.config
        decoder_mask = nn.combine_masks(
            nn.make_attention_mask(inputs > 0, inputs > 0, dtype=config.dtype),
            nn.make_causal_mask(inputs, dtype=config.dtype),
        )
        logits = PortedDecoder(config=config, name="decoder")(
            inputs,
            inputs_positions=inputs_positions,
            inputs_segmentation=inputs_segmentation,
            decoder_mask=decoder_mask,
        )
        return logits.astype(config.dtype)


CONFIG = upstream.TransformerConfig(
    vocab_size=13,
    output_vocab_size=13,
    emb_dim=8,
    num_heads=2,
    num_layers=N,
    qkv_dim=8,
    mlp_dim=16,
    max_len=16,
    deterministic=True,
)
TOKENS = jnp.array([[1, 2, 3, 4, 0, 0], [5, 6, 7, 8, 9, 0]])


# Upstream builds its attention with nn.SelfAttention, which this flax deprecates.
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:SelfAttention will be deprecated:DeprecationWarning")
def test_upstream_lm1b_checkpoint_converts_in_one_call():
    loop, port = upstream.TransformerLM(CONFIG), PortedLM(CONFIG)
    loop_vars = loop.init(jax.random.key(0), TOKENS)
    variables = swf.convert(loop_vars, loop, port, TOKENS)
    assert jax.tree.structure(variables) == jax.tree.structure(port.init(jax.random.key(1), TOKENS))
    # Bitwise against the loop's names: layer i is `encoderdecoderblock_{i}`.
    loop_p, p = nn.unbox(loop_vars)["params"]["decoder"], nn.unbox(variables)["params"]["decoder"]
    for i in range(N):
        layer = jax.tree.map(lambda a, i=i: a[i], p["encoderdecoderblocks"])
        assert_trees_bitwise(layer, loop_p[f"encoderdecoderblock_{i}"])
    for name in ("Embed_0", "encoderdecoder_norm", "logitdense"):
        assert_trees_bitwise(p[name], loop_p[name])
    # The logical partitioning gains the (replicated) layer axis.
    spec = nn.get_partition_spec(variables)["params"]["decoder"]["encoderdecoderblocks"]
    assert spec["MlpBlock_0"]["Dense_0"]["kernel"] == jax.sharding.PartitionSpec(
        None, "embed", "mlp"
    )

    # Same logits and gradients; and back, bitwise, boxes included.
    def loss(model, v):
        logits = model.apply(v, TOKENS)
        return jnp.mean(jax.nn.log_softmax(logits)[..., 1]), logits

    (_, y_loop), g_loop = jax.value_and_grad(lambda v: loss(loop, v), has_aux=True)(loop_vars)
    (_, y_port), g_port = jax.value_and_grad(lambda v: loss(port, v), has_aux=True)(variables)
    assert_trees_close(y_port, y_loop)
    assert_trees_close(nn.unbox(swf.convert(g_port, port, loop, TOKENS)), nn.unbox(g_loop))
    assert_trees_bitwise(swf.convert(variables, port, loop, TOKENS), loop_vars)
    # Unboxed variables convert to unboxed ones.
    plain = swf.convert(nn.unbox(loop_vars), loop, port, TOKENS)
    assert_trees_bitwise(plain, nn.unbox(variables))


class SiblingLoop(nn.Module):
    """A loop body that builds its modules in the parent: Dense_{i}, LayerNorm_{i}, ..."""

    @nn.compact
    def __call__(self, x):
        for _ in range(N):
            x = x + nn.Dense(D)(nn.LayerNorm()(x))
        return nn.LayerNorm()(x)


class Body(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + nn.Dense(D)(nn.LayerNorm()(x))


class SiblingPort(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.LayerNorm()(swf.Stack(Body, N, name="layers")(x))


def test_a_loop_body_of_sibling_modules_converts():
    loop_vars = SiblingLoop().init(jax.random.key(0), X)
    variables = swf.convert(loop_vars, SiblingLoop(), SiblingPort(), X)
    params, loop_p = variables["params"], loop_vars["params"]
    for i in range(N):
        assert_trees_bitwise(
            jax.tree.map(lambda a, i=i: a[i], params["layers"]["Dense_0"]), loop_p[f"Dense_{i}"]
        )
        assert_trees_bitwise(
            jax.tree.map(lambda a, i=i: a[i], params["layers"]["LayerNorm_0"]),
            loop_p[f"LayerNorm_{i}"],
        )
    assert_trees_bitwise(params["LayerNorm_0"], loop_p[f"LayerNorm_{N}"])
    assert_trees_close(SiblingPort().apply(variables, X), SiblingLoop().apply(loop_vars, X))


def test_models_that_do_not_correspond_are_refused():
    loop_vars = SiblingLoop().init(jax.random.key(0), X)

    class Swapped(nn.Module):  # LayerNorm after Dense: another model
        @nn.compact
        def __call__(self, x):
            return x + nn.LayerNorm()(nn.Dense(D)(x))

    class Other(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.LayerNorm()(swf.Stack(Swapped, N)(x))

    with pytest.raises(
        ValueError,
        match=r"(?s)\(params\): the two models do not correspond.*"
        r"first differ at #0.*source: params/LayerNorm_0/bias: LayerNorm 'bias'.*"
        r"target: params/Stack_0/Dense_0/bias \(layer 0\): Dense 'bias'",
    ):
        swf.convert(loop_vars, SiblingLoop(), Other(), X)
    with pytest.raises(
        ValueError,
        match=r"(?s)not those of the source model.*missing: "
        r"params/Dense_0/bias",
    ):
        swf.convert(
            {"params": {"Dense_0": {"kernel": jnp.zeros((D, D))}}}, SiblingLoop(), SiblingPort(), X
        )
    with pytest.raises(TypeError, match="must be a linen `nn.Module`"):
        swf.convert(loop_vars, SiblingLoop(), lambda x: x, X)


def test_a_pattern_position_missing_from_the_traced_init_is_named():
    # (no model reaches this through `convert`: every position of a pattern Stack runs while
    # init is traced. The check guards the bookkeeping of `_correspond._Pattern` itself.)
    from stackwise.flax import _correspond

    class Local(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(2)(x)

    class Global(Local):
        pass

    stack = swf.Stack([Local(), Global()], 4)
    pattern = _correspond._Pattern(stack, (0,), "stackwise.flax.convert")
    pattern.record(0, (), "Local")
    with pytest.raises(ValueError, match=r"stackwise.flax.convert: the source model's pattern "
                       r"Stack at model/layers did not run position 1 \(Global_0\) while init "
                       r"was traced"):
        pattern.modules(("model", "layers"), "source")
    pattern.record(1, (), "Global")
    assert sorted(pattern.modules(("model", "layers"), "source")) == [
        ("model", "layers", "Global_0"), ("model", "layers", "Local_0")]
