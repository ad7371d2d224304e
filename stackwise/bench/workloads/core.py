"""The blocks in pure JAX: Python loops, a hand-written ``lax.scan`` and ``stackwise.stack``.

``mlp`` is the core comparison (the residual block ``h + gelu(h @ w1) @ w2``);
``transformer`` is the pure-JAX side of the framework comparison (its Haiku, linen and NNX
rows are in the modules named after them).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

import stackwise
from stackwise.bench.config import BenchConfig
from stackwise.bench.workloads.common import (
    LOOP,
    SCAN,
    Build,
    Case,
    attend,
    device,
    mean_square,
    transformer_input,
    unstack,
)


def _variants(layer_init, layer, inputs, *, slices: bool, checkpoint: bool) -> list[Case]:
    """The rows of a pure-JAX block: loops, the hand-written scan(s), stackwise's remats.

    ``inputs(n) -> (stacked params, x)`` gives the values (from numpy: no compiles);
    ``layer_init`` is only what ``stackwise.stack`` is given.
    """

    def loop_separate(n):
        stacked, x = inputs(n)

        def loss(ps, h):
            for p in ps:
                h = layer(p, h)
            return mean_square(h)

        return unstack(stacked), x, loss

    def loop_slices(n):
        stacked, x = inputs(n)

        def loss(ps, h):
            for i in range(n):
                h = layer(jax.tree.map(lambda a, i=i: a[i], ps), h)
            return mean_square(h)

        return stacked, x, loss

    def hand_scan(remat: bool) -> Build:
        def build(n):
            stacked, x = inputs(n)
            body = lambda h, p: (layer(p, h), None)  # noqa: E731
            if remat:
                body = jax.checkpoint(body, prevent_cse=False)
            return stacked, x, lambda ps, h: mean_square(jax.lax.scan(body, h, ps)[0])

        return build

    def with_stackwise(**options) -> Build:
        def build(n):
            stacked, x = inputs(n)
            layers = stackwise.stack(layer_init, layer, n, **options)
            return stacked, x, lambda ps, h: mean_square(layers.apply(ps, h))

        return build

    return [
        Case(LOOP, "jax", "off", loop_separate),
        *([Case("loop (stacked slices)", "jax", "off", loop_slices)] if slices else []),
        Case(SCAN, "jax", "off", hand_scan(False)),
        *([Case("lax.scan+checkpoint (hand)", "jax", "layer", hand_scan(True))]
          if checkpoint else []),
        Case("stackwise", "jax", "off", with_stackwise(remat=False)),
        Case("stackwise default", "jax", "dots", with_stackwise()),
        Case("stackwise remat", "jax", "layer", with_stackwise(remat=True)),
        Case("stackwise nested", "jax", "nested", with_stackwise(remat=True, nested=True)),
    ]


def mlp(cfg: BenchConfig, notes: list[str]) -> list[Case]:
    """The residual MLP block ``h + gelu(h @ w1) @ w2`` (D, hidden, batch from ``cfg``)."""
    del notes  # nothing here is optional
    d, hidden, batch = cfg.d, cfg.hidden, cfg.batch

    def layer_init(key):
        k1, k2 = jax.random.split(key)
        return {
            "w1": jax.random.normal(k1, (d, hidden)) / math.sqrt(d),
            "w2": jax.random.normal(k2, (hidden, d)) / math.sqrt(hidden) * 0.1,
        }

    def layer(p, h):
        return h + jax.nn.gelu(h @ p["w1"]) @ p["w2"]

    def inputs(n):
        rng = np.random.default_rng(cfg.seed)
        stacked = {
            "w1": rng.standard_normal((n, d, hidden), np.float32) / math.sqrt(d),
            "w2": rng.standard_normal((n, hidden, d), np.float32) / math.sqrt(hidden) * 0.1,
        }
        return device(stacked), device(rng.standard_normal((batch, d), np.float32))

    return _variants(layer_init, layer, inputs, slices=True, checkpoint=True)


def transformer(cfg: BenchConfig, notes: list[str]) -> list[Case]:
    """The pre-LN causal self-attention + MLP block, written in pure JAX."""
    del notes
    d, hidden, heads = cfg.tf_d, cfg.tf_hidden, cfg.tf_heads

    def dense(key, m, k):
        return {"w": jax.random.normal(key, (m, k)) / math.sqrt(m), "b": jnp.zeros(k)}

    def layer_init(key):
        ks = jax.random.split(key, 4)
        return {
            "ln1": {"scale": jnp.ones(d), "bias": jnp.zeros(d)},
            "qkv": dense(ks[0], d, 3 * d),
            "out": dense(ks[1], d, d),
            "ln2": {"scale": jnp.ones(d), "bias": jnp.zeros(d)},
            "fc1": dense(ks[2], d, hidden),
            "fc2": dense(ks[3], hidden, d),
        }

    def linear(p, x):
        return x @ p["w"] + p["b"][None, None, :]

    def norm(p, x):
        mean = x.mean(-1, keepdims=True)
        var = jnp.square(x - mean).mean(-1, keepdims=True)
        scale, bias = p["scale"][None, None], p["bias"][None, None]
        return (x - mean) * jax.lax.rsqrt(var + 1e-5) * scale + bias

    def layer(p, x):
        x = x + linear(p["out"], attend(linear(p["qkv"], norm(p["ln1"], x)), heads))
        return x + linear(p["fc2"], jax.nn.gelu(linear(p["fc1"], norm(p["ln2"], x))))

    def inputs(n):
        rng = np.random.default_rng(cfg.seed)

        def dense_np(m, k):
            w = rng.standard_normal((n, m, k), np.float32) / math.sqrt(m)
            return {"w": w, "b": np.zeros((n, k), np.float32)}

        norm_np = {"scale": np.ones((n, d), np.float32), "bias": np.zeros((n, d), np.float32)}
        stacked = {
            "ln1": norm_np, "qkv": dense_np(d, 3 * d), "out": dense_np(d, d), "ln2": norm_np,
            "fc1": dense_np(d, hidden), "fc2": dense_np(hidden, d),
        }
        return device(stacked), transformer_input(cfg)

    return _variants(layer_init, layer, inputs, slices=False, checkpoint=False)
