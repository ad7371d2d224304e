"""`stackwise.quant`: per-layer, per-channel quantization of stacked weights, dequantized one
layer at a time inside the scan; QLoRA (quantized base + LoRA) against the loop model; the
compiled program's temporaries at two depths."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _reference import D, H, apply, assert_stack_is_loop, init, layer_params, loop, trained
from _trees import assert_trees_close
from hypothesis import given, settings
from hypothesis import strategies as st

import stackwise

KEY = jax.random.key(0)
UV = ["['u']", "['v']"]
NF4_GAP = 0.1609  # the widest gap between neighbouring NF4 values (0.7230 .. 1.0: 0.277 / 2)


def _base(n, seed=0):
    return stackwise.stack(init, apply, n).init(jax.random.key(seed))


@pytest.mark.parametrize("kind", stackwise.quant.KINDS)
def test_each_layer_is_quantized_alone(kind):
    """Layer i's codes and scales are those of quantizing layer i by itself: the layer axis
    is never a weight axis."""
    w = jax.random.normal(KEY, (4, 7, 5)) * jnp.arange(1.0, 5.0)[:, None, None]
    q = stackwise.quant.quantize({"w": w}, kind)["w"]
    assert q.scale.shape == (4, 1, 5) and q.shape == (4, 7, 5)
    assert q.codes.shape == ((4, 7, 5) if kind == "int8" else (4, 4, 5))
    for i in range(4):
        alone = stackwise.quant.quantize({"w": w[i : i + 1]}, kind)["w"]
        np.testing.assert_array_equal(q.codes[i], alone.codes[0])
        np.testing.assert_array_equal(q.scale[i], alone.scale[0])


@pytest.mark.parametrize("kind", stackwise.quant.KINDS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dequantize_is_within_half_a_step_and_keeps_the_dtype(kind, dtype):
    w = jax.random.normal(KEY, (3, 9, 4)).astype(dtype)
    q = stackwise.quant.quantize({"w": w}, kind)["w"]
    back = stackwise.quant.dequantize(q)
    assert back.dtype == w.dtype and back.shape == w.shape
    step = np.asarray(q.scale) * (2 * NF4_GAP if kind == "nf4" else 1.0)
    rounding = float(jnp.finfo(dtype).eps) * np.abs(np.asarray(w, np.float32))
    err = np.abs(np.asarray(back, np.float32) - np.asarray(w, np.float32))
    assert np.all(err <= step / 2 * (1 + 1e-6) + rounding)
    # The layer's own slice dequantizes to the same floats, bitwise.
    for i in range(3):
        np.testing.assert_array_equal(
            stackwise.quant.dequantize(jax.tree.map(lambda v, i=i: v[i], q)), back[i])


def test_zero_channel_and_other_leaves():
    params = {"w": jnp.zeros((2, 4, 3)), "b": jnp.ones((2, 3)), "i": jnp.ones((2, 4, 4), int)}
    q = stackwise.quant.quantize(params, "int4")
    np.testing.assert_array_equal(stackwise.quant.dequantize(q["w"]), params["w"])
    assert q["b"] is params["b"] and q["i"] is params["i"]  # not 2-D / not float: untouched
    np.testing.assert_array_equal(stackwise.quant.dequantize(q)["b"], params["b"])


def check_qlora(kind, n, rank, remat, unroll):
    """Quantized base + adapters: outputs and the adapters' gradients against the loop model."""
    base = stackwise.quant.quantize(_base(n), kind, targets=UV)
    adapters = trained(stackwise.lora.init(KEY, base, rank=rank, targets=UV))
    assert adapters["u"].a.dtype == jnp.float32
    layers = stackwise.lora.stack(apply, n, remat=remat, unroll=unroll)
    x = jax.random.normal(jax.random.key(1), (3, D))
    assert_stack_is_loop(layers, base, adapters, x, n)
    # The quantized base alone (no adapters) runs as the loop over its dequantized layers.
    assert_trees_close(layers.apply(base, x), loop([apply], [base], None, x, n))


@pytest.mark.parametrize("kind", stackwise.quant.KINDS)
def test_qlora_equals_loop(kind):
    check_qlora(kind, 3, 2, stackwise.DEFAULT_REMAT, 1)


@pytest.mark.slow
@settings(max_examples=6, deadline=None)
@given(kind=st.sampled_from(stackwise.quant.KINDS), n=st.integers(1, 5),
       rank=st.integers(1, H), remat=st.sampled_from([stackwise.DEFAULT_REMAT, True]),
       unroll=st.sampled_from([1, 2, True]))
def test_qlora_equals_loop_over_shapes(kind, n, rank, remat, unroll):
    check_qlora(kind, n, rank, remat, unroll)


def test_decode_with_a_quantized_base_equals_loop():
    """A cache written in place per layer (with_state), weights dequantized per layer."""
    n, t = 3, 4
    base = stackwise.quant.quantize(_base(n), "nf4", targets=UV)

    def step(p, cache, x, pos):
        y = apply(p, x)
        return y, jax.lax.dynamic_update_slice(cache, y, (pos, 0))

    layers = stackwise.lora.stack(step, n, with_state=True)
    cache = jnp.zeros((n, t, D))
    x = jnp.ones((1, D))
    y, new = jax.jit(layers.apply)(base, cache, x, 2)
    y_loop, rows = x, []
    for i in range(n):
        y_loop, c = step(layer_params(base, None, i), cache[i], y_loop, 2)
        rows.append(c)
    assert_trees_close(y, y_loop)
    assert_trees_close(new, jnp.stack(rows))


def _unpacks(eqns) -> bool:
    return any(e.primitive.name == "shift_right_logical" for e in eqns)


def test_packed_codes_stay_packed_until_inside_the_layer():
    """The program unpacks 4-bit codes inside the scan's body only, never the whole stack."""
    n = 4
    base = stackwise.quant.quantize(_base(n), "nf4", targets=UV)
    adapters = stackwise.lora.init(KEY, base, rank=2, targets=UV)
    layers = stackwise.lora.stack(apply, n)

    def loss(ad):
        return jnp.sum(layers.apply(stackwise.lora.attach(base, ad), jnp.ones((2, D))))

    jaxpr = jax.make_jaxpr(jax.grad(loss))(adapters).jaxpr
    assert not _unpacks(jaxpr.eqns)
    scans = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
    assert scans and all(
        any(_unpacks(s.params["jaxpr"].jaxpr.eqns) for s in scans) for _ in [0])


def _temp_mib(n: int, kind: str, python_loop: bool, d: int = 256) -> float:
    """Temp memory of ``jit(grad)`` w.r.t. the adapters, with a quantized base of n layers."""
    w = jax.random.normal(KEY, (n, d, d)) / d**0.5
    base = stackwise.quant.quantize({"w": w}, kind)
    adapters = stackwise.lora.init(KEY, base, rank=4)
    layer = lambda p, x: x + jnp.tanh(x @ p["w"])  # noqa: E731
    x = jnp.ones((2, d))
    layers = stackwise.lora.stack(layer, n)

    def loss(ad):
        params = stackwise.lora.attach(base, ad)
        if not python_loop:
            return jnp.sum(layers.apply(params, x))
        y = x
        for i in range(n):
            w_i = stackwise.quant.dequantize(jax.tree.map(lambda v, i=i: v[i], base["w"]))
            y = layer({"w": w_i + 1.0 * (ad["w"].a[i] @ ad["w"].b[i])}, y)
        return jnp.sum(y)

    compiled = jax.jit(jax.grad(loss)).lower(adapters).compile()
    return compiled.memory_analysis().temp_size_in_bytes / 2**20


@pytest.mark.parametrize("kind", ["int8", "nf4"])
def test_temp_memory_holds_about_one_layer_at_any_depth(kind):
    """From n=4 to n=16 the stack's temporaries grow by far less than one dequantized layer
    (0.25 MiB at d=256); the loop's grow by a dequantized layer per layer."""
    layer_mib = 256 * 256 * 4 / 2**20
    stack_growth = _temp_mib(16, kind, False) - _temp_mib(4, kind, False)
    assert stack_growth < layer_mib / 2, stack_growth
    loop_growth = _temp_mib(16, kind, True) - _temp_mib(4, kind, True)
    assert loop_growth > 10 * layer_mib, loop_growth


def test_remat_false_with_a_quantized_base_warns_with_the_memory():
    base = stackwise.quant.quantize({"w": jnp.ones((4, 16, 8))}, "int8")
    layers = stackwise.lora.stack(lambda p, x: x @ p["w"].T @ p["w"], 4, remat=False)
    with pytest.warns(UserWarning, match=r"remat=False.*\(2048 bytes\)"):
        layers.apply(base, jnp.ones((1, 8)))
    # Float params (no quantized leaf) and the default remat: no warning.
    layers.apply({"w": jnp.ones((4, 16, 8))}, jnp.ones((1, 8)))
    stackwise.lora.stack(lambda p, x: x @ p["w"].T @ p["w"], 4).apply(base, jnp.ones((1, 8)))
