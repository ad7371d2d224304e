"""One character-level transformer LM, written five ways: pure JAX, Haiku, Flax linen, NNX and
Equinox.

Each ``build_<framework>(config)`` returns an :class:`LM`, a set of pure functions over a plain
pytree of params, so that ``transformer_lm.py`` trains, checkpoints and samples every framework
with the same code. In each framework the ``config.layers`` blocks are ONE stackwise stack:
their params have a leading layer axis and run as one scanned layer.

The block is pre-LN: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``, with causal multi-head
self-attention and rotary position embeddings (RoPE). Decoding keeps a per-layer KV cache, a
ring buffer of ``config.seq_len`` slots: a query attends to at most the last ``seq_len`` tokens,
exactly as in training, so the sample can be longer than the training context (with RoPE only
relative positions matter).

``config.pattern`` repeats kinds of block over the layers, Gemma-style: a "global" block is the
one above; a "local" block is the same block attending only to the last ``config.window``
tokens (itself included), in training and in decoding (its cache masks by the slots' positions).
With the default pattern, ``("global",)``, the blocks are a plain stack; with k kinds, layer i
is of kind ``pattern[i % k]`` and the blocks are ONE pattern stack (``stackwise.stack`` of lists
of k functions, or each adapter's ``Stack([...], n)``): position p holds layers p, p + k, ...
stacked, and ``layers`` need not be a multiple of k.

The five are one model: the same params under each framework's names (the same count), drawn
from the same distributions (embedding N(0, 0.02²); dense kernels N(0, 1/fan_in), the residual
branches' output projections scaled by 1/sqrt(2 * layers); biases 0; LayerNorm scale 1, offset
0), and the same computation: given the same param values the five give the same logits up to
float32 rounding (tests/examples checks it, with the default blocks and with a pattern;
Equinox's dense weights are the others' transposed, ``[out, in]``). What differs is the random
draw itself: each framework splits the init key its own way, so the initial params differ
between frameworks as they do between seeds of one framework. So does the initial loss, by more
than one might expect: at init about half the variance of the logits is one random vector
shared by every position, so the loss moves with that one draw (with the default sizes, 4.45 to
4.91 nats over seeds 0-5 of the pure-JAX model; 4.54, 4.73, 4.69 and 4.65 for seed 0 in JAX,
Haiku, linen and NNX). Trained with the defaults they end within 0.02 nats of each other (1.52
to 1.54; measured before Equinox joined).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

import stackwise

FRAMEWORKS = ("jax", "haiku", "flax", "nnx", "equinox")
#: The kinds of block: "global" attends to the whole context (causally), "local" to the last
#: ``Config.window`` tokens (sliding-window attention).
KINDS = ("local", "global")


@dataclasses.dataclass(frozen=True)
class Config:
    """The model's sizes (the same in every framework)."""

    vocab: int = 62
    layers: int = 4
    d_model: int = 128
    heads: int = 4
    mlp_ratio: int = 4
    seq_len: int = 64  # the training context, and the KV cache's ring-buffer size
    remat: bool = False  # rematerialise each block's activations in the backward pass
    pattern: tuple[str, ...] = ("global",)  # the blocks' kinds, repeated: see KINDS
    window: int = 16  # a "local" block's query at t sees the keys at t - window + 1 .. t

    def __post_init__(self):
        bad = [kind for kind in self.pattern if kind not in KINDS]
        if not self.pattern or bad:
            raise ValueError(
                f"Config.pattern {self.pattern!r}: each entry must be one of {', '.join(KINDS)}"
                + (f"; got {bad[0]!r}" if bad else "; got none")
            )
        if "local" in self.pattern and not 1 <= self.window <= self.seq_len:
            raise ValueError(
                f"Config.window must be 1 to seq_len={self.seq_len}, got {self.window}"
            )
        if self.layers < len(self.pattern):
            raise ValueError(
                f"Config.layers={self.layers} is fewer than the pattern's {len(self.pattern)} "
                "blocks; give at least one layer per pattern entry."
            )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads

    @property
    def windows(self) -> tuple[int, ...]:
        """Each pattern position's attention window in tokens (``seq_len``: global)."""
        return tuple(self.window if kind == "local" else self.seq_len for kind in self.pattern)

    @property
    def counts(self) -> tuple[int, ...]:
        """How many of the ``layers`` blocks each pattern position holds (p, p + k, ...)."""
        k = len(self.pattern)
        return tuple(len(range(p, self.layers, k)) for p in range(k))


class LM(NamedTuple):
    """A language model as pure functions; ``params`` is a plain pytree.

    Attributes:
      init: ``params = init(key)``; the blocks' leaves carry a leading ``layers`` axis.
      apply: ``logits, cache = apply(params, tokens, positions, cache)``: ``tokens`` int32
        ``[batch, length]`` at absolute ``positions`` int32 ``[length]``. With ``cache=None``
        (training) it attends causally within ``tokens`` and returns ``cache=None``; with a
        cache from ``init_cache`` it writes the new keys/values into it and attends to all
        cached ones (prefill from position 0 with ``length <= seq_len``, then one token at a
        time).
      init_cache: ``cache = init_cache(batch)``: an empty stacked per-layer KV cache.
      to_loop: ``loop_params = to_loop(params)``: the params in the layout of the same model
        written as a plain Python loop over separate blocks (one params tree per block), with
        the framework's stackwise conversion.
      loop_apply: ``logits = loop_apply(loop_params, tokens)``: the full forward of that loop.
      serve: ``served, init_cache = serve(params)`` (the pure-JAX model only, else None): the
        params and the KV cache in stackwise's serving layout (``stackwise.to_serving``: one
        buffer per layer, converted once), which ``apply`` runs as a Python loop over them;
        decoding then pays no per-layer slice of the stacked weights.
    """

    init: Callable[..., Any]
    apply: Callable[..., Any]
    init_cache: Callable[..., Any]
    to_loop: Callable[..., Any]
    loop_apply: Callable[..., Any]
    serve: Callable[..., Any] | None = None


# --------------------------------------------------------------------------
# Shared numerics: written once, used by every framework so the five models compute the same.


def rope(x: jax.Array, positions: jax.Array) -> jax.Array:
    """Rotary position embedding of ``x [batch, length, heads, head_dim]`` at ``positions``."""
    half = x.shape[-1] // 2
    freqs = 10_000.0 ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions.astype(jnp.float32)[:, None] * freqs[None, :]  # [length, half]
    cos, sin = jnp.cos(angles)[None, :, None, :], jnp.sin(angles)[None, :, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


def attention(q, k, v, q_pos, k_pos, window: int) -> jax.Array:
    """Causal attention: query at position p sees keys at ``p - window < k_pos <= p``.

    ``q [b, lq, h, d]``, ``k, v [b, lk, h, d]``, ``q_pos [lq]``, ``k_pos [lk]`` (a negative
    key position marks an empty cache slot).
    """
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    seen = (k_pos[None, :] >= 0) & (k_pos[None, :] <= q_pos[:, None])
    seen &= q_pos[:, None] - k_pos[None, :] < window
    scores = jnp.where(seen[None, None], scores, -1e30)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)


def cached_attention(q, k, v, positions, cache_k, cache_v, window: int | None = None):
    """Writes ``k, v`` into a ring-buffer cache and attends to it: ``(out, cache_k, cache_v)``.

    Slot ``s`` of the ``slots = cache_k.shape[1]`` holds the token at position ``p`` with
    ``p % slots == s``. The write is one contiguous chunk starting at slot
    ``positions[0] % slots``: a prefill from position 0 of at most ``slots`` tokens, or a
    single token. A query sees the cached keys less than ``window`` positions back (default:
    ``slots``). A local block keeps a cache of ``seq_len`` slots like a global one and masks
    by the slots' absolute positions: simplest, and exactly its training mask (a ring of
    ``window`` slots would save memory but could not take a prefill longer than ``window``).
    """
    slots = cache_k.shape[1]
    start = positions[0] % slots
    cache_k = jax.lax.dynamic_update_slice_in_dim(cache_k, k.astype(cache_k.dtype), start, 1)
    cache_v = jax.lax.dynamic_update_slice_in_dim(cache_v, v.astype(cache_v.dtype), start, 1)
    last = positions[-1]
    slot_ids = jnp.arange(slots, dtype=jnp.int32)
    slot_pos = last - (last - slot_ids) % slots  # the newest position held by each slot (<0: empty)
    out = attention(q, cache_k, cache_v, positions, slot_pos, slots if window is None else window)
    return out, cache_k, cache_v


def layer_norm(x, scale, bias, eps: float = 1e-5):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * _row(scale, x) + _row(bias, x)


def _row(v, x):
    """``v [d]`` shaped to broadcast against ``x [..., d]`` (explicitly: no rank promotion)."""
    return v.reshape((1,) * (x.ndim - 1) + v.shape)


def cache_shape(config: Config, batch: int) -> tuple[int, ...]:
    """One layer's key (or value) cache: ``[batch, seq_len, heads, head_dim]``."""
    return (batch, config.seq_len, config.heads, config.head_dim)


def stacked_cache(config: Config, batch: int):
    """An empty KV cache as a stack's state: ``{"k", "v"}`` with a leading ``layers`` axis;
    with a pattern of k blocks, a tuple of k such dicts (position p's ``counts[p]`` layers)."""
    shapes = [(count, *cache_shape(config, batch)) for count in config.counts]
    caches = [{"k": jnp.zeros(shape), "v": jnp.zeros(shape)} for shape in shapes]
    return one_or_list(config, caches)


def one_or_list(config: Config, items: list):
    """``items[0]`` for a model of one kind of block (a plain Stack); for a pattern, the
    items as a tuple (the k positions' states, as a pattern stack takes them)."""
    return tuple(items) if len(config.pattern) > 1 else items[0]


def _check_framework(framework: str) -> None:
    if framework not in FRAMEWORKS:
        raise ValueError(f"unknown framework {framework!r}; choose one of {', '.join(FRAMEWORKS)}.")


def build(framework: str, config: Config) -> LM:
    """The LM in ``framework`` (one of :data:`FRAMEWORKS`)."""
    _check_framework(framework)
    builders = {
        "jax": build_jax,
        "haiku": build_haiku,
        "flax": build_flax,
        "nnx": build_nnx,
        "equinox": build_equinox,
    }
    return builders[framework](config)


# --------------------------------------------------------------------------
# Pure JAX: one block is an (init, apply) pair of functions; `stackwise.stack` stacks it.


def _dense_init(key, d_in, d_out, scale=1.0):
    return jax.random.normal(key, (d_in, d_out), jnp.float32) * (scale / math.sqrt(d_in))


def _ln_init(d):
    return {"scale": jnp.ones(d), "bias": jnp.zeros(d)}


def _ln(p, x):
    return layer_norm(x, p["scale"], p["bias"])


def loss_fn(lm: LM, params, inputs, targets):
    """The mean next-token cross-entropy (nats) of ``lm`` on ``inputs`` predicting
    ``targets`` (both int32 ``[batch, length]``): what training and fine-tuning minimise."""
    positions = jnp.arange(inputs.shape[1], dtype=jnp.int32)
    logits, _ = lm.apply(params, inputs, positions)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def build_jax(config: Config, *, adapted: bool = False) -> LM:
    """The pure-JAX LM. ``adapted=True``: its blocks also take ``stackwise.lora.attach(base,
    adapters)`` params, the base float or quantized (``stackwise.quant``): each block is
    ``stackwise.lora.wrap``-ped, so it builds its own float weights from its own slice of the
    base and the adapters, inside the scan (examples/lm_finetune.py fine-tunes with it)."""
    c = config
    d, hidden = c.d_model, c.mlp_ratio * c.d_model
    depth_scale = 1 / math.sqrt(2 * c.layers)  # residual branches start small

    def block_init(key):
        k_qkv, k_out, k_up, k_down = jax.random.split(key, 4)
        params = {
            "ln1": _ln_init(d),
            "qkv": _dense_init(k_qkv, d, 3 * d),
            "out": _dense_init(k_out, d, d, depth_scale),
            "ln2": _ln_init(d),
            "up": _dense_init(k_up, d, hidden),
            "up_bias": jnp.zeros(hidden),
            "down": _dense_init(k_down, hidden, d, depth_scale),
            "down_bias": jnp.zeros(d),
        }
        return params, None  # (params, state): the state is the KV cache, made by init_cache

    def block_apply(window):
        def apply(p, cache, x, positions):
            """One block: ``x, cache = apply(p, cache, x, positions)``; cache may be None."""
            b, length, _ = x.shape
            qkv = (_ln(p["ln1"], x) @ p["qkv"]).reshape(b, length, 3, c.heads, c.head_dim)
            q, k, v = rope(qkv[:, :, 0], positions), rope(qkv[:, :, 1], positions), qkv[:, :, 2]
            if cache is None:
                att = attention(q, k, v, positions, positions, window)
            else:
                att, ck, cv = cached_attention(q, k, v, positions, cache["k"], cache["v"], window)
                cache = {"k": ck, "v": cv}
            x = x + att.reshape(b, length, d) @ p["out"]
            h = _ln(p["ln2"], x) @ p["up"]
            h = jax.nn.gelu(h + _row(p["up_bias"], h)) @ p["down"]
            return x + h + _row(p["down_bias"], h), cache

        return apply

    # One block function per pattern position (its attention window); layer i runs
    # applies[i % k].
    applies = [block_apply(window) for window in c.windows]
    if adapted:  # (plain params pass through a wrapped block unchanged)
        applies = [stackwise.lora.wrap(f, with_state=True) for f in applies]
    k = len(applies)

    # The blocks: one stack (a pattern stack for k > 1). Its state is the per-layer KV cache
    # (None when training).
    blocks = stackwise.stack(
        one_or_list(c, [block_init] * k),
        one_or_list(c, applies),
        c.layers,
        remat=c.remat,
        with_state=True,
    )

    def init(key):
        k_embed, k_blocks, k_head = jax.random.split(key, 3)
        stacked, _ = blocks.init(k_blocks)
        return {
            "embed": jax.random.normal(k_embed, (c.vocab, d)) * 0.02,
            "blocks": stacked,
            "ln_f": _ln_init(d),
            "head": _dense_init(k_head, d, c.vocab),
            "head_bias": jnp.zeros(c.vocab),
        }

    def head(params, x):
        logits = _ln(params["ln_f"], x) @ params["head"]
        return logits + _row(params["head_bias"], logits)

    def apply(params, tokens, positions, cache=None):
        x = params["embed"][tokens]
        x, cache = blocks.apply(params["blocks"], cache, x, positions)
        return head(params, x), cache

    def init_cache(batch):
        return stacked_cache(c, batch)

    def to_loop(params):  # "blocks": a list of per-layer trees, in layer order
        blocks = stackwise.unstack_layers(params["blocks"], pattern=k if k > 1 else None)
        return {**params, "blocks": blocks}

    def loop_apply(loop_params, tokens):
        positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)
        x = loop_params["embed"][tokens]
        for i, p in enumerate(loop_params["blocks"]):  # the loop the stack replaces
            x, _ = applies[i % k](p, None, x, positions)
        return head(loop_params, x)

    def serve(params):  # the blocks' params and caches as per-layer buffers, in layer order
        pattern = k if k > 1 else None
        served = {**params, "blocks": stackwise.to_serving(params["blocks"], pattern=pattern)}
        return served, lambda batch: stackwise.to_serving(init_cache(batch), pattern=pattern)

    return LM(init, apply, init_cache, to_loop, loop_apply, serve)


def _zeros_like_shapes(shapes):
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


# --------------------------------------------------------------------------
# Haiku: an ordinary hk.Module block; `stackwise.haiku.Stack` stacks it. The KV cache is Haiku
# state (`hk.get_state`), which the Stack keeps per layer, stacked.


def build_haiku(config: Config) -> LM:
    import haiku as hk

    import stackwise.haiku

    c = config
    d, hidden = c.d_model, c.mlp_ratio * c.d_model
    depth_scale = 1 / math.sqrt(2 * c.layers)

    def dense(d_out, name, scale=1.0, bias=True):
        w_init = hk.initializers.VarianceScaling(scale**2, "fan_in", "normal")
        return hk.Linear(d_out, with_bias=bias, w_init=w_init, name=name)

    def norm(name):
        return hk.LayerNorm(-1, create_scale=True, create_offset=True, eps=1e-5, name=name)

    class Block(hk.Module):
        window = c.seq_len  # how many positions back a query sees: all the context

        def __call__(self, x, positions, decode: bool):
            b, length, _ = x.shape
            qkv = dense(3 * d, "qkv", bias=False)(norm("ln1")(x))
            qkv = qkv.reshape(b, length, 3, c.heads, c.head_dim)
            q, k, v = rope(qkv[:, :, 0], positions), rope(qkv[:, :, 1], positions), qkv[:, :, 2]
            if decode:
                shape = cache_shape(c, b)
                cache_k = hk.get_state("k", shape, init=jnp.zeros)
                cache_v = hk.get_state("v", shape, init=jnp.zeros)
                att, cache_k, cache_v = cached_attention(
                    q, k, v, positions, cache_k, cache_v, self.window
                )
                hk.set_state("k", cache_k)
                hk.set_state("v", cache_v)
            else:
                att = attention(q, k, v, positions, positions, self.window)
            x = x + dense(d, "out", depth_scale, bias=False)(att.reshape(b, length, d))
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

    model = hk.transform_with_state(lambda *a: Model(name="lm")(*a))

    def haiku_names(names):
        """The names Haiku gives modules named ``names`` made in order: a repeated name
        ``n`` becomes ``n``, ``n_1``, ``n_2``, ..."""
        seen: dict[str, int] = {}
        out = []
        for name in names:
            out.append(name if name not in seen else f"{name}_{seen[name]}")
            seen[name] = seen.get(name, 0) + 1
        return out

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
        return _zeros_like_shapes(jax.eval_shape(lambda: model.init(jax.random.key(0), *one)[1]))

    def to_loop(params):
        # Layer i's "lm/blocks/block/qkv" becomes "lm/block_i/qkv" ("lm/block/qkv" for i = 0):
        # the names Haiku gives the loop's blocks (with a pattern, "lm/blocks/local_1/qkv"
        # holds layers 1, 4, ..., which become "lm/local_1/qkv", "lm/local_3/qkv", ...).
        return stackwise.haiku.to_loop(params, stacked, loop_names)

    def loop_apply(loop_params, tokens):
        positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)
        return model.apply(loop_params, {}, None, tokens, positions, False, True)[0]

    return LM(init, apply, init_cache, to_loop, loop_apply)


# --------------------------------------------------------------------------
# Flax linen: an ordinary nn.Module block; `stackwise.flax.Stack` stacks it. The KV cache is
# the usual `cache` collection, which the Stack keeps per layer, stacked.


def build_flax(config: Config) -> LM:
    import functools

    import flax.linen as nn

    import stackwise.flax

    c = config
    d, hidden = c.d_model, c.mlp_ratio * c.d_model
    depth_scale = 1 / math.sqrt(2 * c.layers)

    def dense(d_out, name, scale=1.0, bias=True):
        kernel_init = nn.initializers.variance_scaling(scale**2, "fan_in", "normal")
        return nn.Dense(d_out, use_bias=bias, kernel_init=kernel_init, name=name)

    def norm(name):
        return nn.LayerNorm(epsilon=1e-5, use_fast_variance=False, name=name)

    class Block(nn.Module):
        window = c.seq_len  # how many positions back a query sees: all the context

        @nn.compact
        def __call__(self, x, positions, decode: bool):
            b, length, _ = x.shape
            qkv = dense(3 * d, "qkv", bias=False)(norm("ln1")(x))
            qkv = qkv.reshape(b, length, 3, c.heads, c.head_dim)
            q, k, v = rope(qkv[:, :, 0], positions), rope(qkv[:, :, 1], positions), qkv[:, :, 2]
            if decode:
                cache_k = self.variable("cache", "k", jnp.zeros, cache_shape(c, b))
                cache_v = self.variable("cache", "v", jnp.zeros, cache_shape(c, b))
                att, cache_k.value, cache_v.value = cached_attention(
                    q, k, v, positions, cache_k.value, cache_v.value, self.window
                )
            else:
                att = attention(q, k, v, positions, positions, self.window)
            x = x + dense(d, "out", depth_scale, bias=False)(att.reshape(b, length, d))
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
        return _zeros_like_shapes(shapes)

    def to_loop(params):  # "blocks" -> "blocks_0", "blocks_1", ... (layer i at position i % k)
        loop = stackwise.flax.to_loop({"params": params}, stacked, names="blocks_{}")
        return loop["params"]

    def loop_apply(loop_params, tokens):
        positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)
        return Model(loop=True).apply({"params": loop_params}, tokens, positions)

    return LM(init, apply, init_cache, to_loop, loop_apply)


# --------------------------------------------------------------------------
# Flax NNX: an ordinary nnx.Module block; `stackwise.nnx.Stack` stacks it. The KV cache is a
# pair of `nnx.Cache` variables of the block, stacked like every other variable.


def build_nnx(config: Config) -> LM:
    import functools

    from flax import nnx

    import stackwise.nnx

    c = config
    d, hidden = c.d_model, c.mlp_ratio * c.d_model
    depth_scale = 1 / math.sqrt(2 * c.layers)

    def dense(d_in, d_out, rngs, scale=1.0, bias=True):
        kernel_init = nnx.initializers.variance_scaling(scale**2, "fan_in", "normal")
        return nnx.Linear(d_in, d_out, use_bias=bias, kernel_init=kernel_init, rngs=rngs)

    def norm(rngs):
        return nnx.LayerNorm(d, epsilon=1e-5, use_fast_variance=False, rngs=rngs)

    class Block(nnx.Module):
        def __init__(self, rngs: nnx.Rngs, window: int = c.seq_len):
            self.window = window  # how many positions back a query sees (static)
            self.ln1, self.ln2 = norm(rngs), norm(rngs)
            self.qkv = dense(d, 3 * d, rngs, bias=False)
            self.out = dense(d, d, rngs, depth_scale, bias=False)
            self.up = dense(d, hidden, rngs)
            self.down = dense(hidden, d, rngs, depth_scale)

        def __call__(self, x, positions, decode: bool = False):
            b, length, _ = x.shape
            qkv = self.qkv(self.ln1(x)).reshape(b, length, 3, c.heads, c.head_dim)
            q, k, v = rope(qkv[:, :, 0], positions), rope(qkv[:, :, 1], positions), qkv[:, :, 2]
            if decode:  # the cache variables are set by `init_cache` below
                att, self.cache_k[...], self.cache_v[...] = cached_attention(
                    q, k, v, positions, self.cache_k[...], self.cache_v[...], self.window
                )
            else:
                att = attention(q, k, v, positions, positions, self.window)
            x = x + self.out(att.reshape(b, length, d))
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
            self.ln_f = norm(rngs)
            self.head = dense(d, c.vocab, rngs)

        def __call__(self, tokens, positions, decode: bool = False):
            x = self.blocks(self.embed(tokens), positions, decode)
            return self.head(self.ln_f(x))

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
    norm_split, head_split = abstract(norm), abstract(lambda rngs: dense(d, c.vocab, rngs))
    block_splits = [abstract(kind) for kind in kinds]

    def loop_apply(loop_params, tokens):
        positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)
        x = merge(embed_split, loop_params["embed"])(tokens)
        for i, layer in enumerate(loop_params["blocks"]):  # one separate Block per layer
            x = merge(block_splits[i % len(kinds)], layer)(x, positions)
        x = merge(norm_split, loop_params["ln_f"])(x)
        return merge(head_split, loop_params["head"])(x)

    return LM(init, apply, init_cache, to_loop, loop_apply)


# --------------------------------------------------------------------------
# Equinox: an ordinary eqx.Module block; `stackwise.equinox.Stack` stacks it. The KV cache is
# an explicit argument, `x, cache = block(x, cache, positions)` (Equinox's functional style;
# `with_state=True`), stacked per layer and written in place.


def build_equinox(config: Config) -> LM:
    import functools

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
            b, length, _ = x.shape
            qkv = per_token(self.qkv, per_token(self.ln1, x))
            qkv = qkv.reshape(b, length, 3, c.heads, c.head_dim)
            q, k, v = rope(qkv[:, :, 0], positions), rope(qkv[:, :, 1], positions), qkv[:, :, 2]
            if cache is None:
                att = attention(q, k, v, positions, positions, self.window)
            else:
                att, ck, cv = cached_attention(
                    q, k, v, positions, cache["k"], cache["v"], self.window
                )
                cache = {"k": ck, "v": cv}
            x = x + per_token(self.out, att.reshape(b, length, d))
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
