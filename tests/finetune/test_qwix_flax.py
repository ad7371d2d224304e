"""qwix on `stackwise.flax.Stack` (linen), against a Python loop of the same blocks with the
same qwix treatment: LoRA and QLoRA (int8, nf4) outputs and LoRA gradients, PTQ through the
bridge `stackwise.flax.quantize_params` (each layer's scales those of its own block in the
loop), a pattern, and a param a transformation adds inside the layer kept stacked."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _tolerance import assert_close, reassociation_bound
from _trees import assert_trees_bitwise
from _versions import EXACT_SCALES, EXACT_SCALES_WHY
from hypothesis import given, settings
from hypothesis import strategies as st

import stackwise
import stackwise.flax

qwix = pytest.importorskip("qwix")

N, D, H, R = 3, 8, 16, 2
KEY = jax.random.key(0)
X = jax.random.normal(jax.random.key(1), (4, D))
BOUND = reassociation_bound(depth=N, width=(D, H, R), summed=4 * D)


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + nn.Dense(D, name="down")(jnp.tanh(nn.Dense(H, name="up")(x)))


class Scale(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + 0.5 * jnp.tanh(nn.Dense(D, name="proj")(x))


def _stacked(blocks, remat=stackwise.DEFAULT_REMAT, n=N):
    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            return stackwise.flax.Stack(blocks, n=n, remat=remat, name="layers")(x)

    return Model()


def _loop(blocks, n=N):
    kinds = blocks if isinstance(blocks, list) else [blocks]

    class Loop(nn.Module):
        @nn.compact
        def __call__(self, x):
            for i in range(n):
                x = kinds[i % len(kinds)](name=f"layers_{i}")(x)
            return x

    return Loop()


def _lora(qtype):
    return qwix.LoraProvider(module_path=".*", rank=R, alpha=2.0, weight_qtype=qtype)


def _ptq(qtype):
    return qwix.PtqProvider([qwix.QtRule(module_path=".*", weight_qtype=qtype)])


def _as_loop(params, blocks):
    """The stack's params in the loop's layout (position names for a pattern)."""
    if not isinstance(blocks, list):
        return stackwise.flax.to_loop({"params": params}, "layers")["params"]
    out = {}
    for i in range(N):
        name = f"{blocks[i % 2].__name__}_0"
        out[f"layers_{i}"] = jax.tree.map(lambda a, i=i: a[i // 2], params["layers"][name])
    return out


def _trained(params):
    """LoRA params as if trained a little (b starts at 0: no change at all)."""
    return jax.tree_util.tree_map_with_path(
        lambda p, v: v + 0.1 if "lora" in jax.tree_util.keystr(p) else v, params
    )


def _quantized(model, provider, floats):
    """The float params quantized for ``provider`` (per layer inside a Stack) plus the
    quantized model's own LoRA params: (quantized model, its params)."""
    qmodel = qwix.quantize_model(model, provider)
    abstract = jax.eval_shape(qmodel.init, KEY, X)["params"]
    inited = qmodel.init(KEY, X)["params"]
    bridge = stackwise.flax.quantize_params if "layers" in floats else qwix.quantize_params
    params = bridge(floats, abstract)
    lora = {"/".join(map(str, k)): v for k, v in _flat(inited).items() if "lora" in k[-1]}
    flat = _flat(params) | {tuple(k.split("/")): v for k, v in lora.items()}
    return qmodel, _trained(_unflat(flat))


def _flat(tree):
    from flax import traverse_util

    return traverse_util.flatten_dict(tree)


def _unflat(flat):
    from flax import traverse_util

    return traverse_util.unflatten_dict(flat)


def _check_against_loop(blocks, provider, remat):
    floats = _stacked(blocks, remat).init(KEY, X)["params"]
    qstack, params = _quantized(_stacked(blocks, remat), provider, floats)
    qloop = qwix.quantize_model(_loop(blocks), provider)
    # The loop's own blocks, quantized by qwix one by one; its LoRA params the stack's.
    loop_q = qwix.quantize_params(
        _as_loop(floats, blocks), jax.eval_shape(qloop.init, KEY, X)["params"]
    )
    from_stack = _as_loop(params, blocks)
    base = {k: v for k, v in _flat(from_stack).items() if "lora" not in k[-1]}
    assert_trees_bitwise(_unflat(base), loop_q)  # per-layer scales, exactly the loop's
    loop_params = from_stack

    def loss(lora, frozen, model):
        params = _unflat(_flat(lora) | _flat(frozen))
        return jnp.sum(jnp.sin(model.apply({"params": params}, X)))

    def grads(params, model):
        flat = _flat(params)
        lora = _unflat({k: v for k, v in flat.items() if "lora" in k[-1]})
        frozen = _unflat({k: v for k, v in flat.items() if "lora" not in k[-1]})
        return jax.jit(jax.grad(functools.partial(loss, model=model)))(lora, frozen)

    # (Jitted: one program each, not one per op and shape of the loop's qwix blocks.)
    y = jax.jit(qstack.apply)({"params": params}, X)
    y_loop = jax.jit(qloop.apply)({"params": loop_params}, X)
    assert_close(y, y_loop, BOUND, what="outputs")
    g, g_loop = _as_loop(grads(params, qstack), blocks), grads(loop_params, qloop)
    assert _flat(g) and _flat(g).keys() == _flat(g_loop).keys()
    assert_close(g, g_loop, BOUND, what="LoRA gradients")


@pytest.mark.parametrize("qtype", ["int8", None, "nf4"])  # the fast tier: int8
def test_lora_and_qlora_equal_the_loop(qtype):
    _check_against_loop(Block, _lora(qtype), stackwise.DEFAULT_REMAT)


# The Stack warns of remat=False on a quantized base (tests/finetune/test_qwix_remat.py).
@pytest.mark.filterwarnings("ignore:.*remat=False with a quantized base:UserWarning")
@pytest.mark.slow
@pytest.mark.parametrize("qtype", [None, "int8", "nf4"])
def test_lora_and_qlora_equal_the_loop_without_remat(qtype):
    _check_against_loop(Block, _lora(qtype), False)


@pytest.mark.slow
@pytest.mark.parametrize("qtype", ["int8", "nf4"])
def test_qlora_on_a_pattern_equals_the_loop(qtype):
    _check_against_loop([Block, Scale], _lora(qtype), stackwise.DEFAULT_REMAT)


@pytest.mark.parametrize("qtype", ["int8", "nf4"])
def test_ptq_through_the_bridge_equals_the_loop(qtype):
    """qwix's own `quantize_params` would give the stacked kernel scales across the layer
    axis ((1, in, 1)); the bridge's are per layer, equal to each loop block's."""
    floats = _stacked(Block).init(KEY, X)["params"]
    qstack = qwix.quantize_model(_stacked(Block), _ptq(qtype))
    abstract = jax.eval_shape(qstack.init, KEY, X)["params"]
    wrong = qwix.quantize_params(floats, abstract)["layers"]["up"]["kernel"].array.scale
    assert wrong.shape[0] != N
    params = stackwise.flax.quantize_params(floats, abstract)
    assert params["layers"]["up"]["kernel"].array.scale.shape[0] == N
    qloop = qwix.quantize_model(_loop(Block), _ptq(qtype))
    loop_params = qwix.quantize_params(
        _as_loop(floats, Block), jax.eval_shape(qloop.init, KEY, X)["params"]
    )
    assert_trees_bitwise(_as_loop(params, Block), loop_params)
    y = jax.jit(qstack.apply)({"params": params}, X)
    assert_close(y, qloop.apply({"params": loop_params}, X), BOUND)


def test_params_outside_the_stack_are_quantized_as_qwix_does():
    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Dense(D, name="embed")(x)
            return stackwise.flax.Stack(Block, n=N, name="layers")(x)

    floats = Model().init(KEY, X)["params"]
    qmodel = qwix.quantize_model(Model(), _ptq("int8"))
    abstract = jax.eval_shape(qmodel.init, KEY, X)["params"]
    ours = stackwise.flax.quantize_params(floats, abstract)
    theirs = qwix.quantize_params({"embed": floats["embed"]}, {"embed": abstract["embed"]})
    assert_trees_bitwise(ours["embed"], theirs["embed"])
    assert ours["layers"]["up"]["kernel"].array.scale.shape == (N, 1, H)


def test_a_param_added_inside_the_layer_is_kept_stacked():
    """A param the block creates on a later call (mutable params), as a transformation
    adding adapters does: one per layer, each the loop block's."""

    class Grows(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Dense(D, name="w")(x)
            if self.is_mutable_collection("params") and not self.is_initializing():
                x = x + self.param("extra", lambda _, x: jnp.mean(x, 0, keepdims=True), x)
            elif self.has_variable("params", "extra"):
                x = x + self.get_variable("params", "extra")
            return x

    variables = _stacked(Grows).init(KEY, X)
    y, grown = _stacked(Grows).apply(variables, X, mutable=["params"], rngs={"params": KEY})
    extra = grown["params"]["layers"]["extra"]
    assert extra.shape == (N, 1, D)
    loop_vars = {"params": _as_loop(variables["params"], Grows)}
    y_loop, loop_grown = _loop(Grows).apply(loop_vars, X, mutable=["params"], rngs={"params": KEY})
    assert_close(y, y_loop, BOUND)
    for i in range(N):
        assert_close(extra[i], loop_grown["params"][f"layers_{i}"]["extra"], BOUND)
    y_again = _stacked(Grows).apply(grown, X)
    np.testing.assert_array_equal(y_again, y)


@pytest.mark.slow
@pytest.mark.skipif(not EXACT_SCALES, reason=EXACT_SCALES_WHY)  # (fake quantization: codes)
def test_qat_equals_the_loop():
    """Fake-quantized training with static activation scales: each layer's statistics
    (the `quant_stats` collection) stacked; outputs, gradients and updated statistics are
    the loop's."""
    rule = qwix.QtRule(
        module_path=".*", weight_qtype="int8", act_qtype="int8", act_static_scale=True
    )
    qstack = qwix.quantize_model(_stacked(Block), qwix.QtProvider([rule]))
    qloop = qwix.quantize_model(_loop(Block), qwix.QtProvider([rule]))
    variables = qstack.init(KEY, X)
    assert {v.shape[0] for v in jax.tree.leaves(variables["quant_stats"])} == {N}
    loop_vars = stackwise.flax.to_loop(variables, "layers")

    def loss(params, rest, model):
        y, new = model.apply({"params": params, **rest}, X, mutable=["quant_stats"])
        return jnp.sum(jnp.sin(y)), new

    rest = {"quant_stats": variables["quant_stats"]}
    loop_rest = {"quant_stats": loop_vars["quant_stats"]}
    (value, new), g = jax.value_and_grad(loss, has_aux=True)(variables["params"], rest, qstack)
    (value_loop, new_loop), g_loop = jax.value_and_grad(loss, has_aux=True)(
        loop_vars["params"], loop_rest, qloop
    )
    assert_close(value, value_loop, BOUND, what="loss")
    assert_close(_as_loop(g, Block), g_loop, BOUND, what="gradients")
    stats = stackwise.flax.to_loop(new, "layers")["quant_stats"]
    assert_close(stats, new_loop["quant_stats"], BOUND, what="statistics")


@pytest.mark.slow
@settings(max_examples=8, deadline=None)
@given(n=st.integers(1, 4), d=st.integers(1, 6), qtype=st.sampled_from(["int8", "nf4"]))
def test_the_bridge_quantizes_each_layer_as_its_block_alone(n, d, qtype):
    """Whatever the depth and width: layer i of the bridge's result is qwix's quantization
    of layer i's float params on their own, bit for bit."""
    x = jnp.ones((2, d))
    stack = stackwise.flax.Stack(nn.Dense(d), n=n)
    floats = stack.init(KEY, x)["params"]
    qstack = qwix.quantize_model(stack, _ptq(qtype))
    quantized = stackwise.flax.quantize_params(
        floats, jax.eval_shape(qstack.init, KEY, x)["params"]
    )
    one = qwix.quantize_model(nn.Dense(d), _ptq(qtype))
    abstract_one = jax.eval_shape(one.init, KEY, x)["params"]
    for i in range(n):
        alone = qwix.quantize_params(jax.tree.map(lambda a, i=i: a[i], floats), abstract_one)
        assert_trees_bitwise(jax.tree.map(lambda a, i=i: a[i], quantized), alone)
