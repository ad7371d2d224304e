"""The LM in Flax NNX: an ordinary ``nnx.Module`` block; ``stackwise.nnx.Stack`` stacks it.

The KV cache is a pair of ``nnx.Cache`` variables of the block, stacked like every other
variable.
"""

from __future__ import annotations

if __name__ == "__main__":  # run by mistake: not a command
    raise SystemExit(f"{__file__} is a module of the example's package, not a command; the "
                     "command is: python examples/transformer_lm.py (--help lists its flags)")

import functools

import jax
import jax.numpy as jnp
from flax import nnx

import stackwise.nnx
from lm.model import LM, Config, one_or_list, self_attention, stacked_cache


def dense(d_in, d_out, rngs, scale=1.0, bias=True):
    """An ``nnx.Linear`` with N(0, scale**2 / fan_in) weights and zero bias."""
    kernel_init = nnx.initializers.variance_scaling(scale**2, "fan_in", "normal")
    return nnx.Linear(d_in, d_out, use_bias=bias, kernel_init=kernel_init, rngs=rngs)


def norm(d, rngs):
    """A LayerNorm of width ``d`` with a scale and a bias, eps 1e-5."""
    return nnx.LayerNorm(d, epsilon=1e-5, use_fast_variance=False, rngs=rngs)


def modules(config: Config) -> tuple[type, list]:
    """The model's Flax NNX modules for ``config``: the Model, and the block of each pattern
    position."""
    c = config
    d, hidden, depth_scale = c.d_model, c.hidden, c.depth_scale

    class Block(nnx.Module):
        def __init__(self, rngs: nnx.Rngs, window: int = c.seq_len):
            self.window = window  # how many positions back a query sees (static)
            self.ln1, self.ln2 = norm(d, rngs), norm(d, rngs)
            self.qkv = dense(d, 3 * d, rngs, bias=False)
            self.out = dense(d, d, rngs, depth_scale, bias=False)
            self.up = dense(d, hidden, rngs)
            self.down = dense(hidden, d, rngs, depth_scale)

        def __call__(self, x, positions, decode: bool = False):
            # The cache variables are set by `init_cache` below.
            cache = {"k": self.cache_k[...], "v": self.cache_v[...]} if decode else None
            att, cache = self_attention(self.qkv(self.ln1(x)), c.heads, positions, self.window,
                                        cache)
            if decode:
                self.cache_k[...], self.cache_v[...] = cache["k"], cache["v"]
            x = x + self.out(att)
            return x + self.down(jax.nn.gelu(self.up(self.ln2(x))))

    # The block of each pattern position (its window); with one kind, the plain Block.
    kinds = (
        [Block] if len(c.pattern) == 1 else [functools.partial(Block, window=w) for w in c.windows]
    )

    class Model(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            embed_init = nnx.initializers.normal(0.02)
            self.embed = nnx.Embed(c.vocab, d, embedding_init=embed_init, rngs=rngs)
            # The blocks as one stack: every variable gains a leading layer axis.
            self.blocks = stackwise.nnx.Stack(
                one_or_list(c, kinds), c.layers, rngs=rngs, remat=c.remat
            )
            self.ln_f = norm(d, rngs)
            self.head = dense(d, c.vocab, rngs)

        def __call__(self, tokens, positions, decode: bool = False):
            x = self.blocks(self.embed(tokens), positions, decode)
            return self.head(self.ln_f(x))

    return Model, kinds


def build(config: Config) -> LM:
    """The LM in Flax NNX (see ``model.py``: the same model in every framework)."""
    c = config
    Model, kinds = modules(c)
    d = c.d_model

    # Pure functions over the params as a plain dict: split a module once (abstractly) into a
    # static graph definition and its state, and merge them back inside every call.
    def abstract(make):
        return nnx.split(nnx.eval_shape(lambda: make(nnx.Rngs(0))))

    def merge(split, params):
        graphdef, state = split
        state = jax.tree.map(lambda x: x, state)  # a fresh copy to fill
        nnx.replace_by_pure_dict(state, params)
        return nnx.merge(graphdef, state)

    model_split = abstract(Model)

    def init(key):
        return nnx.to_pure_dict(nnx.state(Model(nnx.Rngs(key)), nnx.Param))

    def apply(params, tokens, positions, cache=None):
        model = merge(model_split, params)
        if cache is None:
            return model(tokens, positions), None
        # The stacked block (each pattern position's): set its stacked cache variables.
        layers = list(model.blocks.layers) if len(kinds) > 1 else [model.blocks.layers]
        caches = cache if len(kinds) > 1 else [cache]
        for layer, one in zip(layers, caches):
            layer.cache_k, layer.cache_v = nnx.Cache(one["k"]), nnx.Cache(one["v"])
        logits = model(tokens, positions, decode=True)
        new = [{"k": layer.cache_k[...], "v": layer.cache_v[...]} for layer in layers]
        return logits, one_or_list(c, new)

    def init_cache(batch):
        return stacked_cache(c, batch)

    def to_loop(params):  # "blocks": a list of per-layer Block states, in layer order
        layers = params["blocks"]["layers"]  # with a pattern: {p: position p's stacked Block}
        if len(kinds) == 1:
            return {**params, "blocks": stackwise.unstack_layers(layers)}
        positions = tuple(layers[p] for p in range(len(kinds)))
        return {**params, "blocks": stackwise.unstack_layers(positions, pattern=len(kinds))}

    # The loop's modules, one by one: the model's embedding, norm and head, and a Block.
    embed_split = abstract(lambda rngs: nnx.Embed(c.vocab, d, rngs=rngs))
    norm_split = abstract(functools.partial(norm, d))
    head_split = abstract(lambda rngs: dense(d, c.vocab, rngs))
    block_splits = [abstract(kind) for kind in kinds]

    def loop_apply(loop_params, tokens):
        positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)
        x = merge(embed_split, loop_params["embed"])(tokens)
        for i, layer in enumerate(loop_params["blocks"]):  # one separate Block per layer
            x = merge(block_splits[i % len(kinds)], layer)(x, positions)
        x = merge(norm_split, loop_params["ln_f"])(x)
        return merge(head_split, loop_params["head"])(x)

    return LM(init, apply, init_cache, to_loop, loop_apply)
