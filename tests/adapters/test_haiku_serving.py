"""The serving layout on the Haiku Stack (`stackwise.haiku.to_serving`): each stacked leaf a
`stackwise.Serving` of its layers, run by the core's serving loop, against the Haiku loop of
the same blocks (bitwise: the same arithmetic, layer by layer; its params from
`stackwise.haiku.to_loop`) and the scanned Stack (within tests/_tolerance.py's bound), for
prefill and decode with a KV cache kept in `hk.get_state` / `hk.set_state` and donated."""

from __future__ import annotations

from functools import partial

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _attention import attention_layer, decode
from _programs import (
    aliased_inputs,
    assert_aliases_exactly,
    assert_no_copy_per_layer,
    nbytes,
    on_cpu,
)
from _trees import assert_trees_bitwise, assert_trees_close
from hypothesis import given, settings
from hypothesis import strategies as st

import stackwise
import stackwise.haiku as swh
from stackwise import _kit
from stackwise._finetune.layer import materialise

B, T, D, HEADS = 2, 16, 8, 2
_, ATTEND = attention_layer(B, T, D, HEADS)
CACHE_SHAPE = (B, T, HEADS, D // HEADS)
PROMPT = jax.random.normal(jax.random.key(2), (B, 5, D))
SLOW = pytest.mark.slow  # (a variant: the fast tier has the plain, pattern-2 and int8 cases)


class Attend(hk.Module):
    """tests/_attention.py's layer as a Haiku module, its KV cache in `hk.get_state`."""

    def __init__(self, scale: float = 1.0, name: str | None = None):
        super().__init__(name=name)
        self.scale = scale

    def __call__(self, x, pos):
        normal = hk.initializers.RandomNormal(D**-0.5)
        qkv = hk.get_parameter("qkv", (D, 3 * D), init=normal) * self.scale
        out = hk.get_parameter("out", (D, D), init=normal)
        cache = {c: hk.get_state(c, CACHE_SHAPE, init=jnp.zeros) for c in "kv"}
        y, cache = ATTEND({"qkv": qkv, "out": out}, cache, x, pos)
        for c, value in cache.items():
            hk.set_state(c, value)
        return y


def _kinds(k):
    return [partial(Attend, 1.0 + p / 4) for p in range(k)]


def _model(n, k, **options):
    """``(stacked, loop, paths)``: the Stack of ``k`` kinds of blocks (a pattern if > 1), the
    Haiku loop of the same blocks (layer i named ``layer_i``) and the Stack's positions."""
    kinds = _kinds(k)
    stacked = hk.transform_with_state(
        lambda x, pos: swh.Stack(kinds if k > 1 else kinds[0], n, **options)(x, pos)
    )

    def loop(x, pos):
        blocks = [kinds[i % k](name=f"layer_{i}") for i in range(n)]
        for i in reversed(range(n)) if options.get("reverse") else range(n):
            x = blocks[i](x, pos)
        return x

    paths = ["stack/attend", "stack/attend_1", "stack/attend_2"][:k] if k > 1 else "stack"
    return stacked, hk.transform_with_state(loop), paths


def _step(f):
    return lambda params, state, x, pos: f.apply(params, state, None, x, pos)


def _decode(step, params, state):
    """`_attention.decode` over ``step(params, state, x, pos)``: the prompt, then 3 tokens."""
    return decode(step, params, state, PROMPT, steps=3)


def _to_loop(tree, paths, k):
    return swh.to_loop(tree, paths if k > 1 else "stack/attend", "layer_{}")


@pytest.mark.parametrize(
    "n, k, options",
    [
        pytest.param(4, 1, {}, id="plain"),
        pytest.param(3, 1, {"remat": False, "reverse": True}, id="reverse", marks=SLOW),
        pytest.param(5, 2, {}, id="pattern-2"),
        pytest.param(6, 3, {"unroll": 2}, id="pattern-3", marks=SLOW),
    ],
)
def test_served_stack_decodes_as_the_loop_of_its_blocks_and_the_scan(n, k, options):
    stacked, loop, paths = _model(n, k, **options)
    params, state = stacked.init(jax.random.key(1), PROMPT, 0)
    served, served_state = swh.to_serving(params, paths), swh.to_serving(state, paths)
    assert all(
        isinstance(leaf, stackwise.Serving)
        for leaf in jax.tree.leaves((served, served_state), is_leaf=_kit.serving.is_serving)
    )
    ys, served_state = _decode(jax.jit(_step(stacked), donate_argnums=1), served, served_state)
    assert isinstance(served_state["stack/attend"]["k"], stackwise.Serving)

    loop_params, loop_state = _to_loop(params, paths, k), _to_loop(state, paths, k)
    assert sorted(loop_params) == sorted(loop.init(jax.random.key(1), PROMPT, 0)[0])
    ys_loop, loop_state = _decode(jax.jit(_step(loop)), loop_params, loop_state)
    ys_scan, scan_state = _decode(jax.jit(_step(stacked)), params, state)
    for y, y_loop, y_scan in zip(ys, ys_loop, ys_scan, strict=True):
        assert_trees_bitwise(y, y_loop)
        assert_trees_close(y, y_scan)
    back = swh.from_serving(served_state, paths)
    assert_trees_bitwise(_to_loop(back, paths, k), loop_state)
    assert_trees_close(back, scan_state)
    if k == 1 and not options:  # hk.layer_stack of the same block, its state stacked too
        layer_stack = hk.transform_with_state(
            lambda x, pos: hk.layer_stack(n)(lambda x: Attend()(x, pos))(x)
        )
        ours = [swh.to_layer_stack(tree, "stack") for tree in (params, state)]
        ys_theirs, theirs = _decode(jax.jit(_step(layer_stack)), *ours)
        assert_trees_close(ys, ys_theirs)
        assert_trees_close(swh.to_layer_stack(back, "stack"), theirs)


@pytest.mark.parametrize("k", [1, 3])
def test_round_trip_is_exact_and_leaves_other_modules_alone(k):
    kinds = _kinds(k)

    def forward(x, pos):
        x = hk.Linear(D, name="embed")(x)
        return swh.Stack(kinds if k > 1 else kinds[0], 5)(x, pos)

    params, state = hk.transform_with_state(forward).init(jax.random.key(1), PROMPT, 0)
    _, _, paths = _model(5, k)
    served = swh.to_serving(params, paths)
    assert served["embed"] is params["embed"] and list(served) == list(params)
    w = served["stack/attend"]["qkv"]
    for i in range(len(w)):
        assert_trees_bitwise(w.layers[i], params["stack/attend"]["qkv"][i])
    assert_trees_bitwise(swh.from_serving(served, paths), params)
    assert_trees_bitwise(swh.from_serving(swh.to_serving(state, paths), paths), state)


# The random search (the fast tier's round trip:
# test_round_trip_is_exact_and_leaves_other_modules_alone[1]).
@SLOW
@settings(max_examples=12, deadline=None)
@given(
    n=st.integers(1, 7),
    k=st.integers(1, 3),
    dtype=st.sampled_from(["float32", "bfloat16", "int8", "uint32"]),
    shape=st.lists(st.integers(1, 3), max_size=2),
)
def test_conversion_is_exact_for_any_depth_pattern_dtype_and_shape(n, k, dtype, shape):
    k = min(k, n)
    counts = [len(range(p, n, k)) for p in range(k)]
    rng = np.random.default_rng(n * 10 + k)

    def leaf(count, extra=()):
        bits = rng.integers(0, 2**8, (count, *extra, *shape), dtype=np.uint8).astype(dtype)
        return jnp.asarray(bits)

    tree = {"head": {"w": leaf(2)}}  # outside the Stack: kept as it is, whatever its shape
    for p, count in enumerate(counts):
        tree[f"stack/pos_{p}/linear"] = {"w": leaf(count, (2,)), "b": leaf(count)}
        tree[f"stack/pos_{p}"] = {"cache": leaf(count, (3,))}
    paths = [f"stack/pos_{p}" for p in range(k)] if k > 1 else "stack"
    served = swh.to_serving(tree, paths)
    assert served["head"] is tree["head"]
    for module, bundle in tree.items():
        for name, value in bundle.items():
            if module != "head":
                got = served[module][name]
                assert isinstance(got, stackwise.Serving) and len(got) == value.shape[0]
                for j, layer in enumerate(got.layers):
                    assert_trees_bitwise(layer, value[j])
    assert_trees_bitwise(swh.from_serving(served, paths), tree)


@SLOW
def test_a_pattern_with_positions_of_one_depth_converts_with_the_stacks_name():
    stacked, _, _ = _model(6, 3)
    params, state = stacked.init(jax.random.key(1), PROMPT, 0)
    served = swh.to_serving(params, "stack")
    y, _ = stacked.apply(served, swh.to_serving(state, "stack"), None, PROMPT, 0)
    served_list = swh.to_serving(params, ["stack/attend", "stack/attend_1", "stack/attend_2"])
    assert_trees_bitwise(served_list, served)
    assert_trees_close(y, stacked.apply(params, state, None, PROMPT, 0)[0])


@pytest.mark.parametrize("n", [4, pytest.param(8, marks=SLOW)])
def test_decode_writes_each_donated_cache_buffer_in_place(n):
    x, pos = jax.ShapeDtypeStruct((B, 1, D), jnp.float32), jnp.int32(3)

    def program(n, donate=True):
        stacked, loop, _ = _model(n, 1)
        params, state = stacked.init(jax.random.key(1), PROMPT, 0)
        served, served_state = swh.to_serving(params, "stack"), swh.to_serving(state, "stack")
        step = jax.jit(_step(stacked), donate_argnums=1 if donate else ())
        compiled = step.lower(served, served_state, x, pos).compile()
        return compiled, jax.tree.leaves(served_state), (stacked, loop, step, params, state)

    compiled, leaves, (stacked, loop, donated, params, state) = program(n)
    assert len(leaves) == 2 * n  # each layer's keys and values, buffers of their own
    assert_aliases_exactly(compiled, leaves)
    undonated = program(n, donate=False)[0]
    assert aliased_inputs(undonated) == []
    assert undonated.memory_analysis().alias_size_in_bytes == 0
    shallow, shallow_leaves, _ = program(n // 2)
    assert_no_copy_per_layer(shallow, compiled, shallow_leaves, leaves)
    if on_cpu():  # XLA:CPU's figures: unpadded bytes, the loop's schedule (tests/_programs.py)
        alias = compiled.memory_analysis().alias_size_in_bytes
        assert alias == nbytes(leaves)
        # The temporaries are the Haiku loop's, byte for byte; the scanned Stack's are larger
        # (a per-layer slice of each weight, the stacked cache written back).
        loop_args = (_to_loop(params, "stack", 1), _to_loop(state, "stack", 1), x, pos)
        loop_compiled = jax.jit(_step(loop), donate_argnums=1).lower(*loop_args).compile()
        temp = compiled.memory_analysis().temp_size_in_bytes
        assert temp == loop_compiled.memory_analysis().temp_size_in_bytes
        scan = donated.lower(params, state, x, pos).compile()
        assert scan.memory_analysis().temp_size_in_bytes > temp


class Noisy(hk.Module):
    """A stateless block with a per-layer input, a per-layer output and a random draw."""

    def __call__(self, x, scale):
        y = jnp.tanh(hk.Linear(D)(x)) * scale
        y = y + jax.random.normal(hk.next_rng_key(), x.shape) * 1e-2
        return y, jnp.sum(y)


def test_per_layer_inputs_aux_and_rng_keys_serve_as_the_loop_and_the_scan():
    n, scales = 4, jnp.arange(1.0, 5.0)
    key = jax.random.key(4)

    def forward(x):
        return swh.Stack(Noisy, n, has_aux=True)(x, stackwise.per_layer(scales))

    f = hk.transform(forward)
    x = jax.random.normal(jax.random.key(3), (B, D))
    params = f.init(jax.random.key(1), x)
    apply = jax.jit(f.apply)
    got = apply(swh.to_serving(params, "stack"), key, x)

    one = hk.transform(lambda x, s: Noisy()(x, s))
    keys = jax.random.split(hk.transform(hk.next_rng_key).apply({}, key), n)

    def loop(loop_params):  # layer i: its params, scale and the i-th of the Stack's keys
        y, aux = x, []
        for i in range(n):
            y, a = one.apply(loop_params[f"noisy_{i}"], keys[i], y, scales[i])
            aux.append(a)
        return y, jnp.stack(aux)

    loop_params = swh.to_loop(params, "stack/noisy", "noisy_{}")
    per_layer = {f"noisy_{i}": {"noisy/linear": loop_params[f"noisy_{i}/linear"]} for i in range(n)}
    assert_trees_bitwise(got, jax.jit(loop)(per_layer))
    assert_trees_close(got, apply(params, key, x))


def test_served_stack_equals_hk_layer_stack_of_the_same_block():
    n, scales = 3, jnp.arange(1.0, 4.0)
    x = jax.random.normal(jax.random.key(3), (B, D))

    def block(x, scale):
        return x + jnp.tanh(hk.Linear(D)(x)) * scale

    ours = hk.transform(lambda x: swh.Stack(block, n)(x, stackwise.per_layer(scales)))
    theirs = hk.transform(
        lambda x: hk.layer_stack(n, with_per_layer_inputs=True)(lambda x, s: (block(x, s), None))(
            x, scales
        )[0]
    )
    params = ours.init(jax.random.key(1), x)
    layer_stack_params = swh.to_layer_stack(params, "stack", "__layer_stack_with_per_layer")
    want = jax.jit(theirs.apply)(layer_stack_params, None, x)
    assert_trees_close(jax.jit(ours.apply)(swh.to_serving(params, "stack"), None, x), want)


class Layer(hk.Module):
    """An outer layer: a Stack of two Linears (so the model is a Stack of Stacks)."""

    def __call__(self, x):
        return swh.Stack(lambda: hk.Linear(D), 2)(x)


class Model(hk.Module):
    """A Stack of `Layer` s inside a module, after an embedding; or the loop of them."""

    def __init__(self, loop: bool = False, name: str | None = None):
        super().__init__(name=name)
        self.embed = hk.Linear(D, name="embed")
        self.layers = (
            [Layer(name=f"layer_{i}") for i in range(3)] if loop else [swh.Stack(Layer, 3)]
        )

    def __call__(self, x):
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return x


def _lifted(loop: bool):
    """The model's transform lifted into an outer one (`hk.lift`), under ``outer/``."""
    inner = hk.transform(lambda x: Model(loop)(x))

    def forward(x):
        key = hk.next_rng_key() if hk.running_init() else None
        return inner.apply(hk.lift(inner.init, name="outer")(key, x), None, x)

    return hk.transform(forward)


def test_a_stack_of_stacks_inside_a_module_inside_a_lifted_transform():
    x = jax.random.normal(jax.random.key(3), (B, D))
    f = _lifted(loop=False)
    params = f.init(jax.random.key(1), x)
    path = "outer/model/~/stack"
    assert params[path + "/layer/stack/linear"]["w"].shape == (3, 2, D, D)
    served = swh.to_serving(params, path)
    inner = served[path + "/layer/stack/linear"]["w"]
    assert inner.layers[0].shape == (2, D, D)  # each outer layer's inner Stack: stacked
    assert served["outer/model/~/embed"] is params["outer/model/~/embed"]
    got = jax.jit(f.apply)(served, None, x)
    loop_params = swh.to_loop(params, path + "/layer", "outer/model/~/layer_{}")
    assert sorted(loop_params) == sorted(_lifted(loop=True).init(jax.random.key(1), x))
    assert_trees_bitwise(got, jax.jit(_lifted(loop=True).apply)(loop_params, None, x))
    assert_trees_close(got, jax.jit(f.apply)(params, None, x))


@pytest.mark.parametrize(
    "kind, k", [("int8", 1), pytest.param("nf4", 2, marks=SLOW)], ids=["int8", "nf4-pattern"]
)
def test_quantized_base_with_adapters_serves_one_layer_at_a_time(kind, k):
    """QLoRA weights on the served Stack: each layer's leaves hold their own codes (nf4 still
    packed) and adapters; the Haiku loop of the same blocks, each layer's float weights built
    as the Stack builds them (`materialise`, which `_kit.run_layer` calls), is the same
    arithmetic."""
    n = 5
    stacked, loop, paths = _model(n, k)
    params, state = stacked.init(jax.random.key(1), PROMPT, 0)
    base = stackwise.quant.quantize(params, kind)
    adapters = stackwise.lora.init(jax.random.key(5), base, rank=2)
    adapters = jax.tree.map(lambda v: v + 0.05, adapters)
    model = stackwise.lora.attach(base, adapters, per_leaf=True)
    served = swh.to_serving(model, paths)
    qkv = served["stack/attend"]["qkv"]
    assert isinstance(qkv.base.codes, stackwise.Serving) and len(qkv.base.codes) == len(
        range(0, n, k)
    )
    if kind == "nf4":  # one layer's codes, still packed
        assert qkv.base.codes.layers[0].shape == (D // 2, 3 * D)
    step = jax.jit(_step(stacked), donate_argnums=1)
    ys, served_state = _decode(step, served, swh.to_serving(state, paths))

    def loop_step(loop_params, state, x, pos):  # each layer's float weights, built in jit
        return loop.apply(materialise(loop_params), state, None, x, pos)

    loop_params, loop_state = _to_loop(model, paths, k), _to_loop(state, paths, k)
    ys_loop, loop_state = _decode(jax.jit(loop_step), loop_params, loop_state)
    ys_scan, _ = _decode(jax.jit(_step(stacked)), model, state)
    for y, y_loop, y_scan in zip(ys, ys_loop, ys_scan, strict=True):
        assert_trees_bitwise(y, y_loop)
        assert_trees_close(y, y_scan)
    back = swh.from_serving(served_state, paths)
    assert_trees_bitwise(_to_loop(back, paths, k), loop_state)
    assert_trees_bitwise(swh.from_serving(served, paths), model)


def test_merged_adapters_serve_as_the_attached_ones():
    stacked, _, _ = _model(3, 1)
    params, state = stacked.init(jax.random.key(1), PROMPT, 0)
    adapters = jax.tree.map(
        lambda v: v + 0.05, stackwise.lora.init(jax.random.key(5), params, rank=2)
    )
    merged = swh.to_serving(stackwise.lora.merge(params, adapters), "stack")
    attached = stackwise.lora.attach(params, adapters, per_leaf=True)
    y, _ = stacked.apply(merged, swh.to_serving(state, "stack"), None, PROMPT, 0)
    assert_trees_close(y, stacked.apply(attached, state, None, PROMPT, 0)[0])
