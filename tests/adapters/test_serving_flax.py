"""The serving layout on the linen Stack (`stackwise.flax.to_serving`): every stacked leaf a
`stackwise.Serving` of its layers, run by the core's serving loop. Against the loop of the
same blocks over `stackwise.flax.to_loop`'s variables (bitwise: the same arithmetic, layer
by layer) and the stacked Stack (within tests/_tolerance.py's bound), for decoding with
flax's own KV cache (`nn.MultiHeadDotProductAttention(decode=True)`, its `cache`
collection) under `jax.jit` with the cache donated, with and without a pattern."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
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
import stackwise.flax
from stackwise import _kit
from stackwise._finetune.layer import materialise

B, T, D, HEADS = 2, 8, 16, 2
KEY = jax.random.key(0)
PROMPT = jax.random.normal(jax.random.key(1), (B, 4, D))


class Block(nn.Module):
    """A pre-norm decoder block with flax's own KV cache (the lm1b example's decoder)."""

    scale: float = 1.0

    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm()(x)
        x = x + self.scale * nn.MultiHeadDotProductAttention(num_heads=HEADS, decode=True)(h, h)
        return x + nn.Dense(D)(jax.nn.gelu(nn.Dense(2 * D)(nn.LayerNorm()(x))))


class Mix(nn.Module):
    """A pattern's position without a cache."""

    @nn.compact
    def __call__(self, x):
        return x + jnp.tanh(nn.Dense(D)(x))


def _kinds(k):
    return [Block, Mix] if k == 2 else [Block]


class Model(nn.Module):
    n: int
    k: int = 1
    options: tuple = ()

    @nn.compact
    def __call__(self, x):
        kinds = _kinds(self.k)
        block = kinds if self.k > 1 else kinds[0]
        return stackwise.flax.Stack(block, self.n, name="layers", **dict(self.options))(x)


class Loop(nn.Module):
    n: int
    k: int = 1
    reverse: bool = False

    @nn.compact
    def __call__(self, x):
        kinds = _kinds(self.k)
        order = reversed(range(self.n)) if self.reverse else range(self.n)
        for i in order:
            x = kinds[i % self.k](name=f"layers_{i}")(x)
        return x


def _path(k):
    return ["layers/Block_0", "layers/Mix_0"] if k == 2 else "layers"


def _step(model):
    """One decode step: ``(params, cache, x) -> (y, cache)``."""

    def step(params, cache, x):
        y, new = model.apply({"params": params, "cache": cache}, x, mutable=["cache"])
        return y, new["cache"]

    return step


def _decode(step, variables):
    """The prompt token by token (flax's cache takes one position a call); each output."""
    cache, ys = variables["cache"], []
    for t in range(PROMPT.shape[1]):
        y, cache = step(variables["params"], cache, PROMPT[:, t : t + 1])
        ys.append(y)
    return ys, cache


def _served_leaves(tree):
    return jax.tree.leaves(tree, is_leaf=_kit.serving.is_serving)


@pytest.mark.parametrize(
    "n, k, options",
    [
        pytest.param(4, 1, {}, id="plain"),
        pytest.param(3, 1, {"remat": False, "reverse": True}, id="reverse", marks=pytest.mark.slow),
        pytest.param(3, 2, {"unroll": 2}, id="pattern"),
    ],
)
def test_served_decode_equals_the_loop_of_its_blocks_and_the_stack(n, k, options):
    model = Model(n, k, tuple(options.items()))
    variables = model.init(KEY, jnp.zeros((B, T, D)))
    served = stackwise.flax.to_serving(variables, _path(k))
    kernel = _served_leaves(served["params"])[0]
    assert isinstance(kernel, stackwise.Serving) and len(kernel) == len(range(0, n, k))
    ys, cache = _decode(jax.jit(_step(model), donate_argnums=1), served)
    assert all(_kit.serving.is_serving(v) for v in _served_leaves(cache))  # served back

    loop = stackwise.flax.to_loop(variables, _path(k))
    ys_loop, cache_loop = _decode(jax.jit(_step(Loop(n, k, options.get("reverse", False)))), loop)
    ys_stack, cache_stack = _decode(jax.jit(_step(model)), variables)
    for y, y_loop, y_stack in zip(ys, ys_loop, ys_stack, strict=True):
        assert_trees_bitwise(y, y_loop)
        assert_trees_close(y, y_stack)
    back = stackwise.flax.from_serving({"cache": cache}, _path(k))
    assert_trees_bitwise(stackwise.flax.to_loop(back, _path(k))["cache"], cache_loop)
    assert_trees_close(back["cache"], cache_stack)


@pytest.mark.parametrize("k", [1, 2])
def test_round_trip_is_exact_in_every_collection(k):
    variables = Model(5, k).init(KEY, jnp.zeros((B, T, D)))
    served = stackwise.flax.to_serving(variables, _path(k))
    layers = stackwise.flax.to_loop(variables, _path(k))
    for i in range(0, 5, k):  # layer i of the Block position: its Serving's entry i // k
        at = lambda tree, i=i: jax.tree.map(  # noqa: E731
            lambda s: s.layers[i // k], tree, is_leaf=_kit.serving.is_serving
        )
        for col in ("params", "cache"):
            position = served[col]["layers"]["Block_0"] if k > 1 else served[col]["layers"]
            assert_trees_bitwise(at(position), layers[col][f"layers_{i}"])
    assert_trees_bitwise(stackwise.flax.from_serving(served, _path(k)), variables)


@pytest.mark.parametrize("n", [4, pytest.param(8, marks=pytest.mark.slow)])
def test_decode_writes_each_donated_cache_buffer_in_place(n):
    """Every layer's cache buffer aliased to its output, and no copy of it; on XLA:CPU the
    temporaries are the loop's, byte for byte, and below the stacked Stack's (a slice of each
    weight, the stacked cache written back)."""
    x = jax.ShapeDtypeStruct((B, 1, D), jnp.float32)

    def compiled(model, variables, donate=True):
        step = jax.jit(_step(model), donate_argnums=1 if donate else ())
        lowered = step.lower(variables["params"], variables["cache"], x)
        return lowered.compile()

    def served(n):
        variables = Model(n).init(KEY, jnp.zeros((B, T, D)))
        return variables, stackwise.flax.to_serving(variables, "layers")

    variables, serving = served(n)
    leaves = jax.tree.leaves(serving["cache"])
    assert len(leaves) == 3 * n  # each layer's keys, values and index: buffers of their own
    program = compiled(Model(n), serving)
    assert_aliases_exactly(program, leaves)
    undonated = compiled(Model(n), serving, donate=False)
    assert aliased_inputs(undonated) == []
    assert undonated.memory_analysis().alias_size_in_bytes == 0
    shallow = served(n // 2)[1]
    assert_no_copy_per_layer(compiled(Model(n // 2), shallow), program,
                             jax.tree.leaves(shallow["cache"]), leaves)
    if on_cpu():  # XLA:CPU's figures: unpadded bytes, the loop's schedule (tests/_programs.py)
        got = program.memory_analysis()
        assert got.alias_size_in_bytes == nbytes(leaves)
        loop = compiled(Loop(n), stackwise.flax.to_loop(variables, "layers")).memory_analysis()
        assert got.temp_size_in_bytes == loop.temp_size_in_bytes
        scan = compiled(Model(n), variables).memory_analysis()
        assert scan.temp_size_in_bytes > got.temp_size_in_bytes


class Sown(nn.Module):
    """A block with a per-layer input, the layer index (or, in the loop, a given one), a
    sown value and an auxiliary output."""

    index: int | None = None

    @nn.compact
    def __call__(self, x, gate):
        i = stackwise.flax.layer_index() if self.index is None else jnp.int32(self.index)
        y = x + gate * jnp.tanh(nn.Dense(D)(x)) + i
        self.sow("intermediates", "mean", y.mean())
        return y, y.sum()


class SownModel(nn.Module):
    @nn.compact
    def __call__(self, x, gates):
        return stackwise.flax.Stack(Sown, 3, has_aux=True, name="layers")(x, gates)


def test_no_state_aux_per_layer_inputs_and_sown_values():
    """`mutable=False` runs the served params alone; `has_aux` outputs come back stacked
    (as from the stacked Stack), sown values served (state, as a cache); all the loop's."""
    x, gates = jnp.ones((B, D)), jnp.array([0.5, 1.0, 2.0])
    model = SownModel()
    variables = model.init(KEY, x, stackwise.per_layer(gates))
    assert "intermediates" not in variables  # (sown at init only when mutable)
    served = stackwise.flax.to_serving(variables, "layers")
    run = jax.jit(lambda v: model.apply(v, x, stackwise.per_layer(gates)))
    (y, sums) = run(served)

    def loop(params):
        h, sums, means = x, [], []
        for i in range(3):
            (h, s), sown = Sown(index=i).apply(
                {"params": params[f"layers_{i}"]}, h, gates[i], mutable=["intermediates"]
            )
            sums.append(s)
            means.append(sown["intermediates"]["mean"][0])
        return h, jnp.stack(sums), means

    y_loop, sums_loop, means_loop = jax.jit(loop)(
        stackwise.flax.to_loop(variables, "layers")["params"]
    )
    assert_trees_bitwise((y, sums), (y_loop, sums_loop))
    assert_trees_close((y, sums), run(variables))
    (_, _), sown = model.apply(served, x, stackwise.per_layer(gates), mutable=["intermediates"])
    mean = sown["intermediates"]["layers"]["mean"][0]
    assert isinstance(mean, stackwise.Serving) and len(mean) == 3
    assert_trees_bitwise(list(mean.layers), means_loop)
    stacked = stackwise.flax.from_serving(sown, "layers")["intermediates"]["layers"]["mean"][0]
    assert_trees_bitwise(stacked, jnp.stack(means_loop))


def _loop_decode(params, cache):
    """A Python loop of the block over per-layer variables (``to_loop``'s), each layer's
    float weights built as the Stack builds them (``materialise``, which ``_kit.run_layer``
    calls)."""

    def step(params, cache, x):
        cache = dict(cache)
        for i in range(len(cache)):
            name = f"layers_{i}"
            layer = {"params": materialise(params[name]), "cache": cache[name]}
            x, new = Block().apply(layer, x, mutable=["cache"])
            cache[name] = new["cache"]
        return x, cache

    return _decode(jax.jit(step), {"params": params, "cache": cache})


@pytest.mark.parametrize("kind", ["int8", pytest.param("nf4", marks=pytest.mark.slow)])
def test_quantized_base_with_adapters_serves_one_layer_at_a_time(kind):
    """QLoRA weights (`stackwise.quant` codes, `stackwise.lora.attach(..., per_leaf=True)`)
    served leaf by leaf: each layer's codes (nf4 still packed), scales and adapters its own
    buffers; the loop over `to_loop`'s per-layer nodes is the same arithmetic."""
    model = Model(4)
    variables = model.init(KEY, jnp.zeros((B, T, D)))
    base = stackwise.quant.quantize(variables["params"]["layers"], kind)
    adapters = stackwise.lora.init(jax.random.key(5), base, rank=2)
    adapters = jax.tree.map(lambda v: v + 0.05, adapters)
    params = {"layers": stackwise.lora.attach(base, adapters, per_leaf=True)}
    qlora = {"params": params, "cache": variables["cache"]}
    served = stackwise.flax.to_serving(qlora, "layers")
    kernel = served["params"]["layers"]["Dense_1"]["kernel"].base  # Dense(2 * D), per layer
    assert isinstance(kernel.codes, stackwise.Serving)
    packed = D // 2 if kind == "nf4" else D
    assert kernel.codes.layers[0].shape == (packed, 2 * D)
    ys, cache = _decode(jax.jit(_step(model), donate_argnums=1), served)

    loop = stackwise.flax.to_loop(qlora, "layers")
    ys_loop, cache_loop = _loop_decode(loop["params"], loop["cache"])
    ys_stack, _ = _decode(jax.jit(_step(model)), qlora)
    for y, y_loop, y_stack in zip(ys, ys_loop, ys_stack, strict=True):
        assert_trees_bitwise(y, y_loop)
        assert_trees_close(y, y_stack)
    back = stackwise.flax.to_loop(stackwise.flax.from_serving({"cache": cache}, "layers"), "layers")
    assert_trees_bitwise(back["cache"], cache_loop)
    back = stackwise.flax.from_serving({"params": served["params"]}, "layers")  # (cache donated)
    assert_trees_bitwise(back["params"], params)


@pytest.mark.slow
def test_qwix_quantized_params_serve_as_the_loop_of_qwix_blocks():
    """qwix PTQ on the Stack (its weights quantized per layer by
    `stackwise.flax.quantize_params`): each layer's int8 values and scales served, the
    outputs those of a loop of the blocks that qwix quantized one by one."""
    qwix = pytest.importorskip("qwix")
    provider = qwix.PtqProvider([qwix.QtRule(module_path=".*", weight_qtype="int8")])
    x0 = jnp.zeros((B, T, D))
    floats = Model(3).init(KEY, x0)
    qmodel, qloop = qwix.quantize_model(Model(3), provider), qwix.quantize_model(Loop(3), provider)
    params = stackwise.flax.quantize_params(
        floats["params"], jax.eval_shape(qmodel.init, KEY, x0)["params"]
    )
    quantized = {"params": params, "cache": floats["cache"]}
    served = stackwise.flax.to_serving(quantized, "layers")
    qvalue = served["params"]["layers"]["Dense_1"]["kernel"].array.qvalue
    assert isinstance(qvalue, stackwise.Serving) and qvalue.layers[0].dtype == jnp.int8
    ys, _ = _decode(jax.jit(_step(qmodel), donate_argnums=1), served)
    loop = stackwise.flax.to_loop(floats, "layers")
    loop_params = qwix.quantize_params(
        loop["params"], jax.eval_shape(qloop.init, KEY, x0)["params"]
    )
    ys_loop, _ = _decode(jax.jit(_step(qloop)), {"params": loop_params, "cache": loop["cache"]})
    ys_stack, _ = _decode(jax.jit(_step(qmodel)), quantized)
    for y, y_loop, y_stack in zip(ys, ys_loop, ys_stack, strict=True):
        assert_trees_bitwise(y, y_loop)
        assert_trees_close(y, y_stack)


class Boxed(nn.Module):
    """A block whose params are partitioned (`nn.with_partitioning` and its logical twin)."""

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.lecun_normal()
        kernel = self.param("kernel", nn.with_partitioning(init, (None, "model")), (D, D))
        scale = self.param(
            "scale", nn.with_logical_partitioning(nn.initializers.ones, ("embed",)), (D,)
        )
        return x + jnp.tanh(x @ kernel) * scale[None]


class BoxedModel(nn.Module):
    @nn.compact
    def __call__(self, x):
        return stackwise.flax.Stack(Boxed, 3, layer_axis_name="layers", name="layers")(x)


class BoxedLoop(nn.Module):
    @nn.compact
    def __call__(self, x):
        for i in range(3):
            x = Boxed(name=f"layers_{i}")(x)
        return x


def test_partitioned_variables_keep_their_boxes_around_the_served_layers():
    """A box stays around its `Serving` with the stacked names (the layer axis first): the
    Stack drops the layer axis per layer, as in the stacked layout, also under a mesh and
    logical rules (whose constraints then see per-layer names); back, bit for bit."""
    x = jax.random.normal(jax.random.key(2), (B, D))
    variables = BoxedModel().init(KEY, x)
    served = stackwise.flax.to_serving(variables, "layers")
    kernel = served["params"]["layers"]["kernel"]
    assert isinstance(kernel, nn.Partitioned) and isinstance(kernel.value, stackwise.Serving)
    assert kernel.names == ("layers", None, "model")
    assert_trees_bitwise(stackwise.flax.from_serving(served, "layers"), variables)
    assert jax.tree.structure(stackwise.flax.from_serving(served, "layers")) == jax.tree.structure(
        variables
    )
    loop = stackwise.flax.to_loop(variables, "layers", layer_axis_name="layers")
    y_loop = jax.jit(BoxedLoop().apply)(loop, x)
    assert_trees_bitwise(jax.jit(BoxedModel().apply)(served, x), y_loop)
    mesh = jax.make_mesh((1,), ("model",), axis_types=(jax.sharding.AxisType.Auto,))
    with jax.set_mesh(mesh), nn.logical_axis_rules([("embed", "model")]):
        assert_trees_bitwise(jax.jit(BoxedModel().apply)(served, x), y_loop)


class MixModel(nn.Module):
    remat: bool = True

    @nn.compact
    def __call__(self, x):
        return stackwise.flax.Stack(Mix, 3, remat=self.remat, name="layers")(x)


class MixLoop(nn.Module):
    @nn.compact
    def __call__(self, x):
        for i in range(3):
            x = Mix(name=f"layers_{i}")(x)
        return x


@pytest.mark.parametrize("remat", [True, False])
def test_gradients_through_served_params_are_the_loops(remat):
    """The layout is for inference, but the loop it runs is differentiable (remat per
    layer): the gradients, served like the params, are the loop's bit for bit."""
    x = jax.random.normal(jax.random.key(2), (B, D))
    variables = MixModel(remat).init(KEY, x)

    def grad(model, params):
        loss = lambda p: jnp.sum(jnp.sin(model.apply({"params": p}, x)))  # noqa: E731
        return jax.jit(jax.grad(loss))(params)

    g = grad(MixModel(remat), stackwise.flax.to_serving(variables, "layers")["params"])
    assert all(_kit.serving.is_serving(v) for v in _served_leaves(g))
    g_loop = grad(MixLoop(), stackwise.flax.to_loop(variables, "layers")["params"])
    back = stackwise.flax.from_serving({"params": g}, "layers")
    assert_trees_bitwise(stackwise.flax.to_loop(back, "layers")["params"], g_loop)


# The random search: the fast tier's round trip is test_round_trip_is_exact_in_every_collection[1].
@pytest.mark.slow
@settings(max_examples=8, deadline=None)
@given(
    n=st.integers(1, 5),
    k=st.integers(1, 3),
    width=st.integers(1, 4),
    dtype=st.sampled_from([jnp.float32, jnp.bfloat16, jnp.int8]),
)
def test_round_trip_whatever_the_depth_pattern_and_dtypes(n, k, width, dtype):
    """Any depth, pattern and dtypes: each position's leaves served as its own layers
    (position p: layers p, p + k, ...), and back bit for bit."""
    k = min(k, n)
    paths = [f"stack/P_{p}" for p in range(k)] if k > 1 else "stack"
    counts = [len(range(p, n, k)) for p in range(k)]
    rng = np.random.default_rng(n * 100 + k * 10 + width)

    def leaf(*shape):
        return jnp.asarray(rng.normal(size=shape) * 10).astype(dtype)

    positions = [{"w": leaf(c, width, 2), "b": leaf(c, 2)} for c in counts]
    stack = {f"P_{p}": t for p, t in enumerate(positions)} if k > 1 else positions[0]
    cache = {f"P_{p}": {"k": leaf(c, 3)} for p, c in enumerate(counts)} if k > 1 else {
        "k": leaf(n, 3)}  # fmt: skip
    variables = {"params": {"stack": stack, "head": leaf(width)}, "cache": {"stack": cache}}
    served = stackwise.flax.to_serving(variables, paths)
    assert_trees_bitwise(served["params"]["head"], variables["params"]["head"])
    for p, c in enumerate(counts):
        w = served["params"]["stack"][f"P_{p}"]["w"] if k > 1 else served["params"]["stack"]["w"]
        assert len(w) == c
        assert_trees_bitwise(w.layers[-1], positions[p]["w"][-1])
    assert_trees_bitwise(stackwise.flax.from_serving(served, paths), variables)


class Normed(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.BatchNorm(use_running_average=False)(nn.Dense(D)(x))


class NormedModel(nn.Module):
    @nn.compact
    def __call__(self, x):
        return stackwise.flax.Stack(Normed, 3, name="layers")(x)


class NormedLoop(nn.Module):
    @nn.compact
    def __call__(self, x):
        for i in range(3):
            x = Normed(name=f"layers_{i}")(x)
        return x


def test_every_mutable_collection_comes_back_served():
    """`mutable=True`: the params and the `batch_stats` come back served, each layer's the
    loop's, bit for bit."""
    x = jax.random.normal(jax.random.key(2), (B * 3, D))
    variables = NormedModel().init(KEY, x)
    served = stackwise.flax.to_serving(variables, "layers")
    y, new = jax.jit(lambda v: NormedModel().apply(v, x, mutable=True))(served)
    assert set(new) == {"params", "batch_stats"}
    assert all(_kit.serving.is_serving(v) for v in _served_leaves(new))
    loop = stackwise.flax.to_loop(variables, "layers")
    y_loop, new_loop = jax.jit(lambda v: NormedLoop().apply(v, x, mutable=True))(loop)
    assert_trees_bitwise(y, y_loop)
    back = stackwise.flax.to_loop(stackwise.flax.from_serving(new, "layers"), "layers")
    assert_trees_bitwise(back, new_loop)
