"""One character-level transformer LM, written five ways: pure JAX (here, :func:`build_jax`),
Haiku, Flax linen, NNX and Equinox (``haiku_model.py``, ``flax_model.py``, ``nnx_model.py``,
``equinox_model.py``: each a ``build(config)``).

Each returns an :class:`LM`, a set of pure functions over a plain pytree of params, so that
the package trains, checkpoints and samples every framework with the same code. In each
framework the ``config.layers`` blocks are ONE stackwise stack: their params have a leading
layer axis and run as one scanned layer. In pure JAX that is ``stackwise.stack(block_init,
block_apply, layers)`` in :func:`build_jax`, and ``blocks.apply(params["blocks"], cache, x,
positions)`` runs all the layers; its ``loop_apply`` is the Python loop the stack replaces.

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

if __name__ == "__main__":  # run by mistake: not a command
    raise SystemExit(f"{__file__} is a module of the example's package, not a command; the "
                     "command is: python examples/transformer_lm.py (--help lists its flags)")

import dataclasses
import importlib
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
    def hidden(self) -> int:
        """The MLP's width."""
        return self.mlp_ratio * self.d_model

    @property
    def depth_scale(self) -> float:
        """The residual branches' output projections start small: 1 / sqrt(2 * layers)."""
        return 1 / math.sqrt(2 * self.layers)

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
    cos, sin = (f(angles)[None, :, None, :].astype(x.dtype) for f in (jnp.cos, jnp.sin))
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


def self_attention(qkv, heads: int, positions, window: int, cache=None):
    """A block's attention, from its fused projection ``qkv [b, length, 3 * d]``: split into
    ``heads``, queries and keys rotated (RoPE), each query attending to the ``window``
    positions up to its own, among the tokens themselves (``cache=None``: training) or in the
    cache they are written into (``cache = {"k", "v"}``: decoding). Returns ``(out [b,
    length, d], cache)``; every framework's block calls it."""
    b, length, width = qkv.shape
    qkv = qkv.reshape(b, length, 3, heads, width // (3 * heads))
    q, k, v = rope(qkv[:, :, 0], positions), rope(qkv[:, :, 1], positions), qkv[:, :, 2]
    if cache is None:
        out = attention(q, k, v, positions, positions, window)
    else:
        out, cache_k, cache_v = cached_attention(q, k, v, positions, cache["k"], cache["v"],
                                                 window)
        cache = {"k": cache_k, "v": cache_v}
    return out.reshape(b, length, width // 3), cache


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


def build(framework: str, config: Config) -> LM:
    """The LM in ``framework`` (one of :data:`FRAMEWORKS`): :func:`build_jax`, or the
    ``build`` of ``lm.<framework>_model`` (imported here: a framework loads only when asked)."""
    if framework not in FRAMEWORKS:
        raise ValueError(f"unknown framework {framework!r}; choose one of {', '.join(FRAMEWORKS)}.")
    if framework == "jax":
        return build_jax(config)
    return importlib.import_module(f"lm.{framework}_model").build(config)


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
    logits = logits.astype(jnp.float32)  # (bfloat16 compute: the loss in float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def block_init(config: Config):
    """A pure-JAX block's init: ``params, state = init(key)`` (its state, the KV cache, comes
    from ``init_cache``)."""
    d, hidden, depth_scale = config.d_model, config.hidden, config.depth_scale

    def init(key):
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

    return init


def block_apply(config: Config, window: int):
    """A pure-JAX block that attends ``window`` positions back: ``x, cache = apply(p, cache,
    x, positions)``; cache may be None."""

    def apply(p, cache, x, positions):
        qkv = _ln(p["ln1"], x) @ p["qkv"]
        att, cache = self_attention(qkv, config.heads, positions, window, cache)
        x = x + att @ p["out"]
        h = _ln(p["ln2"], x) @ p["up"]
        h = jax.nn.gelu(h + _row(p["up_bias"], h)) @ p["down"]
        return x + h + _row(p["down_bias"], h), cache

    return apply


def build_jax(config: Config, *, adapted: bool = False) -> LM:
    """The pure-JAX LM. ``adapted=True``: its blocks also take ``stackwise.lora.attach(base,
    adapters)`` params, the base float or quantized (``stackwise.quant``): each block is
    ``stackwise.lora.wrap``-ped, so it builds its own float weights from its own slice of the
    base and the adapters, inside the scan (``finetune.py`` fine-tunes with it)."""
    c = config
    d = c.d_model

    # One block function per pattern position (its attention window); layer i runs
    # applies[i % k].
    applies = [block_apply(c, window) for window in c.windows]
    if adapted:  # (plain params pass through a wrapped block unchanged)
        applies = [stackwise.lora.wrap(f, with_state=True) for f in applies]
    k = len(applies)

    # The blocks: one stack (a pattern stack for k > 1). Its state is the per-layer KV cache
    # (None when training).
    blocks = stackwise.stack(
        one_or_list(c, [block_init(c)] * k),
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
        served = stackwise.to_serving(params, "blocks", pattern=pattern)
        return served, lambda batch: stackwise.to_serving(init_cache(batch), pattern=pattern)

    return LM(init, apply, init_cache, to_loop, loop_apply, serve)


def zeros_like_shapes(shapes):
    """Zeros of the shapes and dtypes of a tree of ``jax.ShapeDtypeStruct`` (an empty cache)."""
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
