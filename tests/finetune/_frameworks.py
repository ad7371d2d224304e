"""The four adapters' Stacks of one small residual block, as the finetune tests run them: the
stacked params, the Stack run on params, and (without a pattern) the block run on one layer's
params, the loop's layer. A pattern alternates the block with a gated one (n=5: positions of
3 and 2 layers)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import equinox as eqx
import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp
from flax import nnx

import stackwise
import stackwise.equinox
import stackwise.flax
import stackwise.haiku
import stackwise.nnx

D, N = 6, 3
KEY = jax.random.key(0)


@dataclasses.dataclass
class Framework:
    """One adapter's Stack: its stacked params, the Stack run on params, and the block run
    on one layer's params (the loop's layer; None for a pattern). ``run_batch`` runs the
    Stack on ``x`` with a batch of adapters' g first: ``run_stack`` but for Equinox, whose
    block sees one example (the rows are mapped outside, on axis 1)."""

    base: Any
    run_stack: Callable[[Any, jax.Array], jax.Array]
    run_block: Callable[[Any, jax.Array], jax.Array] | None
    run_batch: Callable[[Any, jax.Array], jax.Array] | None = None

    def __post_init__(self):
        self.run_batch = self.run_batch or self.run_stack


def _haiku(remat, n=N, d=D, pattern=False, **options) -> Framework:
    def block(x):
        return x + jnp.tanh(hk.Linear(d)(x))

    def gated(x):
        return x * jax.nn.sigmoid(hk.Linear(d)(x))

    blocks = [block, gated] if pattern else block
    stacked = hk.transform(
        lambda x: stackwise.haiku.Stack(blocks, n=n, remat=remat, **options)(x))
    one = hk.transform(block)
    return Framework(
        stacked.init(KEY, jnp.ones((1, d))),
        lambda p, x: stacked.apply(p, None, x),
        None if pattern else
        lambda p, x: one.apply({k.split("/", 1)[1]: v for k, v in p.items()}, None, x),
    )


class LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + jnp.tanh(nn.Dense(x.shape[-1])(x))


class LinenGated(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x * jax.nn.sigmoid(nn.Dense(x.shape[-1])(x))


def _linen(remat, n=N, d=D, pattern=False, **options) -> Framework:
    blocks = [LinenBlock, LinenGated] if pattern else LinenBlock
    stack = stackwise.flax.Stack(blocks, n=n, remat=remat, **options)
    return Framework(
        stack.init(KEY, jnp.ones((1, d)))["params"],
        lambda p, x: stack.apply({"params": p}, x),
        None if pattern else lambda p, x: LinenBlock().apply({"params": p}, x),
    )


class NnxBlock(nnx.Module):
    def __init__(self, rngs, d=D):
        self.linear = nnx.Linear(d, d, rngs=rngs)

    def __call__(self, x):
        return x + jnp.tanh(self.linear(x))


class NnxGated(nnx.Module):
    def __init__(self, rngs, d=D):
        self.linear = nnx.Linear(d, d, rngs=rngs)

    def __call__(self, x):
        return x * jax.nn.sigmoid(self.linear(x))


def _nnx(remat, n=N, d=D, pattern=False, **options) -> Framework:
    make = functools.partial(NnxBlock, d=d)
    blocks = [make, functools.partial(NnxGated, d=d)] if pattern else make
    graphdef, params, rest = nnx.split(
        stackwise.nnx.Stack(blocks, n=n, rngs=nnx.Rngs(0), remat=remat, **options),
        nnx.Param, ...,
    )
    block_def, _ = nnx.split(make(nnx.Rngs(1)))
    return Framework(
        params,
        lambda p, x: nnx.merge(graphdef, p, rest)(x),
        None if pattern else lambda p, x: nnx.merge(block_def, p["layers"])(x),
    )


class EqxBlock(eqx.Module):
    linear: eqx.nn.Linear

    def __init__(self, d=D, *, key):
        self.linear = eqx.nn.Linear(d, d, key=key)

    def __call__(self, x):
        return x + jnp.tanh(self.linear(x))


class EqxGated(EqxBlock):
    def __call__(self, x):
        return x * jax.nn.sigmoid(self.linear(x))


def _equinox(remat, n=N, d=D, pattern=False, **options) -> Framework:
    blocks = [functools.partial(c, d) for c in (EqxBlock, EqxGated)] if pattern else (
        functools.partial(EqxBlock, d))
    stack = stackwise.equinox.Stack(blocks, n=n, key=KEY, remat=remat, **options)
    return Framework(
        stack,
        lambda p, x: jax.vmap(p)(x),
        None if pattern else lambda p, x: jax.vmap(p.layers)(x),
        lambda p, x: jax.vmap(p, in_axes=1, out_axes=1)(x),
    )


FRAMEWORKS = {"haiku": _haiku, "linen": _linen, "nnx": _nnx, "equinox": _equinox}
