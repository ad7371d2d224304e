"""`stackwise.lora` against the loop model: outputs and the adapters' gradients, with every
remat / unroll, patterns, state, batches of adapters; merge and unmerge; the optimizer split."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _programs import on_cpu
from _reference import D, H, apply, assert_stack_is_loop, gate, init, layer_params, loop, trained
from _trees import assert_trees_bitwise, assert_trees_close
from hypothesis import given, settings
from hypothesis import strategies as st

import stackwise
import stackwise.optax

KEY = jax.random.key(0)
UV = ["['u']", "['v']"]  # the two weights (c, a (1, D) bias, is no target)


def _base(n, seed=0):
    return stackwise.stack(init, apply, n).init(jax.random.key(seed))


def _x(batch=3, seed=1, lead=()):
    """Inputs drawn by NumPy (JAX compiles its sampler anew for each shape)."""
    return jnp.asarray(np.random.default_rng(seed).standard_normal((*lead, batch, D), np.float32))


@pytest.mark.slow
@settings(max_examples=8, deadline=None)
@given(
    n=st.integers(1, 5),
    rank=st.integers(1, H),
    alpha=st.sampled_from([1.0, 4.0]),
    targets=st.sampled_from([UV, ["['u']"], "['v']"]),
    remat=st.sampled_from([stackwise.DEFAULT_REMAT, True, False]),
    unroll=st.sampled_from([1, 2, True]),
)
def test_stack_equals_loop_over_shapes(n, rank, alpha, targets, remat, unroll):
    check_against_loop(n, rank, alpha, targets, remat, unroll)


@pytest.mark.parametrize("remat, unroll", [(stackwise.DEFAULT_REMAT, 1), (False, 2), (True, True)])
def test_stack_equals_loop(remat, unroll):
    check_against_loop(3, 2, 4.0, UV, remat, unroll)


def check_against_loop(n, rank, alpha, targets, remat, unroll):
    """Outputs and the adapters' gradients of the stack and of the loop model."""
    base = _base(n)
    adapters = trained(stackwise.lora.init(KEY, base, rank=rank, alpha=alpha, targets=targets))
    layers = stackwise.lora.stack(apply, n, remat=remat, unroll=unroll)
    x = _x()
    assert_stack_is_loop(layers, base, adapters, x, n)


def test_untrained_adapters_give_the_base_model_bitwise():
    base = _base(3)
    adapters = stackwise.lora.init(KEY, base, rank=2, targets=["['u']", "['v']"])
    plain = stackwise.stack(None, apply, 3).apply(base, _x())
    adapted = stackwise.lora.stack(apply, 3).apply(stackwise.lora.attach(base, adapters), _x())
    np.testing.assert_array_equal(adapted, plain)


@pytest.mark.parametrize("n", [5, 6])
def test_pattern_equals_loop(n):
    """Two kinds of layers (a b a b ...), each position with its own adapters."""
    stacked = stackwise.stack([init, init], [apply, gate], n)
    bases = stacked.init(KEY)
    adapters = trained(stackwise.lora.init(KEY, bases, rank=2, targets=lambda p, s: s == (D, H)))
    assert adapters[0]["u"].a.shape == (len(range(0, n, 2)), D, 2)
    layers = stackwise.lora.stack([apply, gate], n)
    x = _x()

    def loss(ad):
        return jnp.sum(layers.apply(tuple(map(stackwise.lora.attach, bases, ad)), x) ** 2)

    def loss_loop(ad):
        return jnp.sum(loop([apply, gate], bases, ad, x, n) ** 2)

    # (The loop model jitted: one program, not one per op and shape.)
    assert_trees_close(layers.apply(tuple(map(stackwise.lora.attach, bases, adapters)), x),
                       jax.jit(lambda ad: loop([apply, gate], bases, ad, x, n))(adapters))
    assert_trees_close(jax.jit(jax.grad(loss))(adapters), jax.jit(jax.grad(loss_loop))(adapters))


def test_with_state_equals_loop():
    """A layer with a per-layer counter, state threaded through the wrapped layer."""

    def counted(p, state, x):
        return apply(p, x) * (1.0 + 0.1 * state), state + 1.0

    n = 3
    base = _base(n)
    adapters = trained(stackwise.lora.init(KEY, base, rank=2, targets=["['u']"]))
    layers = stackwise.lora.stack(counted, n, with_state=True)
    state = jnp.arange(n, dtype=jnp.float32)
    y, new_state = layers.apply(stackwise.lora.attach(base, adapters), state, _x())
    y_loop = _x()
    for i in range(n):
        y_loop, _ = counted(layer_params(base, adapters, i), state[i], y_loop)
    assert_trees_close(y, y_loop)
    np.testing.assert_array_equal(new_state, state + 1)
    # A batch: the counter, updated alike by every group, is kept once; each group's rows
    # are those of its adapter alone.
    other = trained(adapters, seed=3)
    batch = stackwise.lora.stack_adapters([adapters, other])
    xs = jnp.stack([_x(), _x(seed=2)])
    ys, new_state = layers.apply(stackwise.lora.attach(base, batch), state, xs)
    np.testing.assert_array_equal(new_state, state + 1)
    for y, ad, x in zip(ys, (adapters, other), xs):
        assert_trees_close(y, layers.apply(stackwise.lora.attach(base, ad), state, x)[0])


def test_batch_of_adapters_equals_each_adapter_alone():
    """g adapters in one call: group j of x runs with adapter j; gradients per adapter."""
    n, g = 3, 3
    base = _base(n)
    each = [trained(stackwise.lora.init(jax.random.key(s), base, rank=2, targets=UV), seed=s)
            for s in range(g)]
    batch = stackwise.lora.stack_adapters(each)
    layers = stackwise.lora.stack(apply, n)
    x = _x(lead=(g,))

    def loss(ad):
        return jnp.sum(layers.apply(stackwise.lora.attach(base, ad), x) ** 2)

    def loss_each(ads):
        return sum(jnp.sum(loop([apply], [base], [ad], x[j], n) ** 2) for j, ad in enumerate(ads))

    y = layers.apply(stackwise.lora.attach(base, batch), x)
    one = jax.jit(lambda ad, x: loop([apply], [base], [ad], x, n))  # (one program for each j)
    for j in range(g):
        assert_trees_close(y[j], one(each[j], x[j]))
    grads = jax.jit(jax.grad(loss))(batch)
    assert grads["u"].a.shape == (g, n, D, 2)
    assert_trees_close(grads, stackwise.lora.stack_adapters(jax.jit(jax.grad(loss_each))(each)))


def test_a_batch_with_aux_gives_each_group_its_aux():
    base = _base(3)
    each = [trained(stackwise.lora.init(jax.random.key(s), base, rank=2, targets=UV), seed=s)
            for s in range(2)]
    layers = stackwise.lora.stack(lambda p, x: (apply(p, x), jnp.sum(apply(p, x))), 3,
                                  has_aux=True)
    xs = _x(lead=(2,))
    ys, aux = layers.apply(stackwise.lora.attach(base, stackwise.lora.stack_adapters(each)), xs)
    assert aux.shape == (3, 2)  # (n, g)
    for j, ad in enumerate(each):
        y, want = layers.apply(stackwise.lora.attach(base, ad), xs[j])
        assert_trees_close((ys[j], aux[:, j]), (y, want))


def _own_error(p, x):
    raise ValueError("the layer's own error")


def _own_unbatched_vmap(p, x):  # JAX refuses the layer's own vmap, as it would anywhere
    return x + jax.vmap(lambda r: r * 2.0, out_axes=None)(x)


@pytest.mark.parametrize(("layer", "message"), [
    (_own_error, "the layer's own error"),
    (_own_unbatched_vmap, "at vmap out_axes, got axis spec None"),
], ids=["raised", "vmap"])
def test_errors_of_the_layer_pass_through_a_batch_unchanged(layer, message):
    """Only the batch's own refusal (state that differs by group) is reworded."""
    base = _base(2)
    batch = stackwise.lora.stack_adapters([stackwise.lora.init(KEY, base, rank=2, targets=UV)] * 2)
    with pytest.raises(ValueError, match=message) as info:
        stackwise.lora.stack(layer, 2).apply(stackwise.lora.attach(base, batch), _x(lead=(2,)))
    assert "stackwise" not in str(info.value)


def test_adapters_share_one_base_without_a_copy():
    """Two adapters on one base in one jitted program: the base is an argument once, and the
    program's temporaries hold far less than a copy of it (one layer's adapted weight each):
    from 4 layers to 8 they grow by less than half of what the base grows."""
    d = 128

    def program(n):
        base = {"w": jnp.asarray(np.random.default_rng(0).standard_normal((n, d, d), np.float32))}
        one, two = (trained(stackwise.lora.init(jax.random.key(s), base, rank=4)) for s in (1, 2))
        layers = stackwise.lora.stack(lambda p, x: jnp.tanh(x @ p["w"]), n)
        assert stackwise.lora.attach(base, one).base["w"] is base["w"]

        def both(base, one, two, x):
            return (layers.apply(stackwise.lora.attach(base, one), x),
                    layers.apply(stackwise.lora.attach(base, two), x))

        x = jnp.ones((2, d))
        return jax.jit(both).lower(base, one, two, x).compile().memory_analysis(), base

    (shallow, _), (memory, base) = program(4), program(8)
    base_bytes = base["w"].nbytes
    grown = memory.temp_size_in_bytes - shallow.temp_size_in_bytes
    assert grown < (base_bytes / 2) / 2, memory  # (the base grows by half its bytes)
    if on_cpu():  # and XLA:CPU's total, whose fixed part is small (tests/_programs.py)
        assert memory.temp_size_in_bytes < base_bytes / 2, memory


@pytest.mark.slow
@settings(max_examples=6, deadline=None)
@given(n=st.integers(1, 4), rank=st.integers(1, 5), dtype=st.sampled_from(["float32", "bfloat16"]))
def test_merge_and_unmerge_over_shapes(n, rank, dtype):
    check_merge(n, rank, dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_merge_and_unmerge(dtype):
    check_merge(3, 2, dtype)


def check_merge(n, rank, dtype):
    """Merge is the wrapped layer's own weight, bitwise; unmerge is within its bound."""
    base = jax.tree.map(lambda v: v.astype(dtype), _base(n))
    adapters = trained(stackwise.lora.init(KEY, base, rank=rank, targets=UV, dtype=jnp.float32))
    merged = stackwise.lora.merge(base, adapters)
    for name in ("u", "v"):
        lw = adapters[name]
        for i in range(n):  # bitwise: the same sum, in the same dtype, as inside the layer
            want = (base[name][i].astype(jnp.float32)
                    + jnp.matmul(lw.a[i], lw.b[i]) * jnp.float32(lw.scale)).astype(dtype)
            np.testing.assert_array_equal(merged[name][i], want)
        assert merged[name].dtype == base[name].dtype
    back = stackwise.lora.unmerge(merged, adapters)
    for name in ("u", "v"):  # the bound of `unmerge`'s docstring
        w = np.asarray(base[name], np.float64)
        d = np.asarray(jnp.matmul(adapters[name].a, adapters[name].b), np.float64) * (
            adapters[name].scale)
        eps = float(jnp.finfo(dtype).eps)
        bound = eps * (np.abs(w) + np.abs(d)) * (1 + eps)
        assert np.all(np.abs(np.asarray(back[name], np.float64) - w) <= bound)
    # The merged stack runs without adapters, as the adapted one does.
    x = _x().astype(dtype)
    adapted = stackwise.lora.stack(apply, n).apply(stackwise.lora.attach(base, adapters), x)
    assert_trees_bitwise(stackwise.stack(None, apply, n).apply(merged, x), adapted)


def test_unmerge_of_untrained_adapters_is_bitwise():
    base = _base(2)
    adapters = stackwise.lora.init(KEY, base, rank=2, targets=UV)
    back = stackwise.lora.unmerge(stackwise.lora.merge(base, adapters), adapters)
    jax.tree.map(np.testing.assert_array_equal, back, base)


def test_train_the_adapters_only():
    """The split, an optimizer on the trainable half, the mask for a whole-tree optimizer."""
    n = 3
    base = _base(n)
    model = stackwise.lora.attach(base, stackwise.lora.init(KEY, base, rank=2, targets=UV))
    layers = stackwise.lora.stack(apply, n)
    x, target = _x(), _x(seed=5)
    trainable, frozen = stackwise.lora.split(model)

    def loss(trainable, frozen):
        return jnp.mean((layers.apply(stackwise.lora.combine(trainable, frozen), x) - target) ** 2)

    tx = stackwise.optax.layerwise(optax.adam(1e-2), stackwise.lora.layer_axes(trainable))
    state = tx.init(trainable)
    losses = []
    # (Each jitted once for the 5 steps: an eager step would compile the stack's scan anew.)
    value_and_grad, update = jax.jit(jax.value_and_grad(loss)), jax.jit(tx.update)
    for _ in range(5):
        value, grads = value_and_grad(trainable, frozen)
        updates, state = update(grads, state, trainable)
        trainable = optax.apply_updates(trainable, updates)
        losses.append(float(value))
    assert losses[-1] < losses[0]
    assert stackwise.lora.combine(trainable, frozen).base["u"] is base["u"]
    # The same step with an optimizer that sees the whole tree: the base's updates are zero.
    whole = optax.multi_transform({True: optax.adam(1e-2), False: optax.set_to_zero()},
                                  stackwise.lora.mask(model))
    grads = jax.grad(lambda m: loss(*stackwise.lora.split(m)))(model)
    updates, _ = whole.update(grads, whole.init(model), model)
    assert all(not jnp.any(u) for u in jax.tree.leaves(updates.base))
    assert any(jnp.any(u) for u in jax.tree.leaves(updates.adapters))


def test_layer_axes_of_a_batch_give_each_adapter_its_own_layers():
    """LAMB through `layerwise` with `layer_axes`: a batch's trust ratios are those of each
    adapter alone."""
    base = _base(2)
    each = [trained(stackwise.lora.init(jax.random.key(s), base, rank=2, targets=UV), seed=s)
            for s in (0, 1)]
    batch = stackwise.lora.stack_adapters(each)
    tx = stackwise.optax.layerwise(optax.lamb(1e-2), stackwise.lora.layer_axes(batch))
    updates, _ = jax.jit(tx.update)(batch, tx.init(batch), batch)  # (one program, not one per op)
    alone = stackwise.optax.layerwise(optax.lamb(1e-2))
    update = jax.jit(alone.update)
    for j, ad in enumerate(each):
        want, _ = update(ad, alone.init(ad), ad)
        assert_trees_close(jax.tree.map(lambda v, j=j: v[j], updates), want)


def _grad_temp_mib(n: int, adapted: bool, d: int = 256) -> float:
    """Temp memory of ``jit(grad)`` w.r.t. the adapters of a float base, default remat; with
    ``adapted=False`` the layer adds ``a @ b`` itself (the default policy saves that matmul)."""
    base = {"w": jnp.asarray(np.random.default_rng(0).standard_normal((n, d, d), np.float32)
                             / d**0.5)}
    adapters = stackwise.lora.init(KEY, base, rank=4)
    x = jnp.ones((2, d))

    def layer(p, x):
        return x + jnp.tanh(x @ p["w"])

    if adapted:
        layers = stackwise.lora.stack(layer, n)
        params = lambda ad: stackwise.lora.attach(base, ad)  # noqa: E731
    else:
        layers = stackwise.stack(
            None, lambda p, x: layer({"w": p["w"] + p["a"] @ p["b"]}, x), n)
        params = lambda ad: {"w": base["w"], "a": ad["w"].a, "b": ad["w"].b}  # noqa: E731

    def loss(ad):
        return jnp.sum(layers.apply(params(ad), x))

    compiled = jax.jit(jax.grad(loss)).lower(adapters).compile()
    return compiled.memory_analysis().temp_size_in_bytes / 2**20


def test_the_backward_pass_keeps_no_adapted_weight():
    """From n=4 to n=16 layers, the wrapped layers' temporaries grow by far less than one
    layer's weight (0.25 MiB at d=256); a layer that adds ``a @ b`` itself keeps it for every
    layer."""
    layer_mib = 256 * 256 * 4 / 2**20
    assert _grad_temp_mib(16, True) - _grad_temp_mib(4, True) < layer_mib / 2
    # The control, that the check can fail, is XLA:CPU's: compiled for a v5e, XLA:TPU reports
    # no temp bytes for either form, at n=4 and 16, at d=256 and at d=1024.
    if on_cpu():
        assert _grad_temp_mib(16, False) - _grad_temp_mib(4, False) > 10 * layer_mib


def test_the_default_targets_leave_integer_leaves_alone():
    """An int32 table stacked with the weights is no target by default: it gets no adapter,
    and merging leaves it bitwise (an update rounded into integers would change it)."""
    table = jnp.arange(3 * 4 * 4, dtype=jnp.int32).reshape(3, 4, 4)
    base = {"w": jnp.ones((3, 4, 4)), "table": table}
    adapters = trained(stackwise.lora.init(KEY, base, rank=2))
    assert adapters["table"] is None and adapters["w"] is not None
    merged = stackwise.lora.merge(base, adapters)
    assert merged["table"] is table
    np.testing.assert_array_equal(
        merged["w"], base["w"] + adapters["w"].scale * adapters["w"].a @ adapters["w"].b)
