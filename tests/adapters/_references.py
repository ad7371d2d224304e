"""The reference models that an adapter's tests and its conversion tests share: the Python
loops a Stack replaces, and the blocks with state that both stack."""

from __future__ import annotations

import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp
from flax import nnx

# --------------------------------------------------------------------------
# Haiku.


def loop_of(make_block, n, reverse=False):
    """The Python loop a Stack replaces: n modules, named `block`, `block_1`, ..."""

    def forward(x, *args, **kwargs):
        blocks = [make_block() for _ in range(n)]
        for block in reversed(blocks) if reverse else blocks:
            x = block(x, *args, **kwargs)
        return x

    return forward


class Counted(hk.Module):
    """Batch norm, plus a per-layer call counter (state) that scales the update."""

    def __call__(self, x, *, is_training):
        count = hk.get_state("count", [], jnp.int32, init=jnp.zeros)
        if is_training:
            hk.set_state("count", count + 1)
        y = hk.BatchNorm(True, True, 0.9)(x, is_training=is_training)
        return x + jnp.tanh(hk.Linear(x.shape[-1])(y)) / (1 + count).astype(x.dtype)


# --------------------------------------------------------------------------
# Flax linen.


class Loop(nn.Module):
    """The reference: a Python loop of blocks named layers_0, layers_1, ..."""

    block: type
    n: int
    reverse: bool = False

    @nn.compact
    def __call__(self, x, *args, **kwargs):
        blocks = [self.block(name=f"layers_{i}") for i in range(self.n)]
        for b in reversed(blocks) if self.reverse else blocks:
            x = b(x, *args, **kwargs)
        return x


# --------------------------------------------------------------------------
# Flax NNX.

NNX_D = 8  # the NNX block's features


class Block(nnx.Module):
    """The NNX block with state (batch statistics) and RNG (dropout); its class name shows in
    the errors the tests match."""

    def __init__(self, d, rngs, rate=0.0):
        self.linear = nnx.Linear(d, d, rngs=rngs)
        self.norm = nnx.BatchNorm(d, rngs=rngs)
        self.drop = nnx.Dropout(rate, rngs=rngs)

    def __call__(self, x):
        return x + jnp.tanh(self.drop(self.norm(self.linear(x))))


def make(rngs, rate=0.0):
    """The NNX ``make_block``: one Block of ``NNX_D`` features."""
    return Block(NNX_D, rngs, rate)


def scan_model(n, rngs, rate=0.0):
    """NNX's own tool, as in the Flax docs: nnx.vmap to create, nnx.scan to apply."""

    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs):
        return make(rngs, rate)

    return create(rngs)


def stacked(states):
    """Per-layer trees stacked along a new leading axis (the Stack's layout)."""
    return jax.tree.map(lambda *a: jnp.stack(a), *states)
