"""The blocks in Flax linen: a Python loop, ``nn.scan`` and ``stackwise.flax.Stack``.

The transformer block, and the decode and prefill blocks (the KV cache in a ``cache``
collection). Imported only when their rows are asked for (it imports flax).
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from stackwise.bench.config import BenchConfig
from stackwise.bench.workloads import common


class Block(nn.Module):
    """The transformer block as an ordinary linen module."""

    d: int
    hidden: int
    heads: int

    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm()(x)
        x = x + nn.Dense(self.d)(common.attend(nn.Dense(3 * self.d)(h), self.heads))
        h = nn.LayerNorm()(x)
        return x + nn.Dense(self.d)(jax.nn.gelu(nn.Dense(self.hidden)(h)))


class Cell(nn.Module):
    """The block as ``nn.scan`` needs it: ``(carry, x) -> (carry, y)``."""

    d: int
    hidden: int
    heads: int

    @nn.compact
    def __call__(self, x, _):
        return Block(self.d, self.hidden, self.heads)(x), None


def transformer(cfg: BenchConfig, notes: list[str]) -> list[common.Case]:
    """linen's rows of the transformer block (see :func:`common.framework_cases`)."""
    sizes = (cfg.tf_d, cfg.tf_hidden, cfg.tf_heads)
    block = functools.partial(Block, *sizes)

    def model(body):  # body(n, x) -> y, inside a compact module
        def build(n):
            class Model(nn.Module):
                @nn.compact
                def __call__(self, x):
                    return body(n, x)

            net = Model()
            return common.initialised(net.init, net.apply, cfg)

        return build

    def scan(remat, n, x):
        cell = Cell if remat == "off" else nn.remat(Cell, policy=common.tool_policy(remat))
        scanned = nn.scan(cell, variable_axes={"params": 0}, split_rngs={"params": True}, length=n)
        return scanned(*sizes)(x, None)[0]

    def stack(sw, remat):
        return model(lambda n, x: sw.Stack(block, n=n, remat=common.stack_remat(remat))(x))

    return common.framework_cases(
        "flax",
        loop=("nn loop", model(functools.partial(common.python_loop, block))),
        tools={"off": "nn.scan", "dots": "nn.scan(nn.remat dots)", "layer": "nn.scan(nn.remat)"},
        tool=lambda remat: model(functools.partial(scan, remat)),
        adapter="stackwise.flax",
        stack=stack,
        notes=notes,
    )


class DecodeAttention(nn.Module):
    """The decode block: attention over a KV cache kept in the ``cache`` collection."""

    d: int
    heads: int
    cache: tuple[int, ...]
    dtype: str

    @nn.compact
    def __call__(self, x, pos):
        k = self.variable("cache", "k", jnp.zeros, self.cache, self.dtype)
        v = self.variable("cache", "v", jnp.zeros, self.cache, self.dtype)
        qkv = nn.Dense(3 * self.d, name="qkv")(x)
        y, k.value, v.value = common.decode_attend(qkv, k.value, v.value, pos, self.heads)
        return x + nn.Dense(self.d, name="out")(y)


class DecodeCell(DecodeAttention):
    """The decode block as ``nn.scan`` needs it: ``(carry, pos) -> (carry, None)``."""

    def __call__(self, x, pos):
        return super().__call__(x, pos), None


def decode(cfg: BenchConfig, notes: list[str]) -> list[common.Case]:
    """linen's rows of the decode block: one token per call (see :func:`_decoding`)."""
    return _decoding("decode", cfg, notes, tokens=1, pos=cfg.dec_prompt)


def prefill(cfg: BenchConfig, notes: list[str]) -> list[common.Case]:
    """linen's rows of the prefill block: a whole prompt per call (see :func:`_decoding`)."""
    return _decoding("prefill", cfg, notes, tokens=cfg.dec_prompt, pos=0)


def _decoding(block_name: str, cfg: BenchConfig, notes: list[str], tokens: int, pos: int):
    """A loop of blocks, ``nn.scan`` with the ``cache`` collection stacked and
    ``stackwise.flax.Stack``, each a step ``apply(..., mutable=["cache"])``. Every row's
    variables are the Stack's, converted with ``stackwise.flax.to_loop`` and
    ``to_scan``, so that every row computes the same."""
    sw = common.adapter_or_note("stackwise.flax", block_name, notes)
    if sw is None:
        return []
    sizes = (cfg.dec_d, cfg.dec_heads, common.cache_shape(cfg), cfg.dec_dtype)
    block = functools.partial(DecodeAttention, *sizes)
    x = common.decode_input(cfg, tokens, pos)
    axes = {"params": 0, "cache": 0}

    def model(body, convert):  # body(n, h, pos) in a compact module; convert(variables)
        def build(n):
            def net(body):
                class Model(nn.Module):
                    @nn.compact
                    def __call__(self, h, pos):
                        return body(n, h, pos)

                return Model()

            stack = net(lambda n, h, pos: sw.Stack(block, n, name="layers")(h, pos))
            variables = convert(stack.init(jax.random.key(cfg.seed), *x))
            model = net(body)

            def step(params, cache, x):
                y, new = model.apply({"params": params, "cache": cache}, *x, mutable=["cache"])
                return y, new["cache"]

            cache = common.zeroed(variables["cache"])
            return variables["params"], cache, x, step

        return build

    def loop(n, h, pos):
        for i in range(n):
            h = block(name=f"layers_{i}")(h, pos)
        return h

    def scan(n, h, pos):
        scanned = nn.scan(
            DecodeCell,
            variable_axes=axes,
            split_rngs={"params": True},
            in_axes=nn.broadcast,
            length=n,
        )
        return scanned(*sizes, name="layers")(h, pos)[0]

    def stack(sw, remat, unroll=1):
        return model(
            lambda n, h, pos: sw.Stack(block, n, remat=common.stack_remat(remat), unroll=unroll,
                                       name="layers")(h, pos),
            lambda variables: variables,
        )

    return common.framework_cases(
        "flax",
        loop=("nn loop", model(loop, lambda v: sw.to_loop(v, "layers"))),
        tools={"off": "nn.scan"},
        tool=lambda remat: model(scan, lambda v: sw.to_scan(v, "layers", variable_axes=axes)),
        adapter="stackwise.flax",
        stack=stack,
        notes=notes,
        remats=("off",),
        unrolled=True,
    )
