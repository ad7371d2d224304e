"""The transformer block in Flax linen: a Python loop, ``nn.scan`` and ``stackwise.flax.Stack``.

Imported only when the transformer block's rows are asked for (it imports flax).
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax

from stackwise.bench.config import BenchConfig
from stackwise.bench.workloads.common import (
    Case,
    attend,
    framework_cases,
    initialised,
    python_loop,
    stack_remat,
    tool_policy,
)


class Block(nn.Module):
    """The transformer block as an ordinary linen module."""

    d: int
    hidden: int
    heads: int

    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm()(x)
        x = x + nn.Dense(self.d)(attend(nn.Dense(3 * self.d)(h), self.heads))
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


def transformer(cfg: BenchConfig, notes: list[str]) -> list[Case]:
    """linen's rows of the transformer block (see :func:`framework_cases`)."""
    sizes = (cfg.tf_d, cfg.tf_hidden, cfg.tf_heads)
    block = functools.partial(Block, *sizes)

    def model(body):  # body(n, x) -> y, inside a compact module
        def build(n):
            class Model(nn.Module):
                @nn.compact
                def __call__(self, x):
                    return body(n, x)

            net = Model()
            return initialised(net.init, net.apply, cfg)

        return build

    def scan(remat, n, x):
        cell = Cell if remat == "off" else nn.remat(Cell, policy=tool_policy(remat))
        scanned = nn.scan(
            cell, variable_axes={"params": 0}, split_rngs={"params": True}, length=n
        )
        return scanned(*sizes)(x, None)[0]

    def stack(sw, remat):
        return model(lambda n, x: sw.Stack(block, n=n, remat=stack_remat(remat))(x))

    return framework_cases(
        "flax",
        loop=("nn loop", model(functools.partial(python_loop, block))),
        tools={"off": "nn.scan", "dots": "nn.scan(nn.remat dots)", "layer": "nn.scan(nn.remat)"},
        tool=lambda remat: model(functools.partial(scan, remat)),
        adapter="stackwise.flax",
        stack=stack,
        notes=notes,
    )
