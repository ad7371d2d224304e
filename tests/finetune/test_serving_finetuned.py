"""The serving layout (`stackwise.to_serving`) of fine-tuned models: merged LoRA, attached
adapters and quantized bases, decoded with a cache, against the scanned apply and the loop
model (tests/finetune/_reference.py). Quantized codes stay quantized per layer: each layer
unpacks and dequantizes its own codes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from _reference import D, H, apply, gate, init, layer_params, trained
from _trees import assert_trees_bitwise, assert_trees_close

import stackwise

KEY = jax.random.key(0)
UV = ["['u']", "['v']"]
N, T = 4, 6  # layers, cache length


def _step(apply_fn):
    """A layer with a cache: its output written at ``pos``."""

    def step(p, cache, x, pos):
        y = apply_fn(p, x)
        return y, jax.lax.dynamic_update_slice(cache, y, (pos, 0))

    return step


def _decode(step, params, cache, tokens=3):
    x, ys = jnp.ones((1, D)), []
    for pos in range(tokens):
        x, cache = step(params, cache, x, jnp.int32(pos))
        ys.append(x)
    return ys, cache


def _base(kind):
    base = stackwise.stack(init, apply, N).init(KEY)
    if kind == "float":
        return base
    if kind == "nf4-double":  # QLoRA's: nf4, its scales double-quantized (5 a block here)
        return stackwise.quant.quantize(base, "nf4", targets=UV, double=5)
    return stackwise.quant.quantize(base, kind, targets=UV)


@pytest.mark.parametrize(
    "kind, adapted",
    [(kind, adapted) for kind in ("float", "int8", "nf4", "nf4-double")
     for adapted in ("none", "attached", "merged")],
)
def test_decode_equals_the_scan_and_the_loop(kind, adapted):
    """A quantized base merges into a quantized base (requantized): the loop model runs the
    merged base's own dequantized layers."""
    base = _base(kind)
    adapters = trained(stackwise.lora.init(KEY, base, rank=2, targets=UV))
    params = {
        "none": base,
        "attached": stackwise.lora.attach(base, adapters),
        "merged": stackwise.lora.merge(base, adapters),
    }[adapted]
    layers = stackwise.lora.stack(_step(apply), N, with_state=True)
    step = jax.jit(layers.apply, donate_argnums=1)
    served = stackwise.to_serving(params)
    ys, served_cache = _decode(step, served, stackwise.to_serving(jnp.zeros((N, T, D))))
    ys_scan, scan_cache = _decode(step, params, jnp.zeros((N, T, D)))
    assert_trees_close(ys, ys_scan)
    assert_trees_close(stackwise.from_serving(served_cache), scan_cache)

    # The loop model: each layer's weights written out by hand (tests/finetune/_reference).
    per_layer = [layer_params(base, adapters if adapted != "none" else None, i) for i in range(N)]
    if adapted == "merged" and kind != "float":
        per_layer = [layer_params(params, None, i) for i in range(N)]

    @jax.jit
    def loop(per_layer, caches, x, pos):
        new = []
        for p, c in zip(per_layer, caches):
            x, c = _step(apply)(p, c, x, pos)
            new.append(c)
        return x, new

    ys_loop, caches = _decode(loop, per_layer, [jnp.zeros((T, D))] * N)
    assert_trees_close(ys, ys_loop)
    assert_trees_close(list(served_cache.layers), caches)


@pytest.mark.parametrize("kind", ["int8", "nf4"])
def test_quantized_codes_stay_quantized_per_layer(kind):
    """Each layer's buffer holds its own codes; the program unpacks (nf4) and dequantizes
    each layer's codes inside that layer, never a stacked array."""
    served = stackwise.to_serving(_base(kind))
    u = served.layers[2]["u"]
    assert isinstance(u, stackwise.quant.Quantized)
    rows = (D + 1) // 2 if kind == "nf4" else D
    assert u.codes.shape == (rows, H) and u.scale.shape == (1, H)
    assert u.codes.dtype == (jnp.uint8 if kind == "nf4" else jnp.int8)
    layers = stackwise.lora.stack(apply, N)
    eqns = list(_eqns(jax.make_jaxpr(layers.apply)(served, jnp.ones((1, D))).jaxpr))
    assert not any(e.primitive.name == "scan" for e in eqns)
    shapes = {v.aval.shape for e in eqns for v in e.invars if hasattr(v, "aval")}
    assert not any(len(s) == 3 and s[0] == N for s in shapes), shapes  # nothing stacked
    # int8 codes are converted to floats, packed nf4 codes unpacked (a shift), per layer:
    first = "convert_element_type" if kind == "int8" else "shift_right_logical"
    codes = [
        e for e in eqns if e.primitive.name == first and e.invars[0].aval.dtype == u.codes.dtype
    ]
    v = served.layers[2]["v"]
    assert {e.invars[0].aval.shape for e in codes} == {u.codes.shape, v.codes.shape}
    assert len(codes) == 2 * N  # u and v of every layer, each on its own


def _eqns(jaxpr):
    """Every equation of a jaxpr and of the jaxprs inside it (remat, pjit, custom_vjp)."""
    for e in jaxpr.eqns:
        yield e
        for value in e.params.values():
            inner = getattr(value, "jaxpr", value)
            if hasattr(inner, "eqns"):
                yield from _eqns(inner)


def test_a_pattern_of_wrapped_layers():
    """`stackwise.lora.stack([apply, gate], n)` over a pattern's serving layout."""
    n = 5
    bases = stackwise.stack([init, init], [apply, gate], n).init(KEY)
    bases = tuple(stackwise.quant.quantize(b, "int8", targets=UV) for b in bases)
    layers = stackwise.lora.stack([apply, gate], n)
    x = jnp.ones((2, D))
    served = stackwise.to_serving(bases, pattern=2)
    out = jax.jit(layers.apply)(served, x)
    assert_trees_close(out, jax.jit(layers.apply)(bases, x))
    y = x
    for i, p in enumerate(served.layers):
        y = (apply, gate)[i % 2](stackwise.quant.dequantize(p), y)
    assert_trees_bitwise(out, y)
