"""`stackwise.quant`: per-layer, per-channel quantization of stacked weights, dequantized one
layer at a time inside the scan; QLoRA (quantized base + LoRA) against the loop model; the
compiled program's temporaries at two depths."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _programs import on_cpu
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


def _temp_mib(n: int, kind: str, python_loop: bool, d: int = 256,
              block: int | None = None, double: bool = False) -> float:
    """Temp memory of ``jit(grad)`` w.r.t. the adapters, with a quantized base of n layers."""
    w = jax.random.normal(KEY, (n, d, d)) / d**0.5
    base = stackwise.quant.quantize({"w": w}, kind, block_size=block, double=double)
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


@pytest.mark.parametrize("kind, block, double", [("int8", None, False), ("nf4", None, False),
                                                 ("nf4", 64, False), ("nf4", 64, True)])
def test_temp_memory_holds_about_one_layer_at_any_depth(kind, block, double):
    """From n=4 to n=16 the stack's temporaries grow by far less than one dequantized layer
    (0.25 MiB at d=256); the loop's grow by a dequantized layer per layer. Block-wise scales
    (QLoRA's blocks of 64), double-quantized or not, alike."""
    layer_mib = 256 * 256 * 4 / 2**20
    stack_growth = (_temp_mib(16, kind, False, block=block, double=double)
                    - _temp_mib(4, kind, False, block=block, double=double))
    assert stack_growth < layer_mib / 2, stack_growth
    # The control, that the check can fail, is XLA:CPU's: compiled for a v5e, XLA:TPU reports
    # no temp bytes for the loop, at n=4 and 16, at d=256 and at d=1024.
    if on_cpu():
        loop_growth = (_temp_mib(16, kind, True, block=block, double=double)
                       - _temp_mib(4, kind, True, block=block, double=double))
        assert loop_growth > 10 * layer_mib, loop_growth


def test_remat_false_with_a_quantized_base_warns_with_the_memory():
    base = stackwise.quant.quantize({"w": jnp.ones((4, 16, 8))}, "int8")
    layers = stackwise.lora.stack(lambda p, x: x @ p["w"].T @ p["w"], 4, remat=False)
    with pytest.warns(UserWarning, match=r"remat=False.*\(2048 bytes\)"):
        layers.apply(base, jnp.ones((1, 8)))
    # Float params (no quantized leaf) and the default remat: no warning.
    layers.apply({"w": jnp.ones((4, 16, 8))}, jnp.ones((1, 8)))
    stackwise.lora.stack(lambda p, x: x @ p["w"].T @ p["w"], 4).apply(base, jnp.ones((1, 8)))


# --------------------------------------------------------------------------
# Block-wise scales (QLoRA: nf4 in blocks of 64 inputs).

@functools.cache  # (computed on first use, not when the module is collected)
def _nf4_table() -> np.ndarray:
    return np.array(stackwise.quant.dequantize(stackwise.quant.Quantized(
        jnp.arange(16, dtype=jnp.uint8)[::2, None]
        | (jnp.arange(16, dtype=jnp.uint8)[1::2, None] << 4),
        jnp.ones((1, 1)), "nf4", "float32", 16)))[:, 0]


def _blockwise_reference(w: np.ndarray, kind: str, block: int) -> np.ndarray:
    """Layer by layer and block by block in NumPy: each block of ``block`` rows of each output
    channel scaled by its own absmax, rounded to the kind's nearest code, scaled back."""
    out = np.empty_like(w, dtype=np.float32)
    for i in range(w.shape[0]):
        for start in range(0, w.shape[1], block):
            part = w[i, start:start + block].astype(np.float32)
            absmax = np.abs(part).max(axis=0, keepdims=True)
            if kind == "nf4":
                scale = np.where(absmax > 0, absmax, 1.0).astype(np.float32)
                table = _nf4_table()
                codes = np.abs(part[..., None] / scale[..., None] - table).argmin(-1)
                out[i, start:start + block] = table[codes] * scale
            else:
                limit = {"int8": 127, "int4": 7}[kind]
                scale = np.where(absmax > 0, absmax / limit, 1.0).astype(np.float32)
                out[i, start:start + block] = np.clip(np.round(part / scale), -limit,
                                                      limit) * scale
    return out


@pytest.mark.parametrize("kind", stackwise.quant.KINDS)
@pytest.mark.parametrize("block", [1, 2, 4, 12])
def test_blockwise_scales_equal_a_numpy_loop_of_blocks(kind, block):
    w = np.asarray(jax.random.normal(KEY, (3, 12, 5))) * np.arange(1.0, 13.0)[None, :, None]
    q = stackwise.quant.quantize({"w": jnp.asarray(w, jnp.float32)}, kind,
                                 block_size=block)["w"]
    assert q.scale.shape == (3, 12 // block, 5) and q.block_size == block
    assert q.codes.shape == ((3, 12, 5) if kind == "int8" else (3, 6, 5))  # still packed
    back = np.asarray(stackwise.quant.dequantize(q))
    # Within float rounding of the reference (a float32 product rounded once more or less).
    ref = _blockwise_reference(w, kind, block)
    close = np.isclose(back, ref, rtol=1e-6, atol=1e-6)
    assert close.all(), close.mean()
    # Whole-axis blocks are the per-channel quantizer, bit for bit.
    if block == 12:
        plain = stackwise.quant.quantize({"w": jnp.asarray(w, jnp.float32)}, kind)["w"]
        np.testing.assert_array_equal(q.codes, plain.codes)
        np.testing.assert_array_equal(q.scale, plain.scale)


@pytest.mark.slow
@settings(max_examples=8, deadline=None)
@given(kind=st.sampled_from(stackwise.quant.KINDS), n=st.integers(1, 3),
       blocks=st.integers(1, 4), block=st.sampled_from([1, 2, 3, 8]), out=st.integers(1, 5),
       seed=st.integers(0, 2**16))
def test_blockwise_scales_over_shapes(kind, n, blocks, block, out, seed):
    """Any number of blocks of any size (odd numbers of rows for the 4-bit packing too)."""
    w = np.asarray(jax.random.normal(jax.random.key(seed), (n, blocks * block, out)))
    q = stackwise.quant.quantize({"w": w}, kind, block_size=block)["w"]
    assert q.scale.shape == (n, blocks, out) and q.shape == w.shape
    np.testing.assert_allclose(stackwise.quant.dequantize(q),
                               _blockwise_reference(w, kind, block), rtol=1e-6, atol=1e-6)
    for i in range(n):  # each layer's slice dequantizes alone to its rows, bitwise
        one = stackwise.quant.dequantize(jax.tree.map(lambda v, i=i: v[i], q))
        np.testing.assert_array_equal(one, stackwise.quant.dequantize(q)[i])


def test_blocks_scale_an_outlier_only_in_its_own_block():
    """The point of blocks: one large input scales its block, not the whole column."""
    w = np.full((1, 8, 2), 0.01, np.float32)
    w[0, 0, 0] = 100.0
    per_channel = stackwise.quant.dequantize(stackwise.quant.quantize({"w": w}, "int4")["w"])
    blocks = stackwise.quant.dequantize(
        stackwise.quant.quantize({"w": w}, "int4", block_size=4)["w"])
    assert float(per_channel[0, 4, 0]) == 0.0  # 0.01 lost under a scale of 100 / 7
    np.testing.assert_allclose(blocks[0, 4:, 0], 0.01, rtol=1e-6)


@pytest.mark.parametrize("kind", ["int8", "nf4"])
def test_qlora_with_blocks_equals_loop(kind):
    """Block-wise quantized base + adapters: outputs and the adapters' gradients against the
    loop model, each layer's slice dequantized inside the layer (`u` has 6 inputs, in blocks
    of 2; `v` has 5, in one block)."""
    n = 3
    base = _base(n)
    base = stackwise.quant.quantize(base, kind, targets=["['u']"], block_size=2)
    base = stackwise.quant.quantize(base, kind, targets=["['v']"], block_size=5)
    assert base["u"].scale.shape == (n, 3, H)
    adapters = trained(stackwise.lora.init(KEY, base, rank=2, targets=UV))
    x = jax.random.normal(jax.random.key(1), (3, D))
    assert_stack_is_loop(stackwise.lora.stack(apply, n), base, adapters, x, n)
    # The slice one layer dequantizes is the layer's float weight in blocks, by hand.
    for i in range(n):
        u = np.asarray(stackwise.quant.dequantize(jax.tree.map(lambda v, i=i: v[i], base["u"])))
        np.testing.assert_array_equal(u, np.asarray(stackwise.quant.dequantize(base["u"]))[i])


def test_blockwise_packed_codes_stay_packed_until_inside_the_layer():
    n = 4
    base = stackwise.quant.quantize({"w": jax.random.normal(KEY, (n, 8, 8))}, "nf4",
                                    block_size=4)
    adapters = stackwise.lora.init(KEY, base, rank=2)
    layers = stackwise.lora.stack(lambda p, x: jnp.tanh(x @ p["w"]), n)

    def loss(ad):
        return jnp.sum(layers.apply(stackwise.lora.attach(base, ad), jnp.ones((2, 8))))

    jaxpr = jax.make_jaxpr(jax.grad(loss))(adapters).jaxpr
    assert not _unpacks(jaxpr.eqns)
    assert any(_unpacks(e.params["jaxpr"].jaxpr.eqns) for e in jaxpr.eqns
               if e.primitive.name == "scan")


@pytest.mark.parametrize("kind", ["int8", "nf4"])
def test_a_non_finite_weight_under_jit_spoils_its_own_column_only(kind):
    """Traced, quantize cannot refuse a NaN (eager, it does: tests/misuse): its column's scale
    is NaN, so that column dequantizes to NaN, never to finite wrong numbers, and every other
    column is bitwise the quantization of the weight without it."""
    w = jax.random.normal(KEY, (2, 4, 3))
    bad = w.at[1, 2, 0].set(jnp.nan)
    got = stackwise.quant.dequantize(jax.jit(lambda p: stackwise.quant.quantize(p, kind))(
        {"w": bad})["w"])
    want = stackwise.quant.dequantize(stackwise.quant.quantize({"w": w}, kind)["w"])
    assert bool(jnp.isnan(got[1, :, 0]).all())
    np.testing.assert_array_equal(got[1, :, 1:], want[1, :, 1:])
    np.testing.assert_array_equal(got[0], want[0])
