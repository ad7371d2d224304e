"""The blocks in Haiku: a Python loop, ``hk.layer_stack`` and ``stackwise.haiku.Stack``.

The transformer block, and the decode and prefill blocks (the KV cache in Haiku state).
Imported only when their rows are asked for (it imports haiku).
"""

from __future__ import annotations

import functools

import haiku as hk
import jax
import jax.numpy as jnp

from stackwise.bench.config import BenchConfig
from stackwise.bench.workloads import common


class Block(hk.Module):
    """The transformer block as an ordinary Haiku module."""

    def __init__(self, d: int, hidden: int, heads: int, name: str | None = None):
        super().__init__(name=name)
        self.d, self.hidden, self.heads = d, hidden, heads

    def __call__(self, x):
        h = hk.LayerNorm(-1, create_scale=True, create_offset=True)(x)
        x = x + hk.Linear(self.d)(common.attend(hk.Linear(3 * self.d)(h), self.heads))
        h = hk.LayerNorm(-1, create_scale=True, create_offset=True)(x)
        return x + hk.Linear(self.d)(jax.nn.gelu(hk.Linear(self.hidden)(h)))


def transformer(cfg: BenchConfig, notes: list[str]) -> list[common.Case]:
    """Haiku's rows of the transformer block (see :func:`common.framework_cases`)."""
    block = functools.partial(Block, cfg.tf_d, cfg.tf_hidden, cfg.tf_heads)

    def model(forward):  # forward(n, x) -> y, run under hk.transform
        def build(n):
            net = hk.without_apply_rng(hk.transform(functools.partial(forward, n)))
            return common.initialised(net.init, net.apply, cfg)

        return build

    def layer_stack(remat, n, x):
        fn = lambda x: block()(x)  # noqa: E731
        if remat != "off":
            fn = hk.remat(fn, policy=common.tool_policy(remat))
        return hk.layer_stack(n)(fn)(x)

    def stack(sw, remat):
        return model(lambda n, x: sw.Stack(block, n=n, remat=common.stack_remat(remat))(x))

    return common.framework_cases(
        "haiku",
        loop=("hk loop", model(functools.partial(common.python_loop, block))),
        tools={
            "off": "hk.layer_stack",
            "dots": "hk.layer_stack+hk.remat(dots)",
            "layer": "hk.layer_stack+hk.remat",
        },
        tool=lambda remat: model(functools.partial(layer_stack, remat)),
        adapter="stackwise.haiku",
        stack=stack,
        notes=notes,
    )


class DecodeAttention(hk.Module):
    """The decode block: attention over a KV cache kept in Haiku state."""

    def __init__(self, d: int, heads: int, cache: tuple[int, ...], dtype: str,
                 name: str | None = None):
        super().__init__(name=name)
        self.d, self.heads, self.cache, self.dtype = d, heads, cache, dtype

    def __call__(self, x, pos):
        k = hk.get_state("k", self.cache, self.dtype, init=jnp.zeros)
        v = hk.get_state("v", self.cache, self.dtype, init=jnp.zeros)
        y, k, v = common.decode_attend(hk.Linear(3 * self.d, name="qkv")(x), k, v, pos, self.heads)
        hk.set_state("k", k)
        hk.set_state("v", v)
        return x + hk.Linear(self.d, name="out")(y)


def decode(cfg: BenchConfig, notes: list[str]) -> list[common.Case]:
    """Haiku's rows of the decode block: one token per call (see :func:`_decoding`)."""
    return _decoding("decode", cfg, notes, tokens=1, pos=cfg.dec_prompt)


def prefill(cfg: BenchConfig, notes: list[str]) -> list[common.Case]:
    """Haiku's rows of the prefill block: a whole prompt per call (see :func:`_decoding`)."""
    return _decoding("prefill", cfg, notes, tokens=cfg.dec_prompt, pos=0)


def _decoding(block_name: str, cfg: BenchConfig, notes: list[str], tokens: int, pos: int):
    """A loop of blocks, ``hk.layer_stack`` with state and ``stackwise.haiku.Stack``, each a
    ``hk.transform_with_state`` step ``(params, cache, x) -> (y, cache)``. Every row's
    params and cache are the Stack's, converted with ``stackwise.haiku.to_loop`` and
    ``to_layer_stack``, so that every row computes the same."""
    sw = common.adapter_or_note("stackwise.haiku", block_name, notes)
    if sw is None:
        return []
    block = functools.partial(DecodeAttention, cfg.dec_d, cfg.dec_heads, common.cache_shape(cfg),
                              cfg.dec_dtype)
    x = common.decode_input(cfg, tokens, pos)

    def model(forward, convert):  # forward(n, h, pos); convert(Stack's tree, n) -> its own
        def build(n):
            stack = hk.transform_with_state(lambda h, pos: sw.Stack(block, n=n)(h, pos))
            params, cache = stack.init(jax.random.key(cfg.seed), *x)
            cache = common.zeroed(cache)
            net = hk.without_apply_rng(hk.transform_with_state(functools.partial(forward, n)))
            return convert(params, n), convert(cache, n), x, lambda p, c, x: net.apply(p, c, *x)

        return build

    def loop(n, h, pos):
        for _ in range(n):
            h = block()(h, pos)
        return h

    def layer_stack(n, h, pos):
        return hk.layer_stack(n)(lambda h: block()(h, pos))(h)

    def stack(sw, remat, unroll=1):
        return model(
            lambda n, h, pos: sw.Stack(block, n=n, remat=common.stack_remat(remat),
                                       unroll=unroll)(h, pos),
            lambda tree, n: tree,
        )

    return common.framework_cases(
        "haiku",
        loop=(
            "hk loop",
            model(
                loop, lambda tree, n: sw.to_loop(tree, "stack/decode_attention", "decode_attention")
            ),
        ),
        tools={"off": "hk.layer_stack"},
        tool=lambda remat: model(layer_stack, lambda tree, n: sw.to_layer_stack(tree, "stack")),
        adapter="stackwise.haiku",
        stack=stack,
        notes=notes,
        remats=("off",),
        unrolled=True,
    )
