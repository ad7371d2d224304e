"""The character-level transformer LM of ``lm_models.py``, written in Equinox.

``build_equinox(config)`` returns the same :class:`lm_models.LM` as ``build_jax`` /
``build_haiku`` / ``build_flax`` / ``build_nnx``: pure functions over a plain pytree of params,
so that ``transformer_lm.py`` trains, checkpoints and samples it with the same code. The
``config.layers`` blocks are ONE ``stackwise.equinox.Stack``: their arrays have a leading
layer axis and run as one scanned layer.

(To merge into ``lm_models.py``: add ``"equinox"`` to ``FRAMEWORKS`` and ``build_equinox`` to
the table in ``build``, and move this function below ``build_nnx``.)
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from lm_models import LM, Config, attention, cache_shape, cached_attention, rope

# --------------------------------------------------------------------------
# Equinox: an ordinary eqx.Module block; `stackwise.equinox.Stack` stacks it. The KV cache is
# an explicit argument, `x, cache = block(x, cache, positions)` (Equinox's functional style;
# `with_state=True`), stacked per layer and written in place.


def build_equinox(config: Config) -> LM:
    import equinox as eqx

    import stackwise.equinox

    c = config
    d, hidden = c.d_model, c.mlp_ratio * c.d_model
    depth_scale = 1 / math.sqrt(2 * c.layers)

    def dense(d_in, d_out, key, scale=1.0, bias=True):
        """An eqx.nn.Linear with N(0, scale^2 / d_in) weights and zero bias."""
        linear = eqx.nn.Linear(d_in, d_out, use_bias=bias, key=key)
        weight = jax.random.normal(key, (d_out, d_in)) * (scale / math.sqrt(d_in))
        linear = eqx.tree_at(lambda m: m.weight, linear, weight)
        return eqx.tree_at(lambda m: m.bias, linear, jnp.zeros(d_out)) if bias else linear

    def per_token(layer, x):
        """Equinox layers act on one vector: map over ``[batch, length]``."""
        return jax.vmap(jax.vmap(layer))(x)

    class Block(eqx.Module):
        ln1: eqx.nn.LayerNorm
        qkv: eqx.nn.Linear
        out: eqx.nn.Linear
        ln2: eqx.nn.LayerNorm
        up: eqx.nn.Linear
        down: eqx.nn.Linear

        def __init__(self, key):
            k_qkv, k_out, k_up, k_down = jax.random.split(key, 4)
            self.ln1, self.ln2 = eqx.nn.LayerNorm(d, eps=1e-5), eqx.nn.LayerNorm(d, eps=1e-5)
            self.qkv = dense(d, 3 * d, k_qkv, bias=False)
            self.out = dense(d, d, k_out, depth_scale, bias=False)
            self.up = dense(d, hidden, k_up)
            self.down = dense(hidden, d, k_down, depth_scale)

        def __call__(self, x, cache, positions):
            """``x, cache = block(x, cache, positions)``; ``cache`` is None when training."""
            b, length, _ = x.shape
            qkv = per_token(self.qkv, per_token(self.ln1, x))
            qkv = qkv.reshape(b, length, 3, c.heads, c.head_dim)
            q, k, v = rope(qkv[:, :, 0], positions), rope(qkv[:, :, 1], positions), qkv[:, :, 2]
            if cache is None:
                att = attention(q, k, v, positions, positions, c.seq_len)
            else:
                att, ck, cv = cached_attention(q, k, v, positions, cache["k"], cache["v"])
                cache = {"k": ck, "v": cv}
            x = x + per_token(self.out, att.reshape(b, length, d))
            h = jax.nn.gelu(per_token(self.up, per_token(self.ln2, x)))
            return x + per_token(self.down, h), cache

    class Model(eqx.Module):
        embed: eqx.nn.Embedding
        blocks: stackwise.equinox.Stack
        ln_f: eqx.nn.LayerNorm
        head: eqx.nn.Linear

        def __init__(self, key):
            k_embed, k_blocks, k_head = jax.random.split(key, 3)
            weight = jax.random.normal(k_embed, (c.vocab, d)) * 0.02
            self.embed = eqx.nn.Embedding(weight=weight)
            # The 12 blocks as one stack: every array gains a leading layer axis.
            self.blocks = stackwise.equinox.Stack(
                Block, c.layers, remat=c.remat, with_state=True, key=k_blocks
            )
            self.ln_f = eqx.nn.LayerNorm(d, eps=1e-5)
            self.head = dense(d, c.vocab, k_head)

        def __call__(self, tokens, positions, cache=None):
            x, cache = self.blocks(per_token(self.embed, tokens), cache, positions)
            return per_token(self.head, per_token(self.ln_f, x)), cache

    # Pure functions over the params: the model's arrays (`eqx.partition`), joined with its
    # static rest (built once, abstractly) inside every call.
    is_leaf = lambda x: eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)  # noqa: E731
    _, static = eqx.partition(eqx.filter_eval_shape(Model, jax.random.key(0)), is_leaf)
    block_static = static.blocks.layers  # one block's static rest (the stacked block's)

    def init(key):
        return eqx.filter(Model(key), eqx.is_array)

    def apply(params, tokens, positions, cache=None):
        return eqx.combine(params, static)(tokens, positions, cache)

    def init_cache(batch):
        shape = (c.layers, *cache_shape(c, batch))
        return {"k": jnp.zeros(shape), "v": jnp.zeros(shape)}

    def loop_apply(layer_params, params, tokens):
        model = eqx.combine(params, static)
        positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)
        x = per_token(model.embed, tokens)
        for layer in layer_params:  # one separate Block per layer
            x, _ = eqx.combine(layer, block_static)(x, None, positions)
        return per_token(model.head, per_token(model.ln_f, x))

    return LM(init, apply, init_cache, loop_apply, lambda params: params.blocks.layers)
