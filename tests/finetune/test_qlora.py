"""QLoRA as the paper has it (Dettmers et al. 2023): double quantization of the scales, with its
error bound and bits per parameter from the stored leaves; bfloat16 compute read from the
jaxpr against a hand-written bfloat16 layer; merge of adapters into a quantized base,
requantized, within half a quantization step per block."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _reference import D, apply, assert_stack_is_loop, init, trained
from _trees import assert_trees_close

import stackwise

KEY = jax.random.key(0)
UV = ["['u']", "['v']"]
F32_EPS = float(jnp.finfo(jnp.float32).eps)
#: The widest gap between neighbouring levels, in units of the scale, and the largest level.
GAP = {"int8": 1.0, "int4": 1.0, "nf4": 1.0 - 0.6961928009986877}  # nf4: -1 .. -0.6962
LEVEL = {"int8": 127.0, "int4": 7.0, "nf4": 1.0}


def _weights(shape, seed=0):
    """Normal weights with a spread of magnitudes across layers, rows and columns (so the
    scales differ and their second-level step is not trivial). Drawn by NumPy: JAX compiles
    its sampler anew for each shape, and the tests use many."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(shape) * np.exp(rng.standard_normal(shape[:-1] + (1,)))
    return jnp.asarray(w, jnp.float32)


def _blocks_of_scales(node):
    """Per layer, the second-level step of each first-level scale, shaped as the scales."""
    n, blocks, out = node.scale.shape
    k, m = node.double, node.scale_step.shape[-1]
    each = np.repeat(np.asarray(node.scale_step), k, axis=-1)[:, :blocks * out]
    assert m == -(-blocks * out // k)
    return each.reshape(n, blocks, out)


# --------------------------------------------------------------------------
# Double quantization.


def _device_errors(scale):
    """This device's errors at double quantization's own values, against float64: the
    largest absolute error of ``log`` at the scales, the largest relative error of ``exp``
    at the decoded log-scales and of a division of the centred log-scales by a step."""
    x = np.asarray(scale, np.float32).ravel()
    log_err = np.abs(np.asarray(jnp.log(x), np.float64) - np.log(x.astype(np.float64))).max()
    arg = np.log(x).astype(np.float32)
    exp_err = np.abs(np.asarray(jnp.exp(arg), np.float64) / np.exp(arg.astype(np.float64)) - 1)
    centred = (arg - arg.mean()).astype(np.float32)
    step = np.float32(np.abs(centred).max() / 127)
    quotient = np.asarray(jnp.asarray(centred) / step, np.float64)
    div_err = np.abs(quotient / (centred.astype(np.float64) / np.float64(step)) - 1)
    return log_err, exp_err.max(), np.nan_to_num(div_err, nan=0.0).max()


@pytest.mark.parametrize("kind", ["int8", "int4", "nf4"])
@pytest.mark.parametrize("block, double", [(None, True), (4, True), (4, 7), (2, 1), (16, 256)])
def test_double_quantization_is_within_its_bound(kind, block, double):
    """Each decoded scale is within a factor exp(step / 2) of the float32 one (step: its
    block's second-level step of log-scales), and each weight within the largest level times
    ``s * (exp(step / 2) - 1)`` (plus float32 rounding) of the singly quantized weight; the
    codes are the singly quantized ones, bitwise."""
    w = _weights((3, 32, 24))
    single = stackwise.quant.quantize({"w": w}, kind, block_size=block)["w"]
    q = stackwise.quant.quantize({"w": w}, kind, block_size=block, double=double)["w"]
    k = 256 if double is True else double
    assert q.double == k and q.scale.dtype == jnp.int8 and q.scale.shape == single.scale.shape
    assert q.scale_offset.shape == (3,) and q.scale_offset.dtype == jnp.float32
    assert q.scale_step.shape == (3, -(-single.scale.size // 3 // k))
    np.testing.assert_array_equal(q.codes, single.codes)
    s, s2 = np.asarray(single.scale), np.asarray(q.float_scale)
    step = _blocks_of_scales(q)
    # |s' - s| <= s * (exp(step / 2) - 1), plus float32 rounding of the log, the sum and the
    # exp (a few ulps of the log-scale, relative to s), plus the backend's own error in log,
    # exp and the division that picks a code (measured on this device at these values: on
    # XLA:CPU a few ulp; XLA:TPU's log up to ~1e-4 off, benchmarks/results/tpu_tier.md).
    log_err, exp_err, div_err = _device_errors(s)
    rounding = 8 * F32_EPS * (1 + np.abs(np.log(s))) + log_err + exp_err
    factor = np.expm1(step / 2 * (1 + 1e-6 + 2 * 127 * div_err) + rounding)
    assert np.all(np.abs(s2 - s) <= s * factor)
    # The weights: |c * s' - c * s| <= |c| * s * (exp(step / 2) - 1), |c| at most the
    # largest level.
    rows = np.repeat(s * factor, 32 // s.shape[1], axis=1)
    got, want = (np.asarray(stackwise.quant.dequantize(v)) for v in (q, single))
    assert np.all(np.abs(got - want) <= LEVEL[kind] * rows + F32_EPS * np.abs(want))
    # A step of log-scales: an outlier in the layer keeps its neighbours' scales close.
    assert np.all(np.abs(s2 / s - 1) <= 0.02)


def test_double_quantized_nf4_in_blocks_of_64_costs_4_127_bits():
    """The paper's numbers, from the stored leaves' bytes: 4 + 8/64 + 32/(64 * 256) bits per
    weight with double quantization (plus one float32 offset per layer), 4.5 without."""
    n, d = 2, 256
    w = _weights((n, d, d))
    for double, want in [(False, 4 + 32 / 64), (True, 4 + 8 / 64 + 32 / (64 * 256))]:
        q = stackwise.quant.quantize({"w": w}, "nf4", block_size=64, double=double)["w"]
        stored = sum(leaf.nbytes for leaf in jax.tree.leaves(q))
        assert stored == q.nbytes
        offsets = 32 / (d * d) if double else 0.0
        bits = stored * 8 / w.size
        assert bits == pytest.approx(want + offsets, rel=1e-12), bits
    assert round(want, 3) == 4.127


def test_each_layer_is_double_quantized_alone():
    """Layer i's codes, scale codes, steps and offset are those of quantizing it alone."""
    w = _weights((4, 16, 6))
    q = stackwise.quant.quantize({"w": w}, "nf4", block_size=4, double=5)["w"]
    for i in range(4):
        alone = stackwise.quant.quantize({"w": w[i:i + 1]}, "nf4", block_size=4, double=5)["w"]
        for mine, its in zip(jax.tree.leaves(q), jax.tree.leaves(alone)):
            np.testing.assert_array_equal(mine[i], its[0])
        # Its slice (inside the scan) dequantizes to its rows of the stacked weight, bitwise.
        np.testing.assert_array_equal(
            stackwise.quant.dequantize(jax.tree.map(lambda v, i=i: v[i], q)),
            stackwise.quant.dequantize(q)[i])


def test_a_non_finite_weight_under_jit_spoils_its_layer_only():
    """The layer's mean scale is NaN, so its whole layer dequantizes to NaN (never to finite
    wrong numbers); the other layers are bitwise those of the finite weights."""
    w = _weights((2, 4, 3))
    bad = w.at[1, 2, 0].set(jnp.nan)
    got = stackwise.quant.dequantize(jax.jit(
        lambda p: stackwise.quant.quantize(p, "nf4", double=True))({"w": bad})["w"])
    want = stackwise.quant.dequantize(stackwise.quant.quantize({"w": w}, "nf4", double=True)["w"])
    assert bool(jnp.isnan(got[1]).all())
    np.testing.assert_array_equal(got[0], want[0])


def _base(n, seed=0):
    return stackwise.stack(init, apply, n).init(jax.random.key(seed))


@pytest.mark.parametrize("kind", ["int8", "nf4"])
@pytest.mark.parametrize("remat", [stackwise.DEFAULT_REMAT, True])
def test_qlora_on_a_double_quantized_base_equals_loop(kind, remat):
    """Outputs and the adapters' gradients against the loop over dequantized layers."""
    n = 3
    base = stackwise.quant.quantize(_base(n), kind, targets=UV, double=3)
    adapters = trained(stackwise.lora.init(KEY, base, rank=2, targets=UV))
    x = jax.random.normal(jax.random.key(1), (3, D))
    assert_stack_is_loop(stackwise.lora.stack(apply, n, remat=remat), base, adapters, x, n)
    # Attached per leaf, and a batch of two adapters sharing the base.
    layers = stackwise.lora.stack(apply, n)
    whole = layers.apply(stackwise.lora.attach(base, adapters), x)
    assert_trees_close(layers.apply(stackwise.lora.attach(base, adapters, per_leaf=True), x),
                       whole)
    batch = stackwise.lora.stack_adapters([adapters, adapters])
    assert_trees_close(layers.apply(stackwise.lora.attach(base, batch), jnp.stack([x, x]))[1],
                       whole)
    # The trainable/frozen split keeps the double-quantized node whole in the frozen half.
    trainable, frozen = stackwise.lora.split(stackwise.lora.attach(base, adapters))
    assert isinstance(frozen.base["u"], stackwise.quant.Quantized)
    assert frozen.base["u"].double == 3


def test_double_quantized_scales_are_decoded_inside_the_layer():
    """The program decodes the int8 scales (a convert to float32 of an int8 array) inside
    the scan only: the stack's scales stay 8-bit outside."""
    n = 4
    base = stackwise.quant.quantize({"w": _weights((n, 8, 8))}, "nf4", block_size=4,
                                    double=True)
    adapters = stackwise.lora.init(KEY, base, rank=2)
    layers = stackwise.lora.stack(lambda p, x: jnp.tanh(x @ p["w"]), n)

    def loss(ad):
        return jnp.sum(layers.apply(stackwise.lora.attach(base, ad), jnp.ones((2, 8))))

    def decodes(eqns):
        return any(e.primitive.name == "convert_element_type"
                   and e.invars[0].aval.dtype == jnp.int8 for e in eqns)

    jaxpr = jax.make_jaxpr(jax.grad(loss))(adapters).jaxpr
    assert not decodes(jaxpr.eqns)
    assert any(decodes(e.params["jaxpr"].jaxpr.eqns) for e in jaxpr.eqns
               if e.primitive.name == "scan")


def test_quantizing_while_loading_double_quantizes_alike():
    """`load_checkpoint(quantize=Scheme(..., double=True))`: the bits of `quantize` of the
    float load, every leaf."""
    n = 3
    base = _base(n)
    ckpt = {f"layers.{i}.{k}": np.asarray(base[k][i]) for i in range(n) for k in base}
    names = {k: f"layers.{{}}.{k}" for k in base}
    scheme = stackwise.quant.Scheme("nf4", UV, None, double=4)
    loaded = stackwise.load_checkpoint(ckpt, jax.eval_shape(lambda: base), names,
                                       quantize=scheme)
    want = stackwise.quant.quantize(base, "nf4", UV, double=4)
    for k in ("u", "v"):
        assert loaded[k].double == 4
        for got, ref in zip(jax.tree.leaves(loaded[k]), jax.tree.leaves(want[k])):
            np.testing.assert_array_equal(got, ref)


def test_load_peft_onto_a_double_quantized_base(tmp_path):
    """Adapters saved from a float base load back onto its double-quantized base, bitwise."""
    base = _base(3)
    adapters = trained(stackwise.lora.init(KEY, base, rank=2, targets=UV))
    modules = {"['u']": "mlp.up_proj", "['v']": "mlp.down_proj"}
    stackwise.lora.save_peft(tmp_path / "a", adapters, modules)
    qbase = stackwise.quant.quantize(base, "nf4", targets=UV, double=True)
    back = stackwise.lora.load_peft(tmp_path / "a", qbase, modules)
    np.testing.assert_array_equal(back["u"].b, adapters["u"].b)


# --------------------------------------------------------------------------
# bfloat16 compute.


def _dots(jaxpr):
    """Every dot_general's operand dtypes, in the jaxpr and the jaxprs inside it."""
    out = []
    for e in jaxpr.eqns:
        if e.primitive.name == "dot_general":
            out.append(tuple(v.aval.dtype for v in e.invars))
        for value in e.params.values():
            for sub in value if isinstance(value, (tuple, list)) else [value]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    out += _dots(inner)
    return out


@pytest.mark.parametrize("adapter_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("double", [False, True])
def test_bf16_compute_matmul_runs_in_bf16_and_equals_a_hand_written_layer(adapter_dtype,
                                                                          double):
    """`stack(..., dtype=jnp.bfloat16)`: the layer's matmul takes bfloat16 operands, and each
    layer's output equals the hand-written one: the weight dequantized and adapted in
    float32 (the update in the adapters' dtype), rounded to bfloat16 once, then
    ``x_bf16 @ w_bf16``."""
    n, d = 3, 16
    base = stackwise.quant.quantize({"w": _weights((n, d, d))}, "nf4", block_size=8,
                                    double=double)
    adapters = trained(stackwise.lora.init(KEY, base, rank=2, dtype=adapter_dtype))
    layer = lambda p, x: jnp.tanh(x @ p["w"])  # noqa: E731
    layers = stackwise.lora.stack(layer, n, dtype=jnp.bfloat16)
    x = jax.random.normal(jax.random.key(1), (2, d)).astype(jnp.bfloat16)
    params = stackwise.lora.attach(base, adapters)
    jaxpr = jax.make_jaxpr(layers.apply)(params, x).jaxpr
    dots = _dots(jaxpr)
    # Two matmuls a layer: x @ W in bfloat16 x bfloat16, and a @ b in the adapters' dtype.
    assert len(dots) == 2 and (jnp.bfloat16, jnp.bfloat16) in dots, dots
    assert (jnp.dtype(adapter_dtype),) * 2 in dots, dots

    y = layers.apply(params, x)
    assert y.dtype == jnp.bfloat16
    ref = x
    for i in range(n):
        w = stackwise.quant.dequantize(jax.tree.map(lambda v, i=i: v[i], base["w"]))
        lw = adapters["w"]
        update = (lw.a[i] @ lw.b[i]) * jnp.asarray(lw.scale, lw.a.dtype)
        w = (w + update.astype(jnp.float32)).astype(jnp.bfloat16)
        ref = jnp.tanh(ref @ w)
    # Within two bfloat16 roundings (XLA may keep a fused bfloat16 product in float32 a
    # little longer in one program than in the other; with float32 adapters on XLA:CPU the
    # two are bitwise equal).
    bf16_eps = float(jnp.finfo(jnp.bfloat16).eps)
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(ref, np.float32),
                               rtol=2 * bf16_eps, atol=bf16_eps)

    # A batch of two adapters on one base: each group's weights in bfloat16 alike.
    batch = stackwise.lora.stack_adapters([adapters, adapters])
    y2 = layers.apply(stackwise.lora.attach(base, batch), jnp.stack([x, x]))
    assert y2.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(y2[1], np.float32), np.asarray(y, np.float32))

    # The adapters' gradients come back in their own dtype.
    grads = jax.grad(lambda ad: jnp.sum(layers.apply(stackwise.lora.attach(base, ad), x)
                                        .astype(jnp.float32)))(adapters)
    assert grads["w"].a.dtype == jnp.dtype(adapter_dtype)


def test_dequantize_takes_a_compute_dtype():
    q = stackwise.quant.quantize({"w": _weights((2, 8, 4))}, "int4", double=True)["w"]
    got = stackwise.quant.dequantize(q, jnp.bfloat16)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(got, stackwise.quant.dequantize(q).astype(jnp.bfloat16))
    tree = stackwise.quant.dequantize({"w": q, "b": jnp.ones(3)}, dtype=jnp.bfloat16)
    assert tree["w"].dtype == jnp.bfloat16 and tree["b"].dtype == jnp.float32


# --------------------------------------------------------------------------
# Merge and requantize.


@pytest.mark.parametrize("kind", ["int8", "int4", "nf4"])
@pytest.mark.parametrize("block, double", [(None, False), (4, False), (4, True), (8, 3)])
def test_merge_into_a_quantized_base_requantizes_within_half_a_step(kind, block, double):
    """|dequantize(merge(q, ad)) - (dequantize(q) + s * a @ b)| <= gap * s' / 2 per block
    (s' the block's new scale; gap 1 for int8/int4, nf4's widest 0.3038), plus, double-
    quantized, the largest level times ``s' * (exp(step / 2) - 1)``."""
    n, rows, cols = 3, 16, 12
    q = stackwise.quant.quantize({"w": _weights((n, rows, cols))}, kind, block_size=block,
                                 double=double)
    adapters = trained(stackwise.lora.init(KEY, q, rank=2, alpha=4.0))
    merged = stackwise.lora.merge(q, adapters)["w"]
    assert (merged.kind, merged.block_size, merged.double) == (q["w"].kind, q["w"].block_size,
                                                               q["w"].double)
    lw = adapters["w"]
    want = np.asarray(stackwise.quant.dequantize(q["w"]) + lw.scale * (lw.a @ lw.b))
    got = np.asarray(stackwise.quant.dequantize(merged))
    per_row = rows // merged.scale.shape[1]
    scale = np.repeat(np.asarray(merged.float_scale), per_row, axis=1)
    if merged.double:  # s' (the single-level scale) within exp(step / 2) of the decoded one
        step = np.repeat(_blocks_of_scales(merged), per_row, axis=1)
        factor = np.expm1(step / 2 * (1 + 1e-5) + 8 * F32_EPS * (1 + np.abs(np.log(scale))))
        scale = scale * (1 + factor)
    bound = GAP[kind] * np.abs(scale) / 2 * (1 + 1e-5) + 4 * F32_EPS * np.abs(want)
    if merged.double:
        bound = bound + LEVEL[kind] * scale * factor
    assert np.all(np.abs(got - want) <= bound)
    # It is the quantizer's codes for the merged float weight (merged in one program, that
    # weight may differ by an ulp from the one merged apart, so its scales may too).
    float_merged = stackwise.lora.merge(stackwise.quant.dequantize(q), adapters)
    again = stackwise.quant.quantize(float_merged, kind, block_size=block, double=double)["w"]
    np.testing.assert_array_equal(merged.codes, again.codes)
    np.testing.assert_allclose(merged.float_scale, again.float_scale, rtol=1e-6)


def test_merge_into_a_quantized_base_with_dora_and_patterns():
    """DoRA's rescaled weight is requantized alike; a pattern's positions merge one by one."""
    q = stackwise.quant.quantize({"w": _weights((2, 8, 8))}, "nf4", block_size=4, double=True)
    dora = trained(stackwise.lora.init(KEY, q, rank=2, dora=True))
    merged = stackwise.lora.merge(q, dora)["w"]
    float_merged = stackwise.lora.merge(stackwise.quant.dequantize(q), dora)
    again = stackwise.quant.quantize(float_merged, "nf4", block_size=4, double=True)["w"]
    np.testing.assert_array_equal(merged.codes, again.codes)
    np.testing.assert_allclose(merged.float_scale, again.float_scale, rtol=1e-6)
    bases = stackwise.stack([init, init], [apply, apply], 4).init(KEY)
    qbases = tuple(stackwise.quant.quantize(b, "int8", targets=UV) for b in bases)
    ads = tuple(trained(stackwise.lora.init(KEY, b, rank=2, targets=UV)) for b in qbases)
    out = tuple(map(stackwise.lora.merge, qbases, ads))
    assert all(isinstance(o["u"], stackwise.quant.Quantized) for o in out)


# --------------------------------------------------------------------------
# Weights of any rank, embeddings and heads, without reshaping by hand.


@pytest.mark.parametrize("kind", ["int8", "int4", "nf4"])
@pytest.mark.parametrize("double", [False, 5])
def test_a_fused_projection_is_its_2d_reshape_quantized(kind, double):
    """An (E, H, D) leaf contracted along E is bitwise its (E, H * D) reshape, quantized and
    reshaped back; contracted along (H, D), its transpose to (H, D, E) reshaped to
    (H * D, E); each layer's slice dequantizes alone to its own shape."""
    n, e, h, d = 3, 8, 4, 6
    w = _weights((n, e, h, d))
    q = stackwise.quant.quantize({"w": w}, kind, contract=0, block_size=4, double=double)["w"]
    flat = stackwise.quant.quantize({"w": w.reshape(n, e, h * d)}, kind, block_size=4,
                                    double=double)["w"]
    assert q.shape == (n, e, h, d) and q.codes.shape == flat.codes.shape
    for mine, its in zip(jax.tree.leaves(q), jax.tree.leaves(flat)):
        np.testing.assert_array_equal(mine, its)
    np.testing.assert_array_equal(stackwise.quant.dequantize(q),
                                  stackwise.quant.dequantize(flat).reshape(w.shape))
    back = stackwise.quant.quantize({"w": w}, kind, contract=(-2, -1), double=double)["w"]
    by_hand = stackwise.quant.quantize(
        {"w": jnp.transpose(w, (0, 2, 3, 1)).reshape(n, h * d, e)}, kind, double=double)["w"]
    np.testing.assert_array_equal(
        stackwise.quant.dequantize(back),
        jnp.transpose(stackwise.quant.dequantize(by_hand).reshape(n, h, d, e), (0, 3, 1, 2)))
    for i in range(n):
        one = jax.tree.map(lambda v, i=i: v[i], back)
        assert one.shape == (e, h, d)
        np.testing.assert_array_equal(stackwise.quant.dequantize(one),
                                      stackwise.quant.dequantize(back)[i])


def test_attention_projections_in_a_qlora_stack_equal_the_loop():
    """A layer with a (D, H, Dh) projection and an (H, Dh, D) one (contract=0 and (0, 1),
    per leaf by a dict: the default targets) beside a LoRA-adapted 2-D weight."""
    n, d, h, dh = 3, 8, 2, 4
    keys = jax.random.split(KEY, 3)
    base = {"qkv": _weights((n, d, h, dh)), "o": _weights((n, h, dh, d), seed=3),
            "up": jax.random.normal(keys[2], (n, d, d)) / d}
    q = stackwise.quant.quantize(base, "nf4", block_size=4, double=True,
                                 contract={"['qkv']": 0, "['o']": (0, 1)})
    assert q["qkv"].axes == (0,) and q["o"].axes == (0, 1) and q["up"].axes == ()

    def layer(p, x):
        heads = jnp.tanh(jnp.einsum("bd,dhk->bhk", x, p["qkv"]))
        return x + jnp.einsum("bhk,hkd->bd", heads, p["o"]) + jnp.tanh(x @ p["up"])

    adapters = trained(stackwise.lora.init(KEY, q, rank=2))   # on the 2-D weight only
    assert adapters["qkv"] is None and adapters["o"] is None
    x = jax.random.normal(jax.random.key(1), (2, d))
    layers = stackwise.lora.stack(layer, n)
    y = layers.apply(stackwise.lora.attach(q, adapters), x)
    want = x
    for i in range(n):
        p = {k: stackwise.quant.dequantize(jax.tree.map(lambda v, i=i: v[i], q[k])) for k in q}
        p["up"] = p["up"] + adapters["up"].scale * adapters["up"].a[i] @ adapters["up"].b[i]
        want = layer(p, want)
    assert_trees_close(y, want)


@pytest.mark.parametrize("double", [False, True])
@pytest.mark.parametrize("stacked", [False, True])
def test_an_embedding_lookup_dequantizes_only_its_rows(double, stacked):
    """A (V, D) table quantized along D (`contract=1`): `take` is `dequantize(q)[ids]`,
    bitwise, and no float array as large as the table appears in its program."""
    v, d = 64, 16
    table = _weights((3, v, d) if stacked else (v, d))
    q = stackwise.quant.quantize({"e": table}, "nf4", contract=1, block_size=8,
                                 double=4 if double else False, stacked=stacked)["e"]
    assert q.shape == table.shape and q.scale.shape[-2:] == (d // 8, v)
    ids = jnp.array([[5, 0, 63], [7, 7, 1]])
    got = stackwise.quant.take(q, ids)
    full = stackwise.quant.dequantize(q)
    want = full[:, ids] if stacked else full[ids]
    np.testing.assert_array_equal(got, want)
    # Under jit, XLA may fuse the product otherwise: within a float32 rounding.
    np.testing.assert_allclose(jax.jit(stackwise.quant.take)(q, ids), want, rtol=2 * F32_EPS)
    # Within the bound of the kind: each row's scales are its own.
    rows = table[:, ids] if stacked else table[ids]
    assert float(jnp.max(jnp.abs(got - rows))) <= float(jnp.max(jnp.abs(rows))) * GAP["nf4"]
    jaxpr = jax.make_jaxpr(stackwise.quant.take)(q, ids).jaxpr
    floats = [np.prod(x.aval.shape) for e in jaxpr.eqns for x in e.outvars
              if jnp.issubdtype(x.aval.dtype, jnp.floating)]
    assert max(floats) == got.size, (max(floats), got.size)


def test_a_head_outside_the_stack_and_a_merged_table():
    """A head (D, V) without a layer axis (`stacked=False`), contracted along D by default;
    an adapter merged into a table quantized along D is requantized along D."""
    d, v = 16, 32
    head = _weights((d, v))
    q = stackwise.quant.quantize({"head": head}, "int8", stacked=False, block_size=8)["head"]
    assert q.codes.shape == (d, v) and q.scale.shape == (2, v)
    one = stackwise.quant.quantize({"head": head[None]}, "int8", block_size=8)["head"]
    for mine, its in zip(jax.tree.leaves(q), jax.tree.leaves(one)):  # a stack of one, bitwise
        np.testing.assert_array_equal(mine, its[0])
    err = jnp.abs(stackwise.quant.dequantize(q) - head)
    assert bool((err <= jnp.repeat(q.scale, 8, axis=0) / 2 * (1 + 1e-6)).all())
    table = {"e": _weights((2, v, d))}
    qt = stackwise.quant.quantize(table, "int4", contract=1, block_size=4)
    adapters = trained(stackwise.lora.init(KEY, qt, rank=2))
    merged = stackwise.lora.merge(qt, adapters)["e"]
    again = stackwise.quant.quantize(stackwise.lora.merge(stackwise.quant.dequantize(qt),
                                                          adapters), "int4", contract=1,
                                     block_size=4)["e"]
    assert merged.axes == (1,)
    np.testing.assert_array_equal(merged.codes, again.codes)
    np.testing.assert_array_equal(merged.scale, again.scale)
