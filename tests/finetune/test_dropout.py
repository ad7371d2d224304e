"""LoRA dropout (PEFT's ``lora_dropout``) against hand-written loops that draw the same masks.

PEFT trains an adapter as ``x @ W + scale * (dropout(x) @ a) @ b``: the adapter's input is
dropped, not the layer's, and its term is added beside the base product. The loops below
write that out per layer and per product, with the masks from the keys
``stackwise.lora.attach(..., key=)`` documents (node t's layer i: ``split(fold_in(key, t),
n)[i]``; its base leaf j's u-th product: ``fold_in(fold_in(that, j), u)``) and a dropout
written here (``bernoulli(key, 1 - p)``, the kept scaled by ``1 / (1 - p)``), for outputs and
the adapters' gradients, on the core's stacks (remat, unroll, patterns, quantized bases,
bfloat16 compute, DoRA, batches of adapters) and the four frameworks' Stacks. A rate of 0, or
no key, is the run without dropout, bitwise."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _frameworks import FRAMEWORKS, D, N
from _reference import apply, init, trained
from _tolerance import rounding_bound
from _trees import assert_trees_bitwise, assert_trees_close

import stackwise

P = 0.3
n = 4
X = jax.random.normal(jax.random.key(2), (5, 6))
KEY = jax.random.key(11)
TARGETS = ["['u']", "['v']"]
is_lora = lambda v: isinstance(v, stackwise.lora.LoraWeights)  # noqa: E731


def dropped(v, key, p):
    """Dropout as torch's ``nn.Dropout`` trains: kept with probability 1 - p, scaled."""
    return jnp.where(jax.random.bernoulli(key, 1.0 - p, v.shape), v / (1.0 - p), 0.0)


def mask_key(key, t, depth, i, j, u=0):
    return jax.random.fold_in(jax.random.fold_in(
        jax.random.split(jax.random.fold_in(key, t), depth)[i], j), u)


def product(h, w, lw, i, key):
    """``h @ w`` of layer i with the adapter's term on the dropped input (PEFT's order:
    ``lora_B(lora_A(dropout(x))) * scaling``, in the adapters' dtype)."""
    out = h @ w
    if lw is None:
        return out
    hd = dropped(h.astype(lw.a.dtype), key, lw.dropout)
    return (out + ((hd @ lw.a[i]) @ lw.b[i]) * lw.scale).astype(out.dtype)


def loop(base, adapters, x, key, t=0, depth=n, first=0, step=1, dtype=None):
    """``apply`` (``x + tanh(x @ u) @ v + c``) over the layers, by hand: base leaves in
    order c (0), u (1), v (2). With ``first``/``step``: the layers of one pattern position
    of another apply (not used)."""
    for i in range(depth):
        w = {k: stackwise.quant.dequantize(jax.tree.map(lambda v, i=i: v[i], base[k]))
             for k in base}
        if dtype is not None:  # (the quantized or adapted weights: u and v)
            w = {k: v.astype(dtype) if k != "c" else v for k, v in w.items()}
        h = jnp.tanh(product(x, w["u"], adapters["u"], i, mask_key(key, t, depth, i, 1)))
        x = x + product(h, w["v"], adapters["v"], i, mask_key(key, t, depth, i, 2)) + w["c"]
    return x


def _adapters(base, p=P, seed=1, **kw):
    return trained(stackwise.lora.init(jax.random.key(seed), base, rank=2, alpha=4.0,
                                       targets=TARGETS, dropout=p, **kw))


BASE = stackwise.stack(init, apply, n).init(jax.random.key(0))


def _check(layers, base, adapters, x=X, **loop_kw):
    def loss(ad, key):
        return jnp.sum(layers.apply(stackwise.lora.attach(base, ad, key=key), x) ** 2)

    def loss_loop(ad, key):
        return jnp.sum(loop(base, ad, x, key, **loop_kw) ** 2)

    assert_trees_close(layers.apply(stackwise.lora.attach(base, adapters, key=KEY), x),
                       loop(base, adapters, x, KEY, **loop_kw))
    assert_trees_close(jax.jit(jax.grad(loss))(adapters, KEY), jax.grad(loss_loop)(adapters, KEY))


OPTIONS = {"default remat": {}, "no remat": {"remat": False}, "unroll": {"unroll": True},
           "remat, unroll 2": {"remat": True, "unroll": 2}}


@pytest.mark.parametrize("options", [pytest.param(v, id=k, marks=[] if k == "default remat"
                                                  else pytest.mark.slow)
                                     for k, v in OPTIONS.items()])
def test_dropout_is_its_loop(options):
    _check(stackwise.lora.stack(apply, n, **options), BASE, _adapters(BASE))


def test_masks_change_with_the_key_and_are_off_without_one():
    """A new key draws new masks; the masks are the loop's at each of several keys; no key
    is the model without dropout (evaluation), bitwise, as is a rate of 0 with a key."""
    layers = stackwise.lora.stack(apply, n)
    adapters = _adapters(BASE)
    outs = [layers.apply(stackwise.lora.attach(BASE, adapters, key=jax.random.key(s)), X)
            for s in range(3)]
    for s, out in enumerate(outs):
        assert_trees_close(out, loop(BASE, adapters, X, jax.random.key(s)))
    assert not np.allclose(outs[0], outs[1])
    raw = jax.random.PRNGKey(5)  # a raw uint32 key: the typed key of its bits
    np.testing.assert_array_equal(
        layers.apply(stackwise.lora.attach(BASE, adapters, key=raw), X),
        layers.apply(stackwise.lora.attach(BASE, adapters, key=jax.random.wrap_key_data(raw)), X))
    plain = dataclasses.replace  # the same adapters with rate 0
    zero = jax.tree.map(lambda v: plain(v, dropout=0.0) if is_lora(v) else v, adapters,
                        is_leaf=is_lora)
    no_key = jax.jit(layers.apply)(stackwise.lora.attach(BASE, adapters), X)
    rate_0 = jax.jit(layers.apply)(stackwise.lora.attach(BASE, zero, key=KEY), X)
    without = jax.jit(layers.apply)(stackwise.lora.attach(BASE, zero), X)
    assert_trees_bitwise(no_key, without)
    assert_trees_bitwise(rate_0, without)

    def loss(ad, **kw):
        return jnp.sum(layers.apply(stackwise.lora.attach(BASE, ad, **kw), X) ** 2)

    assert_trees_bitwise(jax.jit(jax.grad(loss))(zero, key=KEY), jax.jit(jax.grad(loss))(zero))


def test_dropout_statistics():
    """Over many inputs the masks keep 1 - p of the elements (within 5 standard deviations
    of the binomial), scale them by 1 / (1 - p) (each dropped input is 0 or the input over
    1 - p), and the adapter's term is unbiased: its mean over keys is the term without
    dropout (within 5 standard errors)."""
    d, r, p = 16, 4, 0.25
    base = {"w": jnp.zeros((1, d, d))}
    adapters = stackwise.lora.init(jax.random.key(0), base, rank=r, dropout=p)
    eye = jnp.eye(d, r)  # a = I (the first r inputs), b = I: the term is the dropped input
    adapters = {"w": dataclasses.replace(adapters["w"], a=eye[None], b=eye.T[None])}
    layer = stackwise.lora.stack(lambda q, x: x @ q["w"], 1)
    x = jax.random.uniform(jax.random.key(1), (4096, d), minval=1.0, maxval=2.0)
    out = layer.apply(stackwise.lora.attach(base, adapters, key=KEY), x)[:, :r]
    kept = out != 0
    share, count = float(kept.mean()), kept.size
    assert abs(share - (1 - p)) < 5 * np.sqrt(p * (1 - p) / count), share
    np.testing.assert_allclose(out[kept], (x[:, :r] / (1 - p))[kept], rtol=1e-6)
    means = jax.vmap(lambda k: layer.apply(stackwise.lora.attach(base, adapters, key=k), x[:8]))(
        jax.random.split(jax.random.key(2), 400))[:, :, :r].mean(0)
    spread = x[:8, :r] * np.sqrt(p / (1 - p) / 400)
    assert jnp.all(jnp.abs(means - x[:8, :r]) < 5 * spread)


def test_every_layer_leaf_and_product_draws_its_own_mask():
    """A weight used twice in a layer draws two masks (u = 0, 1), each leaf its own (j),
    each layer its own (i): against the loop written with those keys."""
    base = {"w": jax.random.normal(jax.random.key(0), (3, 6, 6)) / 3}
    adapters = trained(stackwise.lora.init(jax.random.key(1), base, rank=2, dropout=P))
    layers = stackwise.lora.stack(lambda q, x: jnp.tanh(x @ q["w"]) @ q["w"], 3)
    y = x = X
    lw = adapters["w"]
    for i in range(3):
        w = base["w"][i]
        h = jnp.tanh(product(y, w, lw, i, mask_key(KEY, 0, 3, i, 0, 0)))
        y = product(h, w, lw, i, mask_key(KEY, 0, 3, i, 0, 1))
    assert_trees_close(layers.apply(stackwise.lora.attach(base, adapters, key=KEY), x), y)


def _uses(kind):
    """A layer using its (6, 6) weight in another form than ``x @ w``; its loop in terms of
    the adapted weight's parts (``x`` dropped for the adapter's term)."""
    forms = {
        "x @ w.T": lambda x, w: x @ w.T,
        "w @ x.T": lambda x, w: (w @ x.T).T,
        "einsum, reshaped into heads": lambda x, w: jnp.einsum(
            "bd,dhk->bhk", x, w.reshape(6, 2, 3)).reshape(x.shape[0], 6),
        "a slice of w, in bfloat16": lambda x, w: jnp.concatenate(
            [x.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16)[:, :3],
             jnp.zeros((x.shape[0], 3), jnp.bfloat16)], 1).astype(jnp.float32),
    }
    return forms[kind]


@pytest.mark.parametrize("kind", ["einsum, reshaped into heads", "x @ w.T", "w @ x.T",
                                  "a slice of w, in bfloat16"])
def test_weights_used_transposed_reshaped_sliced_or_cast(kind):
    """The term follows the weight: transposed (the factors swap), reshaped or sliced (the
    update is made whole and moved the same way), cast (the term stays in the adapters'
    dtype, as PEFT computes it)."""
    form = _uses(kind)
    base = {"w": jax.random.normal(jax.random.key(0), (3, 6, 6)) / 3}
    adapters = trained(stackwise.lora.init(jax.random.key(1), base, rank=2, dropout=P))
    layers = stackwise.lora.stack(lambda q, x: x + jnp.tanh(form(x, q["w"])), 3)
    lw = adapters["w"]

    def reference(lw):
        y = X
        for i in range(3):
            w, update = base["w"][i], lw.scale * lw.a[i] @ lw.b[i]
            key = mask_key(KEY, 0, 3, i, 0)
            if kind == "w @ x.T":  # the mask is drawn on the product's operand, x.T
                pre = form(y, w) + form(dropped(y.T, key, P).T, update)
            elif "bfloat16" not in kind:
                pre = form(y, w) + form(dropped(y, key, P), update)
            else:  # the product in bfloat16, the term in float32, their sum in bfloat16
                yb = y.astype(jnp.bfloat16)
                part = (yb @ w.astype(jnp.bfloat16)[:, :3]).astype(jnp.float32) + (
                    dropped(yb.astype(jnp.float32), key, P) @ update[:, :3])
                pre = jnp.concatenate([part.astype(jnp.bfloat16).astype(jnp.float32),
                                       jnp.zeros((y.shape[0], 3))], 1)
            y = y + jnp.tanh(pre)
        return y

    got = layers.apply(stackwise.lora.attach(base, adapters, key=KEY), X)
    # (bfloat16: each layer rounds the product and its sum with the term; tests/_tolerance.py)
    bound = 200 if "bfloat16" not in kind else rounding_bound(roundings=2 * 3)
    assert_trees_close(got, reference(lw), bound=bound)
    if "bfloat16" not in kind:
        def loss(lw):
            return jnp.sum(layers.apply(stackwise.lora.attach(base, {"w": lw}, key=KEY), X) ** 2)

        assert_trees_close(jax.grad(loss)(lw), jax.grad(lambda v: jnp.sum(reference(v) ** 2))(lw))


@pytest.mark.slow
def test_pattern_positions_with_their_own_keys():
    """A pattern attaches each position with its own key: position p is node 0 of its
    tree, its layers drawn from that key (the loop runs layers in model order)."""
    def scale_init(key):
        return {"s": jax.random.normal(key, (6, 6)) / 6}

    def scale_apply(q, x):
        return x + x @ q["s"]

    pattern = stackwise.stack([init, scale_init], [apply, scale_apply], 5)
    bases = pattern.init(jax.random.key(0))
    adapters = tuple(trained(a) for a in stackwise.lora.init(
        jax.random.key(1), bases, rank=2, dropout=P, targets=lambda path, _: "['c']" not in path))
    keys = jax.random.split(KEY, 2)
    layers = stackwise.lora.stack([apply, scale_apply], 5)

    def run(ad):
        return layers.apply(tuple(stackwise.lora.attach(b, a, key=k)
                                  for b, a, k in zip(bases, ad, keys)), X)

    def reference(ad):
        x = X
        for layer in range(5):
            p, i = layer % 2, layer // 2
            depth = 3 if p == 0 else 2
            w = jax.tree.map(lambda v, i=i: v[i], bases[p])
            lws = ad[p]
            if p == 0:  # leaves c (0), u (1), v (2)
                h = jnp.tanh(product(x, w["u"], lws["u"], i, mask_key(keys[0], 0, depth, i, 1)))
                x = x + product(h, w["v"], lws["v"], i, mask_key(keys[0], 0, depth, i, 2)) + w["c"]
            else:
                x = x + product(x, w["s"], lws["s"], i, mask_key(keys[1], 0, depth, i, 0))
        return x

    assert_trees_close(run(adapters), reference(adapters))
    assert_trees_close(jax.grad(lambda a: jnp.sum(run(a) ** 2))(adapters),
                       jax.grad(lambda a: jnp.sum(reference(a) ** 2))(adapters))


@pytest.mark.slow  # (the fast tier's loop test covers the path; these, its dtypes)
@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_qlora_base_and_bfloat16_compute(kind):
    """A quantized base (QLoRA): each layer's weight dequantized, the term added on the
    dropped input; with ``dtype=bfloat16`` the layer's product in bfloat16 and the term in
    the adapters' float32, as PEFT's QLoRA computes it."""
    qbase = stackwise.quant.quantize(BASE, kind, targets=TARGETS)
    adapters = _adapters(qbase)
    _check(stackwise.lora.stack(apply, n), qbase, adapters)
    bf16 = stackwise.lora.stack(apply, n, dtype=jnp.bfloat16)
    qbase = {**qbase, "c": qbase["c"].astype(jnp.bfloat16)}  # (a float leaf: as it is)
    x = X.astype(jnp.bfloat16)
    got = bf16.apply(stackwise.lora.attach(qbase, adapters, key=KEY), x)
    want = loop(qbase, adapters, x, KEY, dtype=jnp.bfloat16)
    assert got.dtype == jnp.bfloat16
    # Each layer rounds to bfloat16 7 times (two products, two sums with their terms, tanh,
    # two residual adds); a backend may skip any of them inside a fusion (tests/_tolerance.py).
    assert_trees_close(got.astype(jnp.float32), want.astype(jnp.float32),
                       bound=rounding_bound(roundings=7 * n))


@pytest.mark.slow  # (DoRA's full-weight form; the transposed and reshaped uses run it fast)
def test_dora_is_peft_s_dora_in_training():
    """DoRA with dropout, as PEFT's ``DoraLinearVariant.forward`` trains it: ``x @ W +
    (m / |V| - 1) * (dropout(x) @ W) + m / |V| * scale * (dropout(x) @ a) @ b``, the norm
    ``|V|`` of ``V = W + scale * a @ b`` held constant for gradients."""
    adapters = _adapters(BASE, dora=True)
    adapters = jax.tree.map(lambda v: dataclasses.replace(v, magnitude=v.magnitude * 1.1)
                            if is_lora(v) else v, adapters, is_leaf=is_lora)
    layers = stackwise.lora.stack(apply, n)

    def dora_product(h, w, lw, i, key):
        v = w + lw.scale * lw.a[i] @ lw.b[i]
        c = (lw.magnitude[i] / jax.lax.stop_gradient(jnp.linalg.norm(v, axis=0)))[None]
        hd = dropped(h, key, lw.dropout)
        return h @ w + (c - 1) * (hd @ w) + c * lw.scale * ((hd @ lw.a[i]) @ lw.b[i])

    def reference(ad):
        x = X
        for i in range(n):
            w = jax.tree.map(lambda v, i=i: v[i], BASE)
            h = jnp.tanh(dora_product(x, w["u"], ad["u"], i, mask_key(KEY, 0, n, i, 1)))
            x = x + dora_product(h, w["v"], ad["v"], i, mask_key(KEY, 0, n, i, 2)) + w["c"]
        return x

    def run(ad):
        return layers.apply(stackwise.lora.attach(BASE, ad, key=KEY), X)

    assert_trees_close(run(adapters), reference(adapters))
    assert_trees_close(jax.grad(lambda a: jnp.sum(run(a) ** 2))(adapters),
                       jax.grad(lambda a: jnp.sum(reference(a) ** 2))(adapters))


@pytest.mark.slow
def test_a_batch_of_adapters_each_as_alone_with_the_key():
    """A batch of g adapters (``stack_adapters``): group j draws the masks adapter j draws
    alone with the same key."""
    one, two = _adapters(BASE, seed=1), _adapters(BASE, seed=2)
    batch = stackwise.lora.stack_adapters([one, two])
    layers = stackwise.lora.stack(apply, n)
    xs = jnp.stack([X, -X])
    got = layers.apply(stackwise.lora.attach(BASE, batch, key=KEY), xs)
    for j, ad in enumerate([one, two]):
        assert_trees_close(got[j], loop(BASE, ad, xs[j], KEY))


def test_split_and_combine_take_each_step_s_key():
    """``split`` keeps no key (a step's); ``combine(..., key=)`` draws what ``attach(...,
    key=)`` draws, and training steps through it follow the loop."""
    adapters = _adapters(BASE)
    trainable, frozen = stackwise.lora.split(stackwise.lora.attach(BASE, adapters, key=KEY))
    assert not any(jnp.issubdtype(v.dtype, jax.dtypes.prng_key)
                   for v in jax.tree.leaves((trainable, frozen)))
    combined = stackwise.lora.combine(trainable, frozen, key=KEY)
    direct = stackwise.lora.attach(BASE, adapters, key=KEY)
    assert_trees_bitwise(combined.keys, direct.keys)
    layers = stackwise.lora.stack(apply, n)
    np.testing.assert_array_equal(layers.apply(combined, X), layers.apply(direct, X))


# --------------------------------------------------------------------------
# The frameworks' Stacks: per-leaf attached, each Stack's block by hand.


def _framework_loop(name, base, lw, x, key):
    """``x + tanh(linear(x))`` of each layer by hand, the adapter's term on the dropped
    input; Equinox's weight is (out, in) and its block sees one example."""
    leaves = [v for v in jax.tree.leaves(base) if jnp.ndim(v) in (2, 3)]
    w = next(v for v in leaves if jnp.ndim(v) == 3)
    bias = next(v for v in leaves if jnp.ndim(v) == 2)
    for i in range(N):
        k = mask_key(key, 0, N, i, 0)
        hd = dropped(x, k, lw.dropout)
        if name == "equinox":  # W @ x: a (out, r), b (r, in)
            pre = w[i] @ x + bias[i] + lw.scale * (lw.a[i] @ (lw.b[i] @ hd))
        else:
            pre = x @ w[i] + bias[i][None] + lw.scale * ((hd @ lw.a[i]) @ lw.b[i])
        x = x + jnp.tanh(pre)
    return x


@pytest.mark.parametrize("name", [pytest.param(k, marks=[] if k == "haiku" else pytest.mark.slow)
                                  for k in FRAMEWORKS])
def test_framework_stacks_are_their_loops(name):
    """Haiku, Linen and NNX run the batch in one call (one mask over the whole input, as
    PEFT's); Equinox's block sees one example, so each example is attached inside the vmap
    with its own key (one key for all would give every example the same mask)."""
    fw = FRAMEWORKS[name](stackwise.DEFAULT_REMAT)
    adapters = trained(stackwise.lora.init(jax.random.key(1), fw.base, rank=2, dropout=P))
    lw = next(v for v in jax.tree.leaves(adapters, is_leaf=is_lora) if is_lora(v))
    x = jax.random.normal(jax.random.key(3), (4, D))

    if name == "equinox":
        keys = jax.random.split(KEY, x.shape[0])

        def run(ad):
            return jax.vmap(lambda k, v: stackwise.lora.attach(fw.base, ad, per_leaf=True,
                                                                key=k)(v))(keys, x)

        def reference(lw):
            return jax.vmap(lambda k, v: _framework_loop(name, fw.base, lw, v, k))(keys, x)
    else:
        def run(ad):
            return fw.run_stack(stackwise.lora.attach(fw.base, ad, per_leaf=True, key=KEY), x)

        def reference(lw):
            return _framework_loop(name, fw.base, lw, x, KEY)

    def adapters_with(lw):
        return jax.tree.map(lambda v: lw if is_lora(v) else v, adapters, is_leaf=is_lora)

    assert_trees_close(run(adapters), reference(lw))
    assert_trees_close(jax.grad(lambda v: jnp.sum(run(adapters_with(v)) ** 2))(lw),
                       jax.grad(lambda v: jnp.sum(reference(v) ** 2))(lw))
