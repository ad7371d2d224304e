"""stackwise.haiku's conversions: by name (`from_loop`/`to_loop`, `hk.layer_stack`) and by
creation order (`convert`, on dm-haiku's example transformer), exact or a clear error."""

from __future__ import annotations

import dataclasses

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _references import Counted, loop_of
from _trees import assert_trees_bitwise, assert_trees_close
from hypothesis import given, settings
from hypothesis import strategies as st
from upstream import haiku_transformer as upstream

import stackwise
import stackwise.haiku as swh

D = 4
KEY = jax.random.key(0)


def haiku_name(name, i):
    """How Haiku names the i-th module made with one name: the reference, written out."""
    return name if i == 0 else f"{name}_{i}"


class Block(hk.Module):
    def __call__(self, x):
        return x + jnp.tanh(hk.Linear(D)(jnp.sin(x)))


X = jax.random.normal(jax.random.key(1), (3, D))


# --------------------------------------------------------------------------
# By name.


def test_conversions_round_trip_exactly():
    n = 3
    stacked = hk.transform_with_state(lambda x: swh.Stack(Counted, n)(x, is_training=True))
    loop = hk.transform_with_state(loop_of(Counted, n))
    for tree in stacked.init(KEY, X):  # params, then state
        loop_tree = swh.to_loop(tree, "stack/counted", "counted")
        assert_trees_bitwise(swh.from_loop(loop_tree, "stack/counted", "counted", n=n), tree)
        ls_tree = swh.to_layer_stack(tree, "stack")
        assert_trees_bitwise(swh.from_layer_stack(ls_tree, "stack"), tree)
    for loop_tree in loop.init(KEY, X, is_training=True):
        tree = swh.from_loop(loop_tree, "stack/counted", "counted")
        assert_trees_bitwise(swh.to_loop(tree, "stack/counted", "counted"), loop_tree)
    # Explicit names, and modules outside the block kept as they are.
    names = ["enc/first", "enc/second", "enc/third"]
    tree = {
        "stack/counted/linear": {"w": jnp.arange(6.0).reshape(3, 2)},
        "head": {"b": jnp.ones(1)},
    }
    loop_tree = swh.to_loop(tree, "stack/counted", names)
    assert sorted(loop_tree) == [
        "enc/first/linear",
        "enc/second/linear",
        "enc/third/linear",
        "head",
    ]
    assert_trees_bitwise(loop_tree["enc/second/linear"]["w"], jnp.array([2.0, 3.0]))
    assert_trees_bitwise(swh.from_loop(loop_tree, "stack/counted", names), tree)


def test_loop_checkpoint_loads_into_a_stack():
    n = 3
    loop = hk.transform(loop_of(Block, n))
    stacked = hk.transform(lambda x: swh.Stack(Block, n)(x))
    loop_params = loop.init(KEY, X)
    params = swh.from_loop(loop_params, "stack/block", "block")
    assert_trees_close(stacked.apply(params, None, X), loop.apply(loop_params, None, X))


NAMING = {
    "plain": ("block", lambda i: haiku_name("block", i)),
    "format": ("layer_{}", lambda i: f"layer_{i}"),
    "function": (lambda i: f"enc/{i}", lambda i: f"enc/{i}"),
}
DTYPES = [jnp.float32, jnp.bfloat16, jnp.int32, jnp.uint8]


@st.composite
def loop_trees(draw):
    n = draw(st.integers(1, 5))
    naming = draw(st.sampled_from(sorted(NAMING)))
    modules = draw(
        st.lists(
            st.sampled_from(["", "/linear", "/norm", "/mlp/~/linear_1"]),
            min_size=1,
            max_size=3,
            unique=True,
        )
    )
    specs = {
        (rest, p): (
            draw(st.sampled_from(DTYPES)),
            tuple(draw(st.lists(st.integers(1, 3), max_size=2))),
        )
        for rest in modules
        for p in draw(st.lists(st.sampled_from("wbs"), min_size=1, max_size=2, unique=True))
    }
    seed = draw(st.integers(0, 2**16))
    return n, naming, specs, seed


@pytest.mark.slow
@settings(max_examples=25, deadline=None)
@given(case=loop_trees(), as_list=st.booleans())
def test_random_loops_round_trip_bitwise(case, as_list):
    n, naming, specs, seed = case
    names, name_of = NAMING[naming]
    keys = iter(jax.random.split(jax.random.key(seed), n * len(specs)))
    tree = {"head": {"b": jnp.ones(2, jnp.bfloat16)}}
    for i in range(n):
        for (rest, p), (dtype, shape) in specs.items():
            value = (10 * jax.random.normal(next(keys), shape)).astype(dtype)
            tree.setdefault(name_of(i) + rest, {})[p] = value
    if as_list:
        names = [name_of(i) for i in range(n)]
    stacked = swh.from_loop(tree, "model/stack/block", names)
    assert stacked["head"] is not tree["head"] or stacked["head"] == tree["head"]
    for (rest, p), (dtype, shape) in specs.items():
        leaf = stacked["model/stack/block" + rest][p]
        assert leaf.dtype == dtype and leaf.shape == (n, *shape)
        assert_trees_bitwise(leaf[n - 1], tree[name_of(n - 1) + rest][p])
    assert_trees_bitwise(swh.to_loop(stacked, "model/stack/block", names), tree)


def test_a_pattern_of_blocks_both_ways():
    # A loop of blocks A, A, B, A, A, B, A (n=7, k=3), named as the loop names them.
    kinds = ["local", "local", "global"]
    counts = {"local": 0, "global": 0}
    tree, names = {}, []
    for i in range(7):
        kind = kinds[i % 3]
        name = haiku_name(f"{kind}_block", counts[kind])
        counts[kind] += 1
        names.append(name)
        width = 2 if kind == "local" else 5
        tree[name + "/linear"] = {"w": jnp.full((width,), i, jnp.float32)}
    paths = ["stack/local_block", "stack/local_block_1", "stack/global_block"]
    stacked = swh.from_loop(tree, paths, names)
    assert stacked["stack/local_block/linear"]["w"][:, 0].tolist() == [0, 3, 6]
    assert stacked["stack/local_block_1/linear"]["w"][:, 0].tolist() == [1, 4]
    assert stacked["stack/global_block/linear"]["w"].shape == (2, 5)
    per_layer = [{"w": tree[name + "/linear"]["w"]} for name in names]
    expected = stackwise.stack_layers(per_layer, pattern=3)
    for path, position in zip(paths, expected):
        assert_trees_bitwise(stacked[path + "/linear"], position)
    assert_trees_bitwise(swh.to_loop(stacked, paths, names), tree)
    with pytest.raises(ValueError, match=r"hold \[3, 1, 2\] layers"):
        swh.to_loop(
            {**stacked, "stack/local_block_1/linear": {"w": jnp.zeros((1, 2))}}, paths, names
        )


# --------------------------------------------------------------------------
# One test per defect class: each is an error that says what it found.


LOOP = {
    f"block{s}/linear": {"w": jnp.full((2,), i, jnp.float32)}
    for i, s in enumerate(["", "_1", "_2"])
}


def test_more_layers_than_n_is_an_error_not_a_shallower_model():
    with pytest.raises(
        ValueError,
        match=r"found 3 layers \('block' \.\.\. 'block_2'\) but n=2: "
        r"layers 2\.\.2 would be left behind",
    ):
        swh.from_loop(LOOP, "stack/block", "block", n=2)
    with pytest.raises(ValueError, match=r"n=4 asks for layers 0\.\.3, but only 3 are present"):
        swh.from_loop(LOOP, "stack/block", "block", n=4)


def test_a_gap_names_the_missing_layer():
    gap = {k: v for k, v in LOOP.items() if not k.startswith("block_1")}
    with pytest.raises(
        ValueError,
        match=r"layer\(s\) 1 \('block_1'\) missing, yet layer 2 "
        r"\('block_2'\) is present",
    ):
        swh.from_loop(gap, "stack/block", "block")


def test_two_layers_of_one_name_are_refused():
    stacked = swh.from_loop(LOOP, "stack/block", "block")
    with pytest.raises(ValueError, match=r"layers 0 and 1 are both named 'a'"):
        swh.to_loop(stacked, "stack/block", ["a", "a", "b"])
    with pytest.raises(ValueError, match=r"layer 1's name 'a/b' lies inside layer 0's 'a'"):
        swh.to_loop(stacked, "stack/block", ["a", "a/b", "c"])
    with pytest.raises(ValueError, match=r"3 layers but 2 `names`"):
        swh.to_loop(stacked, "stack/block", ["a", "b"])


def test_existing_entries_are_never_overwritten():
    with pytest.raises(ValueError, match=r"\['stack/block/linear'\] already exist"):
        swh.from_loop({**LOOP, "stack/block/linear": {"w": jnp.zeros(1)}}, "stack/block", "block")
    stacked = swh.from_loop(LOOP, "stack/block", "block")
    with pytest.raises(ValueError, match=r"\['block_1/linear'\] already exist"):
        swh.to_loop({**stacked, "block_1/linear": {"w": jnp.zeros(1)}}, "stack/block", "block")
    with pytest.raises(ValueError, match=r"already exist"):
        swh.from_layer_stack({"x/a": {"w": 1}, "stack/a": {"w": 1}}, "stack", "x")


def test_mixed_dtypes_are_refused_not_promoted():
    mixed = {**LOOP, "block_1/linear": {"w": jnp.ones(2, jnp.bfloat16)}}
    with pytest.raises(
        TypeError,
        match=r"leaf stack/block/linear/w .*layers 0, 2: float32; "
        r"layer 1 \('block_1'\): bfloat16",
    ):
        swh.from_loop(mixed, "stack/block", "block")
    wide = {**LOOP, "block_2/linear": {"w": jnp.ones(3)}}
    with pytest.raises(
        ValueError,
        match=r"leaf stack/block/linear/w has a different shape.*"
        r"layer 2 \('block_2'\): \(3,\)",
    ):
        swh.from_loop(wide, "stack/block", "block")
    other = {**LOOP, "block_1/linear": {"v": jnp.ones(2)}}
    with pytest.raises(ValueError, match=r"layer 1 \('block_1'\) holds other leaves.*missing"):
        swh.from_loop(other, "stack/block", "block")


def test_absent_paths_and_ragged_depths_are_errors():
    tree = {"stack/block/linear": {"w": jnp.zeros((3, 2)), "b": jnp.zeros((2,))}}
    with pytest.raises(ValueError, match=r"no module named 'stack/blk'.*'stack/block/linear'"):
        swh.to_loop(tree, "stack/blk", "block")
    # The depth comes from the leaves: a leaf without it is listed, no `n` is asked for.
    with pytest.raises(
        ValueError,
        match=r"(?s)same leading layer axis.*"
        r"stack/block/linear/b: shape \(2,\)",
    ) as error:
        swh.to_loop(tree, "stack/block", "block")
    assert "`n`" not in str(error.value)
    with pytest.raises(ValueError, match=r"found no layer: nothing is named 'blk'"):
        swh.from_loop(LOOP, "stack/block", "blk")
    with pytest.raises(ValueError, match="no module named 'stack'"):
        swh.to_layer_stack(LOOP, "stack")
    with pytest.raises(TypeError, match="`names` must be a format string"):
        swh.from_loop(LOOP, "stack/block", 3)
    with pytest.raises(TypeError, match="`n` must be None"):
        swh.from_loop(LOOP, "stack/block", "block", n=2.0)


# --------------------------------------------------------------------------
# By creation order: dm-haiku's example transformer, ported onto a Stack.


@dataclasses.dataclass
class PortedTransformer(upstream.Transformer):
    """upstream.Transformer with its loop body moved, unchanged, into a Stack's block."""

    def __call__(self, embeddings, mask):
        initializer = hk.initializers.VarianceScaling(2 / self.num_layers)
        _, seq_len, model_size = embeddings.shape
        mask = mask[:, None, None, :]
        causal_mask = np.tril(np.ones((1, 1, seq_len, seq_len)))
        mask = mask * causal_mask

        def layer(h, mask):  # the loop's body, as upstream wrote it
            attn_block = hk.MultiHeadAttention(
                num_heads=self.num_heads,
                key_size=self.attn_size,
                model_size=model_size,
                w_init=initializer,
            )
            h_norm = upstream._layer_norm(h)
            h_attn = attn_block(h_norm, h_norm, h_norm, mask=mask)
            h_attn = hk.dropout(hk.next_rng_key(), self.dropout_rate, h_attn)
            h = h + h_attn
            dense_block = hk.Sequential(
                [
                    hk.Linear(self.widening_factor * model_size, w_init=initializer),
                    jax.nn.gelu,
                    hk.Linear(model_size, w_init=initializer),
                ]
            )
            h_norm = upstream._layer_norm(h)
            h_dense = dense_block(h_norm)
            h_dense = hk.dropout(hk.next_rng_key(), self.dropout_rate, h_dense)
            return h + h_dense

        h = swh.Stack(layer, self.num_layers)(embeddings, mask)
        return upstream._layer_norm(h)


N_LAYERS = 3
TOKENS = jnp.array([[1, 2, 3, 4, 0, 0], [5, 6, 7, 8, 9, 0]])


def language_model(transformer):
    def forward(tokens):
        t = transformer(
            num_heads=2, num_layers=N_LAYERS, attn_size=4, dropout_rate=0.0, name="transformer"
        )
        return upstream.LanguageModel(t, model_size=8, vocab_size=11, pad_token=0)(tokens)

    return hk.transform(forward)


# Upstream adds [T, D] position embeddings to [B, T, D] token embeddings: rank promotion,
# which the suite's strict setting refuses; allowed for the upstream model only.
@pytest.fixture
def rank_promotion_allowed():
    with jax.numpy_rank_promotion("allow"):
        yield


@pytest.mark.slow
@pytest.mark.usefixtures("rank_promotion_allowed")
def test_upstream_transformer_checkpoint_converts_in_one_call():
    loop, port = language_model(upstream.Transformer), language_model(PortedTransformer)
    loop_params = loop.init(KEY, TOKENS)
    params = swh.convert(loop_params, loop, port, TOKENS)
    assert jax.tree.structure(params) == jax.tree.structure(port.init(KEY, TOKENS))

    # Bitwise, against the loop's names worked out by hand: layer i owns layer_norm_{2i},
    # layer_norm_{2i+1}, linear_{2i}, linear_{2i+1} and multi_head_attention_{i}.
    def loop_leaf(module, p, i):
        base, j = module
        return loop_params[f"transformer/{haiku_name(base, j(i))}"][p]

    by_hand = {
        "layer_norm": ("layer_norm", lambda i: 2 * i),
        "layer_norm_1": ("layer_norm", lambda i: 2 * i + 1),
        "linear": ("linear", lambda i: 2 * i),
        "linear_1": ("linear", lambda i: 2 * i + 1),
    }
    for name, module in by_hand.items():
        for p, leaf in params[f"transformer/stack/{name}"].items():
            for i in range(N_LAYERS):
                assert_trees_bitwise(leaf[i], loop_leaf(module, p, i))
    for sub in ("query", "key", "value", "linear"):
        for p, leaf in params[f"transformer/stack/multi_head_attention/{sub}"].items():
            for i in range(N_LAYERS):
                name = haiku_name("transformer/multi_head_attention", i) + f"/{sub}"
                assert_trees_bitwise(leaf[i], loop_params[name][p])
    final = haiku_name("transformer/layer_norm", 2 * N_LAYERS)
    assert_trees_bitwise(params["transformer/layer_norm"], loop_params[final])
    for name in ("language_model", "language_model/embed", "language_model/linear"):
        assert_trees_bitwise(params[name], loop_params[name])

    # Same logits and gradients; and back, bitwise.
    rng = jax.random.key(2)

    def loss(apply, p):
        logits = apply(p, rng, TOKENS)
        return jnp.mean(jax.nn.log_softmax(logits)[..., 1]), logits

    (l_loop, y_loop), g_loop = jax.value_and_grad(lambda p: loss(loop.apply, p), has_aux=True)(
        loop_params
    )
    (l_port, y_port), g_port = jax.value_and_grad(lambda p: loss(port.apply, p), has_aux=True)(
        params
    )
    assert_trees_close(y_port, y_loop)
    # The key projection's bias shifts every score of a query alike, which softmax ignores: its
    # gradient is 0, and what the two programs compute there is rounding noise.
    zero = ("/key']['b']",)
    assert_trees_close(swh.convert(g_port, port, loop, TOKENS), g_loop, zero=zero)
    assert_trees_bitwise(swh.convert(params, port, loop, TOKENS), loop_params)


def test_convert_moves_params_and_state_and_layer_stack():
    n, kw = 3, {"is_training": True}
    loop = hk.transform_with_state(loop_of(Counted, n))
    stacked = hk.transform_with_state(lambda x, **kw: swh.Stack(Counted, n)(x, **kw))
    layer_stack = hk.transform_with_state(
        lambda x, **kw: hk.layer_stack(n)(lambda x: Counted()(x, **kw))(x)
    )
    loop_tree = loop.init(KEY, X, **kw)
    tree = swh.convert(loop_tree, loop, stacked, X, **kw)
    by_name = tuple(swh.from_loop(t, "stack/counted", "counted") for t in loop_tree)
    assert_trees_bitwise(tree, by_name)
    state = swh.convert(loop_tree[1], loop, stacked, X, **kw)  # state alone: told by its names
    assert_trees_bitwise(state, tree[1])
    ls = swh.convert(tree, stacked, layer_stack, X, **kw)
    assert sorted(ls[0])[0].startswith("__layer_stack_no_per_layer/counted")
    assert_trees_bitwise(ls, tuple(swh.to_layer_stack(t, "stack") for t in tree))
    assert_trees_bitwise(swh.convert(ls, layer_stack, loop, X, **kw), loop_tree)


def test_models_that_do_not_correspond_are_refused():
    loop = hk.transform(loop_of(Block, 3))

    def other(x):  # the block's Linear after a LayerNorm the loop does not have
        def body(x):
            return x + hk.Linear(D)(hk.LayerNorm(-1, True, True)(x))

        return swh.Stack(body, 3)(x)

    params = loop.init(KEY, X)
    with pytest.raises(
        ValueError,
        match=r"(?s)the source has 6 per-layer leaves and the target "
        r"12.*first differ at #0.*source: block/linear/b: Linear 'b'.*"
        r"target: stack/layer_norm/offset \(layer 0\): LayerNorm 'offset'",
    ):
        swh.convert(params, loop, hk.transform(other), X)
    deeper = hk.transform(lambda x: swh.Stack(Block, 4)(x))
    with pytest.raises(ValueError, match=r"the source has 6 per-layer leaves and the target 8"):
        swh.convert(params, loop, deeper, X)
    wrong = {**params, "block_1/linear": {"w": params["block_1/linear"]["w"]}}
    with pytest.raises(
        ValueError,
        match=r"(?s)not those of the source model.*missing: "
        r"block_1/linear/b",
    ):
        swh.convert(wrong, loop, deeper, X)
    with pytest.raises(TypeError, match="must be an `hk.transform`"):
        swh.convert(params, loop, 3, X)
