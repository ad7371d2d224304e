"""A batch of g LoRA adapters in one call on the adapters' Stacks (Haiku, Linen, NNX, Equinox).

`attach(base, stack_adapters([ad_0, ..., ad_{g-1}]), per_leaf=True)` in a Stack's params runs
group j of x's leading axis with adapter j, on the one base: equal to each adapter alone on
its group's rows (itself equal to a loop of the block: test_adapters.py), for outputs and
the adapters' gradients of a loss summed over the groups; with a float, int8 or nf4 base, a
pattern, and every remat, unroll, nesting and reverse. State the groups share (an RNG count,
running averages read only) is kept; random keys reach every group alike. The compiled
program holds the base once and one adapted layer per group."""

from __future__ import annotations

import contextlib
import functools

import equinox as eqx
import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp
import pytest
from _frameworks import FRAMEWORKS, D
from _programs import on_cpu
from _reference import trained
from _trees import assert_trees_close
from flax import nnx

import stackwise
import stackwise.equinox
import stackwise.flax
import stackwise.haiku
import stackwise.nnx

G, R = 3, 2
X = jax.random.normal(jax.random.key(1), (G, 4, D))  # (g, rows, d)
POLICY = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
is_lora = lambda v: isinstance(v, stackwise.lora.LoraWeights)  # noqa: E731


def _each(base, g=G):
    """g different adapters of one base, as if trained (`a` and `b` moved apart)."""
    return [trained(stackwise.lora.init(jax.random.key(s), base, rank=R), seed=s)
            for s in range(g)]


def _lora(tree):
    return [v for v in jax.tree.leaves(tree, is_leaf=is_lora) if is_lora(v)]


def _unrematted(on: bool):
    """`remat=False` with a quantized base warns at each call (test_adapters.py checks it)."""
    return pytest.warns(UserWarning, match="remat=False") if on else contextlib.nullcontext()


def _assert_batch_is_each_alone(fw, base, x=X):
    """The batch's outputs and gradients against each adapter alone on its group's rows."""
    each = _each(base, len(x))
    params = stackwise.lora.attach(base, stackwise.lora.stack_adapters(each), per_leaf=True)
    trainable, frozen = stackwise.lora.split(params)

    def loss(trainable):
        return jnp.sum(jnp.sin(fw.run_batch(stackwise.lora.combine(trainable, frozen), x)))

    def loss_alone(adapters, j):
        return jnp.sum(jnp.sin(fw.run_stack(
            stackwise.lora.attach(base, adapters, per_leaf=True), x[j])))

    y = jax.jit(fw.run_batch)(params, x)
    grads = _lora(jax.jit(jax.grad(loss))(trainable))  # a (n, g, in, r), b (n, g, r, out)
    assert grads and grads[0].a.shape[1] == len(x)
    for j, adapters in enumerate(each):
        alone = stackwise.lora.attach(base, adapters, per_leaf=True)
        assert_trees_close(y[j], fw.run_stack(alone, x[j]))
        want = _lora(jax.grad(loss_alone)(adapters, j))
        assert_trees_close([(g.a[:, j], g.b[:, j]) for g in grads], [(w.a, w.b) for w in want])
    assert float(jnp.abs(y[0] - y[1]).max()) > 0.1  # the groups differ


CASES = {  # (base, Stack options)
    "float-default": (None, {}),
    "int8-default": ("int8", {}),
    "nf4-no-remat": ("nf4", {"remat": False}),
    "float-remat-unroll-nested": (None, {"remat": True, "unroll": 2, "nested": 2}),
    "int8-policy-reverse": ("int8", {"remat": POLICY, "reverse": True}),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("framework", list(FRAMEWORKS))
def test_a_batch_equals_each_adapter_alone(framework, case):
    kind, options = CASES[case]
    options = {"remat": stackwise.DEFAULT_REMAT, **options}
    fw = FRAMEWORKS[framework](**options)
    base = fw.base if kind is None else stackwise.quant.quantize(fw.base, kind)
    with _unrematted(kind is not None and options["remat"] is False):
        _assert_batch_is_each_alone(fw, base)


@pytest.mark.slow  # (a variant: the fast tier has the plain stack's)
@pytest.mark.parametrize("framework", list(FRAMEWORKS))
def test_a_batch_in_a_pattern(framework):
    fw = FRAMEWORKS[framework](stackwise.DEFAULT_REMAT, n=5, pattern=True)
    _assert_batch_is_each_alone(fw, stackwise.quant.quantize(fw.base, "nf4"))


# --------------------------------------------------------------------------
# State the groups share, and random keys.


class LinenBlock(nn.Module):
    """Dense, dropout (train), BatchNorm reading its running averages."""

    @nn.compact
    def __call__(self, x):
        x = nn.Dropout(0.5, deterministic=False)(nn.Dense(D)(x))
        return nn.BatchNorm(use_running_average=True)(x)


def test_linen_running_averages_and_dropout_reach_every_group():
    """Read-only `batch_stats` in a mutable collection come back as they were; the dropout
    key is one for all groups, so group j equals adapter j alone with that key."""
    stack = stackwise.flax.Stack(LinenBlock, n=3)
    rngs = {"params": jax.random.key(0), "dropout": jax.random.key(1)}
    variables = stack.init(rngs, X[0])
    each = _each(variables["params"])
    params = stackwise.lora.attach(variables["params"], stackwise.lora.stack_adapters(each),
                                   per_leaf=True)

    def run(params, x):
        return stack.apply({**variables, "params": params}, x, rngs={"dropout": rngs["dropout"]},
                           mutable=["batch_stats"])

    y, new = run(params, X)
    assert_trees_close(new, {"batch_stats": variables["batch_stats"]})
    for j, adapters in enumerate(each):
        alone, _ = run(stackwise.lora.attach(variables["params"], adapters, per_leaf=True), X[j])
        assert_trees_close(y[j], alone)


def test_haiku_state_every_group_updates_alike_is_kept():
    def block(x):
        count = hk.get_state("count", (), jnp.int32, jnp.zeros)
        hk.set_state("count", count + 1)
        return x + jnp.tanh(hk.Linear(D)(x)) * count

    forward = hk.transform_with_state(lambda x: stackwise.haiku.Stack(block, n=3)(x))
    base, state = forward.init(jax.random.key(0), X[0])
    state = jax.tree.map(lambda v: v + 1, state)
    each = _each(base)
    params = stackwise.lora.attach(base, stackwise.lora.stack_adapters(each), per_leaf=True)
    y, new = forward.apply(params, state, None, X)
    for j, adapters in enumerate(each):
        alone, new_alone = forward.apply(
            stackwise.lora.attach(base, adapters, per_leaf=True), state, None, X[j])
        assert_trees_close(y[j], alone)
        assert_trees_close(new, new_alone)


class NnxBlock(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(D, D, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return x + jnp.tanh(self.drop(self.linear(x)))


def test_nnx_rng_streams_in_the_block_reach_every_group():
    """The block's own `nnx.Rngs` (a dropout's) draw one key per layer for all groups and
    advance once, as for one adapter alone."""
    graphdef, base, rest = nnx.split(stackwise.nnx.Stack(NnxBlock, 3, rngs=nnx.Rngs(0)),
                                     nnx.Param, ...)
    each = _each(base)
    fresh = lambda: jax.tree.map(lambda v: v, rest)  # noqa: E731  (a model's own Variables)
    params = stackwise.lora.attach(base, stackwise.lora.stack_adapters(each), per_leaf=True)
    model = nnx.merge(graphdef, params, fresh())
    y = model(X)
    for j, adapters in enumerate(each):
        alone = stackwise.lora.attach(base, adapters, per_leaf=True)
        alone = nnx.merge(graphdef, alone, fresh())
        assert_trees_close(y[j], alone(X[j]))
        assert_trees_close(nnx.state(alone, nnx.RngCount), nnx.state(model, nnx.RngCount))
    assert int(jax.tree.leaves(nnx.state(model, nnx.RngCount))[0][0]) == 1


class EqxBlock(eqx.Module):
    linear: eqx.nn.Linear
    drop: eqx.nn.Dropout

    def __init__(self, *, key):
        self.linear, self.drop = eqx.nn.Linear(D, D, key=key), eqx.nn.Dropout(0.5)

    def __call__(self, x, *, key):
        return x + jnp.tanh(self.drop(self.linear(x), key=key))


def test_equinox_key_reaches_every_group():
    stack = stackwise.equinox.Stack(EqxBlock, 3, key=jax.random.key(0))
    each, key = _each(stack), jax.random.key(3)
    batch = stackwise.lora.attach(stack, stackwise.lora.stack_adapters(each), per_leaf=True)
    y = jax.vmap(functools.partial(batch, key=key), in_axes=1, out_axes=1)(X)
    for j, adapters in enumerate(each):
        alone = stackwise.lora.attach(stack, adapters, per_leaf=True)
        assert_trees_close(y[j], jax.vmap(functools.partial(alone, key=key))(X[j]))


# --------------------------------------------------------------------------
# Without a copy: the compiled program.


def _compiled(framework: str, g: int, n: int, d: int):
    """``jit(grad)`` w.r.t. a batch of g adapters of an nf4 base: memory, and the bytes of
    the trainable and frozen halves given to it."""
    fw = FRAMEWORKS[framework](stackwise.DEFAULT_REMAT, n=n, d=d)
    base = stackwise.quant.quantize(fw.base, "nf4")
    one = stackwise.lora.init(jax.random.key(2), base, rank=4)
    params = stackwise.lora.attach(base, stackwise.lora.stack_adapters([one] * g), per_leaf=True)
    trainable, frozen = stackwise.lora.split(params)
    x = jnp.ones((g, 2, d))

    def loss(trainable, frozen):
        return jnp.sum(fw.run_batch(stackwise.lora.combine(trainable, frozen), x))

    memory = jax.jit(jax.grad(loss)).lower(trainable, frozen).compile().memory_analysis()
    nbytes = lambda t: sum(v.nbytes for v in jax.tree.leaves(t))  # noqa: E731
    return memory, nbytes(trainable), nbytes(frozen)


@pytest.mark.parametrize("framework", list(FRAMEWORKS))
def test_the_base_is_held_once_and_each_group_adds_one_layer(framework):
    """n=16 layers, d=256, an nf4 base, rank 4. The program's arguments are the base once and
    the g adapters; from g=2 to g=4 its temporaries grow by about one layer's adapted weight
    per group (measured: 0.84 and 1.42 MiB in every framework, 0.29 MiB per group against one
    layer's 0.25 MiB), not by a copy of the base (4 MiB in float32)."""
    n, d = 16, 256
    layer = d * d * 4
    temps = {}
    for g in (2, 4):
        memory, trainable, frozen = _compiled(framework, g, n, d)
        if on_cpu():  # XLA:CPU's argument bytes are the arrays' own (a TPU pads a (d, 4) leaf)
            assert memory.argument_size_in_bytes == trainable + frozen
        assert trainable == g * n * 2 * d * 4 * 4  # a (d, 4) and b (4, d) per group and layer
        temps[g] = memory.temp_size_in_bytes
    per_group = (temps[4] - temps[2]) / 2
    assert per_group < n * layer / 2, (temps, layer)  # no float copy of the base per group
    if on_cpu():  # and on XLA:CPU, about one layer's adapted weight (tests/_programs.py)
        assert 0.5 * layer < per_group < 1.5 * layer, (temps, layer)
