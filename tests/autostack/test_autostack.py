"""stackwise.autostack on pure-function loop models: outputs and gradients equal the loop's,
the params convert bitwise, and the program is flat in depth."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _models import llama, llama_block, llama_params, mlp, mlp_params
from _trees import assert_trees_bitwise, assert_trees_close
from hypothesis import given, settings
from hypothesis import strategies as st

import stackwise

KEY = jax.random.key(0)
X = jax.random.normal(jax.random.key(1), (4, 8))
POLICY = jax.checkpoint_policies.dots_with_no_batch_dims_saveable


def check_loop(fn, params, *args, n=None, period=None, **options):
    """autostack(fn) against fn: outputs and the grads of every param leaf, jitted; returns f."""
    stacked, f = stackwise.autostack(fn, params, *args, **options)
    if isinstance(n, tuple):  # a count per run
        assert tuple(r.n for r in f.runs) == n, f.runs
    elif n is not None:
        assert f.found.n == n, f.found
    if period is not None:
        assert f.found.period == period, f.found

    def loss(g, p):
        return sum(jnp.sum(jnp.sin(leaf)) for leaf in jax.tree.leaves(g(p, *args)))

    assert_trees_close(jax.jit(f)(stacked, *args), jax.jit(fn)(params, *args))
    got = f.unstack(jax.jit(jax.grad(lambda p: loss(f, p)))(stacked))
    assert_trees_close(got, jax.jit(jax.grad(lambda p: loss(fn, p)))(params))
    return f


@pytest.mark.parametrize("remat", [None, True, POLICY])
@pytest.mark.parametrize("n", [2, 5])
def test_mlp_matches_the_loop(n, remat):
    f = check_loop(mlp, mlp_params(KEY, n), X, n=n, remat=remat)
    assert f.found.params == 3 and f.found.start == 0


@pytest.mark.slow  # (the fast tier's Llama: test_unseen_models.py's pure-function one)
@pytest.mark.parametrize("n", [4, 5, 6])
def test_llama_matches_the_loop(n):
    tokens = jnp.array([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]])
    check_loop(llama, llama_params(KEY, n), tokens, n=n)


def test_jitted_blocks_are_one_equation_each():
    block = jax.jit(llama_block)

    def model(params, x):
        for p in params["layers"]:
            x = block(p, x)
        return x

    params = llama_params(KEY, 4)
    f = check_loop(model, params, jax.random.normal(KEY, (2, 5, 8)), n=4, period=1)
    assert f.found.params == 9


def test_a_jitted_model_is_looked_into():
    f = check_loop(jax.jit(mlp), mlp_params(KEY, 3), X, n=3)
    assert f.found.equations > 1


def test_fold_in_layer_index_becomes_a_scanned_input():
    def model(params, x, key):
        for i, p in enumerate(params["layers"]):
            noise = jax.random.normal(jax.random.fold_in(key, i), x.shape)
            x = x + jnp.tanh(x @ p["w"] + p["b"]) @ p["v"] * (i + 0.5) + 0.01 * noise
        return x @ params["head"]

    f = check_loop(model, mlp_params(KEY, 4), X, jax.random.key(7), n=4)
    assert len(f._plans[0].scanned) == 2  # the fold_in index and the per-layer scale
    jaxpr = str(jax.make_jaxpr(f)(f.stack(mlp_params(KEY, 4)), X, jax.random.key(7)))
    assert jaxpr.count("random_fold_in") == 1


def test_a_period_of_two_different_blocks():
    def model(params, x):
        for i, p in enumerate(params["layers"]):
            if i % 2 == 0:
                x = x + jnp.tanh(x @ p["w"] + p["b"]) @ p["v"]
            else:
                x = x * jax.nn.sigmoid(p["b"][:, :8]) + jnp.cos(x @ p["w"]) @ p["v"]
        return x @ params["head"]

    f = check_loop(model, mlp_params(KEY, 6), X, n=3)
    assert f.found.period > 5 and f.found.params == 6


def test_several_carries_and_per_layer_outputs():
    def model(params, x):
        hidden, total = [], 0.0
        for p in params["layers"]:
            x = x + jnp.tanh(x @ p["w"] + p["b"]) @ p["v"]
            total = total + jnp.mean(x**2)
            hidden.append(x)
        return x @ params["head"], total, hidden

    f = check_loop(model, mlp_params(KEY, 4), X, n=4)
    assert f._plans[0].ys  # the hidden states of every block but the last leave as stacked outputs


def test_unstack_of_stack_is_bitwise_every_leaf():
    params = llama_params(KEY, 5)
    tokens = jnp.array([[1, 2, 3]])
    stacked, f = stackwise.autostack(llama, params, tokens)
    assert_trees_bitwise(f.unstack(stacked), params)
    fresh = llama_params(jax.random.key(3), 5)
    assert_trees_bitwise(f.unstack(f.stack(fresh)), fresh)
    assert stacked["blocks"]["['layers'][0]['q']"].shape == (5, 8, 8)
    assert stacked["rest"]["layers"][3] == dict.fromkeys(params["layers"][3])
    assert stacked["rest"]["embed"] is params["embed"]


def test_composes_with_vmap_and_grad():
    params = mlp_params(KEY, 3)
    stacked, f = stackwise.autostack(mlp, params, X)
    xs = jax.random.normal(KEY, (5, 4, 8))
    assert_trees_close(jax.vmap(f, (None, 0))(stacked, xs), jax.vmap(mlp, (None, 0))(params, xs))
    got = jax.grad(lambda x: f(stacked, x).sum())(X)
    assert_trees_close(got, jax.grad(lambda x: mlp(params, x).sum())(X))


def _hlo_size(fn, params, x):
    return len(jax.jit(fn).lower(params, x).as_text())


def test_the_program_is_flat_in_depth():
    tokens = jnp.array([[1, 2, 3, 4]])
    sizes, loops = [], []
    for n in (4, 16):
        params = llama_params(KEY, n)
        stacked, f = stackwise.autostack(llama, params, tokens)
        sizes.append(_hlo_size(f, stacked, tokens))
        loops.append(_hlo_size(llama, params, tokens))
    assert sizes[1] < 1.1 * sizes[0], sizes
    assert loops[1] > 2.5 * loops[0], loops


def test_the_program_is_the_stacks_size_at_every_depth():
    """The lowered ``jit(grad(loss))`` of the autostacked loop is the size of a hand-written
    ``stackwise.stack`` of the same block (no remat, as autostack's default), and neither
    grows from 4 to 16 layers: no benchmark, the programs' text only."""
    x = jax.random.normal(KEY, (2, 5, 8))

    def loop(params, x):
        for p in params["layers"]:
            x = llama_block(p, x)
        return jnp.mean(x**2)

    sizes = {}
    for n in (4, 16):
        params = {"layers": llama_params(KEY, n)["layers"]}
        stacked, f = stackwise.autostack(loop, params, x, n=n)
        layers = stackwise.stack(None, llama_block, n, remat=False)
        by_stack = stackwise.stack_layers(params["layers"])

        def with_stack(ps, x, layers=layers):
            return jnp.mean(layers.apply(ps, x) ** 2)

        sizes[n] = (len(jax.jit(jax.grad(f)).lower(stacked, x).as_text()),
                    len(jax.jit(jax.grad(with_stack)).lower(by_stack, x).as_text()))
    (auto4, stack4), (auto16, stack16) = sizes[4], sizes[16]
    assert abs(auto16 - auto4) <= 0.03 * auto4, sizes  # flat in depth
    assert abs(stack16 - stack4) <= 0.03 * stack4, sizes
    # the stack's size (measured: 62,941 and 63,332 chars against 62,656 and 63,047; the
    # loop's 77,612 and 309,356)
    assert abs(auto4 - stack4) <= 0.05 * stack4 and abs(auto16 - stack16) <= 0.05 * stack16


@pytest.mark.slow  # (8 examples, each tracing and compiling a loop and its scan: ~20 s)
@settings(max_examples=8, deadline=None)
@given(n=st.integers(2, 6), d=st.sampled_from([4, 8]), w=st.integers(1, 12))
def test_mlp_property(n, d, w):
    params = mlp_params(jax.random.key(n * w), n, d=d, widths=[w] * n)
    x = jnp.ones((2, d)) * 0.3
    check_loop(mlp, params, x, n=n)
    np.testing.assert_equal(stackwise.autostack(mlp, params, x)[1].found.n, n)


def test_blocks_inside_checkpoint_and_custom_vjp_calls():
    @jax.custom_vjp
    def clip_grad(x):
        return x

    clip_grad.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -1.0, 1.0),))

    @jax.checkpoint
    def block(p, x):
        return clip_grad(x + jnp.tanh(x @ p["w"] + p["b"]) @ p["v"])

    def model(params, x):
        for p in params["layers"]:
            x = block(p, x)
        return x @ params["head"]

    f = check_loop(model, mlp_params(KEY, 4), X, n=4, period=1)
    assert f.found.params == 3


# --------------------------------------------------------------------------
# A leaf several blocks read (weights tied across layers) is never stacked as a block's own:
# it stays in "rest", read by every block of the scan (or stacked at each call where blocks
# read different such leaves), and its gradient sums every block's, as the loop's does.


def test_one_leaf_read_by_every_block_is_shared_not_stacked():
    def model(params, x):  # ALBERT-style: one layer's weights applied n times
        p = params["layer"]
        for _ in range(4):
            x = x + jnp.tanh(x @ p["w"] + p["b"]) @ p["v"]
        return x @ params["head"]

    full = mlp_params(KEY, 1)
    params = {"layer": full["layers"][0], "head": full["head"]}
    stacked, f = stackwise.autostack(model, params, X)
    assert (f.found.n, f.found.params) == (4, 0) and stacked["blocks"] == {}
    assert len(f._plans[0].shared) == 3
    check_loop(model, params, X, n=4)
    assert_trees_bitwise(f.unstack(stacked), params)


def test_a_leaf_read_by_two_blocks_is_stacked_at_each_call_not_moved():
    def model(params, x):  # layers 2i and 2i+1 share their "w"; each has its own "v", "b"
        for i, p in enumerate(params["layers"]):
            w = params["layers"][i - i % 2]["w"]
            x = x + jnp.tanh(x @ w + p["b"]) @ p["v"]
        return x @ params["head"]

    params = mlp_params(KEY, 4)
    stacked, f = stackwise.autostack(model, params, X)
    assert (f.found.n, f.found.params) == (4, 2), f.found
    assert "['layers'][0]['w']" not in stacked["blocks"]
    assert stacked["rest"]["layers"][0]["w"] is params["layers"][0]["w"]
    assert len(f._plans[0].scanned) == 1  # (w0, w0, w2, w2), stacked when f runs
    check_loop(model, params, X, n=4)
    assert_trees_bitwise(f.unstack(stacked), params)


def test_a_block_leaf_read_after_the_run_too_stays_in_rest():
    def model(params, x):  # the last layer's "w" also read by the head (a tie)
        for p in params["layers"]:
            x = x + jnp.tanh(x @ p["w"] + p["b"]) @ p["v"]
        return x @ params["layers"][-1]["w"]

    params = mlp_params(KEY, 4)
    stacked, f = stackwise.autostack(model, params, X)
    assert f.found.n == 4 and "['layers'][0]['w']" not in stacked["blocks"]
    check_loop(model, params, X, n=4)
    assert_trees_bitwise(f.unstack(stacked), params)


# --------------------------------------------------------------------------
# A decode step: each block writes the new token's key and value into its own layer's cache
# (`dynamic_update_slice`) and returns it. The caches are per-block inputs stacked when `f`
# runs (or, where they are in the params, stacked param leaves) and per-block outputs
# leaving the scan stacked; only the activation is carried.

B, T, D = 2, 8, 8


def decode(params, caches, x, pos):
    """``x [B, 1, D]``, ``caches``: per layer ``{"k", "v"}`` of ``[B, T, D]``."""
    new = []
    for p, c in zip(params["layers"], caches):
        k = jax.lax.dynamic_update_slice(c["k"], x @ p["wk"], (0, pos, 0))
        v = jax.lax.dynamic_update_slice(c["v"], x @ p["wv"], (0, pos, 0))
        scores = jnp.einsum("bqd,bkd->bqk", x @ p["wq"], k) / D**0.5
        scores = jnp.where(jnp.arange(T)[None, None, :] <= pos, scores, -1e9)
        x = x + jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(scores, -1), v) @ p["wo"]
        new.append({"k": k, "v": v})
    return x, new


def decode_params(n):
    keys = jax.random.split(KEY, n)
    return {"layers": [{w: jax.random.normal(kk, (D, D)) / D**0.5
                        for w, kk in zip(("wq", "wk", "wv", "wo"), jax.random.split(k, 4))}
                       for k in keys]}


def decode_caches(n):
    keys = jax.random.split(jax.random.key(2), n)
    return [{"k": jax.random.normal(k, (B, T, D)), "v": jnp.cos(jax.random.normal(k, (B, T, D)))}
            for k in keys]


def test_a_decode_step_updating_each_layers_kv_cache():
    n, x, pos = 4, jax.random.normal(jax.random.key(3), (B, 1, D)), jnp.int32(3)
    f = check_loop(decode, decode_params(n), decode_caches(n), x, pos, n=n)
    assert f.found.params == 4 and len(f._plans[0].scanned) == 2  # the k and v caches
    assert len(f._plans[0].carry) == 1 and len(f._plans[0].ys) == 2  # x carried; caches stacked out


def test_a_kv_cache_among_the_params_is_stacked_with_them():
    n, x, pos = 4, jax.random.normal(jax.random.key(3), (B, 1, D)), jnp.int32(5)

    def step(variables, x, pos):  # as a flax "cache" collection beside the "params"
        return decode({"layers": variables["params"]}, variables["cache"], x, pos)

    variables = {"params": decode_params(n)["layers"], "cache": decode_caches(n)}
    stacked, f = stackwise.autostack(step, variables, x, pos)
    assert f.found.params == 6 and stacked["blocks"]["['cache'][0]['k']"].shape == (n, B, T, D)
    y, caches = jax.jit(f)(stacked, x, pos)
    want_y, want_caches = step(variables, x, pos)
    assert_trees_close((y, caches), (want_y, want_caches))
    assert_trees_bitwise(f.unstack(stacked), variables)
