"""`stackwise.flax.Stack` against a Python loop of the same blocks and against `nn.scan`."""

from __future__ import annotations

import functools

import flax.errors
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _references import Loop
from _trees import assert_trees_close, assert_trees_equal

import stackwise
import stackwise.flax
from stackwise.bench import program_fingerprint

D = 4
N = 3


# --------------------------------------------------------------------------
# Blocks.


class Block(nn.Module):
    """Params, a sown value, a custom collection, a positional and a static keyword arg."""

    features: int = D
    scan_out: bool = False  # nn.scan's signature: return (carry, ys)

    @nn.compact
    def __call__(self, x, scale, *, train: bool = False):
        if not isinstance(train, bool):  # static values must stay static
            raise TypeError(f"train should be a Python bool, got {train!r}")
        h = nn.Dense(2 * self.features)(x)
        self.sow("intermediates", "h", h)
        calls = self.variable("counters", "calls", lambda: jnp.zeros((), jnp.int32))
        if not self.is_initializing():
            calls.value += 1
        y = x + scale * jnp.tanh(nn.Dense(self.features)(jnp.tanh(h)))
        if train:
            y = y * 0.5
        return (y, None) if self.scan_out else y


class BNBlock(nn.Module):
    scan_out: bool = False

    @nn.compact
    def __call__(self, x, train: bool = True):
        # No bias before BatchNorm: its gradient is zero up to rounding.
        h = nn.Dense(D, use_bias=False)(x)
        y = x + jnp.tanh(nn.BatchNorm(use_running_average=not train)(h))
        return (y, None) if self.scan_out else y


class Stacked(nn.Module):
    block: type
    n: int
    options: tuple = ()

    @nn.compact
    def __call__(self, x, *args, **kwargs):
        stack = stackwise.flax.Stack(self.block, self.n, name="layers", **dict(self.options))
        return stack(x, *args, **kwargs)


def to_stack(variables):
    return stackwise.flax.from_loop(variables, "layers")


def to_loop(variables):
    return stackwise.flax.to_loop(variables, "layers")


X = jnp.linspace(-1.0, 1.0, 2 * D).reshape(2, D)

# --------------------------------------------------------------------------
# Against the loop: outputs, gradients, every collection.

OPTIONS = {
    "plain": {},
    "remat": {"remat": True},
    "unroll2-reverse": {"unroll": 2, "reverse": True},
    "python-loop-remat": {"unroll": True, "remat": True},
    "nested": {"nested": True, "n": 5},
    "nested2-remat-reverse": {"nested": 2, "remat": True, "reverse": True, "n": 5},
    "policy": {"remat": jax.checkpoint_policies.dots_with_no_batch_dims_saveable},
}


@pytest.mark.parametrize("name", OPTIONS)
def test_matches_loop(name):
    options = dict(OPTIONS[name])
    n = options.pop("n", N)
    loop = Loop(Block, n, reverse=options.get("reverse", False))
    stacked = Stacked(Block, n, tuple(options.items()))
    variables = loop.init(jax.random.key(1), X, 0.7, train=False)
    converted = to_stack(variables)

    def loss(params, model, variables):
        y, _ = model.apply({**variables, "params": params}, X, 0.7, train=True, mutable="counters")
        return jnp.sum(jnp.sin(y)), y

    (l_ref, y_ref), g_ref = jax.value_and_grad(loss, has_aux=True)(
        variables["params"], loop, variables
    )
    (value, y), g = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)(
        converted["params"], stacked, converted
    )
    assert_trees_close(value, l_ref)
    assert_trees_close(y, y_ref)
    assert_trees_close(g, to_stack({"params": g_ref})["params"])


def test_init_layout_matches_loop_and_nn_scan():
    stack_vars = Stacked(Block, N).init(jax.random.key(0), X, 0.5)
    loop_vars = jax.eval_shape(Loop(Block, N).init, jax.random.key(0), X, 0.5)
    scan_vars = jax.eval_shape(
        ScanModel(functools.partial(Block, scan_out=True), N).init, jax.random.key(0), X, 0.5
    )
    shapes = lambda v: jax.tree.map(jnp.shape, v)  # noqa: E731
    assert shapes(stack_vars) == shapes(scan_vars)
    stacked_loop_shapes = {
        c: {"layers": jax.tree.map(lambda a: (N, *a.shape), t["layers_0"])}
        for c, t in loop_vars.items()
    }
    assert shapes(stack_vars) == stacked_loop_shapes
    assert stack_vars["params"]["layers"]["Dense_0"]["kernel"].shape == (N, D, 2 * D)
    assert sorted(stack_vars) == ["counters", "params"]  # init keeps no intermediates
    # Each layer has its own initial params.
    k = stack_vars["params"]["layers"]["Dense_0"]["kernel"]
    assert not np.allclose(k[0], k[1])


@pytest.mark.parametrize("unroll", [1, True])
def test_every_collection_matches_loop(unroll):
    loop, stacked = Loop(Block, N), Stacked(Block, N, (("unroll", unroll),))
    variables = loop.init(jax.random.key(2), X, 0.3)
    mutable = ["counters", "intermediates"]
    y_ref, new_ref = loop.apply(variables, X, 0.3, mutable=mutable)
    y, new = stacked.apply(to_stack(variables), X, 0.3, mutable=mutable)
    assert_trees_close(y, y_ref)
    assert_trees_close(new, to_stack(new_ref))
    assert new["counters"]["layers"]["calls"].tolist() == [1] * N
    assert new["intermediates"]["layers"]["h"][0].shape == (N, 2, 2 * D)
    # A second step from the updated state.
    _, again = stacked.apply({**to_stack(variables), **new}, X, 0.3, mutable="counters")
    assert again["counters"]["layers"]["calls"].tolist() == [2] * N


def test_mutability_follows_the_caller():
    stacked = Stacked(Block, N)
    variables = stacked.init(jax.random.key(0), X, 1.0)
    # Only the listed collection comes back; the sow is dropped, as in a loop.
    _, new = stacked.apply(variables, X, 1.0, mutable=["counters"])
    assert sorted(new) == ["counters"]
    # Nothing mutable: the block's update of `counters` is a Flax error, as in a loop.
    with pytest.raises(flax.errors.ModifyScopeVariableError, match="counters"):
        stacked.apply(variables, X, 1.0)
    with pytest.raises(flax.errors.ModifyScopeVariableError, match="counters"):
        Loop(Block, N).apply(to_loop(variables), X, 1.0)


@pytest.mark.slow
@pytest.mark.parametrize("remat", [False, True])
def test_batch_norm_matches_loop(remat):
    loop, stacked = Loop(BNBlock, N), Stacked(BNBlock, N, (("remat", remat),))
    x = jax.random.normal(jax.random.key(0), (16, D))  # a batch that BatchNorm's grad is stable on
    variables = loop.init(jax.random.key(3), x)
    converted = to_stack(variables)
    assert converted["batch_stats"]["layers"]["BatchNorm_0"]["mean"].shape == (N, D)

    def step(model, variables):
        def loss(params):
            y, new = model.apply(
                {**variables, "params": params}, x * 3.0 + 1.0, mutable="batch_stats"
            )
            return jnp.sum(y**2), new

        return jax.grad(loss, has_aux=True)(variables["params"])

    g_ref, new_ref = step(loop, variables)
    g, new = jax.jit(step, static_argnums=0)(stacked, converted)
    assert_trees_close(g, to_stack({"params": g_ref})["params"])
    assert_trees_close(new, to_stack(new_ref))
    # Eval mode with immutable variables: only the output.
    y = stacked.apply({**converted, **new}, x, False)
    y_ref = loop.apply({**variables, **new_ref}, x, False)
    assert_trees_close(y, y_ref)


def test_keyword_arguments_reach_every_layer_and_stay_static():
    class Affine(nn.Module):
        @nn.compact
        def __call__(self, x, *, shift, mode: str):
            assert isinstance(mode, str)  # test block: a traced str would fail here
            w = self.param("w", nn.initializers.normal(1.0), (1, D))
            return x * w + (shift if mode == "add" else -shift)

    loop, stacked = Loop(Affine, N), Stacked(Affine, N)
    variables = loop.init(jax.random.key(0), X, shift=0.5, mode="add")
    for mode in ("add", "sub"):
        y = jax.jit(lambda v, s, mode=mode: stacked.apply(v, X, shift=s, mode=mode))(
            to_stack(variables), jnp.float32(0.5)
        )
        assert_trees_close(y, loop.apply(variables, X, shift=0.5, mode=mode))


def test_per_layer_inputs_outputs_and_index():
    class Gated(nn.Module):
        @nn.compact
        def __call__(self, x, gate):
            i = stackwise.flax.layer_index()
            self.sow("intermediates", "index", i)
            return x * gate + i, x.sum()

    gates = jnp.array([2.0, 3.0, 5.0])
    for reverse in (False, True):
        stack = stackwise.flax.Stack(Gated, N, has_aux=True, reverse=reverse)
        (y, sums), state = stack.apply(
            {}, jnp.ones(()), stackwise.per_layer(gates), mutable="intermediates"
        )
        x, ref_sums = jnp.ones(()), [None] * N
        for i in reversed(range(N)) if reverse else range(N):
            ref_sums[i] = x
            x = x * gates[i] + i
        np.testing.assert_allclose(y, x)
        np.testing.assert_allclose(sums, jnp.stack(ref_sums))
        assert state["intermediates"]["index"][0].tolist() == [0, 1, 2]


def test_block_forms_class_partial_and_template():
    class Parent(nn.Module):
        form: str

        @nn.compact
        def __call__(self, x):
            if self.form == "partial":
                block = functools.partial(nn.Dense, features=D)
            else:  # created here, in the parent's compact method
                block = nn.Dense(features=D, use_bias=False)
            return stackwise.flax.Stack(block, N)(x)

    for form in ("partial", "template"):
        variables = Parent(form).init(jax.random.key(0), X)
        # The template is only a template: no variables outside the Stack.
        assert list(variables["params"]) == ["Stack_0"]
        kernel = variables["params"]["Stack_0"]["kernel"]
        assert kernel.shape == (N, D, D)
        ref = X
        for i in range(N):
            bias = variables["params"]["Stack_0"].get("bias", jnp.zeros((N, D)))
            ref = ref @ kernel[i] + bias[i][None]
        assert_trees_close(Parent(form).apply(variables, X), ref)


# --------------------------------------------------------------------------
# RNG streams.


class Noisy(nn.Module):
    @nn.compact
    def __call__(self, x):
        y = nn.Dropout(0.5, deterministic=False)(x)
        noise = jax.random.uniform(self.make_rng("noise"), x.shape)
        self.sow("intermediates", "mask", y != 0)
        self.sow("intermediates", "noise", noise)
        return y + noise


@pytest.mark.slow
def test_rng_streams_are_split_per_layer_and_deterministic():
    stack = stackwise.flax.Stack(Noisy, 4)
    x = jnp.ones((64,))

    def run(key, **options):
        k1, k2 = jax.random.split(key)
        model = stackwise.flax.Stack(Noisy, 4, **options)
        return model.apply({}, x, rngs={"dropout": k1, "noise": k2}, mutable="intermediates")

    y, s = run(jax.random.key(0))
    masks, noise = s["intermediates"]["mask"][0], s["intermediates"]["noise"][0]
    assert masks.shape == noise.shape == (4, 64)
    for i in range(4):  # every layer draws its own mask and noise
        for j in range(i):
            assert not np.array_equal(masks[i], masks[j])
            assert not np.allclose(noise[i], noise[j])
    assert 0.3 < float(masks.mean()) < 0.7
    # Deterministic in the key; the same per-layer streams whatever the schedule.
    assert_trees_equal((y, s), run(jax.random.key(0)))
    assert_trees_close((y, s), run(jax.random.key(0), unroll=True, remat=True))
    y_other, _ = run(jax.random.key(1))
    assert not np.allclose(y, y_other)
    # A stream the caller does not give is missing, as in a loop.
    with pytest.raises(flax.errors.InvalidRngError, match="noise"):
        stack.apply({}, x, rngs={"dropout": jax.random.key(0)})


def test_dropout_matches_a_loop_given_the_same_per_layer_keys():
    class Drop(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(D)(nn.Dropout(0.3, deterministic=False)(x))

    variables = stackwise.flax.Stack(Drop, N).init(jax.random.key(0), X)

    # The Stack hands layer i `split(key, n)[i]` of the key its own scope draws
    # from each stream: a per-layer loop with the same keys gives the same result.
    class Probe(nn.Module):
        @nn.compact
        def __call__(self):
            return self.make_rng("dropout")

    key = jax.random.key(7)
    stack_key = Probe().apply({}, rngs={"dropout": key})
    keys = jax.random.split(stack_key, N)
    x = X
    for i, layer in enumerate(stackwise.unstack_layers(variables["params"])):
        x = Drop().apply({"params": layer}, x, rngs={"dropout": keys[i]})
    y = stackwise.flax.Stack(Drop, N).apply(variables, X, rngs={"dropout": key})
    assert_trees_close(y, x)


# --------------------------------------------------------------------------
# Against nn.scan.


class ScanModel(nn.Module):
    block: type
    n: int
    variable_axes: tuple = ((True, 0),)

    @nn.compact
    def __call__(self, x, *args):
        scanned = nn.scan(
            self.block,
            variable_axes=dict(self.variable_axes),
            split_rngs={"params": True},
            in_axes=(nn.broadcast,) * len(args),
            length=self.n,
        )
        return scanned(name="layers")(x, *args)[0]


def test_matches_nn_scan_forward_grad_and_collections():
    scan = ScanModel(functools.partial(Block, scan_out=True), N)
    stacked = Stacked(Block, N)
    variables = scan.init(jax.random.key(4), X, 0.9)
    converted = stackwise.flax.from_scan(variables)
    mutable = ["counters", "intermediates"]

    def run(model, variables):
        def loss(params):
            y, new = model.apply({**variables, "params": params}, X, 0.9, mutable=mutable)
            return jnp.sum(jnp.sin(y)), (y, new)

        return jax.grad(loss, has_aux=True)(variables["params"])

    g_ref, (y_ref, new_ref) = run(scan, variables)
    g, (y, new) = run(stacked, converted)
    assert_trees_close(y, y_ref)
    assert_trees_close(g, g_ref)
    assert_trees_close(new, new_ref)


def test_with_its_collections_it_compiles_to_the_program_of_nn_scan():
    # With remat off, jit(grad) of a Stack is nn.scan's program up to names, sown values
    # and counters included: the benchmark's step-time parity rests on this.
    scan = ScanModel(functools.partial(Block, scan_out=True), N)
    variables = scan.init(jax.random.key(4), X, 0.9)

    def program(model, variables):
        def loss(params):
            y, _ = model.apply({**variables, "params": params}, X, 0.9,
                               mutable=["counters", "intermediates"])
            return jnp.sum(jnp.sin(y))

        compiled = jax.jit(jax.grad(loss)).lower(variables["params"]).compile()
        return program_fingerprint(compiled.as_text())

    stacked = program(Stacked(Block, N, (("remat", False),)), stackwise.flax.from_scan(variables))
    assert stacked == program(scan, variables)


def test_batch_norm_matches_nn_scan_with_other_variable_axes():
    axes = (("params", 1), ("batch_stats", 0))
    scan = ScanModel(functools.partial(BNBlock, scan_out=True), N, axes)
    variables = scan.init(jax.random.key(5), X, True)
    assert variables["params"]["layers"]["Dense_0"]["kernel"].shape == (D, N, D)
    converted = stackwise.flax.from_scan(variables, "layers", variable_axes=dict(axes))
    y_ref, new_ref = scan.apply(variables, X, True, mutable="batch_stats")
    y, new = Stacked(BNBlock, N).apply(converted, X, True, mutable="batch_stats")
    assert_trees_close(y, y_ref)
    assert_trees_close(new, stackwise.flax.from_scan(new_ref, "layers", variable_axes=dict(axes)))
    back = stackwise.flax.to_scan(converted, "layers", variable_axes=dict(axes))
    assert_trees_equal(back, variables)


# --------------------------------------------------------------------------
# Autoregressive decoding with a stacked KV cache.


class Attention(nn.Module):
    decode: bool = False

    @nn.compact
    def __call__(self, x, mask=None):
        attn = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=8, decode=self.decode)
        return x + attn(x, mask=mask)


def test_decoding_token_by_token_matches_the_full_forward():
    n, length = 3, 5
    x = jax.random.normal(jax.random.key(0), (2, length, D))
    decoder = stackwise.flax.Stack(functools.partial(Attention, decode=True), n)
    variables = decoder.init(jax.random.key(1), x)
    cache = variables["cache"]
    assert cache["MultiHeadDotProductAttention_0"]["cached_key"].shape == (n, 2, length, 2, 4)
    full = stackwise.flax.Stack(Attention, n).apply(
        {"params": variables["params"]}, x, nn.make_causal_mask(jnp.ones((2, length)))
    )

    @jax.jit
    def step(cache, token):
        return decoder.apply(
            {"params": variables["params"], "cache": cache}, token, mutable="cache"
        )

    outs = []
    for t in range(length):
        y, new = step(cache, x[:, t : t + 1])
        cache = new["cache"]
        outs.append(y)
    assert cache["MultiHeadDotProductAttention_0"]["cache_index"].tolist() == [length] * n
    assert_trees_close(jnp.concatenate(outs, axis=1), full)


# --------------------------------------------------------------------------
# Partitioning metadata.


class Sharded(nn.Module):
    scan_out: bool = False

    @nn.compact
    def __call__(self, x):
        w = self.param(
            "w", nn.with_partitioning(nn.initializers.normal(1.0), (None, "model")), (D, D)
        )
        init = nn.with_logical_partitioning(nn.initializers.normal(1.0), ("embed", "mlp"))
        dense = nn.Dense(D, kernel_init=init)
        y = x + jnp.tanh(dense(x @ w))
        return (y, None) if self.scan_out else y


@pytest.mark.parametrize("axis", [None, "layers"])
def test_partition_specs_gain_the_layer_axis_as_in_nn_scan(axis):
    P = jax.sharding.PartitionSpec
    stack = stackwise.flax.Stack(Sharded, N, layer_axis_name=axis)
    variables = stack.init(jax.random.key(0), X)
    specs = nn.get_partition_spec(variables)["params"]
    assert specs["w"] == P(axis, None, "model")
    assert specs["Dense_0"]["kernel"] == P(axis, "embed", "mlp")
    scan = nn.scan(
        Sharded,
        variable_axes={True: 0},
        split_rngs={"params": True},
        length=N,
        metadata_params={nn.PARTITION_NAME: axis},
    )(scan_out=True)
    scan_vars = scan.init(jax.random.key(0), X)
    assert nn.get_partition_spec(scan_vars) == nn.get_partition_spec(variables)
    assert jax.tree.map(jnp.shape, scan_vars) == jax.tree.map(jnp.shape, variables)
    # Boxed variables apply directly and match their unboxed values.
    y = stack.apply(variables, X)
    assert_trees_close(y, stack.apply(nn.unbox(variables), X))
    # The loop layout drops the layer axis from every spec, and back, exactly.
    loop = stackwise.flax.to_loop(
        {"params": {"s": variables["params"]}}, "s", layer_axis_name=axis
    )
    assert nn.get_partition_spec(loop)["params"]["layers_0"]["w"] == P(None, "model")
    back = stackwise.flax.from_loop(loop, "s", layer_axis_name=axis)
    assert_trees_equal(back, {"params": {"s": variables["params"]}})


# --------------------------------------------------------------------------


# --------------------------------------------------------------------------
# Errors.


def test_block_not_a_flax_module():
    with pytest.raises(TypeError, match=r"`block` must be a Flax linen module.*got function"):
        stackwise.flax.Stack(lambda x: x, 2)
    with pytest.raises(TypeError, match=r"got int 3"):
        stackwise.flax.Stack(3, 2)


def test_bad_n():
    with pytest.raises(ValueError, match=r"Stack\(Block, n=0\)|`n` must be at least 1, got 0"):
        stackwise.flax.Stack(Block, 0)
    with pytest.raises(TypeError, match=r"Stack\(Block, n=2.0\): `n` must be a Python int"):
        stackwise.flax.Stack(Block, 2.0)


def test_block_changing_the_carry():
    narrow = stackwise.flax.Stack(functools.partial(nn.Dense, features=3), 2)
    message = (
        r"Stack\(partial\(Dense, \.\.\.\), n=2\): a layer changed carry leaf `x` "
        r"from float32\[2, 4\] to float32\[2, 3\]"
    )
    with pytest.raises(TypeError, match=message):
        narrow.init(jax.random.key(0), X)

    class Cast(nn.Module):
        @nn.compact
        def __call__(self, x):
            return x.astype(jnp.int32)

    with pytest.raises(TypeError, match=r"Stack\(Cast, n=2\).*float32\[2, 4\] to int32\[2, 4\]"):
        stackwise.flax.Stack(Cast, 2).apply({}, X)


def test_collection_that_cannot_be_stacked():
    class Tagged(nn.Module):
        @nn.compact
        def __call__(self, x):
            self.variable("meta", "tag", lambda: "relu")
            return x

    message = r"Stack\(Tagged, n=2\): variable `meta\['tag'\]` holds a str"
    with pytest.raises(TypeError, match=message):
        stackwise.flax.Stack(Tagged, 2).init(jax.random.key(0), X)


def test_params_of_the_wrong_depth():
    stack = Stacked(Block, 4)
    variables = Stacked(Block, 3).init(jax.random.key(0), X, 1.0)
    message = r"(?s)Stack\(Block, n=4\).*\n  params\['Dense_0'\]\['bias'\]: shape \(3, 8\)"
    with pytest.raises(ValueError, match=message):
        stack.apply(variables, X, 1.0, mutable="counters")
    # The per-layer (loop) layout instead of the stacked one.
    layer0 = stackwise.unstack_layers(variables)[0]
    with pytest.raises(ValueError, match=r"from_loop"):
        stackwise.flax.Stack(Block, 4).apply(layer0, X, 1.0, mutable="counters")


def test_partition_name_mismatch():
    named = stackwise.flax.Stack(Sharded, N, layer_axis_name="layers")
    variables = named.init(jax.random.key(0), X)
    message = (
        r"partitioning of `params\['Dense_0'\]\['kernel'\]` is \('layers', 'embed', 'mlp'\)"
        r".*`layer_axis_name='layers'`"
    )
    with pytest.raises(ValueError, match=message):
        stackwise.flax.Stack(Sharded, N).apply(variables, X)


# --------------------------------------------------------------------------
# Patterns (outputs and grads against the loop: tests/adapters/test_contract.py).


def test_a_patterns_variables_have_linens_natural_names():
    class Local(nn.Module):
        @nn.compact
        def __call__(self, x):
            return x + jnp.tanh(nn.Dense(D)(x))

    class Global(Local):
        pass

    stack = stackwise.flax.Stack([Local, Local, Global], 8)
    params = stack.init(jax.random.key(0), X)["params"]
    assert sorted(params) == ["Global_0", "Local_0", "Local_1"]
    shapes = {name: tree["Dense_0"]["kernel"].shape for name, tree in params.items()}
    assert shapes == {"Local_0": (3, D, D), "Local_1": (3, D, D), "Global_0": (2, D, D)}
