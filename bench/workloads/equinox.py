"""The blocks in Equinox: a Python loop, the hand-written ``eqx.filter_vmap`` + ``lax.scan``
and ``stackwise.equinox.Stack``.

Equinox has no layer-stacking tool of its own; its users build the layers with
``eqx.filter_vmap`` and run them with ``lax.scan`` over ``eqx.partition``-ed arrays, with
``eqx.filter_checkpoint`` around the body for remat: that is this framework's tool row
(``filter_vmap+scan``, ``filter_vmap+scan+checkpoint(dots)``, ``...+checkpoint``).
The blocks act on one example, as Equinox layers do; every row maps the whole model over
the batch with ``jax.vmap`` (the decode and prefill blocks' attention maps its linears over
the batch and tokens itself, its KV cache a plain pytree). Imported only when Equinox's rows
are asked for (it imports equinox).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import numpy as np

from stackwise.bench.config import BenchConfig
from stackwise.bench.workloads import common


class Mlp(eqx.Module):
    """The residual MLP block ``h + gelu(h @ w1) @ w2`` as an ordinary Equinox module."""

    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, d: int, hidden: int, *, key: jax.Array):
        k1, k2 = jax.random.split(key)
        self.up = eqx.nn.Linear(d, hidden, use_bias=False, key=k1)
        self.down = eqx.nn.Linear(hidden, d, use_bias=False, key=k2)

    def __call__(self, x):  # x: [d]
        return x + self.down(jax.nn.gelu(self.up(x)))


class Transformer(eqx.Module):
    """The transformer block (pre-LN causal attention + MLP) on one sequence ``[seq, d]``."""

    ln1: eqx.nn.LayerNorm
    qkv: eqx.nn.Linear
    out: eqx.nn.Linear
    ln2: eqx.nn.LayerNorm
    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear
    heads: int = eqx.field(static=True)

    def __init__(self, d: int, hidden: int, heads: int, *, key: jax.Array):
        ks = jax.random.split(key, 4)
        self.ln1, self.ln2 = eqx.nn.LayerNorm(d), eqx.nn.LayerNorm(d)
        self.qkv = eqx.nn.Linear(d, 3 * d, key=ks[0])
        self.out = eqx.nn.Linear(d, d, key=ks[1])
        self.fc1 = eqx.nn.Linear(d, hidden, key=ks[2])
        self.fc2 = eqx.nn.Linear(hidden, d, key=ks[3])
        self.heads = heads

    def __call__(self, x):  # x: [seq, d]; Equinox's layers act on one position: vmap
        qkv = jax.vmap(self.qkv)(jax.vmap(self.ln1)(x))
        x = x + jax.vmap(self.out)(common.attend(qkv[None], self.heads)[0])
        h = jax.vmap(self.fc1)(jax.vmap(self.ln2)(x))
        return x + jax.vmap(self.fc2)(jax.nn.gelu(h))


class Loop(eqx.Module):
    """n separately held blocks in a Python loop."""

    blocks: list

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return x


class Scan(eqx.Module):
    """What Equinox users write: ``eqx.filter_vmap`` to build the n blocks, ``lax.scan`` over
    their arrays to run them, ``eqx.filter_checkpoint`` around the body if asked."""

    layers: eqx.Module
    remat: str = eqx.field(static=True)

    def __init__(self, make_block: Callable, n: int, key: jax.Array, remat: str):
        self.layers = eqx.filter_vmap(make_block)(jax.random.split(key, n))
        self.remat = remat

    def __call__(self, x):
        params, static = eqx.partition(self.layers, eqx.is_array)

        def body(x, layer):
            return eqx.combine(layer, static)(x), None

        if self.remat != "off":
            body = eqx.filter_checkpoint(body, policy=common.tool_policy(self.remat))
        return jax.lax.scan(body, x, params)[0]


def _rows(
    make_block: Callable[[jax.Array], eqx.Module], x: jax.Array, cfg: BenchConfig, notes: list[str]
) -> list[common.Case]:
    """Equinox's rows of a block made by ``make_block(key)`` (see ``framework_cases``)."""

    def model(make: Callable[[int, jax.Array], Any]) -> common.Build:
        """``make(n, key)`` -> a model of ``n`` blocks acting on one example."""

        def build(n):
            params, static = eqx.partition(make(n, jax.random.key(cfg.seed)), eqx.is_array)
            return params, x, lambda p, h: common.mean_square(jax.vmap(eqx.combine(p, static))(h))

        return build

    def loop(n, key):
        return Loop([make_block(k) for k in jax.random.split(key, n)])

    def stack(sw, remat):
        return model(
            lambda n, key: sw.Stack(make_block, n, remat=common.stack_remat(remat), key=key)
        )

    return common.framework_cases(
        "equinox",
        loop=("eqx loop", model(loop)),
        tools={
            "off": "filter_vmap+scan",
            "dots": "filter_vmap+scan+checkpoint(dots)",
            "layer": "filter_vmap+scan+checkpoint",
        },
        tool=lambda remat: model(lambda n, key: Scan(make_block, n, key, remat)),
        adapter="stackwise.equinox",
        stack=stack,
        notes=notes,
    )


def mlp(cfg: BenchConfig, notes: list[str]) -> list[common.Case]:
    """Equinox's rows of the residual MLP block (D, hidden, batch from ``cfg``)."""
    rng = np.random.default_rng(cfg.seed + 1)
    x = common.device(rng.standard_normal((cfg.batch, cfg.d), np.float32))
    return _rows(lambda key: Mlp(cfg.d, cfg.hidden, key=key), x, cfg, notes)


def transformer(cfg: BenchConfig, notes: list[str]) -> list[common.Case]:
    """Equinox's rows of the transformer block (sizes from ``cfg``)."""

    def make_block(key):
        return Transformer(cfg.tf_d, cfg.tf_hidden, cfg.tf_heads, key=key)

    return _rows(make_block, common.transformer_input(cfg), cfg, notes)


class DecodeAttention(eqx.Module):
    """The decode block: attention over a KV cache given and returned as a plain pytree
    (``{"k", "v"}``), as Equinox layers take state that is not an ``eqx.nn.State``; its
    linears map every position of ``h [batch, tokens, d]``."""

    qkv: eqx.nn.Linear
    out: eqx.nn.Linear
    heads: int = eqx.field(static=True)

    def __init__(self, d: int, heads: int, *, key: jax.Array):
        k1, k2 = jax.random.split(key)
        self.qkv = eqx.nn.Linear(d, 3 * d, key=k1)
        self.out = eqx.nn.Linear(d, d, key=k2)
        self.heads = heads

    def __call__(self, h, cache, pos):
        each = jax.vmap(jax.vmap(self.qkv))
        y, k, v = common.decode_attend(each(h), cache["k"], cache["v"], pos, self.heads)
        return h + jax.vmap(jax.vmap(self.out))(y), {"k": k, "v": v}


def decode(cfg: BenchConfig, notes: list[str]) -> list[common.Case]:
    """Equinox's rows of the decode block: one token per call (see :func:`_decoding`)."""
    return _decoding("decode", cfg, notes, tokens=1, pos=cfg.dec_prompt)


def prefill(cfg: BenchConfig, notes: list[str]) -> list[common.Case]:
    """Equinox's rows of the prefill block: a whole prompt per call (see :func:`_decoding`)."""
    return _decoding("prefill", cfg, notes, tokens=cfg.dec_prompt, pos=0)


def _decoding(block_name: str, cfg: BenchConfig, notes: list[str], tokens: int, pos: int):
    """A loop of blocks, ``eqx.filter_vmap`` + ``lax.scan`` with the stacked cache as the
    scan's per-layer input and output, and ``stackwise.equinox.Stack(..., with_state=True)``,
    each a step ``(params, cache, x) -> (y, cache)``. Every row's params are the Stack's
    (the loop's blocks sliced from them), so that every row computes the same."""
    sw = common.adapter_or_note("stackwise.equinox", block_name, notes)
    if sw is None:
        return []
    x = common.decode_input(cfg, tokens, pos)

    def make_block(key):
        return DecodeAttention(cfg.dec_d, cfg.dec_heads, key=key)

    def model(run, layers: Callable[[Any, int], Any], **options) -> common.Build:
        """``run(model, cache, h, pos) -> (y, cache)``, on ``layers(stack, n)``: the Stack's
        blocks in the row's layout."""

        def build(n):
            stack = sw.Stack(make_block, n, with_state=True, key=jax.random.key(cfg.seed),
                             **options)
            params, static = eqx.partition(layers(stack, n), eqx.is_array)
            cache = common.zero_cache(cfg, n, per_layer=isinstance(params, list))

            def step(params, cache, x):
                return run(eqx.combine(params, static), cache, *x)

            return params, cache, x, step

        return build

    def blocks(stack, n):  # the Stack's n blocks, each its own arrays (sliced in numpy)
        params, static = eqx.partition(stack.layers, eqx.is_array)
        return [eqx.combine(p, static) for p in common.unstack(params)]

    def loop(blocks, cache, h, pos):
        new = []
        for block, c in zip(blocks, cache):
            h, c = block(h, c, pos)
            new.append(c)
        return h, new

    def scan(layers, cache, h, pos):
        params, static = eqx.partition(layers, eqx.is_array)

        def body(h, pc):
            return eqx.combine(pc[0], static)(h, pc[1], pos)

        return jax.lax.scan(body, h, (params, cache))

    def stack(sw, remat, unroll=1):
        del sw
        return model(lambda stack, cache, h, pos: stack(h, cache, pos),
                     lambda stack, n: stack, remat=common.stack_remat(remat), unroll=unroll)

    return common.framework_cases(
        "equinox",
        loop=("eqx loop", model(loop, blocks)),
        tools={"off": "filter_vmap+scan"},
        tool=lambda remat: model(scan, lambda stack, n: stack.layers),
        adapter="stackwise.equinox",
        stack=stack,
        notes=notes,
        remats=("off",),
        unrolled=True,
    )
