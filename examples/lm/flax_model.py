"""The LM in Flax linen: an ordinary ``nn.Module`` block; ``stackwise.flax.Stack`` stacks it.

The KV cache is the usual ``cache`` collection, which the Stack keeps per layer, stacked.
"""

from __future__ import annotations

if __name__ == "__main__":  # run by mistake: not a command
    raise SystemExit(f"{__file__} is a module of the example's package, not a command; the "
                     "command is: python examples/transformer_lm.py (--help lists its flags)")

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

import stackwise.flax
from lm.model import LM, Config, cache_shape, one_or_list, self_attention, zeros_like_shapes


def dense(d_out, name, scale=1.0, bias=True):
    """An ``nn.Dense`` with N(0, scale**2 / fan_in) weights and zero bias."""
    kernel_init = nn.initializers.variance_scaling(scale**2, "fan_in", "normal")
    return nn.Dense(d_out, use_bias=bias, kernel_init=kernel_init, name=name)


def norm(name):
    """A LayerNorm with a scale and a bias, eps 1e-5 (as in every framework here)."""
    return nn.LayerNorm(epsilon=1e-5, use_fast_variance=False, name=name)


def modules(config: Config) -> tuple[type, list]:
    """The model's Flax linen modules for ``config``: the Model, and the block of each pattern
    position."""
    c = config
    d, hidden, depth_scale = c.d_model, c.hidden, c.depth_scale

    class Block(nn.Module):
        window = c.seq_len  # how many positions back a query sees: all the context

        @nn.compact
        def __call__(self, x, positions, decode: bool):
            qkv = dense(3 * d, "qkv", bias=False)(norm("ln1")(x))
            cache = None
            if decode:  # the `cache` collection, which the Stack keeps per layer
                shape = cache_shape(c, x.shape[0])
                held = {name: self.variable("cache", name, jnp.zeros, shape) for name in ("k", "v")}
                cache = {name: variable.value for name, variable in held.items()}
            att, cache = self_attention(qkv, c.heads, positions, self.window, cache)
            if decode:
                held["k"].value, held["v"].value = cache["k"], cache["v"]
            x = x + dense(d, "out", depth_scale, bias=False)(att)
            h = nn.gelu(dense(hidden, "up")(norm("ln2")(x)))
            return x + dense(d, "down", depth_scale)(h)

    class Local(Block):  # a pattern's kinds: the Stack names them "Local_0", "Global_0", ...
        window = c.window

    class Global(Block):
        pass

    # The block of each pattern position: with one kind, the plain Block.
    kinds = (
        [functools.partial(Block)]
        if len(c.pattern) == 1
        else [{"local": Local, "global": Global}[kind] for kind in c.pattern]
    )

    class Model(nn.Module):
        loop: bool = False

        @nn.compact
        def __call__(self, tokens, positions, decode: bool = False):
            embed_init = nn.initializers.normal(0.02)
            x = nn.Embed(c.vocab, d, embedding_init=embed_init, name="embed")(tokens)
            if self.loop:  # the Python loop the stack replaces: one module per block
                for i in range(c.layers):
                    x = kinds[i % len(kinds)](name=f"blocks_{i}")(x, positions, False)
            else:  # the blocks as one stack
                blocks = stackwise.flax.Stack(
                    one_or_list(c, kinds), c.layers, remat=c.remat, name="blocks"
                )
                x = blocks(x, positions, decode)
            return dense(c.vocab, "head")(norm("ln_f")(x))

    return Model, kinds


def build(config: Config) -> LM:
    """The LM in Flax linen (see ``model.py``: the same model in every framework)."""
    c = config
    Model, kinds = modules(c)
    model = Model()
    # Where the stacked blocks' params are: "blocks", or with a pattern each position's
    # (linen's names of the blocks: "blocks/Local_0", "blocks/Local_1", "blocks/Global_0").
    counted: dict[str, int] = {}
    positions_at = []
    for kind in kinds:
        name = getattr(kind, "func", kind).__name__
        positions_at.append(f"blocks/{name}_{counted.get(name, 0)}")
        counted[name] = counted.get(name, 0) + 1
    stacked = positions_at if len(kinds) > 1 else "blocks"

    def init(key):
        tokens = jnp.zeros((1, c.seq_len), jnp.int32)
        return model.init(key, tokens, jnp.arange(c.seq_len))["params"]

    def apply(params, tokens, positions, cache=None):
        if cache is None:
            return model.apply({"params": params}, tokens, positions), None
        variables = {"params": params, "cache": cache}
        logits, new = model.apply(variables, tokens, positions, True, mutable=["cache"])
        return logits, new["cache"]

    def init_cache(batch):
        one = jnp.zeros((batch, 1), jnp.int32), jnp.zeros(1, jnp.int32), True
        shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), *one)["cache"])
        return zeros_like_shapes(shapes)

    def to_loop(params):  # "blocks" -> "blocks_0", "blocks_1", ... (layer i at position i % k)
        loop = stackwise.flax.to_loop({"params": params}, stacked, names="blocks_{}")
        return loop["params"]

    def loop_apply(loop_params, tokens):
        positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)
        return Model(loop=True).apply({"params": loop_params}, tokens, positions)

    return LM(init, apply, init_cache, to_loop, loop_apply)
