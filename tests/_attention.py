"""What the state and serving tests share: one attention layer with a KV cache, and a decode
driver (a prompt, then token by token)."""

import jax
import jax.numpy as jnp


def attention_layer(b: int, t: int, d: int, heads: int):
    """``(init, attend)`` of a layer over a cache of ``t`` positions (batch ``b``, width ``d``):
    ``init(key) -> (params, cache)``; ``attend(params, cache, x, pos) -> (x, cache)`` writes
    this step's keys and values at ``pos`` and attends to the positions up to the last."""
    hd = d // heads

    def init(key):
        k1, k2 = jax.random.split(key)
        params = {
            "qkv": jax.random.normal(k1, (d, 3 * d)) / d**0.5,
            "out": jax.random.normal(k2, (d, d)) / d**0.5,
        }
        return params, {"k": jnp.zeros((b, t, heads, hd)), "v": jnp.zeros((b, t, heads, hd))}

    def attend(params, cache, x, pos):
        length = x.shape[1]
        q, k, v = (a.reshape(b, length, heads, hd) for a in jnp.split(x @ params["qkv"], 3, -1))
        ck = jax.lax.dynamic_update_slice_in_dim(cache["k"], k, pos, 1)
        cv = jax.lax.dynamic_update_slice_in_dim(cache["v"], v, pos, 1)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, ck) / hd**0.5
        seen = jnp.arange(t)[None, :] <= (pos + jnp.arange(length))[:, None]
        scores = jnp.where(seen[None, None], scores, -1e30)
        o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, -1), cv).reshape(b, length, d)
        return x + o @ params["out"], {"k": ck, "v": cv}

    return init, attend


def decode(step, params, cache, prompt, steps):
    """``step(params, cache, x, pos) -> (y, cache)`` on ``prompt`` at position 0, then
    ``steps`` tokens one at a time (each the tanh of the last output); every call's output,
    and the last cache."""
    ys = []
    y, cache = step(params, cache, prompt, jnp.int32(0))
    ys.append(y)
    x = y[:, -1:]
    for pos in range(prompt.shape[1], prompt.shape[1] + steps):
        y, cache = step(params, cache, x, jnp.int32(pos))
        ys.append(y)
        x = jnp.tanh(y)
    return ys, cache
