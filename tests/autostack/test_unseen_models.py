"""stackwise.autostack on loop models written fresh, in the style people write them in the wild
(none of them comes from this repository's other tests): a linen GPT-2, a Haiku GPT, a
pure-function Llama over a list of per-layer dicts, and an Equinox model holding a list of
blocks. For each, the run found is the whole depth (every layer's every param leaf stacked),
outputs and gradients equal the loop's within float32 rounding (tests/_tolerance.py), and the
params convert to the stacked layout and back bitwise.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import pytest
from _models import check_model
from _tolerance import reassociation_bound

import stackwise

VOCAB, SEQ, BATCH = 37, 7, 2
TOKENS = jax.random.randint(jax.random.key(11), (BATCH, SEQ), 0, VOCAB)


def check_unseen(fn, params, fresh, args, *, n, per_layer, bound, zero=()):
    """``autostack(fn)`` against ``fn``: the run is the ``n`` layers, each of its
    ``per_layer`` param leaves stacked; the outputs and every param leaf's grad (both jitted)
    within ``bound`` eps of the loop's; ``unstack(stack(params))`` bitwise, on the params
    traced and on fresh ones. Returns ``(stacked, f)``."""
    stacked, f = check_model(fn, params, fresh, args, n=n, bound=bound, zero=zero,
                             given_n=False)
    assert f.found.params == per_layer, (f.found, per_layer)
    for key, leaf in stacked["blocks"].items():
        assert leaf.shape[0] == n, (key, leaf.shape)
    return stacked, f


def scanned_layers(f, stacked, *args) -> list[int]:
    """The lengths of the scans in ``f``'s jaxpr (top level)."""
    jaxpr = jax.make_jaxpr(f)(stacked, *args).jaxpr
    return [e.params["length"] for e in jaxpr.eqns if e.primitive.name == "scan"]


# --------------------------------------------------------------------------
# (a) A linen GPT-2, as nanoGPT's model.py is ported to flax: `for i in range(n_layer):
# x = Block(config, name=f"h_{i}")(x)`, tied embeddings (`wte.attend`), dropout off.


def linen_gpt2(n_layer, n_embd=16, n_head=4):
    import flax.linen as nn

    class CausalSelfAttention(nn.Module):
        @nn.compact
        def __call__(self, x, deterministic):
            B, T, C = x.shape
            qkv = nn.Dense(3 * C, name="c_attn")(x)
            q, k, v = jnp.split(qkv, 3, axis=-1)
            q = q.reshape(B, T, n_head, C // n_head).transpose(0, 2, 1, 3)
            k = k.reshape(B, T, n_head, C // n_head).transpose(0, 2, 1, 3)
            v = v.reshape(B, T, n_head, C // n_head).transpose(0, 2, 1, 3)
            att = (q @ k.transpose(0, 1, 3, 2)) * (1.0 / math.sqrt(k.shape[-1]))
            mask = jnp.tril(jnp.ones((T, T), dtype=bool)).reshape(1, 1, T, T)
            att = jnp.where(mask, att, jnp.finfo(att.dtype).min)
            att = nn.softmax(att, axis=-1)
            att = nn.Dropout(rate=0.1)(att, deterministic=deterministic)
            y = (att @ v).transpose(0, 2, 1, 3).reshape(B, T, C)
            y = nn.Dense(C, name="c_proj")(y)
            return nn.Dropout(rate=0.1)(y, deterministic=deterministic)

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x, deterministic):
            x = nn.Dense(4 * n_embd, name="c_fc")(x)
            x = nn.gelu(x, approximate=True)
            x = nn.Dense(n_embd, name="c_proj")(x)
            return nn.Dropout(rate=0.1)(x, deterministic=deterministic)

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, deterministic=True):
            x = x + CausalSelfAttention(name="attn")(nn.LayerNorm(epsilon=1e-5, name="ln_1")(x),
                                                     deterministic)
            x = x + MLP(name="mlp")(nn.LayerNorm(epsilon=1e-5, name="ln_2")(x), deterministic)
            return x

    class GPT(nn.Module):
        @nn.compact
        def __call__(self, idx, deterministic=True):
            b, t = idx.shape
            wte = nn.Embed(VOCAB, n_embd, name="wte")
            wpe = nn.Embed(SEQ, n_embd, name="wpe")
            pos = jnp.arange(0, t, dtype=jnp.int32)
            x = wte(idx) + wpe(pos)[None]
            x = nn.Dropout(rate=0.1)(x, deterministic=deterministic)
            for i in range(n_layer):
                x = Block(name=f"h_{i}")(x, deterministic=deterministic)
            x = nn.LayerNorm(epsilon=1e-5, name="ln_f")(x)
            return wte.attend(x)  # weight tying

    return GPT()


# A layer: a norm (16), c_attn (16), the scores (4 per head), softmax and att @ v (7
# positions), c_proj (16), a norm (16), c_fc (16) and its c_proj (64); the grads sum 14 tokens.
GPT2_SUMS = (16, 16, 4, 7, 16, 16, 16, 64)
# c_attn's key bias shifts every score of a query alike, which softmax ignores: its gradient
# is 0 in exact arithmetic, and both programs compute rounding noise there.
GPT2_ZERO = ("['c_attn']['bias']",)


@pytest.mark.slow  # (the fast tier runs the pure-function Llama)
@pytest.mark.parametrize("n", [4, 12])
def test_linen_gpt2(n):
    model = linen_gpt2(n)
    params = model.init(jax.random.key(0), TOKENS)
    fresh = model.init(jax.random.key(1), TOKENS)
    per_layer = len(jax.tree.leaves(params["params"]["h_0"]))
    stacked, f = check_unseen(model.apply, params, fresh, (TOKENS,), n=n, per_layer=per_layer,
                              bound=reassociation_bound(depth=n, width=GPT2_SUMS, summed=14),
                              zero=GPT2_ZERO)
    assert per_layer == 12  # ln_1, c_attn, c_proj, ln_2, c_fc, c_proj: scale/kernel and bias
    assert scanned_layers(f, stacked, TOKENS) == [n]
    assert stacked["blocks"]["['params']['h_0']['mlp']['c_fc']['kernel']"].shape == (n, 16, 64)
    assert stacked["rest"]["params"]["wte"]["embedding"] is params["params"]["wte"]["embedding"]


@pytest.mark.slow
def test_linen_gpt2_with_dropout_on():
    """Training: every Dropout draws from the "dropout" rng, folded per module path: the
    scan gives each layer the loop's masks."""
    model = linen_gpt2(4)
    params = model.init(jax.random.key(0), TOKENS)
    fresh = model.init(jax.random.key(1), TOKENS)

    def train_apply(p, tokens, key):
        return model.apply(p, tokens, deterministic=False, rngs={"dropout": key})

    stacked, f = check_unseen(train_apply, params, fresh, (TOKENS, jax.random.key(3)), n=4,
                              per_layer=12,
                              bound=reassociation_bound(depth=4, width=GPT2_SUMS, summed=14),
                              zero=GPT2_ZERO)
    assert scanned_layers(f, stacked, TOKENS, jax.random.key(3)) == [4]


# --------------------------------------------------------------------------
# (b) A Haiku GPT: `hk.MultiHeadAttention` with a causal mask, an MLP, layer norms, blocks made
# in a `for` loop (`hk.Module`s named by creation order), dropout through `hk.dropout` when
# training.


def haiku_gpt(n_layer, d_model=16, num_heads=4):
    import haiku as hk

    class DecoderBlock(hk.Module):
        def __init__(self, dropout_rate, name=None):
            super().__init__(name=name)
            self.dropout_rate = dropout_rate

        def __call__(self, h, mask, is_training):
            init = hk.initializers.VarianceScaling(2 / n_layer)
            attn_in = hk.LayerNorm(axis=-1, create_scale=True, create_offset=True)(h)
            attn = hk.MultiHeadAttention(num_heads=num_heads, key_size=d_model // num_heads,
                                         model_size=d_model, w_init=init)
            h_attn = attn(attn_in, attn_in, attn_in, mask=mask)
            if is_training:
                h_attn = hk.dropout(hk.next_rng_key(), self.dropout_rate, h_attn)
            h = h + h_attn
            mlp_in = hk.LayerNorm(axis=-1, create_scale=True, create_offset=True)(h)
            mlp = hk.Sequential([hk.Linear(4 * d_model, w_init=init), jax.nn.gelu,
                                 hk.Linear(d_model, w_init=init)])
            h_mlp = mlp(mlp_in)
            if is_training:
                h_mlp = hk.dropout(hk.next_rng_key(), self.dropout_rate, h_mlp)
            return h + h_mlp

    def forward(tokens, is_training=False):
        _, seq_len = tokens.shape
        token_emb = hk.Embed(vocab_size=VOCAB, embed_dim=d_model)
        pos_emb = hk.get_parameter("pos_embs", [SEQ, d_model],
                                   init=hk.initializers.TruncatedNormal(stddev=0.02))
        h = token_emb(tokens) + pos_emb[None, :seq_len]
        mask = jnp.tril(jnp.ones((1, 1, seq_len, seq_len)))
        for _ in range(n_layer):
            h = DecoderBlock(dropout_rate=0.1)(h, mask, is_training)
        h = hk.LayerNorm(axis=-1, create_scale=True, create_offset=True, name="ln_f")(h)
        return hk.Linear(VOCAB, name="lm_head")(h)

    return hk.transform(forward)


# As the linen GPT-2's: the attention's query/key/value and output projections are sums of 16.
HAIKU_GPT_SUMS = GPT2_SUMS
HAIKU_GPT_ZERO = ("/key']['b']",)


@pytest.mark.slow  # (the fast tier runs the pure-function Llama)
@pytest.mark.parametrize("n", [4, 12])
def test_haiku_gpt(n):
    model = haiku_gpt(n)
    params = model.init(jax.random.key(0), TOKENS)
    fresh = model.init(jax.random.key(1), TOKENS)

    def apply(p, tokens):
        return model.apply(p, None, tokens)

    per_layer = len(jax.tree.leaves({k: v for k, v in params.items()
                                     if k.startswith("decoder_block/")}))
    stacked, f = check_unseen(apply, params, fresh, (TOKENS,), n=n, per_layer=per_layer,
                              bound=reassociation_bound(depth=n, width=HAIKU_GPT_SUMS, summed=14),
                              zero=HAIKU_GPT_ZERO)
    assert per_layer == 16  # 2 norms, 4 attention Linears and 2 MLP Linears: 2 leaves each
    assert scanned_layers(f, stacked, TOKENS) == [n]


@pytest.mark.slow
def test_haiku_gpt_training_with_dropout():
    """``hk.next_rng_key()`` per dropout: the key chain is carried through the scan."""
    model = haiku_gpt(4)
    params = model.init(jax.random.key(0), TOKENS)
    fresh = model.init(jax.random.key(1), TOKENS)

    def train_apply(p, key, tokens):
        return model.apply(p, key, tokens, is_training=True)

    stacked, f = check_unseen(train_apply, params, fresh, (jax.random.key(3), TOKENS), n=4,
                              per_layer=16,
                              bound=reassociation_bound(depth=4, width=HAIKU_GPT_SUMS, summed=14),
                              zero=HAIKU_GPT_ZERO)
    assert scanned_layers(f, stacked, jax.random.key(3), TOKENS) == [4]


# --------------------------------------------------------------------------
# (c) A pure-function Llama over a list of per-layer param dicts: RMSNorm, RoPE from the
# positions, grouped-query attention (2 kv heads for 4 query heads), SwiGLU.

DIM, N_HEADS, N_KV_HEADS, HIDDEN = 16, 4, 2, 40
HEAD_DIM = DIM // N_HEADS


def llama_init(key, n_layers):
    def dense(k, fan_in, fan_out):
        return jax.random.normal(k, (fan_in, fan_out), jnp.float32) * fan_in**-0.5

    keys = jax.random.split(key, n_layers + 2)
    layers = []
    for k in keys[:n_layers]:
        kq, kk, kv, ko, k1, k2, k3 = jax.random.split(k, 7)
        layers.append({
            "attention_norm": jnp.ones((DIM,), jnp.float32),
            "wq": dense(kq, DIM, N_HEADS * HEAD_DIM),
            "wk": dense(kk, DIM, N_KV_HEADS * HEAD_DIM),
            "wv": dense(kv, DIM, N_KV_HEADS * HEAD_DIM),
            "wo": dense(ko, N_HEADS * HEAD_DIM, DIM),
            "ffn_norm": jnp.ones((DIM,), jnp.float32),
            "w1": dense(k1, DIM, HIDDEN),
            "w2": dense(k2, HIDDEN, DIM),
            "w3": dense(k3, DIM, HIDDEN),
        })
    return {
        "tok_embeddings": jax.random.normal(keys[-2], (VOCAB, DIM), jnp.float32),
        "layers": layers,
        "norm": jnp.ones((DIM,), jnp.float32),
        "output": dense(keys[-1], DIM, VOCAB),
    }


def rmsnorm(x, weight, eps=1e-5):
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return normed.astype(x.dtype) * weight[None, None, :]


def rope(x, positions, theta=10000.0):
    """Rotates pairs (x[..., :h/2], x[..., h/2:]) of ``x [B, T, H, h]`` by the positions."""
    half = x.shape[-1] // 2
    freqs = 1.0 / (theta ** (jnp.arange(0, half, dtype=jnp.float32) / half))
    angles = positions[:, :, None].astype(jnp.float32) * freqs[None, None, :]  # [B, T, h/2]
    cos, sin = jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


def llama_attention(layer, x, positions):
    bsz, seqlen, _ = x.shape
    xq = (x @ layer["wq"]).reshape(bsz, seqlen, N_HEADS, HEAD_DIM)
    xk = (x @ layer["wk"]).reshape(bsz, seqlen, N_KV_HEADS, HEAD_DIM)
    xv = (x @ layer["wv"]).reshape(bsz, seqlen, N_KV_HEADS, HEAD_DIM)
    xq, xk = rope(xq, positions), rope(xk, positions)
    n_rep = N_HEADS // N_KV_HEADS
    keys, values = jnp.repeat(xk, n_rep, axis=2), jnp.repeat(xv, n_rep, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", xq, keys) / math.sqrt(HEAD_DIM)
    causal = positions[:, None, :, None] >= positions[:, None, None, :]
    scores = jnp.where(causal, scores, -jnp.inf)
    probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(xq.dtype)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs, values).reshape(bsz, seqlen, -1)
    return out @ layer["wo"]


def llama_forward(params, tokens):
    h = params["tok_embeddings"][tokens]
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1])[None, :], tokens.shape)
    for layer in params["layers"]:
        h = h + llama_attention(layer, rmsnorm(h, layer["attention_norm"]), positions)
        x = rmsnorm(h, layer["ffn_norm"])
        h = h + (jax.nn.silu(x @ layer["w1"]) * (x @ layer["w3"])) @ layer["w2"]
    return rmsnorm(h, params["norm"]) @ params["output"]


# A layer: a norm (16), q/k/v (16), the scores (4 per head), softmax and probs @ v (7
# positions), wo (16), a norm (16), w1/w3 (16), w2 (40); the grads sum 14 tokens.
LLAMA_SUMS = (16, 16, 4, 7, 16, 16, 16, 40)


@pytest.mark.parametrize("n", [4, 12])
def test_pure_function_llama(n):
    params = llama_init(jax.random.key(0), n)
    fresh = llama_init(jax.random.key(1), n)
    stacked, f = check_unseen(llama_forward, params, fresh, (TOKENS,), n=n, per_layer=9,
                              bound=reassociation_bound(depth=n, width=LLAMA_SUMS, summed=14))
    assert scanned_layers(f, stacked, TOKENS) == [n]
    assert stacked["blocks"]["['layers'][0]['wk']"].shape == (n, DIM, N_KV_HEADS * HEAD_DIM)
    assert stacked["rest"]["output"] is params["output"]


# --------------------------------------------------------------------------
# (d) An Equinox model holding a list of blocks, called per sequence under `jax.vmap`.


@functools.cache
def equinox_gpt_class(d=16, heads=4):
    """The model's class, made once (a treedef holds its classes: the params of two models
    made by two calls of this function must have one structure)."""
    import equinox as eqx

    class Block(eqx.Module):
        ln1: eqx.nn.LayerNorm
        attn: eqx.nn.MultiheadAttention
        ln2: eqx.nn.LayerNorm
        mlp: eqx.nn.MLP

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.ln1, self.ln2 = eqx.nn.LayerNorm(d), eqx.nn.LayerNorm(d)
            self.attn = eqx.nn.MultiheadAttention(heads, d, use_query_bias=True,
                                                  use_key_bias=True, use_value_bias=True,
                                                  use_output_bias=True, key=k1)
            self.mlp = eqx.nn.MLP(d, d, 4 * d, depth=1, activation=jax.nn.gelu, key=k2)

        def __call__(self, x):  # [T, d]
            t = x.shape[0]
            mask = jnp.tril(jnp.ones((t, t), dtype=bool))
            h = jax.vmap(self.ln1)(x)
            x = x + self.attn(h, h, h, mask=mask)
            return x + jax.vmap(self.mlp)(jax.vmap(self.ln2)(x))

    class GPT(eqx.Module):
        embed: eqx.nn.Embedding
        pos: jax.Array
        blocks: list
        ln_f: eqx.nn.LayerNorm
        head: eqx.nn.Linear

        def __init__(self, key, n_layer):
            keys = jax.random.split(key, n_layer + 3)
            self.embed = eqx.nn.Embedding(VOCAB, d, key=keys[0])
            self.pos = 0.02 * jax.random.normal(keys[1], (SEQ, d))
            self.blocks = [Block(k) for k in keys[2:-1]]
            self.ln_f = eqx.nn.LayerNorm(d)
            self.head = eqx.nn.Linear(d, VOCAB, key=keys[-1])

        def __call__(self, tokens):  # [T]
            x = jax.vmap(self.embed)(tokens) + self.pos[: tokens.shape[0]]
            for block in self.blocks:
                x = block(x)
            return jax.vmap(self.head)(jax.vmap(self.ln_f)(x))

    return GPT


def equinox_gpt(key, n_layer):
    return equinox_gpt_class()(key, n_layer)


EQX_ZERO = ("key_proj.bias",)


@pytest.mark.slow  # (the fast tier runs the pure-function Llama)
@pytest.mark.parametrize("n", [4, 12])
def test_equinox_list_of_blocks(n):
    import equinox as eqx

    model = equinox_gpt(jax.random.key(0), n)
    params, static = eqx.partition(model, eqx.is_array)
    fresh = eqx.partition(equinox_gpt(jax.random.key(1), n), eqx.is_array)[0]

    def forward(params, tokens):
        return jax.vmap(eqx.combine(params, static))(tokens)

    per_layer = len(jax.tree.leaves(params.blocks[0]))
    stacked, f = check_unseen(forward, params, fresh, (TOKENS,), n=n, per_layer=per_layer,
                              bound=reassociation_bound(depth=n, width=GPT2_SUMS, summed=14),
                              zero=EQX_ZERO)
    assert scanned_layers(f, stacked, TOKENS) == [n]


def test_an_equinox_module_given_whole_is_refused_with_the_partition_to_use():
    """A module's non-array fields (an activation function, a dropout rate) are leaves of its
    pytree: the message names the first and shows the `eqx.partition` call that works."""
    model = equinox_gpt(jax.random.key(0), 2)
    with pytest.raises(TypeError) as info:
        stackwise.autostack(lambda m, tokens: jax.vmap(m)(tokens), model, TOKENS)
    message = str(info.value)
    assert "the leaf at `params.blocks[0].attn.dropout.p` is float 0.0" in message, message
    assert "eqx.partition(model, eqx.is_array)" in message, message


def test_params_of_a_class_made_twice_are_told_apart_by_the_node():
    """The same leaves at the same paths, but the model's class made again: the message names
    the node, not two whole treedefs."""
    import equinox as eqx

    params, static = eqx.partition(equinox_gpt(jax.random.key(0), 2), eqx.is_array)
    _, f = stackwise.autostack(lambda p, t: jax.vmap(eqx.combine(p, static))(t), params, TOKENS)
    other = equinox_gpt_class.__wrapped__()(jax.random.key(1), 2)  # (not the cached class)
    with pytest.raises(TypeError) as info:
        f.stack(eqx.partition(other, eqx.is_array)[0])
    message = str(info.value)
    assert "the same leaves at the same paths, but a node differs" in message, message
    assert "`equinox_gpt_class.<locals>.GPT`" in message and "made twice" in message, message
