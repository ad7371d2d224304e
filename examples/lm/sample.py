"""Sampling with the stacked KV cache, the checks that come first, and the speeds.

Before every sample (trained, restored, loaded or fine-tuned) :func:`check_logits` checks the
stacked params in a Python loop's layout, KV-cached decoding and (the pure-JAX model) the
serving layout against the full forward, within a bound derived from the precision in use
(``precision.py``); then :func:`generate` samples token by token from the cache.
"""

from __future__ import annotations

if __name__ == "__main__":  # run by mistake: not a command
    raise SystemExit(f"{__file__} is a module of the example's package, not a command; the "
                     "command is: python examples/transformer_lm.py (--help lists its flags)")

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from lm import precision
from lm.data import encode


def generate(decode, lm, params, prompt: np.ndarray, length: int, key, temperature, emit=None):
    """Samples ``length`` tokens after ``prompt``, one at a time, with the KV cache.

    ``decode = jax.jit(lm.apply, donate_argnums=3)``. The prompt fills the cache in one call
    (prefill); after that each step feeds only the newest token: nothing is recomputed.
    ``emit(token_id)`` is called as each token is drawn. Returns the tokens and the decode
    speed in tokens/s (the steps after the first, which may compile).
    """
    window = jax.eval_shape(lambda: lm.init_cache(1))
    # [layers, batch, seq_len, heads, head_dim], or without `layers` in the serving layout
    window = jax.tree.leaves(window)[0].shape[-3]
    if not 1 <= len(prompt) <= window:
        raise ValueError(f"the prompt must have 1 to {window} characters, got {len(prompt)}.")
    cache = lm.init_cache(1)
    logits, cache = decode(params, jnp.asarray(prompt)[None], jnp.arange(len(prompt)), cache)
    out = []
    t0 = None
    for pos in range(len(prompt), len(prompt) + length):
        key, k = jax.random.split(key)
        token = jax.random.categorical(k, logits[0, -1] / temperature)
        out.append(int(token))
        if emit is not None:
            emit(out[-1])
        logits, cache = decode(params, token.reshape(1, 1), jnp.array([pos]), cache)
        if t0 is None:
            jax.block_until_ready(logits)
            t0 = time.perf_counter()
    jax.block_until_ready(logits)
    decode_tok_s = (length - 1) / (time.perf_counter() - t0) if length > 1 else float("nan")
    return np.array(out, dtype=np.int32), decode_tok_s


def prefill_speed(decode, lm, params, tokens: np.ndarray, repeats: int = 3) -> float:
    """Tokens/s of one prefill call filling an empty cache with ``tokens`` (best of repeats)."""
    tokens, positions = jnp.asarray(tokens)[None], jnp.arange(len(tokens))
    jax.block_until_ready(decode(params, tokens, positions, lm.init_cache(1)))  # compile
    best = float("inf")
    for _ in range(repeats):
        cache = jax.block_until_ready(lm.init_cache(1))
        t0 = time.perf_counter()
        jax.block_until_ready(decode(params, tokens, positions, cache))
        best = min(best, time.perf_counter() - t0)
    return len(tokens[0]) / best


def cached_vs_full(forward, decode, lm, params, tokens: np.ndarray, prefill: int,
                   decoded=None) -> float:
    """Max |logits| difference: the full forward vs prefill + token-by-token cached decoding
    (of ``decoded = (params, init_cache)``, another layout of the same params, if given)."""
    tokens = jnp.asarray(tokens)[None]
    full, _ = forward(params, tokens, jnp.arange(tokens.shape[1]))
    params, init_cache = decoded or (params, lm.init_cache)
    logits, cache = decode(params, tokens[:, :prefill], jnp.arange(prefill), init_cache(1))
    steps = [logits]
    for pos in range(prefill, tokens.shape[1]):
        logits, cache = decode(params, tokens[:, pos : pos + 1], jnp.array([pos]), cache)
        steps.append(logits)
    return float(jnp.abs(jnp.concatenate(steps, axis=1) - full).max())


def decode_speed(decode, init_cache, params, tokens: np.ndarray) -> float:
    """Tokens/s of one-token decode calls after a prefill of ``tokens[:1]`` (best of the
    calls; the cache donated, as ``generate`` runs it)."""
    tokens = jnp.asarray(tokens)[None]
    _, cache = decode(params, tokens[:, :1], jnp.arange(1), init_cache(1))
    best = float("inf")
    for pos in range(1, tokens.shape[1]):
        t0 = time.perf_counter()
        logits, cache = decode(params, tokens[:, pos : pos + 1], jnp.array([pos]), cache)
        jax.block_until_ready(logits)
        best = min(best, time.perf_counter() - t0)
    return 1 / best


def check_logits(lm, config, params, window: np.ndarray, result: dict, log=print):
    """Checks the stacked ``params`` in the layout of a Python loop over separate blocks,
    KV-cached decoding (a prefill of half the ``window``, then token by token) and, if
    ``lm.serve``, cached decoding in the serving layout, against the full forward on
    ``window``: each within :func:`precision.logits_bound` (at ``'highest'`` where the
    backend's matmuls would be coarser than float32). Adds the differences and the bound to
    ``result``; returns ``lm.serve(params)``, or None.

    Raises:
      RuntimeError: a comparison exceeds the bound (its name, value and the bound's making).
    """
    context, at = precision.check_precision()
    served = lm.serve(params) if lm.serve is not None else None
    half = len(window) // 2
    with context:  # (the programs traced here are the checks' own)
        forward = jax.jit(lm.apply)  # the full forward pass (no cache)
        decode = jax.jit(lm.apply, donate_argnums=(3,))  # with the KV cache, updated in place
        full, _ = forward(params, window[None], jnp.arange(len(window)))
        loop = jax.jit(lm.loop_apply)(lm.to_loop(params), window[None])
        result["loop_diff"] = float(jnp.abs(loop - full).max())
        result["cache_diff"] = cached_vs_full(forward, decode, lm, params, window, half)
        if served is not None:  # the serving layout: per-layer buffers of weights and caches
            result["serving_diff"] = cached_vs_full(forward, decode, lm, params, window, half,
                                                    served)
    bound = precision.logits_bound(config, float(jnp.abs(full).max()), at)
    result["logits_bound"] = bound.tolerance
    log(f"in the layout of a Python loop over {config.layers} separate blocks, the params give "
        f"the stack's logits to {result['loop_diff']:.1e}")
    log(f"KV-cached decoding matches the full forward to {result['cache_diff']:.1e}")
    if served is not None:
        log(f"in the serving layout ({config.layers} per-layer buffers of weights and KV "
            f"caches), cached decoding matches the full forward to {result['serving_diff']:.1e}")
    log(f"each within its bound, {bound.describe()}")
    for name in ("loop_diff", "cache_diff", "serving_diff")[: 2 + (served is not None)]:
        if not result[name] <= bound.tolerance:
            raise RuntimeError(f"{name} = {result[name]:.2e} exceeds its bound, "
                               f"{bound.describe()}")
    return served


def check_and_sample(lm, config, params, args: argparse.Namespace, chars: str, val,
                     result: dict, log=print) -> None:
    """Checks the model (:func:`check_logits`), then samples (:func:`generate`), in the
    serving layout if the model has one: every run's sample, fine-tuned or not, comes from
    here. Adds what it measured to ``result``."""
    window = np.asarray(val[0][0])
    served = check_logits(lm, config, params, window, result, log)
    decode = jax.jit(lm.apply, donate_argnums=(3,))  # with the KV cache, updated in place
    if served is not None:
        scanned = decode_speed(decode, lm.init_cache, params, window)
        params, init_cache = served
        lm = lm._replace(init_cache=init_cache)
        fast = decode_speed(decode, init_cache, params, window)
        result["decode_best_tokens_per_s"] = {"stacked": scanned, "serving": fast}
        log(f"the serving layout decodes {fast:,.0f} tokens/s (best call; the stacked layout: "
            f"{scanned:,.0f}); the sample comes from it")

    # Sample, printing each character as it comes.
    prompt = encode(chars, args.prompt)
    log(f"\n--- sample ({args.sample_len} characters, temperature {args.temperature}) ---")
    sys.stdout.write(args.prompt)

    def emit(token: int) -> None:
        sys.stdout.write(chars[token])
        sys.stdout.flush()

    key = jax.random.key(args.seed + 3)
    sample, result["decode_tokens_per_s"] = generate(
        decode, lm, params, prompt, args.sample_len, key, args.temperature, emit
    )
    result["prefill_tokens_per_s"] = prefill_speed(decode, lm, params, window)
    log(
        f"\n--- prefill {result['prefill_tokens_per_s']:,.0f} tokens/s (one {len(window)}-token "
        f"prompt), decode {result['decode_tokens_per_s']:,.0f} tokens/s (one token per call)"
    )
    result["sample"] = args.prompt + "".join(chars[t] for t in sample)
