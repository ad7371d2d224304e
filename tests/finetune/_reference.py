"""The loop model the finetune tests compare against: per-layer slices of the base and the
adapters, the adapted weight written out by hand (``w + (alpha / r) * a @ b``, or rsLoRA's
``alpha / sqrt(r)``), plain autodiff."""

from __future__ import annotations

import jax
import jax.numpy as jnp

import stackwise

D, H = 6, 5  # width, hidden width (in != out for the two weights)


def init(key):
    k1, k2 = jax.random.split(key)
    return {"u": jax.random.normal(k1, (D, H)) / D**0.5, "v": jax.random.normal(k2, (H, D)) / H,
            "c": jnp.zeros((1, D))}


def apply(p, x):
    return x + jnp.tanh(x @ p["u"]) @ p["v"] + p["c"]


def gate(p, x):
    return x * jax.nn.sigmoid(x @ p["u"] @ p["v"])


def layer_params(base, adapters, i):
    """Layer i's float params of the loop model: dequantized, the update added by hand."""
    out = {}
    for name, w in base.items():
        w = stackwise.quant.dequantize(jax.tree.map(lambda v: v[i], w))
        lw = adapters.get(name) if adapters is not None else None
        if lw is not None:
            r = lw.a.shape[-1]
            w = w + (lw.alpha / (r**0.5 if lw.rslora else r)) * (lw.a[i] @ lw.b[i])
        out[name] = w
    return out


def loop(apply_fns, bases, adapters, x, n):
    """``x`` through n layers, layer i running position ``i % k`` with its own slice."""
    k = len(apply_fns)
    for i in range(n):
        p = i % k
        x = apply_fns[p](layer_params(bases[p], adapters[p] if adapters else None, i // k), x)
    return x


def trained(adapters, seed=7):
    """The adapters moved off their zero start (b = 0 gives no update to compare)."""
    leaves, treedef = jax.tree.flatten(adapters)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(
        treedef, [v + 0.3 * jax.random.normal(k, v.shape, v.dtype) for k, v in zip(keys, leaves)])


def assert_stack_is_loop(layers, base, adapters, x, n):
    """Outputs and the adapters' gradients of a one-position LoRA stack and of its loop model,
    within the shared bound for a stack against its loop (tests/_trees.py)."""
    from _trees import assert_trees_close

    def loss(ad):
        return jnp.sum(layers.apply(stackwise.lora.attach(base, ad), x) ** 2)

    def loss_loop(ad):
        return jnp.sum(loop([apply], [base], [ad], x, n) ** 2)

    assert_trees_close(layers.apply(stackwise.lora.attach(base, adapters), x),
                       jax.jit(lambda ad: loop([apply], [base], [ad], x, n))(adapters))
    assert_trees_close(jax.jit(jax.grad(loss))(adapters), jax.jit(jax.grad(loss_loop))(adapters))
