"""`stackwise.optax.layerwise` against the plain optimizer on the loop model's per-layer params.

The loop model's params are the stacked ones with every stacked leaf split into its layers
(a list of n leaves, as a Python loop of blocks holds them); the same gradients go to both.
After a few steps every leaf must agree to float32 rounding, and, for the optimizers that
look at a leaf's shape or norm, the unwrapped optimizer on the stacked params must not (so
the comparison can fail).
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _tolerance import LAMBDA, check, compare

import stackwise
import stackwise.optax as so

N, D, STEPS = 4, 8, 3

# The wrapped optimizer's params within ROUNDING_BOUND * eps * (the leaf's largest magnitude) of
# the loop model's (tests/_tolerance.py). Each step adds an update that may differ by float32
# reassociation (vmap, a layer's sums: norms, RMS, second moments over its D x D entries, within
# LAMBDA * sqrt(D * D) eps of the update) and rounds the sum to the params' float32: 1 eps of the
# params, and the updates are at most 0.1 of them (learning rates up to 0.1 on params of 0.25-1).
# Over STEPS steps: 3 * (1 + 0.1 * 6 * 8) = 18 eps (2e-6 on params of 0.96: the absolute 2e-6 it
# replaces). Measured: at most 1.3 eps (Muon); the unwrapped shape-aware optimizers, which must
# fall outside, are 420 (lars) to 570,000 eps away after one step.
ROUNDING_BOUND = math.ceil(STEPS * (1 + 0.1 * LAMBDA * math.sqrt(D * D)))


def _params(key=0, n=N):
    k = jax.random.split(jax.random.key(key), 3)
    return {
        "blocks": {"w": jax.random.normal(k[0], (n, D, D)) / D**0.5,
                   "b": 0.1 * jax.random.normal(k[1], (n, D))},
        "embed": jax.random.normal(k[2], (5, D)),
    }


STACKED = {"blocks": True, "embed": False}


def _loop(tree, depth_of):
    """Each stacked leaf split into (nested) lists of its layers: the loop model's params."""
    def split(a, d):
        return a if not d else [split(a[i], d - 1) for i in range(a.shape[0])]

    pairs, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return jax.tree.unflatten(
        treedef, [split(a, depth_of(jax.tree_util.keystr(p))) for p, a in pairs])


def _unloop(loop_tree, like, depth_of):
    def join(sub, d):
        return sub if not d else jnp.stack([join(s, d - 1) for s in sub])

    pairs, treedef = jax.tree_util.tree_flatten_with_path(like)
    subs = treedef.flatten_up_to(loop_tree)
    return jax.tree.unflatten(
        treedef, [join(s, depth_of(jax.tree_util.keystr(p))) for (p, _), s in zip(pairs, subs)])


def _grads(params, t):
    return jax.tree.map(lambda a: jnp.sin(3.0 * a + t) + 0.1 * t, params)


def _train(tx, params, steps=STEPS, edit=None):
    """``steps`` steps with made-up gradients, jitted (compiled once); the params after each."""

    @jax.jit
    def step(params, state, t):
        updates, state = tx.update(_grads(params, t), state, params)
        return optax.apply_updates(params, updates), state

    state = jax.jit(tx.init)(params)
    history = []
    for t in range(steps):
        if edit is not None:
            state = edit(t, state)
        params, state = step(params, state, t)
        history.append(params)
    return history


def _train_loop(tx, params, depth_of, steps=STEPS, edit=None):
    """The same steps for the loop model (the same gradients, split by layer)."""
    like = params

    @jax.jit
    def step(loop, state, t):
        grads = _loop(_grads(_unloop(loop, like, depth_of), t), depth_of)
        updates, state = tx.update(grads, state, loop)
        loop = optax.apply_updates(loop, updates)
        return loop, state, _unloop(loop, like, depth_of)

    loop = _loop(params, depth_of)
    state = jax.jit(tx.init)(loop)
    history = []
    for t in range(steps):
        if edit is not None:
            state = edit(t, state)
        loop, state, stacked = step(loop, state, t)
        history.append(stacked)
    return history


def _apart(a, b) -> float:
    """How far apart, in eps * (each leaf's largest |b|): ``_tolerance.compare``'s."""
    return compare(a, b)["in_eps"]


def _depth(path):
    return int("blocks" in path)


def _2d(tree):
    """Muon's dimension numbers for matrices, on every leaf (as a tree: optax 0.2.8's
    `scale_by_muon` maps them over the updates)."""
    return jax.tree.map(lambda _: optax.contrib.MuonDimensionNumbers(), tree)


OPTIMIZERS = {
    "adam": lambda: optax.adam(1e-2),
    "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
    "sgd_momentum": lambda: optax.sgd(1e-2, momentum=0.9),
    "lion": lambda: optax.lion(1e-2),
    "lamb": lambda: optax.lamb(1e-2),
    "lars": lambda: optax.lars(1.0),  # its trust coefficient 1e-3 makes steps small
    "adafactor": lambda: optax.adafactor(1e-2, min_dim_size_to_factor=4),
    "muon": lambda: optax.contrib.muon(1e-2),
    "adaptive_grad_clip": lambda: optax.chain(optax.adaptive_grad_clip(0.01), optax.sgd(1e-1)),
    "clip_by_block_rms": lambda: optax.chain(optax.clip_by_block_rms(0.1), optax.sgd(1e-1)),
    "clip_global_then_lamb": lambda: optax.chain(optax.clip_by_global_norm(0.5),
                                                 optax.lamb(1e-2)),
    # Not split, not known: runs on the loop view (exact).
    "apply_if_finite_lamb": lambda: optax.apply_if_finite(optax.lamb(1e-2), 3),
    # A partition labelled by shape (split: labels of one layer), Muon's own part in it.
    "partition_scale_by_muon": lambda: optax.partition(
        {"m": optax.chain(optax.contrib.scale_by_muon(ns_steps=2, weight_dimension_numbers=_2d),
                          optax.scale(-1e-2)),
         "a": optax.adam(1e-2)},
        lambda p: jax.tree.map(lambda x: "m" if x.ndim == 2 else "a", p)),
}
SHAPE_AWARE = {"lamb", "lars", "adafactor", "muon", "adaptive_grad_clip", "clip_by_block_rms",
               "clip_global_then_lamb", "apply_if_finite_lamb", "partition_scale_by_muon"}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_equals_the_loop_model(name):
    params = _params()
    wrapped = _train(so.layerwise(OPTIMIZERS[name](), STACKED), params)
    reference = _train_loop(OPTIMIZERS[name](), params, _depth)
    for step, (a, b) in enumerate(zip(wrapped, reference)):
        check(compare(a, b), ROUNDING_BOUND, f"step {step}")
    assert _apart(wrapped[-1], params) > 100 * ROUNDING_BOUND  # the params moved
    if name in SHAPE_AWARE:  # ... and unwrapped, the optimizer would train another model
        plain = _train(OPTIMIZERS[name](), params, steps=1)
        assert _apart(plain[0], reference[0]) > ROUNDING_BOUND


def _program(text: str) -> str:
    """A compiled program without its source locations (file and function names)."""
    text = re.sub(r",? ?metadata=\{[^}]*\}", "", text)
    return "\n".join(line for line in text.splitlines()
                     if not re.match(r'^\s*\d+ ["{]', line))


@pytest.mark.parametrize("name", ["adam", "adamw", "sgd_momentum", "lion"])
def test_elementwise_optimizers_compile_to_the_same_program(name):
    params = _params()
    plain, wrapped = OPTIMIZERS[name](), so.layerwise(OPTIMIZERS[name](), STACKED)
    args = (_grads(params, 0), plain.init(params), params)

    def programs(tx):
        lowered = jax.jit(tx.update).lower(*args)
        return lowered.as_text(debug_info=False), _program(lowered.compile().as_text())

    assert programs(wrapped) == programs(plain)


@pytest.mark.slow
def test_muon_runs_with_its_own_batch_axes():
    """`layerwise(contrib.muon)` is Muon with the layer axes as its batch axes (its weight
    dimension numbers shifted past them): the same compiled program, no vmap around it. With
    `test_equals_the_loop_model[muon]`, this shows `muon_dimensions` exact too."""
    params = _params()
    wrapped = so.layerwise(optax.contrib.muon(1e-2), STACKED)
    own = optax.contrib.muon(1e-2, muon_weight_dimension_numbers=so.muon_dimensions(STACKED))
    state = wrapped.init(params)
    assert jax.tree.structure(state) == jax.tree.structure(own.init(params))

    def program(tx):
        lowered = jax.jit(tx.update).lower(_grads(params, 0), state, params)
        return _program(lowered.compile().as_text())

    assert program(wrapped) == program(own)


def test_state_placed_as_the_params_are():
    """The state of a per-layer part is committed to a device only where its param is: an
    uncommitted state of committed params (or the reverse) would make a jitted step's second
    call compile again."""
    tx = so.layerwise(optax.adafactor(1e-2), STACKED)  # per layer; `b` unfactored
    params = _params()
    assert not any(a.committed for a in jax.tree.leaves(tx.init(params)))
    placed = jax.device_put(params, jax.devices()[0])
    like_b = [a for a in jax.tree.leaves(tx.init(placed)) if a.shape == (N, D)]
    assert like_b and all(a.committed for a in like_b)


@pytest.mark.slow
def test_inject_hyperparams_learning_rate_changed_during_training():
    def edit(t, state):
        if t == 2:  # halve the learning rate before the third step, as a user would
            state.hyperparams["learning_rate"] = state.hyperparams["learning_rate"] * 0.5
        return state

    make = lambda: optax.inject_hyperparams(optax.lamb)(learning_rate=1e-2)  # noqa: E731
    params = _params()
    wrapped = _train(so.layerwise(make(), STACKED), params, edit=edit)
    reference = _train_loop(make(), params, _depth, edit=edit)
    check(compare(wrapped[-1], reference[-1]), ROUNDING_BOUND)
    state = so.layerwise(make(), STACKED).init(params)
    assert state.hyperparams["learning_rate"].shape == ()  # shared, not per layer


@pytest.mark.slow
def test_a_pattern_of_positions_with_different_numbers_of_layers():
    # stackwise.stack([a, b], ..., n=5): a tuple of 2 stacked trees, of 3 and 2 layers.
    dense = lambda k: {"w": jax.random.normal(k, (D, D))}  # noqa: E731
    wide = lambda k: {"w": jax.random.normal(k, (D, 2 * D)), "s": jnp.ones((D,))}  # noqa: E731
    layers = stackwise.stack([dense, wide], [lambda p, x: x, lambda p, x: x], n=5)
    params = {"stack": layers.init(jax.random.key(1)), "head": jnp.ones((D, 3))}
    assert [p["w"].shape[0] for p in params["stack"]] == [3, 2]
    stacked = {"stack": True, "head": False}
    depth = lambda path: int("stack" in path)  # noqa: E731
    make = OPTIMIZERS["adaptive_grad_clip"]
    wrapped = _train(so.layerwise(make(), stacked), params)
    reference = _train_loop(make(), params, depth)
    check(compare(wrapped[-1], reference[-1]), ROUNDING_BOUND)


@pytest.mark.slow
def test_nested_stacks():
    params = {"w": jax.random.normal(jax.random.key(2), (2, 3, D, D)), "b": jnp.ones((2, 3, D))}
    make = OPTIMIZERS["adaptive_grad_clip"]
    wrapped = _train(so.layerwise(make(), stacked=2), params)
    reference = _train_loop(make(), params, lambda path: 2)
    check(compare(wrapped[-1], reference[-1]), ROUNDING_BOUND)


@pytest.mark.slow
def test_per_layer_controls_on_a_pattern_equal_per_layer_multi_transform():
    """A pattern of k=2 positions, n=5 layers (3 and 2 rows): layer i is row i // 2 of
    position i % 2. Freezing, layer-wise decay and a weight-decay mask name the model's
    layers; the loop model (the layers in order) gets one transformation per layer."""
    n, k, frozen, decayed, lr = 5, 2, (0, 3), (1, 4), 1e-2
    dense = lambda key: {"w": jax.random.normal(key, (D, D)) / D**0.5}  # noqa: E731
    wide = lambda key: {"w": jax.random.normal(key, (D, 2 * D)), "s": jnp.ones(D)}  # noqa: E731
    layers = stackwise.stack([dense, wide], [lambda p, x: x, lambda p, x: x], n=n)
    params = {"stack": layers.init(jax.random.key(1)), "head": jnp.ones((D, 3))}
    scales = so.layer_decay(0.5, n)
    tx = so.layerwise(
        optax.chain(optax.clip_by_global_norm(0.5), optax.scale_by_adam(),
                    so.layer_mask(optax.add_decayed_weights(0.5), decayed,
                                  {"stack": so.pattern(n, k), "head": False}),
                    optax.scale(-lr)),
        {"stack": so.pattern(n, k), "head": False}, freeze=frozen, lr_scale=scales)
    history = _train(tx, params)

    def per_layer(i, scale=1.0):
        decay = [optax.add_decayed_weights(0.5)] if i in decayed else []
        return optax.chain(optax.scale_by_adam(), *decay, optax.scale(-lr * scale))

    def labels(tree, name):
        return {"layers": [jax.tree.map(lambda _, i=i: "frozen" if i in frozen else name(i),
                                        layer) for i, layer in enumerate(tree["layers"])],
                "head": "head"}

    # The frozen layers' gradients are zeros before the global norm, as `freeze` says.
    reference_tx = optax.chain(
        optax.multi_transform({"frozen": optax.set_to_zero(), "rest": optax.identity(),
                               "head": optax.identity()}, lambda t: labels(t, lambda i: "rest")),
        optax.clip_by_global_norm(0.5),
        optax.multi_transform({**{f"layer{i}": per_layer(i, float(scales[i])) for i in range(n)},
                               "frozen": optax.set_to_zero(), "head": per_layer(-1)},
                              lambda t: labels(t, lambda i: f"layer{i}")))

    @jax.jit
    def loop_step(loop, state, t):
        stacked = {"stack": stackwise.stack_layers(loop["layers"], pattern=k),
                   "head": loop["head"]}
        grads = _grads(stacked, t)
        grads = {"layers": stackwise.unstack_layers(grads["stack"], pattern=k),
                 "head": grads["head"]}
        updates, state = reference_tx.update(grads, state, loop)
        return optax.apply_updates(loop, updates), state

    loop = {"layers": stackwise.unstack_layers(params["stack"], pattern=k),
            "head": params["head"]}
    state = reference_tx.init(loop)
    for t in range(STEPS):
        loop, state = loop_step(loop, state, t)
    want = {"stack": stackwise.stack_layers(loop["layers"], pattern=k), "head": loop["head"]}
    check(compare(history[-1], want), ROUNDING_BOUND)
    for p in range(k):  # layers 0 and 3: row 0 of position 0, row 1 of position 1
        rows = np.array([i // k for i in frozen if i % k == p])
        for a, b in zip(jax.tree.leaves(history[-1]["stack"][p]),
                        jax.tree.leaves(params["stack"][p])):
            assert jnp.array_equal(a[rows], b[rows])
            assert not jnp.array_equal(a, b)


def test_freezing_layers_0_and_1_of_4():
    params = _params()
    make = lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2))  # noqa: E731
    history = _train(so.layerwise(make(), STACKED, freeze=[0, 1]), params)
    w0, w = params["blocks"]["w"], history[-1]["blocks"]["w"]
    assert jnp.array_equal(w[:2], w0[:2]) and jnp.array_equal(
        history[-1]["blocks"]["b"][:2], params["blocks"]["b"][:2])
    assert bool(jnp.all(jnp.any(w[2:] != w0[2:], axis=(1, 2))))
    assert not jnp.array_equal(history[-1]["embed"], params["embed"])

    # The loop model with per-layer optax.multi_transform: layers 0-1 set_to_zero.
    def labels(loop):
        blocks = jax.tree.map(lambda _: "train", loop["blocks"])
        for layer in blocks.values():
            layer[0] = layer[1] = "frozen"
        return {"blocks": blocks, "embed": "train"}

    reference = _train_loop(
        optax.multi_transform({"train": make(), "frozen": optax.set_to_zero()}, labels),
        params, _depth)
    check(compare(history[-1], reference[-1]), ROUNDING_BOUND)


def _per_layer(loop, name_of_layer, other):
    blocks = {k: [name_of_layer(i) for i in range(len(v))] for k, v in loop["blocks"].items()}
    return {"blocks": blocks, "embed": other}


@pytest.mark.slow
def test_layer_decay_equals_per_layer_multi_transform():
    params = _params()
    scales = so.layer_decay(0.5, N)
    history = _train(so.layerwise(optax.adamw(1e-2), STACKED, lr_scale=scales), params)
    per_layer = {f"layer{i}": optax.adamw(1e-2 * float(s)) for i, s in enumerate(scales)}
    reference = _train_loop(
        optax.multi_transform({**per_layer, "embed": optax.adamw(1e-2)},
                              lambda loop: _per_layer(loop, lambda i: f"layer{i}", "embed")),
        params, _depth)
    check(compare(history[-1], reference[-1]), ROUNDING_BOUND)


@pytest.mark.slow
def test_weight_decay_on_some_layers_equals_per_layer_multi_transform():
    params = _params()
    tx = so.layerwise(optax.chain(
        optax.scale_by_adam(),
        so.layer_mask(optax.add_decayed_weights(0.5), layers=[1, 3], stacked=STACKED),
        optax.scale(-1e-2)), STACKED)
    history = _train(tx, params)
    decayed = lambda i: "decay" if i in (1, 3) else "plain"  # noqa: E731
    reference = _train_loop(
        optax.multi_transform({"decay": optax.adamw(1e-2, weight_decay=0.5),
                               "plain": optax.adam(1e-2)},
                              lambda loop: _per_layer(loop, decayed, "plain")),
        params, _depth)
    check(compare(history[-1], reference[-1]), ROUNDING_BOUND)


def test_layer_indices_read_as_in_the_core():
    """`freeze=` / `layers=` take what `stackwise._core.checks.layer_number` takes: NumPy integers,
    and negative indices counting from the end, per leaf (bitwise the same updates)."""
    params = {"w": jnp.arange(1.0, 25.0).reshape(N, 2, 3), "e": jnp.ones(3)}
    stacked = {"w": np.True_, "e": False}
    grads = jax.tree.map(jnp.ones_like, params)

    def step(tx):
        return tx.update(grads, tx.init(params), params)[0]

    plain = step(so.layerwise(optax.adam(1e-2), stacked, freeze=[2, 3]))
    assert not jnp.any(plain["w"][2:]) and jnp.all(plain["w"][:2])
    for freeze in ([np.int64(-2), -1], np.array([2, 3]), range(-2, 0)):
        same = step(so.layerwise(optax.adam(1e-2), stacked, freeze=freeze))
        assert all(jnp.array_equal(a, b) for a, b in zip(jax.tree.leaves(same),
                                                         jax.tree.leaves(plain)))
    masked = step(so.layer_mask(optax.add_decayed_weights(0.5), np.int32(-1), stacked))
    assert masked["w"][:, 0, 0].tolist() == [1.0, 1.0, 1.0, 1.0 + 0.5 * 19.0]
    assert so.layer_decay(0.5, np.int64(2)).tolist() == [0.5, 1.0]


def test_numbers_and_abstract_leaves_where_shapes_suffice():
    """A Python number among the params is a leaf of shape () (as optax's elementwise
    transformations take it); `muon_dimensions` reads abstract params (`jax.eval_shape`) as
    concrete ones."""
    params = {"w": jnp.arange(36.0).reshape(N, 3, 3), "scale": 2.0}
    grads = {"w": jnp.ones((N, 3, 3)), "scale": 1.0}
    tx = so.layerwise(optax.adamw(1e-2), {"w": True, "scale": False}, freeze=[0])
    u, _ = tx.update(grads, tx.init(params), params)
    plain = optax.adamw(1e-2)
    want, _ = plain.update(grads, plain.init(params), params)
    assert jnp.array_equal(u["scale"], want["scale"]) and jnp.array_equal(u["w"][1:], want["w"][1:])
    dims = so.muon_dimensions({"w": True, "scale": False})
    abstract = jax.eval_shape(lambda: params)
    assert dims(abstract) == dims(params) and dims(params)["scale"] is None
    assert dims(abstract)["w"].reduction_axis == (1,)
