"""The LM in Haiku: an ordinary ``hk.Module`` block; ``stackwise.haiku.Stack`` stacks it.

The KV cache is Haiku state (``hk.get_state``), which the Stack keeps per layer, stacked.
"""

from __future__ import annotations

if __name__ == "__main__":  # run by mistake: not a command
    raise SystemExit(f"{__file__} is a module of the example's package, not a command; the "
                     "command is: python examples/transformer_lm.py (--help lists its flags)")

import haiku as hk
import jax
import jax.numpy as jnp

import stackwise.haiku
from lm.model import LM, Config, cache_shape, one_or_list, self_attention, zeros_like_shapes


def dense(d_out, name, scale=1.0, bias=True):
    """An ``hk.Linear`` with N(0, scale**2 / fan_in) weights and zero bias."""
    w_init = hk.initializers.VarianceScaling(scale**2, "fan_in", "normal")
    return hk.Linear(d_out, with_bias=bias, w_init=w_init, name=name)


def norm(name):
    """A LayerNorm with a scale and an offset, eps 1e-5 (as in every framework here)."""
    return hk.LayerNorm(-1, create_scale=True, create_offset=True, eps=1e-5, name=name)


def haiku_names(names):
    """The names Haiku gives modules named ``names`` made in order: a repeated name
    ``n`` becomes ``n``, ``n_1``, ``n_2``, ..."""
    seen: dict[str, int] = {}
    out = []
    for name in names:
        out.append(name if name not in seen else f"{name}_{seen[name]}")
        seen[name] = seen.get(name, 0) + 1
    return out


def modules(config: Config) -> tuple[type, list[type]]:
    """The model's Haiku modules for ``config``: the Model, and the block of each pattern
    position."""
    c = config
    d, hidden, depth_scale = c.d_model, c.hidden, c.depth_scale

    class Block(hk.Module):
        window = c.seq_len  # how many positions back a query sees: all the context

        def __call__(self, x, positions, decode: bool):
            qkv = dense(3 * d, "qkv", bias=False)(norm("ln1")(x))
            cache = None
            if decode:  # Haiku state, which the Stack keeps per layer
                shape = cache_shape(c, x.shape[0])
                cache = {name: hk.get_state(name, shape, init=jnp.zeros) for name in ("k", "v")}
            att, cache = self_attention(qkv, c.heads, positions, self.window, cache)
            if decode:
                hk.set_state("k", cache["k"])
                hk.set_state("v", cache["v"])
            x = x + dense(d, "out", depth_scale, bias=False)(att)
            h = jax.nn.gelu(dense(hidden, "up")(norm("ln2")(x)))
            return x + dense(d, "down", depth_scale)(h)

    class Local(Block):  # a pattern's kinds, named "local" and "global" by Haiku
        window = c.window

    class Global(Block):
        pass

    # The block of each pattern position: with one kind, the plain Block ("block").
    kinds = (
        [Block]
        if len(c.pattern) == 1
        else [{"local": Local, "global": Global}[kind] for kind in c.pattern]
    )

    class Model(hk.Module):
        def __call__(self, tokens, positions, decode: bool = False, loop: bool = False):
            embed_init = hk.initializers.RandomNormal(0.02)
            x = hk.Embed(c.vocab, d, w_init=embed_init, name="embed")(tokens)
            if loop:  # the Python loop the stack replaces: "lm/block", "lm/block_1", ...
                for i in range(c.layers):
                    x = kinds[i % len(kinds)]()(x, positions, False)
            else:  # the blocks as one stack
                blocks = stackwise.haiku.Stack(
                    one_or_list(c, kinds), c.layers, remat=c.remat, name="blocks"
                )
                x = blocks(x, positions, decode)
            return dense(c.vocab, "head")(norm("ln_f")(x))

    return Model, kinds


def build(config: Config) -> LM:
    """The LM in Haiku (see ``model.py``: the same model in every framework)."""
    c = config
    Model, kinds = modules(c)
    model = hk.transform_with_state(lambda *a: Model(name="lm")(*a))
    kind_names = [kind.__name__.lower() for kind in kinds]
    # The stacked blocks' modules ("lm/blocks/block/qkv", ...): the path of each pattern
    # position, and of each layer of the loop ("lm/block", "lm/block_1", ...).
    stacked = [f"lm/blocks/{n}" for n in haiku_names(kind_names)]
    stacked = stacked if len(kinds) > 1 else stacked[0]
    loop_names = [
        f"lm/{n}" for n in haiku_names(kind_names[i % len(kinds)] for i in range(c.layers))
    ]

    def init(key):
        params, _ = model.init(key, jnp.zeros((1, c.seq_len), jnp.int32), jnp.arange(c.seq_len))
        return params

    def apply(params, tokens, positions, cache=None):
        decode = cache is not None
        logits, state = model.apply(params, cache or {}, None, tokens, positions, decode)
        return logits, (state if decode else None)

    def init_cache(batch):
        one = jnp.zeros((batch, 1), jnp.int32), jnp.zeros(1, jnp.int32), True
        return zeros_like_shapes(jax.eval_shape(lambda: model.init(jax.random.key(0), *one)[1]))

    def to_loop(params):
        # Layer i's "lm/blocks/block/qkv" becomes "lm/block_i/qkv" ("lm/block/qkv" for i = 0):
        # the names Haiku gives the loop's blocks (with a pattern, "lm/blocks/local_1/qkv"
        # holds layers 1, 4, ..., which become "lm/local_1/qkv", "lm/local_3/qkv", ...).
        return stackwise.haiku.to_loop(params, stacked, loop_names)

    def loop_apply(loop_params, tokens):
        positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)
        return model.apply(loop_params, {}, None, tokens, positions, False, True)[0]

    return LM(init, apply, init_cache, to_loop, loop_apply)
