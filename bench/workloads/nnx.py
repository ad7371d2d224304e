"""The blocks in Flax NNX: a Python loop, ``nnx.scan`` and ``stackwise.nnx.Stack``.

The transformer block, and the decode and prefill blocks (the KV cache in ``nnx.Cache``
variables). Imported only when their rows are asked for (it imports flax.nnx).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from stackwise.bench.config import BenchConfig
from stackwise.bench.workloads import common


class Block(nnx.Module):
    """The transformer block as an ordinary NNX module."""

    def __init__(self, d: int, hidden: int, heads: int, rngs: nnx.Rngs):
        self.heads = heads
        self.ln1 = nnx.LayerNorm(d, rngs=rngs)
        self.qkv = nnx.Linear(d, 3 * d, rngs=rngs)
        self.out = nnx.Linear(d, d, rngs=rngs)
        self.ln2 = nnx.LayerNorm(d, rngs=rngs)
        self.fc1 = nnx.Linear(d, hidden, rngs=rngs)
        self.fc2 = nnx.Linear(hidden, d, rngs=rngs)

    def __call__(self, x):
        x = x + self.out(common.attend(self.qkv(self.ln1(x)), self.heads))
        return x + self.fc2(jax.nn.gelu(self.fc1(self.ln2(x))))


class Loop(nnx.Module):
    """Blocks in a Python loop."""

    def __init__(self, blocks: list[nnx.Module]):
        self.blocks = nnx.List(blocks)

    def __call__(self, x, *args):
        for block in self.blocks:
            x = block(x, *args)
        return x


class Scan(nnx.Module):
    """n blocks made by ``nnx.vmap`` and run by ``nnx.scan``, with ``nnx.remat`` if asked."""

    def __init__(self, make_block, n: int, rngs: nnx.Rngs, remat: str):
        @nnx.split_rngs(splits=n)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create(rngs):
            return make_block(rngs)

        self.blocks = create(rngs)
        self.remat = remat

    def __call__(self, x, *args):
        def step(x, block, *args):
            return block(x, *args)

        if self.remat != "off":
            step = nnx.remat(step, policy=common.tool_policy(self.remat))
        in_axes = (nnx.Carry, 0, *(None,) * len(args))  # args: the same for every layer
        return nnx.scan(in_axes=in_axes, out_axes=nnx.Carry)(step)(x, self.blocks, *args)


def transformer(cfg: BenchConfig, notes: list[str]) -> list[common.Case]:
    """NNX's rows of the transformer block (see :func:`common.framework_cases`)."""

    def make_block(rngs):
        return Block(cfg.tf_d, cfg.tf_hidden, cfg.tf_heads, rngs)

    def model(make):  # make(n, rngs) -> the model
        def build(n):
            graphdef, state = nnx.split(make(n, nnx.Rngs(cfg.seed)))
            x = common.transformer_input(cfg)
            return state, x, lambda s, h: common.mean_square(nnx.merge(graphdef, s)(h))

        return build

    def stack(sw, remat):
        return model(
            lambda n, rngs: sw.Stack(make_block, n=n, rngs=rngs, remat=common.stack_remat(remat))
        )

    return common.framework_cases(
        "nnx",
        loop=("nnx loop", model(lambda n, rngs: Loop([make_block(rngs) for _ in range(n)]))),
        tools={
            "off": "nnx.scan",
            "dots": "nnx.scan+nnx.remat(dots)",
            "layer": "nnx.scan+nnx.remat",
        },
        tool=lambda remat: model(lambda n, rngs: Scan(make_block, n, rngs, remat)),
        adapter="stackwise.nnx",
        stack=stack,
        notes=notes,
    )


class DecodeAttention(nnx.Module):
    """The decode block: attention over a KV cache kept in ``nnx.Cache`` variables."""

    def __init__(self, d: int, heads: int, cache: tuple[int, ...], dtype: str, rngs: nnx.Rngs):
        self.heads = heads
        self.qkv = nnx.Linear(d, 3 * d, rngs=rngs)
        self.out = nnx.Linear(d, d, rngs=rngs)
        self.k = nnx.Cache(jnp.zeros(cache, dtype))
        self.v = nnx.Cache(jnp.zeros(cache, dtype))

    def __call__(self, x, pos):
        y, self.k[...], self.v[...] = common.decode_attend(
            self.qkv(x), self.k[...], self.v[...], pos, self.heads
        )
        return x + self.out(y)


def decode(cfg: BenchConfig, notes: list[str]) -> list[common.Case]:
    """NNX's rows of the decode block: one token per call (see :func:`_decoding`)."""
    return _decoding("decode", cfg, notes, tokens=1, pos=cfg.dec_prompt)


def prefill(cfg: BenchConfig, notes: list[str]) -> list[common.Case]:
    """NNX's rows of the prefill block: a whole prompt per call (see :func:`_decoding`)."""
    return _decoding("prefill", cfg, notes, tokens=cfg.dec_prompt, pos=0)


def _decoding(block_name: str, cfg: BenchConfig, notes: list[str], tokens: int, pos: int):
    """A loop of blocks, ``nnx.scan`` over blocks made by ``nnx.vmap`` and
    ``stackwise.nnx.Stack``, each a step that merges the module, calls it and returns its
    ``nnx.Cache`` state. Every row's variables are the Stack's (the loop's blocks from
    ``Stack.to_layers()``, the scanned blocks updated with the Stack's stacked state), so
    that every row computes the same."""
    sw = common.adapter_or_note("stackwise.nnx", block_name, notes)
    if sw is None:
        return []

    def make_block(rngs):
        return DecodeAttention(cfg.dec_d, cfg.dec_heads, common.cache_shape(cfg), cfg.dec_dtype,
                               rngs)

    x = common.decode_input(cfg, tokens, pos)

    def model(make, remat="off", unroll=1):  # make(stack, n) -> the row's model, from the Stack
        def build(n):
            stack = sw.Stack(make_block, n, rngs=nnx.Rngs(cfg.seed),
                             remat=common.stack_remat(remat), unroll=unroll)
            graphdef, params, cache = nnx.split(make(stack, n), nnx.Param, nnx.Cache)

            def step(params, cache, x):
                m = nnx.merge(graphdef, params, cache)
                return m(*x), nnx.state(m, nnx.Cache)

            return params, cache, x, step

        return build

    def scan(stack, n):
        scanned = Scan(make_block, n, nnx.Rngs(cfg.seed), "off")
        nnx.update(scanned.blocks, nnx.state(stack.layers))
        return scanned

    def stack(sw, remat, unroll=1):
        return model(lambda stack, n: stack, remat, unroll)

    return common.framework_cases(
        "nnx",
        loop=("nnx loop", model(lambda stack, n: Loop(stack.to_layers()))),
        tools={"off": "nnx.scan"},
        tool=lambda remat: model(scan),
        adapter="stackwise.nnx",
        stack=stack,
        notes=notes,
        remats=("off",),
        unrolled=True,
    )
