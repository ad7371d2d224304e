"""The serving layout on the NNX Stack (`stackwise.nnx.to_serving`, a new model): every stacked
Variable's value a `stackwise.Serving` of its layers, run by the core's serving loop. Against
the loop of `Stack.to_layers()`' blocks (bitwise: the same arithmetic, layer by layer) and the
stacked Stack (within tests/_tolerance.py's bound), decoding with `nnx.MultiHeadAttention`'s own
`nnx.Cache` KV cache, through `nnx.split` / `jax.jit(donate_argnums=...)` / `nnx.merge` and
through `nnx.jit`; BatchStat, custom Variables, RNG streams, patterns, quantized and LoRA
params, qwix PTQ."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from _nnx import Loop
from _programs import (
    aliased_inputs,
    assert_aliases_exactly,
    assert_no_copy_per_layer,
    nbytes,
    on_cpu,
)
from _trees import assert_trees_bitwise, assert_trees_close
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

import stackwise
import stackwise.nnx
from stackwise._finetune.layer import materialise

B, T, D, HEADS = 2, 8, 8, 2


class Attend(nnx.Module):
    """A pre-norm attention block decoding with nnx.MultiHeadAttention's own cache."""

    def __init__(self, rngs):
        self.norm = nnx.LayerNorm(D, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(HEADS, D, decode=True, rngs=rngs)
        self.attn.init_cache((B, T, D))  # under the Stack's vmap: one cache per layer
        self.mlp = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.norm(x))
        return x + jnp.tanh(self.mlp(x))


class Mix(nnx.Module):
    """A pattern position without a cache."""

    def __init__(self, rngs):
        self.linear = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, x):
        return x + 0.5 * jnp.tanh(self.linear(x))


def _stack(n, k=1, **options):
    kinds = [Attend, Mix][:k] if k > 1 else Attend
    return stackwise.nnx.Stack(kinds, n, rngs=nnx.Rngs(0), **options)


def _decoder(model, donate):
    """``step(params, cache, x) -> (y, cache)``: the functional API users donate with."""
    graphdef, params, cache = nnx.split(model, nnx.Param, nnx.Cache)

    @functools.partial(jax.jit, donate_argnums=1 if donate else ())
    def step(params, cache, x):
        model = nnx.merge(graphdef, params, cache)
        return model(x), nnx.state(model, nnx.Cache)

    return step, params, cache


def _decode(model, donate=False, tokens=4):
    """Each token's output and the last cache, decoding one token at a time."""
    step, params, cache = _decoder(model, donate)
    x, ys = jax.random.normal(jax.random.key(1), (B, 1, D)), []
    for _ in range(tokens):
        y, cache = step(params, cache, x)
        ys.append(y)
        x = jnp.tanh(y)
    return ys, cache


def _served(stack):
    return stackwise.nnx.to_serving(stack)  # a new Stack: `stack` stays stacked


@pytest.mark.parametrize(
    "n, k, options",
    [(4, 1, {}), (3, 1, {"remat": False, "reverse": True}), (5, 2, {}), (6, 2, {"unroll": 2})],
    ids=["plain", "reverse", "pattern", "pattern-unrolled"],
)
def test_decode_equals_the_loop_of_its_blocks_and_the_stacked_stack(n, k, options):
    stack = _stack(n, k, **options)
    served = _served(stack)
    ys, cache = _decode(served, donate=True)
    blocks = stack.to_layers()
    ys_loop, loop_cache = _decode(Loop(blocks[::-1] if options.get("reverse") else blocks))
    for y, y_loop in zip(ys, ys_loop, strict=True):
        assert_trees_bitwise(y, y_loop)
    nnx.update(served, cache)
    loop_cache = nnx.to_pure_dict(loop_cache)["blocks"]
    for i, block in enumerate(served.to_layers()):  # each layer's cache: the loop block's
        j = n - 1 - i if options.get("reverse") else i
        got = nnx.to_pure_dict(nnx.state(block, nnx.Cache))
        assert_trees_bitwise(got, loop_cache.get(j, {}))  # (a pattern's Mix: no cache)
    ys_stacked, stacked_cache = _decode(stack)
    assert_trees_close(ys, ys_stacked)
    served = stackwise.nnx.from_serving(served)
    assert_trees_close(nnx.state(served, nnx.Cache), stacked_cache)


@pytest.mark.parametrize("n", [4, 8])
def test_every_cache_buffer_is_donated_and_written_in_place(n):
    x = jax.ShapeDtypeStruct((B, 1, D), jnp.float32)

    def program(n, donate=True):
        stack = _stack(n)
        served = _served(stack)
        step, params, cache = _decoder(served, donate=donate)
        return step.lower(params, cache, x).compile(), jax.tree.leaves(cache), stack

    compiled, leaves, stack = program(n)
    assert len(leaves) == 3 * n  # each layer's keys, values and index, buffers of their own
    assert_aliases_exactly(compiled, leaves)
    undonated = program(n, donate=False)[0]
    assert aliased_inputs(undonated) == []
    assert undonated.memory_analysis().alias_size_in_bytes == 0
    shallow, shallow_leaves, _ = program(n // 2)
    assert_no_copy_per_layer(shallow, compiled, shallow_leaves, leaves)
    if on_cpu():  # XLA:CPU's figures: unpadded bytes, the loop's schedule (tests/_programs.py)
        memory = compiled.memory_analysis()
        assert memory.alias_size_in_bytes == nbytes(leaves)
        # The temporaries are the loop's, byte for byte; the stacked Stack's are larger (a
        # per-layer slice of each weight, the stacked cache written back).
        loop = _decoder(Loop(stack.to_layers()), donate=True)
        assert (
            memory.temp_size_in_bytes
            == loop[0].lower(*loop[1:], x).compile().memory_analysis().temp_size_in_bytes
        )
        scan = _decoder(stack, donate=True)
        assert scan[0].lower(*scan[1:], x).compile().memory_analysis().temp_size_in_bytes > (
            memory.temp_size_in_bytes
        )


def _values(module):
    """Every Variable's value, and whether any is served (a `stackwise.Serving`)."""
    state = nnx.state(module)
    return state, any(
        isinstance(v, stackwise.Serving)
        for v in jax.tree.leaves(state, is_leaf=lambda v: isinstance(v, stackwise.Serving))
    )


def test_neither_direction_changes_the_model_given_nor_a_module_sharing_its_variables():
    """`to_serving` / `from_serving` return new models: the given one, and a module that
    shares its Variables (`nnx.merge` of its `nnx.split`), keep theirs, bit for bit, and
    calling the served model (which writes its caches) changes neither."""

    class Model(nnx.Module):
        def __init__(self):
            self.embed = nnx.Linear(D, D, rngs=nnx.Rngs(5))
            self.blocks = stackwise.nnx.Stack(Cached, 3, rngs=nnx.Rngs(0))

        def __call__(self, x):
            return self.blocks(self.embed(x))

    model = Model()
    sharer = nnx.merge(*nnx.split(model))
    assert sharer.blocks.layers.cache is model.blocks.layers.cache  # shared Variables
    before, _ = _values(model)
    served = stackwise.nnx.to_serving(model, "blocks")
    assert type(served) is Model and _values(served)[1]
    x = jax.random.normal(jax.random.key(3), (B, D))
    y = served(x)  # writes the served caches
    assert [int(p) for p in served.blocks.layers.pos.get_value().layers] == [1, 1, 1]
    for m in (model, sharer):
        state, is_served = _values(m)
        assert not is_served
        assert_trees_bitwise(state, before)
    assert_trees_close(y, nnx.clone(model)(x))  # the stacked model's output
    served_sharer = nnx.merge(*nnx.split(served))
    served_state, _ = _values(served)
    back = stackwise.nnx.from_serving(served, "blocks")
    assert not _values(back)[1]
    for m in (served, served_sharer):
        state, is_served = _values(m)
        assert is_served
        assert_trees_bitwise(state, served_state)
    assert_trees_bitwise(nnx.state(back.embed), nnx.state(model.embed))


def test_nnx_jit_runs_a_model_holding_a_served_stack():
    class Model(nnx.Module):
        def __init__(self, stack):
            self.embed = nnx.Linear(D, D, rngs=nnx.Rngs(5))
            self.blocks = stack

    stack = _stack(3)
    model = Model(_served(stack))
    call = nnx.jit(lambda m, x: m.blocks(m.embed(x)), donate_argnums=0)
    loop = Model(Loop(stack.to_layers()))
    x = jnp.ones((B, 1, D))
    old = jax.tree.leaves(nnx.state(model, nnx.Cache))
    compiled = call.lower(model, x).compile()
    assert_aliases_exactly(compiled, jax.tree.leaves(nnx.state(model)))
    if on_cpu():  # XLA:CPU's bytes are the arrays' own (tests/_programs.py)
        alias = compiled.memory_analysis().alias_size_in_bytes
        assert alias == nbytes(jax.tree.leaves(nnx.state(model)))
    for _ in range(2):
        y = call(model, x)
        assert_trees_bitwise(y, nnx.jit(lambda m, x: m.blocks(m.embed(x)))(loop, x))
    assert all(a.is_deleted() for a in old)  # donated: each layer's cache reused
    index = model.blocks.layers.attn.cache_index.get_value()
    assert isinstance(index, stackwise.Serving) and [int(i) for i in index.layers] == [2] * 3


def test_round_trip_is_exact_and_nnx_sees_per_layer_buffers():
    stack = _stack(4)
    stack.layers.mlp.kernel.set_metadata(out_sharding=(None, None, "model"))  # kept
    before = nnx.state(stack)
    served = _served(stack)
    kernel = served.layers.mlp.kernel
    assert type(kernel) is nnx.Param and isinstance(kernel.get_value(), stackwise.Serving)
    cache = nnx.state(served, nnx.Cache)
    assert {len(v.get_value()) for v in jax.tree.leaves(cache, is_leaf=_is_var)} == {4}
    _, params, rest = nnx.split(served, nnx.Param, ...)
    assert len(jax.tree.leaves(params)) == 4 * len(jax.tree.leaves(nnx.state(stack, nnx.Param)))
    assert {a.shape for a in jax.tree.leaves(nnx.state(served.layers.mlp))} == {(D, D), (D,)}
    for i, block in enumerate(stack.to_layers()):  # its layers are the stacked Stack's
        assert_trees_bitwise(nnx.state(served[i]), nnx.state(block))
        assert_trees_bitwise(nnx.state(served.to_layers()[i]), nnx.state(block))
    served = stackwise.nnx.from_serving(served)
    assert_trees_bitwise(nnx.state(served), before)
    assert jax.tree.structure(nnx.state(served)) == jax.tree.structure(before)


# The random search (the fast tier has test_round_trip_is_exact_and_nnx_sees_per_layer_buffers
# and test_decode_equals_the_loop_of_its_blocks_and_the_stacked_stack[plain]).
@pytest.mark.slow
@settings(max_examples=5, deadline=None)
@given(n=st.integers(1, 5), k=st.integers(1, 2), d=st.integers(1, 4), t=st.integers(1, 3))
def test_any_shapes_serve_as_the_loop_and_convert_back_exactly(n, k, d, t):
    """Widths, cache lengths, depths and patterns vary: the served calls write each layer's
    cache as the loop's blocks do, and `from_serving` gives the stacked Stack back."""

    class Writes(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(d, d, rngs=rngs)
            self.cache = nnx.Cache(jnp.zeros((t, d)))

        def __call__(self, x):
            y = jnp.tanh(self.linear(x))
            self.cache[...] = jnp.roll(self.cache[...], 1, 0).at[0].set(y[0])
            return x + y

    k = min(k, n)
    stack = stackwise.nnx.Stack([Writes] * k if k > 1 else Writes, n, rngs=nnx.Rngs(n))
    before = nnx.state(stack)
    loop = Loop(stack.to_layers())
    served = _served(stack)
    call = nnx.jit(lambda m, x: m(x))
    x = jnp.linspace(-1.0, 1.0, 2 * d).reshape(2, d)
    for _ in range(2):
        assert_trees_bitwise(call(served, x), call(loop, x))
    for i, block in enumerate(loop.blocks):
        assert_trees_bitwise(nnx.state(served[i]), nnx.state(block))
    served = stackwise.nnx.from_serving(served)
    assert jax.tree.structure(nnx.state(served)) == jax.tree.structure(before)
    back = stackwise.nnx.from_serving(stackwise.nnx.to_serving(stack))
    assert_trees_bitwise(nnx.state(back), before)
    assert_trees_bitwise(nnx.state(stack), before)  # the given Stack: untouched


def _is_var(v):
    return isinstance(v, nnx.Variable)


class Steps(nnx.Variable):
    """A custom Variable: how many times the layer ran."""


class Stateful(nnx.Module):
    """BatchStats updated in training mode, a custom Variable, a dropout stream of its own,
    a per-layer input, and an aux output."""

    def __init__(self, rngs):
        self.linear = nnx.Linear(D, D, rngs=rngs)
        self.norm = nnx.BatchNorm(D, use_running_average=False, rngs=rngs)
        self.drop = nnx.Dropout(0.25, rngs=rngs)
        self.steps = Steps(jnp.zeros((), jnp.int32))

    def __call__(self, x, scale):
        self.steps[...] += 1
        y = self.drop(self.norm(self.linear(x))) * scale
        return x + jnp.tanh(y), y.mean()


def test_batch_stats_custom_variables_and_rng_streams_update_as_in_the_loop():
    n = 4
    stack = stackwise.nnx.Stack(Stateful, n, rngs=nnx.Rngs(0, dropout=1), has_aux=True)
    served = _served(stack)
    blocks = nnx.List(stack.to_layers())
    scales = jnp.arange(1.0, n + 1)
    x = jax.random.normal(jax.random.key(2), (B, D))
    call = nnx.jit(lambda m, x: m(x, stackwise.per_layer(scales)))

    @nnx.jit
    def loop(blocks, x):
        aux = []
        for i, block in enumerate(blocks):
            x, a = block(x, scales[i])
            aux.append(a)
        return x, jnp.stack(aux)

    for _ in range(2):
        got = call(served, x)
        assert_trees_bitwise(got, loop(blocks, x))
        assert_trees_close(got, call(stack, x))
    for i, block in enumerate(blocks):
        assert_trees_bitwise(nnx.state(served[i]), nnx.state(block))
    assert int(served[2].steps[...]) == 2
    served = stackwise.nnx.from_serving(served)
    assert_trees_close(nnx.state(served, nnx.BatchStat), nnx.state(stack, nnx.BatchStat))
    assert_trees_bitwise(nnx.state(served, Steps), nnx.state(stack, Steps))


class Noisy(nnx.Module):
    """Dropout drawing from an `nnx.Rngs` argument, and the running layer's index."""

    def __init__(self, rngs):
        self.linear = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, x, rngs):
        x = nnx.Dropout(0.5)(self.linear(x), rngs=rngs)
        return x + stackwise.nnx.layer_index()


def test_an_rngs_argument_and_the_layer_index_as_stacked():
    stack = stackwise.nnx.Stack(Noisy, 3, rngs=nnx.Rngs(0))
    served = _served(stack)
    x = jnp.ones((B, D))
    rngs, served_rngs = nnx.Rngs(dropout=7), nnx.Rngs(dropout=7)
    for _ in range(2):
        assert_trees_close(served(x, served_rngs), stack(x, rngs))
    assert int(served_rngs.dropout.count[...]) == int(rngs.dropout.count[...]) == 2


class Cached(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(D, D, rngs=rngs)
        self.cache = nnx.Cache(jnp.zeros((T, D)))
        self.pos = nnx.Cache(jnp.zeros((), jnp.int32))

    def __call__(self, x):
        y = x + jnp.tanh(self.linear(x))
        self.cache[...] = jax.lax.dynamic_update_slice(self.cache[...], y, (self.pos[...], 0))
        self.pos[...] += 1
        return y


@pytest.mark.parametrize("kind", ["int8", "nf4", "merged"])
def test_quantized_and_lora_params_serve_one_layer_at_a_time(kind):
    """The Stack's own per-leaf LoRA over a quantized (or a merged float) base: each layer's
    buffer holds its own codes (nf4 still packed); the loop's blocks get their float
    weights as the Stack builds them (`materialise`, which `_kit.run_layer` calls)."""
    n = 4
    graphdef, base, rest = nnx.split(
        stackwise.nnx.Stack(Cached, n, rngs=nnx.Rngs(0)), nnx.Param, ...
    )
    adapters = stackwise.lora.init(jax.random.key(3), base, rank=2)
    adapters = jax.tree.map(lambda v: v + 0.05, adapters)
    if kind == "merged":
        params = stackwise.lora.merge(base, adapters)
    else:
        params = stackwise.lora.attach(
            stackwise.quant.quantize(base, kind), adapters, per_leaf=True
        )
    model = nnx.merge(graphdef, params, rest)
    blocks = model.to_layers()
    model = stackwise.nnx.to_serving(model)
    if kind == "nf4":
        codes = model.layers.linear.kernel.get_value().base.codes
        assert isinstance(codes, stackwise.Serving) and codes.layers[0].shape == (D // 2, D)
    xs = [jax.random.normal(jax.random.key(4 + t), (1, D)) for t in range(3)]
    ys = [nnx.jit(lambda m, x: m(x))(model, x) for x in xs]

    def floats(block):
        g, p, r = nnx.split(block, nnx.Param, ...)
        return nnx.merge(g, materialise(p), r)

    loop = Loop([floats(b) for b in blocks])
    ys_loop = [nnx.jit(lambda m, x: m(x))(loop, x) for x in xs]
    assert_trees_bitwise(ys, ys_loop)
    for i, block in enumerate(loop.blocks):
        assert_trees_bitwise(nnx.state(model[i], nnx.Cache), nnx.state(block, nnx.Cache))


@pytest.mark.parametrize("kind", ["ptq", "qlora"])
def test_qwix_models_serve_per_layer(kind):
    """qwix's PTQ model (its int8 kernels kept stacked by the Stack) and its QLoRA model (its
    `qwix_rngs` set from outside, left as it is), served, against qwix's treatment of the
    loop of the same float blocks given the Stack's per-layer params."""
    qwix = pytest.importorskip("qwix")
    x = jax.random.normal(jax.random.key(6), (B, D))
    floats = stackwise.nnx.Stack(Mix, 3, rngs=nnx.Rngs(0))
    if kind == "ptq":
        provider = qwix.PtqProvider([qwix.QtRule(module_path=".*", weight_qtype="int8")])
        treat = lambda m: qwix.quantize_model(m, provider, x)  # noqa: E731
    else:
        provider = qwix.LoraProvider(module_path=".*", rank=2, alpha=2.0, weight_qtype="int8")
        treat = lambda m: qwix.apply_lora_to_model(m, provider, x, rngs=nnx.Rngs(1))  # noqa: E731
    loop, model = treat(Loop(floats.to_layers())), treat(floats)
    nnx.update(model, jax.tree.map(lambda v: v + 0.1, nnx.state(model, nnx.LoRAParam)))
    for i, block in enumerate(loop.blocks):
        nnx.update(block, nnx.state(model[i], nnx.Param))
    model = stackwise.nnx.to_serving(model)
    if kind == "ptq":
        codes = model.layers.linear.kernel.array.qvalue.get_value()  # qwix's int8 codes
        assert isinstance(codes, stackwise.Serving) and codes.layers[1].dtype == jnp.int8
    else:
        assert isinstance(model.layers.linear.kernel_lora_a.get_value(), stackwise.Serving)
    call = nnx.jit(lambda m, x: m(x))
    assert_trees_bitwise(call(model, x), call(loop, x))


class Grows(nnx.Module):
    """Adds a param on its first call, as a transformation adding adapters does."""

    def __init__(self, rngs):
        self.linear = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, x):
        x = self.linear(x)
        if not hasattr(self, "extra"):
            self.extra = nnx.Param(jnp.mean(x, 0, keepdims=True))
        return x + self.extra[...]


def test_a_param_added_inside_a_served_layer_is_kept_per_layer():
    stack = stackwise.nnx.Stack(Grows, 3, rngs=nnx.Rngs(0))
    loop = Loop(stack.to_layers())
    stack = stackwise.nnx.to_serving(stack)
    x = jax.random.normal(jax.random.key(7), (B, D))
    call = nnx.jit(lambda m, x: m(x))
    y = call(stack, x)
    assert_trees_bitwise(y, call(loop, x))
    assert isinstance(stack.layers.extra.get_value(), stackwise.Serving)
    assert_trees_bitwise(call(stack, x), y)  # kept: not re-created
    for i, block in enumerate(loop.blocks):
        assert_trees_bitwise(stack[i].extra[...], block.extra[...])
