"""The blocks in Equinox: a Python loop, the hand-written ``eqx.filter_vmap`` + ``lax.scan``
and ``stackwise.equinox.Stack``.

Equinox has no layer-stacking tool of its own; its users build the layers with
``eqx.filter_vmap`` and run them with ``lax.scan`` over ``eqx.partition``-ed arrays, with
``eqx.filter_checkpoint`` around the body for remat: that is this framework's tool row
(``filter_vmap+scan``, ``filter_vmap+scan+checkpoint(dots)``, ``...+checkpoint``).
The blocks act on one example, as Equinox layers do; every row maps the whole model over
the batch with ``jax.vmap``. Imported only when Equinox's rows are asked for (it imports
equinox).
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
