"""Loop models for the autostack tests: plain Python loops over per-layer params."""

import jax
import jax.numpy as jnp
from _trees import assert_trees_bitwise, assert_trees_close

import stackwise


def check_model(fn, params, fresh, args, *, n, bound, zero=(), given_n=True):
    """``autostack(fn)`` against ``fn`` itself: the run is ``n`` blocks (found without ``n=``
    when not ``given_n``); the outputs and the grads of every param leaf (both jitted) within
    ``bound`` eps of the loop's; ``unstack`` of ``stack`` bitwise, on the params traced and on
    fresh ones. Returns ``(stacked, f)``."""
    stacked, f = stackwise.autostack(fn, params, *args, **({"n": n} if given_n else {}))
    assert f.found.n == n, f.found

    def loss(g, p):
        return sum(jnp.sum(jnp.sin(leaf)) for leaf in jax.tree.leaves(g(p, *args)))

    assert_trees_close(jax.jit(f)(stacked, *args), jax.jit(fn)(params, *args), bound)
    got = f.unstack(jax.jit(jax.grad(lambda p: loss(f, p)))(stacked))
    want = jax.jit(jax.grad(lambda p: loss(fn, p)))(params)
    assert_trees_close(got, want, bound, zero=zero)
    assert_trees_bitwise(f.unstack(stacked), params)
    assert_trees_bitwise(f.unstack(f.stack(fresh)), fresh)
    return stacked, f


def mlp_params(key, n, d=8, widths=None):
    widths = widths or [d] * n
    keys = jax.random.split(key, n + 1)
    layers = [
        {"w": jax.random.normal(k, (d, w)) / d**0.5, "v": jax.random.normal(k, (w, d)) / w**0.5,
         "b": jnp.full((1, w), 0.1)}
        for k, w in zip(keys[:n], widths)
    ]
    return {"layers": layers, "head": jax.random.normal(keys[n], (d, 3)) / d**0.5}


def mlp(params, x):
    for layer in params["layers"]:
        x = x + jnp.tanh(x @ layer["w"] + layer["b"]) @ layer["v"]
    return x @ params["head"]


def rms_norm(x, scale):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale


def llama_block(p, x, heads=2):
    t, d = x.shape[-2:]
    h = rms_norm(x, p["norm1"])
    q, k, v = (jnp.reshape(h @ p[w], (*h.shape[:-1], heads, d // heads)) for w in "qkv")
    logits = jnp.einsum("...qhd,...khd->...hqk", q, k) / (d // heads) ** 0.5
    mask = jnp.tril(jnp.ones((1, 1, t, t), bool))
    logits = jnp.where(mask, logits, -1e9)
    attn = jnp.einsum("...hqk,...khd->...qhd", jax.nn.softmax(logits, axis=-1), v)
    x = x + jnp.reshape(attn, x.shape) @ p["o"]
    h = rms_norm(x, p["norm2"])
    return x + (jax.nn.silu(h @ p["gate"]) * (h @ p["up"])) @ p["down"]


def llama_params(key, n, d=8, f=16, vocab=11):
    def layer(k):
        ks = jax.random.split(k, 7)
        shapes = {"q": (d, d), "k": (d, d), "v": (d, d), "o": (d, d), "gate": (d, f),
                  "up": (d, f), "down": (f, d)}
        out = {name: jax.random.normal(kk, s) / s[0] ** 0.5
               for kk, (name, s) in zip(ks, shapes.items())}
        return {**out, "norm1": jnp.ones((1, 1, d)), "norm2": jnp.ones((1, 1, d))}

    keys = jax.random.split(key, n + 1)
    return {"embed": jax.random.normal(keys[n], (vocab, d)), "layers": [layer(k) for k in keys[:n]],
            "norm": jnp.ones((1, 1, d))}


def llama(params, tokens):
    x = params["embed"][tokens]
    for p in params["layers"]:
        x = llama_block(p, x)
    x = rms_norm(x, params["norm"])
    return x @ params["embed"].T
