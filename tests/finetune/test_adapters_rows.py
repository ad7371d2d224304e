"""Multi-LoRA serving: `attach(base, stack_adapters([...]), rows=idx)` runs row i of x with
adapter idx[i] (-1: the base alone) on one base.

Each row equals the same model with just that adapter attached, run on that row alone (and a
-1 row equals the base alone): outputs, and the adapters' gradients of a loss summed over the
rows against a per-row loop of single-adapter runs; on a float, int8, int4 or nf4 base, scanned
or unrolled, in a pattern, on the framework Stacks, and decoding with a per-row KV cache under
jit with the cache donated, through `Stacked.apply` and `Stacked.decode`. The base is read once
per token (one product of the whole batch with each base weight), no per-row weight is built,
and the cache is still written in place (no scatter: a dynamic_update_slice of the batch's
rows)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _frameworks import FRAMEWORKS
from _reference import trained
from _trees import assert_trees_close
from hypothesis import given, settings
from hypothesis import strategies as st

import stackwise
from stackwise._upstream import jax as jax_ties

D, N, R = 8, 3, 2
KEY = jax.random.key(0)


def mlp(p, x):
    """Adapted weights as `@`, as an einsum's first operand (`jnp.einsum` passes it to
    `dot_general` as the right one), and transposed."""
    h = jnp.tanh(x @ p["u"])
    return x + jnp.einsum("oh,bth->bto", p["v"], h) + h @ p["o"].T


def gate(p, x):
    return x * jax.nn.sigmoid(jnp.dot(x, p["u"]) @ p["v"].T)


def attend(p, cache, x, pos):
    """One decoding step of a row-batched attention: x (b, 1, D), cache (b, S, D)."""
    q, k = x @ p["u"], jnp.einsum("btd,de->bte", x, p["v"])
    cache = jax.lax.dynamic_update_slice_in_dim(cache, k, pos, 1)
    mask = jnp.arange(cache.shape[1]) <= pos
    s = jnp.where(mask, jnp.einsum("btd,bsd->bts", q, cache), -1e9)
    return x + jnp.einsum("bts,bsd->btd", jax.nn.softmax(s, -1), cache) @ p["o"].T, cache


def _normal(seed, shape):
    """Test data drawn by NumPy (JAX compiles its sampler anew for each shape)."""
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32))


def _base(kind=None, n=N):
    base = {name: _normal(s, (n, D, D)) / D**0.5 for s, name in enumerate("uvo")}
    return base if kind is None else stackwise.quant.quantize(base, kind)


def _each(base, g):
    """g different adapters of one base, as if trained."""
    return [trained(stackwise.lora.init(jax.random.key(s), base, rank=R), seed=s)
            for s in range(g)]


def _alone(base, each, r):
    """The model with just adapter r attached (the base alone for r = -1)."""
    return base if r < 0 else stackwise.lora.attach(base, each[r])


def _grads_of_loop(run, base, each, rows, x):
    """The adapters' gradients of sum_i sum(sin(row i run alone with its adapter))."""

    def loss(each):
        return sum(jnp.sum(jnp.sin(run(_alone(base, each, r), x[i:i + 1])))
                   for i, r in enumerate(rows) if r >= 0)

    grads = jax.jit(jax.grad(loss))(each)  # (one program, not a scan compiled per row)
    return stackwise.lora.stack_adapters(grads)


def _assert_rows_are_each_alone(layers, base, each, rows, x, grads=True):
    rows = list(rows)
    batch = stackwise.lora.stack_adapters(each)
    run = jax.jit(lambda b, idx, x: layers.apply(stackwise.lora.attach(base, b, rows=idx), x))
    y = run(batch, jnp.asarray(rows, jnp.int32), x)
    alone = jax.jit(layers.apply)  # (compiled once for the rows with an adapter, once without)
    for i, r in enumerate(rows):
        assert_trees_close(y[i], alone(_alone(base, each, r), x[i:i + 1])[0])
    if grads and any(r >= 0 for r in rows):
        got = jax.grad(lambda b: jnp.sum(jnp.sin(run(b, jnp.asarray(rows, jnp.int32), x))))(
            batch)
        assert_trees_close(got, _grads_of_loop(layers.apply, base, each, rows, x))


X = _normal(1, (5, 2, D))  # (rows, tokens, d)
ROWS = [2, -1, 0, 1, 2]


@pytest.mark.parametrize("kind", [None, "int8", "int4", "nf4"])
@pytest.mark.parametrize("unroll", [1, True])
def test_each_row_equals_its_adapter_alone(kind, unroll):
    base = _base(kind)
    layers = stackwise.lora.stack(mlp, N, unroll=unroll)
    _assert_rows_are_each_alone(layers, base, _each(base, 3), ROWS, X)


def left(p, x):
    """The adapted weights as `dot_general`'s left operand, each cast before its product."""
    f32 = jnp.float32
    h = jnp.tanh(x @ p["u"].astype(f32))
    t = jax.lax.dot_general(p["v"].astype(f32), h, (((1,), (2,)), ((), ())))  # (o, b, t)
    return x + jnp.moveaxis(t, 0, -1) @ p["o"].T.astype(f32)


@pytest.mark.parametrize("kind", [None, "int8"])
def test_a_weight_on_the_left_of_its_product_equals_its_adapter_alone(kind):
    base = _base(kind)
    _assert_rows_are_each_alone(stackwise.lora.stack(left, N), base, _each(base, 3), ROWS, X)


def test_a_weight_cast_before_its_product_gets_its_update_in_the_cast_dtype():
    """A bfloat16 base cast to float32 in the layer: each row computes x @ W + s (x @ a) @ b in
    float32, as the float32 merge of its adapter does. (Attached alone, the same adapter's
    outputs differ from both by about bfloat16's rounding, 5e-4 of their scale here: the
    reference is the float32 merge.)"""
    base = jax.tree.map(lambda a: a.astype(jnp.bfloat16), _base())
    each = _each(base, 3)
    layers = stackwise.lora.stack(left, N)
    run = jax.jit(lambda b, idx, x: layers.apply(stackwise.lora.attach(base, b, rows=idx), x))
    y = run(stackwise.lora.stack_adapters(each), jnp.asarray(ROWS, jnp.int32), X)
    wide = lambda tree: jax.tree.map(lambda a: a.astype(jnp.float32), tree)  # noqa: E731 (exact)
    alone = jax.jit(layers.apply)
    for i, r in enumerate(ROWS):
        merged = wide(base) if r < 0 else stackwise.lora.merge(wide(base), wide(each[r]))
        assert_trees_close(y[i], alone(merged, X[i:i + 1])[0])


@pytest.mark.parametrize("kind", [None, "int8"])
def test_more_adapters_than_rows_gather_each_rows_own(kind):
    """g > batch: each row's own a and b are gathered (side by side, g adapters would be
    read for fewer rows); the same values."""
    base = _base(kind)
    layers = stackwise.lora.stack(mlp, N)
    _assert_rows_are_each_alone(layers, base, _each(base, 4), [3, -1], X[:2])


def test_rows_in_a_pattern():
    """Positions of 3 and 2 layers, each attached with the same rows."""
    n = 5
    bases = (_base(n=3), _base("nf4", n=2))
    each = [tuple(_each(b, 3)[j] for b in bases) for j in range(3)]
    layers = stackwise.lora.stack([mlp, gate], n)
    batch = [stackwise.lora.stack_adapters([e[p] for e in each]) for p in range(2)]
    idx = jnp.asarray(ROWS)
    y = layers.apply(tuple(stackwise.lora.attach(bases[p], batch[p], rows=idx)
                           for p in range(2)), X)
    run = jax.jit(layers.apply)  # (compiled once for the rows with an adapter, once without)
    for i, r in enumerate(ROWS):
        alone = bases if r < 0 else tuple(
            stackwise.lora.attach(bases[p], each[r][p]) for p in range(2))
        assert_trees_close(y[i], run(alone, X[i:i + 1])[0])


@pytest.mark.slow  # (12 examples, each compiling: ~20 s)
@settings(max_examples=12, deadline=None)
@given(st.data())
def test_property_rows_against_a_loop(data):
    """Over the batch size, the number of adapters and the index vector (small sizes)."""
    g = data.draw(st.integers(1, 3), "adapters")
    rows = data.draw(st.lists(st.integers(-1, g - 1), min_size=1, max_size=4), "rows")
    base = _base()
    x = _normal(len(rows), (len(rows), 1, D))
    _assert_rows_are_each_alone(stackwise.lora.stack(mlp, N), base, _each(base, g), rows, x)


def test_traced_indices_outside_the_batch_run_the_base():
    """Under jit the indices are not checked: any outside [0, g) runs the base alone, as -1
    does, never another adapter (a clipping gather would give adapter g-1 or 0)."""
    base = _base()
    each = _each(base, 2)
    layers = stackwise.lora.stack(mlp, N)
    run = jax.jit(lambda idx, x: layers.apply(
        stackwise.lora.attach(base, stackwise.lora.stack_adapters(each), rows=idx), x))
    y = run(jnp.array([2, -5, 7, 1]), X[:4])
    for i in range(3):
        assert_trees_close(y[i], layers.apply(base, X[i:i + 1])[0])
    assert_trees_close(y[3], layers.apply(_alone(base, each, 1), X[3:4])[0])
    with pytest.raises(ValueError, match=r"outside \[-1, 2\)"):
        stackwise.lora.attach(base, stackwise.lora.stack_adapters(each), rows=[2, 0])


def _equations(jaxpr):
    """Every equation of a jaxpr and of the jaxprs in its equations' params."""
    for eqn in jaxpr.eqns:
        yield eqn
        for v in eqn.params.values():
            for sub in v if isinstance(v, (tuple, list)) else (v,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _equations(inner)


@pytest.mark.parametrize("g", [3, 6])  # side by side (g <= rows), gathered (g > rows)
def test_the_base_is_read_once_and_no_row_weight_is_built(g):
    """In the traced step each base weight meets the activations in one product for the
    whole batch (the weight never batched), and no (rows, in, out) weight exists."""
    base, b = _base(), 4
    batch = stackwise.lora.stack_adapters(_each(base, g))
    layers = stackwise.lora.stack(mlp, N, unroll=True)
    closed = jax.make_jaxpr(lambda idx, x: layers.apply(
        stackwise.lora.attach(base, batch, rows=idx), x))(jnp.zeros(b, jnp.int32), X[:b])
    eqns = list(_equations(closed.jaxpr))
    shapes = [tuple(v.aval.shape) for e in eqns for v in (*e.invars, *e.outvars)
              if hasattr(v, "aval")]
    assert (b, D, D) not in shapes  # no weight per row
    with_base = [e for e in eqns if e.primitive.name == "dot_general"
                 and any(tuple(v.aval.shape) == (D, D) for v in e.invars)]
    assert len(with_base) == 3 * N  # one product per weight and layer
    for e in with_base:  # ... of the whole batch
        other = next(v for v in e.invars if tuple(v.aval.shape) != (D, D))
        assert other.aval.shape[0] == b and not any(e.params["dimension_numbers"][1])


# --------------------------------------------------------------------------
# Decoding with a per-row KV cache.

S = 6


def _decode_alone(layers, params, x, steps):
    cache = jnp.zeros((N, 1, S, D))
    step = jax.jit(layers.apply)  # (one program for every position)
    for pos in range(steps):
        x, cache = step(params, cache, x, pos)
    return x, cache


@pytest.mark.parametrize(("kind", "g", "rows"), [
    (None, 3, ROWS), ("int8", 3, ROWS), (None, 4, [3, -1])])  # (the last: gathered)
@pytest.mark.parametrize("call", ["apply", "decode"])
def test_decode_with_a_kv_cache_per_row(kind, g, rows, call):
    base = _base(kind)
    each = _each(base, g)
    layers = stackwise.lora.stack(attend, N, with_state=True)
    ROWS = rows  # noqa: N806
    rows = jnp.asarray(ROWS)
    x = _normal(2, (len(ROWS), 1, D))
    step = jax.jit(
        lambda b, idx, cache, x, pos: getattr(layers, call)(
            stackwise.lora.attach(base, b, rows=idx), cache, x, pos),
        donate_argnums=2)
    batch, cache, y = stackwise.lora.stack_adapters(each), jnp.zeros((N, len(ROWS), S, D)), x
    for pos in range(3):
        y, cache = step(batch, rows, cache, y, pos)
    for i, r in enumerate(ROWS):
        want_y, want_cache = _decode_alone(layers, _alone(base, each, r), x[i:i + 1], 3)
        assert_trees_close((y[i], cache[:, i]), (want_y[0], want_cache[:, 0]))


@pytest.mark.parametrize("call", ["apply", "decode"])
def test_the_cache_is_written_in_place(call):
    """The row's `dynamic_update_slice` of its cache stays one of the batch's rows (vmap
    alone would write a scatter), so the stack writes the donated stacked cache in place."""
    base = _base()
    batch = stackwise.lora.stack_adapters(_each(base, 2))
    layers = stackwise.lora.stack(attend, N, with_state=True)
    step = jax.jit(lambda cache, x: getattr(layers, call)(
        stackwise.lora.attach(base, batch, rows=jnp.array([1, -1, 0])), cache, x, 0),
        donate_argnums=0)
    args = (jnp.zeros((N, 3, S, D)), jnp.ones((3, 1, D)))
    text = str(jax.make_jaxpr(step)(*args))
    assert "scatter" not in text and "dynamic_update_slice" in text
    compiled = step.lower(*args).compile().as_text()
    assert "input_output_alias" in compiled  # the donated cache is the new cache's buffer


# --------------------------------------------------------------------------
# The framework Stacks (attach per_leaf=True).


@pytest.mark.parametrize("framework", [f for f in FRAMEWORKS if f != "equinox"])
def test_framework_stacks_take_rows(framework):
    fw = FRAMEWORKS[framework](stackwise.DEFAULT_REMAT)
    each = _each(fw.base, 2)
    batch = stackwise.lora.stack_adapters(each)
    rows = [1, -1, 0]
    x = _normal(3, (3, 6))
    y = fw.run_stack(stackwise.lora.attach(fw.base, batch, per_leaf=True, rows=rows), x)
    for i, r in enumerate(rows):
        alone = fw.base if r < 0 else stackwise.lora.attach(fw.base, each[r], per_leaf=True)
        assert_trees_close(y[i], fw.run_stack(alone, x[i:i + 1])[0])
    assert float(np.abs(y[0] - y[2]).max()) > 0.01


@pytest.mark.slow  # (the fallback, every case merged per row: ~8 s)
def test_with_the_evaluation_ties_broken_each_row_merges_its_weight(monkeypatch):
    """Where the jaxpr evaluation's ties to JAX no longer hold, rows take the exact path:
    vmap over the rows, each row's weight built; the same values, decoding with a cache."""
    monkeypatch.setattr(jax_ties, "holds", lambda tie: tie not in (
        jax_ties.EVAL_LOOP, jax_ties.UPDATE_SLICE))
    base = _base("int8")
    each = _each(base, 3)
    _assert_rows_are_each_alone(stackwise.lora.stack(mlp, N), base, each, ROWS, X)
    layers = stackwise.lora.stack(attend, N, with_state=True)
    x = _normal(2, (len(ROWS), 1, D))
    y, cache = x, jnp.zeros((N, len(ROWS), S, D))
    params = stackwise.lora.attach(base, stackwise.lora.stack_adapters(each), rows=ROWS)
    for pos in range(2):
        y, cache = layers.decode(params, cache, y, pos)
    for i, r in enumerate(ROWS):
        want_y, want_cache = _decode_alone(layers, _alone(base, each, r), x[i:i + 1], 2)
        assert_trees_close((y[i], cache[:, i]), (want_y[0], want_cache[:, 0]))
