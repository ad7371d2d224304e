"""The blocks in pure JAX: Python loops, a hand-written ``lax.scan`` and ``stackwise.stack``.

``mlp`` is the core comparison (the residual block ``h + gelu(h @ w1) @ w2``);
``transformer``, ``decode`` and ``prefill`` are the pure-JAX side of the framework
comparisons (their Haiku, linen and NNX rows are in the modules named after them);
``pattern`` is a layer pattern ``[a, a, b]`` against a loop and a scan over groups.
"""

from __future__ import annotations

import math
from collections.abc import Callable

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
    decode_attend,
    decode_input,
    device,
    mean_square,
    transformer_input,
    unstack,
    zero_cache,
)


def _variants(layer_init, layer, inputs, *, slices: bool, checkpoint: bool,
              autostack: bool = False) -> list[Case]:
    """The rows of a pure-JAX block: loops, the hand-written scan(s), stackwise's remats,
    and (``autostack``) the loop over separate params run by :func:`stackwise.autostack`.

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

    def autostacked(n):
        """The loop over separate params, unmodified, through ``stackwise.autostack``: its
        params are autostack's stacked layout. Tracing the loop and finding its run happen
        here, in the build (not timed: the compile column is the program's, as for every row)."""
        params, x, loss = loop_separate(n)
        stacked, f = stackwise.autostack(loss, params, x, n=n)
        return stacked, x, f

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
        *(
            [Case("lax.scan+checkpoint (hand)", "jax", "layer", hand_scan(True))]
            if checkpoint
            else []
        ),
        Case("stackwise", "jax", "off", with_stackwise(remat=False)),
        Case("stackwise default", "jax", "dots", with_stackwise()),
        Case("stackwise remat", "jax", "layer", with_stackwise(remat=True)),
        Case("stackwise nested", "jax", "nested", with_stackwise(remat=True, nested=True)),
        *([Case("stackwise.autostack", "jax", "off", autostacked)] if autostack else []),
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

    return _variants(layer_init, layer, inputs, slices=True, checkpoint=True, autostack=True)


def transformer(cfg: BenchConfig, notes: list[str]) -> list[Case]:
    """The pre-LN causal self-attention + MLP block, written in pure JAX."""
    del notes
    return _variants(*transformer_block(cfg), slices=False, checkpoint=False, autostack=True)


def transformer_block(cfg: BenchConfig) -> tuple[Callable, Callable, Callable]:
    """The pure-JAX transformer block of ``cfg``'s ``tf_*`` sizes: ``(layer_init, layer,
    inputs)``, with ``layer(p, x) -> x``, ``layer_init(key) -> p`` (what ``stackwise.stack``
    is given) and ``inputs(n) -> (stacked params, x)`` (from numpy: no compiles). The
    ``transformer`` block's rows, and ``benchmarks/tpu_train.py``'s, run it."""
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
            "ln1": norm_np,
            "qkv": dense_np(d, 3 * d),
            "out": dense_np(d, d),
            "ln2": norm_np,
            "fc1": dense_np(d, hidden),
            "fc2": dense_np(hidden, d),
        }
        return device(stacked), transformer_input(cfg)

    return layer_init, layer, inputs


def decode(cfg: BenchConfig, notes: list[str]) -> list[Case]:
    """One token per call, at position ``dec_prompt``: see :func:`_decoding`."""
    del notes
    return _decoding(cfg, tokens=1, pos=cfg.dec_prompt)


def prefill(cfg: BenchConfig, notes: list[str]) -> list[Case]:
    """A prompt of ``dec_prompt`` tokens in one call, from position 0: see :func:`_decoding`."""
    del notes
    return _decoding(cfg, tokens=cfg.dec_prompt, pos=0)


def _decoding(cfg: BenchConfig, tokens: int, pos: int) -> list[Case]:
    """A decoding step of n attention layers, each with its own KV cache, the cache donated.

    Rows: the Python loop over separate params and separate caches (the reference); a
    hand-written ``lax.scan`` with the stacked cache as its per-layer input and output
    (every call writes the whole new cache); a hand-written scan with the stacked cache
    in its carry, written at the layer's index (in place); ``stackwise.stack(...,
    with_state=True)`` on the stacked params and cache, and in the serving layout (the
    params and the cache as per-layer buffers in a ``stackwise.Serving``, what
    ``stackwise.to_serving`` gives: a Python loop), and ``unroll=True`` (a Python loop writing
    each layer's row of the stacked cache). Forward only, so remat changes nothing: the
    stack runs without. Every cache is zeros made on the device (:func:`zero_cache`).
    """
    d, heads = cfg.dec_d, cfg.dec_heads

    def linear(p, h):
        return h @ p["w"] + p["b"][None, None, :]

    def layer(p, cache, h, pos):
        y, k, v = decode_attend(linear(p["qkv"], h), cache["k"], cache["v"], pos, heads)
        return h + linear(p["out"], y), {"k": k, "v": v}

    def inputs(n):
        rng = np.random.default_rng(cfg.seed)

        def dense_np(m, k):
            w = rng.standard_normal((n, m, k), np.float32) / math.sqrt(m)
            return {"w": w, "b": 0.1 * rng.standard_normal((n, k), np.float32)}

        params = {"qkv": dense_np(d, 3 * d), "out": dense_np(d, d)}
        return device(params), decode_input(cfg, tokens, pos)

    def loop_separate(n):
        params, x = inputs(n)

        def step(ps, caches, x):
            h, pos = x
            new = []
            for p, c in zip(ps, caches):
                h, c = layer(p, c, h, pos)
                new.append(c)
            return h, new

        return unstack(params), zero_cache(cfg, n, per_layer=True), x, step

    def hand_scan(n):
        params, x = inputs(n)

        def step(ps, cache, x):
            h, pos = x
            return jax.lax.scan(lambda h, pc: layer(*pc, h, pos), h, (ps, cache))

        return params, zero_cache(cfg, n), x, step

    def hand_scan_carry(n):
        params, x = inputs(n)

        def step(ps, cache, x):
            h, pos = x

            def body(carry, inputs):
                (h, cache), (p, i) = carry, inputs
                mine = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, 0, False), cache)
                h, mine = layer(p, mine, h, pos)
                cache = jax.tree.map(
                    lambda a, c: jax.lax.dynamic_update_index_in_dim(a, c, i, 0), cache, mine
                )
                return (h, cache), None

            (h, cache), _ = jax.lax.scan(body, (h, cache), (ps, jnp.arange(n)))
            return h, cache

        return params, zero_cache(cfg, n), x, step

    def with_stackwise(serving: bool, unroll: int | bool = 1) -> Build:
        def build(n):
            params, x = inputs(n)
            layers = stackwise.stack(None, layer, n, with_state=True, remat=False, unroll=unroll)
            if serving:  # the serving layout (what to_serving gives): per-layer buffers,
                # the params sliced once in numpy, the cache made so
                params = stackwise.Serving(unstack(params))
                cache = stackwise.Serving(zero_cache(cfg, n, per_layer=True))
            else:
                cache = zero_cache(cfg, n)
            return params, cache, x, lambda ps, cache, x: layers.apply(ps, cache, *x)

        return build

    return [
        Case(LOOP, "jax", "off", loop_separate),
        Case(SCAN, "jax", "off", hand_scan),
        Case("lax.scan (cache in carry)", "jax", "off", hand_scan_carry),
        Case("stackwise", "jax", "off", with_stackwise(False)),
        Case("stackwise serving layout", "jax", "off", with_stackwise(True)),
        Case("stackwise unroll=True", "jax", "off", with_stackwise(False, unroll=True)),
    ]


def pattern(cfg: BenchConfig, notes: list[str]) -> list[Case]:
    """A pattern ``[a, a, b]`` of residual MLP blocks (``a`` with ``hidden`` units, ``b``
    with ``pattern_hidden``) repeated to depth n, n not necessarily a multiple of 3.

    Rows: the Python loop over separate params; a hand-written ``lax.scan`` over groups
    of 3 layers, then the remaining n % 3 layers by hand (with and without a checkpoint
    around each group); ``stackwise.stack([init_a, init_a, init_b], [apply] * 3, n)`` at
    each remat. The scans and the stack take the same params: position p's layers p,
    p+3, ... stacked (``Stacked.init``'s layout).
    """
    del notes
    d, batch = cfg.d, cfg.batch
    hiddens = (cfg.hidden, cfg.hidden, cfg.pattern_hidden)
    k = len(hiddens)

    def layer_init(hidden):
        def init(key):
            k1, k2 = jax.random.split(key)
            return {
                "w1": jax.random.normal(k1, (d, hidden)) / math.sqrt(d),
                "w2": jax.random.normal(k2, (hidden, d)) / math.sqrt(hidden) * 0.1,
            }

        return init

    def layer(p, h):
        return h + jax.nn.gelu(h @ p["w1"]) @ p["w2"]

    def inputs(n):
        rng = np.random.default_rng(cfg.seed)
        positions = []
        for p, hidden in enumerate(hiddens):
            count = len(range(p, n, k))
            positions.append(
                {
                    "w1": rng.standard_normal((count, d, hidden), np.float32) / math.sqrt(d),
                    "w2": rng.standard_normal((count, hidden, d), np.float32)
                    / math.sqrt(hidden)
                    * 0.1,
                }
            )
        return device(tuple(positions)), device(rng.standard_normal((batch, d), np.float32))

    def loop_separate(n):
        positions, x = inputs(n)
        per_position = [unstack(p) for p in positions]
        layers = [per_position[i % k][i // k] for i in range(n)]

        def loss(ps, h):
            for p in ps:
                h = layer(p, h)
            return mean_square(h)

        return layers, x, loss

    def hand_scan(remat: bool) -> Build:
        def build(n):
            positions, x = inputs(n)
            repeats, tail = divmod(n, k)

            def group(h, ps):
                for p in ps:
                    h = layer(p, h)
                return h, None

            if remat:
                group = jax.checkpoint(group, prevent_cse=False)

            def loss(positions, h):
                whole = tuple(jax.tree.map(lambda a: a[:repeats], p) for p in positions)
                h = jax.lax.scan(group, h, whole)[0]
                for p in range(tail):  # the last, partial repeat
                    h = layer(jax.tree.map(lambda a: a[repeats], positions[p]), h)
                return mean_square(h)

            return positions, x, loss

        return build

    def with_stackwise(**options) -> Build:
        def build(n):
            positions, x = inputs(n)
            inits = [layer_init(hidden) for hidden in hiddens]
            layers = stackwise.stack(inits, [layer] * k, n, **options)
            return positions, x, lambda ps, h: mean_square(layers.apply(ps, h))

        return build

    return [
        Case(LOOP, "jax", "off", loop_separate),
        Case(SCAN, "jax", "off", hand_scan(False)),
        Case("lax.scan+checkpoint (hand)", "jax", "layer", hand_scan(True)),
        Case("stackwise", "jax", "off", with_stackwise(remat=False)),
        Case("stackwise default", "jax", "dots", with_stackwise()),
        Case("stackwise remat", "jax", "layer", with_stackwise(remat=True)),
    ]
