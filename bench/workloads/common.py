"""What every workload module shares: the :class:`Case` it returns, the skeleton of a
framework's rows (:func:`framework_cases`) and the pieces of the blocks."""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import stackwise
from stackwise.bench.config import BenchConfig

#: ``build(n) -> (params, x, loss)``, with ``loss(params, x) -> scalar``; for a block with
#: state (``Block.state``: ``decode``, ``prefill``), ``build(n) -> (params, state, x, step)``
#: with ``step(params, state, x) -> (y, new_state)``, jitted with ``state`` donated.
Build = Callable[[int], tuple]

#: The reference rows of every block: each row's ``/loop`` and ``/scan`` ratios are to these.
LOOP = "loop (separate params)"
SCAN = "lax.scan (hand)"

#: The remat settings every framework's tool and adapter rows run at, in table order:
#: none, the default policy (``stackwise.DEFAULT_REMAT``), full per-layer remat.
REMATS = ("off", "dots", "layer")


class Case(NamedTuple):
    """One variant (one row per depth): ``build(n)`` makes its params, input and loss."""

    name: str
    framework: str  # jax | haiku | flax | nnx
    remat: str  # off | dots | layer | nested
    build: Build
    tool: str = ""  # the row this one's /tool ratios are to (an adapter's tool, a control)


def tool_policy(remat: str) -> Callable | None:
    """The ``policy`` a tool's remat (``hk.remat``, ``nn.remat``, ``nnx.remat``) gets for
    ``remat`` ``"dots"`` (stackwise's default policy) or ``"layer"`` (none: full remat)."""
    return stackwise.DEFAULT_REMAT if remat == "dots" else None


def stack_remat(remat: str) -> Any:
    """The ``remat=`` an adapter's ``Stack`` gets for ``remat`` ``"off"``, ``"dots"``,
    ``"layer"``: ``False``, ``stackwise.DEFAULT_REMAT`` (its default), ``True``."""
    return {"off": False, "dots": stackwise.DEFAULT_REMAT, "layer": True}[remat]


def framework_cases(
    framework: str,
    *,
    loop: tuple[str, Build],
    tools: dict[str, str],
    tool: Callable[[str], Build],
    adapter: str,
    stack: Callable[..., Build],
    notes: list[str],
    remats: Sequence[str] = REMATS,
    unrolled: bool = False,
) -> list[Case]:
    """A framework's rows, the same for every framework, in this order:

    1. ``loop``: ``(name, build)`` of a Python loop over n blocks, in the framework.
    2. The framework's own tool (``hk.layer_stack``, ``nn.scan``...) at each remat of
       ``remats`` (:data:`REMATS`; ``("off",)`` for a block without ``grad``, where
       remat changes nothing): ``tools`` maps the remat to the row's name, ``tool(remat)``
       gives its build. The ``off`` row runs a second time as ``"<name> (control)"``,
       compared with the first: its ratios are the run's noise floor.
    3. The adapter, module ``adapter`` (e.g. ``"stackwise.haiku"``), rows named
       ``"<adapter>.Stack"``, ``"... default"`` and ``"... remat"``: ``stack(module,
       remat)`` gives the build, and each row is compared with the tool's row of the same
       remat. An adapter that cannot be imported is skipped with a note.
    4. With ``unrolled``: the adapter's Stack at ``unroll=True`` without remat, row
       ``"<adapter>.Stack unroll=True"`` (``stack(module, "off", unroll=True)``; a Python
       loop writing each layer's slice: what ``Stacked.decode`` runs), against the tool.
    """
    off = tools["off"]
    cases = [
        Case(loop[0], framework, "off", loop[1]),
        Case(off, framework, "off", tool("off")),
        Case(f"{off} (control)", framework, "off", tool("off"), tool=off),
        *(Case(tools[r], framework, r, tool(r)) for r in remats if r != "off"),
    ]
    try:
        module = importlib.import_module(adapter)
    except ImportError as e:
        notes.append(f"{adapter}: not importable ({e}); its rows skipped.")
        return cases
    name = f"{adapter}.Stack"
    names = {"off": name, "dots": f"{name} default", "layer": f"{name} remat"}
    cases += [Case(names[r], framework, r, stack(module, r), tool=tools[r]) for r in remats]
    if unrolled:
        cases.append(Case(f"{name} unroll=True", framework, "off",
                          stack(module, "off", unroll=True), tool=off))
    return cases


def adapter_or_note(adapter: str, block: str, notes: list[str]) -> Any:
    """The adapter module, or None with a note: for a block whose rows all take their
    values from the adapter's params (``decode``, ``prefill``), so that every row of a
    framework computes the same thing and can be checked against its loop."""
    try:
        return importlib.import_module(adapter)
    except ImportError as e:
        notes.append(
            f"{adapter}: not importable ({e}); the {block} rows of its framework "
            "(whose params are the Stack's, converted) are skipped."
        )
        return None


# ==========================================================================
# Pieces of the blocks.


def mean_square(y: jax.Array) -> jax.Array:
    """The loss of every variant: ``mean(y**2)``."""
    return jnp.mean(jnp.square(y))


def device(tree: Any) -> Any:
    """numpy -> device arrays without running a jax op (so without compiling one)."""
    return jax.tree.map(jax.device_put, tree)


def in_dtype(build: Build, dtype: str) -> Build:
    """``build`` of a block with state, its floating params, state and input cast to
    ``dtype`` on the device, so that every layer computes in it.

    The decode and prefill blocks make their state in ``cfg.dec_dtype`` already
    (:func:`zero_cache`, the frameworks' blocks), so a leaf in ``dtype`` is kept as it is;
    a floating leaf in another is cast one at a time, and a state array deleted once its
    cast is made (the state is the row's own: every step donates it). Params and input are
    not deleted (a build may share them with others: the input is the same for every row),
    only dropped with the build's own references. The casts compile one small program per
    shape, at build time (a cold compile clears JAX's caches first)."""
    target = jnp.dtype(dtype)

    def cast(tree: Any, owned: bool) -> Any:
        def one(a: Any) -> Any:
            if not jnp.issubdtype(a.dtype, jnp.floating) or a.dtype == target:
                return a
            out = jax.block_until_ready(jnp.asarray(a).astype(target))
            if owned and isinstance(a, jax.Array):
                a.delete()
            return out

        return jax.tree.map(one, tree)

    def built(n: int) -> tuple:
        params, state, x, step = build(n)
        return cast(params, False), cast(state, True), cast(x, False), step

    return built


def zero_cache(cfg: BenchConfig, n: int, per_layer: bool = False) -> Any:
    """The decode and prefill blocks' KV cache of ``n`` layers: zeros in ``cfg.dec_dtype``,
    made on the device, so the host never holds it (made in numpy and put on a v5e, then
    copied back to slice it, a cache of gigabytes ran the host's 40 GiB out). ``{"k", "v"}``
    stacked ``[n, *cache_shape(cfg)]``; with ``per_layer``, a list of n such dicts without
    the layer axis (the loops' and the serving layout's separate buffers)."""
    shape = cache_shape(cfg)
    if per_layer:
        return [{c: jnp.zeros(shape, cfg.dec_dtype) for c in "kv"} for _ in range(n)]
    return {c: jnp.zeros((n, *shape), cfg.dec_dtype) for c in "kv"}


def zeroed(state: Any) -> Any:
    """A framework's state from its ``init`` (which runs the forward, so writes the cache)
    as zeros of the same shapes and dtypes, made on the device one leaf at a time, each
    given array deleted once its zeros exist: the state is never held twice in full."""

    def one(a: jax.Array) -> jax.Array:
        out = jax.block_until_ready(jnp.zeros(a.shape, a.dtype))
        a.delete()
        return out

    return jax.tree.map(one, state)


def unstack(stacked: Any) -> list[Any]:
    """Per-layer params, as separate device arrays, sliced in numpy (no compiles)."""
    host = jax.tree.map(np.asarray, stacked)
    n = jax.tree.leaves(host)[0].shape[0]
    return [device(jax.tree.map(lambda a, i=i: a[i], host)) for i in range(n)]


def attend(qkv: jax.Array, heads: int) -> jax.Array:
    """Causal multi-head self-attention from fused ``qkv [batch, seq, 3 * d]``: the
    transformer block's attention, the same function in every framework."""
    b, t, three_d = qkv.shape
    q, k, v = (a.reshape(b, t, heads, three_d // 3 // heads) for a in jnp.split(qkv, 3, -1))
    logits = jnp.einsum("bthd,bshd->bhts", q, k) / math.sqrt(q.shape[-1])
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))[None, None]
    weights = jax.nn.softmax(jnp.where(causal, logits, jnp.finfo(logits.dtype).min), axis=-1)
    return jnp.einsum("bhts,bshd->bthd", weights, v).reshape(b, t, three_d // 3)


def python_loop(make_block: Callable, n: int, x: Any) -> Any:
    """``n`` blocks made by ``make_block()``, applied in a Python loop: the body of a Haiku
    or linen model written as the loop the stack replaces."""
    for _ in range(n):
        x = make_block()(x)
    return x


def initialised(init: Callable, apply: Callable, cfg: BenchConfig) -> tuple[Any, Any, Callable]:
    """``(params, x, loss)`` of a transformer model given as ``init(key, x) -> params`` and
    ``apply(params, x) -> y`` (a Haiku or linen model's ``init`` and ``apply``)."""
    x = transformer_input(cfg)
    return init(jax.random.key(cfg.seed), x), x, lambda p, h: mean_square(apply(p, h))


def transformer_input(cfg: BenchConfig) -> jax.Array:
    """The transformer block's input ``[tf_batch, tf_seq, tf_d]``, the same for every row."""
    rng = np.random.default_rng(cfg.seed + 1)
    return device(rng.standard_normal((cfg.tf_batch, cfg.tf_seq, cfg.tf_d), np.float32))


# ==========================================================================
# The decode and prefill blocks: one attention layer reading and writing a KV cache.


def decode_attend(
    qkv: jax.Array, k_cache: jax.Array, v_cache: jax.Array, pos: jax.Array, heads: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Writes the keys and values of the tokens ``qkv [batch, t, 3 * d]`` into the caches
    ``[batch, length, heads, d // heads]`` at positions ``pos, ..., pos + t - 1`` (with
    :func:`jax.lax.dynamic_update_slice_in_dim`), then lets each token attend to the
    positions up to its own. Returns ``(y [batch, t, d], k_cache, v_cache)``: the decode
    and prefill blocks' attention, the same function in every framework."""
    b, t, three_d = qkv.shape
    length = k_cache.shape[1]
    q, k, v = (a.reshape(b, t, heads, three_d // 3 // heads) for a in jnp.split(qkv, 3, -1))
    k_cache = jax.lax.dynamic_update_slice_in_dim(k_cache, k.astype(k_cache.dtype), pos, 1)
    v_cache = jax.lax.dynamic_update_slice_in_dim(v_cache, v.astype(v_cache.dtype), pos, 1)
    logits = jnp.einsum("bthd,bshd->bhts", q, k_cache) / math.sqrt(q.shape[-1])
    seen = jnp.arange(length)[None, :] <= (pos + jnp.arange(t))[:, None]
    logits = jnp.where(seen[None, None], logits, jnp.finfo(logits.dtype).min)
    weights = jax.nn.softmax(logits, axis=-1)
    y = jnp.einsum("bhts,bshd->bthd", weights, v_cache).reshape(b, t, three_d // 3)
    return y, k_cache, v_cache


def cache_shape(cfg: BenchConfig) -> tuple[int, int, int, int]:
    """One layer's key (or value) cache: ``[dec_batch, dec_cache, dec_heads, head size]``."""
    return cfg.dec_batch, cfg.dec_cache, cfg.dec_heads, cfg.dec_d // cfg.dec_heads


def decode_input(cfg: BenchConfig, tokens: int, pos: int) -> tuple[jax.Array, jax.Array]:
    """``x = (h [dec_batch, tokens, dec_d], pos)`` of a decode or prefill step: the
    embedded tokens and the cache position of the first, the same for every row."""
    rng = np.random.default_rng(cfg.seed + 2)
    h = rng.standard_normal((cfg.dec_batch, tokens, cfg.dec_d), np.float32)
    return device((h, np.int32(pos)))
