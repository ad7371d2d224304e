"""The transformer block in Flax NNX: a Python loop, ``nnx.scan`` and ``stackwise.nnx.Stack``.

Imported only when the transformer block's rows are asked for (it imports flax.nnx).
"""

from __future__ import annotations

import jax
from flax import nnx

from stackwise.bench.config import BenchConfig
from stackwise.bench.workloads.common import (
    Case,
    attend,
    framework_cases,
    mean_square,
    stack_remat,
    tool_policy,
    transformer_input,
)


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
        x = x + self.out(attend(self.qkv(self.ln1(x)), self.heads))
        return x + self.fc2(jax.nn.gelu(self.fc1(self.ln2(x))))


class Loop(nnx.Module):
    """n blocks in a Python loop."""

    def __init__(self, make_block, n: int, rngs: nnx.Rngs):
        self.blocks = nnx.List([make_block(rngs) for _ in range(n)])

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
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

    def __call__(self, x):
        def step(x, block):
            return block(x)

        if self.remat != "off":
            step = nnx.remat(step, policy=tool_policy(self.remat))
        return nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)(step)(x, self.blocks)


def transformer(cfg: BenchConfig, notes: list[str]) -> list[Case]:
    """NNX's rows of the transformer block (see :func:`framework_cases`)."""

    def make_block(rngs):
        return Block(cfg.tf_d, cfg.tf_hidden, cfg.tf_heads, rngs)

    def model(make):  # make(n, rngs) -> the model
        def build(n):
            graphdef, state = nnx.split(make(n, nnx.Rngs(cfg.seed)))
            x = transformer_input(cfg)
            return state, x, lambda s, h: mean_square(nnx.merge(graphdef, s)(h))

        return build

    def stack(sw, remat):
        return model(lambda n, rngs: sw.Stack(make_block, n=n, rngs=rngs, remat=stack_remat(remat)))

    return framework_cases(
        "nnx",
        loop=("nnx loop", model(lambda n, rngs: Loop(make_block, n, rngs))),
        tools={
            "off": "nnx.scan", "dots": "nnx.scan+nnx.remat(dots)", "layer": "nnx.scan+nnx.remat",
        },
        tool=lambda remat: model(lambda n, rngs: Scan(make_block, n, rngs, remat)),
        adapter="stackwise.nnx",
        stack=stack,
        notes=notes,
    )
