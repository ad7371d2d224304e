"""The LM in Equinox: an ordinary ``eqx.Module`` block; ``stackwise.equinox.Stack`` stacks it.

The KV cache is an explicit argument, ``x, cache = block(x, cache, positions)`` (Equinox's
functional style; ``with_state=True``), stacked per layer and written in place.
"""

from __future__ import annotations

if __name__ == "__main__":  # run by mistake: not a command
    raise SystemExit(f"{__file__} is a module of the example's package, not a command; the "
                     "command is: python examples/transformer_lm.py (--help lists its flags)")

import functools
import math

import equinox as eqx
import jax
import jax.numpy as jnp

import stackwise.equinox
from lm.model import LM, Config, one_or_list, self_attention, stacked_cache


def dense(d_in, d_out, key, scale=1.0, bias=True):
    """An eqx.nn.Linear with N(0, scale^2 / d_in) weights and zero bias."""
    linear = eqx.nn.Linear(d_in, d_out, use_bias=bias, key=key)
    weight = jax.random.normal(key, (d_out, d_in)) * (scale / math.sqrt(d_in))
    linear = eqx.tree_at(lambda m: m.weight, linear, weight)
    return eqx.tree_at(lambda m: m.bias, linear, jnp.zeros(d_out)) if bias else linear


def per_token(layer, x):
    """Equinox layers act on one vector: map over ``[batch, length]``."""
    return jax.vmap(jax.vmap(layer))(x)


def modules(config: Config) -> tuple[type, list]:
    """The model's Equinox modules for ``config``: the Model, and the block of each pattern
    position."""
    c = config
    d, hidden, depth_scale = c.d_model, c.hidden, c.depth_scale

    class Block(eqx.Module):
        ln1: eqx.nn.LayerNorm
        qkv: eqx.nn.Linear
        out: eqx.nn.Linear
        ln2: eqx.nn.LayerNorm
        up: eqx.nn.Linear
        down: eqx.nn.Linear
        window: int = eqx.field(static=True)  # how many positions back a query sees

        def __init__(self, key, window: int = c.seq_len):
            k_qkv, k_out, k_up, k_down = jax.random.split(key, 4)
            self.ln1, self.ln2 = eqx.nn.LayerNorm(d, eps=1e-5), eqx.nn.LayerNorm(d, eps=1e-5)
            self.qkv = dense(d, 3 * d, k_qkv, bias=False)
            self.out = dense(d, d, k_out, depth_scale, bias=False)
            self.up = dense(d, hidden, k_up)
            self.down = dense(hidden, d, k_down, depth_scale)
            self.window = window

        def __call__(self, x, cache, positions):
            """``x, cache = block(x, cache, positions)``; ``cache`` is None when training."""
            qkv = per_token(self.qkv, per_token(self.ln1, x))
            att, cache = self_attention(qkv, c.heads, positions, self.window, cache)
            x = x + per_token(self.out, att)
            h = jax.nn.gelu(per_token(self.up, per_token(self.ln2, x)))
            return x + per_token(self.down, h), cache

    # The block of each pattern position (its window); with one kind, the plain Block.
    kinds = [functools.partial(Block, window=w) for w in c.windows]

    class Model(eqx.Module):
        embed: eqx.nn.Embedding
        blocks: stackwise.equinox.Stack
        ln_f: eqx.nn.LayerNorm
        head: eqx.nn.Linear

        def __init__(self, key):
            k_embed, k_blocks, k_head = jax.random.split(key, 3)
            weight = jax.random.normal(k_embed, (c.vocab, d)) * 0.02
            self.embed = eqx.nn.Embedding(weight=weight)
            # The blocks as one stack: every array gains a leading layer axis.
            self.blocks = stackwise.equinox.Stack(
                one_or_list(c, kinds), c.layers, remat=c.remat, with_state=True, key=k_blocks
            )
            self.ln_f = eqx.nn.LayerNorm(d, eps=1e-5)
            self.head = dense(d, c.vocab, k_head)

        def __call__(self, tokens, positions, cache=None):
            x, cache = self.blocks(per_token(self.embed, tokens), cache, positions)
            return per_token(self.head, per_token(self.ln_f, x)), cache

    return Model, kinds


def build(config: Config) -> LM:
    """The LM in Equinox (see ``model.py``: the same model in every framework)."""
    c = config
    Model, kinds = modules(c)

    # Pure functions over the params: the model's arrays (`eqx.filter`; the rest is None), joined
    # with its static rest (built once, abstractly) inside every call.
    is_leaf = lambda x: eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)  # noqa: E731
    _, static = eqx.partition(eqx.filter_eval_shape(Model, jax.random.key(0)), is_leaf)
    # Each pattern position's stacked block's static rest: that of each of its layers too.
    block_statics = static.blocks.layers if len(kinds) > 1 else (static.blocks.layers,)

    def init(key):
        return eqx.filter(Model(key), eqx.is_array)

    def apply(params, tokens, positions, cache=None):
        return eqx.combine(params, static)(tokens, positions, cache)

    def init_cache(batch):
        return stacked_cache(c, batch)

    def to_loop(params):  # "blocks": a list of per-layer Blocks' arrays, in layer order
        blocks = params.blocks.to_layers()  # layer i: stack[i], its arrays sliced
        return {"embed": params.embed, "blocks": blocks, "ln_f": params.ln_f, "head": params.head}

    def loop_apply(loop_params, tokens):
        positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)
        x = per_token(eqx.combine(loop_params["embed"], static.embed), tokens)
        for i, layer in enumerate(loop_params["blocks"]):  # one separate Block per layer
            x, _ = eqx.combine(layer, block_statics[i % len(kinds)])(x, None, positions)
        x = per_token(eqx.combine(loop_params["ln_f"], static.ln_f), x)
        return per_token(eqx.combine(loop_params["head"], static.head), x)

    return LM(init, apply, init_cache, to_loop, loop_apply)
